//! The store: write-ahead log → hot in-memory Arrow buffer → Parquet, with one consistent
//! view for readers.
//!
//! # Design
//!
//! Everything mutable lives in one `State` behind a mutex held only for bookkeeping (never
//! across I/O): the hot batches per (table, run), batches being flushed, the list of Parquet
//! files from the manifest, the idempotency keys and the run index. A reader takes a
//! [`TableView`] — file paths plus hot and flushing batches — in one critical section, so it
//! sees every acknowledged row exactly once whatever flush or compaction is doing.
//!
//! Ingest appends to the write-ahead log; after the group fsync, the log's writer thread
//! *applies* the batch: rows go into the hot buffer, the key becomes applied, the run index
//! learns the series. The hot buffer is thus always "every durable record up to
//! `applied_seq`".
//!
//! The lifecycle, one file each: `admit` (caps and idempotency before a batch is logged;
//! apply after its fsync), `flush` (hot → Parquet parts → manifest), `compact` (small parts
//! merged), `delete` (a run removed), `alerts` (alert state and its journal). A crash
//! anywhere leaves the previous manifest, the log records after its `flushed_seq`, and
//! possibly unlisted files, which start-up deletes.

mod admit;
pub use admit::Prepared;
pub mod alert_log;
mod alerts;
pub mod backend;
mod compact;
mod delete;
pub mod files;
mod flush;
pub mod index;
pub mod manifest;
pub mod metrics;
pub mod rollup;
mod unlisted;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use arrow_array::RecordBatch;
use rankwatch_analytics::detect::TENSORS_TAG;
use rankwatch_analytics::schema::{alerts as alert_schema, runs};
use rankwatch_analytics::{Alert, RunId, RunInfo};
use tokio::sync::{Notify, broadcast};

use crate::clock::SharedClock;
use crate::entry::Table;
use crate::error::{Error, Result};
use crate::idempotency::KeySet;
use backend::Backend;
use index::RunSummary;
use manifest::{FileMeta, Manifest};
use metrics::StoreMetrics;

/// What changed, for `/api/v1/events` subscribers: the contract's event type.
pub use rankwatch_api::Event;

/// What an admitted batch holds against the caps until it is applied or fails.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Reservation {
    /// New series of its run.
    pub series: usize,
    /// Its run is not known yet.
    pub new_run: bool,
}

/// Limits the store enforces at ingest.
#[derive(Debug, Clone, Copy)]
pub struct StoreLimits {
    pub hot_budget_bytes: usize,
    pub max_series_per_run: usize,
    /// Most series of all runs together (the run index lives in memory).
    pub max_series: usize,
    /// Most runs the collector keeps (each costs a summary, files per flush and a branch in
    /// every SQL query).
    pub max_runs: usize,
    pub compact_small_rows: u64,
    pub compact_max_rows: u64,
    pub file_grace: Duration,
    /// How long a run's idempotency keys are kept after its last new key.
    pub key_window: Duration,
}

/// Rows of one table of one run, as a reader sees them.
#[derive(Debug, Clone, Default)]
pub struct TableView {
    /// Parquet files, relative to the dataset root ([`Backend::location`] says where).
    pub files: Vec<PathBuf>,
    /// Hot and flushing batches, file schema.
    pub batches: Vec<RecordBatch>,
}

/// One samples part, as the query planner sees it.
#[derive(Debug, Clone)]
pub struct SamplesPart {
    /// Relative to the dataset root, like [`TableView::files`].
    pub samples: PathBuf,
    /// Its rollup part, when written.
    pub rollup: Option<PathBuf>,
    /// The rollup's sparse metrics ([`FileMeta::sparse`]): see [`SamplesPart::has_windows`].
    pub sparse: BTreeMap<String, rollup::Finest>,
    /// Its first and last step (unknown only for an empty part).
    pub steps: Option<(u64, u64)>,
}

impl SamplesPart {
    /// Whether its rollup holds `metric`'s windows of `level` (per rank, or `pooled`).
    pub fn has_windows(&self, metric: &str, level: u32, pooled: bool) -> bool {
        self.rollup.is_some() && self.sparse.get(metric).is_none_or(|f| f.has(level, pooled))
    }
}

