//! Round trip through the real router: ingest Arrow (plain and zstd) and JSON, read every
//! endpoint back, compare values exactly — before a flush (hot buffer), after it (Parquet),
//! and after a restart (index rebuilt from Parquet, keys from the snapshot).

use crate::common::*;
use rankwatch_analytics::Site;
use serde_json::{Value, json};

const RUN: &str = "rt-1";

/// Close enough to be the same f64: the server writes the shortest representation that round
/// trips, but serde_json's default parser (without `float_roundtrip`) may land one ulp off.
fn same(a: f64, b: f64) -> bool {
    a == b
        || (a.is_nan() && b.is_nan())
        || (a.is_finite() && (a.to_bits() as i64 - b.to_bits() as i64).abs() <= 1)
}

fn num(v: &Value) -> f64 {
    match v {
        Value::Number(n) => n.as_f64().unwrap(),
        Value::String(s) if s == "NaN" => f64::NAN,
        Value::String(s) if s == "Infinity" => f64::INFINITY,
        Value::String(s) if s == "-Infinity" => f64::NEG_INFINITY,
        other => panic!("not a number: {other}"),
    }
}

async fn seed(c: &rankwatch_collector::Collector) -> Vec<rankwatch_analytics::Sample> {
    let r = post(
        c,
        "/api/v1/ingest?table=runs",
        ARROW,
        Some("rt-1/0/s/0"),
        runs_ipc(&info(RUN, 2, 3)),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let mut rows = workload(RUN, 2, 20, 3);
    // Non-finite values are data: stored, counted, never dropped or averaged away.
    rows.push(sample(RUN, Some(1), 20, "loss", None, None, f64::NAN));
    rows.push(sample(RUN, Some(0), 20, "loss", None, None, f64::INFINITY));
    rows.push(sample(
        RUN,
        Some(1),
        21,
        "loss",
        None,
        None,
        f64::NEG_INFINITY,
    ));
    let (a, b) = rows.split_at(rows.len() / 2);
    let r = post(
        c,
        "/api/v1/ingest",
        ARROW,
        Some("rt-1/0/s/1"),
        samples_ipc(a, false),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["status"], "stored");
    let r = post(
        c,
        "/api/v1/ingest",
        ARROW,
        Some("rt-1/0/s/2"),
        samples_ipc(b, true),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["nonfinite"], 3);
    let sketches = vec![
        sketch(RUN, 0, 19, vec![1.0, 0.0, 0.0, 0.0]),
        sketch(RUN, 1, 19, vec![1.0, 1.0, 0.0, 0.0]),
    ];
    let r = post(
        c,
        "/api/v1/ingest?table=sketches",
        ARROW,
        Some("rt-1/0/s/3"),
        sketches_ipc(&sketches),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    // The JSON form, as curl users send it, with the NaN spelling JSON allows.
    let body = json!({
        "run": RUN,
        "samples": [
            {"rank": 0, "step": 5, "time_ms": 1_700_000_000_005i64, "metric": "user/lr", "value": 0.001},
            {"rank": 0, "step": 6, "time_ms": 1_700_000_000_006i64, "metric": "user/lr", "value": "NaN"},
            {"step": 6, "metric": "perplexity", "value": 20.5},
        ]
    });
    let r = post(
        c,
        "/api/v1/ingest",
        "application/json",
        Some("rt-1/0/s/4"),
        body.to_string().into_bytes(),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["rows"], 3);
    rows
}

async fn check_everything(
    c: &rankwatch_collector::Collector,
    rows: &[rankwatch_analytics::Sample],
) {
    // runs
    let runs = get(c, "/api/v1/runs").await.json();
    let run = runs["runs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["run"] == RUN)
        .expect("run listed");
    assert_eq!(run["world_size"], 2);
    assert_eq!(run["samples"].as_u64().unwrap(), rows.len() as u64 + 3);
    assert_eq!(run["nonfinite"], 4);
    assert_eq!(run["first_step"], 0);
    assert_eq!(run["last_step"], 21);
    assert_eq!(run["sketches"], 2);

    // catalog
    let cat = get(c, &format!("/api/v1/runs/{RUN}/catalog")).await.json();
    let metrics: Vec<&str> = cat["metrics"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["metric"].as_str().unwrap())
        .collect();
    assert_eq!(metrics, ["loss", "perplexity", "spectral.ratio", "user/lr"]);
    let ratio = &cat["metrics"][2];
    assert_eq!(ratio["layers"], json!([0, 1, 2]));
    assert_eq!(ratio["ranks"], json!([0, 1]));
    assert_eq!(cat["metrics"][3]["user"], true);

    // series: raw resolution gives back exactly the ingested values, NaN and ±Inf included.
    let s = get(c, &format!("/api/v1/runs/{RUN}/series?metric=loss&rank=1"))
        .await
        .json();
    let series = &s["series"][0];
    assert_eq!(s["series"].as_array().unwrap().len(), 1);
    for b in series["buckets"].as_array().unwrap() {
        let step = b["start"].as_u64().unwrap();
        let want = rows
            .iter()
            .find(|r| r.rank == Some(1) && r.step == step && r.metric.as_str() == "loss")
            .unwrap()
            .value;
        let got = num(&b["last"]);
        assert!(same(got, want), "step {step}: {got} vs {want}");
        assert_eq!(
            b["nonfinite"].as_u64().unwrap(),
            u64::from(!want.is_finite())
        );
    }
    // Downsampled: the NaN and the -Inf are still counted, the max is the true max.
    let s = get(
        c,
        &format!("/api/v1/runs/{RUN}/series?metric=loss&points=2"),
    )
    .await
    .json();
    // 22 steps in 2 buckets: aligned power-of-two width 16, so 0..=15 and 16..=21.
    assert_eq!(s["buckets"]["width"], 16);
    let nonfinite: u64 = s["series"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|x| {
            x["buckets"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| b["nonfinite"].as_u64().unwrap())
        })
        .sum();
    assert_eq!(nonfinite, 3);
    let rank0_max = num(&s["series"][0]["buckets"][0]["max"]);
    let want = rows
        .iter()
        .filter(|r| r.rank == Some(0) && r.step <= 15 && r.metric.as_str() == "loss")
        .map(|r| r.value)
        .fold(f64::MIN, f64::max);
    assert!(same(rank0_max, want), "{rank0_max} vs {want}");

    // heatmap: 3 layers; cell = both ranks pooled; last = mean at the last step.
    let h = get(
        c,
        &format!("/api/v1/runs/{RUN}/heatmap?metric=spectral.ratio&points=4"),
    )
    .await
    .json();
    assert_eq!(h["layers"], json!([0, 1, 2]));
    // 22 steps in at most 4 buckets: width 8, so 3 buckets starting at 0, 8 and 16.
    assert_eq!(h["steps"], json!([0, 8, 16]));
    assert_eq!(h["count"][1][0], 2 * 8); // 8 steps per bucket × 2 ranks
    let last = num(&h["last"][2][2]);
    assert!((last - (1.0 + 0.2 + 0.019)).abs() < 1e-12, "{last}");

    // workers at step 19: both ranks' values and the sketch cosine matrix.
    let w = get(c, &format!("/api/v1/runs/{RUN}/workers?step=19"))
        .await
        .json();
    assert_eq!(w["ranks"], json!([0, 1]));
    let loss = w["metrics"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["metric"] == "loss")
        .unwrap();
    let want = rows
        .iter()
        .find(|r| r.rank == Some(0) && r.step == 19 && r.metric.as_str() == "loss")
        .unwrap()
        .value;
    assert!(same(num(&loss["values"][0]), want));
    let cos = num(&w["cosine"]["matrix"][0][1]);
    assert!((cos - 1.0 / 2f64.sqrt()).abs() < 1e-6, "{cos}");
    // Latest step by default: the newest step every rank has reached.
    let w = get(c, &format!("/api/v1/runs/{RUN}/workers")).await.json();
    assert_eq!(w["step"], 20);

    // SQL sees the same rows, including the JSON ones.
    let q = post(c, "/api/v1/sql", "application/json", None,
        json!({"sql": "SELECT count(*) AS n, sum(CASE WHEN isnan(value) THEN 1 ELSE 0 END) AS nans FROM samples WHERE run = 'rt-1'"}).to_string().into_bytes()).await;
    assert_eq!(q.status, 200, "{}", q.text());
    assert_eq!(
        q.json()["rows"][0]["n"].as_u64().unwrap(),
        rows.len() as u64 + 3
    );
    assert_eq!(q.json()["rows"][0]["nans"], 2);

    // Alerts: none yet (the engine arrives later); the filter is validated.
    let a = get(c, "/api/v1/alerts?state=firing").await;
    assert_eq!(a.status, 200);
    assert_eq!(a.json()["alerts"], json!([]));
}

#[tokio::test]
async fn every_endpoint_returns_what_was_ingested_hot_flushed_and_after_restart() {
    let dir = tempfile::tempdir().unwrap();
    let c = open_store_only(dir.path()).await;
    let rows = seed(&c).await;
    check_everything(&c, &rows).await;

    c.flush().await.unwrap();
    let files = c.store().files();
    assert!(
        files
            .iter()
            .any(|f| f.table == "samples" && f.rows as usize == rows.len() + 3)
    );
    check_everything(&c, &rows).await;

    // A retried batch is acknowledged, not stored twice.
    let r = post(
        &c,
        "/api/v1/ingest",
        ARROW,
        Some("rt-1/0/s/1"),
        samples_ipc(&rows[..5], false),
    )
    .await;
    assert_eq!(r.json()["status"], "duplicate");
    c.shutdown().await.unwrap();

    let c = open_store_only(dir.path()).await;
    check_everything(&c, &rows).await;
    let r = post(
        &c,
        "/api/v1/ingest",
        ARROW,
        Some("rt-1/0/s/2"),
        samples_ipc(&rows[..5], false),
    )
    .await;
    assert_eq!(r.json()["status"], "duplicate", "keys survive a restart");
    check_everything(&c, &rows).await;
    c.shutdown().await.unwrap();
}

#[tokio::test]
async fn unflushed_batches_come_back_from_the_log() {
    let dir = tempfile::tempdir().unwrap();
    let c = open_store_only(dir.path()).await;
    let rows = seed(&c).await;
    // Simulate a crash: drop without shutdown, so nothing is flushed.
    drop(c);
    let c = open_store_only(dir.path()).await;
    check_everything(&c, &rows).await;
    let r = post(
        &c,
        "/api/v1/ingest?table=sketches",
        ARROW,
        Some("rt-1/0/s/3"),
        sketches_ipc(&[sketch(RUN, 0, 1, vec![1.0])]),
    )
    .await;
    assert_eq!(
        r.json()["status"],
        "duplicate",
        "replayed keys are applied keys: {}",
        r.text()
    );
    c.shutdown().await.unwrap();
}

#[tokio::test]
async fn compaction_merges_small_files_without_changing_answers() {
    let dir = tempfile::tempdir().unwrap();
    let c = open_store_only(dir.path()).await;
    let rows = workload("cmp", 2, 30, 2);
    for (i, chunk) in rows.chunks(20).enumerate() {
        let r = post(
            &c,
            "/api/v1/ingest",
            ARROW,
            Some(&format!("cmp/0/s/{i}")),
            samples_ipc(chunk, false),
        )
        .await;
        assert_eq!(r.status, 200);
        c.flush().await.unwrap();
    }
    let before = get(
        &c,
        "/api/v1/runs/cmp/series?metric=spectral.ratio&layer=1&rank=0",
    )
    .await
    .json();
    let files_before = c
        .store()
        .files()
        .iter()
        .filter(|f| f.table == "samples")
        .count();
    assert!(files_before > 3);
    let merged = c.store().compact().await.unwrap();
    assert_eq!(merged, files_before);
    assert_eq!(
        c.store()
            .files()
            .iter()
            .filter(|f| f.table == "samples")
            .count(),
        1
    );
    let after = get(
        &c,
        "/api/v1/runs/cmp/series?metric=spectral.ratio&layer=1&rank=0",
    )
    .await
    .json();
    assert_eq!(before, after);
    c.shutdown().await.unwrap();
    let c = open_store_only(dir.path()).await;
    let again = get(
        &c,
        "/api/v1/runs/cmp/series?metric=spectral.ratio&layer=1&rank=0",
    )
    .await
    .json();
    assert_eq!(before, again);
    c.shutdown().await.unwrap();
}

#[tokio::test]
async fn metrics_exposition_counts_ingest_and_exports_bounded_run_gauges() {
    let dir = tempfile::tempdir().unwrap();
    let c = open_store_only(dir.path()).await;
    let rows = seed(&c).await;
    let bad = post(&c, "/api/v1/ingest", ARROW, None, b"garbage".to_vec()).await;
    assert_eq!(bad.status, 400);
    let m = get(&c, "/metrics").await;
    assert_eq!(m.status, 200);
    let text = m.text();
    let value = |name: &str| metric_value(&text, name);
    assert_eq!(
        value("rankwatch_ingest_rows_total{table=\"samples\"}"),
        rows.len() as f64
    );
    assert_eq!(
        value("rankwatch_ingest_rejects_total{reason=\"malformed_arrow\"}"),
        1.0
    );
    assert_eq!(value("rankwatch_ingest_nonfinite_values_total"), 4.0);
    assert!(value("rankwatch_wal_fsync_seconds_count") >= 5.0);
    assert!(value("rankwatch_hot_buffer_bytes") > 0.0);
    // Run gauges come from the run index: one `run` label, nothing finer.
    assert_eq!(value("rankwatch_run_step{run=\"rt-1\"}"), 21.0);
    assert_eq!(value("rankwatch_run_perplexity{run=\"rt-1\"}"), 20.5);
    assert!((value("rankwatch_run_spectral_ratio_max{run=\"rt-1\"}") - (1.2 + 0.019)).abs() < 1e-9);
    assert!(
        !text.contains("layer=") && !text.contains("rank="),
        "no per-layer or per-rank labels"
    );
    c.shutdown().await.unwrap();
}

#[tokio::test]
async fn sites_are_checked_per_metric() {
    let dir = tempfile::tempdir().unwrap();
    let c = open_store_only(dir.path()).await;
    let ok = vec![sample(
        "s",
        Some(0),
        1,
        "act_max",
        Some(0),
        Some(Site::Residual),
        3.0,
    )];
    assert_eq!(
        post(&c, "/api/v1/ingest", ARROW, None, samples_ipc(&ok, false))
            .await
            .status,
        200
    );
    let bad = vec![sample(
        "s",
        Some(0),
        1,
        "act_max",
        Some(0),
        Some(Site::Q),
        3.0,
    )];
    let r = post(&c, "/api/v1/ingest", ARROW, None, samples_ipc(&bad, false)).await;
    assert_eq!(r.status, 400);
    assert!(r.error().contains("does not take site q"), "{}", r.error());
    c.shutdown().await.unwrap();
}
