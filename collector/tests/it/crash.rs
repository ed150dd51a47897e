//! `kill -9` at random moments, several times, while several writers stream: after each
//! restart every acknowledged row is queryable exactly once, and batches whose
//! acknowledgement was lost are retried with the same idempotency key and land once.
//!
//! Runs the real `rankwatch` binary with short flush and compaction intervals, so kills land
//! in the middle of group commits, flushes and compactions too.

use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::common::*;
use serde_json::{Value, json};

const WRITERS: u32 = 4;
/// A writer stops starting new batches after this many, if the kill rounds are not over.
const MAX_BATCHES: u64 = 100_000;
const ROWS: u64 = 50;
const RUN: &str = "crash";

fn spawn(dir: &std::path::Path) -> (Child, String) {
    spawn_rankwatch(
        dir,
        &["--flush-interval", "150ms", "--compact-interval", "400ms"],
    )
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(20)))
        .build()
        .into()
}

/// The value of row `i` of batch `seq` of writer `rank`: distinct, so a checksum sees
/// a duplicate or a loss.
fn value(rank: u32, seq: u64, i: u64) -> f64 {
    (rank as f64) * 1e6 + (seq * ROWS + i) as f64 + 0.25
}

fn batch(rank: u32, seq: u64) -> Vec<u8> {
    let rows: Vec<_> = (0..ROWS)
        .map(|i| {
            sample(
                RUN,
                Some(rank),
                seq * ROWS + i,
                "loss",
                None,
                None,
                value(rank, seq, i),
            )
        })
        .collect();
    samples_ipc(&rows, seq.is_multiple_of(2))
}

fn sql(base: &str, query: &str) -> Value {
    let mut r = agent()
        .post(&format!("{base}/api/v1/sql"))
        .header("content-type", "application/json")
        .send(json!({ "sql": query }).to_string())
        .expect("sql answers");
    let text = r.body_mut().read_to_string().unwrap();
    assert_eq!(r.status(), 200, "{text}");
    serde_json::from_str(&text).unwrap()
}

/// Per rank: rows, distinct steps, sum of values.
fn census(base: &str) -> Vec<(u64, u64, f64)> {
    let v = sql(
        base,
        "SELECT rank, count(*) AS n, count(DISTINCT step) AS d, sum(value) AS s FROM samples WHERE rank IS NOT NULL GROUP BY rank ORDER BY rank",
    );
    v["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["n"].as_u64().unwrap(),
                r["d"].as_u64().unwrap(),
                r["s"].as_f64().unwrap(),
            )
        })
        .collect()
}

