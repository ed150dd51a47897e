//! Rules that depend on the time, checked on a hand-moved clock: no test here sleeps for the
//! rule's timeout. (Short polls remain, for the alert engine's task to take a batch in; they
//! are bounded and never stand in for the time a rule waits.)

use std::sync::Arc;
use std::time::{Duration, Instant};

use rankwatch_collector::Collector;
use rankwatch_collector::clock::ManualClock;
use serde_json::Value;

use crate::common::*;

/// 2026-01-01T00:00:00Z: the manual clock's start.
const T0: i64 = 1_767_225_600_000;

async fn open_at(dir: &std::path::Path, clock: &Arc<ManualClock>) -> Collector {
    let mut c = config(dir);
    c.align_timeout = Duration::from_secs(30);
    Collector::open_with_clock(&c, clock.clone())
        .await
        .expect("collector opens")
}

async fn announce(c: &Collector, run: &str, world: u32) {
    let r = post(
        c,
        "/api/v1/ingest?table=runs",
        ARROW,
        None,
        runs_ipc(&info(run, world, 1)),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
}

async fn loss(c: &Collector, run: &str, rank: u32, step: u64) {
    let rows = [sample(run, Some(rank), step, "loss", None, None, 2.0)];
    let r = post(c, "/api/v1/ingest", ARROW, None, samples_ipc(&rows, false)).await;
    assert_eq!(r.status, 200, "{}", r.text());
}

/// Polls `/metrics` until `line` appears (the engine works on its own task), 10 s at most.
async fn wait_metric(c: &Collector, line: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let text = get(c, "/metrics").await.text();
        if text.lines().any(|l| l == line) {
            return text;
        }
        assert!(Instant::now() < deadline, "no `{line}` in:\n{text}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until the alert engine has taken in `n` batches: what it decides about them is then
/// visible, so "nothing happened" is a finding rather than a race.
async fn wait_engine(c: &Collector, n: u64) {
    wait_metric(c, &format!("rankwatch_alert_engine_batches_total {n}")).await;
}

/// Polls until `run`'s `stale_rank` alert satisfies `pred`, 10 s at most.
async fn wait_stale(c: &Collector, run: &str, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let found = alerts(c, run)
            .await
            .into_iter()
            .find(|a| a["rule"] == "stale_rank");
        if let Some(a) = found.filter(|a| pred(a)) {
            return a;
        }
        assert!(Instant::now() < deadline, "stale_rank never {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn alerts(c: &Collector, run: &str) -> Vec<Value> {
    get(c, &format!("/api/v1/alerts?run={run}")).await.json()["alerts"]
        .as_array()
        .unwrap()
        .clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_closes_by_its_deadline_on_the_collectors_clock() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::at(T0);
    let c = open_at(dir.path(), &clock).await;
    let run = "deadline";
    announce(&c, run, 2).await;
    // Rank 1 never reports step 1: the step can only close by its 30 s deadline.
    loss(&c, run, 0, 1).await;
    let complete = r#"rankwatch_aligner_steps_total{outcome="timeout"} 1"#;
    clock.advance(Duration::from_secs(29));
    loss(&c, run, 0, 2).await;
    wait_engine(&c, 3).await;
    // A batch later, still before the deadline: nothing closed.
    let text = get(&c, "/metrics").await.text();
    assert!(!text.contains(complete), "closed early:\n{text}");
    clock.advance(Duration::from_secs(2));
    loss(&c, run, 0, 3).await;
    wait_metric(&c, complete).await;
    c.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_rank_goes_stale_after_the_timeout_and_not_before() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::at(T0);
    let c = open_at(dir.path(), &clock).await;
    let run = "stale";
    announce(&c, run, 2).await;
    loss(&c, run, 0, 1).await;
    loss(&c, run, 1, 1).await;
    // 59 s of silence from rank 1 while rank 0 goes on: within the 60 s default.
    clock.advance(Duration::from_secs(59));
    loss(&c, run, 0, 2).await;
    wait_engine(&c, 4).await;
    assert!(
        alerts(&c, run).await.is_empty(),
        "{:#?}",
        alerts(&c, run).await
    );
    clock.advance(Duration::from_secs(2));
    loss(&c, run, 0, 3).await;
    let stale = wait_stale(&c, run, "raised", |_| true).await;
    assert_eq!(stale["rank"], 1, "{stale:#}");
    assert_eq!(stale["state"], "firing", "{stale:#}");
    // Rank 1 reports again: the alert resolves, at the clock's time.
    loss(&c, run, 1, 3).await;
    let resolved = wait_stale(&c, run, "resolved", |a| a["state"] == "resolved").await;
    assert_eq!(resolved["resolved_at_ms"], T0 + 61_000, "{resolved:#}");
    c.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_by_age_counts_from_each_runs_last_report() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::at(T0);
    let mut config = config(dir.path());
    config.no_alert_engine = true;
    config.retention_age = Some(Duration::from_secs(3600));
    let c = Collector::open_with_clock(&config, clock.clone())
        .await
        .unwrap();
    loss(&c, "old", 0, 1).await;
    clock.advance(Duration::from_secs(1800));
    loss(&c, "recent", 0, 1).await;
    c.flush().await.unwrap();
    // 61 minutes after "old" last reported, 31 after "recent".
    clock.advance(Duration::from_secs(1860));
    let r = post(
        &c,
        "/api/v1/retention",
        "application/json",
        None,
        Vec::new(),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let report = r.json();
    let deleted: Vec<&str> = report["deleted"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["run"].as_str().unwrap())
        .collect();
    assert_eq!(deleted, ["old"], "{report:#}");
    let runs = get(&c, "/api/v1/runs").await.json();
    let names: Vec<&str> = runs["runs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["run"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["recent"], "{runs:#}");
    // An age shorter than the active window (15 min) does not reach a run still reporting:
    // "recent" (31 min silent) goes, "live" (reported now) stays.
    loss(&c, "live", 0, 1).await;
    let r = post(
        &c,
        "/api/v1/retention",
        "application/json",
        None,
        br#"{"max_age":"1ms"}"#.to_vec(),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let deleted: Vec<String> = r.json()["deleted"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["run"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(deleted, ["recent"]);
    c.shutdown().await.unwrap();
}

#[tokio::test]
async fn idempotency_keys_of_a_run_quiet_for_the_window_expire() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::at(T0);
    let c = open_at(dir.path(), &clock).await;
    let send = |run: &'static str, key: &'static str| {
        let body = samples_ipc(&workload(run, 1, 2, 1), false);
        post(&c, "/api/v1/ingest", ARROW, Some(key), body)
    };
    assert_eq!(send("old", "old/0/s/1").await.json()["status"], "stored");
    assert_eq!(send("busy", "busy/0/s/1").await.json()["status"], "stored");
    c.flush().await.unwrap();
    assert!(dir.path().join("keys/old.json").exists());

    // 29 days on, "busy" sends again; a retry of "old" is still recognised.
    clock.advance(Duration::from_secs(29 * 86_400));
    assert_eq!(send("busy", "busy/0/s/2").await.json()["status"], "stored");
    assert_eq!(send("old", "old/0/s/1").await.json()["status"], "duplicate");
    c.flush().await.unwrap();

    // Past the 30-day window for "old" only: its keys go, "busy"'s stay.
    clock.advance(Duration::from_secs(2 * 86_400));
    c.flush().await.unwrap();
    assert!(!dir.path().join("keys/old.json").exists());
    assert!(dir.path().join("keys/busy.json").exists());
    assert_eq!(
        send("busy", "busy/0/s/2").await.json()["status"],
        "duplicate"
    );
    assert_eq!(
        send("old", "old/0/s/1").await.json()["status"],
        "stored",
        "a retry after the window is stored again (the documented price)"
    );
    c.shutdown().await.unwrap();
}
