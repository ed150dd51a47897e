//! The alert journal: every alert state change is on disk before anyone outside hears of it.
//!
//! Alerts live in the store's memory and reach Parquet (`table=alerts`) at each flush. Between
//! two flushes a `kill -9` used to lose every change — an alert that resolved came back firing,
//! and replaying the log re-raised alerts receivers had already been told about. Now the alert
//! engine appends each change here and fsyncs (one fsync per engine step, however many changes)
//! before it hands the change to the sinks. At start the journal is applied over the Parquet
//! alerts, the later `updated_at_ms` winning.
//!
//! Files are `alerts-<n>.log`, one line per entry: `<crc32 hex> <json>`. An entry is an alert's
//! new state or a run's deletion (so a deleted run's alerts are not brought back by older
//! lines). A line that is torn or fails its CRC is skipped and counted. A flush *rotates*
//! just before it takes its snapshot of the alerts (later changes go to the next file) and
//! deletes the files up to the rotated one once its manifest is committed: what they held is
//! in Parquet then. The store upserts an alert in memory before it is journaled, so whatever
//! reached a file before the rotation is in the snapshot taken after it; whatever comes later
//! is in a file the flush keeps. A journal with nothing new is not rotated.

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use rankwatch_analytics::{Alert, RunId};
use serde::{Deserialize, Serialize};

use crate::error::Result;

/// The journal's folder in the data directory.
pub const DIR: &str = "alert-journal";

/// One journal line.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum Line {
    Alert(Box<StoredAlert>),
    RunDeleted(String),
}

/// An alert as the collector keeps it in its own JSON files (this journal, the alert
/// receivers' records): JSON has no NaN or infinity (a `nonfinite` alert's value is NaN), so
/// the two floats travel as their bits.
#[derive(Debug, Serialize, Deserialize)]
pub struct StoredAlert {
    alert: Alert,
    value_bits: u64,
    threshold_bits: u64,
}

impl StoredAlert {
    pub fn new(alert: &Alert) -> StoredAlert {
        let mut copy = alert.clone();
        copy.value = 0.0;
        copy.threshold = 0.0;
        StoredAlert {
            value_bits: alert.value.to_bits(),
            threshold_bits: alert.threshold.to_bits(),
            alert: copy,
        }
    }

    pub fn into_alert(self) -> Alert {
        let mut alert = self.alert;
        alert.value = f64::from_bits(self.value_bits);
        alert.threshold = f64::from_bits(self.threshold_bits);
        alert
    }
}

/// What the journal held at start, in order applied.
#[derive(Debug, Default)]
pub struct Recovered {
    /// The latest state of each journaled alert, by id.
    pub alerts: BTreeMap<String, Alert>,
    /// Runs deleted after some of their lines: their alerts go, whatever Parquet holds.
    pub deleted: Vec<RunId>,
    /// Lines skipped as torn or damaged.
    pub damaged: usize,
}

/// The open journal.
#[derive(Debug)]
pub struct AlertLog {
    dir: PathBuf,
    active: Mutex<Active>,
}

#[derive(Debug)]
struct Active {
    number: u64,
    file: File,
    /// Whether anything was appended to this file (an empty one needs no rotation).
    written: bool,
}

fn path(dir: &Path, number: u64) -> PathBuf {
    dir.join(format!("alerts-{number:020}.log"))
}

fn numbers(dir: &Path) -> Result<Vec<u64>> {
    let mut out: Vec<u64> = fs::read_dir(dir)?
        .filter_map(|e| {
            let name = e.ok()?.file_name();
            name.to_str()?
                .strip_prefix("alerts-")?
                .strip_suffix(".log")?
                .parse()
                .ok()
        })
        .collect();
    out.sort_unstable();
    Ok(out)
}

