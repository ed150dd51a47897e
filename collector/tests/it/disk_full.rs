//! A full disk under the Parquet side (issue 45 item 8): a flush that runs out of space
//! half-way leaves no temporary file and no part that no manifest lists, so the space it took
//! is free again at once and the flush heals when space returns, without a restart; a flush
//! whose manifest write fails has its parts deleted after the next commit, and no row is lost
//! or stored twice. The disk is the store's file-system seam (`rankwatch_collector::disk`),
//! implemented here as a disk of a given size.

use std::collections::BTreeSet;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicUsize, Ordering};

use rankwatch_collector::Collector;
use rankwatch_collector::disk::{Disk, DiskFile, RealDisk};

use crate::common::*;

const ENOSPC: i32 = 28;

/// The real file system, with `free` bytes left: a write past them fails with `ENOSPC` as a
/// full disk's does; deleting or replacing a file gives its bytes back.
#[derive(Debug)]
struct SmallDisk {
    free: Arc<AtomicI64>,
    /// Refuse the rename that replaces `manifest.json` (once per `true`).
    refuse_manifest: AtomicBool,
    creates: AtomicUsize,
}

impl SmallDisk {
    fn new() -> SmallDisk {
        SmallDisk {
            free: Arc::new(AtomicI64::new(i64::MAX / 2)),
            refuse_manifest: AtomicBool::new(false),
            creates: AtomicUsize::new(0),
        }
    }

    fn give_back(&self, path: &Path) {
        if let Ok(meta) = std::fs::metadata(path) {
            self.free.fetch_add(meta.len() as i64, Ordering::SeqCst);
        }
    }
}

struct Metered {
    file: std::fs::File,
    free: Arc<AtomicI64>,
}

impl Write for Metered {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let want = buf.len() as i64;
        if self.free.fetch_sub(want, Ordering::SeqCst) < want {
            self.free.fetch_add(want, Ordering::SeqCst);
            return Err(io::Error::from_raw_os_error(ENOSPC));
        }
        self.file.write_all(buf)?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.file.flush()
    }
}

impl DiskFile for Metered {
    fn sync_all(&mut self) -> io::Result<()> {
        self.file.sync_all()
    }

    fn size(&self) -> io::Result<u64> {
        Ok(self.file.metadata()?.len())
    }
}

impl Disk for SmallDisk {
    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        RealDisk.create_dir_all(dir)
    }

    fn create(&self, path: &Path) -> io::Result<Box<dyn DiskFile>> {
        self.give_back(path);
        self.creates.fetch_add(1, Ordering::SeqCst);
        Ok(Box::new(Metered {
            file: std::fs::File::create(path)?,
            free: self.free.clone(),
        }))
    }

    fn open_append(&self, path: &Path) -> io::Result<Box<dyn DiskFile>> {
        Ok(Box::new(Metered {
            file: std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)?,
            free: self.free.clone(),
        }))
    }

    fn truncate(&self, path: &Path, len: u64) -> io::Result<()> {
        self.give_back(path);
        RealDisk.truncate(path, len)?;
        self.free.fetch_sub(len as i64, Ordering::SeqCst);
        Ok(())
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        if to.file_name().is_some_and(|n| n == "manifest.json")
            && self.refuse_manifest.swap(false, Ordering::SeqCst)
        {
            return Err(io::Error::from_raw_os_error(ENOSPC));
        }
        self.give_back(to);
        RealDisk.rename(from, to)
    }

    fn remove_file(&self, path: &Path) -> io::Result<()> {
        self.give_back(path);
        RealDisk.remove_file(path)
    }

    fn remove_dir(&self, dir: &Path) -> io::Result<()> {
        RealDisk.remove_dir(dir)
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        RealDisk.sync_dir(dir)
    }
}

/// Every file under the `table=*` folders, relative to the data directory.
fn files_on_disk(dir: &Path) -> BTreeSet<PathBuf> {
    let mut out = BTreeSet::new();
    for table in std::fs::read_dir(dir).unwrap().flatten() {
        if !table.file_name().to_string_lossy().starts_with("table=") {
            continue;
        }
        for run in std::fs::read_dir(table.path()).unwrap().flatten() {
            for file in std::fs::read_dir(run.path()).unwrap().flatten() {
                out.insert(file.path().strip_prefix(dir).unwrap().to_owned());
            }
        }
    }
    out
}

fn listed(c: &Collector) -> BTreeSet<PathBuf> {
    c.store().files().iter().map(|f| f.relative()).collect()
}

