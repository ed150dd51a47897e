//! The rankwatch agent: what runs inside a training process and gets its measurements to the
//! collector without ever making the training step wait.
//!
//! The training thread calls [`Agent::log`] (or [`Agent::push`]); the record goes onto a
//! bounded queue with a non-blocking `try_send`. When the queue is full the record is dropped
//! and counted — the step is never delayed. A sender thread ([`sender`]) drains the queue,
//! seals batches (one Arrow IPC stream per table, zstd), numbers them for idempotency keys
//! `run/rank/session/seq`, and posts them with retries, exponential backoff with jitter and
//! `Retry-After`. While the collector is unreachable, batches wait in a bounded disk
//! [`spool`] and are replayed in order once it is back; a later process for the same run and
//! rank replays what an earlier one left. Every loss — queue full, backlog full, a batch the
//! collector refused — is counted in [`StatsSnapshot`] and reported to the collector as the
//! per-rank metric `dropped`.
//!
//! Usable from Rust training code directly:
//!
//! ```no_run
//! use rankwatch_agent::{Agent, AgentConfig, Metric, Point};
//! use rankwatch_analytics::RunId;
//! # fn main() -> rankwatch_agent::Result<()> {
//! let agent = Agent::start(AgentConfig::new(RunId::new("my-run")?, 0, "http://127.0.0.1:7070"))?;
//! let loss = Metric::new("loss")?;
//! agent.log(1, vec![Point { metric: loss, rank: Some(0), layer: None, site: None, value: 2.3 }])?;
//! agent.shutdown(std::time::Duration::from_secs(5));
//! # Ok(()) }
//! ```

pub mod alerts;
mod backoff;
mod config;
mod encode;
mod error;
mod record;
pub mod sender;
pub mod spool;
mod stats;
mod transport;
pub mod wire;

use std::path::Path;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::mpsc::{SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rankwatch_analytics::{RunInfo, SketchRecord};

pub use config::{AgentConfig, Mode};
pub use encode::Table;
pub use error::{Error, Result};
pub use record::{Metric, Point, Record};
pub use stats::StatsSnapshot;

pub use sender::now_ms;
use sender::{Msg, Sender, Shared};

/// What [`Agent::flush`] achieved before its deadline.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlushReport {
    /// The sender processed the request before the deadline.
    pub completed: bool,
    /// Batches still waiting (in memory or spooled) afterwards.
    pub backlog_batches: u64,
}

