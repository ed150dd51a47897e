//! `rankwatch._native`: the Rust agent ([`rankwatch_agent`]) as a Python extension.
//!
//! The Python package calls this from the training thread, so the hot entry points are built
//! for that: `Agent::log` takes the keyword dict of `run.log(step, **scalars)` as it is,
//! resolves each key to a validated metric through a cache keyed by the (interned) Python
//! string object, reads plain `float`/`int` values directly and hands anything else — above
//! all tensors, whose `__float__` would force a device sync — back to Python untouched.
//! Probe outputs use pre-registered series (`Agent::register`, `Agent::log_series`), so a
//! report of a thousand layer values is one call with one list of floats. Waiting calls
//! (`flush`, `shutdown`) release the GIL. Every refusal is a `ValueError` naming the problem.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyFloat, PyInt, PyString};
use rankwatch_agent::alerts::AlertFeed;
use rankwatch_agent::{
    Agent as RustAgent, AgentConfig, Metric, Mode, Point, StatsSnapshot, now_ms,
};
use rankwatch_analytics::math::sketch::SketchKind;
use rankwatch_analytics::{ModelLayout, RunId, RunInfo, Site, SketchRecord, vocab};

fn value_error(e: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(e.to_string())
}

fn agent_error(e: rankwatch_agent::Error) -> PyErr {
    match e {
        rankwatch_agent::Error::Closed => {
            PyRuntimeError::new_err("the rankwatch run is finished; nothing more is logged")
        }
        other => value_error(other),
    }
}

/// The metric a `run.log` keyword names: a per-rank vocabulary metric as itself, anything
/// else as the user scalar `user/<name>`.
fn scalar_metric(name: &str) -> Result<Metric, String> {
    if let Ok(known) = name.parse::<vocab::Metric>() {
        if known.scope() != vocab::Scope::Rank {
            return Err(format!(
                "{name:?} is a {} metric; run.log takes per-rank scalars (loss, tokens, …) and user scalars",
                match known.scope() {
                    vocab::Scope::Layer => "per-layer",
                    _ => "collector-derived",
                }
            ));
        }
        return Ok(known.into());
    }
    let full = if name.starts_with(rankwatch_analytics::validate::USER_PREFIX) {
        name.to_owned()
    } else {
        format!("{}{name}", rankwatch_analytics::validate::USER_PREFIX)
    };
    Metric::new(&full).map_err(|e| e.to_string())
}

/// A registered set of series: one value of each per `log_series` call.
#[derive(Debug)]
struct Series {
    points: Vec<Point>,
}

/// Hashes an object address: addresses are already well spread apart from their low
/// alignment bits, so a multiply is enough (SipHash would cost more than the whole look-up).
#[derive(Debug, Default, Clone, Copy)]
struct AddressHasher(u64);

impl std::hash::Hasher for AddressHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8 | u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_usize(&mut self, n: usize) {
        self.0 = (n as u64 >> 4).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

type AddressMap<V> = HashMap<usize, V, std::hash::BuildHasherDefault<AddressHasher>>;

#[derive(Debug, Default)]
struct Caches {
    /// Keyed by the address of the key's Python string; the string is kept alive beside it.
    by_object: AddressMap<(Py<PyString>, Metric)>,
    series: Vec<Series>,
}

/// One rank's agent.
#[pyclass(frozen, module = "rankwatch._native")]
struct Agent {
    /// Always there but in `Drop`, which leaves it to a forked child (see there).
    inner: Option<RustAgent>,
    rank: u32,
    caches: Mutex<Caches>,
    /// Where the alert feed polls, when it is started.
    collector: Option<(String, Option<String>)>,
    feed: Mutex<Option<AlertFeed>>,
    /// The process that started the agent and its threads.
    pid: u32,
}

impl Drop for Agent {
    /// In a process forked from the one that started it, the agent's copy is leaked: its
    /// sender and poller threads were not forked, and a lock one of them held at the fork
    /// stays held in the child for good, so stopping them there would wait forever (a child
    /// that ends by interpreter finalization, not `os._exit`, drops every object it inherited).
    fn drop(&mut self) {
        if std::process::id() != self.pid {
            // `get_mut` takes no lock: the borrow is exclusive.
            let feed = self.feed.get_mut().unwrap_or_else(|p| p.into_inner());
            std::mem::forget(feed.take());
            std::mem::forget(self.inner.take());
        }
    }
}

impl Agent {
    /// The running agent (only `Drop` takes it).
    fn agent(&self) -> &RustAgent {
        self.inner
            .as_ref()
            .expect("the agent is taken only when dropped")
    }
}

fn stats_dict<'py>(py: Python<'py>, s: &StatsSnapshot) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("accepted_rows", s.accepted_rows)?;
    d.set_item("queued_values", s.queued_values)?;
    d.set_item("sent_rows", s.sent_rows)?;
    d.set_item("sent_batches", s.sent_batches)?;
    d.set_item("duplicates", s.duplicates)?;
    d.set_item("retries", s.retries)?;
    d.set_item("dropped_rows", s.dropped_rows)?;
    d.set_item("dropped_queue_full", s.dropped_queue_full)?;
    d.set_item("dropped_spool_full", s.dropped_spool_full)?;
    d.set_item("refused_rows", s.refused_rows)?;
    d.set_item("set_aside_rows", s.set_aside_rows)?;
    d.set_item("backlog_batches", s.backlog_batches)?;
    d.set_item("spooled_batches", s.spooled_batches)?;
    d.set_item("spool_bytes", s.spool_bytes)?;
    d.set_item("spool_corrupt", s.spool_corrupt)?;
    d.set_item("connected", s.connected)?;
    d.set_item("ever_connected", s.ever_connected)?;
    d.set_item("last_error", s.last_error.clone())?;
    Ok(d)
}

