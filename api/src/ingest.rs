//! `POST /api/v1/ingest` with `Content-Type: application/json`: the body a script, a shell or
//! another language writes when it does not speak Arrow IPC (what the SDK's agent sends).
//! Unknown fields are refused rather than ignored, so a misspelt `metirc` is an error that
//! names it instead of a sample that silently lacks its metric. Times left out are the
//! collector's receive time.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::{ModelLayout, Num, SketchKind};

/// One ingest request: a run and at least one of its info, samples and sketches.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct IngestBody {
    #[cfg_attr(feature = "openapi", schemars(with = "crate::openapi::RunId"))]
    pub run: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub info: Option<IngestInfo>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub samples: Vec<IngestSample>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sketches: Vec<IngestSketch>,
}

/// The run's metadata, sent once (again after a restart of the job).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct IngestInfo {
    /// Number of ranks; at least 1.
    #[cfg_attr(feature = "openapi", schemars(range(min = 1)))]
    pub world_size: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at_ms: Option<i64>,
    #[serde(default, skip_serializing_if = "ModelLayout::is_empty")]
    pub layout: ModelLayout,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub tags: BTreeMap<String, String>,
}

/// One value of one metric at one step; `rank` null for a value of every rank.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct IngestSample {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rank: Option<u32>,
    pub step: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time_ms: Option<i64>,
    #[cfg_attr(feature = "openapi", schemars(with = "crate::openapi::MetricName"))]
    pub metric: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer: Option<u32>,
    /// A site's wire name; checked against the metric by the collector.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schemars(with = "Option<crate::Site>"))]
    pub site: Option<String>,
    pub value: Num,
}

/// One rank's gradient sketch at one step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct IngestSketch {
    pub rank: u32,
    pub step: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time_ms: Option<i64>,
    pub kind: SketchKind,
    pub seed: u32,
    /// ‖g_k‖, exact.
    pub norm: Num,
    pub vector: Vec<f32>,
}
