//! Bodies of ingest's answer, the operations endpoints (health, SQL, rules, probe switch,
//! deletion, retention).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// What ingest answers to an accepted batch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
pub struct Ack {
    pub status: AckStatus,
    pub run: String,
    pub rows: u64,
    pub nonfinite: u64,
    /// Write-ahead-log sequence number (absent for duplicates).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq: Option<u64>,
}

/// Whether an acknowledged batch was stored now or had been already.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum AckStatus {
    Stored,
    /// Its idempotency key was applied before; nothing was stored twice.
    Duplicate,
}

/// `GET /healthz` and `GET /readyz`: `ok`, `ready`, `not ready` or `failing`, with the reason
/// when not ok.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
pub struct Health {
    #[cfg_attr(
        feature = "openapi",
        schemars(extend("enum" = ["ok", "ready", "not ready", "failing"]))
    )]
    pub status: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The collector's release (`rankwatch --version`).
    #[serde(default)]
    pub version: String,
    /// The ingest wire protocol it speaks (see `PROTOCOL_HEADER`).
    #[serde(default)]
    pub wire_protocol: u32,
}

/// `POST /api/v1/sql` with `application/json` (plain text is the SQL itself).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct SqlRequest {
    pub sql: String,
}

/// The answer to a SQL query: rows as objects keyed by column, non-finite floats as
/// [`crate::Num`] writes them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
pub struct SqlAnswer {
    pub columns: Vec<String>,
    pub rows: Vec<serde_json::Map<String, serde_json::Value>>,
    /// Whether the row limit cut the answer short.
    pub truncated: bool,
}

/// `GET /api/v1/rules[?run=R]`, and the answer to setting or clearing a run's override. The
/// rules themselves are the analytics crate's configuration, passed through as JSON.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
pub struct RulesAnswer {
    /// Present when the answer is about one run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run: Option<String>,
    /// Every rule's settings, by rule name.
    pub rules: serde_json::Value,
    /// The run's own override, null when it has none (absent for the base rules).
    #[serde(
        default,
        rename = "override",
        skip_serializing_if = "Override::is_absent"
    )]
    pub overrides: Override,
}

/// A run's rule override in a [`RulesAnswer`]: absent (the base rules were asked for), null
/// (the run has none) or the override.
#[derive(Debug, Clone, Default, PartialEq)]
pub enum Override {
    #[default]
    Absent,
    None,
    Set(serde_json::Value),
}

impl Override {
    fn is_absent(&self) -> bool {
        matches!(self, Override::Absent)
    }
}

impl Serialize for Override {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Override::Absent | Override::None => s.serialize_none(),
            Override::Set(v) => v.serialize(s),
        }
    }
}

impl<'de> Deserialize<'de> for Override {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(match Option::<serde_json::Value>::deserialize(d)? {
            None | Some(serde_json::Value::Null) => Override::None,
            Some(v) => Override::Set(v),
        })
    }
}

/// A run's probe switch (`GET`/`PUT /api/v1/runs/{run}/probes`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
pub struct ProbeSwitch {
    pub run: String,
    /// Whether an operator wants its probes on; null when nobody set it.
    pub on: Option<bool>,
    /// Bumped by every change; 0 when nobody set it.
    pub revision: u64,
    pub changed_ms: Option<i64>,
}

/// The body of `PUT /api/v1/runs/{run}/probes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct SetProbes {
    pub on: bool,
}

/// What `DELETE /api/v1/runs/{run}` removed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
pub struct Deleted {
    pub run: String,
    /// Parquet files (samples, sketches, run metadata, alerts).
    pub files: u64,
    pub bytes: u64,
    /// Sample rows, in files and in the hot buffer.
    pub rows: u64,
    pub alerts: u64,
}

/// The body of `POST /api/v1/retention`. With neither limit, the collector's own policy
/// applies.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct RetentionRequest {
    /// Delete runs silent longer than this: `30d`, `12h`, `90m`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_age: Option<String>,
    /// Keep the Parquet total under this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_bytes: Option<ByteSize>,
    #[serde(default)]
    pub dry_run: bool,
}

/// A size: a number of bytes, or text such as `50GB` / `200GiB` (the collector parses it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[serde(untagged)]
pub enum ByteSize {
    Bytes(u64),
    Text(String),
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct SizeVisitor;
        impl serde::de::Visitor<'_> for SizeVisitor {
            type Value = ByteSize;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(r#"a non-negative number of bytes or a size like "50GB""#)
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<ByteSize, E> {
                Ok(ByteSize::Bytes(v))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<ByteSize, E> {
                Ok(ByteSize::Text(v.to_owned()))
            }
        }
        d.deserialize_any(SizeVisitor)
    }
}

/// What a retention pass did (or, dry, would do).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
pub struct RetentionReport {
    pub dry_run: bool,
    /// The runs deleted, in the order they went.
    pub deleted: Vec<Doomed>,
    /// Parquet bytes left after the pass.
    pub bytes_left: u64,
    /// Set when the size cap is still exceeded (only protected, recently active runs remain).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub over_cap: Option<String>,
}

/// One run a retention pass deletes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
pub struct Doomed {
    pub run: String,
    pub reason: RetentionReason,
    pub bytes: u64,
    pub last_seen_ms: i64,
}

/// Which limit a run broke.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum RetentionReason {
    Age,
    Size,
}

/// Run tags: free-form labels the run was started with.
pub type Tags = BTreeMap<String, String>;
