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
