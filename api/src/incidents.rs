//! Incidents (alerts grouped by cause), their acknowledgement, and silences:
//! `GET /api/v1/incidents`, `POST|DELETE /api/v1/incidents/{id}/ack`,
//! `GET|POST /api/v1/silences`, `DELETE /api/v1/silences/{id}`.

use serde::{Deserialize, Serialize};

use crate::alerts::Alert;
use crate::vocab::{AlertState, Rule, Severity};

/// Alerts that share a cause: the same moment of a run, the cause first.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
pub struct Incident {
    /// `incident:` and the id of its first alert (the cause); stays put as symptoms join.
    pub id: String,
    pub run: String,
    /// The worst severity among its alerts.
    pub severity: Severity,
    /// Firing while any of its alerts fires, else pending while one is, else resolved.
    pub state: AlertState,
    /// The rules involved, the cause's first.
    pub rules: Vec<Rule>,
    /// Ranks its alerts are about or name.
    pub ranks: Vec<u32>,
    /// A per-rank rule fired on every rank of the world: no rank stands out.
    pub every_rank: bool,
    pub layers: Vec<u32>,
    #[cfg_attr(feature = "openapi", schemars(with = "Vec<crate::Site>"))]
    pub sites: Vec<String>,
    pub first_step: u64,
    pub last_step: u64,
    pub started_at_ms: i64,
    pub fired_at_ms: Option<i64>,
    /// When its last alert resolved, once all have.
    pub resolved_at_ms: Option<i64>,
    /// One line: the cause, where, and what followed.
    pub summary: String,
    /// What to do about it, first step first: where to look and what usually fixes it.
    #[serde(default)]
    pub action: String,
    /// Set while every alert of the incident is acknowledged (a new alert joining clears it).
    pub acknowledged: Option<Acknowledgement>,
    /// Ids of the silences muting any of its alerts now.
    pub silenced_by: Vec<String>,
    /// Its alerts, the cause first.
    pub alerts: Vec<Alert>,
}

/// `GET /api/v1/incidents`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
pub struct Incidents {
    pub incidents: Vec<Incident>,
}

/// Who acknowledged, when, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
pub struct Acknowledgement {
    pub by: String,
    pub at_ms: i64,
    #[serde(default)]
    pub comment: String,
}

/// `POST /api/v1/incidents/{id}/ack`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct AckRequest {
    /// Who takes it (a name or handle; 1–100 characters).
    pub by: String,
    #[serde(default)]
    pub comment: String,
}

/// Which alerts a silence mutes: every field given must match (an absent one matches all).
/// At least one must be given.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct Matchers {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rule: Option<Rule>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schemars(with = "Option<crate::Site>"))]
    pub site: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rank: Option<u32>,
}

/// `POST /api/v1/silences`: mutes matching alerts' notifications for a while. Muted alerts are
/// still detected, stored and shown; receivers (webhook, Slack, Alertmanager) are not told of
/// them firing until the silence ends. Resolutions always go through.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct NewSilence {
    pub matchers: Matchers,
    /// How long, in seconds from now (1 s to 90 days).
    pub duration_s: u64,
    pub created_by: String,
    #[serde(default)]
    pub comment: String,
}

/// A silence, active or ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
pub struct Silence {
    pub id: String,
    pub matchers: Matchers,
    pub starts_at_ms: i64,
    /// When it ends (or ended: expired, or deleted early).
    pub ends_at_ms: i64,
    pub created_by: String,
    pub comment: String,
    /// Whether it mutes now.
    pub active: bool,
}

/// `GET /api/v1/silences`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
pub struct Silences {
    pub silences: Vec<Silence>,
}
