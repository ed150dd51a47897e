//! `GET /api/v1/runs/{run}/consistency` over what was ingested: independent shards read ≈ 1,
//! ranks fed the same batches read far below it, and the odd rank of an off-task run stands
//! out in `ranks`; the aligner's C_w is reported; bad requests are refused with their reason.

use rankwatch_analytics::simulate::{DataParallelSim, Fault};
use rankwatch_collector::Collector;

use crate::alerting::{announce, ingest, step_rows};
use crate::common::*;

/// 300 steps of a 4-rank run; `same` gives every rank rank 0's values.
async fn feed(c: &Collector, run: &str, seed: u32, fault: Fault, same: bool) {
    announce(c, run).await;
    let mut sim = DataParallelSim::new(4, 1024, seed);
    for step in 0..300u64 {
        let mut obs = sim.step(step, fault);
        if same {
            let first = obs.ranks[0];
            for r in &mut obs.ranks {
                *r = rankwatch_analytics::math::step::RankValues {
                    rank: r.rank,
                    ..first
                };
            }
        }
        ingest(c, run, step, &step_rows(run, &obs)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runs_consistency_reads_against_independent_shards() {
    let dir = tempfile::tempdir().unwrap();
    let c = Collector::open(&config(dir.path())).await.unwrap();
    feed(&c, "shards", 3, Fault::None, false).await;
    feed(&c, "same", 4, Fault::None, true).await;
    feed(&c, "off-task", 5, Fault::LossOffset(2, 0.8), false).await;

    let shards = get(&c, "/api/v1/runs/shards/consistency").await.json();
    assert_eq!(shards["verdict"], "independent_shards", "{shards:#}");
    assert_eq!(
        (
            shards["from_step"].as_u64(),
            shards["to_step"].as_u64(),
            shards["steps"].as_u64()
        ),
        (Some(0), Some(299), Some(300))
    );
    let ratio = shards["loss"]["ratio"].as_f64().unwrap();
    assert!((0.6..=1.6).contains(&ratio), "{shards:#}");
    assert_eq!(shards["ranks"].as_array().unwrap().len(), 4);

    let same = get(&c, "/api/v1/runs/same/consistency").await.json();
    assert_eq!(same["verdict"], "same_batches", "{same:#}");
    assert!(
        same["reading"].as_str().unwrap().contains("same data"),
        "{same:#}"
    );

    let off = get(&c, "/api/v1/runs/off-task/consistency?from=100&to=299")
        .await
        .json();
    assert_eq!(off["verdict"], "more_dispersed", "{off:#}");
    assert_eq!(off["from_step"], 100);
    let standing = |rank: u64| {
        off["ranks"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["rank"] == rank)
            .unwrap()["loss_vs_others"]
            .as_f64()
            .unwrap()
    };
    assert!(
        standing(2) > 1.2 && (0.9..1.1).contains(&standing(0)),
        "{off:#}"
    );

    // The aligner's C_w of closed steps is reported (the last steps close on its timeout).
    let mut waited = 0;
    loop {
        let report = get(&c, "/api/v1/runs/shards/consistency").await.json();
        if let Some(cos) = report["cos_weighted_median"].as_f64() {
            assert!((-1.0..=1.0).contains(&cos), "{report:#}");
            break;
        }
        waited += 1;
        assert!(waited < 100, "no C_w: {report:#}");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }

    let unknown = get(&c, "/api/v1/runs/nope/consistency").await;
    assert_eq!(unknown.status, 404);
    let backwards = get(&c, "/api/v1/runs/shards/consistency?from=9&to=3").await;
    assert_eq!(backwards.status, 400);
    assert!(
        backwards.error().contains("from (9) is after to (3)"),
        "{}",
        backwards.error()
    );
    let typo = get(&c, "/api/v1/runs/shards/consistency?form=3").await;
    assert_eq!(typo.status, 400);
    let short = get(&c, "/api/v1/runs/shards/consistency?from=0&to=5")
        .await
        .json();
    assert_eq!(short["verdict"], "too_few_steps", "{short:#}");
    c.shutdown().await.unwrap();
}
