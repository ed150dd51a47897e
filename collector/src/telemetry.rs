//! The collector's own metrics, served at `/metrics` in the Prometheus text format.
//!
//! `prometheus-client` rather than `metrics`: it keeps metrics in an explicit `Registry`
//! instead of a process-global recorder, so several collectors can live in one test process,
//! and its `Collector` trait lets the per-run gauges be computed from the run index at scrape
//! time, so a run that goes quiet simply stops being exported (no stale label sets to expire).
//!
//! Per-run gauges carry one label, `run`, and only for *active* runs (seen within the active
//! window, at most `max_active_runs`, most recent first): no per-layer or per-rank labels.

use std::fmt::Write as _;
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use rankwatch_analytics::math::dispersion::Dispersion;

use crate::store::Store;
use crate::wal::WalObserver;

/// A label set of fixed, low-cardinality labels (`reason`, `table`, `format`).
pub type Labels = Vec<(&'static str, &'static str)>;

/// Every metric the collector maintains itself.
#[derive(Debug)]
pub struct Telemetry {
    pub ingest_rows: Family<Labels, Counter>,
    pub ingest_bytes: Counter,
    pub ingest_batches: Family<Labels, Counter>,
    pub ingest_nonfinite: Counter,
    pub ingest_duplicates: Counter,
    pub rejects: Family<Labels, Counter>,
    pub wal_fsync_seconds: Histogram,
    pub wal_group_records: Histogram,
    pub wal_bytes: Gauge,
    pub wal_segments: Gauge,
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
    pub sse_clients: Gauge,
    pub alert_transitions: Family<Labels, Counter>,
    pub alert_notifications: Family<Labels, Counter>,
    pub aligner_steps: Family<Labels, Counter>,
    pub aligner_late_rows: Counter,
    pub derived_samples: Counter,
    pub alert_engine_errors: Counter,
}

impl Default for Telemetry {
    fn default() -> Self {
        let seconds = || Histogram::new(exponential_buckets(0.0005, 2.0, 16));
        Telemetry {
            ingest_rows: Family::default(),
            ingest_bytes: Counter::default(),
            ingest_batches: Family::default(),
            ingest_nonfinite: Counter::default(),
            ingest_duplicates: Counter::default(),
            rejects: Family::default(),
            wal_fsync_seconds: seconds(),
            wal_group_records: Histogram::new(exponential_buckets(1.0, 2.0, 12)),
            wal_bytes: Gauge::default(),
            wal_segments: Gauge::default(),
            flushes: Counter::default(),
            flush_errors: Counter::default(),
            runs_deleted: Counter::default(),
            flushed_rows: Counter::default(),
            flush_seconds: seconds(),
            compactions: Counter::default(),
            compacted_files: Counter::default(),
            compaction_seconds: seconds(),
            parquet_files: Gauge::default(),
            parquet_bytes: Gauge::default(),
            hot_bytes: Gauge::default(),
            sse_clients: Gauge::default(),
            alert_transitions: Family::default(),
            alert_notifications: Family::default(),
            aligner_steps: Family::default(),
            aligner_late_rows: Counter::default(),
            derived_samples: Counter::default(),
            alert_engine_errors: Counter::default(),
        }
    }
}

impl Telemetry {
    /// Counts a refused request under its reason label.
    pub fn reject(&self, error: &crate::error::Error) {
        self.rejects
            .get_or_create(&vec![("reason", error.reason())])
            .inc();
    }
}

impl Telemetry {
    /// Counts one delivery outcome of an alert sink.
    pub fn notification(&self, sink: crate::alerting::sinks::SinkKind, outcome: &'static str) {
        self.alert_notifications
            .get_or_create(&vec![("sink", sink.as_str()), ("outcome", outcome)])
            .inc();
    }
}

impl WalObserver for Telemetry {
    fn fsynced(&self, records: usize, _bytes: usize, seconds: f64) {
        self.wal_fsync_seconds.observe(seconds);
        self.wal_group_records.observe(records as f64);
    }

    fn size(&self, segments: usize, bytes: u64) {
        self.wal_segments.set(segments as i64);
        self.wal_bytes.set(bytes as i64);
    }
}

