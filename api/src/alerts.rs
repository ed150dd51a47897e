//! Alerts as the API shows them: `GET /alerts`, a run's alert feed, and the `alert` event.

use serde::{Deserialize, Serialize};

use crate::vocab::{AlertState, Rule, Severity};

/// One alert.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
pub struct Alert {
    /// Stable across restarts: derived from what the alert is about and its first step.
    pub id: String,
    pub run: String,
    pub rule: Rule,
    pub severity: Severity,
    pub state: AlertState,
    pub layer: Option<u32>,
    #[cfg_attr(feature = "openapi", schemars(with = "Option<crate::Site>"))]
    pub site: Option<String>,
    /// The rank it is about, for per-rank rules (`stale_rank`, per-rank `nonfinite`).
    pub rank: Option<u32>,
    /// Ranks named as outliers (silent inconsistency), most deviant first.
    pub outlier_ranks: Vec<u32>,
    /// The observed value that breached; null when not finite.
    pub value: Option<f64>,
    /// The threshold it breached; null when not finite.
    pub threshold: Option<f64>,
    /// First and latest step of the breach.
    pub first_step: u64,
    pub last_step: u64,
    pub started_at_ms: i64,
    pub updated_at_ms: i64,
    /// When it reached `firing`; null for one that never did.
    pub fired_at_ms: Option<i64>,
    pub resolved_at_ms: Option<i64>,
    /// One line a person can act on.
    pub explanation: String,
}

impl Alert {
    /// Whether it ever reached `firing` (a pending alert that cleared never did).
    pub fn has_fired(&self) -> bool {
        self.fired_at_ms.is_some()
    }
}

/// `GET /api/v1/alerts`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
pub struct Alerts {
    pub alerts: Vec<Alert>,
}

/// `GET /api/v1/runs/{run}/alerts/feed?after=R`: one run's alert changes after revision `R`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
pub struct AlertFeed {
    /// Changes when the collector restarts; revisions then start again from zero.
    pub epoch: i64,
    /// The cursor for the next call.
    pub revision: u64,
    pub alerts: Vec<Alert>,
}
