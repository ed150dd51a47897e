//! A full disk under the write-ahead log: batches get `503` with `Retry-After`, `/healthz` and
//! `/readyz` say why, the collector heals by itself when space returns, and no refused batch is
//! ever stored — not then, not after a restart. The faults come from the data directory's disk
//! (`rankwatch_collector::disk::faulty::FaultyDisk`, behind the store's file-system seam),
//! which fails its fsyncs with `ENOSPC` as a full disk does.

use std::time::{Duration, Instant};

use std::sync::Arc;

use rankwatch_collector::clock::SystemClock;
use rankwatch_collector::disk::faulty::FaultyDisk;

use crate::common::*;

async fn open_on_faulty(
    dir: &std::path::Path,
) -> (rankwatch_collector::Collector, Arc<FaultyDisk>) {
    let mut config = config(dir);
    config.no_alert_engine = true;
    let disk = Arc::new(FaultyDisk::default());
    let c = rankwatch_collector::Collector::open_on(&config, SystemClock::shared(), disk.clone())
        .await
        .expect("collector opens");
    (c, disk)
}

async fn send(c: &rankwatch_collector::Collector, run: &str) -> Reply {
    let rows = workload(run, 2, 3, 1);
    post(c, "/api/v1/ingest", ARROW, None, samples_ipc(&rows, false)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_is_a_503_with_retry_after_and_heals_without_storing_a_refused_batch() {
    let dir = tempfile::tempdir().unwrap();
    let (c, disk) = open_on_faulty(dir.path()).await;
    assert_eq!(send(&c, "before").await.status, 200);

    disk.fail_syncs(u32::MAX); // the disk is full until told otherwise
    let refused = send(&c, "refused").await;
    assert_eq!(refused.status, 503, "{}", refused.text());
    assert_eq!(refused.headers["retry-after"], "5");
    assert_eq!(refused.json()["reason"], "unavailable");
    assert!(
        refused.error().contains("os error 28"),
        "{}",
        refused.error()
    );
    let health = get(&c, "/healthz").await;
    assert_eq!(health.status, 503);
    assert_eq!(health.json()["status"], "failing");
    assert!(
        health.json()["reason"]
            .as_str()
            .unwrap()
            .contains("write-ahead log")
    );
    assert_eq!(get(&c, "/readyz").await.status, 503);
    // Still full a second later: still refused, still failing.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let again = send(&c, "refused-too").await;
    assert_eq!(again.status, 503, "{}", again.text());
    assert!(
        again.error().contains("retrying every 1 s"),
        "{}",
        again.error()
    );
    assert_eq!(get(&c, "/healthz").await.status, 503);

    // Space returns: the log rolls the refused batch back and heals without a restart.
    disk.fail_syncs(0);
    let deadline = Instant::now() + Duration::from_secs(20);
    while get(&c, "/healthz").await.status != 200 {
        assert!(Instant::now() < deadline, "the collector never healed");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(get(&c, "/readyz").await.status, 200);
    assert_eq!(send(&c, "after").await.status, 200);
    assert_eq!(run_names(&c).await, ["after", "before"]);

    // And after a restart (the log replayed, the hot buffer flushed): the same two runs.
    c.shutdown().await.unwrap();
    let c = open_store_only(dir.path()).await;
    assert_eq!(run_names(&c).await, ["after", "before"]);
    c.shutdown().await.unwrap();
}
