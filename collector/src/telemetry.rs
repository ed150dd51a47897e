//! The collector's `/metrics`, in the Prometheus text format: it gathers, it does not count.
//!
//! Each component owns the counters of its own work and updates them where the work happens:
//! [`IngestMetrics`] (ingest), [`StoreMetrics`](crate::store::metrics::StoreMetrics) (flushes, compactions, sizes), [`WalMetrics`]
//! (group commits), [`EngineMetrics`] (the alert engine), [`SinkMetrics`] (alert deliveries),
//! and [`RequestMetrics`] here for what only the HTTP layer sees (refusals, SSE clients). The
//! [`Exporter`] registers them all in one registry and adds the per-run gauges. So this module
//! sits above every component it reads, and none of them imports it.
//!
//! `prometheus-client` rather than `metrics`: it keeps metrics in an explicit `Registry`
//! instead of a process-global recorder, so several collectors can live in one test process,
//! and its `Collector` trait lets the per-run gauges be computed from the run index at scrape
//! time, so a run that goes quiet simply stops being exported (no stale label sets to expire).
//!
//! Per-run gauges carry one label, `run`, and only for *active* runs (seen within the active
//! window, at most `max_active_runs`, most recent first): no per-layer or per-rank labels.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::registry::Registry;
use rankwatch_analytics::math::dispersion::Dispersion;

use crate::alerting::EngineMetrics;
use crate::alerting::sinks::SinkMetrics;
use crate::ingest::IngestMetrics;
use crate::instrument::Labels;
use crate::store::Store;
use crate::wal::WalMetrics;

/// What only the HTTP layer sees.
#[derive(Debug, Default)]
pub struct RequestMetrics {
    pub rejects: Family<Labels, Counter>,
    pub sse_clients: Gauge,
    /// Slots of the API's bounded resources in use.
    pub admission: AdmissionGauges,
}

impl RequestMetrics {
    /// Counts a refused request under its reason label.
    pub fn reject(&self, error: &crate::error::Error) {
        self.rejects
            .get_or_create(&vec![("reason", error.reason().as_str())])
            .inc();
    }

    fn register(&self, r: &mut Registry) {
        r.register(
            "ingest_rejects",
            "Requests refused, by reason",
            self.rejects.clone(),
        );
        r.register(
            "sse_clients",
            "Connected /api/v1/events subscribers",
            self.sse_clients.clone(),
        );
        let a = &self.admission;
        r.register(
            "inflight_requests",
            "Requests being handled (event streams aside)",
            a.requests.clone(),
        );
        r.register(
            "inflight_body_bytes",
            "Declared bytes of the ingest bodies being read, decoded and committed",
            a.body_bytes.clone(),
        );
        r.register(
            "running_exports",
            "Exports being written",
            a.exports.clone(),
        );
        r.register(
            "running_sql_queries",
            "/api/v1/sql queries running",
            a.sql.clone(),
        );
    }
}

/// Slots of the API's bounded resources in use (the event streams are `sse_clients`).
#[derive(Debug, Default, Clone)]
pub struct AdmissionGauges {
    pub requests: Gauge,
    pub body_bytes: Gauge,
    pub exports: Gauge,
    pub sql: Gauge,
}

/// Every component's counters, for the exporter to gather.
#[derive(Debug, Clone, Copy)]
pub struct Sources<'a> {
    pub ingest: &'a IngestMetrics,
    pub wal: &'a WalMetrics,
    pub engine: &'a EngineMetrics,
    pub sinks: &'a SinkMetrics,
    pub requests: &'a RequestMetrics,
}

/// The `/metrics` registry: every component's metrics plus the per-run gauges.
#[derive(Debug)]
pub struct Exporter {
    registry: Registry,
}

impl Exporter {
    /// Registers everything. The per-run gauges read `store`'s run index at each scrape.
    pub fn new(store: Arc<Store>, sources: Sources<'_>, window: Duration, max_runs: usize) -> Self {
        let mut r = Registry::with_prefix("rankwatch");
        sources.ingest.register(&mut r);
        sources.requests.register(&mut r);
        sources.wal.register(&mut r);
        store.metrics().register(&mut r);
        sources.engine.register(&mut r);
        sources.sinks.register(&mut r);
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
    store: Arc<Store>,
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
        let store = &self.store;
        let now = store.now_ms();
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
