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
//! A flush moves all hot batches to `flushing` (still readable), writes one sorted Parquet
//! file per (table, run) without holding the lock, saves the key snapshot, then commits a new
//! manifest (`flushed_seq` = the `applied_seq` it started from) and drops the flushed batches
//! in the same critical section. Only then is the log truncated. Compaction merges small files
//! of one run into one, commits the manifest, and deletes the old files after a grace period
//! so queries already planned on them finish. A crash anywhere leaves the previous manifest,
//! the log records after its `flushed_seq`, and possibly unlisted files, which start-up
//! deletes.

pub mod alert_log;
pub mod backend;
pub mod files;
pub mod index;
pub mod manifest;
pub mod metrics;
pub mod rollup;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use arrow_array::RecordBatch;
use rankwatch_analytics::schema::{alerts, runs};
use rankwatch_analytics::{Alert, RunId, RunInfo};
use tokio::sync::{Notify, broadcast};

use crate::clock::SharedClock;
use crate::entry::{Entry, Table};
use crate::error::{Error, Result};
use crate::idempotency::{Check, Key, KeySet};
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
    /// Its first and last step (unknown only for an empty part).
    pub steps: Option<(u64, u64)>,
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
    metrics: StoreMetrics,
    clock: SharedClock,
    /// Serialises flushes and compactions (each commits a manifest).
    maintenance: tokio::sync::Mutex<()>,
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
            metrics: StoreMetrics::default(),
            maintenance: tokio::sync::Mutex::new(()),
            epoch: clock.now_ms(),
            clock,
        };
        store.load_runs_and_alerts()?;
        store.apply_journal(journaled);
        store.report_sizes();
        Ok(store)
    }

    /// Lays the journal's alert changes over the alerts read from Parquet; the runs they touch
    /// are written to Parquet by the next flush, after which the journal files go.
    fn apply_journal(&self, journaled: alert_log::Recovered) {
        let mut state = self.lock();
        for run in &journaled.deleted {
            state.alerts.retain(|_, a| &a.run != run);
        }
        for (id, alert) in journaled.alerts {
            let newer = state
                .alerts
                .get(&id)
                .is_none_or(|old| old.updated_at_ms <= alert.updated_at_ms);
            if newer {
                state.alerts_dirty.push(alert.run.clone());
                state.alerts.insert(id, alert);
            }
        }
    }

    /// Makes alert changes (already upserted) durable: the alert engine calls this before it
    /// tells any receiver.
    pub fn journal_alerts(&self, alerts: &[Alert]) -> Result<()> {
        self.alert_log.append(alerts)
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

    /// The world size a run announced, if any (without copying its metadata).
    pub fn world_size(&self, run: &RunId) -> Option<u32> {
        self.lock()
            .runs
            .get(run)
            .and_then(|r| r.info.as_ref())
            .map(|i| i.world_size)
    }

    /// Refuses with 429 (and starts a flush) while the hot buffer is at twice its budget:
    /// ingest asks before it reads a body, and again when it commits.
    pub fn check_budget(&self) -> Result<()> {
        let hot = self.lock().hot_bytes;
        self.budget_left(hot)
    }

    fn budget_left(&self, hot_bytes: usize) -> Result<()> {
        if hot_bytes >= self.limits.hot_budget_bytes.saturating_mul(2) {
            self.flush_wanted.notify_one();
            return Err(Error::Backpressure {
                bytes: hot_bytes,
                retry_after_s: 1,
            });
        }
        Ok(())
    }

    /// Admission control before a batch is logged: memory budget, cardinality, idempotency.
    pub fn begin(&self, key: Option<&Key>, entry: &Entry) -> Result<Admission> {
        let mut state = self.lock();
        if let Some(key) = key {
            match state.keys.begin(key) {
                Check::Applied => return Ok(Admission::Duplicate),
                Check::InFlight => return Err(Error::InFlight(key.to_string())),
                Check::New => {}
            }
        }
        let refuse = |state: &mut State, error: Error| -> Result<Admission> {
            if let Some(key) = key {
                state.keys.abort(key);
            }
            Err(error)
        };
        if let Err(e) = self.budget_left(state.hot_bytes) {
            return refuse(&mut state, e);
        }
        if !state.runs.contains_key(&entry.run)
            && let Some(twin) = state
                .runs
                .keys()
                .find(|r| r.as_str().eq_ignore_ascii_case(entry.run.as_str()))
        {
            // On a case-insensitive file system (macOS, Windows) or a data set copied to one,
            // `run=Run1/` and `run=run1/` are one folder: the two runs' parts would mix.
            let error = Error::bad(format!(
                "run id {:?} differs from the existing run {:?} only in letter case; run ids \
                 must differ in more than case (their folders collide on case-insensitive \
                 file systems)",
                entry.run.as_str(),
                twin.as_str()
            ));
            return refuse(&mut state, error);
        }
        let new_run = !state.runs.contains_key(&entry.run);
        if new_run && !state.reserved_runs.contains_key(&entry.run) {
            let runs = state.runs.len() + state.reserved_runs.len();
            if runs >= self.limits.max_runs {
                let error = Error::Cardinality(format!(
                    "the collector keeps {runs} runs, its limit (--max-runs {}): run {} is \
                     not taken; delete runs (rankwatch runs delete) or let retention remove \
                     them",
                    self.limits.max_runs, entry.run
                ));
                return refuse(&mut state, error);
            }
        }
        let mut reservation = Reservation { series: 0, new_run };
        if let Some(samples) = &entry.samples {
            let summary = state.runs.get(&entry.run);
            let have = summary.map_or(0, |s| s.series.len());
            let batch = files::without_run(samples)?;
            let fresh = match summary {
                Some(s) => s.new_series(&batch),
                None => RunSummary::default().new_series(&batch),
            };
            // Batches in flight count with their new series (conservatively: two in flight
            // with the same new series count it twice until one is applied).
            let pending = state.reserved_series.get(&entry.run).copied().unwrap_or(0);
            if have + pending + fresh > self.limits.max_series_per_run {
                let limit = self.limits.max_series_per_run;
                return refuse(
                    &mut state,
                    Error::Cardinality(format!(
                        "run {} would have {} series (metric, layer, site, rank), over the limit of {limit}; \
                         this batch adds {fresh} new ones{}",
                        entry.run,
                        have + pending + fresh,
                        if pending > 0 {
                            format!(" and batches being written add up to {pending}")
                        } else {
                            String::new()
                        }
                    )),
                );
            }
            if fresh > 0 {
                *state.reserved_series.entry(entry.run.clone()).or_default() += fresh;
            }
            reservation.series = fresh;
        }
        if new_run {
            *state.reserved_runs.entry(entry.run.clone()).or_default() += 1;
        }
        Ok(Admission::Write(reservation))
    }

    /// Ends an admitted batch's reservation (it was applied, or failed).
    pub fn release(&self, run: &RunId, reservation: Reservation) {
        if reservation == Reservation::default() {
            return;
        }
        let mut state = self.lock();
        let state = &mut *state;
        for (map, n) in [
            (&mut state.reserved_series, reservation.series),
            (&mut state.reserved_runs, usize::from(reservation.new_run)),
        ] {
            if n == 0 {
                continue;
            }
            if let Some(left) = map.get_mut(run) {
                *left = left.saturating_sub(n);
                if *left == 0 {
                    map.remove(run);
                }
            }
        }
    }

    /// Forgets an in-flight key whose write failed.
    pub fn abort(&self, key: &Key) {
        self.lock().keys.abort(key);
    }

    /// Applies a durable entry (called by the log writer in sequence order, and by replay).
    pub fn apply(&self, seq: u64, key: Option<&Key>, entry: &Entry, seen_ms: i64) -> Result<()> {
        let samples = entry.samples.as_ref().map(files::without_run).transpose()?;
        let sketches = entry
            .sketches
            .as_ref()
            .map(files::without_run)
            .transpose()?;
        let mut events = Vec::new();
        {
            let mut state = self.lock();
            let state = &mut *state;
            state.applied_seq = state.applied_seq.max(seq);
            if let Some(key) = key {
                state.keys.commit(key, self.clock.now_ms());
            }
            // A record of a run deleted after it was logged (only seen in replay).
            if state
                .manifest
                .deleted_runs
                .get(&entry.run)
                .is_some_and(|&through| seq <= through)
            {
                return Ok(());
            }
            let summary = state.runs.entry(entry.run.clone()).or_default();
            summary.last_seen_ms = summary.last_seen_ms.max(seen_ms);
            if let Some(info) = &entry.info {
                if summary.info.as_ref() != Some(info) {
                    summary.info = Some(info.clone());
                    state.runs_dirty.push(entry.run.clone());
                }
                events.push(Event::Run {
                    run: entry.run.to_string(),
                    world_size: info.world_size,
                });
            }
            if let Some(batch) = &samples {
                summary.add_samples(batch, seen_ms);
                let (first, last) = files::step_range(batch);
                events.push(Event::Samples {
                    run: entry.run.to_string(),
                    rows: batch.num_rows() as u64,
                    first_step: first.unwrap_or(0),
                    last_step: last.unwrap_or(0),
                });
            }
            if let Some(batch) = &sketches {
                summary.sketches += batch.num_rows() as u64;
            }
            for (table, batch) in [(Table::Samples, samples), (Table::Sketches, sketches)] {
                if let Some(batch) = batch {
                    let bytes = batch.get_array_memory_size();
                    let part = state.hot.entry((table, entry.run.clone())).or_default();
                    part.bytes += bytes;
                    part.batches.push(batch);
                    state.hot_bytes += bytes;
                }
            }
            self.metrics.hot_bytes.set(state.hot_bytes as i64);
            if state.hot_bytes >= self.limits.hot_budget_bytes {
                self.flush_wanted.notify_one();
            }
        }
        for event in events {
            self.publish(event);
        }
        Ok(())
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
            .map(|f| SamplesPart {
                samples: f.relative(),
                rollup: of_run
                    .iter()
                    .find(|r| r.table == rollup::TABLE && r.pairs(f))
                    .map(|r| r.relative()),
                steps: f.min_step.zip(f.max_step),
            })
            .collect();
        let hot = state.unflushed(Table::Samples, run);
        SamplesView { parts, hot }
    }

    /// Runs the closure on the run index (read-only).
    pub fn with_runs<T>(&self, f: impl FnOnce(&BTreeMap<RunId, RunSummary>) -> T) -> T {
        f(&self.lock().runs)
    }

    /// Alerts, filtered.
    pub fn alerts(&self, run: Option<&RunId>) -> Vec<Alert> {
        self.lock()
            .alerts
            .values()
            .filter(|a| run.is_none_or(|r| a.run == *r))
            .cloned()
            .collect()
    }

    /// Records an alert's new state (the alert engine's entry point); persisted at the next
    /// flush, announced at once.
    pub fn upsert_alert(&self, alert: Alert) {
        {
            let mut state = self.lock();
            state.alerts_dirty.push(alert.run.clone());
            state.alert_revision += 1;
            let revision = state.alert_revision;
            state.alert_revisions.insert(alert.id.clone(), revision);
            state.alerts.insert(alert.id.clone(), alert.clone());
        }
        self.publish(Event::Alert {
            alert: Box::new((&alert).into()),
        });
    }

    /// The alerts of `run` that changed after `revision`, oldest change first, with the latest
    /// revision.
    pub fn alert_changes(&self, run: &RunId, revision: u64) -> (u64, Vec<Alert>) {
        let state = self.lock();
        let mut changed: Vec<(u64, Alert)> = state
            .alert_revisions
            .iter()
            .filter(|(_, rev)| **rev > revision)
            .filter_map(|(id, rev)| state.alerts.get(id).map(|a| (*rev, a)))
            .filter(|(_, a)| a.run == *run)
            .map(|(rev, a)| (rev, a.clone()))
            .collect();
        changed.sort_by_key(|(rev, _)| *rev);
        (
            state.alert_revision,
            changed.into_iter().map(|(_, a)| a).collect(),
        )
    }

    /// When this store was opened (ms since the epoch): alert revisions count from there.
    pub fn epoch(&self) -> i64 {
        self.epoch
    }

    /// Bytes in the hot buffer.
    pub fn hot_bytes(&self) -> usize {
        self.lock().hot_bytes
    }

    /// Moves every hot batch into Parquet and commits a manifest. Returns the flushed sequence
    /// number when something was committed.
    pub async fn flush(self: &Arc<Self>) -> Result<Option<u64>> {
        let _guard = self.maintenance.lock().await;
        let store = self.clone();
        tokio::task::spawn_blocking(move || store.flush_blocking())
            .await
            .map_err(|e| Error::Unavailable(format!("flush task failed: {e}")))?
    }

    fn flush_blocking(&self) -> Result<Option<u64>> {
        let started = Instant::now();
        // Keys of runs that gained none within the window: dropped from memory and disk (no
        // manifest is involved; a retry after that long is stored again, as documented).
        let cutoff = self.clock.now_ms() - self.limits.key_window.as_millis() as i64;
        let expired = self.lock().keys.expire(cutoff);
        for run in &expired {
            if let Err(e) = crate::idempotency::remove_run_file(&self.dir, run) {
                tracing::warn!(%run, error = %e, "could not remove an expired key file");
            }
        }
        {
            let state = self.lock();
            let nothing_new = state.applied_seq == state.manifest.flushed_seq
                && state.runs_dirty.is_empty()
                && state.alerts_dirty.is_empty()
                && state.hot.is_empty();
            if nothing_new {
                return Ok(None);
            }
        }
        // Before the snapshot, outside the lock: the journal files up to here hold changes the
        // snapshot below has (see `alert_log`).
        let journal = self.alert_log.rotate();
        let (through, parts, infos, alerts, keys) = {
            let mut state = self.lock();
            let through = state.applied_seq;
            let hot = std::mem::take(&mut state.hot);
            state.hot_bytes = 0;
            let parts: Vec<(Table, RunId)> = hot.keys().cloned().collect();
            state.flushing.extend(hot);
            let infos: Vec<RunInfo> = dedup(std::mem::take(&mut state.runs_dirty))
                .iter()
                .filter_map(|r| state.runs.get(r).and_then(|s| s.info.clone()))
                .collect();
            let alerts: Vec<(RunId, Vec<Alert>)> = dedup(std::mem::take(&mut state.alerts_dirty))
                .into_iter()
                .map(|run| {
                    let of_run = state
                        .alerts
                        .values()
                        .filter(|a| a.run == run)
                        .cloned()
                        .collect();
                    (run, of_run)
                })
                .collect();
            // The keys of the runs changed up to `through` (a file may run ahead of the
            // manifest, never behind it: see `idempotency`).
            (through, parts, infos, alerts, state.keys.take_changes())
        };
        let written = keys
            .save(&self.dir)
            .and_then(|_| self.write_flush(&parts, &infos, &alerts))
            .and_then(|(new_files, replaced)| {
                let mut manifest = self.lock().manifest.clone();
                manifest.files.retain(|f| !replaced.contains(&f.relative()));
                let rows: u64 = new_files.iter().map(|f| f.rows).sum();
                manifest.next_part += new_files.len() as u64;
                manifest.files.extend(new_files);
                manifest.flushed_seq = through;
                // The log no longer holds records at or below `through`.
                manifest.deleted_runs.retain(|_, seq| *seq > through);
                self.backend.save_manifest(&manifest)?;
                Ok((manifest, replaced, rows))
            });
        let mut state = self.lock();
        match written {
            Ok((manifest, replaced, rows)) => {
                // Commit for readers: the new files appear as the flushed batches vanish.
                state.manifest = manifest;
                state.flushing.clear();
                let now = Instant::now();
                state
                    .graveyard
                    .extend(replaced.into_iter().map(|p| (now, p)));
                drop(state);
                match journal {
                    Ok(Some(covered)) => {
                        if let Err(e) = self.alert_log.remove_through(covered) {
                            tracing::warn!(error = %e, "could not remove flushed alert-journal files");
                        }
                    }
                    Ok(None) => {}
                    Err(e) => {
                        tracing::warn!(error = %e, "could not start a new alert-journal file")
                    }
                }
                self.metrics.flushes.inc();
                self.metrics.flushed_rows.inc_by(rows);
                self.metrics
                    .flush_seconds
                    .observe(started.elapsed().as_secs_f64());
                self.report_sizes();
                Ok(Some(through))
            }
            Err(e) => {
                // Put the batches back so the next flush retries them; nothing is lost since
                // the log still holds them.
                let flushing = std::mem::take(&mut state.flushing);
                for (key, part) in flushing {
                    state.hot_bytes += part.bytes;
                    let slot = state.hot.entry(key).or_default();
                    slot.bytes += part.bytes;
                    let mut batches = part.batches;
                    batches.append(&mut slot.batches);
                    slot.batches = batches;
                }
                state.keys.unwritten(&keys);
                state.runs_dirty.extend(infos.into_iter().map(|i| i.run));
                state
                    .alerts_dirty
                    .extend(alerts.into_iter().map(|(r, _)| r));
                self.metrics.flush_errors.inc();
                Err(e)
            }
        }
    }

    /// Writes the Parquet files of a flush; returns the new files and the relative paths of
    /// files they replace (older run metadata and alert files).
    fn write_flush(
        &self,
        parts: &[(Table, RunId)],
        infos: &[RunInfo],
        alerts: &[(RunId, Vec<Alert>)],
    ) -> Result<(Vec<FileMeta>, Vec<PathBuf>)> {
        let mut next_part = self.lock().manifest.next_part;
        let mut new_files = Vec::new();
        let mut replaced = Vec::new();
        for (table, run) in parts {
            let batches: Vec<RecordBatch> = {
                let state = self.lock();
                state
                    .flushing
                    .iter()
                    .filter(|(k, _)| k.0 == *table && k.1 == *run)
                    .flat_map(|(_, p)| p.batches.iter().cloned())
                    .collect()
            };
            if batches.is_empty() {
                continue;
            }
            let batch = files::sorted(*table, &batches)?;
            new_files.extend(self.write_part(*table, run, next_part, &batch)?);
            next_part += 1;
        }
        for info in infos {
            let batch = files::without_run(&runs::to_batch(std::slice::from_ref(info))?)?;
            replaced.extend(self.files_of(runs::TABLE, &info.run));
            new_files.push(self.write_file(
                runs::TABLE,
                files::Layout::UNSORTED,
                &info.run,
                next_part,
                std::slice::from_ref(&batch),
            )?);
            next_part += 1;
        }
        for (run, of_run) in alerts {
            replaced.extend(self.files_of(alerts::TABLE, run));
            if of_run.is_empty() {
                continue;
            }
            let batch = files::without_run(&alerts::to_batch(of_run)?)?;
            new_files.push(self.write_file(
                alerts::TABLE,
                files::Layout::UNSORTED,
                run,
                next_part,
                std::slice::from_ref(&batch),
            )?);
            next_part += 1;
        }
        Ok((new_files, replaced))
    }

    fn files_of(&self, table: &str, run: &RunId) -> Vec<PathBuf> {
        self.lock()
            .manifest
            .files
            .iter()
            .filter(|f| f.table == table && f.run == *run)
            .map(FileMeta::relative)
            .collect()
    }

    /// Writes one part of `table` (sorted in its order) and, for samples, its rollup part
    /// under the same number.
    fn write_part(
        &self,
        table: Table,
        run: &RunId,
        part: u64,
        batch: &RecordBatch,
    ) -> Result<Vec<FileMeta>> {
        let meta = self.write_file(
            table.as_str(),
            files::Layout::of(table),
            run,
            part,
            std::slice::from_ref(batch),
        )?;
        let rollup = if table == Table::Samples {
            self.write_rollup(&meta, batch)?
        } else {
            None
        };
        Ok([Some(meta), rollup].into_iter().flatten().collect())
    }

    /// Writes the rollup of the samples part `samples` (whose rows are `batch`), unless its
    /// series are too short for one; such a part is remembered, not summarised again.
    fn write_rollup(&self, samples: &FileMeta, batch: &RecordBatch) -> Result<Option<FileMeta>> {
        let Some(summary) = rollup::summarise(batch)? else {
            self.lock().without_rollup.insert(samples.relative());
            return Ok(None);
        };
        let mut meta = self.write_file(
            rollup::TABLE,
            rollup::LAYOUT,
            &samples.run,
            samples.part,
            &summary,
        )?;
        // The steps it covers are its part's (a rollup has window starts, not steps).
        (meta.min_step, meta.max_step) = (samples.min_step, samples.max_step);
        Ok(Some(meta))
    }

    /// Writes one file in `layout` holding the rows of `batches`, in order.
    fn write_file(
        &self,
        name: &str,
        layout: files::Layout,
        run: &RunId,
        part: u64,
        batches: &[RecordBatch],
    ) -> Result<FileMeta> {
        let node = self.backend.node();
        let relative = manifest::file_path(name, run, node, part);
        let bytes = self.backend.write(layout, batches, &relative)?;
        let ranges = batches.iter().map(files::step_range);
        let min_step = ranges.clone().filter_map(|r| r.0).min();
        let max_step = ranges.filter_map(|r| r.1).max();
        Ok(FileMeta {
            table: name.to_owned(),
            run: run.clone(),
            part,
            rows: batches.iter().map(|b| b.num_rows() as u64).sum(),
            bytes,
            min_step,
            max_step,
            node: node.map(str::to_owned),
        })
    }

    /// Merges the small sample and sketch files of each run (see the module docs). Returns
    /// how many files were merged away.
    pub async fn compact(self: &Arc<Self>) -> Result<usize> {
        let _guard = self.maintenance.lock().await;
        let store = self.clone();
        tokio::task::spawn_blocking(move || store.compact_blocking())
            .await
            .map_err(|e| Error::Unavailable(format!("compaction task failed: {e}")))?
    }

    fn compact_blocking(&self) -> Result<usize> {
        self.bury_old_files();
        let candidates: Vec<(Table, RunId, Vec<FileMeta>)> = {
            let state = self.lock();
            let mut groups: BTreeMap<(&str, RunId), Vec<FileMeta>> = BTreeMap::new();
            for f in &state.manifest.files {
                if (f.table == "samples" || f.table == "sketches")
                    && f.rows < self.limits.compact_small_rows
                {
                    groups
                        .entry((
                            if f.table == "samples" {
                                "samples"
                            } else {
                                "sketches"
                            },
                            f.run.clone(),
                        ))
                        .or_default()
                        .push(f.clone());
                }
            }
            groups
                .into_iter()
                .filter_map(|((t, run), mut fs)| {
                    fs.sort_by_key(|f| f.part);
                    // Oldest first, up to the memory bound.
                    let mut total = 0;
                    fs.retain(|f| {
                        total += f.rows;
                        total <= self.limits.compact_max_rows
                    });
                    let table = if t == "samples" {
                        Table::Samples
                    } else {
                        Table::Sketches
                    };
                    (fs.len() >= 2).then_some((table, run, fs))
                })
                .collect()
        };
        let mut merged = 0;
        for (table, run, group) in candidates {
            let started = Instant::now();
            let mut batches = Vec::new();
            for f in &group {
                batches.extend(self.backend.read(&f.relative())?);
            }
            let batch = files::sorted(table, &batches)?;
            let part = {
                let mut state = self.lock();
                let p = state.manifest.next_part;
                state.manifest.next_part += 1;
                p
            };
            let metas = self.write_part(table, &run, part, &batch)?;
            let mut manifest = self.lock().manifest.clone();
            // The merged parts and their rollups go.
            let old: Vec<PathBuf> = manifest
                .files
                .iter()
                .filter(|f| group.iter().any(|g| g.pairs(f)))
                .map(FileMeta::relative)
                .collect();
            manifest.files.retain(|f| !old.contains(&f.relative()));
            manifest.files.extend(metas);
            self.backend.save_manifest(&manifest)?;
            {
                let mut state = self.lock();
                // Keep the part counter reserved above.
                manifest.next_part = manifest.next_part.max(state.manifest.next_part);
                state.manifest = manifest;
                let now = Instant::now();
                state.graveyard.extend(old.into_iter().map(|p| (now, p)));
            }
            merged += group.len();
            self.metrics.compactions.inc();
            self.metrics.compacted_files.inc_by(group.len() as u64);
            self.metrics
                .compaction_seconds
                .observe(started.elapsed().as_secs_f64());
        }
        self.add_missing_rollups()?;
        self.report_sizes();
        Ok(merged)
    }

    /// Writes the rollup of each samples part of this collector that has none (written before
    /// rollups existed), one manifest commit per part. Until then its queries read raw rows.
    fn add_missing_rollups(&self) -> Result<usize> {
        let missing: Vec<FileMeta> = {
            let mut guard = self.lock();
            let state = &mut *guard;
            let files = &state.manifest.files;
            let listed: std::collections::HashSet<PathBuf> =
                files.iter().map(FileMeta::relative).collect();
            // Parts merged or deleted since are forgotten.
            state.without_rollup.retain(|p| listed.contains(p));
            let with_rollup: Vec<&FileMeta> =
                files.iter().filter(|f| f.table == rollup::TABLE).collect();
            files
                .iter()
                .filter(|f| {
                    f.table == Table::Samples.as_str()
                        && f.node.as_deref() == self.backend.node()
                        && !with_rollup.iter().any(|r| r.pairs(f))
                        && !state.without_rollup.contains(&f.relative())
                })
                .cloned()
                .collect()
        };
        let mut written = 0;
        for f in &missing {
            // A part is sorted, so its batches in order are too.
            let batches = self.backend.read(&f.relative())?;
            let batch =
                arrow_select::concat::concat_batches(&files::file_schema(Table::Samples), &batches)
                    .map_err(Error::Arrow)?;
            let Some(meta) = self.write_rollup(f, &batch)? else {
                continue;
            };
            let mut manifest = self.lock().manifest.clone();
            manifest.files.push(meta);
            self.backend.save_manifest(&manifest)?;
            let mut state = self.lock();
            manifest.next_part = manifest.next_part.max(state.manifest.next_part);
            state.manifest = manifest;
            written += 1;
        }
        if !missing.is_empty() {
            tracing::info!(
                parts = missing.len(),
                written,
                "older samples parts checked for rollups"
            );
        }
        Ok(missing.len())
    }

    /// Deletes a run: its Parquet files (after the grace period queries get), its rows in
    /// the hot buffer, its run metadata and alerts. Serialised with flushes and compactions.
    /// Records of the run still in the write-ahead log are tombstoned in the manifest, so a
    /// restart does not bring them back. Rows that arrive afterwards start the run anew.
    pub async fn delete_run(self: &Arc<Self>, run: &RunId) -> Result<Deleted> {
        let _guard = self.maintenance.lock().await;
        let store = self.clone();
        let run = run.clone();
        tokio::task::spawn_blocking(move || store.delete_run_blocking(&run))
            .await
            .map_err(|e| Error::Unavailable(format!("deletion task failed: {e}")))?
    }

    fn delete_run_blocking(&self, run: &RunId) -> Result<Deleted> {
        let mut guard = self.lock();
        let state = &mut *guard;
        if !state.runs.contains_key(run) && !state.manifest.files.iter().any(|f| f.run == *run) {
            return Err(Error::UnknownRun(run.to_string()));
        }
        let mut manifest = state.manifest.clone();
        let (gone, kept): (Vec<FileMeta>, Vec<FileMeta>) =
            manifest.files.into_iter().partition(|f| f.run == *run);
        manifest.files = kept;
        if state.applied_seq > manifest.flushed_seq {
            manifest.deleted_runs.insert(run.clone(), state.applied_seq);
        }
        // The lock is held across this one small write (unlike flushes): a record of the run
        // applied between choosing the tombstone and dropping the hot rows would be lost from
        // memory yet replayed after a restart.
        self.backend.save_manifest(&manifest)?;
        state.manifest = manifest;
        let mut deleted = Deleted {
            run: run.to_string(),
            files: gone.len() as u64,
            bytes: gone.iter().map(|f| f.bytes).sum(),
            rows: gone
                .iter()
                .filter(|f| f.table == Table::Samples.as_str())
                .map(|f| f.rows)
                .sum(),
            ..Deleted::default()
        };
        for table in [Table::Samples, Table::Sketches] {
            if let Some(part) = state.hot.remove(&(table, run.clone())) {
                state.hot_bytes = state.hot_bytes.saturating_sub(part.bytes);
                if table == Table::Samples {
                    deleted.rows += part
                        .batches
                        .iter()
                        .map(|b| b.num_rows() as u64)
                        .sum::<u64>();
                }
            }
        }
        state.runs.remove(run);
        state.keys.forget_run(run);
        state.runs_dirty.retain(|r| r != run);
        state.alerts_dirty.retain(|r| r != run);
        let ids: Vec<String> = state
            .alerts
            .values()
            .filter(|a| a.run == *run)
            .map(|a| a.id.clone())
            .collect();
        for id in &ids {
            state.alerts.remove(id);
            state.alert_revisions.remove(id);
        }
        deleted.alerts = ids.len() as u64;
        let now = Instant::now();
        state
            .graveyard
            .extend(gone.iter().map(|f| (now, f.relative())));
        self.metrics.hot_bytes.set(state.hot_bytes as i64);
        self.metrics.runs_deleted.inc();
        self.publish(Event::RunDeleted {
            run: run.to_string(),
        });
        drop(guard);
        // Older journal lines of the run must not bring its alerts back at the next start.
        if let Err(e) = self.alert_log.run_deleted(run) {
            tracing::warn!(%run, error = %e, "could not journal the run's deletion");
        }
        // A retry of the deleted run's batches would start it anew in any case (see
        // docs/operations.md); its keys only took room.
        if let Err(e) = crate::idempotency::remove_run_file(&self.dir, run) {
            tracing::warn!(%run, error = %e, "could not remove the deleted run's key file");
        }
        self.report_sizes();
        tracing::info!(%run, files = deleted.files, bytes = deleted.bytes, rows = deleted.rows, "run deleted");
        Ok(deleted)
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

    /// Deletes replaced files whose grace period is over.
    fn bury_old_files(&self) {
        let due: Vec<PathBuf> = {
            let mut state = self.lock();
            let grace = self.limits.file_grace;
            let (due, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut state.graveyard)
                .into_iter()
                .partition(|(t, _)| t.elapsed() >= grace);
            state.graveyard = keep;
            due.into_iter().map(|(_, p)| p).collect()
        };
        for path in due {
            if let Err(e) = self.backend.remove(&path) {
                tracing::warn!(file = %path.display(), error = %e, "could not delete a replaced file");
            }
        }
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
            .filter(|f| f.table == runs::TABLE || f.table == alerts::TABLE)
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
                    for alert in alerts::from_batch(&with_run)? {
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
        f(state.runs.entry(run.clone()).or_default())
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

fn dedup(mut runs: Vec<RunId>) -> Vec<RunId> {
    runs.sort();
    runs.dedup();
    runs
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