/// The handle the training code holds. Cheap to share behind an `Arc`; every method takes
/// `&self` and none blocks except [`Agent::flush`] and [`Agent::shutdown`], which wait at most
/// their timeout.
#[derive(Debug)]
pub struct Agent {
    run: rankwatch_analytics::RunId,
    rank: u32,
    session: String,
    tx: SyncSender<Msg>,
    shared: Arc<Shared>,
    queue_values: u64,
    info: RwLock<Option<RunInfo>>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Agent {
    /// Checks `config`, opens the spool (keeping what an earlier process left) and starts the
    /// sender thread.
    pub fn start(config: AgentConfig) -> Result<Agent> {
        config.check()?;
        let session = config.session.clone().unwrap_or_else(new_session);
        let spool = config
            .spool_dir
            .as_deref()
            .map(|dir| spool::Spool::open(dir, config.spool_max_bytes, config.segment_bytes))
            .transpose()?;
        let (tx, rx) = sync_channel(config.queue_records);
        let shared = Arc::new(Shared::default());
        let sender = Sender::new(config.clone(), session.clone(), shared.clone(), rx, spool);
        let thread = std::thread::Builder::new()
            .name(format!("rankwatch-sender-{}", config.rank))
            .spawn(move || sender.run())
            .map_err(|e| Error::Config(format!("cannot start the sender thread: {e}")))?;
        Ok(Agent {
            run: config.run.clone(),
            rank: config.rank,
            session,
            tx,
            shared,
            queue_values: config.queue_values,
            info: RwLock::new(None),
            thread: Mutex::new(Some(thread)),
        })
    }

    /// The run this agent reports to.
    pub fn run(&self) -> &rankwatch_analytics::RunId {
        &self.run
    }

    /// This process's rank.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// The session part of this agent's idempotency keys.
    pub fn session(&self) -> &str {
        &self.session
    }

    /// Validates `points` (scope of each metric, ranks and layers within the announced run)
    /// and queues them for `step`. All or nothing: an invalid point refuses the whole call.
    /// `Ok(false)` means the queue was full and the points were dropped (and counted).
    pub fn log(&self, step: u64, points: Vec<Point>) -> Result<bool> {
        {
            let info = self.info.read().unwrap_or_else(|e| e.into_inner());
            for point in &points {
                point.validate(info.as_ref())?;
            }
        }
        self.log_prevalidated(step, points)
    }

    /// [`Agent::log`] without the per-point checks, for callers whose points are valid by
    /// construction (the Python SDK's per-rank scalars). Never waits; `Ok(false)`: dropped.
    pub fn log_prevalidated(&self, step: u64, points: Vec<Point>) -> Result<bool> {
        self.push(Record::Points {
            step,
            time_ms: now_ms(),
            points,
        })
    }

    /// Queues a gradient sketch of this rank.
    pub fn sketch(&self, sketch: SketchRecord) -> Result<bool> {
        if sketch.vector.is_empty() {
            return Err(Error::InvalidSample(
                "a sketch needs a non-empty vector".into(),
            ));
        }
        self.push(Record::Sketch(sketch))
    }

    /// Announces (or updates) the run's metadata: world size, model layout, tags.
    pub fn set_info(&self, mut info: RunInfo) -> Result<bool> {
        info.validate()?;
        // The collector shows each run's agent release (`rankwatch runs list`, the runs API).
        info.tags
            .entry(rankwatch_api::VERSION_TAG.to_owned())
            .or_insert_with(|| rankwatch_api::VERSION.to_owned());
        *self.info.write().unwrap_or_else(|e| e.into_inner()) = Some(info.clone());
        self.push(Record::Info(info))
    }

    /// Queues `record` without validation. Never waits: `Ok(false)` means it was dropped
    /// because the queue is full, and the drop is counted.
    pub fn push(&self, record: Record) -> Result<bool> {
        let rows = record.rows();
        let stats = &self.shared.stats;
        if stats.queued_values.load(Relaxed) + rows > self.queue_values {
            stats.dropped_queue_full.fetch_add(rows, Relaxed);
            return Ok(false);
        }
        stats.queued_values.fetch_add(rows, Relaxed);
        match self.tx.try_send(Msg::Record(record)) {
            Ok(()) => {
                stats.accepted_rows.fetch_add(rows, Relaxed);
                Ok(true)
            }
            Err(TrySendError::Full(_)) => {
                stats.queued_values.fetch_sub(rows, Relaxed);
                stats.dropped_queue_full.fetch_add(rows, Relaxed);
                Ok(false)
            }
            Err(TrySendError::Disconnected(_)) => {
                stats.queued_values.fetch_sub(rows, Relaxed);
                Err(Error::Closed)
            }
        }
    }

    /// Seals what is queued and tries to deliver the whole backlog, waiting at most `timeout`.
    pub fn flush(&self, timeout: Duration) -> FlushReport {
        let deadline = Instant::now() + timeout;
        let ticket = {
            let mut c = self.shared.control();
            if c.exited {
                return self.report(true);
            }
            c.flush_requested += 1;
            c.flush_deadline = Some(deadline);
            c.flush_requested
        };
        let _ = self.tx.try_send(Msg::Wake);
        let completed = self
            .shared
            .wait_until(deadline, |c| c.flush_done >= ticket || c.exited);
        self.report(completed)
    }

    fn report(&self, completed: bool) -> FlushReport {
        FlushReport {
            completed,
            backlog_batches: self.shared.stats.backlog_batches.load(Relaxed),
        }
    }

    /// Stops the agent: seals and delivers what it can before `timeout`, spools the rest, and
    /// joins the sender thread if it finished in time (otherwise leaves it detached, so the
    /// process is never held hostage). Calling it again is harmless.
    pub fn shutdown(&self, timeout: Duration) -> StatsSnapshot {
        let deadline = Instant::now() + timeout;
        {
            let mut c = self.shared.control();
            if c.shutdown_deadline.is_none() {
                // Leave the thread a margin to spool what it could not deliver.
                c.shutdown_deadline = Some(deadline - (timeout / 5).min(Duration::from_secs(1)));
            }
        }
        let _ = self.tx.try_send(Msg::Wake);
        let exited = self.shared.wait_until(deadline, |c| c.exited);
        if exited && let Some(thread) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take()
        {
            let _ = thread.join();
        }
        self.stats()
    }

    /// Whether [`Agent::shutdown`] completed.
    pub fn is_closed(&self) -> bool {
        self.shared.control().exited
    }

    /// The counters now.
    pub fn stats(&self) -> StatsSnapshot {
        self.shared.stats.snapshot()
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if !self.is_closed() {
            self.shutdown(Duration::from_secs(2));
        }
    }
}

/// The folder, inside a spool directory, where batches the collector refused are kept.
pub const REFUSED_DIR: &str = "refused";

/// Delivers a spool directory left by an offline run (or a crashed process) to `collector`,
/// oldest first, each batch with its original idempotency key, then the batches the collector
/// once refused (`DIR/refused`, e.g. over a series limit since raised). A batch refused again
/// is kept there, never deleted. Stops at the first batch that cannot be delivered now, so it
/// can simply be run again; returns the rows delivered.
pub fn sync_spool(
    dir: &Path,
    collector: &str,
    token: Option<&str>,
    timeout: Duration,
) -> Result<SyncReport> {
    let transport = transport::Transport::new(collector, token, Duration::from_secs(2));
    let mut report = SyncReport::default();
    let mut spool = spool::Spool::open(dir, u64::MAX, 8 << 20)?;
    let refused_dir = dir.join(REFUSED_DIR);
    let mut aside = spool::Aside::new(refused_dir.clone(), u64::MAX, 8 << 20);
    if !drain(
        &mut spool,
        &transport,
        timeout,
        &mut report,
        Some(&mut aside),
    )? {
        return Ok(report);
    }
    report.corrupt = spool.corrupt();
    if refused_dir.is_dir() {
        // One pass over what was kept before: a batch refused again goes to the back of the
        // same folder and is not tried twice.
        let kept = aside.spool()?;
        drain(kept, &transport, timeout, &mut report, None)?;
        kept.sync();
        report.corrupt += kept.corrupt();
    }
    Ok(report)
}

/// Sends `spool`'s batches; refused ones are kept in `aside`, or, without one (`spool` is the
/// refused folder itself), appended back to `spool` behind this pass, which then stops at the
/// records it started with. Returns `false` when the collector could not take one now.
fn drain(
    spool: &mut spool::Spool,
    transport: &transport::Transport,
    timeout: Duration,
    report: &mut SyncReport,
    mut aside: Option<&mut spool::Aside>,
) -> Result<bool> {
    let pass = spool.records();
    for _ in 0..pass {
        let Some(batch) = spool.head() else {
            break;
        };
        match transport.post(batch, timeout) {
            transport::Outcome::Delivered { duplicate } => {
                report.batches += 1;
                report.rows += batch.rows;
                report.duplicates += u64::from(duplicate);
                spool.pop();
            }
            transport::Outcome::Refused { reason, .. } => {
                let batch = batch.clone();
                report.errors.push(reason);
                spool.pop();
                let kept = match aside.as_deref_mut() {
                    Some(aside) => aside.keep(&batch)?,
                    None => spool.append(&batch)?,
                };
                if kept {
                    report.set_aside_rows += batch.rows;
                } else {
                    report.refused_rows += batch.rows;
                }
            }
            transport::Outcome::Retry { reason, .. } => {
                report.remaining = spool.records();
                report.errors.push(reason);
                return Ok(false);
            }
        }
    }
    Ok(true)
}

/// What [`sync_spool`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SyncReport {
    pub batches: u64,
    pub rows: u64,
    pub duplicates: u64,
    /// Rows the collector refused for good and that could not be kept.
    pub refused_rows: u64,
    /// Rows the collector refused, kept in `DIR/refused` for a later sync.
    pub set_aside_rows: u64,
    pub corrupt: u64,
    /// Batches left because the collector could not take them now.
    pub remaining: u64,
    pub errors: Vec<String>,
}

/// A new session id: 16 random hex digits per agent.
fn new_session() -> String {
    rankwatch_analytics::random_hex_id()
}
