//! Rollups never change an answer: series and heatmaps read through the planner (rollup
//! windows, raw rows at the cut ends, parts without rollups, the hot buffer) equal the answers
//! read from raw rows alone, bit for bit, over random runs, file layouts and bucket grids.

use proptest::prelude::*;
use rankwatch_analytics::{Sample, Site};
use rankwatch_collector::query::views::{HeatmapQuery, SeriesQuery};

use crate::common::*;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// One random value: mostly finite, sometimes NaN or ±Inf, sometimes exactly repeated, and
/// sometimes a zero of either sign (a zero extreme's sign must not depend on arrival order).
fn value() -> impl Strategy<Value = f64> {
    prop_oneof![
        12 => -1e3f64..1e3,
        1 => Just(f64::NAN),
        1 => Just(f64::INFINITY),
        1 => Just(f64::NEG_INFINITY),
        1 => Just(0.5),
        1 => Just(0.0),
        1 => Just(-0.0),
    ]
}

/// A run's rows: per-layer metrics without a site and at two sites, a per-rank metric, ranks that
/// start late and skip steps, now and then a step reported twice, and a sparse per-layer metric
/// (every `every` steps, as a probe at its cadence), whose rollups start at a coarser level.
fn run_rows() -> impl Strategy<Value = Vec<Sample>> {
    (
        1u32..4,
        0u64..300,
        1u64..700,
        proptest::collection::vec((value(), 0u8..10), 64),
        2u64..60,
    )
        .prop_map(|(ranks, first, steps, noise, every)| {
            let mut rows = Vec::new();
            let mut n = 0usize;
            let mut next = || {
                n += 1;
                noise[n % noise.len()]
            };
            for step in first..first + steps {
                for rank in 0..ranks {
                    let (v, roll) = next();
                    // Rank 1 joins late and skips some steps.
                    if rank == 1 && (step < first + 37 || roll == 0) {
                        continue;
                    }
                    let r = Some(rank);
                    rows.push(sample("rp", r, step, "loss", None, None, v + step as f64));
                    for layer in 0..3 {
                        let (v, roll) = next();
                        rows.push(sample(
                            "rp",
                            r,
                            step,
                            "spectral.ratio",
                            Some(layer),
                            None,
                            v,
                        ));
                        if roll == 9 {
                            rows.push(sample(
                                "rp",
                                r,
                                step,
                                "spectral.ratio",
                                Some(layer),
                                None,
                                -v,
                            ));
                        }
                        let site = if (layer + step as u32).is_multiple_of(2) {
                            Site::Up
                        } else {
                            Site::O
                        };
                        rows.push(sample(
                            "rp",
                            r,
                            step,
                            "stable_rank",
                            Some(layer),
                            Some(site),
                            v * 0.5,
                        ));
                        if step.is_multiple_of(every) {
                            rows.push(sample(
                                "rp",
                                r,
                                step,
                                "token_cosine",
                                Some(layer),
                                None,
                                v * 0.25,
                            ));
                        }
                    }
                }
            }
            rows
        })
}

/// A bucket grid request inside or around the run: (from, to, points).
fn grid() -> impl Strategy<Value = (Option<u64>, Option<u64>, usize)> {
    (
        proptest::option::weighted(0.7, 0u64..1100),
        proptest::option::weighted(0.7, 0u64..1100),
        prop_oneof![1usize..8, 8usize..64, 64usize..400],
    )
        .prop_map(|(from, to, points)| match (from, to) {
            (Some(a), Some(b)) => (Some(a.min(b)), Some(a.max(b)), points),
            other => (other.0, other.1, points),
        })
}