#[test]
fn acknowledged_rows_survive_kill_9_exactly_once() {
    let dir = tempfile::tempdir().unwrap();
    let (child, base) = spawn(dir.path());
    let child = Arc::new(Mutex::new(child));
    let base = Arc::new(Mutex::new(base));
    let acked: Arc<Vec<Mutex<Vec<u64>>>> =
        Arc::new((0..WRITERS).map(|_| Mutex::new(Vec::new())).collect());
    let done = Arc::new(AtomicBool::new(false));

    let failures = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let writers: Vec<_> = (0..WRITERS)
        .map(|rank| {
            let (base, acked, done, failures) =
                (base.clone(), acked.clone(), done.clone(), failures.clone());
            std::thread::spawn(move || {
                let agent = agent();
                // Keep writing until the kill rounds are over, so every kill lands mid-stream.
                let mut seq = 0;
                while seq < MAX_BATCHES && !done.load(Ordering::Acquire) {
                    let body = batch(rank, seq);
                    let key = format!("{RUN}/{rank}/w{rank}/{seq}");
                    let started = Instant::now();
                    // Retry the same batch with the same key until it is acknowledged.
                    loop {
                        assert!(
                            started.elapsed() < Duration::from_secs(120),
                            "writer {rank} stuck at {seq}"
                        );
                        let url = format!("{}/api/v1/ingest", base.lock().unwrap());
                        match agent
                            .post(&url)
                            .header("content-type", ARROW)
                            .header("idempotency-key", &key)
                            .send(&body[..])
                        {
                            Ok(mut r) if r.status() == 200 => {
                                let ack: Value =
                                    serde_json::from_str(&r.body_mut().read_to_string().unwrap())
                                        .unwrap();
                                assert!(
                                    ack["status"] == "stored" || ack["status"] == "duplicate",
                                    "{ack}"
                                );
                                acked[rank as usize].lock().unwrap().push(seq);
                                break;
                            }
                            Ok(r)
                                if r.status() == 409 || r.status() == 429 || r.status() == 503 => {}
                            Ok(r) => panic!("writer {rank}: unexpected status {}", r.status()),
                            // The collector is down or died mid-request; retry the same key.
                            Err(_) => {
                                failures.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    seq += 1;
                }
                seq
            })
        })
        .collect();

    // Kill at pseudo-random moments (a fixed-seed xorshift keeps the test reproducible).
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    for round in 0..5 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        std::thread::sleep(Duration::from_millis(150 + x % 700));
        let snapshot: Vec<Vec<u64>> = acked.iter().map(|a| a.lock().unwrap().clone()).collect();
        {
            let mut c = child.lock().unwrap();
            c.kill().unwrap(); // SIGKILL
            c.wait().unwrap();
        }
        let (fresh, address) = spawn(dir.path());
        *child.lock().unwrap() = fresh;
        *base.lock().unwrap() = address.clone();
        // Everything acknowledged before the kill is there, once.
        let census = census(&address);
        for (rank, seqs) in snapshot.iter().enumerate() {
            let (n, distinct, sum) = census.get(rank).copied().unwrap_or((0, 0, 0.0));
            assert_eq!(n, distinct, "round {round}, rank {rank}: duplicates");
            assert!(
                n >= seqs.len() as u64 * ROWS,
                "round {round}, rank {rank}: {n} rows, {} batches acknowledged",
                seqs.len()
            );
            let acked_sum: f64 = seqs
                .iter()
                .flat_map(|&s| (0..ROWS).map(move |i| value(rank as u32, s, i)))
                .sum();
            assert!(sum >= acked_sum - 1e-6, "round {round}, rank {rank}");
        }
    }
    done.store(true, Ordering::Release);
    let sent: Vec<u64> = writers.into_iter().map(|w| w.join().unwrap()).collect();
    assert!(
        failures.load(Ordering::Relaxed) > 0,
        "no request was cut by a kill: the kills missed the stream"
    );
    assert!(
        sent.iter().all(|&n| n > 5),
        "writers made progress: {sent:?}"
    );
    // Every batch was eventually acknowledged, so every batch is there exactly once.
    let address = base.lock().unwrap().clone();
    let census = census(&address);
    for rank in 0..WRITERS {
        let batches = sent[rank as usize];
        let want_sum: f64 = (0..batches)
            .flat_map(|s| (0..ROWS).map(move |i| value(rank, s, i)))
            .sum();
        let (n, distinct, sum) = census[rank as usize];
        assert_eq!(
            (n, distinct),
            (batches * ROWS, batches * ROWS),
            "rank {rank}"
        );
        assert!(
            (sum - want_sum).abs() < 1e-6 * want_sum.max(1.0),
            "rank {rank}: checksum {sum} vs {want_sum}"
        );
    }
    // A clean shutdown (SIGTERM) flushes everything; the restart replays nothing yet loses nothing.
    terminate(&mut child.lock().unwrap());
    // Segments only: a kill that tore a record leaves its bytes set aside in `wal/damaged/`
    // (by design, never deleted), a directory whose own size once counted here as log bytes.
    let wal: u64 = std::fs::read_dir(dir.path().join("wal"))
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.file_name().to_string_lossy().starts_with("wal-"))
        .map(|e| e.metadata().unwrap().len())
        .sum();
    assert_eq!(wal, 0, "a clean shutdown leaves an empty log");
    let (mut last, address) = spawn(dir.path());
    assert_eq!(census_total(&address), sent.iter().sum::<u64>() * ROWS);
    last.kill().unwrap();
    last.wait().unwrap();
}

/// A clean shutdown (SIGTERM), which flushes everything; it must exit 0.
fn terminate(child: &mut Child) {
    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    assert!(child.wait().unwrap().success(), "graceful shutdown exits 0");
}

fn census_total(base: &str) -> u64 {
    census(base).iter().map(|c| c.0).sum()
}

/// The one crash window a new data set has of its own: its first flush wrote a part, then the
/// process died before the manifest. The empty manifest committed at start makes that part an
/// unlisted leftover (deleted at the next start; its rows replay from the log), where before
/// it was "parts without a manifest", which the collector must refuse as a lost manifest.
#[test]
fn a_crash_in_the_first_flush_of_a_new_data_set_restarts_with_every_row() {
    let dir = tempfile::tempdir().unwrap();
    // Flushes only at shutdown: the rows stay in the log, as in a flush cut short.
    let (mut child, base) = spawn_rankwatch(dir.path(), &["--flush-interval", "1h"]);
    assert!(
        dir.path().join("manifest.json").exists(),
        "a new data set commits its empty manifest at start"
    );
    let http = agent();
    let ingest = |base: &str, rank: u32| {
        let r = http
            .post(format!("{base}/api/v1/ingest"))
            .header("content-type", ARROW)
            .send(&batch(rank, 0)[..])
            .unwrap();
        assert_eq!(r.status(), 200);
    };
    ingest(&base, 0);
    child.kill().unwrap(); // SIGKILL: nothing flushed
    child.wait().unwrap();
    // What the cut flush left: a part the manifest does not list (another data set's part,
    // flushed at its clean shutdown, stands in for it under the same table folder).
    let other = tempfile::tempdir().unwrap();
    let (mut donor, donor_base) = spawn_rankwatch(other.path(), &[]);
    ingest(&donor_base, 1);
    terminate(&mut donor);
    let part = files_under(other.path())
        .into_iter()
        .map(|(p, _)| p)
        // A part (`part-N.parquet`), not the rollup beside it: the directory's order varies
        // with the files' names, and a rollup is not a leftover the start removes.
        .find(|p| {
            p.extension().is_some_and(|x| x == "parquet")
                && p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("part-"))
        })
        .expect("the donor flushed a part");
    let relative = part.strip_prefix(other.path()).unwrap();
    std::fs::create_dir_all(dir.path().join(relative).parent().unwrap()).unwrap();
    std::fs::copy(&part, dir.path().join(relative)).unwrap();

    let (mut child, base) = spawn(dir.path());
    let census = census(&base);
    child.kill().unwrap();
    child.wait().unwrap();
    assert_eq!(
        census,
        vec![(ROWS, ROWS, (0..ROWS).map(|i| value(0, 0, i)).sum::<f64>())],
        "the logged rows are back, the leftover part's are not"
    );
    // Deleted; the path may hold a part of this collector's own by now (a flush after the
    // restart numbers its first part as the donor did), never the donor's bytes.
    let donor_bytes = std::fs::read(&part).unwrap();
    assert!(
        !std::fs::read(dir.path().join(relative)).is_ok_and(|now| now == donor_bytes),
        "the leftover part was deleted"
    );
}
