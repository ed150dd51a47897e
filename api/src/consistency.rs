//! `GET /api/v1/runs/{run}/consistency`: a run's worker-level consistency — loss dispersion,
//! gradient-norm dispersion and the inter-worker cosine, each dispersion beside what independent
//! shards would give (`rankwatch_analytics::consistency` computes it).

use serde::{Deserialize, Serialize};

use crate::num::Num;

/// The report over the run's steps (or `from`–`to`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
pub struct ConsistencyReport {
    pub run: String,
    pub world_size: Option<u32>,
    /// The first and last step assessed (null without per-rank data).
    pub from_step: Option<u64>,
    pub to_step: Option<u64>,
    /// Steps with two or more ranks' values.
    pub steps: u64,
    /// Cross-rank loss dispersion; null with too few steps.
    pub loss: Option<DispersionIndicator>,
    /// Cross-rank dispersion of the local (pre-averaging) gradient norms; null with too few.
    pub grad_norm: Option<DispersionIndicator>,
    /// Median of C_w, the norm-weighted mean inter-worker cosine (1: identical gradients).
    pub cos_weighted_median: Option<Num>,
    pub verdict: ConsistencyVerdict,
    /// The verdict in words: what it means and what usually causes it.
    pub reading: String,
    /// Each rank's typical value relative to the other ranks' median.
    pub ranks: Vec<RankStanding>,
}

/// One dispersion, observed and as independent shards would give it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
pub struct DispersionIndicator {
    /// Median over steps of the cross-rank coefficient of variation (sample std / mean).
    pub observed_cv: f64,
    /// What independent batches of the same data give: each rank's own step-to-step noise,
    /// scaled to a K-rank sample.
    pub expected_cv: f64,
    /// observed / expected: ≈ 1 for independent shards, ≪ 1 for shared batches, ≫ 1 for ranks
    /// that differ by more than their batches.
    pub ratio: Num,
}

/// How the run reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum ConsistencyVerdict {
    /// Every ratio below 0.25.
    SameBatches,
    /// Every ratio within 0.5–2.
    IndependentShards,
    /// Some ratio above 2.
    MoreDispersed,
    /// Neither: some ratio within 0.25–0.5.
    Between,
    TooFewSteps,
}

/// One rank's typical loss and gradient norm over the other ranks' median (1: like them).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
pub struct RankStanding {
    pub rank: u32,
    pub loss_vs_others: Option<f64>,
    pub grad_norm_vs_others: Option<f64>,
}
