//! `GET /runs/{run}/workers`: every rank's values at one step, side by side, and how alike
//! the ranks' gradients are (the sketch cosine matrix).

use serde::{Deserialize, Serialize};

use crate::num::Num;

/// `GET /api/v1/runs/{run}/workers[?step=S]`. Without `step`, the newest step every live rank
/// has reached; `step` is null when the run has no per-rank data yet.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
pub struct Workers {
    pub run: String,
    pub step: Option<u64>,
    pub world_size: Option<u32>,
    /// The ranks that reported at this step, ascending: the columns of every `values`.
    pub ranks: Vec<u32>,
    pub metrics: Vec<WorkerMetric>,
    /// Null when fewer than two ranks sent a sketch at this step.
    pub cosine: Option<Cosine>,
}

/// One per-rank metric at the step, a value per rank of [`Workers::ranks`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
pub struct WorkerMetric {
    pub metric: String,
    pub layer: Option<u32>,
    #[cfg_attr(feature = "openapi", schemars(with = "Option<crate::Site>"))]
    pub site: Option<String>,
    /// Null where that rank sent no value.
    pub values: Vec<Option<Num>>,
}

/// The rank × rank cosine of the gradient sketches, or why there is none.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[serde(untagged)]
pub enum Cosine {
    Matrix(CosineMatrix),
    /// The sketches do not compare (different kinds or seeds, or unusable norms).
    Error {
        error: String,
    },
}

/// The cosine matrix, ranks ascending.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
pub struct CosineMatrix {
    pub ranks: Vec<u32>,
    pub matrix: Vec<Vec<Num>>,
    /// The mean over distinct pairs; null for a single rank.
    pub pair_mean: Option<Num>,
}
