//! Run deletion: the manifest drops the run's files (deleted after the grace period), a
//! tombstone keeps its records still in the write-ahead log from coming back at replay, and
//! its hot rows, summary, keys and alerts go.
//!
//! The store's lock is not held across the manifest's write (on object storage a PUT, which
//! every acknowledgement would wait behind): what goes is chosen under the lock — the records
//! applied so far, the rows they made (the first batches of each hot part), the alerts raised
//! so far — the manifest is written without it, then those go under the lock again. Records of
//! the run applied meanwhile come after the tombstone (the log applies records in order): they
//! start the run anew and stay, with their alerts; its run-table entry is written again by the
//! next flush. Like flushes it runs under the maintenance lock (`Store::under_maintenance`), so
//! no flush moves the hot rows between the phases.

use std::sync::Arc;
use std::time::Instant;

use rankwatch_analytics::RunId;

use super::manifest::FileMeta;
use super::{Deleted, Event, Store};
use crate::entry::Table;
use crate::error::{Error, Result};

/// The tables whose hot rows a deletion drops.
const TABLES: [Table; 2] = [Table::Samples, Table::Sketches];

impl Store {
    /// Deletes a run: its Parquet files (after the grace period queries get), its rows in
    /// the hot buffer, its run metadata and alerts. Serialised with flushes and compactions.
    /// Records of the run still in the write-ahead log are tombstoned in the manifest, so a
    /// restart does not bring them back. Rows that arrive afterwards start the run anew.
    pub async fn delete_run(self: &Arc<Self>, run: &RunId) -> Result<Deleted> {
        let run = run.clone();
        self.under_maintenance("deletion", move |store| store.delete_run_blocking(&run))
            .await
    }

    fn delete_run_blocking(&self, run: &RunId) -> Result<Deleted> {
        // Phase 1, under the lock: what goes. The records applied so far (through `through`)
        // are the run's old ones; their rows are the first `old_batches` of each hot part
        // (parts only grow by appending, and flushes wait on `maintenance`, held here).
        let (manifest, gone, through, old_batches, old_alerts) = {
            let mut guard = self.lock();
            let state = &mut *guard;
            if !state.runs.contains_key(run) && !state.manifest.files.iter().any(|f| f.run == *run)
            {
                return Err(Error::UnknownRun(run.to_string()));
            }
            let mut manifest = state.manifest.clone();
            let (gone, kept): (Vec<FileMeta>, Vec<FileMeta>) =
                manifest.files.into_iter().partition(|f| f.run == *run);
            manifest.files = kept;
            let through = state.applied_seq;
            if through > manifest.flushed_seq {
                manifest.deleted_runs.insert(run.clone(), through);
            }
            let old_batches = TABLES.map(|t| {
                state
                    .hot
                    .get(&(t, run.clone()))
                    .map_or(0, |p| p.batches.len())
            });
            // With their revisions: an alert changed meanwhile is about the new rows.
            let old_alerts: Vec<(String, Option<u64>)> = state
                .alerts
                .values()
                .filter(|a| a.run == *run)
                .map(|a| (a.id.clone(), state.alert_revisions.get(&a.id).copied()))
                .collect();
            (manifest, gone, through, old_batches, old_alerts)
        };
        // Phase 2, without it: the manifest's write (a PUT to object storage can take a
        // while, and every acknowledgement needs the lock). Until it commits, readers still
        // see the run; a failure leaves everything as it was.
        self.backend.save_manifest(&manifest)?;
        let mut guard = self.lock();
        let state = &mut *guard;
        // Phase 3, under the lock again: the old rows, summary, keys and alerts go; rows that
        // arrived meanwhile (records after `through`) start the run anew and stay.
        debug_assert_eq!(state.manifest.flushed_seq, manifest.flushed_seq);
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
        // Anything of the run applied after `through` (rows, or its info alone) starts it anew.
        let anew = state.runs.get(run).is_some_and(|s| s.last_seq > through);
        for (table, old) in TABLES.into_iter().zip(old_batches) {
            let key = (table, run.clone());
            let Some(part) = state.hot.get_mut(&key) else {
                continue;
            };
            let dropped: Vec<_> = part.batches.drain(..old.min(part.batches.len())).collect();
            let bytes: usize = dropped.iter().map(|b| b.get_array_memory_size()).sum();
            part.bytes = part.bytes.saturating_sub(bytes);
            state.hot_bytes = state.hot_bytes.saturating_sub(bytes);
            if table == Table::Samples {
                deleted.rows += dropped.iter().map(|b| b.num_rows() as u64).sum::<u64>();
            }
            if part.batches.is_empty() {
                state.hot.remove(&key);
            }
        }
        if let Some(old) = state.runs.remove(run) {
            state.total_series = state.total_series.saturating_sub(old.series.len());
            if anew {
                // The run as its new rows make it (its latest info and time carried over).
                let mut summary = super::index::RunSummary::default();
                summary.info = old.info;
                summary.last_seen_ms = old.last_seen_ms;
                summary.last_seq = old.last_seq;
                for batch in state.unflushed(Table::Samples, run) {
                    summary.add_samples(&batch, old.last_seen_ms);
                }
                summary.sketches = state
                    .unflushed(Table::Sketches, run)
                    .iter()
                    .map(|b| b.num_rows() as u64)
                    .sum();
                state.total_series += summary.series.len();
                state.runs.insert(run.clone(), summary);
                // Its run-table file goes with the old run's files: written again by the
                // next flush.
                state.runs_dirty.push(run.clone());
            }
        }
        if !anew {
            // A run started anew keeps the keys of its new batches (a retry of an old one is
            // then acknowledged without being stored: it would have started the run anew).
            state.keys.forget_run(run);
            state.runs_dirty.retain(|r| r != run);
            state.alerts_dirty.retain(|r| r != run);
        }
        let mut removed_alerts = 0;
        for (id, revision) in &old_alerts {
            if state.alert_revisions.get(id).copied() == *revision {
                state.alerts.remove(id);
                state.alert_revisions.remove(id);
                removed_alerts += 1;
            }
        }
        deleted.alerts = removed_alerts;
        // Alerts raised or changed meanwhile (about the new rows) are kept, and journalled
        // again after the deletion's line, which would otherwise drop them at the next start.
        let kept_alerts: Vec<_> = state
            .alerts
            .values()
            .filter(|a| a.run == *run)
            .cloned()
            .collect();
        if !kept_alerts.is_empty() && !state.alerts_dirty.contains(run) {
            state.alerts_dirty.push(run.clone());
        }
        let now = Instant::now();
        state
            .graveyard
            .extend(gone.iter().map(|f| (now, f.relative())));
        self.metrics.hot_bytes.set(state.hot_bytes as i64);
        self.room_freed.notify_waiters();
        self.metrics.runs_deleted.inc();
        self.publish(Event::RunDeleted {
            run: run.to_string(),
        });
        drop(guard);
        self.sweep_unlisted();
        // Older journal lines of the run must not bring its alerts back at the next start.
        if let Err(e) = self.alert_log.run_deleted(run) {
            tracing::warn!(%run, error = %e, "could not journal the run's deletion");
        }
        if !kept_alerts.is_empty()
            && let Err(e) = self.alert_log.append(&kept_alerts)
        {
            tracing::warn!(%run, error = %e, "could not journal the run's new alerts again");
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
}
