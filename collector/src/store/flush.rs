//! Flush: hot batches → sorted Parquet parts (and their rollups) → a new manifest.
//!
//! A flush moves all hot batches to `flushing` (still readable), writes one sorted Parquet
//! file per (table, run) without holding the lock, saves the key snapshot, then commits a new
//! manifest (`flushed_seq` = the `applied_seq` it started from) and drops the flushed batches
//! in the same critical section. Only then is the log truncated. A failed flush puts the
//! batches back for the next one (the log still holds them).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use arrow_array::RecordBatch;
use rankwatch_analytics::schema::{alerts, runs};
use rankwatch_analytics::{Alert, RunId, RunInfo};

use super::manifest::{self, FileMeta};
use super::{Store, files, rollup};
use crate::entry::Table;
use crate::error::Result;

impl Store {
    /// Moves every hot batch into Parquet and commits a manifest. Returns the flushed sequence
    /// number when something was committed.
    pub async fn flush(self: &Arc<Self>) -> Result<Option<u64>> {
        self.under_maintenance("flush", |store| store.flush_blocking())
            .await
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
            self.metrics.hot_bytes.set(0);
            // Batches waiting for room go on now, not when this flush ends.
            self.room_freed.notify_waiters();
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
        // Every file this flush writes, so that a failure leaves none behind (see `unlisted`).
        let mut files_written = Vec::new();
        let written = keys
            .save(&self.dir)
            .and_then(|_| self.write_flush(&parts, &infos, &alerts, &mut files_written))
            .and_then(|(new_files, replaced)| {
                // The part numbers used are reserved in the state's manifest already.
                let mut manifest = self.lock().manifest.clone();
                manifest.files.retain(|f| !replaced.contains(&f.relative()));
                let rows: u64 = new_files.iter().map(|f| f.rows).sum();
                manifest.files.extend(new_files);
                manifest.flushed_seq = through;
                // The log no longer holds records at or below `through`.
                manifest.deleted_runs.retain(|_, seq| *seq > through);
                self.commit_manifest(&manifest, &mut files_written)?;
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
                self.sweep_unlisted();
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
                self.metrics.hot_bytes.set(state.hot_bytes as i64);
                self.metrics.flush_errors.inc();
                drop(state);
                self.abandon(files_written, false);
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
        written: &mut Vec<PathBuf>,
    ) -> Result<(Vec<FileMeta>, Vec<PathBuf>)> {
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
            let part = self.reserve_part();
            new_files.extend(self.write_part(*table, run, part, &batch, written)?);
        }
        for info in infos {
            let batch = files::without_run(&runs::to_batch(std::slice::from_ref(info))?)?;
            replaced.extend(self.files_of(runs::TABLE, &info.run));
            let part = self.reserve_part();
            new_files.push(self.write_file(
                runs::TABLE,
                files::Layout::UNSORTED,
                &info.run,
                part,
                std::slice::from_ref(&batch),
                written,
            )?);
        }
        for (run, of_run) in alerts {
            replaced.extend(self.files_of(alerts::TABLE, run));
            if of_run.is_empty() {
                continue;
            }
            let batch = files::without_run(&alerts::to_batch(of_run)?)?;
            let part = self.reserve_part();
            new_files.push(self.write_file(
                alerts::TABLE,
                files::Layout::UNSORTED,
                run,
                part,
                std::slice::from_ref(&batch),
                written,
            )?);
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
    /// under the same number. `written` gains each file it writes (see [`Store::write_file`]).
    pub(super) fn write_part(
        &self,
        table: Table,
        run: &RunId,
        part: u64,
        batch: &RecordBatch,
        written: &mut Vec<PathBuf>,
    ) -> Result<Vec<FileMeta>> {
        let meta = self.write_file(
            table.as_str(),
            files::Layout::of(table),
            run,
            part,
            std::slice::from_ref(batch),
            written,
        )?;
        let rollup = if table == Table::Samples {
            self.write_rollup(&meta, batch, written)?
        } else {
            None
        };
        Ok([Some(meta), rollup].into_iter().flatten().collect())
    }

    /// Writes the rollup of the samples part `samples` (whose rows are `batch`), unless its
    /// series are too short for one; such a part is remembered, not summarised again.
    pub(super) fn write_rollup(
        &self,
        samples: &FileMeta,
        batch: &RecordBatch,
        written: &mut Vec<PathBuf>,
    ) -> Result<Option<FileMeta>> {
        let Some(summary) = rollup::summarise(batch)? else {
            self.lock().without_rollup.insert(samples.relative());
            return Ok(None);
        };
        let mut meta = self.write_file(
            rollup::TABLE,
            rollup::LAYOUT,
            &samples.run,
            samples.part,
            &summary.batches,
            written,
        )?;
        meta.sparse = summary.sparse;
        // The steps it covers are its part's (a rollup has window starts, not steps).
        (meta.min_step, meta.max_step) = (samples.min_step, samples.max_step);
        Ok(Some(meta))
    }

    /// Writes one file in `layout` holding the rows of `batches`, in order. Its path joins
    /// `written` before the write starts: a write that fails after its rename (the directory
    /// fsync) still leaves the file, which the caller must then delete or commit.
    fn write_file(
        &self,
        name: &str,
        layout: files::Layout,
        run: &RunId,
        part: u64,
        batches: &[RecordBatch],
        written: &mut Vec<PathBuf>,
    ) -> Result<FileMeta> {
        let node = self.backend.node();
        let writer = self.backend.writer();
        let relative = manifest::file_path(name, run, node, writer, part);
        written.push(relative.clone());
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
            writer: writer.map(str::to_owned),
            sparse: Default::default(),
        })
    }
}

fn dedup(mut runs: Vec<RunId>) -> Vec<RunId> {
    runs.sort();
    runs.dedup();
    runs
}
