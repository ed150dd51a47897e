//! The manifest: which Parquet files make up each table, and how far the write-ahead log has
//! been flushed into them. It is the commit point of every flush and compaction: a file that
//! is not listed does not exist for readers, and is deleted on start.

use std::fs;
use std::path::{Path, PathBuf};

use rankwatch_analytics::RunId;
use serde::{Deserialize, Serialize};

use crate::disk::{Disk, write_atomic};
use crate::entry::Table;
use crate::error::{Error, Result};

const FILE: &str = "manifest.json";
/// Written as 2 since rollup entries may list sparse metrics ([`FileMeta::sparse`]): a collector
/// that knows only 1 refuses such a manifest instead of answering narrow buckets without them.
/// Version 1 (no entries: every metric at every level) is read as it is.
const VERSION: u32 = 2;

/// One Parquet file of one table and run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FileMeta {
    pub table: String,
    pub run: RunId,
    pub part: u64,
    pub rows: u64,
    pub bytes: u64,
    pub min_step: Option<u64>,
    pub max_step: Option<u64>,
    /// The collector that wrote it, in object storage (part of the name there, so collectors
    /// sharing one prefix never collide); absent for the data directory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// Which holder of `node` wrote it (a prefix of its data directory's identity), in object
    /// storage: after a take-over, a late flush of the collector that lost the node id writes
    /// other names than the new holder's, so it can never replace a part the new holder lists.
    /// Absent in parts written before this existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub writer: Option<String>,
    /// A rollup part's sparse metrics: those it summarises only from a coarser level than the
    /// first ([`super::rollup::Summary::sparse`]). Every other metric, and every metric of a
    /// part written before this existed, has every level.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub sparse: std::collections::BTreeMap<String, super::rollup::Finest>,
}

impl FileMeta {
    /// Path relative to the data directory, in the Hive layout.
    pub fn relative(&self) -> PathBuf {
        file_path(
            &self.table,
            &self.run,
            self.node.as_deref(),
            self.writer.as_deref(),
            self.part,
        )
    }

    /// Whether this file and `other` share their run, part number and writer: a samples part
    /// and its rollup.
    pub fn pairs(&self, other: &FileMeta) -> bool {
        self.part == other.part
            && self.run == other.run
            && self.node == other.node
            && self.writer == other.writer
    }

    /// Whether this file belongs to `table` of `run`.
    pub fn is(&self, table: Table, run: &RunId) -> bool {
        self.table == table.as_str() && self.run == *run
    }
}

/// `table=<t>/run=<id>/part-<n>.parquet`, or `part-<node>-<n>.<writer>.parquet` for a node's
/// part (`part-<node>-<n>.parquet` when written before writers were named).
pub fn file_path(
    table: &str,
    run: &RunId,
    node: Option<&str>,
    writer: Option<&str>,
    part: u64,
) -> PathBuf {
    let name = match (node, writer) {
        (Some(node), Some(writer)) => format!("part-{node}-{part}.{writer}.parquet"),
        (Some(node), None) => format!("part-{node}-{part}.parquet"),
        (None, _) => format!("part-{part}.parquet"),
    };
    Path::new(&format!("table={table}"))
        .join(format!("run={run}"))
        .join(name)
}

/// The durable description of the Parquet side of the store.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Manifest {
    pub version: u32,
    /// Every write-ahead-log record at or below this sequence number is in `files`.
    pub flushed_seq: u64,
    /// The part number the next file gets.
    pub next_part: u64,
    pub files: Vec<FileMeta>,
    /// Deleted runs whose write-ahead-log records may not all be flushed yet: replay skips a
    /// record of such a run at or below its sequence number. Dropped once `flushed_seq`
    /// passes it (the log no longer holds those records).
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub deleted_runs: std::collections::BTreeMap<RunId, u64>,
}

impl Default for Manifest {
    fn default() -> Self {
        Manifest {
            version: VERSION,
            flushed_seq: 0,
            next_part: 0,
            files: Vec::new(),
            deleted_runs: Default::default(),
        }
    }
}

