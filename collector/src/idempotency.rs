//! Idempotency keys: a batch retried by an agent is acknowledged again, never stored twice.
//!
//! A key is `run/rank/session/seq`. An agent session numbers its batches, so the keys applied
//! for one (run, rank, session) are kept as sorted disjoint ranges of sequence numbers — one
//! range for an agent that never loses a batch — instead of one string per batch.
//!
//! Keys are durable together with their rows: each key travels inside its write-ahead-log
//! record, so replay restores it; and when a flush moves rows into Parquet, the key set as of
//! that flush is written to `keys-<flushed seq>.json` *before* the manifest that commits the
//! flush. On start the snapshot whose number equals the manifest's `flushed_seq` is loaded,
//! then replay adds the keys of every later record.

use std::collections::{HashMap, HashSet};
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
        (self.run.to_string(), self.rank, self.session.clone())
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

type SessionId = (String, u32, String);

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

/// Every applied key, plus those being written.
#[derive(Debug, Default, Clone)]
pub struct KeySet {
    applied: HashMap<SessionId, Ranges>,
    pending: HashSet<Key>,
}

#[derive(Serialize, Deserialize)]
struct Snapshot {
    through_seq: u64,
    sessions: Vec<(String, u32, String, Ranges)>,
}

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
            .get(&key.session_id())
            .is_some_and(|r| r.contains(key.seq))
    }

    /// Records `key` as applied (its batch is durable).
    pub fn commit(&mut self, key: &Key) {
        self.pending.remove(key);
        self.applied
            .entry(key.session_id())
            .or_default()
            .insert(key.seq);
    }

    /// Forgets an in-flight `key` whose write failed, so a retry can try again.
    pub fn abort(&mut self, key: &Key) {
        self.pending.remove(key);
    }

    fn path(dir: &Path, through_seq: u64) -> PathBuf {
        dir.join(format!("keys-{through_seq:020}.json"))
    }

    /// Writes the applied keys as the snapshot for `through_seq` (durably).
    pub fn save(&self, dir: &Path, through_seq: u64) -> Result<()> {
        let snapshot = Snapshot {
            through_seq,
            sessions: self
                .applied
                .iter()
                .map(|((run, rank, session), r)| (run.clone(), *rank, session.clone(), r.clone()))
                .collect(),
        };
        let bytes = serde_json::to_vec(&snapshot)?;
        write_atomic(&Self::path(dir, through_seq), &bytes)
    }

    /// Loads the snapshot for `through_seq` (none is fine when nothing was flushed yet) and
    /// deletes every other snapshot.
    pub fn load(dir: &Path, through_seq: u64) -> Result<KeySet> {
        let path = Self::path(dir, through_seq);
        let mut set = KeySet::default();
        match fs::read(&path) {
            Ok(bytes) => {
                let snapshot: Snapshot =
                    serde_json::from_slice(&bytes).map_err(|e| Error::Corrupt {
                        what: path.display().to_string(),
                        reason: e.to_string(),
                    })?;
                for (run, rank, session, ranges) in snapshot.sessions {
                    set.applied.insert((run, rank, session), ranges);
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && through_seq == 0 => {}
            Err(e) => {
                return Err(Error::Corrupt {
                    what: path.display().to_string(),
                    reason: format!("the key snapshot of the last flush is unreadable: {e}"),
                });
            }
        }
        Self::prune(dir, through_seq)?;
        Ok(set)
    }

    /// Deletes snapshots other than the one for `keep_seq`.
    pub fn prune(dir: &Path, keep_seq: u64) -> Result<()> {
        let keep = Self::path(dir, keep_seq);
        for entry in fs::read_dir(dir)? {
            let path = entry?.path();
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
            if name.starts_with("keys-") && path != keep {
                fs::remove_file(&path)?;
            }
        }
        Ok(())
    }
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
        set.commit(&key(1));
        assert_eq!(set.begin(&key(1)), Check::Applied);
    }

    #[test]
    fn snapshots_round_trip_and_only_the_committed_one_survives() {
        let dir = tempfile::tempdir().unwrap();
        let mut set = KeySet::default();
        for s in [1, 2, 3, 10, 12] {
            set.commit(&key(s));
        }
        set.save(dir.path(), 40).unwrap();
        set.commit(&key(11));
        set.save(dir.path(), 41).unwrap();
        let loaded = KeySet::load(dir.path(), 40).unwrap();
        assert!(loaded.is_applied(&key(10)) && !loaded.is_applied(&key(11)));
        assert!(!KeySet::path(dir.path(), 41).exists());
        assert!(KeySet::load(dir.path(), 99).is_err());
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
