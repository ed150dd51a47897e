//! Compaction: merges the small sample and sketch parts of a run into one, commits the
//! manifest, and deletes the replaced files after a grace period so queries already planned
//! on them finish. It also writes the rollups of parts from before rollups existed.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use rankwatch_analytics::RunId;

use super::manifest::FileMeta;
use super::{Store, files, rollup};
use crate::entry::Table;
use crate::error::{Error, Result};

impl Store {
    /// Merges the small sample and sketch files of each run (see the module docs). Returns
    /// how many files were merged away.
    pub async fn compact(self: &Arc<Self>) -> Result<usize> {
        self.under_maintenance("compaction", |store| store.compact_blocking())
            .await
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
            let part = self.reserve_part();
            let mut written = Vec::new();
            let committed = self
                .write_part(table, &run, part, &batch, &mut written)
                .and_then(|metas| {
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
                    self.commit_manifest(&manifest, &mut written)?;
                    Ok((manifest, old))
                });
            let (mut manifest, old) = match committed {
                Ok(done) => done,
                Err(e) => {
                    self.abandon(written, false);
                    return Err(e);
                }
            };
            {
                let mut state = self.lock();
                // Keep part numbers reserved since the clone.
                manifest.next_part = manifest.next_part.max(state.manifest.next_part);
                state.manifest = manifest;
                let now = Instant::now();
                state.graveyard.extend(old.into_iter().map(|p| (now, p)));
            }
            self.sweep_unlisted();
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
            let mut files_written = Vec::new();
            let rollup = match self.write_rollup(f, &batch, &mut files_written) {
                Ok(rollup) => rollup,
                Err(e) => {
                    self.abandon(files_written, false);
                    return Err(e);
                }
            };
            let Some(meta) = rollup else {
                continue;
            };
            let mut manifest = self.lock().manifest.clone();
            manifest.files.push(meta);
            self.commit_manifest(&manifest, &mut files_written)?;
            {
                let mut state = self.lock();
                manifest.next_part = manifest.next_part.max(state.manifest.next_part);
                state.manifest = manifest;
            }
            self.sweep_unlisted();
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
}