/// `rows` as one batch of run `rp`, flushed to a part.
async fn ingest_and_flush(c: &rankwatch_collector::Collector, rows: &[Sample]) {
    let r = post(
        c,
        "/api/v1/ingest",
        ARROW,
        Some("rp/0/s/0"),
        samples_ipc(rows, false),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    c.flush().await.unwrap();
}

/// The planned and the raw answer are the same JSON (or the same error).
fn same_answer<T: serde::Serialize>(
    planned: rankwatch_collector::Result<T>,
    raw: rankwatch_collector::Result<T>,
    what: &str,
) {
    let json = |r: rankwatch_collector::Result<T>| {
        r.map(|a| serde_json::to_string(&a).unwrap())
            .map_err(|e| e.to_string())
    };
    assert_eq!(json(planned), json(raw), "{what}");
}

/// Every read of the planner equals the raw read through DataFusion, whether the planner reads
/// local parts directly (point reads, the default) or through DataFusion (as for object
/// storage), and so does every raw read made by point reads; returns the rollup rows used.
async fn answers_agree(
    c: &rankwatch_collector::Collector,
    grids: &[(Option<u64>, Option<u64>, usize)],
) -> u64 {
    let planned = c.state().queries().clone();
    let planned_datafusion = planned.without_point_reads();
    let raw = planned.without_rollups().without_point_reads();
    let raw_point_reads = planned.without_rollups();
    let used = || c.store().metrics().downsampled_rollup_rows.get();
    let before = used();
    for &(from, to, points) in grids {
        for (metric, layer, site, rank) in [
            ("spectral.ratio", None, None, None),
            ("stable_rank", Some(1), Some("up"), Some(0)),
            ("loss", None, None, Some(1)),
            ("token_cosine", Some(2), None, Some(0)),
        ] {
            let q = || SeriesQuery {
                metric: metric.into(),
                layer,
                site: site.map(str::to_owned),
                rank,
                from,
                to,
                points: Some(points),
            };
            let what = format!(
                "series {metric} {layer:?} {site:?} {rank:?} over {from:?}..{to:?} in {points}"
            );
            same_answer(
                planned.series("rp", q()).await,
                raw.series("rp", q()).await,
                &what,
            );
            same_answer(
                raw_point_reads.series("rp", q()).await,
                raw.series("rp", q()).await,
                &format!("point reads: {what}"),
            );
            same_answer(
                planned_datafusion.series("rp", q()).await,
                raw.series("rp", q()).await,
                &format!("rollups through DataFusion: {what}"),
            );
        }
        for (metric, site, rank) in [
            ("spectral.ratio", None, None),
            ("stable_rank", Some("up"), None),
            ("stable_rank", Some("o"), Some(0)),
            ("token_cosine", None, None),
            ("token_cosine", None, Some(1)),
        ] {
            let q = || HeatmapQuery {
                metric: metric.into(),
                site: site.map(str::to_owned),
                rank,
                from,
                to,
                points: Some(points),
            };
            let what =
                format!("heatmap {metric} {site:?} {rank:?} over {from:?}..{to:?} in {points}");
            same_answer(
                planned.heatmap("rp", q()).await,
                raw.heatmap("rp", q()).await,
                &what,
            );
            same_answer(
                raw_point_reads.heatmap("rp", q()).await,
                raw.heatmap("rp", q()).await,
                &format!("point reads: {what}"),
            );
            same_answer(
                planned_datafusion.heatmap("rp", q()).await,
                raw.heatmap("rp", q()).await,
                &format!("rollups through DataFusion: {what}"),
            );
        }
    }
    used() - before
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Random runs cut into random parts (flushed or left hot, compacted or not): the
    /// planner's series and heatmaps equal the raw ones.
    #[test]
    fn rollups_answer_exactly_what_raw_rows_answer(
        rows in run_rows(),
        cuts in proptest::collection::vec((0.0f64..1.0, any::<bool>()), 1..5),
        compact in any::<bool>(),
        grids in proptest::collection::vec(grid(), 4),
    ) {
        let rt = runtime();
        let dir = tempfile::tempdir().unwrap();
        rt.block_on(async {
            let c = open_store_only(dir.path()).await;
            // Rows arrive in step order, cut at random points; each piece is flushed to a
            // part or left in the hot buffer.
            let mut at: Vec<usize> = cuts.iter().map(|(f, _)| (f * rows.len() as f64) as usize).collect();
            at.push(rows.len());
            at.sort_unstable();
            let mut start = 0;
            for (i, (&end, &(_, flush))) in at.iter().zip(cuts.iter().chain([&(0.0, false)])).enumerate() {
                if end > start {
                    let r = post(&c, "/api/v1/ingest", ARROW, Some(&format!("rp/0/s/{i}")), samples_ipc(&rows[start..end], false)).await;
                    assert_eq!(r.status, 200, "{}", r.text());
                    start = end;
                }
                if flush {
                    c.flush().await.unwrap();
                }
            }
            if compact {
                c.store().compact().await.unwrap();
            }
            answers_agree(&c, &grids).await;
        });
    }
}

/// A metric sampled every 25 steps beside dense ones: its rollup starts at 64-step windows
/// (per rank; pooled over 4 ranks at 2-step ones), the part's manifest entry says so, and
/// every grid, narrower and wider than that, answers exactly what raw rows answer.
#[tokio::test]
async fn a_sparse_metric_is_read_raw_below_its_first_level() {
    let dir = tempfile::tempdir().unwrap();
    let c = open_store_only(dir.path()).await;
    let mut rows = Vec::new();
    for step in 0..3_000u64 {
        for rank in 0..4 {
            // (metric, layer, value) of rank `rank` at `step`.
            let mut at = |metric: &str, layer: Option<u32>, v: f64| {
                rows.push(sample("rp", Some(rank), step, metric, layer, None, v));
            };
            at("loss", None, step as f64);
            for layer in 0..3 {
                at("spectral.ratio", Some(layer), f64::from(layer));
                if step.is_multiple_of(25) {
                    at(
                        "token_cosine",
                        Some(layer),
                        (step as f64).sin() * f64::from(rank + 1),
                    );
                }
            }
        }
    }
    ingest_and_flush(&c, &rows).await;
    let rollups: Vec<_> = c
        .store()
        .files()
        .into_iter()
        .filter(|f| f.table == "rollups")
        .collect();
    assert_eq!(rollups.len(), 1);
    let finest = rollups[0].sparse.get("token_cosine").copied();
    assert_eq!(
        finest,
        Some(rankwatch_collector::store::rollup::Finest {
            rank: Some(6),
            pooled: Some(1)
        })
    );
    assert_eq!(
        rollups[0].sparse.len(),
        1,
        "the dense metrics have every level"
    );
    let grids: Vec<(Option<u64>, Option<u64>, usize)> = vec![
        (None, None, 1000), // 4-step buckets: raw below 64 per rank
        (None, None, 100),  // 32-step
        (None, None, 40),   // 128-step: rollups
        (Some(10), Some(2_990), 60),
        (Some(100), Some(400), 300),
    ];
    let used = answers_agree(&c, &grids).await;
    assert!(used > 0, "the coarse grids read rollup windows");
}

/// A long run in a few parts, asked for the whole range: the planner reads rollup windows
/// and at most the cut windows raw, far fewer rows than the run holds.
#[tokio::test]
async fn an_overview_reads_rollups_not_rows() {
    let dir = tempfile::tempdir().unwrap();
    let c = open_store_only(dir.path()).await;
    let rows = workload("rp", 4, 5_000, 4);
    for (i, chunk) in rows.chunks(rows.len() / 3 + 1).enumerate() {
        let r = post(
            &c,
            "/api/v1/ingest",
            ARROW,
            Some(&format!("rp/0/s/{i}")),
            samples_ipc(chunk, true),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.text());
        c.flush().await.unwrap();
    }
    let files = c.store().files();
    assert_eq!(files.iter().filter(|f| f.table == "rollups").count(), 3);
    assert_eq!(files.iter().filter(|f| f.table == "samples").count(), 3);
    let m = c.store().metrics();
    let (raw0, tiles0) = (
        m.downsampled_raw_rows.get(),
        m.downsampled_rollup_rows.get(),
    );
    let h = get(
        &c,
        "/api/v1/runs/rp/heatmap?metric=spectral.ratio&points=100",
    )
    .await;
    assert_eq!(h.status, 200, "{}", h.text());
    let h = h.json();
    // 5,000 steps in at most 100 buckets: width 64, 79 buckets, the last cut at step 4,999.
    assert_eq!(h["buckets"]["width"], 64);
    assert_eq!(h["steps"].as_array().unwrap().len(), 79);
    let samples: u64 = rows
        .iter()
        .filter(|r| r.metric.as_str() == "spectral.ratio")
        .count() as u64;
    let cells: u64 = h["count"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|r| r.as_array().unwrap())
        .map(|n| n.as_u64().unwrap())
        .sum();
    assert_eq!(cells, samples, "every row is counted once");
    let (raw, tiles) = (
        m.downsampled_raw_rows.get() - raw0,
        m.downsampled_rollup_rows.get() - tiles0,
    );
    // The cells pool the ranks, so the rank-pooled windows answer: 4 layers × 79 windows, plus
    // one per layer where a window straddles two parts. No part has rows past the range's
    // ends, so the cut last window comes from the rollups too: no raw row at all.
    assert!((4 * 79..=4 * 81).contains(&tiles), "{tiles} rollup rows");
    assert_eq!(raw, 0, "raw rows read");
    // Local parts are read through their series indexes, built on a part's first read only.
    assert_eq!(
        m.point_read_parts.get(),
        3,
        "the three rollup parts, read directly"
    );
    assert_eq!(m.part_index_builds.get(), 3);
    assert_eq!(m.read_cache_hits.get(), 0, "nothing was decoded before");
    // A narrower range cuts windows of parts that have rows beyond it: those steps are raw.
    let (raw0, tiles0) = (
        m.downsampled_raw_rows.get(),
        m.downsampled_rollup_rows.get(),
    );
    let h = get(
        &c,
        "/api/v1/runs/rp/heatmap?metric=spectral.ratio&points=100&from=100&to=4000",
    )
    .await;
    assert_eq!(h.status, 200, "{}", h.text());
    assert_eq!(h.json()["buckets"]["width"], 64);
    let (raw, tiles) = (
        m.downsampled_raw_rows.get() - raw0,
        m.downsampled_rollup_rows.get() - tiles0,
    );
    // 100..=127 and 3,968..=4,000 raw, for 4 layers × 4 ranks.
    assert_eq!(raw, (28 + 33) * 16, "raw rows read");
    // The three rollup parts again (cached) and the two samples parts cut by the ends (new).
    assert_eq!(m.point_read_parts.get(), 3 + 5);
    assert_eq!(m.part_index_builds.get(), 3 + 2);
    // The same windows of the same series: each rollup part's rows come from what the first
    // heatmap decoded, only the range applied anew (the answers are checked below).
    assert_eq!(m.read_cache_hits.get(), 3);
    assert!(tiles > 0 && tiles < 4 * 64, "{tiles} rollup rows");
    // The narrower heatmap above included: its rows came from the first one's kept rows.
    assert!(
        answers_agree(
            &c,
            &[
                (None, None, 100),
                (Some(100), Some(4_000), 100),
                (Some(3), Some(4_000), 37)
            ]
        )
        .await
            > 0
    );
    c.shutdown().await.unwrap();
}

/// The heatmap the compaction test asks for before and after.
const HEATMAP: &str = "/api/v1/runs/rp/heatmap?metric=spectral.ratio&points=50";

/// Parts written before rollups existed are read raw until compaction writes their rollups;
/// the answers are the same before and after.
#[tokio::test]
async fn older_parts_get_their_rollups_at_compaction() {
    let dir = tempfile::tempdir().unwrap();
    let c = open_store_only(dir.path()).await;
    let rows = workload("rp", 2, 600, 2);
    ingest_and_flush(&c, &rows).await;
    let before = get(&c, HEATMAP).await.json();
    c.shutdown().await.unwrap();
    // Make it an older store: the manifest without its rollup, the file gone.
    let path = dir.path().join("manifest.json");
    let mut manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let files = manifest["files"].as_array_mut().unwrap();
    let rollup = files
        .iter()
        .position(|f| f["table"] == "rollups")
        .expect("a rollup was written");
    let gone = files.remove(rollup);
    std::fs::remove_file(dir.path().join(format!(
        "table=rollups/run=rp/part-{}.parquet",
        gone["part"]
    )))
    .unwrap();
    std::fs::write(&path, serde_json::to_vec(&manifest).unwrap()).unwrap();

    let c = open_store_only(dir.path()).await;
    let tiles = || c.store().metrics().downsampled_rollup_rows.get();
    let old = get(&c, HEATMAP).await.json();
    assert_eq!(old, before);
    assert_eq!(tiles(), 0, "no rollup to read yet");
    c.store().compact().await.unwrap();
    assert_eq!(
        c.store()
            .files()
            .iter()
            .filter(|f| f.table == "rollups")
            .count(),
        1
    );
    let new = get(&c, HEATMAP).await.json();
    assert_eq!(new, before);
    assert!(tiles() > 0, "the rollup written at compaction is read");
    c.shutdown().await.unwrap();
}

/// A part of many short series (here 40 steps each) gets no rollup, which would hold nearly as
/// many rows as it summarises; it is read raw and answers the same.
#[tokio::test]
async fn parts_of_short_series_get_no_rollup() {
    let dir = tempfile::tempdir().unwrap();
    let c = open_store_only(dir.path()).await;
    let rows = workload("rp", 8, 40, 8);
    ingest_and_flush(&c, &rows).await;
    c.store().compact().await.unwrap();
    let files = c.store().files();
    assert_eq!(files.iter().filter(|f| f.table == "samples").count(), 1);
    assert_eq!(files.iter().filter(|f| f.table == "rollups").count(), 0);
    assert_eq!(
        answers_agree(&c, &[(None, None, 4), (Some(3), Some(30), 2)]).await,
        0
    );
    c.shutdown().await.unwrap();
}

/// A part holding a NaN beside one other value (its footer, NaN-blind, once said min = max):
/// every read path, DataFusion's included, counts the NaN and keeps the other value's extremes.
#[tokio::test]
async fn a_nan_in_a_part_is_counted_by_every_read_path() {
    let dir = tempfile::tempdir().unwrap();
    let c = open_store_only(dir.path()).await;
    let first = [
        sample("rp", Some(0), 0, "loss", None, None, 0.5),
        sample("rp", Some(0), 0, "spectral.ratio", Some(0), None, f64::NAN),
    ];
    ingest_and_flush(&c, &first).await;
    let rest: Vec<Sample> = (1..3)
        .map(|s| sample("rp", Some(0), s, "spectral.ratio", Some(0), None, s as f64))
        .collect();
    ingest_and_flush(&c, &rest).await;
    let planned = c.state().queries().clone();
    for (name, queries) in [
        ("planned", planned.clone()),
        ("through DataFusion", planned.without_point_reads()),
        ("raw", planned.without_rollups().without_point_reads()),
        ("raw point reads", planned.without_rollups()),
    ] {
        let q = SeriesQuery {
            metric: "spectral.ratio".into(),
            layer: None,
            site: None,
            rank: None,
            from: None,
            to: None,
            points: Some(3),
        };
        let answer = serde_json::to_value(queries.series("rp", q).await.unwrap()).unwrap();
        let first = &answer["series"][0]["buckets"][0];
        assert_eq!(first["nonfinite"], 1, "{name}: {first}");
        assert_eq!(first["min"], serde_json::Value::Null, "{name}: {first}");
        assert_eq!(first["last"], "NaN", "{name}: {first}");
    }
}
