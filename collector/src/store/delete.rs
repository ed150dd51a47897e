//! Run deletion: the manifest drops the run's files (deleted after the grace period), a
//! tombstone keeps its records still in the write-ahead log from coming back at replay, and
//! its hot rows, summary, keys and alerts go.

use std::sync::Arc;
use std::time::Instant;

use rankwatch_analytics::RunId;

use super::manifest::FileMeta;
use super::{Deleted, Event, Store};
use crate::entry::Table;
use crate::error::{Error, Result};

impl Store {
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
        if let Some(summary) = state.runs.remove(run) {
            state.total_series = state.total_series.saturating_sub(summary.series.len());
        }
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
        self.sweep_unlisted();
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
}
