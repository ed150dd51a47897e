//! Idempotency keys: a batch retried by an agent is acknowledged again, never stored twice.
//!
//! A key is `run/rank/session/seq`. An agent session numbers its batches, so the keys applied
//! for one (run, rank, session) are kept as sorted disjoint ranges of sequence numbers — one
//! range for an agent that never loses a batch — instead of one string per batch.
//!
//! Keys are durable together with their rows: each key travels inside its write-ahead-log
//! record, so replay restores it; and when a flush moves rows into Parquet, the keys of every
//! run that gained one since the last flush are written to `keys/<run>.json` *before* the
//! manifest that commits the flush. A run's file may so run ahead of the manifest (a crash
//! between the two): it then also names keys of records after the manifest's `flushed_seq`,
//! which replay applies anyway — a superset, never a key whose rows could be missing.
//!
//! Only changed runs are written, so a flush costs what changed, not every key ever seen (the
//! first design rewrote one snapshot of all keys, cloned under the store's lock, every flush).
//! A live run's file is written whole each flush it gained a key, so its size is what bounds
//! that cost: each session's ranges are one pair for an agent that loses nothing, and a
//! session that has sent nothing for the idempotency window (an agent restarted gets a new
//! session) is dropped, so the file holds about one entry per rank still sending, the size
//! of what the same flush writes for that run's rows anyway.
//! A deleted run's keys go with it, in memory and on disk, so the set is bounded by the runs
//! kept. A data directory of that first design (`keys-<seq>.json`) is read once and rewritten
//! per run at start.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::fs;
use std::path::{Path, PathBuf};

use rankwatch_analytics::RunId;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::fsutil::write_atomic;

/// A parsed `Idempotency-Key`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Key {
    pub run: RunId,
    pub rank: u32,
    pub session: String,
    pub seq: u64,
}

impl Key {
    /// Parses `run/rank/session/seq`.
    pub fn parse(text: &str) -> Result<Key> {
        let fail = |why: &str| {
            Error::bad(format!(
                "invalid Idempotency-Key {text:?}: {why} (expected run/rank/session/seq)"
            ))
        };
        let parts: Vec<&str> = text.split('/').collect();
        let [run, rank, session, seq] = parts[..] else {
            return Err(fail("needs four '/'-separated parts"));
        };
        let run = RunId::new(run).map_err(|e| fail(&e.to_string()))?;
        let rank = rank.parse().map_err(|_| fail("rank is not a number"))?;
        if session.is_empty()
            || session.len() > 64
            || !session
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        {
            return Err(fail("session must be 1-64 of [A-Za-z0-9_-]"));
        }
        let seq = seq.parse().map_err(|_| fail("seq is not a number"))?;
        Ok(Key {
            run,
            rank,
            session: session.to_owned(),
            seq,
        })
    }

    fn session_id(&self) -> SessionId {
        (self.rank, self.session.clone())
    }
}

impl std::fmt::Display for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}/{}/{}/{}",
            self.run, self.rank, self.session, self.seq
        )
    }
}

/// A session of one run: (rank, session).
type SessionId = (u32, String);

/// Sorted, disjoint, inclusive ranges of applied sequence numbers.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
struct Ranges(Vec<(u64, u64)>);

impl Ranges {
    fn contains(&self, seq: u64) -> bool {
        let i = self.0.partition_point(|&(_, end)| end < seq);
        self.0.get(i).is_some_and(|&(start, _)| start <= seq)
    }

    fn insert(&mut self, seq: u64) {
        let i = self
            .0
            .partition_point(|&(_, end)| end.saturating_add(1) < seq);
        match self.0.get_mut(i) {
            Some(r) if r.0 <= seq.saturating_add(1) => {
                r.0 = r.0.min(seq);
                r.1 = r.1.max(seq);
                // Merge with the next range when the gap closed.
                if let Some(&(next_start, next_end)) = self.0.get(i + 1)
                    && next_start <= self.0[i].1.saturating_add(1)
                {
                    self.0[i].1 = self.0[i].1.max(next_end);
                    self.0.remove(i + 1);
                }
            }
            _ => self.0.insert(i, (seq, seq)),
        }
    }
}

