//! Deleting a run beside live ingest (issue 45 item 10): the store's lock is not held while
//! the deletion writes its manifest (on object storage a PUT, behind which every
//! acknowledgement waited), and rows of the run that arrive meanwhile start it anew, in memory
//! and after a restart. The manifest's write is held open here by the store's file-system
//! seam (`rankwatch_collector::disk`), a disk whose rename over `manifest.json` waits.

use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use rankwatch_analytics::{RunId, Sample};
use rankwatch_collector::Collector;
use rankwatch_collector::disk::{Disk, DiskFile, RealDisk};

use crate::common::*;

/// The real file system, except that while `hold` is set a rename over `manifest.json` waits
/// for `release` (and says, through `waiting`, that it does).
#[derive(Debug, Default)]
struct GateDisk {
    hold: AtomicBool,
    waiting: AtomicBool,
    open: Mutex<bool>,
    opened: Condvar,
}

impl GateDisk {
    fn release(&self) {
        *self.open.lock().unwrap() = true;
        self.opened.notify_all();
    }
}

impl Disk for GateDisk {
    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        RealDisk.create_dir_all(dir)
    }
    fn create(&self, path: &Path) -> io::Result<Box<dyn DiskFile>> {
        RealDisk.create(path)
    }
    fn open_append(&self, path: &Path) -> io::Result<Box<dyn DiskFile>> {
        RealDisk.open_append(path)
    }
    fn truncate(&self, path: &Path, len: u64) -> io::Result<()> {
        RealDisk.truncate(path, len)
    }
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        if self.hold.load(Ordering::SeqCst) && to.file_name().is_some_and(|n| n == "manifest.json")
        {
            self.waiting.store(true, Ordering::SeqCst);
            let open = self.open.lock().unwrap();
            drop(self.opened.wait_while(open, |open| !*open).unwrap());
        }
        RealDisk.rename(from, to)
    }
    fn remove_file(&self, path: &Path) -> io::Result<()> {
        RealDisk.remove_file(path)
    }
    fn remove_dir(&self, dir: &Path) -> io::Result<()> {
        RealDisk.remove_dir(dir)
    }
    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        RealDisk.sync_dir(dir)
    }
}

async fn ingest(c: &Collector, rows: &[Sample]) {
    let reply = post(c, "/api/v1/ingest", ARROW, None, samples_ipc(rows, false)).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
}

fn rows_of(c: &Collector, run: &str) -> usize {
    let run = RunId::new(run).unwrap();
    let hot: usize = c
        .store()
        .samples_view(&run)
        .hot
        .iter()
        .map(|b| b.num_rows())
        .sum();
    let files: u64 = c
        .store()
        .files()
        .iter()
        .filter(|f| f.table == "samples" && f.run == run)
        .map(|f| f.rows)
        .sum();
    hot + files as usize
}