impl AlertLog {
    /// Opens the journal in `data_dir`, reading what earlier processes left.
    pub fn open(data_dir: &Path) -> Result<(AlertLog, Recovered)> {
        let dir = data_dir.join(DIR);
        fs::create_dir_all(&dir)?;
        let mut recovered = Recovered::default();
        let existing = numbers(&dir)?;
        for number in &existing {
            let text = fs::read(path(&dir, *number))?;
            for raw in text.split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
                match parse(raw) {
                    Some(Line::Alert(stored)) => {
                        let alert = stored.into_alert();
                        let newer = recovered
                            .alerts
                            .get(&alert.id)
                            .is_none_or(|old| old.updated_at_ms <= alert.updated_at_ms);
                        if newer {
                            recovered.alerts.insert(alert.id.clone(), alert);
                        }
                    }
                    Some(Line::RunDeleted(run)) => match RunId::new(run) {
                        Ok(run) => {
                            recovered.alerts.retain(|_, a| a.run != run);
                            recovered.deleted.push(run);
                        }
                        Err(_) => recovered.damaged += 1,
                    },
                    None => recovered.damaged += 1,
                }
            }
        }
        if recovered.damaged > 0 {
            tracing::warn!(
                lines = recovered.damaged,
                "torn or damaged alert-journal lines skipped (a crash mid-write leaves one)"
            );
        }
        let number = existing.last().map_or(0, |n| n + 1);
        let file = open_new(&dir, number)?;
        Ok((
            AlertLog {
                dir,
                active: Mutex::new(Active {
                    number,
                    file,
                    written: false,
                }),
            },
            recovered,
        ))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Active> {
        self.active.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Appends alert states and makes them durable.
    pub fn append(&self, alerts: &[Alert]) -> Result<()> {
        let lines: Vec<Line> = alerts
            .iter()
            .map(|a| Line::Alert(Box::new(StoredAlert::new(a))))
            .collect();
        self.write(&lines)
    }

    /// Records that `run` was deleted, durably.
    pub fn run_deleted(&self, run: &RunId) -> Result<()> {
        self.write(&[Line::RunDeleted(run.to_string())])
    }

    fn write(&self, lines: &[Line]) -> Result<()> {
        let mut bytes = Vec::new();
        for line in lines {
            let json = serde_json::to_vec(line)?;
            write!(bytes, "{:08x} ", crc32fast::hash(&json))?;
            bytes.extend_from_slice(&json);
            bytes.push(b'\n');
        }
        let mut active = self.lock();
        active.written = true;
        active.file.write_all(&bytes)?;
        active.file.sync_data()?;
        Ok(())
    }

    /// Starts a new file for later changes and returns the number of the last one that a
    /// snapshot of the alerts taken after this call covers; `None` when nothing was journaled
    /// since the last rotation (no new file, nothing to delete).
    pub fn rotate(&self) -> Result<Option<u64>> {
        let mut active = self.lock();
        if !active.written {
            return Ok(None);
        }
        let covered = active.number;
        let file = open_new(&self.dir, covered + 1)?;
        *active = Active {
            number: covered + 1,
            file,
            written: false,
        };
        Ok(Some(covered))
    }

    /// Deletes the files a committed flush covers.
    pub fn remove_through(&self, covered: u64) -> Result<()> {
        for number in numbers(&self.dir)? {
            if number <= covered {
                fs::remove_file(path(&self.dir, number))?;
            }
        }
        Ok(())
    }
}

fn open_new(dir: &Path, number: u64) -> Result<File> {
    let file = OpenOptions::new()
        .create(true)
        .append(true)
        .open(path(dir, number))?;
    crate::fsutil::sync_parent(&path(dir, number))?;
    Ok(file)
}

fn parse(raw: &[u8]) -> Option<Line> {
    let text = std::str::from_utf8(raw).ok()?;
    let (crc, json) = text.split_once(' ')?;
    let crc = u32::from_str_radix(crc, 16).ok()?;
    if crc32fast::hash(json.as_bytes()) != crc {
        return None;
    }
    serde_json::from_str(json).ok()
}

/// A per-rank `nonfinite` alert with NaN and infinite floats, for tests of what stores alerts.
#[cfg(test)]
pub(crate) fn test_alert(
    id: &str,
    run: &str,
    state: rankwatch_analytics::AlertState,
    updated: i64,
) -> Alert {
    use rankwatch_analytics::{Rule, Severity};
    Alert {
        id: id.into(),
        run: RunId::new(run).unwrap(),
        rule: Rule::Nonfinite,
        severity: Severity::Critical,
        state,
        layer: None,
        site: None,
        rank: Some(1),
        outlier_ranks: vec![],
        first_step: 1,
        last_step: 2,
        value: f64::NAN,
        threshold: f64::INFINITY,
        explanation: "x".into(),
        started_at_ms: 1,
        fired_at_ms: Some(1),
        resolved_at_ms: None,
        updated_at_ms: updated,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rankwatch_analytics::AlertState;

    #[test]
    fn changes_come_back_latest_first_and_a_deleted_run_stays_deleted() {
        let dir = tempfile::tempdir().unwrap();
        let (log, recovered) = AlertLog::open(dir.path()).unwrap();
        assert!(recovered.alerts.is_empty());
        log.append(&[test_alert("a", "r1", AlertState::Firing, 10)])
            .unwrap();
        log.append(&[
            test_alert("a", "r1", AlertState::Resolved, 20),
            test_alert("b", "r2", AlertState::Firing, 15),
            test_alert("c", "gone", AlertState::Firing, 15),
        ])
        .unwrap();
        log.run_deleted(&RunId::new("gone").unwrap()).unwrap();
        // An older state written later (out of order) does not win.
        log.append(&[test_alert("b", "r2", AlertState::Pending, 5)])
            .unwrap();
        drop(log);
        let (_, recovered) = AlertLog::open(dir.path()).unwrap();
        assert_eq!(recovered.alerts["a"].state, AlertState::Resolved);
        assert!(recovered.alerts["a"].value.is_nan(), "a NaN value survives");
        assert_eq!(recovered.alerts["b"].state, AlertState::Firing);
        assert!(!recovered.alerts.contains_key("c"));
        assert_eq!(recovered.deleted.len(), 1);
    }

    #[test]
    fn a_torn_line_is_skipped_and_counted_and_rotation_drops_covered_files() {
        let dir = tempfile::tempdir().unwrap();
        let (log, _) = AlertLog::open(dir.path()).unwrap();
        log.append(&[test_alert("a", "r1", AlertState::Firing, 10)])
            .unwrap();
        let covered = log.rotate().unwrap().expect("something was journaled");
        log.append(&[test_alert("b", "r1", AlertState::Firing, 11)])
            .unwrap();
        // A crash mid-line in the newest file.
        let newest = path(&dir.path().join(DIR), covered + 1);
        let mut f = OpenOptions::new().append(true).open(&newest).unwrap();
        f.write_all(b"0badc0de {\"alert\":").unwrap();
        drop(f);
        drop(log);
        let (log, recovered) = AlertLog::open(dir.path()).unwrap();
        assert_eq!(recovered.damaged, 1);
        assert_eq!(recovered.alerts.len(), 2);
        log.remove_through(covered).unwrap();
        drop(log);
        let (_, recovered) = AlertLog::open(dir.path()).unwrap();
        assert_eq!(
            recovered.alerts.keys().collect::<Vec<_>>(),
            ["b"],
            "the covered file is gone"
        );
    }
}
