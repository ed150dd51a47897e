//! The log's own counters: group commits, records per group, size, entries set aside.

use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// What the writer reports about its work, for `/metrics`.
pub trait WalObserver: Send + Sync {
    /// One fsync of `records` records and `bytes` bytes took `seconds`.
    fn fsynced(&self, records: usize, bytes: usize, seconds: f64);
    /// The log now holds `segments` files and `bytes` bytes.
    fn size(&self, segments: usize, bytes: u64);
}

/// The log's counters, fed as its observer; [`crate::telemetry`] exports them.
#[derive(Debug)]
pub struct WalMetrics {
    pub fsync_seconds: Histogram,
    pub group_records: Histogram,
    pub bytes: Gauge,
    pub segments: Gauge,
    /// Damaged ranges and undecodable entries set aside at start.
    pub set_aside: prometheus_client::metrics::counter::Counter,
}

impl Default for WalMetrics {
    fn default() -> Self {
        WalMetrics {
            fsync_seconds: crate::instrument::seconds_histogram(),
            group_records: Histogram::new(exponential_buckets(1.0, 2.0, 12)),
            bytes: Gauge::default(),
            segments: Gauge::default(),
            set_aside: Default::default(),
        }
    }
}

impl WalMetrics {
    /// Adds these metrics to a registry, with their names and help texts.
    pub fn register(&self, r: &mut Registry) {
        r.register(
            "wal_fsync_seconds",
            "Duration of one write-ahead-log group commit (write and fsync)",
            self.fsync_seconds.clone(),
        );
        r.register(
            "wal_group_records",
            "Batches per write-ahead-log group commit",
            self.group_records.clone(),
        );
        r.register(
            "wal_bytes",
            "Bytes in write-ahead-log segments",
            self.bytes.clone(),
        );
        r.register(
            "wal_segments",
            "Write-ahead-log segment files",
            self.segments.clone(),
        );
        r.register(
            "wal_set_aside",
            "Damaged write-ahead-log ranges and undecodable entries set aside in wal/damaged at start",
            self.set_aside.clone(),
        );
    }
}

impl WalObserver for WalMetrics {
    fn fsynced(&self, records: usize, _bytes: usize, seconds: f64) {
        self.fsync_seconds.observe(seconds);
        self.group_records.observe(records as f64);
    }

    fn size(&self, segments: usize, bytes: u64) {
        self.segments.set(segments as i64);
        self.bytes.set(bytes as i64);
    }
}
