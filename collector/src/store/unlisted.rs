//! Files written but never committed: what a failed flush or compaction leaves.
//!
//! Every maintenance step writes its parts first and commits them by saving the manifest. When
//! a step fails (a full disk half-way through, an object store that times out), the parts it
//! already wrote are listed by no manifest. Left there, they would hold the space a full disk
//! needs back until the next restart deletes them as leftovers, and the retry would write the
//! same rows again beside them. So:
//! - a step that failed before its manifest write deletes what it wrote at once;
//! - a step whose manifest write failed may or may not have committed (a rename done but its
//!   directory fsync not, a PUT whose answer was lost): its files wait in `State::unlisted`
//!   and go after the next successful commit, if that manifest does not list them;
//! - part numbers are reserved as they are used, never handed out twice, so a retry cannot
//!   write a name a pending deletion is about to remove.
//!
//! A file that cannot be deleted now stays in the list and is tried again after each commit;
//! `rankwatch_unlisted_files` says how many wait.

use std::collections::HashSet;
use std::path::PathBuf;

use super::Store;
use super::manifest::{FileMeta, Manifest};
use crate::error::Result;

impl Store {
    /// The next part number, reserved for the caller whether or not its write succeeds.
    pub(super) fn reserve_part(&self) -> u64 {
        let mut state = self.lock();
        let part = state.manifest.next_part;
        state.manifest.next_part += 1;
        part
    }

    /// Saves `manifest`, the commit of a step that wrote `written`. When the save fails, those
    /// files may or may not be committed: they wait for the next commit (see [`Store::abandon`])
    /// and `written` is left empty, so the step's own clean-up of its files does nothing.
    pub(super) fn commit_manifest(
        &self,
        manifest: &Manifest,
        written: &mut Vec<PathBuf>,
    ) -> Result<()> {
        let saved = self.backend.save_manifest(manifest);
        if saved.is_err() {
            self.abandon(std::mem::take(written), true);
        }
        saved
    }

    /// Gives up on the files a failed step wrote (`written`, relative paths). `maybe_listed`:
    /// the step tried to save its manifest, so they may be committed and wait for the next
    /// commit to tell.
    pub(super) fn abandon(&self, written: Vec<PathBuf>, maybe_listed: bool) {
        if written.is_empty() {
            return;
        }
        if maybe_listed {
            self.lock().unlisted.extend(written);
        } else {
            let left = self.remove_all(written);
            self.lock().unlisted.extend(left);
        }
        self.report_unlisted();
    }

    /// After a commit: deletes the waiting files that the manifest now in force does not list
    /// (those it lists were committed after all, or written again under their name).
    pub(super) fn sweep_unlisted(&self) {
        let waiting: Vec<PathBuf> = {
            let mut state = self.lock();
            if state.unlisted.is_empty() {
                return;
            }
            let listed: HashSet<PathBuf> = state
                .manifest
                .files
                .iter()
                .map(FileMeta::relative)
                .collect();
            std::mem::take(&mut state.unlisted)
                .into_iter()
                .filter(|p| !listed.contains(p))
                .collect()
        };
        let left = self.remove_all(waiting);
        self.lock().unlisted.extend(left);
        self.report_unlisted();
    }

    /// Deletes each file (a missing one is gone already); returns those that could not be.
    fn remove_all(&self, paths: Vec<PathBuf>) -> Vec<PathBuf> {
        paths
            .into_iter()
            .filter(|path| match self.backend.remove(path) {
                Ok(()) => false,
                Err(e) => {
                    tracing::warn!(file = %path.display(), error = %e, "could not delete a file no manifest lists; trying again after the next commit");
                    true
                }
            })
            .collect()
    }

    fn report_unlisted(&self) {
        let waiting = self.lock().unlisted.len();
        self.metrics.unlisted_files.set(waiting as i64);
    }
}
