//! Incidents, acknowledgements, silences and finished runs through the real router and a
//! real webhook receiver: one fault on every rank is one incident; a silence holds its
//! notifications back until it is deleted; finishing every rank resolves what is open.

use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::Request;
use rankwatch_analytics::simulate::{DataParallelSim, Fault};
use rankwatch_collector::Collector;
use serde_json::{Value, json};

use crate::alerting::{announce, ingest, step_rows};
use crate::common::*;

const WORLD: u32 = 4;

async fn send_json(c: &Collector, method: &str, uri: &str, body: Value) -> Reply {
    let request = Request::builder()
        .method(method)
        .uri(uri)
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .unwrap();
    call(c, request).await
}

async fn delete(c: &Collector, uri: &str) -> Reply {
    call(c, Request::delete(uri).body(Body::empty()).unwrap()).await
}

/// Polls the run's incidents until `pred` holds for the list (10 s at most).
async fn wait_incidents(c: &Collector, run: &str, pred: impl Fn(&[Value]) -> bool) -> Vec<Value> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let list = get(c, &format!("/api/v1/incidents?run={run}")).await.json()["incidents"]
            .as_array()
            .unwrap()
            .clone();
        if pred(&list) {
            return list;
        }
        assert!(
            Instant::now() < deadline,
            "incidents never matched: {list:#?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The webhook deliveries so far: (event, incident id).
fn heard(got: &std::sync::Mutex<Vec<(String, Value)>>) -> Vec<(String, String)> {
    got.lock()
        .unwrap()
        .iter()
        .map(|(_, b)| {
            (
                b["event"].as_str().unwrap_or("").to_owned(),
                b["incident"]["id"].as_str().unwrap_or("").to_owned(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_fault_on_every_rank_is_one_incident_silenced_acknowledged_and_resolved_by_finishing() {
    let dir = tempfile::tempdir().unwrap();
    let receiver = Receiver::start(0);
    let got = receiver.got.clone();
    let mut config = config(dir.path());
    config.webhook_urls = vec![format!("{}/hook", receiver.base)];
    let c = Collector::open(&config).await.unwrap();
    let run = "incident-1";
    announce(&c, run).await;

    // Bad silences are refused with their reason; a good one is listed as active.
    let refused = send_json(
        &c,
        "POST",
        "/api/v1/silences",
        json!({"matchers": {}, "duration_s": 60, "created_by": "ana"}),
    )
    .await;
    assert_eq!(refused.status, 400);
    assert!(
        refused.error().contains("at least one matcher"),
        "{}",
        refused.error()
    );
    let refused = send_json(
        &c,
        "POST",
        "/api/v1/silences",
        json!({"matchers": {"rule": "nope"}, "duration_s": 60, "created_by": "ana"}),
    )
    .await;
    assert_eq!(refused.status, 400, "{}", refused.text());
    let silence = send_json(
        &c,
        "POST",
        "/api/v1/silences",
        json!({"matchers": {"run": run, "rule": "nonfinite"}, "duration_s": 3600, "created_by": "ana", "comment": "known NaN, fix on its way"}),
    )
    .await;
    assert_eq!(silence.status, 201, "{}", silence.text());
    let silence = silence.json();
    assert_eq!(silence["active"], true);
    let listed = get(&c, "/api/v1/silences").await.json();
    assert_eq!(listed["silences"][0]["id"], silence["id"]);

    // Every rank's loss turns NaN from step 7: four per-rank alerts, one cause.
    let mut sim = DataParallelSim::new(WORLD, 64, 5);
    for step in 0..12u64 {
        let mut obs = sim.step(step, Fault::None);
        if step >= 7 {
            for r in &mut obs.ranks {
                r.loss = Some(f64::NAN);
            }
        }
        ingest(&c, run, step, &step_rows(run, &obs)).await;
    }
    let incidents = wait_incidents(&c, run, |list| {
        list.len() == 1
            && list[0]["alerts"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|a| a["state"] == "firing")
                .count()
                == 4
    })
    .await;
    let incident = &incidents[0];
    assert_eq!(incident["state"], "firing");
    assert_eq!(incident["every_rank"], true, "{incident:#}");
    assert_eq!(incident["ranks"], json!([0, 1, 2, 3]));
    assert!(
        incident["summary"]
            .as_str()
            .unwrap()
            .starts_with("nonfinite, every rank of 4"),
        "{incident:#}"
    );
    assert_eq!(incident["silenced_by"], json!([silence["id"]]));
    assert!(incident["acknowledged"].is_null());

    // Silenced: the receiver heard nothing of them (give the delivery thread a moment).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(heard(&got), vec![], "a silenced alert reached the receiver");

    // Acknowledge: checked, then kept on every alert of the incident.
    let id = incident["id"].as_str().unwrap().to_owned();
    let ack_uri = format!("/api/v1/incidents/{id}/ack");
    let bad = send_json(&c, "POST", &ack_uri, json!({"comment": "who?"})).await;
    assert_eq!(bad.status, 400);
    assert!(bad.error().contains("by"), "{}", bad.error());
    let missing = send_json(
        &c,
        "POST",
        "/api/v1/incidents/incident:nope/ack",
        json!({"by": "ana"}),
    )
    .await;
    assert_eq!(missing.status, 404);
    assert!(
        missing.error().contains("no incident"),
        "{}",
        missing.error()
    );
    let acked = send_json(
        &c,
        "POST",
        &ack_uri,
        json!({"by": "ana", "comment": "on it"}),
    )
    .await;
    assert_eq!(acked.status, 200, "{}", acked.text());
    assert_eq!(acked.json()["acknowledged"]["by"], "ana");
    let listed = get(&c, &format!("/api/v1/incidents?run={run}"))
        .await
        .json();
    assert_eq!(listed["incidents"][0]["acknowledged"]["comment"], "on it");

    // The silence ends: the held-back incident reaches the receiver, once for its 4 alerts,
    // with where it struck, the evidence and what to do.
    let ended = delete(
        &c,
        &format!("/api/v1/silences/{}", silence["id"].as_str().unwrap()),
    )
    .await;
    assert_eq!(ended.status, 200, "{}", ended.text());
    assert_eq!(ended.json()["active"], false);
    let deadline = Instant::now() + Duration::from_secs(10);
    while heard(&got).is_empty() {
        assert!(Instant::now() < deadline, "held-back incident not told");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(heard(&got), [("opened".to_owned(), id.clone())]);
    let opened = got.lock().unwrap()[0].1.clone();
    assert_eq!(opened["version"], 2);
    assert_eq!(opened["status"], "firing");
    let told = &opened["incident"];
    assert_eq!(told["alerts"].as_array().unwrap().len(), 4, "{opened:#}");
    assert_eq!(
        (told["every_rank"].as_bool(), told["severity"].as_str()),
        (Some(true), Some("critical"))
    );
    assert!(
        told["action"]
            .as_str()
            .unwrap()
            .contains("every rank at step 7"),
        "{opened:#}"
    );
    assert!(
        told["evidence"].as_str().unwrap().contains("step 7"),
        "{opened:#}"
    );
    assert!(
        opened["text"].as_str().unwrap().starts_with(
            "[opened] critical incident on run incident-1: nonfinite, every rank of 4"
        ),
        "{opened:#}"
    );

    // Every rank finishes: the incident resolves now, not an idle hour later.
    let finished: Vec<_> = (0..WORLD)
        .map(|rank| sample(run, Some(rank), 11, "finished", None, None, 1.0))
        .collect();
    ingest(&c, run, 100, &finished).await;
    let incidents = wait_incidents(&c, run, |list| {
        list.len() == 1 && list[0]["state"] == "resolved"
    })
    .await;
    for alert in incidents[0]["alerts"].as_array().unwrap() {
        assert!(
            alert["explanation"]
                .as_str()
                .unwrap()
                .contains("the run finished"),
            "{alert:#}"
        );
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while heard(&got).len() < 2 {
        assert!(
            Instant::now() < deadline,
            "the resolution was not told: {:?}",
            heard(&got)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        heard(&got),
        [
            ("opened".to_owned(), id.clone()),
            ("resolved".to_owned(), id.clone())
        ],
        "one message when it opened, one when it resolved"
    );
    let metrics = get(&c, "/metrics").await.text();
    assert!(
        metrics.contains("rankwatch_runs_finished_total 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("rankwatch_alerts_silenced_total{rule=\"nonfinite\"} 4"),
        "{metrics}"
    );
    // A resolved incident has nothing left to acknowledge.
    let late = send_json(&c, "POST", &ack_uri, json!({"by": "bo"})).await;
    assert_eq!(late.status, 400);
    c.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silences_and_acknowledgements_survive_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let c = open(dir.path()).await;
    let silence = send_json(
        &c,
        "POST",
        "/api/v1/silences",
        json!({"matchers": {"rank": 3}, "duration_s": 600, "created_by": "ana"}),
    )
    .await;
    assert_eq!(silence.status, 201, "{}", silence.text());
    c.shutdown().await.unwrap();
    let c = open(dir.path()).await;
    let listed = get(&c, "/api/v1/silences").await.json();
    assert_eq!(listed["silences"][0]["id"], silence.json()["id"]);
    assert_eq!(listed["silences"][0]["matchers"], json!({"rank": 3}));
    let gone = delete(&c, "/api/v1/silences/silence-unknown").await;
    assert_eq!(gone.status, 404);
    assert!(gone.error().contains("no silence"), "{}", gone.error());
    c.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_that_reports_again_after_finishing_keeps_the_run_open() {
    let dir = tempfile::tempdir().unwrap();
    let c = open(dir.path()).await;
    let run = "resumed-1";
    announce(&c, run).await;
    let mut sim = DataParallelSim::new(WORLD, 64, 9);
    for step in 0..5u64 {
        ingest(&c, run, step, &step_rows(run, &sim.step(step, Fault::None))).await;
    }
    let finish = |ranks: std::ops::Range<u32>, step: u64| -> Vec<_> {
        ranks
            .map(|rank| sample(run, Some(rank), step, "finished", None, None, 1.0))
            .collect()
    };
    let retired = |text: &str| text.contains("rankwatch_runs_finished_total 1");
    // Ranks 0–2 finish; rank 0 then trains on (a resume under the same name) before rank 3
    // finishes: the run is not over.
    ingest(&c, run, 10, &finish(0..3, 4)).await;
    let mut again = sim.step(5, Fault::None);
    again.ranks.truncate(1);
    ingest(&c, run, 11, &step_rows(run, &again)).await;
    ingest(&c, run, 12, &finish(3..4, 4)).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        !retired(&get(&c, "/metrics").await.text()),
        "retired while rank 0 still trains"
    );
    // Rank 0 finishes too: now it is.
    ingest(&c, run, 13, &finish(0..1, 5)).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while !retired(&get(&c, "/metrics").await.text()) {
        assert!(Instant::now() < deadline, "never retired");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    c.shutdown().await.unwrap();
}