fn parse_site(site: Option<&str>) -> PyResult<Option<Site>> {
    site.map(|s| s.parse::<Site>().map_err(value_error))
        .transpose()
}

#[pymethods]
impl Agent {
    #[new]
    #[pyo3(signature = (run, rank, collector, *, token=None, mode="online", spool_dir=None,
        queue_values=2_000_000, batch_interval_s=1.0, request_timeout_s=10.0, session=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        run: &str,
        rank: u32,
        collector: &str,
        token: Option<String>,
        mode: &str,
        spool_dir: Option<PathBuf>,
        queue_values: u64,
        batch_interval_s: f64,
        request_timeout_s: f64,
        session: Option<String>,
    ) -> PyResult<Agent> {
        let run = RunId::new(run).map_err(value_error)?;
        let mut config = AgentConfig::new(run, rank, collector);
        config.token = token;
        config.mode = match mode {
            "online" => Mode::Online,
            "offline" => Mode::Offline,
            other => {
                return Err(value_error(format!(
                    "mode must be \"online\" or \"offline\" here, got {other:?}"
                )));
            }
        };
        config.spool_dir = spool_dir;
        config.queue_values = queue_values;
        let seconds = |name: &str, s: f64| {
            Duration::try_from_secs_f64(s)
                .ok()
                .filter(|d| !d.is_zero())
                .ok_or_else(|| {
                    value_error(format!(
                        "{name} must be a positive number of seconds, got {s}"
                    ))
                })
        };
        config.batch_interval = seconds("batch_interval_s", batch_interval_s)?;
        config.request_timeout = seconds("request_timeout_s", request_timeout_s)?;
        config.session = session;
        let collector =
            (config.mode == Mode::Online).then(|| (config.collector.clone(), config.token.clone()));
        let inner = RustAgent::start(config).map_err(agent_error)?;
        Ok(Agent {
            inner: Some(inner),
            rank,
            caches: Mutex::new(Caches::default()),
            collector,
            feed: Mutex::new(None),
            pid: std::process::id(),
        })
    }

    /// This agent's rank.
    #[getter]
    fn rank(&self) -> u32 {
        self.rank
    }

    /// The session part of the idempotency keys.
    #[getter]
    fn session(&self) -> String {
        self.agent().session().to_owned()
    }

    /// Queues this rank's scalars for `step`. Plain floats and ints are taken; the names of
    /// all other values are returned (in order) for the caller to resolve — tensors, numpy
    /// scalars, or mistakes. Returns `None` when every value was taken. Raises `ValueError`
    /// naming a key that is not a valid metric name, and queues nothing in that case.
    fn log(
        &self,
        py: Python<'_>,
        step: u64,
        values: &Bound<'_, PyDict>,
    ) -> PyResult<Option<Vec<String>>> {
        let mut points = Vec::with_capacity(values.len());
        let mut others: Option<Vec<String>> = None;
        {
            let mut caches = self.caches.lock().unwrap_or_else(|e| e.into_inner());
            for (key, value) in values.iter() {
                let key = key
                    .cast_into::<PyString>()
                    .map_err(|_| value_error("metric names must be strings"))?;
                let value = if let Ok(f) = value.cast_exact::<PyFloat>() {
                    f.value()
                } else if value.is_instance_of::<PyInt>() {
                    value.extract::<f64>()?
                } else {
                    others
                        .get_or_insert_with(Vec::new)
                        .push(key.to_str()?.to_owned());
                    continue;
                };
                let address = key.as_ptr() as usize;
                let metric = match caches.by_object.get(&address) {
                    Some((_, metric)) => metric.clone(),
                    None => {
                        let metric = scalar_metric(key.to_str()?).map_err(value_error)?;
                        caches
                            .by_object
                            .insert(address, (key.clone().unbind(), metric.clone()));
                        metric
                    }
                };
                points.push(Point {
                    metric,
                    rank: Some(self.rank),
                    layer: None,
                    site: None,
                    value,
                });
            }
        }
        let _ = py;
        if !points.is_empty() {
            // Valid by construction: `scalar_metric` admits only per-rank and user metrics,
            // and each point carries this rank and no layer or site.
            self.agent()
                .log_prevalidated(step, points)
                .map_err(agent_error)?;
        }
        Ok(others)
    }

    /// Registers a fixed list of series `(metric, layer, site, all_ranks)` and returns its id
    /// for [`Agent::log_series`]. `all_ranks` marks values that are the same on every rank
    /// (weights), stored with a null rank.
    fn register(
        &self,
        series: Vec<(String, Option<u32>, Option<String>, bool)>,
    ) -> PyResult<usize> {
        let mut points = Vec::with_capacity(series.len());
        for (name, layer, site, all_ranks) in series {
            let metric = Metric::new(&name).map_err(value_error)?;
            let point = Point {
                metric,
                rank: (!all_ranks).then_some(self.rank),
                layer,
                site: parse_site(site.as_deref())?,
                value: 0.0,
            };
            point.validate(None).map_err(agent_error)?;
            points.push(point);
        }
        let mut caches = self.caches.lock().unwrap_or_else(|e| e.into_inner());
        caches.series.push(Series { points });
        Ok(caches.series.len() - 1)
    }

    /// Queues one value per series of `series_id` for `step`.
    fn log_series(&self, step: u64, series_id: usize, values: Vec<f64>) -> PyResult<bool> {
        let points = {
            let caches = self.caches.lock().unwrap_or_else(|e| e.into_inner());
            let series = caches
                .series
                .get(series_id)
                .ok_or_else(|| value_error(format!("unknown series id {series_id}")))?;
            if series.points.len() != values.len() {
                return Err(value_error(format!(
                    "series {series_id} has {} entries, got {} values",
                    series.points.len(),
                    values.len()
                )));
            }
            series
                .points
                .iter()
                .zip(values)
                .map(|(p, value)| Point { value, ..p.clone() })
                .collect()
        };
        self.agent().log(step, points).map_err(agent_error)
    }

    /// Queues a gradient sketch of this rank.
    #[pyo3(signature = (step, kind, seed, norm, vector))]
    fn sketch(
        &self,
        step: u64,
        kind: &str,
        seed: u32,
        norm: f64,
        vector: Vec<f32>,
    ) -> PyResult<bool> {
        let kind: SketchKind = kind.parse().map_err(value_error)?;
        let record = SketchRecord {
            run: self.agent().run().clone(),
            rank: self.rank,
            step,
            time_ms: now_ms(),
            kind,
            seed,
            norm,
            vector,
        };
        self.agent().sketch(record).map_err(agent_error)
    }

    /// Announces the run: world size, the discovered layout (`ModelLayout` JSON) and tags.
    #[pyo3(signature = (world_size, layout_json, tags, started_at_ms=None))]
    fn set_info(
        &self,
        world_size: u32,
        layout_json: &str,
        tags: BTreeMap<String, String>,
        started_at_ms: Option<i64>,
    ) -> PyResult<bool> {
        let layout: ModelLayout = serde_json::from_str(layout_json)
            .map_err(|e| value_error(format!("invalid layout JSON: {e}")))?;
        let info = RunInfo {
            run: self.agent().run().clone(),
            world_size,
            started_at_ms: started_at_ms.unwrap_or_else(now_ms),
            layout,
            tags,
        };
        self.agent().set_info(info).map_err(agent_error)
    }

    /// Seals and tries to deliver everything, waiting at most `timeout_s`. Returns whether
    /// the backlog is empty afterwards.
    fn flush(&self, py: Python<'_>, timeout_s: f64) -> bool {
        let timeout = Duration::try_from_secs_f64(timeout_s.max(0.0)).unwrap_or(Duration::ZERO);
        let report = py.detach(|| self.agent().flush(timeout));
        report.completed && report.backlog_batches == 0
    }

    /// Starts polling the collector for this run's alerts every `interval_s` (once; later calls
    /// do nothing). Returns false in offline mode, where there is no collector to ask.
    #[pyo3(signature = (interval_s=2.0))]
    fn watch_alerts(&self, interval_s: f64) -> PyResult<bool> {
        let Some((collector, token)) = &self.collector else {
            return Ok(false);
        };
        let interval = Duration::try_from_secs_f64(interval_s)
            .ok()
            .filter(|d| !d.is_zero())
            .ok_or_else(|| value_error(format!("interval_s must be positive, got {interval_s}")))?;
        let mut feed = self.feed.lock().unwrap_or_else(|p| p.into_inner());
        if feed.is_none() {
            let started = AlertFeed::start(
                collector,
                self.agent().run().as_str(),
                token.as_deref(),
                interval,
            )
            .map_err(|e| value_error(format!("cannot start the alert feed: {e}")))?;
            *feed = Some(started);
        }
        Ok(true)
    }

    /// The alert changes received since the last call, as JSON texts, oldest first.
    fn take_alerts(&self) -> Vec<String> {
        let feed = self.feed.lock().unwrap_or_else(|p| p.into_inner());
        feed.as_ref()
            .map(|f| {
                f.take()
                    .iter()
                    // Plain fields only: serialising an alert cannot fail.
                    .filter_map(|a| serde_json::to_string(a).ok())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The alert feed's counters: changes dropped untaken, failed polls, whether connected.
    fn alert_feed_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        let feed = self.feed.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(f) = feed.as_ref() {
            d.set_item("dropped", f.dropped())?;
            d.set_item("failed_polls", f.failed_polls())?;
            d.set_item("connected", f.connected())?;
        }
        Ok(d)
    }

    /// Stops the agent (idempotent) and returns its final counters.
    fn shutdown<'py>(&self, py: Python<'py>, timeout_s: f64) -> PyResult<Bound<'py, PyDict>> {
        let feed = self.feed.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(mut feed) = feed {
            py.detach(move || feed.stop());
        }
        let timeout = Duration::try_from_secs_f64(timeout_s.max(0.0)).unwrap_or(Duration::ZERO);
        let stats = py.detach(|| self.agent().shutdown(timeout));
        stats_dict(py, &stats)
    }

    /// Whether the agent was shut down.
    #[getter]
    fn closed(&self) -> bool {
        self.agent().is_closed()
    }

    /// The counters now (queued, sent, retried, spooled, dropped, last error).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        stats_dict(py, &self.agent().stats())
    }
}

