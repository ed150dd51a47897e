//! Power loss under the Parquet side (issue 45 item 9): the store's flushes, compactions and
//! manifest commits run on a model disk that keeps, at a simulated power cut, only what was
//! made durable — file contents fsynced, directory entries (creates, renames, deletes)
//! fsynced in their directory — as LazyFS does, through the store's file-system seam
//! (`rankwatch_collector::disk`). The power fails after the Nth disk operation, for crash
//! points spread over a whole run of concurrent ingest, flushes and a compaction; the durable
//! image, with the write-ahead log as it stands, is opened by a fresh collector. Every
//! acknowledged batch must be there, none twice.
//!
//! `RANKWATCH_POWER_CUTS` sets the number of crash points (40 by default) and
//! `RANKWATCH_POWER_ROUNDS` the length of the run (6 rounds); the 1,000-point benchmark is
//! `RANKWATCH_POWER_CUTS=1000 RANKWATCH_POWER_ROUNDS=40 cargo test -p rankwatch-collector
//! --test it power_loss -- --nocapture`, which prints its tally. Removing the directory fsync after a rename in
//! `disk::write_with`, or the file fsync before it, makes this test fail.

use std::collections::{BTreeMap, HashMap};
use std::ffi::OsString;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use rankwatch_analytics::RunId;
use rankwatch_collector::Collector;
use rankwatch_collector::clock::SystemClock;
use rankwatch_collector::disk::{Disk, DiskFile, RealDisk};
use rankwatch_collector::entry::Table;

use crate::common::*;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Entry {
    File(u64),
    Dir,
}

#[derive(Debug, Default)]
struct Inode {
    current: Vec<u8>,
    durable: Vec<u8>,
}

#[derive(Debug, Default)]
struct DirEntries {
    current: BTreeMap<OsString, Entry>,
    durable: BTreeMap<OsString, Entry>,
}

/// What a power cut would leave: the model of every file and directory the store wrote.
#[derive(Debug, Default)]
struct Model {
    inodes: HashMap<u64, Inode>,
    dirs: HashMap<PathBuf, DirEntries>,
    next_inode: u64,
    ops: u64,
    /// The power fails after this many operations (every later one fails with `EIO`).
    cut_after: u64,
}

impl Model {
    fn step(&mut self) -> io::Result<()> {
        self.ops += 1;
        if self.ops > self.cut_after {
            return Err(io::Error::from_raw_os_error(5)); // EIO: the disk is gone
        }
        Ok(())
    }

    fn split(path: &Path) -> (PathBuf, OsString) {
        (
            path.parent().unwrap().to_owned(),
            path.file_name().unwrap().to_owned(),
        )
    }

    fn dir(&mut self, dir: &Path) -> &mut DirEntries {
        self.dirs.entry(dir.to_owned()).or_default()
    }
}

/// The real file system, mirrored into a [`Model`] that knows what is durable.
#[derive(Debug)]
struct PowerCutDisk {
    model: Arc<Mutex<Model>>,
}

struct ModelFile {
    file: std::fs::File,
    inode: u64,
    model: Arc<Mutex<Model>>,
}

impl Write for ModelFile {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let mut model = self.model.lock().unwrap();
        model.step()?;
        self.file.write_all(buf)?;
        model
            .inodes
            .get_mut(&self.inode)
            .unwrap()
            .current
            .extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl DiskFile for ModelFile {
    fn sync_all(&mut self) -> io::Result<()> {
        let mut model = self.model.lock().unwrap();
        model.step()?;
        let inode = model.inodes.get_mut(&self.inode).unwrap();
        inode.durable = inode.current.clone();
        Ok(())
    }

    fn len(&self) -> io::Result<u64> {
        Ok(self.file.metadata()?.len())
    }
}

impl Disk for PowerCutDisk {
    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        let mut model = self.model.lock().unwrap();
        model.step()?;
        let missing: Vec<PathBuf> = dir
            .ancestors()
            .take_while(|d| !d.exists())
            .map(Path::to_owned)
            .collect();
        RealDisk.create_dir_all(dir)?;
        for created in missing.iter().rev() {
            let (parent, name) = Model::split(created);
            model.dir(&parent).current.insert(name, Entry::Dir);
            model.dir(created);
        }
        Ok(())
    }