impl Manifest {
    /// Loads the manifest of `dir`; `None` where none was ever written.
    pub fn load(dir: &Path) -> Result<Option<Manifest>> {
        let path = dir.join(FILE);
        match fs::read(&path) {
            Ok(bytes) => Manifest::from_json(&bytes, &path.display().to_string()).map(Some),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Parses a manifest read from `what`.
    pub fn from_json(bytes: &[u8], what: &str) -> Result<Manifest> {
        let manifest: Manifest = serde_json::from_slice(bytes).map_err(|e| Error::Corrupt {
            what: what.to_owned(),
            reason: e.to_string(),
        })?;
        if !(1..=VERSION).contains(&manifest.version) {
            return Err(Error::Corrupt {
                what: what.to_owned(),
                reason: format!("unsupported manifest version {}", manifest.version),
            });
        }
        Ok(manifest)
    }

    /// The manifest as stored.
    pub fn to_json(&self) -> Result<Vec<u8>> {
        Ok(serde_json::to_vec_pretty(self)?)
    }

    /// Replaces the manifest durably.
    pub fn save(&self, disk: &dyn Disk, dir: &Path) -> Result<()> {
        Ok(write_atomic(disk, &dir.join(FILE), &self.to_json()?)?)
    }

    /// Deletes Parquet files the manifest does not list (left by a crash between writing a
    /// file and committing it) and temporary files. Returns how many were removed (`dry`:
    /// would be, deleting nothing).
    pub fn remove_unlisted(&self, disk: &dyn Disk, dir: &Path, dry: bool) -> Result<usize> {
        let listed: std::collections::HashSet<PathBuf> =
            self.files.iter().map(|f| dir.join(f.relative())).collect();
        let mut removed = 0;
        for table in read_dir_if_exists(dir)? {
            if !is_dir_named(&table, "table=") {
                continue;
            }
            for run in read_dir_if_exists(&table)? {
                if !is_dir_named(&run, "run=") {
                    continue;
                }
                for file in read_dir_if_exists(&run)? {
                    let name = file.file_name().and_then(|n| n.to_str()).unwrap_or("");
                    let ours = name.starts_with("part-")
                        && (name.ends_with(".parquet") || name.ends_with(".tmp"));
                    if ours && !listed.contains(&file) {
                        if !dry {
                            tracing::info!(file = %file.display(), "removing a file no manifest lists");
                            disk.remove_file(&file)?;
                        }
                        removed += 1;
                    }
                }
            }
        }
        Ok(removed)
    }
}

fn read_dir_if_exists(dir: &Path) -> Result<Vec<PathBuf>> {
    match fs::read_dir(dir) {
        Ok(entries) => Ok(entries.filter_map(|e| e.ok().map(|e| e.path())).collect()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(e.into()),
    }
}

fn is_dir_named(path: &Path, prefix: &str) -> bool {
    path.is_dir()
        && path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with(prefix))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::rollup::Finest;

    fn part(table: &str, part: u64, node: Option<&str>, writer: Option<&str>) -> FileMeta {
        FileMeta {
            table: table.into(),
            run: RunId::new("r").unwrap(),
            part,
            rows: 1,
            bytes: 1,
            min_step: Some(0),
            max_step: Some(0),
            node: node.map(str::to_owned),
            writer: writer.map(str::to_owned),
            sparse: Default::default(),
        }
    }

    /// Compaction drops the files that pair with the parts it merged: another writer's part
    /// with the same number on the same node is not one of them.
    #[test]
    fn a_part_pairs_with_its_own_writers_rollup_only() {
        let samples = part("samples", 7, Some("n1"), Some("w1"));
        assert!(samples.pairs(&part("rollups", 7, Some("n1"), Some("w1"))));
        assert!(!samples.pairs(&part("rollups", 7, Some("n1"), Some("w2"))));
        assert!(!samples.pairs(&part("samples", 7, Some("n1"), None)));
        assert!(!samples.pairs(&part("rollups", 7, Some("n2"), Some("w1"))));
        assert!(!samples.pairs(&part("rollups", 8, Some("n1"), Some("w1"))));
        assert!(part("samples", 7, None, None).pairs(&part("rollups", 7, None, None)));
    }

    #[test]
    fn version_1_is_read_version_2_keeps_sparse_metrics_and_a_later_one_is_refused() {
        let finest = Finest {
            rank: Some(6),
            pooled: None,
        };
        let manifest = Manifest {
            files: vec![FileMeta {
                table: "rollups".into(),
                run: RunId::new("r").unwrap(),
                part: 3,
                rows: 10,
                bytes: 100,
                min_step: Some(0),
                max_step: Some(99),
                node: None,
                writer: None,
                sparse: [("act_max".to_owned(), finest)].into(),
            }],
            ..Manifest::default()
        };
        let json = String::from_utf8(manifest.to_json().unwrap()).unwrap();
        assert!(json.contains(r#""version": 2"#), "{json}");
        let back = Manifest::from_json(json.as_bytes(), "m").unwrap();
        assert_eq!(back.files, manifest.files);
        // A version-1 manifest (written before sparse metrics): every metric at every level.
        let old = json
            .replace(r#""version": 2"#, r#""version": 1"#)
            .replace(r#""sparse""#, r#""ignored""#);
        let old = Manifest::from_json(old.as_bytes(), "m").unwrap();
        assert!(old.files[0].sparse.is_empty());
        let newer = json.replace(r#""version": 2"#, r#""version": 3"#);
        let err = Manifest::from_json(newer.as_bytes(), "m").unwrap_err();
        assert!(
            err.to_string().contains("unsupported manifest version 3"),
            "{err}"
        );
    }
}
