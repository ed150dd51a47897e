//! The alert engine through the real router: the step aligner's all-ranks statistics (exact,
//! once per step, across a restart), detectors on the live stream, alerts restored after a
//! restart, per-run rule overrides, and delivery to a webhook, Slack and the training
//! process's feed.

use std::time::{Duration, Instant};

use crate::common::*;
use rankwatch_analytics::math::StepStats;
use rankwatch_analytics::simulate::{DataParallelSim, Fault};
use rankwatch_analytics::{Sample, Site};
use rankwatch_collector::Collector;
use serde_json::{Value, json};

const WORLD: u32 = 4;

/// Every rank's step scalars as the SDK reports them.
pub(crate) fn step_rows(
    run: &str,
    obs: &rankwatch_analytics::detect::StepObservation,
) -> Vec<Sample> {
    let mut rows = Vec::new();
    for r in &obs.ranks {
        let mut push = |metric: &str, value: Option<f64>| {
            if let Some(v) = value {
                let mut s = sample(run, Some(r.rank), obs.step, metric, None, None, v);
                s.time_ms = obs.time_ms;
                rows.push(s);
            }
        };
        push("loss", r.loss);
        push("tokens", r.tokens);
        push("grad_norm", r.grad_norm);
        push("grad_norm_mean", r.grad_norm_mean);
        push("cos_to_mean", r.cos_to_mean);
    }
    rows
}

