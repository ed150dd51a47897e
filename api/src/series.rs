//! Downsampled reads: `GET /runs/{run}/series` and `GET /runs/{run}/heatmap`. Steps
//! `from..=to` are cut into `count` buckets of `width` steps; each bucket keeps its min, max,
//! last value and counts, so a spike inside a bucket is never averaged away.

use serde::{Deserialize, Serialize};

use crate::num::Num;

/// The step buckets of a downsampled answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
pub struct BucketRange {
    pub from: u64,
    pub to: u64,
    pub width: u64,
    pub count: u64,
}

/// One non-empty bucket of a series.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
pub struct Bucket {
    pub start: u64,
    pub end: u64,
    /// Values in the bucket, non-finite ones included.
    pub count: u64,
    pub nonfinite: u64,
    /// Over the finite values; null when there are none.
    pub min: Option<Num>,
    pub max: Option<Num>,
    /// The value at the bucket's last step (the mean when several ranks share it).
    pub last: Option<Num>,
    pub last_step: u64,
}

/// One series (layer × site × rank) of a metric.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
pub struct Series {
    pub layer: Option<u32>,
    #[cfg_attr(feature = "openapi", schemars(with = "Option<crate::Site>"))]
    pub site: Option<String>,
    pub rank: Option<u32>,
    pub buckets: Vec<Bucket>,
}

/// `GET /api/v1/runs/{run}/series`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
pub struct SeriesAnswer {
    pub run: String,
    pub metric: String,
    pub buckets: BucketRange,
    pub series: Vec<Series>,
}

/// `GET /api/v1/runs/{run}/heatmap`: a layer × bucket grid of one metric (and site). Each
/// grid is indexed `[layer][bucket]`, layers in the order of `layers`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
pub struct Heatmap {
    pub run: String,
    pub metric: String,
    #[cfg_attr(feature = "openapi", schemars(with = "Option<crate::Site>"))]
    pub site: Option<String>,
    pub buckets: BucketRange,
    /// The first step of each bucket.
    pub steps: Vec<u64>,
    pub layers: Vec<u32>,
    pub last: Vec<Vec<Option<Num>>>,
    pub min: Vec<Vec<Option<Num>>>,
    pub max: Vec<Vec<Option<Num>>>,
    pub count: Vec<Vec<u64>>,
    pub nonfinite: Vec<Vec<u64>>,
}