/// Starts deleting `run` with its manifest write held open by `disk`; returns once the
/// write is reached and the store's lock is seen free meanwhile (before, the deletion held it
/// across this write, and every acknowledgement waited for it). The lock is asked for from a
/// thread of its own, so that a lock still held fails the test instead of hanging it: the
/// write is let go first.
async fn delete_held_open(
    c: &Collector,
    disk: &Arc<GateDisk>,
    run: &str,
) -> tokio::task::JoinHandle<rankwatch_collector::Result<rankwatch_collector::store::Deleted>> {
    disk.hold.store(true, Ordering::SeqCst);
    let store = c.store().clone();
    let run = RunId::new(run).unwrap();
    let deletion = tokio::spawn(async move { store.delete_run(&run).await });
    tokio::time::timeout(Duration::from_secs(30), async {
        while !disk.waiting.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the deletion reaches its manifest write");
    let (told, answer) = std::sync::mpsc::channel();
    let asker = c.store().clone();
    std::thread::spawn(move || {
        let _ = told.send(asker.with_runs(|runs| runs.len()));
    });
    if answer.recv_timeout(Duration::from_secs(10)).is_err() {
        disk.release();
        panic!("the store's lock was held while the deletion wrote its manifest");
    }
    deletion
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledgements_go_on_while_a_deletion_writes_its_manifest_and_new_rows_stay() {
    let dir = tempfile::tempdir().unwrap();
    let disk = Arc::new(GateDisk::default());
    let c = open_on_disk(dir.path(), disk.clone()).await;
    let keep = workload("keep", 2, 20, 1);
    let old = workload("gone", 2, 20, 1);
    ingest(&c, &keep).await;
    ingest(&c, &old).await;
    c.flush().await.unwrap();
    // Old rows both in files and in the hot buffer.
    let old_hot: Vec<Sample> = workload("gone", 2, 40, 1)
        .into_iter()
        .skip(old.len())
        .collect();
    ingest(&c, &old_hot).await;

    let deletion = delete_held_open(&c, &disk, "gone").await;
    // So another run's batch and a new batch of the run being deleted are both acknowledged.
    let more_keep: Vec<Sample> = workload("keep", 2, 40, 1)
        .into_iter()
        .skip(keep.len())
        .collect();
    let anew: Vec<Sample> = workload("gone", 1, 5, 1)
        .into_iter()
        .map(|mut s| {
            s.step += 1_000;
            s
        })
        .collect();
    tokio::time::timeout(Duration::from_secs(20), async {
        ingest(&c, &more_keep).await;
        ingest(&c, &anew).await;
    })
    .await
    .expect("ingest is acknowledged while the deletion writes its manifest");
    // Readers still see the run until the deletion commits.
    assert_eq!(rows_of(&c, "gone"), old.len() + old_hot.len() + anew.len());

    disk.release();
    let deleted = tokio::time::timeout(Duration::from_secs(30), deletion)
        .await
        .expect("the deletion ends")
        .unwrap()
        .unwrap();
    assert_eq!(
        deleted.rows as usize,
        old.len() + old_hot.len(),
        "{deleted:?}"
    );
    assert_eq!(
        rows_of(&c, "gone"),
        anew.len(),
        "the rows that came after stay"
    );
    assert_eq!(rows_of(&c, "keep"), keep.len() + more_keep.len());
    let summary_rows = c
        .store()
        .with_runs(|runs| runs.get(&RunId::new("gone").unwrap()).map(|s| s.samples));
    assert_eq!(
        summary_rows,
        Some(anew.len() as u64),
        "the run's summary is of its new rows"
    );
    let first_step = c.store().with_runs(|runs| {
        runs.get(&RunId::new("gone").unwrap())
            .and_then(|s| s.first_step)
    });
    assert_eq!(first_step, Some(1_000), "and so are its steps");
    // The hot buffer's count is of the batches it still holds.
    let held: usize = ["keep", "gone"]
        .iter()
        .flat_map(|r| c.store().samples_view(&RunId::new(*r).unwrap()).hot)
        .map(|b| b.get_array_memory_size())
        .sum();
    assert_eq!(c.store().hot_bytes(), held);
    drop(c);

    // After a restart (the log replayed against the tombstone): the same.
    disk.hold.store(false, Ordering::SeqCst);
    let c = open_on_disk(dir.path(), disk).await;
    assert_eq!(rows_of(&c, "gone"), anew.len());
    assert_eq!(rows_of(&c, "keep"), keep.len() + more_keep.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_announced_again_while_it_is_deleted_is_kept_with_its_announcement() {
    let dir = tempfile::tempdir().unwrap();
    let disk = Arc::new(GateDisk::default());
    let c = open_on_disk(dir.path(), disk.clone()).await;
    let old = workload("gone", 2, 20, 1);
    ingest(&c, &old).await;
    let deletion = delete_held_open(&c, &disk, "gone").await;
    // The job starts again: its announcement alone, no rows yet.
    let reply = post(
        &c,
        "/api/v1/ingest?table=runs",
        ARROW,
        None,
        runs_ipc(&info("gone", 3, 1)),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    disk.release();
    let deleted = deletion.await.unwrap().unwrap();
    assert_eq!(deleted.rows as usize, old.len());
    let world = |c: &Collector| {
        c.store().with_runs(|runs| {
            runs.get(&RunId::new("gone").unwrap())
                .and_then(|s| s.info.as_ref().map(|i| i.world_size))
        })
    };
    assert_eq!(world(&c), Some(3), "the new announcement is kept");
    assert_eq!(rows_of(&c, "gone"), 0);
    // Written by the next flush, and so after a restart too.
    c.flush().await.unwrap();
    drop(c);
    disk.hold.store(false, Ordering::SeqCst);
    let c = open_on_disk(dir.path(), disk).await;
    assert_eq!(world(&c), Some(3));
    assert_eq!(rows_of(&c, "gone"), 0);
}
