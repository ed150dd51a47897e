//! Start-up never deletes what it cannot account for: Parquet parts with no manifest at all
//! (a lost or deleted `manifest.json`) stop the collector with a message saying what to do,
//! instead of being deleted as a crash's leftovers (before: every part was deleted).

use std::path::Path;

use crate::common::*;
use rankwatch_collector::Collector;

fn parts(dir: &Path) -> usize {
    files_under(dir)
        .iter()
        .filter(|(p, _)| p.extension().is_some_and(|x| x == "parquet"))
        .count()
}

#[tokio::test]
async fn parts_without_a_manifest_stop_the_collector_and_stay() {
    let dir = tempfile::tempdir().unwrap();
    let c = open_store_only(dir.path()).await;
    ingest_runs(&c, &["a", "b"], 2, 5).await;
    c.shutdown().await.unwrap();
    let before = parts(dir.path());
    assert!(before >= 2, "flushed at shutdown: {before} parts");

    std::fs::remove_file(dir.path().join("manifest.json")).unwrap();
    let e = Collector::open(&config(dir.path()))
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&format!(
            "there is no manifest, but {before} Parquet part(s)"
        )) && e.contains("Restore manifest.json from a backup"),
        "{e}"
    );
    assert_eq!(parts(dir.path()), before, "no part was deleted");

    // A new, empty directory still starts (no parts, no manifest).
    let fresh = tempfile::tempdir().unwrap();
    open_store_only(fresh.path())
        .await
        .shutdown()
        .await
        .unwrap();
}

/// Keys of `run` for sessions `0..n`, one batch each; each must be stored (or, again, a
/// duplicate).
async fn keyed(c: &Collector, run: &str, sessions: u32, expect: &str) {
    for s in 0..sessions {
        let body = samples_ipc(&workload(run, 1, 2, 1), false);
        let key = format!("{run}/0/s{s}/1");
        let r = post(c, "/api/v1/ingest", ARROW, Some(&key), body).await;
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.json()["status"], expect, "{key}");
    }
}

#[tokio::test]
async fn idempotency_keys_are_kept_per_run_across_restarts_and_go_with_a_deleted_run() {
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys");
    let c = open_store_only(dir.path()).await;
    keyed(&c, "kept", 3, "stored").await;
    keyed(&c, "doomed", 2, "stored").await;
    c.flush().await.unwrap();
    assert!(keys.join("kept.json").exists() && keys.join("doomed.json").exists());
    let r = get(&c, "/metrics").await;
    assert!(
        r.text().contains("rankwatch_idempotency_sessions 5"),
        "{}",
        r.text()
    );

    // Deleting a run removes its keys, from memory and disk.
    let deleted = call(
        &c,
        axum::http::Request::delete("/api/v1/runs/doomed")
            .body(axum::body::Body::empty())
            .unwrap(),
    )
    .await;
    assert_eq!(deleted.status, 200, "{}", deleted.text());
    assert!(!keys.join("doomed.json").exists());
    c.flush().await.unwrap();
    let r = get(&c, "/metrics").await;
    assert!(
        r.text().contains("rankwatch_idempotency_sessions 3"),
        "{}",
        r.text()
    );
    c.shutdown().await.unwrap();

    // After a restart the kept run's retries are still recognised.
    let c = open_store_only(dir.path()).await;
    keyed(&c, "kept", 3, "duplicate").await;
    c.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_data_directory_of_the_single_key_snapshot_design_is_upgraded() {
    let dir = tempfile::tempdir().unwrap();
    let c = open_store_only(dir.path()).await;
    keyed(&c, "old", 2, "stored").await;
    c.shutdown().await.unwrap();
    // Rewrite the keys as the first design kept them: one snapshot named by the flushed seq.
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("manifest.json")).unwrap()).unwrap();
    let seq = manifest["flushed_seq"].as_u64().unwrap();
    std::fs::remove_dir_all(dir.path().join("keys")).unwrap();
    let legacy = dir.path().join(format!("keys-{seq:020}.json"));
    std::fs::write(
        &legacy,
        format!(
            r#"{{"through_seq":{seq},"sessions":[["old",0,"s0",[[1,1]]],["old",0,"s1",[[1,1]]]]}}"#
        ),
    )
    .unwrap();

    let c = open_store_only(dir.path()).await;
    keyed(&c, "old", 2, "duplicate").await;
    keyed(&c, "new", 1, "stored").await;
    c.flush().await.unwrap();
    assert!(
        !legacy.exists(),
        "the old snapshot is gone once the runs are written"
    );
    assert!(dir.path().join("keys/old.json").exists());
    c.shutdown().await.unwrap();
    let c = open_store_only(dir.path()).await;
    keyed(&c, "old", 2, "duplicate").await;
    c.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_entry_that_does_not_decode_is_set_aside_and_the_rest_replays() {
    use rankwatch_collector::wal::{self, WalHandle, WalMetrics};
    use std::sync::Arc;

    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join(wal::DIR);
    // A log written by something this collector cannot decode (a newer version, a bug),
    // between two good batches written by the collector itself.
    let c = open_store_only(dir.path()).await;
    ingest_runs(&c, &["before"], 1, 3).await;
    drop(c); // no shutdown: nothing is flushed, the batch stays in the log
    let (handle, thread) = WalHandle::start(
        log.clone(),
        100,
        1 << 20,
        Arc::new(WalMetrics::default()),
        rankwatch_collector::disk::RealDisk::shared(),
    )
    .unwrap();
    handle
        .append(bytes::Bytes::from_static(b"not an entry"), Box::new(|_| {}))
        .await
        .unwrap();
    drop(handle);
    thread.join().unwrap();

    let c = open_store_only(dir.path()).await;
    assert_eq!(run_names(&c).await, ["before"], "the good batch replayed");
    let kept: Vec<String> = std::fs::read_dir(log.join(wal::DAMAGED_DIR))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(kept.iter().any(|n| n.ends_with(".entry")), "{kept:?}");
    let entry = kept.iter().find(|n| n.ends_with(".entry")).unwrap();
    assert_eq!(
        std::fs::read(log.join(wal::DAMAGED_DIR).join(entry)).unwrap(),
        b"not an entry"
    );
    assert!(kept.iter().any(|n| n.ends_with(".reason.txt")), "{kept:?}");
    let metrics = get(&c, "/metrics").await.text();
    assert!(
        metrics.contains("rankwatch_wal_set_aside_total 1"),
        "{metrics}"
    );
    c.shutdown().await.unwrap();
}