/// The samples of one run with their rollups: see [`Store::samples_view`].
#[derive(Debug, Clone, Default)]
pub struct SamplesView {
    pub parts: Vec<SamplesPart>,
    /// Hot and flushing batches, file schema.
    pub hot: Vec<RecordBatch>,
}

#[derive(Debug, Default)]
struct HotPart {
    batches: Vec<RecordBatch>,
    bytes: usize,
}

#[derive(Debug, Default)]
struct State {
    hot: HashMap<(Table, RunId), HotPart>,
    hot_bytes: usize,
    flushing: Vec<((Table, RunId), HotPart)>,
    manifest: Manifest,
    applied_seq: u64,
    keys: KeySet,
    runs: BTreeMap<RunId, RunSummary>,
    runs_dirty: Vec<RunId>,
    alerts: BTreeMap<String, Alert>,
    alerts_dirty: Vec<RunId>,
    /// Revision of each alert's latest change (1, 2, ... since this process started), so the
    /// training process can poll for what changed.
    alert_revisions: BTreeMap<String, u64>,
    alert_revision: u64,
    /// Files replaced by compaction, deleted once no query can still be reading them.
    graveyard: Vec<(Instant, PathBuf)>,
    /// Samples parts found too short for a rollup since start, so compaction does not read
    /// them again to find out (see `add_missing_rollups`).
    without_rollup: std::collections::HashSet<PathBuf>,
    /// New series of batches admitted but not yet applied, per run: what the series cap counts
    /// besides the run's own (before, N concurrent batches each passed against the series
    /// applied so far, and a run reached N times the cap).
    reserved_series: HashMap<RunId, usize>,
    /// Runs not yet known whose first batches are admitted but not yet applied (how many
    /// batches each), for the run cap.
    reserved_runs: HashMap<RunId, usize>,
    /// Series of every run's summary together, for the collector-wide cap.
    total_series: usize,
    /// Files a failed flush or compaction wrote that no manifest lists yet (see `unlisted`).
    unlisted: Vec<PathBuf>,
}

impl State {
    /// The hot and flushing batches of one table of one run: what readers see besides files.
    fn unflushed(&self, table: Table, run: &RunId) -> Vec<RecordBatch> {
        let key = (table, run.clone());
        let mut batches: Vec<RecordBatch> = self
            .flushing
            .iter()
            .filter(|(k, _)| *k == key)
            .flat_map(|(_, p)| p.batches.iter().cloned())
            .collect();
        if let Some(part) = self.hot.get(&key) {
            batches.extend(part.batches.iter().cloned());
        }
        batches
    }
}

/// The store; shared by the HTTP layer, the log writer and the background tasks.
#[derive(Debug)]
pub struct Store {
    /// The data directory: the key snapshots (and, by default, the Parquet side too).
    dir: PathBuf,
    backend: Backend,
    state: Mutex<State>,
    limits: StoreLimits,
    events: broadcast::Sender<Event>,
    flush_wanted: Notify,
    /// Told when the hot buffer shrinks (a flush takes it, a run is deleted): batches waiting
    /// in [`Store::room_until`] look again.
    room_freed: Notify,
    metrics: StoreMetrics,
    clock: SharedClock,
    /// Serialises flushes, compactions and deletions (see `under_maintenance`).
    maintenance: Arc<tokio::sync::Mutex<()>>,
    epoch: i64,
    /// Alert changes since the last flush, durable (see `alert_log`).
    alert_log: alert_log::AlertLog,
}

/// What [`Store::delete_run`] removed: the contract's type.
pub use rankwatch_api::Deleted;

/// One run's footprint, for retention.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunUsage {
    pub run: RunId,
    /// Bytes of its Parquet files.
    pub bytes: u64,
    /// When it last reported (ms since the epoch; 0 when unknown).
    pub last_seen_ms: i64,
}

