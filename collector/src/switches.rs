//! Probe switches: whether an operator wants a run's probes on or off, for agents started
//! dormant (`rankwatch run --dormant`) or attached later.
//!
//! The training node opens no port: its agent polls `GET /api/v1/runs/{run}/probes` every few
//! seconds and acts at the end of an optimizer step, so `rankwatch attach RUN`, `rankwatch
//! detach RUN` and the dashboard's button only record a wish here. Each change bumps the run's
//! revision, so an agent can tell a new wish from the one it already acted on. Wishes are kept
//! one small JSON file per run (`probe-switches/<run>.json`, replaced atomically), so a
//! collector restart does not turn a job's probes back off or on; deleting a run drops its file.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Mutex;

use rankwatch_analytics::RunId;
use serde::{Deserialize, Serialize};

use crate::error::Result;
use crate::fsutil::write_atomic;

/// One run's wish.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Switch {
    /// Probes wanted on (`true`) or off.
    pub on: bool,
    /// Bumped at every change, from 1.
    pub revision: u64,
    /// When it last changed, Unix milliseconds.
    pub changed_ms: i64,
}

/// Every run's switch, persisted under the data directory.
#[derive(Debug)]
pub struct ProbeSwitches {
    dir: PathBuf,
    switches: Mutex<BTreeMap<RunId, Switch>>,
}

impl ProbeSwitches {
    /// The switches saved in `dir` (a file that does not parse is reported and skipped).
    pub fn open(dir: PathBuf) -> Result<ProbeSwitches> {
        let mut switches = BTreeMap::new();
        for (run, path) in crate::fsutil::run_files(&dir)? {
            match serde_json::from_slice::<Switch>(&std::fs::read(&path)?) {
                Ok(switch) => {
                    switches.insert(run, switch);
                }
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "unreadable probe switch skipped")
                }
            }
        }
        Ok(ProbeSwitches {
            dir,
            switches: Mutex::new(switches),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<RunId, Switch>> {
        self.switches.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `run`'s switch; `None` when nobody ever set it (the agent keeps its own start setting).
    pub fn get(&self, run: &RunId) -> Option<Switch> {
        self.lock().get(run).copied()
    }

    /// Sets `run`'s probes on or off at `now_ms`; saved before it is visible.
    pub fn set(&self, run: &RunId, on: bool, now_ms: i64) -> Result<Switch> {
        let mut switches = self.lock();
        let revision = switches.get(run).map_or(0, |s| s.revision) + 1;
        let switch = Switch {
            on,
            revision,
            changed_ms: now_ms,
        };
        std::fs::create_dir_all(&self.dir)?;
        write_atomic(
            &self.dir.join(format!("{run}.json")),
            &serde_json::to_vec(&switch)?,
        )?;
        switches.insert(run.clone(), switch);
        Ok(switch)
    }

    /// Forgets `run`'s switch (the run was deleted).
    pub fn remove(&self, run: &RunId) -> Result<()> {
        if self.lock().remove(run).is_some() {
            let path = self.dir.join(format!("{run}.json"));
            match std::fs::remove_file(&path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e.into()),
                _ => {}
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_switch_survives_a_restart_and_counts_its_changes() {
        let dir = tempfile::tempdir().unwrap();
        let run = RunId::new("job-1").unwrap();
        let switches = ProbeSwitches::open(dir.path().join("s")).unwrap();
        assert_eq!(switches.get(&run), None);
        assert_eq!(switches.set(&run, true, 10).unwrap().revision, 1);
        let off = switches.set(&run, false, 20).unwrap();
        assert_eq!((off.on, off.revision, off.changed_ms), (false, 2, 20));
        let reopened = ProbeSwitches::open(dir.path().join("s")).unwrap();
        assert_eq!(reopened.get(&run), Some(off));
        reopened.remove(&run).unwrap();
        assert_eq!(
            ProbeSwitches::open(dir.path().join("s")).unwrap().get(&run),
            None
        );
    }

    #[test]
    fn an_unreadable_file_is_skipped_not_fatal() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("bad.json"), b"{not json").unwrap();
        let switches = ProbeSwitches::open(dir.path().to_path_buf()).unwrap();
        assert_eq!(switches.get(&RunId::new("bad").unwrap()), None);
    }
}