    fn create(&self, path: &Path) -> io::Result<Box<dyn DiskFile>> {
        let mut model = self.model.lock().unwrap();
        model.step()?;
        let file = std::fs::File::create(path)?;
        model.next_inode += 1;
        let inode = model.next_inode;
        model.inodes.insert(inode, Inode::default());
        let (parent, name) = Model::split(path);
        model.dir(&parent).current.insert(name, Entry::File(inode));
        Ok(Box::new(ModelFile {
            file,
            inode,
            model: self.model.clone(),
        }))
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        let mut model = self.model.lock().unwrap();
        model.step()?;
        RealDisk.rename(from, to)?;
        let (from_dir, from_name) = Model::split(from);
        let (to_dir, to_name) = Model::split(to);
        let moved = model.dir(&from_dir).current.remove(&from_name).unwrap();
        model.dir(&to_dir).current.insert(to_name, moved);
        Ok(())
    }

    fn remove_file(&self, path: &Path) -> io::Result<()> {
        let mut model = self.model.lock().unwrap();
        model.step()?;
        RealDisk.remove_file(path)?;
        let (dir, name) = Model::split(path);
        model.dir(&dir).current.remove(&name);
        Ok(())
    }

    fn remove_dir(&self, dir: &Path) -> io::Result<()> {
        let mut model = self.model.lock().unwrap();
        model.step()?;
        RealDisk.remove_dir(dir)?;
        let (parent, name) = Model::split(dir);
        model.dir(&parent).current.remove(&name);
        Ok(())
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        let mut model = self.model.lock().unwrap();
        model.step()?;
        let entries = model.dir(dir);
        entries.durable = entries.current.clone();
        Ok(())
    }
}

/// Whether the model owns this top-level name of the data directory (the Parquet side).
fn modelled(name: &str) -> bool {
    name.starts_with("table=") || name.starts_with("manifest.")
}

/// Writes what survives the power cut into `image`: the Parquet side from the model's durable
/// state, everything else (the write-ahead log, the key snapshots) as it is on disk.
fn materialise(model: &Model, live: &Path, image: &Path) {
    fn copy_tree(from: &Path, to: &Path, top: bool) {
        std::fs::create_dir_all(to).unwrap();
        for entry in std::fs::read_dir(from).unwrap().flatten() {
            let name = entry.file_name();
            if top && (modelled(&name.to_string_lossy()) || name == "LOCK") {
                continue;
            }
            let path = entry.path();
            if path.is_dir() {
                copy_tree(&path, &to.join(&name), false);
            } else {
                std::fs::copy(&path, to.join(&name)).unwrap();
            }
        }
    }
    copy_tree(live, image, true);
    fn durable_tree(model: &Model, dir: &Path, to: &Path) {
        let Some(entries) = model.dirs.get(dir) else {
            return;
        };
        for (name, entry) in &entries.durable {
            match entry {
                Entry::Dir => {
                    std::fs::create_dir_all(to.join(name)).unwrap();
                    durable_tree(model, &dir.join(name), &to.join(name));
                }
                Entry::File(inode) => {
                    std::fs::write(to.join(name), &model.inodes[inode].durable).unwrap();
                }
            }
        }
    }
    let Some(root) = model.dirs.get(live) else {
        return;
    };
    for (name, entry) in &root.durable {
        if !modelled(&name.to_string_lossy()) {
            continue;
        }
        match entry {
            Entry::Dir => {
                std::fs::create_dir_all(image.join(name)).unwrap();
                durable_tree(model, &live.join(name), &image.join(name));
            }
            Entry::File(inode) => {
                std::fs::write(image.join(name), &model.inodes[inode].durable).unwrap();
            }
        }
    }
}

const RUNS: [&str; 3] = ["alpha", "beta", "gamma"];
const STEPS_PER_BATCH: u64 = 5;