/// Outcome of [`Store::begin`].
#[derive(Debug)]
pub enum Admission {
    /// Write it; what it adds is reserved against the caps until [`Store::release`] is
    /// called (applied or failed).
    Write(Reservation),
    /// Already durable; acknowledge.
    Duplicate,
}

impl Store {
    /// Opens the store in `dir` with its Parquet side in `backend`: loads the manifest,
    /// deletes unlisted files, loads the key snapshot and rebuilds the run index from Parquet.
    /// Replay comes after, via [`Store::apply`]. With an object store this blocks on the
    /// network: call it from a blocking thread.
    pub fn open(
        dir: &Path,
        backend: Backend,
        limits: StoreLimits,
        clock: SharedClock,
    ) -> Result<Store> {
        std::fs::create_dir_all(dir)?;
        let manifest = match backend.find_manifest()? {
            Some(manifest) => manifest,
            None => {
                // No manifest at all: every part would look like a crash's leftover. Parts with
                // no manifest mean a lost or deleted manifest, not a new data set.
                let parts = backend.remove_unlisted(&Manifest::default(), true)?;
                if parts > 0 {
                    return Err(Error::Corrupt {
                        what: format!("data set under {}", dir.display()),
                        reason: format!(
                            "there is no manifest, but {parts} Parquet part(s) of this collector \
                             are there; refusing to start, which would delete them as leftovers \
                             of a crash. Restore manifest.json from a backup, or move the \
                             table=* folders aside to start empty"
                        ),
                    });
                }
                // A new data set: its empty manifest is committed before any part can be
                // written, so that a crash in the first flush (parts written, manifest not yet)
                // leaves unlisted parts beside a manifest, which the next start deletes as
                // leftovers (their rows are still in the log), instead of parts without one.
                let empty = Manifest::default();
                backend.save_manifest(&empty)?;
                empty
            }
        };
        let removed = backend.remove_unlisted(&manifest, false)?;
        if removed > 0 {
            tracing::info!(
                removed,
                "removed files left by an interrupted flush or compaction"
            );
        }
        // A shard replaced with an empty data directory finds its manifest in the bucket but
        // not the key snapshot of its lost log: it starts with none rather than refuse.
        let replacement = matches!(backend, Backend::Remote(_))
            && manifest.flushed_seq > 0
            && !dir.join(crate::wal::DIR).exists();
        let keys = if replacement {
            tracing::warn!(
                flushed_seq = manifest.flushed_seq,
                "new data directory for a node with data in object storage: idempotency keys \
                 of the old write-ahead log are lost, so a batch retried across the replacement \
                 may be stored twice"
            );
            KeySet::default()
        } else {
            KeySet::load(dir, manifest.flushed_seq, clock.now_ms())?
        };
        std::fs::create_dir_all(dir.join(crate::idempotency::DIR))?;
        let state = State {
            applied_seq: manifest.flushed_seq,
            manifest,
            keys,
            ..Default::default()
        };
        let (events, _) = broadcast::channel(1024);
        let (alert_log, journaled) = alert_log::AlertLog::open(dir)?;
        let store = Store {
            alert_log,
            dir: dir.to_owned(),
            backend,
            state: Mutex::new(state),
            limits,
            events,
            flush_wanted: Notify::new(),
            room_freed: Notify::new(),
            metrics: StoreMetrics::default(),
            maintenance: Arc::new(tokio::sync::Mutex::new(())),
            epoch: clock.now_ms(),
            clock,
        };
        store.load_runs_and_alerts()?;
        store.apply_journal(journaled);
        store.report_sizes();
        Ok(store)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock would be a bug; the data stays consistent because
        // every critical section is bookkeeping that completes or is not started.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Where the Parquet side lives.
    pub fn backend(&self) -> &Backend {
        &self.backend
    }

    /// The data directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The sequence number flushed to Parquet.
    pub fn flushed_seq(&self) -> u64 {
        self.lock().manifest.flushed_seq
    }

    /// Subscribes to change events.
    pub fn subscribe(&self) -> broadcast::Receiver<Event> {
        self.events.subscribe()
    }

    /// Publishes an event (no subscriber is fine).
    pub fn publish(&self, event: Event) {
        let _ = self.events.send(event);
    }

    /// The collector's clock, shared by everything that reads the store.
    pub fn clock(&self) -> &SharedClock {
        &self.clock
    }

    /// The current time by [`Store::clock`], in ms since the epoch.
    pub fn now_ms(&self) -> i64 {
        self.clock.now_ms()
    }

    /// The store's counters (for `/metrics`).
    pub fn metrics(&self) -> &StoreMetrics {
        &self.metrics
    }

    /// Waits until ingest asks for an early flush.
    pub async fn flush_requested(&self) {
        self.flush_wanted.notified().await;
    }

    /// The metadata a run announced, if any.
    pub fn run_info(&self, run: &RunId) -> Option<RunInfo> {
        self.lock().runs.get(run).and_then(|r| r.info.clone())
    }

    /// The names of the tensors a run's replica fingerprints cover, in their digest's order
    /// (its `replica_fingerprint_tensors` tag); empty when it sent none or sent no list.
    pub fn replica_tensors(&self, run: &RunId) -> Vec<String> {
        let state = self.lock();
        let tag = state
            .runs
            .get(run)
            .and_then(|r| r.info.as_ref())
            .and_then(|i| i.tags.get(TENSORS_TAG));
        tag.and_then(|t| serde_json::from_str(t).ok())
            .unwrap_or_default()
    }

    /// The world size a run announced, if any (without copying its metadata).
    pub fn world_size(&self, run: &RunId) -> Option<u32> {
        self.lock()
            .runs
            .get(run)
            .and_then(|r| r.info.as_ref())
            .map(|i| i.world_size)
    }

    /// What a reader of `table` for `run` sees now.
    pub fn view(&self, table: Table, run: &RunId) -> TableView {
        let state = self.lock();
        let files = state
            .manifest
            .files
            .iter()
            .filter(|f| f.is(table, run))
            .map(FileMeta::relative)
            .collect();
        let batches = state.unflushed(table, run);
        TableView { files, batches }
    }

    /// The samples of `run` as the planner reads them: each part with its rollup (if written)
    /// and step range, and the hot and flushing batches; consistent like [`Store::view`].
    pub fn samples_view(&self, run: &RunId) -> SamplesView {
        let state = self.lock();
        let of_run: Vec<&FileMeta> = state
            .manifest
            .files
            .iter()
            .filter(|f| f.run == *run)
            .collect();
        let parts = of_run
            .iter()
            .filter(|f| f.table == Table::Samples.as_str())
            .map(|f| {
                let rollup = of_run
                    .iter()
                    .find(|r| r.table == rollup::TABLE && r.pairs(f));
                SamplesPart {
                    samples: f.relative(),
                    rollup: rollup.map(|r| r.relative()),
                    sparse: rollup.map(|r| r.sparse.clone()).unwrap_or_default(),
                    steps: f.min_step.zip(f.max_step),
                }
            })
            .collect();
        let hot = state.unflushed(Table::Samples, run);
        SamplesView { parts, hot }
    }

    /// Runs the closure on the run index (read-only).
    pub fn with_runs<T>(&self, f: impl FnOnce(&BTreeMap<RunId, RunSummary>) -> T) -> T {
        f(&self.lock().runs)
    }

    /// When this store was opened (ms since the epoch): alert revisions count from there.
    pub fn epoch(&self) -> i64 {
        self.epoch
    }

    /// Runs `work` on a blocking thread under the maintenance lock (flushes, compactions and
    /// deletions each commit a manifest). The guard travels into the task, so a caller that
    /// stops waiting (a request cancelled at shutdown) cannot let the next step start beside it.
    async fn under_maintenance<T: Send + 'static>(
        self: &Arc<Self>,
        what: &str,
        work: impl FnOnce(&Store) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        let guard = self.maintenance.clone().lock_owned().await;
        let store = self.clone();
        tokio::task::spawn_blocking(move || {
            let _guard = guard;
            work(&store)
        })
        .await
        .map_err(|e| Error::Unavailable(format!("{what} task failed: {e}")))?
    }