/// Sends a spool directory (an offline run, or what a crashed process left) to `collector`.
#[pyfunction]
#[pyo3(signature = (spool_dir, collector, token=None, timeout_s=10.0))]
fn sync<'py>(
    py: Python<'py>,
    spool_dir: PathBuf,
    collector: &str,
    token: Option<String>,
    timeout_s: f64,
) -> PyResult<Bound<'py, PyDict>> {
    let timeout =
        Duration::try_from_secs_f64(timeout_s.max(0.1)).unwrap_or(Duration::from_secs(10));
    let report = py
        .detach(|| rankwatch_agent::sync_spool(&spool_dir, collector, token.as_deref(), timeout))
        .map_err(agent_error)?;
    let d = PyDict::new(py);
    d.set_item("batches", report.batches)?;
    d.set_item("rows", report.rows)?;
    d.set_item("duplicates", report.duplicates)?;
    d.set_item("refused_rows", report.refused_rows)?;
    d.set_item("set_aside_rows", report.set_aside_rows)?;
    d.set_item("corrupt", report.corrupt)?;
    d.set_item("remaining", report.remaining)?;
    d.set_item("errors", report.errors)?;
    Ok(d)
}

/// The metric vocabulary: `(name, scope, sites)` for each metric.
#[pyfunction]
fn vocabulary() -> Vec<(&'static str, &'static str, Vec<&'static str>)> {
    vocab::Metric::ALL
        .iter()
        .map(|m| {
            let scope = match m.scope() {
                vocab::Scope::Rank => "rank",
                vocab::Scope::Layer => "layer",
                vocab::Scope::AllRanks => "all_ranks",
            };
            (
                m.as_str(),
                scope,
                m.sites().iter().map(|s| s.as_str()).collect(),
            )
        })
        .collect()
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // One release number for the wheel, the agent and the collector (`rankwatch --version`).
    m.add("VERSION", rankwatch_api::VERSION)?;
    m.add("WIRE_PROTOCOL", rankwatch_api::WIRE_PROTOCOL)?;
    m.add_class::<Agent>()?;
    m.add_function(wrap_pyfunction!(sync, m)?)?;
    m.add_function(wrap_pyfunction!(vocabulary, m)?)?;
    Ok(())
}