/// What a key's state is when a request carrying it arrives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Check {
    /// Never seen: the caller writes the batch, then calls [`KeySet::commit`] or [`KeySet::abort`].
    New,
    /// Already durable: acknowledge again without writing.
    Applied,
    /// Another request with this key is being written now.
    InFlight,
}

/// The applied keys of one run, and when it last gained one (ms since the epoch): keys unused
/// for longer than the idempotency window are dropped, a whole run's or one session's.
#[derive(Debug, Clone, Default)]
struct RunKeys {
    sessions: HashMap<SessionId, SessionKeys>,
    last_ms: i64,
}

/// One agent session's applied keys, and when it last gained one. A live run's ended sessions
/// (an agent restarted gets a new one) expire on their own, so a long run's key file holds the
/// sessions still sending, not every session it ever had.
#[derive(Debug, Clone, Default)]
struct SessionKeys {
    ranges: Ranges,
    last_ms: i64,
}

/// Every applied key, plus those being written.
#[derive(Debug, Default)]
pub struct KeySet {
    applied: HashMap<RunId, RunKeys>,
    pending: HashSet<Key>,
    /// Runs that gained a key since their file was last written.
    dirty: BTreeSet<RunId>,
}

/// The keys of the runs changed since the last flush, as of that flush: written by it.
#[derive(Debug, Default)]
pub struct KeyChanges {
    runs: Vec<(RunId, RunKeys)>,
}

/// One run's key file.
#[derive(Serialize, Deserialize)]
struct RunFile {
    run: String,
    sessions: Vec<(u32, String, Ranges)>,
    /// When the run last gained a key; absent in files written before it was kept.
    #[serde(default)]
    last_ms: i64,
    /// When each session (in `sessions`' order) last gained a key; absent in files written
    /// before sessions expired on their own (each then counts from the run's time).
    #[serde(default)]
    session_last_ms: Vec<i64>,
}

/// The first design's single snapshot of every run's keys.
#[derive(Deserialize)]
struct LegacySnapshot {
    sessions: Vec<(String, u32, String, Ranges)>,
}

/// The folder of the per-run key files, in the data directory.
pub const DIR: &str = "keys";

impl KeySet {
    /// Classifies `key` and, when new, marks it in flight.
    pub fn begin(&mut self, key: &Key) -> Check {
        if self.is_applied(key) {
            Check::Applied
        } else if !self.pending.insert(key.clone()) {
            Check::InFlight
        } else {
            Check::New
        }
    }

    /// Whether `key` is durable.
    pub fn is_applied(&self, key: &Key) -> bool {
        self.applied
            .get(&key.run)
            .and_then(|run| run.sessions.get(&key.session_id()))
            .is_some_and(|s| s.ranges.contains(key.seq))
    }

    /// Records `key` as applied (its batch is durable) at `now_ms`.
    pub fn commit(&mut self, key: &Key, now_ms: i64) {
        self.pending.remove(key);
        let run = self.applied.entry(key.run.clone()).or_default();
        run.last_ms = run.last_ms.max(now_ms);
        let session = run.sessions.entry(key.session_id()).or_default();
        session.last_ms = session.last_ms.max(now_ms);
        session.ranges.insert(key.seq);
        if !self.dirty.contains(&key.run) {
            self.dirty.insert(key.run.clone());
        }
    }

    /// Forgets an in-flight `key` whose write failed, so a retry can try again.
    pub fn abort(&mut self, key: &Key) {
        self.pending.remove(key);
    }

    /// Forgets every key of a deleted run (its file is removed by [`remove_run_file`]).
    pub fn forget_run(&mut self, run: &RunId) {
        self.applied.remove(run);
        self.dirty.remove(run);
    }