    /// Bytes in the hot buffer.
    pub fn hot_bytes(&self) -> usize {
        self.lock().hot_bytes
    }

    /// Each run's Parquet bytes and when it last reported, for retention.
    pub fn usage(&self) -> Vec<RunUsage> {
        let state = self.lock();
        let mut bytes: HashMap<&RunId, u64> = HashMap::new();
        for f in &state.manifest.files {
            *bytes.entry(&f.run).or_default() += f.bytes;
        }
        state
            .runs
            .iter()
            .map(|(run, s)| RunUsage {
                run: run.clone(),
                bytes: bytes.get(run).copied().unwrap_or(0),
                last_seen_ms: s.last_time_ms.unwrap_or(0).max(s.last_seen_ms),
            })
            .collect()
    }

    fn report_sizes(&self) {
        let state = self.lock();
        self.metrics
            .parquet_files
            .set(state.manifest.files.len() as i64);
        self.metrics
            .parquet_bytes
            .set(state.manifest.files.iter().map(|f| f.bytes as i64).sum());
        self.metrics.hot_bytes.set(state.hot_bytes as i64);
        self.metrics
            .idempotency_sessions
            .set(state.keys.sessions() as i64);
    }

    /// Loads run metadata and alerts from their files.
    fn load_runs_and_alerts(&self) -> Result<()> {
        let files: Vec<FileMeta> = self.lock().manifest.files.clone();
        for f in files
            .iter()
            .filter(|f| f.table == runs::TABLE || f.table == alert_schema::TABLE)
        {
            for batch in self.backend.read(&f.relative())? {
                let with_run = add_run_column(&batch, &f.run)?;
                let mut state = self.lock();
                if f.table == runs::TABLE {
                    for info in runs::from_batch(&with_run)? {
                        let run = info.run.clone();
                        state.runs.entry(run).or_default().info = Some(info);
                    }
                } else {
                    for alert in alert_schema::from_batch(&with_run)? {
                        state.alerts.insert(alert.id.clone(), alert);
                    }
                }
            }
        }
        Ok(())
    }