/// The `/metrics` registry: the [`Telemetry`] metrics plus the per-run gauges.
#[derive(Debug)]
pub struct Exporter {
    registry: Registry,
}

impl Exporter {
    /// Registers everything; `store` is filled in once the store is open.
    pub fn new(
        t: &Telemetry,
        store: Arc<OnceLock<Weak<Store>>>,
        window: Duration,
        max_runs: usize,
    ) -> Self {
        let mut r = Registry::with_prefix("rankwatch");
        r.register(
            "ingest_rows",
            "Rows accepted, by table",
            t.ingest_rows.clone(),
        );
        r.register(
            "ingest_bytes",
            "Request body bytes accepted",
            t.ingest_bytes.clone(),
        );
        r.register(
            "ingest_batches",
            "Batches accepted, by body format",
            t.ingest_batches.clone(),
        );
        r.register(
            "ingest_nonfinite_values",
            "NaN or infinite sample values accepted (stored, not dropped)",
            t.ingest_nonfinite.clone(),
        );
        r.register(
            "ingest_duplicates",
            "Batches acknowledged again for an idempotency key already applied",
            t.ingest_duplicates.clone(),
        );
        r.register(
            "ingest_rejects",
            "Requests refused, by reason",
            t.rejects.clone(),
        );
        r.register(
            "wal_fsync_seconds",
            "Duration of one write-ahead-log group commit (write and fsync)",
            t.wal_fsync_seconds.clone(),
        );
        r.register(
            "wal_group_records",
            "Batches per write-ahead-log group commit",
            t.wal_group_records.clone(),
        );
        r.register(
            "wal_bytes",
            "Bytes in write-ahead-log segments",
            t.wal_bytes.clone(),
        );
        r.register(
            "wal_segments",
            "Write-ahead-log segment files",
            t.wal_segments.clone(),
        );
        r.register(
            "flushes",
            "Flushes of the hot buffer to Parquet",
            t.flushes.clone(),
        );
        r.register(
            "flush_errors",
            "Flushes that failed and will be retried",
            t.flush_errors.clone(),
        );
        r.register(
            "runs_deleted",
            "Runs deleted, by hand (DELETE /api/v1/runs/{run}) or by retention",
            t.runs_deleted.clone(),
        );
        r.register(
            "flushed_rows",
            "Rows written to Parquet by flushes",
            t.flushed_rows.clone(),
        );
        r.register(
            "flush_seconds",
            "Duration of one flush",
            t.flush_seconds.clone(),
        );
        r.register(
            "compactions",
            "Compactions that merged small Parquet files",
            t.compactions.clone(),
        );
        r.register(
            "compacted_files",
            "Parquet files merged away by compaction",
            t.compacted_files.clone(),
        );
        r.register(
            "compaction_seconds",
            "Duration of one compaction",
            t.compaction_seconds.clone(),
        );
        r.register(
            "parquet_files",
            "Parquet files in the manifest",
            t.parquet_files.clone(),
        );
        r.register(
            "parquet_bytes",
            "Bytes of Parquet files in the manifest",
            t.parquet_bytes.clone(),
        );
        r.register(
            "hot_buffer_bytes",
            "Bytes of Arrow data in the hot buffer",
            t.hot_bytes.clone(),
        );
        r.register(
            "sse_clients",
            "Connected /api/v1/events subscribers",
            t.sse_clients.clone(),
        );
        r.register(
            "alert_transitions",
            "Alert state changes raised by the alert engine, by rule, state and severity",
            t.alert_transitions.clone(),
        );
        r.register(
            "alert_notifications",
            "Alert deliveries to webhooks, Slack and Alertmanager, by sink and outcome \
             (delivered, retried, failed, dropped)",
            t.alert_notifications.clone(),
        );
        r.register(
            "aligner_steps",
            "Steps the aligner closed, by how (complete: every rank moved on; timeout)",
            t.aligner_steps.clone(),
        );
        r.register(
            "aligner_late_rows",
            "Rows that arrived after their step had closed (stored, not in the step's statistics)",
            t.aligner_late_rows.clone(),
        );
        r.register(
            "derived_samples",
            "All-ranks samples the aligner computed and stored",
            t.derived_samples.clone(),
        );
        r.register(
            "alert_engine_errors",
            "Batches or derived writes the alert engine could not process (logged)",
            t.alert_engine_errors.clone(),
        );
        r.register_collector(Box::new(RunGauges {
            store,
            window,
            max_runs,
        }));
        Exporter { registry: r }
    }

