//! The alert engine's CPU per sample on the agent's default report (issue 47's "≤ 30 ns a
//! sample"), without the HTTP, WAL and store around it.
//!
//! The report is the one `bench/agent_mix.py capture` recorded from the real SDK (the demo
//! model at its default cadences: every step's gradient scalars, a sketch and the replica
//! fingerprints every 10 steps, activations every 25, the spectral probe every 50), replayed for
//! `ranks` ranks. Each rank's report of a step is one Arrow batch, as the agent posts it, and
//! goes through what the engine does with an acknowledged batch: every row routed
//! (`RunWatch::row`), the batch ended, the run ticked (steps closed, their cross-rank statistics
//! and rules evaluated, stale ranks checked). Sketches are fed as the agent sends them, before
//! that step's samples. Throughput is reported in samples (sample rows; the sketches' work is
//! counted in their time, not their number).
//!
//! Time is the bench thread's CPU time, not wall time: on a shared machine other processes
//! stretch wall time, not the CPU the engine itself uses (what a sample costs the collector's
//! core). Run with `cargo bench -p rankwatch-collector --bench engine` (or `cargo xtask bench
//! engine`).

use std::hint::black_box;
use std::time::Duration;

use arrow_array::RecordBatch;
use criterion::{BatchSize, BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use rankwatch_analytics::agent_mix::{AgentMix, replica_sketch};
use rankwatch_analytics::detect::DetectorsConfig;
use rankwatch_analytics::math::SketchKind;
use rankwatch_analytics::schema::samples;
use rankwatch_analytics::{RunId, SketchRecord};
use rankwatch_collector::alerting::watch::RunWatch;

#[path = "shared/thread_cpu.rs"]
mod thread_cpu;
use thread_cpu::ThreadCpu;

const MIX: &str = include_str!("../../bench/agent_mix.json");
/// Steps replayed per iteration: two periods of the schedule.
const STEPS: u64 = 200;
const SKETCH_DIM: usize = 1024;

/// One rank's report of one step: its samples batch and whether a sketch goes with it.
struct Report {
    rank: u32,
    step: u64,
    batch: RecordBatch,
    sketch: bool,
}

fn time_ms(step: u64) -> i64 {
    1_700_000_000_000 + step as i64 * 1000
}

fn reports(mix: &AgentMix, run: &RunId, ranks: u32) -> (Vec<Report>, u64) {
    let mut out = Vec::new();
    let mut rows = 0;
    for step in 0..STEPS {
        for rank in 0..ranks {
            let (samples, sketch) = mix.samples(run, rank, step, ranks, time_ms(step));
            rows += samples.len() as u64;
            out.push(Report {
                rank,
                step,
                batch: samples::to_batch(&samples).expect("a valid batch"),
                sketch,
            });
        }
    }
    (out, rows)
}

fn engine(c: &mut Criterion<ThreadCpu>) {
    let mix = AgentMix::parse(MIX).expect("bench/agent_mix.json");
    let run = RunId::new("bench").expect("a valid run id");
    let mut group = c.benchmark_group("alert engine, agent's default report");
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(20));
    for ranks in [64u32, 1024] {
        let (reports, rows) = reports(&mix, &run, ranks);
        let sketches: Vec<Option<SketchRecord>> = reports
            .iter()
            .map(|r| {
                // Replicas' gradients agree to a cosine near 0.9: a shared direction and each
                // rank's own.
                r.sketch.then(|| {
                    replica_sketch(
                        &run,
                        r.rank,
                        r.step,
                        time_ms(r.step),
                        SketchKind::Rademacher,
                        SKETCH_DIM,
                        0.3,
                    )
                })
            })
            .collect();
        group.throughput(Throughput::Elements(rows));
        group.bench_with_input(BenchmarkId::new("ranks", ranks), &ranks, |b, &ranks| {
            b.iter_batched(
                || {
                    RunWatch::new(run.clone(), DetectorsConfig::default(), 30_000, 0)
                        .expect("default detectors")
                },
                |mut watch| {
                    let tensors = Vec::new;
                    for (report, sketch) in reports.iter().zip(&sketches) {
                        // The collector's clock: one second a step, as the ranks report.
                        let now = report.step as i64 * 1000;
                        if let Some(s) = sketch {
                            watch.sketch(s.clone(), now);
                        }
                        samples::try_for_each_row(&report.batch, |row| {
                            black_box(watch.row(row, now));
                            Ok(())
                        })
                        .expect("a valid batch");
                        black_box(watch.end_batch());
                        black_box(watch.tick(Some(ranks), now, false, &tensors));
                    }
                    watch
                },
                BatchSize::PerIteration,
            );
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().with_measurement(ThreadCpu);
    targets = engine
}
criterion_main!(benches);