fn stored_sample_rows(c: &Collector) -> u64 {
    c.store()
        .files()
        .iter()
        .filter(|f| f.table == "samples")
        .map(|f| f.rows)
        .sum()
}

async fn ingest(c: &Collector, runs: std::ops::Range<u32>) -> u64 {
    let mut rows = 0;
    for i in runs {
        let batch = workload(&format!("run-{i}"), 4, 40, 2);
        rows += batch.len() as u64;
        let reply = post(c, "/api/v1/ingest", ARROW, None, samples_ipc(&batch, false)).await;
        assert_eq!(reply.status, 200, "{}", reply.text());
    }
    rows
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flush_that_fills_the_disk_leaves_nothing_behind_and_heals_when_space_returns() {
    let dir = tempfile::tempdir().unwrap();
    let disk = Arc::new(SmallDisk::new());
    let c = open_on_disk(dir.path(), disk.clone()).await;
    let mut sent = ingest(&c, 0..2).await;
    c.flush().await.unwrap();
    let one_part = c
        .store()
        .files()
        .iter()
        .filter(|f| f.table == "samples")
        .map(|f| f.bytes)
        .max()
        .unwrap() as i64;

    // Eight runs' parts to write, room for about two and a half.
    sent += ingest(&c, 2..10).await;
    disk.free.store(one_part * 5 / 2, Ordering::SeqCst);
    let before = disk.creates.load(Ordering::SeqCst);
    let err = c.flush().await.unwrap_err().to_string();
    assert!(err.contains("os error 28"), "{err}");
    let attempted = disk.creates.load(Ordering::SeqCst) - before;
    assert!(
        attempted >= 3,
        "the flush failed after writing whole parts ({attempted} files created)"
    );
    assert_eq!(
        files_on_disk(dir.path()),
        listed(&c),
        "a failed flush leaves no temporary file and no unlisted part"
    );
    assert_eq!(c.store().metrics().unlisted_files.get(), 0);
    assert_eq!(c.store().metrics().flush_errors.get(), 1);
    // The rows are still served from memory meanwhile.
    assert_eq!(
        c.store()
            .samples_view(&rankwatch_analytics::RunId::new("run-9").unwrap())
            .hot
            .iter()
            .map(|b| b.num_rows())
            .sum::<usize>(),
        workload("run-9", 4, 40, 2).len()
    );

    // Space returns: the next flush commits everything, once.
    disk.free.store(i64::MAX / 2, Ordering::SeqCst);
    c.flush().await.unwrap();
    assert_eq!(files_on_disk(dir.path()), listed(&c));
    assert_eq!(stored_sample_rows(&c), sent, "every row stored, none twice");
    let parts: Vec<u64> = c
        .store()
        .files()
        .iter()
        .filter(|f| f.table == "samples")
        .map(|f| f.part)
        .collect();
    let distinct: BTreeSet<u64> = parts.iter().copied().collect();
    assert_eq!(distinct.len(), parts.len(), "no part number used twice");
    drop(c);

    // And after a restart, the same.
    let c = open_on_disk(dir.path(), Arc::new(SmallDisk::new())).await;
    assert_eq!(stored_sample_rows(&c), sent);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parts_of_a_flush_whose_manifest_write_failed_go_after_the_next_commit() {
    let dir = tempfile::tempdir().unwrap();
    let disk = Arc::new(SmallDisk::new());
    let c = open_on_disk(dir.path(), disk.clone()).await;
    let mut sent = ingest(&c, 0..3).await;
    disk.refuse_manifest.store(true, Ordering::SeqCst);
    let err = c.flush().await.unwrap_err().to_string();
    assert!(err.contains("os error 28"), "{err}");
    let left = files_on_disk(dir.path());
    let waiting = left.difference(&listed(&c)).count();
    assert!(
        waiting >= 3,
        "the parts may be committed, so they wait: {left:?}"
    );
    assert_eq!(c.store().metrics().unlisted_files.get(), waiting as i64);

    sent += ingest(&c, 3..4).await;
    c.flush().await.unwrap();
    assert_eq!(
        files_on_disk(dir.path()),
        listed(&c),
        "the failed flush's parts are gone once a manifest that does not list them is in force"
    );
    assert_eq!(c.store().metrics().unlisted_files.get(), 0);
    assert_eq!(stored_sample_rows(&c), sent, "every row stored, none twice");
    drop(c);
    let c = open_on_disk(dir.path(), Arc::new(SmallDisk::new())).await;
    assert_eq!(stored_sample_rows(&c), sent);
}