    /// Forgets the keys of runs that gained none since `cutoff_ms` and returns those runs
    /// (their files are removed by [`remove_run_file`]): a batch retried after that long is
    /// stored again, the price of a key set that does not grow for ever. In the runs kept, the
    /// sessions that gained none since then go too, and their runs' files are written again
    /// by the next flush, smaller.
    pub fn expire(&mut self, cutoff_ms: i64) -> Vec<RunId> {
        let old: Vec<RunId> = self
            .applied
            .iter()
            .filter(|(_, keys)| keys.last_ms < cutoff_ms)
            .map(|(run, _)| run.clone())
            .collect();
        for run in &old {
            self.forget_run(run);
        }
        for (run, keys) in &mut self.applied {
            let before = keys.sessions.len();
            keys.sessions.retain(|_, s| s.last_ms >= cutoff_ms);
            if keys.sessions.len() < before && !self.dirty.contains(run) {
                self.dirty.insert(run.clone());
            }
        }
        old
    }

    /// Sessions known, over all runs (a gauge: what the set holds).
    pub fn sessions(&self) -> usize {
        self.applied.values().map(|run| run.sessions.len()).sum()
    }

    /// The changed runs' keys as of now, for the flush that writes them; they count as
    /// written from here on (see [`KeySet::unwritten`] for a flush that fails).
    pub fn take_changes(&mut self) -> KeyChanges {
        let dirty = std::mem::take(&mut self.dirty);
        KeyChanges {
            runs: dirty
                .into_iter()
                .filter_map(|run| {
                    let keys = self.applied.get(&run)?.clone();
                    Some((run, keys))
                })
                .collect(),
        }
    }

    /// A flush that took `changes` failed: their runs are written by the next one.
    pub fn unwritten(&mut self, changes: &KeyChanges) {
        for (run, _) in &changes.runs {
            if self.applied.contains_key(run) {
                self.dirty.insert(run.clone());
            }
        }
    }

    /// Loads the keys of a data directory whose manifest says `flushed_seq`: the per-run files,
    /// or a snapshot of the first design (rewritten per run here, then removed). A directory with flushed data and no keys at all is refused:
    /// retried batches would be stored twice.
    pub fn load(dir: &Path, flushed_seq: u64, now_ms: i64) -> Result<KeySet> {
        let mut set = KeySet::default();
        let runs_dir = dir.join(DIR);
        let legacy = legacy_path(dir, flushed_seq);
        if runs_dir.is_dir() {
            for entry in fs::read_dir(&runs_dir)? {
                let path = entry?.path();
                if path.extension().and_then(|e| e.to_str()) != Some("json") {
                    continue;
                }
                let (run, mut keys) = read_run_file(&path)?;
                if keys.last_ms == 0 {
                    // Unknown (an older file): counted from now.
                    keys.last_ms = now_ms;
                }
                for session in keys.sessions.values_mut() {
                    if session.last_ms == 0 {
                        session.last_ms = keys.last_ms;
                    }
                }
                set.applied.insert(run, keys);
            }
        } else if legacy.exists() {
            let bytes = fs::read(&legacy)?;
            let snapshot: LegacySnapshot =
                serde_json::from_slice(&bytes).map_err(|e| corrupt(&legacy, e.to_string()))?;
            for (run, rank, session, ranges) in snapshot.sessions {
                let run = RunId::new(run).map_err(|e| corrupt(&legacy, e.to_string()))?;
                let keys = set.applied.entry(run.clone()).or_default();
                keys.sessions.insert(
                    (rank, session),
                    SessionKeys {
                        ranges,
                        last_ms: now_ms,
                    },
                );
                keys.last_ms = now_ms;
                set.dirty.insert(run);
            }
            // Rewritten per run at once (a file may run ahead of the manifest, see the module
            // docs); then the old snapshots go.
            fs::create_dir_all(&runs_dir)?;
            set.take_changes().save(dir)?;
            remove_legacy(dir)?;
        } else if flushed_seq > 0 {
            return Err(corrupt(
                &runs_dir,
                "the idempotency keys of the flushed data are missing".into(),
            ));
        }
        fs::create_dir_all(&runs_dir)?;
        Ok(set)
    }
}

