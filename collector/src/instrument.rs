//! What every component's own counters share: the label-set type and the duration buckets.
//! Each component keeps its counters where its work happens; [`crate::telemetry`] exports them.

/// A label set of fixed, low-cardinality metric labels (`reason`, `table`, `format`): each
/// component keeps its own counters under these, and [`crate::telemetry`] exports them.
pub type Labels = Vec<(&'static str, &'static str)>;

/// Buckets for durations of the collector's own work (group commits, flushes, compactions):
/// 0.5 ms to ~16 s.
pub fn seconds_histogram() -> prometheus_client::metrics::histogram::Histogram {
    use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
    Histogram::new(exponential_buckets(0.0005, 2.0, 16))
}