    /// The text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            let _ = writeln!(out, "# encoding failed");
        }
        out
    }
}

/// Per-run gauges computed from the run index at scrape time.
#[derive(Debug)]
struct RunGauges {
    store: Arc<OnceLock<Weak<Store>>>,
    window: Duration,
    max_runs: usize,
}

struct RunRow {
    run: String,
    values: [Option<f64>; 9],
}

const RUN_GAUGES: [(&str, &str); 9] = [
    ("run_step", "Latest step of an active run"),
    ("run_loss", "Mean over ranks of each rank's latest loss"),
    (
        "run_loss_std",
        "Population standard deviation over ranks of each rank's latest loss",
    ),
    ("run_perplexity", "Latest perplexity"),
    (
        "run_spectral_ratio_min",
        "Minimum over layers of the latest spectral ratio",
    ),
    (
        "run_spectral_ratio_max",
        "Maximum over layers of the latest spectral ratio",
    ),
    (
        "run_loss_cv",
        "Latest loss coefficient of variation across ranks",
    ),
    (
        "run_grad_norm_cv",
        "Latest gradient-norm coefficient of variation across ranks",
    ),
    ("run_alerts_firing", "Alerts firing"),
];

impl RunGauges {
    fn rows(&self) -> Vec<RunRow> {
        let Some(store) = self.store.get().and_then(Weak::upgrade) else {
            return Vec::new();
        };
        let now = crate::now_ms();
        let window = self.window.as_millis() as i64;
        let alerts = store.alerts(None);
        let mut rows: Vec<(i64, RunRow)> = store.with_runs(|runs| {
            runs.iter()
                .filter(|(_, s)| s.last_seen_ms > 0 && now - s.last_seen_ms <= window)
                .map(|(run, s)| {
                    let losses: Vec<f64> =
                        s.loss_by_rank.values().flatten().map(|l| l.value).collect();
                    let dispersion = Dispersion::of(&losses);
                    let ratios = s
                        .ratio_by_layer
                        .values()
                        .flatten()
                        .map(|l| l.value)
                        .filter(|v| v.is_finite());
                    let (min, max) =
                        ratios.fold((None, None), |(lo, hi): (Option<f64>, Option<f64>), v| {
                            (
                                Some(lo.map_or(v, |l| l.min(v))),
                                Some(hi.map_or(v, |h| h.max(v))),
                            )
                        });
                    let firing = alerts
                        .iter()
                        .filter(|a| {
                            a.run == *run && a.state == rankwatch_analytics::AlertState::Firing
                        })
                        .count();
                    (
                        s.last_seen_ms,
                        RunRow {
                            run: run.to_string(),
                            values: [
                                s.last_step.map(|v| v as f64),
                                dispersion.as_ref().map(|d| d.mean),
                                dispersion.as_ref().map(|d| d.std),
                                s.perplexity.map(|l| l.value),
                                min,
                                max,
                                s.loss_cv.map(|l| l.value),
                                s.grad_norm_cv.map(|l| l.value),
                                Some(firing as f64),
                            ],
                        },
                    )
                })
                .collect()
        });
        rows.sort_by_key(|r| std::cmp::Reverse(r.0));
        rows.truncate(self.max_runs);
        rows.into_iter().map(|(_, r)| r).collect()
    }
}

impl Collector for RunGauges {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let rows = self.rows();
        for (i, (name, help)) in RUN_GAUGES.iter().enumerate() {
            let present: Vec<&RunRow> = rows.iter().filter(|r| r.values[i].is_some()).collect();
            if present.is_empty() {
                continue;
            }
            let mut family = encoder.encode_descriptor(
                name,
                help,
                None,
                prometheus_client::metrics::MetricType::Gauge,
            )?;
            for row in present {
                let labels = [("run", row.run.as_str())];
                let gauge = ConstGauge::new(row.values[i].unwrap_or(f64::NAN));
                gauge.encode(family.encode_family(&labels)?)?;
            }
        }
        Ok(())
    }
}