/// Rounds of ingest (`RANKWATCH_POWER_ROUNDS`, 6 by default): a longer run makes more disk
/// operations to cut at.
fn rounds() -> u64 {
    std::env::var("RANKWATCH_POWER_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(6)
}

fn batch(run: &str, round: u64) -> Vec<rankwatch_analytics::Sample> {
    workload(run, 2, (round + 1) * STEPS_PER_BATCH, 1)
        .into_iter()
        .filter(|s| s.step / STEPS_PER_BATCH == round)
        .collect()
}

/// One run of the workload on a disk that fails after `cut_after` operations: concurrent
/// ingest of three runs, flushes every other round, a compaction. Returns the rounds
/// acknowledged per run, the disk operations done, and the durable image.
async fn run_until_the_power_fails(
    cut_after: u64,
) -> (BTreeMap<&'static str, Vec<u64>>, u64, tempfile::TempDir) {
    let live = tempfile::tempdir().unwrap();
    let image = tempfile::tempdir().unwrap();
    let model = Arc::new(Mutex::new(Model {
        cut_after,
        ..Model::default()
    }));
    model.lock().unwrap().dir(live.path());
    let mut acked: BTreeMap<&'static str, Vec<u64>> = BTreeMap::new();
    let mut config = config(live.path());
    config.no_alert_engine = true;
    config.compact_small_rows = 1 << 20;
    let disk = Arc::new(PowerCutDisk {
        model: model.clone(),
    });
    if let Ok(c) = Collector::open_on(&config, SystemClock::shared(), disk).await {
        for round in 0..rounds() {
            let sends = RUNS.map(|run| {
                let c = &c;
                async move {
                    let key = format!("{run}/0/s/{round}");
                    let body = samples_ipc(&batch(run, round), false);
                    let reply = post(c, "/api/v1/ingest", ARROW, Some(&key), body).await;
                    (run, reply.status.as_u16())
                }
            });
            for (run, status) in futures_util::future::join_all(sends).await {
                if status == 200 {
                    acked.entry(run).or_default().push(round);
                }
            }
            if round % 2 == 1 {
                let _ = c.flush().await;
            }
            if round % 5 == 4 {
                let _ = c.store().compact().await;
                let _ = c.flush().await;
            }
        }
        // The power fails here (if it has not yet): what is durable is imaged, then the
        // collector is stopped (its own last flush cannot change the image).
        materialise(&model.lock().unwrap(), live.path(), image.path());
        let _ = c.shutdown().await;
    } else {
        materialise(&model.lock().unwrap(), live.path(), image.path());
    }
    let ops = model.lock().unwrap().ops;
    (acked, ops, image)
}

/// Rows per step of `run` in the store now (Parquet parts and the hot buffer).
fn rows_per_step(c: &Collector, dir: &Path, run: &str) -> BTreeMap<u64, usize> {
    let view = c.store().view(Table::Samples, &RunId::new(run).unwrap());
    let mut batches = view.batches;
    for file in &view.files {
        batches.extend(rankwatch_collector::store::files::read(&dir.join(file)).unwrap());
    }
    let mut rows = BTreeMap::new();
    for b in &batches {
        let steps = b
            .column_by_name("step")
            .unwrap()
            .as_any()
            .downcast_ref::<arrow_array::UInt64Array>()
            .unwrap();
        for step in steps.values() {
            *rows.entry(*step).or_default() += 1;
        }
    }
    rows
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_acknowledged_batch_survives_a_power_cut_at_any_disk_operation() {
    let points: u64 = std::env::var("RANKWATCH_POWER_CUTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(40);
    // The whole run once without a cut: how many operations there are to cut between.
    let (_, total, _) = run_until_the_power_fails(u64::MAX).await;
    assert!(total > 50, "the workload makes {total} disk operations");
    let per_step = batch("alpha", 0).len() / STEPS_PER_BATCH as usize;
    let (mut acked_batches, mut lost, mut doubled) = (0usize, 0usize, 0usize);
    for i in 0..points {
        // Spread over the run, with every small number early on (the first manifest).
        let cut_after = if points >= total {
            i % (total + 1)
        } else {
            i * total / points
        };
        let (acked, _, image) = run_until_the_power_fails(cut_after).await;
        let mut config = config(image.path());
        config.no_alert_engine = true;
        let c = Collector::open(&config)
            .await
            .unwrap_or_else(|e| panic!("cut after {cut_after}: the image does not open: {e}"));
        for run in RUNS {
            let rows = rows_per_step(&c, image.path(), run);
            let rounds = acked.get(run).cloned().unwrap_or_default();
            acked_batches += rounds.len();
            for round in &rounds {
                for step in round * STEPS_PER_BATCH..(round + 1) * STEPS_PER_BATCH {
                    let got = rows.get(&step).copied().unwrap_or(0);
                    if got < per_step {
                        lost += 1;
                        eprintln!(
                            "cut after {cut_after}: {run} step {step}: {got} of {per_step} rows"
                        );
                    }
                }
            }
            for (step, got) in &rows {
                if *got > per_step {
                    doubled += 1;
                    eprintln!("cut after {cut_after}: {run} step {step}: {got} rows, stored twice");
                }
            }
        }
        let _ = c.shutdown().await;
    }
    eprintln!(
        "power cuts: {points} crash points over {total} disk operations; {acked_batches} \
         acknowledged batches; {lost} acknowledged steps lost; {doubled} steps stored twice"
    );
    assert_eq!(lost, 0, "acknowledged rows were lost");
    assert_eq!(doubled, 0, "rows were stored twice");
}