    /// Runs the closure on one run's summary, creating it if needed (the index rebuild).
    pub fn with_run_mut<T>(&self, run: &RunId, f: impl FnOnce(&mut RunSummary) -> T) -> T {
        let mut state = self.lock();
        let state = &mut *state;
        let summary = state.runs.entry(run.clone()).or_default();
        let before = summary.series.len();
        let out = f(summary);
        state.total_series = (state.total_series + summary.series.len()).saturating_sub(before);
        out
    }

    /// Runs that have Parquet sample files.
    pub fn runs_with_files(&self, table: Table) -> Vec<RunId> {
        let state = self.lock();
        let mut runs: Vec<RunId> = state
            .manifest
            .files
            .iter()
            .filter(|f| f.table == table.as_str())
            .map(|f| f.run.clone())
            .collect();
        runs.sort();
        runs.dedup();
        runs
    }

    /// Every Parquet file with its metadata (for tests and tooling).
    pub fn files(&self) -> Vec<FileMeta> {
        self.lock().manifest.files.clone()
    }
}

/// Puts the partition column back in front of a stored batch.
pub fn add_run_column(batch: &RecordBatch, run: &RunId) -> Result<RecordBatch> {
    let mut fields = vec![Arc::new(arrow_schema::Field::new(
        "run",
        arrow_schema::DataType::Utf8,
        false,
    ))];
    fields.extend(batch.schema().fields().iter().cloned());
    let mut columns: Vec<arrow_array::ArrayRef> =
        vec![Arc::new(arrow_array::StringArray::from(vec![
            run.as_str();
            batch
                .num_rows(
                )
        ]))];
    columns.extend(batch.columns().iter().cloned());
    RecordBatch::try_new(Arc::new(arrow_schema::Schema::new(fields)), columns).map_err(Error::Arrow)
}
