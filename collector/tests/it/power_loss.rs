//! Power loss (issue 45 item 9): the write-ahead log, the store's flushes, compactions and
//! manifest commits all run on a model disk that keeps, at a simulated power cut, only what
//! was made durable — file contents fsynced, directory entries (creates, renames, deletes)
//! fsynced in their directory — as LazyFS does, through the data directory's file-system seam
//! (`rankwatch_collector::disk::model`). The power fails after the Nth disk operation, for
//! crash points spread over a whole run of concurrent ingest, flushes and a compaction; the
//! durable image is opened by a fresh collector. Every acknowledged batch must be there, none
//! twice.
//!
//! `RANKWATCH_POWER_CUTS` sets the number of crash points (40 by default) and
//! `RANKWATCH_POWER_ROUNDS` the length of the run (6 rounds); the 1,000-point benchmark is
//! `RANKWATCH_POWER_CUTS=1000 cargo test -p rankwatch-collector --test it power_loss --
//! --nocapture`, which prints its tally every 100 points. Removing the log's `sync_data`, its
//! directory fsync after a new segment, the directory fsync after a rename in
//! `disk::write_with`, or the file fsync before it, makes this test fail.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use rankwatch_analytics::RunId;
use rankwatch_collector::Collector;
use rankwatch_collector::clock::SystemClock;
use rankwatch_collector::disk::model::PowerCutDisk;
use rankwatch_collector::entry::Table;

use crate::common::*;

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
    let disk = PowerCutDisk::new(cut_after);
    let mut acked: BTreeMap<&'static str, Vec<u64>> = BTreeMap::new();
    let mut config = config(live.path());
    config.no_alert_engine = true;
    config.compact_small_rows = 1 << 20;
    if let Ok(c) = Collector::open_on(&config, SystemClock::shared(), Arc::new(disk.clone())).await
    {
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
        disk.materialise(live.path(), image.path()).unwrap();
        let _ = c.shutdown().await;
    } else {
        disk.materialise(live.path(), image.path()).unwrap();
    }
    let ops = disk.operations();
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
        if (i + 1) % 100 == 0 {
            eprintln!(
                "power cuts so far: {} of {points}; {acked_batches} acknowledged batches; {lost} \
                 acknowledged steps lost; {doubled} steps stored twice",
                i + 1
            );
        }
    }
    eprintln!(
        "power cuts: {points} crash points over {total} disk operations; {acked_batches} \
         acknowledged batches; {lost} acknowledged steps lost; {doubled} steps stored twice"
    );
    assert_eq!(lost, 0, "acknowledged rows were lost");
    assert_eq!(doubled, 0, "rows were stored twice");
}
