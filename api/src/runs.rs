//! What the collector knows about runs: `GET /runs` and `GET /runs/{run}/catalog`.

use serde::{Deserialize, Serialize};

use crate::ops::Tags;

/// `GET /api/v1/runs`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
pub struct Runs {
    pub runs: Vec<RunSummary>,
}

/// One run. The metadata fields are null until the run announced itself.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
pub struct RunSummary {
    pub run: String,
    pub world_size: Option<u32>,
    /// The model family the agent recognised (`gpt2`, `llama`, ...).
    pub family: Option<String>,
    pub layers: Option<u32>,
    pub started_at_ms: Option<i64>,
    pub tags: Option<Tags>,
    /// The rankwatch release of the run's agent (its `rankwatch.version` tag).
    pub agent_version: Option<String>,
    pub first_step: Option<u64>,
    pub last_step: Option<u64>,
    /// When any rank last reported (ms since the epoch).
    pub last_seen_ms: Option<i64>,
    pub samples: u64,
    pub nonfinite: u64,
    pub sketches: u64,
    pub series: u64,
    /// Parquet bytes on disk.
    pub bytes: u64,
    pub alerts_firing: u64,
}

/// `GET /api/v1/runs/{run}/catalog`: the metrics a run has, and where.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
pub struct Catalog {
    pub run: String,
    pub metrics: Vec<CatalogMetric>,
}

impl Catalog {
    /// The entry of `metric`, if the run has it.
    pub fn get(&self, metric: &str) -> Option<&CatalogMetric> {
        self.metrics.iter().find(|m| m.metric == metric)
    }
}

/// One metric of a [`Catalog`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
pub struct CatalogMetric {
    pub metric: String,
    /// Null for a user's own metric.
    pub scope: Option<MetricScope>,
    /// Whether the user logged it (not one of rankwatch's metrics).
    pub user: bool,
    pub layers: Vec<u32>,
    #[cfg_attr(feature = "openapi", schemars(with = "Vec<crate::Site>"))]
    pub sites: Vec<String>,
    pub ranks: Vec<u32>,
    /// How many series (layer × site × rank) it has.
    pub series: u64,
}

/// What one value of a metric describes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum MetricScope {
    /// One value per rank per step.
    Rank,
    /// One value per layer (and site).
    Layer,
    /// Derived across all ranks by the collector.
    AllRanks,
}