impl KeyChanges {
    /// Writes each changed run's file (durably), before the manifest of the flush.
    pub fn save(&self, dir: &Path) -> Result<()> {
        for (run, keys) in &self.runs {
            let file = RunFile {
                run: run.to_string(),
                sessions: keys
                    .sessions
                    .iter()
                    .map(|((rank, session), s)| (*rank, session.clone(), s.ranges.clone()))
                    .collect(),
                last_ms: keys.last_ms,
                session_last_ms: keys.sessions.values().map(|s| s.last_ms).collect(),
            };
            write_atomic(&run_path(dir, run), &serde_json::to_vec(&file)?)?;
        }
        Ok(())
    }
}

/// Removes a deleted run's key file (none is fine).
pub fn remove_run_file(dir: &Path, run: &RunId) -> Result<()> {
    match fs::remove_file(run_path(dir, run)) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Deletes the first design's snapshots, once every run's file is written.
fn remove_legacy(dir: &Path) -> Result<()> {
    for entry in fs::read_dir(dir)? {
        let path = entry?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if name.starts_with("keys-") && name.ends_with(".json") {
            fs::remove_file(&path)?;
        }
    }
    Ok(())
}

fn run_path(dir: &Path, run: &RunId) -> PathBuf {
    dir.join(DIR).join(format!("{run}.json"))
}

fn legacy_path(dir: &Path, through_seq: u64) -> PathBuf {
    dir.join(format!("keys-{through_seq:020}.json"))
}

fn corrupt(path: &Path, reason: String) -> Error {
    Error::Corrupt {
        what: path.display().to_string(),
        reason,
    }
}

fn read_run_file(path: &Path) -> Result<(RunId, RunKeys)> {
    let bytes = fs::read(path)?;
    let file: RunFile = serde_json::from_slice(&bytes).map_err(|e| corrupt(path, e.to_string()))?;
    let run = RunId::new(file.run).map_err(|e| corrupt(path, e.to_string()))?;
    if path.file_stem().and_then(|s| s.to_str()) != Some(run.as_str()) {
        return Err(corrupt(
            path,
            format!(
                "holds the keys of run {:?}, not of the run it is named after",
                run.as_str()
            ),
        ));
    }
    if !file.session_last_ms.is_empty() && file.session_last_ms.len() != file.sessions.len() {
        return Err(corrupt(
            path,
            format!(
                "names {} sessions but the times of {}",
                file.sessions.len(),
                file.session_last_ms.len()
            ),
        ));
    }
    let times = file.session_last_ms.into_iter().chain(std::iter::repeat(0));
    let keys = RunKeys {
        sessions: file
            .sessions
            .into_iter()
            .zip(times)
            .map(|((rank, session, ranges), last_ms)| {
                ((rank, session), SessionKeys { ranges, last_ms })
            })
            .collect(),
        last_ms: file.last_ms,
    };
    Ok((run, keys))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn key(seq: u64) -> Key {
        Key::parse(&format!("run-1/3/abc/{seq}")).unwrap()
    }

    #[test]
    fn keys_parse_and_bad_ones_are_named() {
        let k = key(7);
        assert_eq!(k.to_string(), "run-1/3/abc/7");
        for (bad, why) in [
            ("a/b/c", "four"),
            ("../x/0/s/1", "four"),
            ("..%2f/0/s/1", "invalid run id"),
            ("r/x/s/1", "rank"),
            ("r/0/s s/1", "session"),
            ("r/0/s/-1", "seq"),
        ] {
            let err = Key::parse(bad).unwrap_err().to_string();
            assert!(err.contains(why), "{bad}: {err}");
        }
    }

    #[test]
    fn begin_commit_abort() {
        let mut set = KeySet::default();
        assert_eq!(set.begin(&key(1)), Check::New);
        assert_eq!(set.begin(&key(1)), Check::InFlight);
        set.abort(&key(1));
        assert_eq!(set.begin(&key(1)), Check::New);
        set.commit(&key(1), 100);
        assert_eq!(set.begin(&key(1)), Check::Applied);
    }

    fn other(run: &str, seq: u64) -> Key {
        Key::parse(&format!("{run}/0/s/{seq}")).unwrap()
    }

    #[test]
    fn only_changed_runs_are_written_and_the_files_load_back() {
        let dir = tempfile::tempdir().unwrap();
        let mut set = KeySet::load(dir.path(), 0, 100).unwrap();
        for s in [1, 2, 3, 10, 12] {
            set.commit(&key(s), 100);
        }
        set.commit(&other("run-2", 5), 100);
        let changes = set.take_changes();
        assert_eq!(changes.runs.len(), 2);
        changes.save(dir.path()).unwrap();
        // Only run-1 changes next: only its file is written.
        set.commit(&key(11), 100);
        let changes = set.take_changes();
        assert_eq!(changes.runs.len(), 1);
        assert_eq!(changes.runs[0].0.as_str(), "run-1");
        changes.save(dir.path()).unwrap();
        assert!(set.take_changes().runs.is_empty(), "nothing changed since");

        let loaded = KeySet::load(dir.path(), 7, 100).unwrap();
        assert!(loaded.is_applied(&key(10)) && loaded.is_applied(&key(11)));
        assert!(!loaded.is_applied(&key(4)));
        assert!(loaded.is_applied(&other("run-2", 5)));
        assert_eq!(loaded.sessions(), 2);
    }

    #[test]
    fn keys_unused_for_longer_than_the_window_expire_and_new_ones_do_not() {
        let dir = tempfile::tempdir().unwrap();
        let mut set = KeySet::load(dir.path(), 0, 100).unwrap();
        set.commit(&key(1), 1_000);
        set.commit(&other("run-2", 1), 5_000);
        set.take_changes().save(dir.path()).unwrap();
        // The times survive a restart.
        let mut set = KeySet::load(dir.path(), 3, 9_000).unwrap();
        let gone = set.expire(2_000);
        assert_eq!(
            gone.iter().map(RunId::as_str).collect::<Vec<_>>(),
            ["run-1"]
        );
        assert!(!set.is_applied(&key(1)) && set.is_applied(&other("run-2", 1)));
        // A file written before the times were kept counts from its loading.
        let legacy = r#"{"run":"run-3","sessions":[[0,"s",[[1,1]]]]}"#;
        std::fs::write(dir.path().join(DIR).join("run-3.json"), legacy).unwrap();
        let mut set = KeySet::load(dir.path(), 3, 9_000).unwrap();
        assert!(set.expire(8_000).iter().all(|r| r.as_str() != "run-3"));
    }

    #[test]
    fn a_live_runs_ended_sessions_expire_and_its_file_shrinks() {
        let dir = tempfile::tempdir().unwrap();
        let mut set = KeySet::load(dir.path(), 0, 100).unwrap();
        let session = |name: &str, seq: u64| Key::parse(&format!("run-1/0/{name}/{seq}")).unwrap();
        // An agent restarted at 3,000 ms: its first session sends no more.
        set.commit(&session("first", 1), 1_000);
        set.commit(&session("second", 1), 3_000);
        set.commit(&session("second", 2), 9_000);
        set.take_changes().save(dir.path()).unwrap();
        // The times survive a restart, per session.
        let mut set = KeySet::load(dir.path(), 3, 9_500).unwrap();
        assert!(set.expire(2_000).is_empty(), "the run is live");
        assert!(!set.is_applied(&session("first", 1)));
        assert!(set.is_applied(&session("second", 2)));
        assert_eq!(set.sessions(), 1);
        // Its file is written again, without the ended session.
        let changes = set.take_changes();
        assert_eq!(changes.runs.len(), 1);
        changes.save(dir.path()).unwrap();
        let text = std::fs::read_to_string(dir.path().join(DIR).join("run-1.json")).unwrap();
        assert!(!text.contains("first") && text.contains("second"), "{text}");
        // A file whose session times do not match its sessions is named as damaged.
        let bad =
            r#"{"run":"run-1","sessions":[[0,"s",[[1,1]]]],"last_ms":5,"session_last_ms":[1,2]}"#;
        std::fs::write(dir.path().join(DIR).join("run-1.json"), bad).unwrap();
        let err = KeySet::load(dir.path(), 3, 100).unwrap_err().to_string();
        assert!(err.contains("names 1 sessions but the times of 2"), "{err}");
    }

    #[test]
    fn a_failed_flush_leaves_its_runs_to_the_next() {
        let mut set = KeySet::default();
        set.commit(&key(1), 100);
        let changes = set.take_changes();
        set.unwritten(&changes);
        assert_eq!(set.take_changes().runs.len(), 1);
    }

    #[test]
    fn a_deleted_run_is_forgotten_in_memory_and_on_disk() {
        let dir = tempfile::tempdir().unwrap();
        let mut set = KeySet::load(dir.path(), 0, 100).unwrap();
        set.commit(&key(1), 100);
        set.commit(&other("run-2", 1), 100);
        set.take_changes().save(dir.path()).unwrap();
        let run = RunId::new("run-1").unwrap();
        set.forget_run(&run);
        remove_run_file(dir.path(), &run).unwrap();
        remove_run_file(dir.path(), &run).unwrap();
        assert!(!set.is_applied(&key(1)));
        assert_eq!(set.sessions(), 1);
        let loaded = KeySet::load(dir.path(), 3, 100).unwrap();
        assert!(!loaded.is_applied(&key(1)) && loaded.is_applied(&other("run-2", 1)));
    }

    #[test]
    fn a_first_design_snapshot_is_read_and_rewritten_per_run() {
        let dir = tempfile::tempdir().unwrap();
        let legacy = r#"{"through_seq":40,"sessions":[["run-1",3,"abc",[[1,3],[10,10]]]]}"#;
        std::fs::write(legacy_path(dir.path(), 40), legacy).unwrap();
        let set = KeySet::load(dir.path(), 40, 100).unwrap();
        assert!(set.is_applied(&key(2)) && set.is_applied(&key(10)) && !set.is_applied(&key(4)));
        assert!(!legacy_path(dir.path(), 40).exists());
        let again = KeySet::load(dir.path(), 41, 100).unwrap();
        assert!(again.is_applied(&key(3)));
    }

    #[test]
    fn missing_or_damaged_keys_of_flushed_data_stop_the_start_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let err = KeySet::load(dir.path(), 9, 100).unwrap_err().to_string();
        assert!(err.contains("missing"), "{err}");
        std::fs::create_dir_all(dir.path().join(DIR)).unwrap();
        std::fs::write(dir.path().join(DIR).join("run-1.json"), b"{not json").unwrap();
        let err = KeySet::load(dir.path(), 9, 100).unwrap_err().to_string();
        assert!(err.contains("run-1.json"), "{err}");
        std::fs::write(
            dir.path().join(DIR).join("run-1.json"),
            br#"{"run":"run-2","sessions":[]}"#,
        )
        .unwrap();
        let err = KeySet::load(dir.path(), 9, 100).unwrap_err().to_string();
        assert!(err.contains("not of the run it is named after"), "{err}");
    }

    proptest! {
        #[test]
        fn ranges_agree_with_a_set(seqs in proptest::collection::vec(0u64..200, 0..300)) {
            let mut ranges = Ranges::default();
            let mut set = std::collections::BTreeSet::new();
            for s in seqs {
                ranges.insert(s);
                set.insert(s);
                for w in ranges.0.windows(2) {
                    prop_assert!(w[0].1 + 1 < w[1].0, "{:?}", ranges.0);
                }
            }
            for s in 0..210 {
                prop_assert_eq!(ranges.contains(s), set.contains(&s));
            }
        }
    }
}