pub(crate) async fn announce(c: &Collector, run: &str) {
    let r = post(
        c,
        "/api/v1/ingest?table=runs",
        ARROW,
        None,
        runs_ipc(&info(run, WORLD, 2)),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
}

pub(crate) async fn ingest(c: &Collector, run: &str, seq: u64, rows: &[Sample]) {
    let key = format!("{run}/0/t/{seq}");
    let r = post(
        c,
        "/api/v1/ingest",
        ARROW,
        Some(&key),
        samples_ipc(rows, false),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
}

/// Polls the alerts of `run` until `pred` holds for one of them (10 s at most).
async fn wait_alert(c: &Collector, run: &str, pred: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let alerts = get(c, &format!("/api/v1/alerts?run={run}")).await.json()["alerts"].clone();
        if let Some(a) = alerts.as_array().unwrap().iter().find(|a| pred(a)) {
            return a.clone();
        }
        assert!(Instant::now() < deadline, "no such alert; have {alerts:#}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_rank_statistics_are_exact_stored_once_and_a_scaled_rank_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let run = "align-1";
    let c = open(dir.path()).await;
    announce(&c, run).await;
    let mut sim = DataParallelSim::new(WORLD, 256, 11);
    let mut expected = Vec::new();
    // Judged from step 230 (skip_steps 200 + 30 warm-up steps); the fault from 240.
    for step in 0..270u64 {
        let fault = if step >= 240 {
            Fault::ScaleGradient(2, 6.0)
        } else {
            Fault::None
        };
        let obs = sim.step(step, fault);
        expected.push(StepStats::compute(&obs.ranks, WORLD));
        ingest(&c, run, step, &step_rows(run, &obs)).await;
    }
    let alert = wait_alert(&c, run, |a| {
        a["rule"] == "silent_inconsistency" && a["state"] == "firing"
    })
    .await;
    assert_eq!(alert["outlier_ranks"], json!([2]), "{alert:#}");
    let first = alert["first_step"].as_u64().unwrap();
    assert!((240..246).contains(&first), "fired from step {first}");
    assert!(
        alert["explanation"].as_str().unwrap().contains("rank 2"),
        "{alert:#}"
    );

    // Steps 0..268 close (every rank moved past them; the engine runs behind ingest, so wait);
    // 269 waits for its timeout or shutdown.
    let query = format!(
        "SELECT step, value FROM samples WHERE run = '{run}' AND rank IS NULL AND metric = 'loss_std' ORDER BY step"
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut rows = sql(&c, &query).await;
    while rows.len() < 269 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
        rows = sql(&c, &query).await;
    }
    assert_eq!(rows.len(), 269);
    for row in &rows {
        let step = row["step"].as_u64().unwrap() as usize;
        let want = expected[step].loss.unwrap().std;
        assert_eq!(row["value"].as_f64().unwrap(), want, "step {step}");
    }
    let cw = sql(&c, &format!(
        "SELECT step, value FROM samples WHERE run = '{run}' AND metric = 'cos_weighted' AND step = 60"
    )).await;
    assert_eq!(
        cw[0]["value"].as_f64().unwrap(),
        expected[60].cos_weighted.unwrap()
    );
    let id = alert["id"].clone();

    // Shutdown closes the last step; a restart replays nothing twice and keeps the alert.
    c.shutdown().await.unwrap();
    let c = open(dir.path()).await;
    let rows = sql(&c, &format!(
        "SELECT count(*) AS n, count(DISTINCT step) AS steps FROM samples WHERE run = '{run}' AND rank IS NULL AND metric = 'loss_std'"
    )).await;
    assert_eq!(
        (rows[0]["n"].as_u64(), rows[0]["steps"].as_u64()),
        (Some(270), Some(270))
    );
    let restored = wait_alert(&c, run, |a| a["id"] == id).await;
    assert_eq!(restored["state"], "firing", "{restored:#}");
    // The fault goes on after the restart: the restored alert stays firing (the new detector's
    // baseline, learned from faulty steps, cannot clear it) and is not duplicated.
    for step in 270..320u64 {
        let obs = sim.step(step, Fault::ScaleGradient(2, 6.0));
        ingest(&c, run, step, &step_rows(run, &obs)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let continued = wait_alert(&c, run, |a| a["id"] == id).await;
    assert_eq!(continued["state"], "firing");
    assert_eq!(continued["first_step"], alert["first_step"]);
    let open_alerts = get(&c, &format!("/api/v1/alerts?run={run}&state=firing"))
        .await
        .json()["alerts"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|a| a["rule"] == "silent_inconsistency")
        .count();
    assert_eq!(
        open_alerts, 1,
        "one alert, not a second copy after the restart"
    );
    let metrics = get(&c, "/metrics").await.text();
    assert!(
        metrics.contains("rankwatch_aligner_steps_total{outcome=\"complete\"}"),
        "{metrics}"
    );
    c.shutdown().await.unwrap();
}

/// The engine's all-ranks statistics wait out backpressure. With a hot budget of one byte
/// every batch leaves the buffer over twice the budget until a flush empties it, so clients
/// and the engine's own derived batches meet 429s; the engine retries its batches, and every
/// closed step's statistics land exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_rank_statistics_wait_out_backpressure_and_land_once() {
    let dir = tempfile::tempdir().unwrap();
    let run = "pressed";
    let mut config = config(dir.path());
    config.hot_budget_bytes = 1;
    // Refused at once rather than held for the flush (see `Store::room_until`): the clients and the
    // engine both meet 429s.
    config.queue_wait = Duration::ZERO;
    let c = Collector::open(&config).await.expect("collector opens");
    let mut refused = 0;
    let mut post_retrying = async |path: &str, key: Option<&str>, body: Vec<u8>| loop {
        let r = post(&c, path, ARROW, key, body.clone()).await;
        if r.status == 429 {
            refused += 1;
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        }
        assert_eq!(r.status, 200, "{}", r.text());
        break;
    };
    post_retrying(
        "/api/v1/ingest?table=runs",
        None,
        runs_ipc(&info(run, WORLD, 2)),
    )
    .await;
    let mut sim = DataParallelSim::new(WORLD, 256, 5);
    let steps = 30u64;
    for step in 0..steps {
        let obs = sim.step(step, Fault::None);
        let key = format!("{run}/0/t/{step}");
        post_retrying(
            "/api/v1/ingest",
            Some(&key),
            samples_ipc(&step_rows(run, &obs), false),
        )
        .await;
    }
    assert!(refused > 0, "the budget never pushed back");
    // Every step but the last closes (every rank moved past it).
    let query = format!(
        "SELECT count(*) AS n, count(DISTINCT step) AS steps FROM samples WHERE run = '{run}' AND rank IS NULL AND metric = 'loss_std'"
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut rows = sql(&c, &query).await;
    while rows[0]["steps"].as_u64() < Some(steps - 1) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
        rows = sql(&c, &query).await;
    }
    assert_eq!(
        (rows[0]["n"].as_u64(), rows[0]["steps"].as_u64()),
        (Some(steps - 1), Some(steps - 1)),
        "{refused} requests refused on the way"
    );
    c.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthy_workers_raise_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let run = "healthy-1";
    let c = open(dir.path()).await;
    announce(&c, run).await;
    let mut sim = DataParallelSim::new(WORLD, 256, 5);
    for step in 0..150u64 {
        let mut rows = step_rows(run, &sim.step(step, Fault::None));
        for layer in 0..2 {
            rows.push(sample(
                run,
                None,
                step,
                "spectral.ratio",
                Some(layer),
                None,
                1.0 + 0.1 * f64::from(layer),
            ));
            rows.push(sample(
                run,
                Some(0),
                step,
                "act_max",
                Some(layer),
                Some(Site::Residual),
                5.0 + (step % 3) as f64,
            ));
        }
        ingest(&c, run, step, &rows).await;
    }
    c.shutdown().await.unwrap();
    let c = open(dir.path()).await;
    let alerts = get(&c, &format!("/api/v1/alerts?run={run}")).await.json()["alerts"].clone();
    assert_eq!(alerts, json!([]), "false alerts on a healthy run");
    c.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rule_overrides_are_checked_applied_and_kept() {
    let dir = tempfile::tempdir().unwrap();
    let c = open(dir.path()).await;
    let put = |body: &'static str, ct: &'static str| {
        let request = axum::http::Request::put("/api/v1/runs/ov-1/rules")
            .header("content-type", ct)
            .body(axum::body::Body::from(body))
            .unwrap();
        call(&c, request)
    };
    let r = put(
        r#"{"rank_collapse": {"drift_factor": 0.5}}"#,
        "application/json",
    )
    .await;
    assert_eq!(r.status, 400);
    assert!(r.error().contains("rank_collapse"), "{}", r.text());
    let r = put("[loss_spike]\nzz = 1\n", "application/toml").await;
    assert_eq!(r.status, 400);
    assert!(r.error().contains("zz"), "{}", r.text());
    let r = get(&c, "/api/v1/rules?run=ov-1").await.json();
    assert_eq!(
        r["rules"]["rank_collapse"]["drift_factor"], 4.0,
        "the old rules stay in force"
    );
    let r = put("[stale_rank]\ntimeout_ms = 5000\n", "application/toml").await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["rules"]["stale_rank"]["timeout_ms"], 5000);
    c.shutdown().await.unwrap();
    let c = open(dir.path()).await;
    let r = get(&c, "/api/v1/rules?run=ov-1").await.json();
    assert_eq!(
        r["rules"]["stale_rank"]["timeout_ms"], 5000,
        "kept across a restart"
    );
    assert_eq!(
        get(&c, "/api/v1/rules").await.json()["rules"]["stale_rank"]["timeout_ms"],
        60000
    );
    c.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nan_reaches_the_webhook_slack_and_the_training_process() {
    let dir = tempfile::tempdir().unwrap();
    let receiver = Receiver::start(1);
    let (url, got) = (receiver.base.clone(), receiver.got.clone());
    let mut config = config(dir.path());
    config.webhook_urls = vec![format!("{url}/hook")];
    config.slack_webhook_urls = vec![format!("{url}/slack")];
    let c = Collector::open(&config).await.unwrap();
    let run = "nan-1";
    announce(&c, run).await;
    let mut sim = DataParallelSim::new(WORLD, 64, 3);
    for step in 0..12u64 {
        let mut obs = sim.step(step, Fault::None);
        if step == 7 {
            obs.ranks[1].loss = Some(f64::NAN);
        }
        ingest(&c, run, step, &step_rows(run, &obs)).await;
    }
    let alert = wait_alert(&c, run, |a| {
        a["rule"] == "nonfinite" && a["state"] == "firing"
    })
    .await;
    assert_eq!(
        (alert["first_step"].as_u64(), alert["severity"].as_str()),
        (Some(7), Some("critical"))
    );
    assert_eq!(alert["rank"], 1);
    let deadline = Instant::now() + Duration::from_secs(10);
    while got.lock().unwrap().len() < 2 {
        assert!(
            Instant::now() < deadline,
            "deliveries: {:?}",
            got.lock().unwrap()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let got = got.lock().unwrap().clone();
    let hook = &got.iter().find(|(p, _)| p == "/hook").unwrap().1;
    assert_eq!(hook["event"], "opened");
    assert_eq!(hook["status"], "firing");
    assert_eq!(hook["incident"]["rules"], json!(["nonfinite"]));
    assert_eq!(hook["incident"]["ranks"], json!([1]));
    assert_eq!(hook["incident"]["alerts"], json!([alert["id"]]));
    assert!(
        hook["incident"]["action"]
            .as_str()
            .unwrap()
            .starts_with("Only rank 1 saw a non-finite value at step 7"),
        "{hook:#}"
    );
    assert!(
        hook["url"].as_str().unwrap().ends_with("/runs/nan-1"),
        "{hook:#}"
    );
    let slack = &got.iter().find(|(p, _)| p == "/slack").unwrap().1;
    assert!(
        slack["text"]
            .as_str()
            .unwrap()
            .contains("[opened] critical incident on run nan-1: nonfinite, rank 1 of 4"),
        "{slack:#}"
    );
    let attachment = &slack["attachments"][0];
    assert_eq!(attachment["color"], "#e01e5a");
    let fields: Vec<&str> = attachment["fields"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["title"].as_str().unwrap())
        .collect();
    assert_eq!(
        fields,
        ["run", "steps", "ranks", "evidence", "what to do"],
        "{slack:#}"
    );
    let metrics = get(&c, "/metrics").await.text();
    assert!(
        metrics.contains("outcome=\"retried\""),
        "the first 503 was retried: {metrics}"
    );

    // The training process's feed: changes after a revision, then nothing new.
    let feed = get(&c, &format!("/api/v1/runs/{run}/alerts/feed?after=0"))
        .await
        .json();
    assert!(
        feed["alerts"]
            .as_array()
            .unwrap()
            .iter()
            .any(|a| a["id"] == alert["id"])
    );
    let revision = feed["revision"].as_u64().unwrap();
    let again = get(
        &c,
        &format!("/api/v1/runs/{run}/alerts/feed?after={revision}"),
    )
    .await
    .json();
    assert_eq!(again["alerts"], json!([]));
    c.shutdown().await.unwrap();
}

#[test]
fn a_bad_rules_file_stops_the_collector_with_its_line() {
    let dir = tempfile::tempdir().unwrap();
    let rules = dir.path().join("rules.toml");
    std::fs::write(&rules, "[rank_collapse]\nband_low = 2.5\nband_high = 2.0\n").unwrap();
    let mut config = config(dir.path());
    config.rules = Some(rules);
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let err = runtime
        .block_on(Collector::open(&config))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("rules.toml") && err.contains("line 1") && err.contains("band_low"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_raises_at_most_its_cap_of_open_alerts_and_counts_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = config(dir.path());
    config.max_open_alerts_per_run = 2;
    let c = Collector::open(&config).await.unwrap();
    let run = "everyone-nan";
    announce(&c, run).await;
    let mut sim = DataParallelSim::new(WORLD, 64, 3);
    for step in 0..12u64 {
        let mut obs = sim.step(step, Fault::None);
        if step == 7 {
            // Every rank at once: one fault, four per-rank alerts.
            for r in &mut obs.ranks {
                r.loss = Some(f64::NAN);
            }
        }
        ingest(&c, run, step, &step_rows(run, &obs)).await;
    }
    wait_alert(&c, run, |a| {
        a["rule"] == "nonfinite" && a["state"] == "firing"
    })
    .await;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let metrics = get(&c, "/metrics").await.text();
        if metrics.contains("rankwatch_alerts_suppressed_total{rule=\"nonfinite\"} 2") {
            break;
        }
        assert!(Instant::now() < deadline, "{metrics}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let open = get(&c, &format!("/api/v1/alerts?run={run}")).await.json()["alerts"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|a| a["rule"] == "nonfinite")
        .count();
    assert_eq!(open, 2, "the cap");
    c.shutdown().await.unwrap();
}

/// Each rank's `learning_rate` reaches `rank_collapse`: while it climbs (a 300-step warm-up),
/// a post-LN model's slow rise into its early plateau is early training; the same token
/// cosine without it fires (set 4's held-out false alerts, docs/detection.md).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_learning_rate_still_warming_up_holds_rank_collapse_s_early_phase() {
    // Every 25 steps from step 0: two layers of a post-LN 7 × 40 with a 300-step warm-up.
    let layers: [&[f64]; 2] = [
        &[
            0.03, 0.06, 0.18, 0.49, 0.71, 0.78, 0.79, 0.71, 0.65, 0.63, 0.75, 0.55, 0.58, 0.46,
            0.4, 0.42, 0.38,
        ],
        &[
            0.03, 0.07, 0.37, 0.98, 1.0, 1.0, 1.0, 0.98, 0.95, 0.89, 0.83, 0.63, 0.58, 0.49, 0.45,
            0.46, 0.43,
        ],
    ];
    let dir = tempfile::tempdir().unwrap();
    let c = open(dir.path()).await;
    for (run, with_lr) in [("warm-lr", true), ("warm-no-lr", false)] {
        announce(&c, run).await;
        for step in 0..=400u64 {
            let mut rows = Vec::new();
            if with_lr {
                let lr = if step < 300 {
                    1e-3 * (step + 1) as f64 / 300.0
                } else {
                    1e-3 * (1.0 - (step - 300) as f64 / 1000.0)
                };
                rows.extend(
                    (0..WORLD).map(|r| sample(run, Some(r), step, "learning_rate", None, None, lr)),
                );
            }
            if step % 25 == 0 {
                for (layer, tc) in layers.iter().enumerate() {
                    let tc = tc[(step / 25) as usize];
                    rows.push(sample(
                        run,
                        Some(0),
                        step,
                        "token_cosine",
                        Some(layer as u32),
                        None,
                        tc,
                    ));
                }
            }
            if !rows.is_empty() {
                ingest(&c, run, step, &rows).await;
            }
        }
    }
    let fired = wait_alert(&c, "warm-no-lr", |a| {
        a["rule"] == "rank_collapse" && a["fired_at_ms"].is_number()
    })
    .await;
    assert!(fired["first_step"].as_u64().unwrap() < 300, "{fired:#}");
    let alerts = get(&c, "/api/v1/alerts?run=warm-lr").await.json()["alerts"].clone();
    assert_eq!(alerts, json!([]), "the warm-up was not waited out");
    c.shutdown().await.unwrap();
}
