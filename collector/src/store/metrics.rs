//! The store's own counters: flushes, compactions, deletions, sizes, and what downsampled
//! reads took from raw rows and from rollups. The store updates
//! them where the work happens; [`crate::telemetry`] exports them.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::instrument::seconds_histogram;

/// What the store counts.
#[derive(Debug)]
pub struct StoreMetrics {
    pub flushes: Counter,
    pub flush_errors: Counter,
    pub runs_deleted: Counter,
    pub flushed_rows: Counter,
    pub flush_seconds: Histogram,
    pub compactions: Counter,
    pub compacted_files: Counter,
    pub compaction_seconds: Histogram,
    pub parquet_files: Gauge,
    pub parquet_bytes: Gauge,
    pub hot_bytes: Gauge,
    /// Waits for room in a full hot buffer, for a flush to take it (see
    /// [`super::Store::room_until`]), and how long each took.
    pub room_waits: Counter,
    pub room_wait_seconds: Histogram,
    pub idempotency_sessions: Gauge,
    /// Files a failed flush or compaction wrote that wait to be deleted (see `unlisted`).
    pub unlisted_files: Gauge,
    /// Rows the series and heatmap reads took from raw samples and from rollups.
    pub downsampled_raw_rows: Counter,
    pub downsampled_rollup_rows: Counter,
    /// Parts those reads read directly (`query::parts`), and the part indexes built for it.
    pub point_read_parts: Counter,
    pub part_index_builds: Counter,
    /// Point reads answered from rows decoded by an earlier read (`--read-cache-bytes`).
    pub read_cache_hits: Counter,
}

impl Default for StoreMetrics {
    fn default() -> Self {
        StoreMetrics {
            flushes: Counter::default(),
            flush_errors: Counter::default(),
            runs_deleted: Counter::default(),
            flushed_rows: Counter::default(),
            flush_seconds: seconds_histogram(),
            compactions: Counter::default(),
            compacted_files: Counter::default(),
            compaction_seconds: seconds_histogram(),
            parquet_files: Gauge::default(),
            parquet_bytes: Gauge::default(),
            hot_bytes: Gauge::default(),
            room_waits: Counter::default(),
            room_wait_seconds: seconds_histogram(),
            idempotency_sessions: Gauge::default(),
            unlisted_files: Gauge::default(),
            downsampled_raw_rows: Counter::default(),
            downsampled_rollup_rows: Counter::default(),
            point_read_parts: Counter::default(),
            part_index_builds: Counter::default(),
            read_cache_hits: Counter::default(),
        }
    }
}

impl StoreMetrics {
    /// Adds these metrics to a registry, with their names and help texts.
    pub fn register(&self, r: &mut Registry) {
        r.register(
            "flushes",
            "Flushes of the hot buffer to Parquet",
            self.flushes.clone(),
        );
        r.register(
            "flush_errors",
            "Flushes that failed and will be retried",
            self.flush_errors.clone(),
        );
        r.register(
            "runs_deleted",
            "Runs deleted, by hand (DELETE /api/v1/runs/{run}) or by retention",
            self.runs_deleted.clone(),
        );
        r.register(
            "flushed_rows",
            "Rows written to Parquet by flushes",
            self.flushed_rows.clone(),
        );
        r.register(
            "flush_seconds",
            "Duration of one flush",
            self.flush_seconds.clone(),
        );
        r.register(
            "compactions",
            "Compactions that merged small Parquet files",
            self.compactions.clone(),
        );
        r.register(
            "compacted_files",
            "Parquet files merged away by compaction",
            self.compacted_files.clone(),
        );
        r.register(
            "compaction_seconds",
            "Duration of one compaction",
            self.compaction_seconds.clone(),
        );
        r.register(
            "parquet_files",
            "Parquet files in the manifest",
            self.parquet_files.clone(),
        );
        r.register(
            "parquet_bytes",
            "Bytes of Parquet files in the manifest",
            self.parquet_bytes.clone(),
        );
        r.register(
            "hot_buffer_bytes",
            "Bytes of Arrow data in the hot buffer",
            self.hot_bytes.clone(),
        );
        r.register(
            "hot_buffer_room_waits",
            "Waits for room in a hot buffer at twice its budget, for the flush that takes it: an ingest batch's (before its body is read and again before its commit, within one --queue-wait) and the alert engine's before it retries a derived batch",
            self.room_waits.clone(),
        );
        r.register(
            "hot_buffer_room_wait_seconds",
            "How long each wait for room in the hot buffer took (an ingest batch for which none came within --queue-wait is refused with 429)",
            self.room_wait_seconds.clone(),
        );
        r.register(
            "idempotency_sessions",
            "Agent sessions whose applied idempotency keys are kept (bounded by the runs kept)",
            self.idempotency_sessions.clone(),
        );
        r.register(
            "unlisted_files",
            "Files a failed flush or compaction wrote that no manifest lists, waiting to be deleted",
            self.unlisted_files.clone(),
        );
        r.register(
            "downsampled_raw_rows",
            "Raw sample rows read by series and heatmap queries",
            self.downsampled_raw_rows.clone(),
        );
        r.register(
            "downsampled_rollup_rows",
            "Rollup rows (one per series and window of 2^k steps) read by series and heatmap queries",
            self.downsampled_rollup_rows.clone(),
        );
        r.register(
            "point_read_parts",
            "Local parts series and heatmap queries read through their cached series index, without a DataFusion plan",
            self.point_read_parts.clone(),
        );
        r.register(
            "part_index_builds",
            "Series indexes built for point reads (one per part read, unless evicted from the cache)",
            self.part_index_builds.clone(),
        );
        r.register(
            "read_cache_hits",
            "Point reads of a part answered from the rows an earlier read decoded, without decoding them again",
            self.read_cache_hits.clone(),
        );
    }
}
