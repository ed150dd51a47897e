//! Downsampled reads: `GET /runs/{run}/series` and `GET /runs/{run}/heatmap`. Steps
//! `from..=to` are cut into `count` buckets of `width` steps; each bucket keeps its min, max,
//! last value and counts, so a spike inside a bucket is never averaged away.
//!
//! The grid is aligned, as VictoriaMetrics aligns a range query's start to its step and as map
//! tiles are: `width` is a power of two and bucket boundaries are multiples of it, so the first
//! and last buckets may be cut short by `from` and `to`. The same bucket then covers the same
//! steps however the range is chosen or the run grows, and the collector answers a wide range
//! from summaries it wrote per 2^k steps instead of from raw rows. [`BucketRange`] holds the
//! arithmetic, shared by the collector and the dashboard.

use serde::{Deserialize, Serialize};

use crate::num::Num;

/// The step buckets of a downsampled answer: bucket `i` covers the steps of the
/// `from / width + i`-th multiple-of-`width` window, clipped to `from..=to`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
pub struct BucketRange {
    pub from: u64,
    pub to: u64,
    /// A power of two.
    pub width: u64,
    pub count: u64,
}

impl BucketRange {
    /// The aligned grid over `from..=to` (`from <= to`) with at most `points` buckets: the
    /// narrowest power-of-two width that needs no more.
    pub fn new(from: u64, to: u64, points: u64) -> BucketRange {
        let to = to.max(from);
        let points = points.max(1);
        // u128: the span of 0..=u64::MAX does not fit in a u64.
        let span = u128::from(to - from) + 1;
        // At most 2^63 wide: a range across 2^63 then has two buckets whatever `points` is.
        let mut shift = span
            .div_ceil(u128::from(points))
            .next_power_of_two()
            .trailing_zeros()
            .min(63);
        // Alignment can add a bucket (a cut first one); widen once more when it does.
        while shift < 63 && u128::from((to >> shift) - (from >> shift)) + 1 > u128::from(points) {
            shift += 1;
        }
        BucketRange {
            from,
            to,
            width: 1 << shift,
            count: (to >> shift) - (from >> shift) + 1,
        }
    }

    /// log2 of `width`.
    pub fn shift(&self) -> u32 {
        self.width.max(1).trailing_zeros()
    }

    /// The bucket of `step`, if it is in range.
    pub fn index(&self, step: u64) -> Option<usize> {
        (step >= self.from && step <= self.to)
            .then(|| ((step >> self.shift()) - (self.from >> self.shift())) as usize)
    }

    /// First step of bucket `i`.
    pub fn start(&self, i: usize) -> u64 {
        let window = (self.from >> self.shift()).saturating_add(i as u64);
        window
            .checked_shl(self.shift())
            .filter(|s| s >> self.shift() == window)
            .map_or(self.to, |s| s.max(self.from))
    }

    /// Last step of bucket `i`.
    pub fn end(&self, i: usize) -> u64 {
        if i as u64 + 1 >= self.count {
            return self.to;
        }
        self.start(i + 1) - 1
    }
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
