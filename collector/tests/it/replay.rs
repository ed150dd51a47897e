//! `rankwatch replay`: a run judged live, exported, and judged again from its rows. Under the
//! same rules the replay finds the alert the engine raised, at the same step and naming the
//! same rank; under stricter rules it finds none; bad files are refused with their name.

use std::time::Duration;

use rankwatch_analytics::Rule;
use rankwatch_analytics::simulate::{DataParallelSim, Fault};
use rankwatch_collector::alerting::replay::{StoredRun, read_parquet};
use rankwatch_collector::alerting::rules;

use crate::alerting::{announce, ingest, step_rows};
use crate::common::*;

const WORLD: u32 = 4;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replayed_run_raises_what_the_live_engine_raised_and_other_rules_change_it() {
    let dir = tempfile::tempdir().unwrap();
    let c = open(dir.path()).await;
    let run = "replay-1";
    announce(&c, run).await;
    let mut sim = DataParallelSim::new(WORLD, 256, 11);
    for step in 0..300u64 {
        let fault = if step >= 240 {
            Fault::ScaleGradient(2, 6.0)
        } else {
            Fault::None
        };
        let mut obs = sim.step(step, fault);
        // A second of the run's own clock per 10 steps: the replay ticks on it.
        obs.time_ms = 1_700_000_000_000 + step as i64 * 100;
        ingest(&c, run, step, &step_rows(run, &obs)).await;
    }
    // The live engine's verdict, once it has judged the fault.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let live = loop {
        let alerts = get(&c, &format!("/api/v1/alerts?run={run}")).await.json()["alerts"].clone();
        if let Some(a) = alerts
            .as_array()
            .unwrap()
            .iter()
            .find(|a| a["rule"] == "silent_inconsistency" && a["fired_at_ms"].is_number())
        {
            break a.clone();
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no live alert: {alerts:#}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };

    let export = get(&c, &format!("/api/v1/runs/{run}/export?table=samples")).await;
    assert_eq!(export.status, 200, "{}", export.text());
    let samples = dir.path().join("replay-1.samples.parquet");
    std::fs::write(&samples, &export.body).unwrap();
    let stored = StoredRun::new(&read_parquet(&samples).unwrap(), &[], None).unwrap();
    assert_eq!(stored.world_size, WORLD);

    let replayed = stored.replay(Default::default(), 10_000).unwrap();
    let same = replayed
        .iter()
        .find(|a| a.rule == Rule::SilentInconsistency && a.has_fired())
        .unwrap_or_else(|| panic!("the replay missed the live alert {live:#}: {replayed:#?}"));
    assert_eq!(
        Some(same.first_step),
        live["first_step"].as_u64(),
        "{same:#?} vs {live:#}"
    );
    assert_eq!(same.outlier_ranks.first(), Some(&2), "{same:#?}");

    // Stricter rules, as a threshold sweep would set them: the same rows raise nothing.
    let strict = dir.path().join("strict.toml");
    std::fs::write(
        &strict,
        "[silent_inconsistency]\nz_threshold = 1e9\nz_exit = 1e8\npeer_window = 0\nidentical_steps = 0\nsame_batch_closeness = 0\n",
    )
    .unwrap();
    let quiet = stored
        .replay(rules::load_file(&strict).unwrap(), 10_000)
        .unwrap();
    assert!(
        !quiet
            .iter()
            .any(|a| a.rule == Rule::SilentInconsistency && a.has_fired()),
        "{quiet:#?}"
    );

    // Bad files are refused naming the file.
    let junk = dir.path().join("junk.parquet");
    std::fs::write(&junk, b"not parquet").unwrap();
    let err = read_parquet(&junk).unwrap_err().to_string();
    assert!(
        err.contains("junk.parquet") && err.contains("not a Parquet file"),
        "{err}"
    );
    let err = read_parquet(&dir.path().join("absent.parquet"))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("cannot open") && err.contains("absent.parquet"),
        "{err}"
    );
    c.shutdown().await.unwrap();
}
