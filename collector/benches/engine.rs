//! The alert engine's CPU per sample on the agent's default report (issue 47's "≤ 30 ns a
//! sample"), without the HTTP, WAL and store around it.
//!
//! The report is the one `bench/agent_mix.py capture` recorded from the real SDK (the demo
//! model at its default cadences: every step's gradient scalars, a sketch and the replica
//! fingerprints every 10 steps, activations every 25, the spectral probe every 50), replayed for
//! `ranks` ranks. Each rank's report of a step is one Arrow batch, as the agent posts it, and
//! goes through what the engine does with an acknowledged batch: every row routed
//! (`RunWatch::samples`), the batch ended, the run ticked (steps closed, their cross-rank statistics
//! and rules evaluated, stale ranks checked). Sketches are fed as the agent sends them, before
//! that step's samples. Throughput is reported in samples (sample rows; the sketches' work is
//! counted in their time, not their number).
//!
//! Two cases. `cold`: every batch of the replay built before it starts (tens of megabytes at 64
//! ranks), so the engine reads each one from memory, as if it had waited in a long queue.
//! `handed-over`: each step's batches built just before the engine takes them, their building
//! not timed, as ingest hands over a batch it has just decoded and validated. The engine's own
//! work is the same in both; the difference is what reading a batch costs when it is not in the
//! cache.
//!
//! Time is the bench thread's CPU time, not wall time: on a shared machine other processes
//! stretch wall time, not the CPU the engine itself uses (what a sample costs the collector's
//! core). Run with `cargo bench -p rankwatch-collector --bench engine` (or `cargo xtask bench
//! engine`).

use std::hint::black_box;
use std::time::Duration;

use arrow_array::RecordBatch;
use criterion::measurement::Measurement;
use criterion::{BatchSize, BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use rankwatch_analytics::agent_mix::{AgentMix, replica_sketch};
use rankwatch_analytics::detect::DetectorsConfig;
use rankwatch_analytics::math::SketchKind;
use rankwatch_analytics::schema::samples;
use rankwatch_analytics::{RunId, Sample, SketchRecord};
use rankwatch_collector::alerting::watch::RunWatch;

#[path = "shared/thread_cpu.rs"]
mod thread_cpu;
use thread_cpu::ThreadCpu;

const MIX: &str = include_str!("../../bench/agent_mix.json");
/// Steps replayed per iteration: two periods of the schedule.
const STEPS: u64 = 200;
const SKETCH_DIM: usize = 1024;

/// One rank's report of one step: its samples (as rows and as the batch) and the sketch that
/// goes with it, if any.
struct Report {
    step: u64,
    samples: Vec<Sample>,
    batch: RecordBatch,
    sketch: Option<SketchRecord>,
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
            // Replicas' gradients agree to a cosine near 0.9: a shared direction and each
            // rank's own.
            let sketch = sketch.then(|| {
                replica_sketch(
                    run,
                    rank,
                    step,
                    time_ms(step),
                    SketchKind::Rademacher,
                    SKETCH_DIM,
                    0.3,
                )
            });
            out.push(Report {
                step,
                batch: samples::to_batch(&samples).expect("a valid batch"),
                samples,
                sketch,
            });
        }
    }
    (out, rows)
}

fn new_watch(run: &RunId) -> RunWatch {
    RunWatch::new(run.clone(), DetectorsConfig::default(), 30_000, 0).expect("default detectors")
}

/// What the engine does with one acknowledged batch: its sketch first (the agent sends it
/// before the step's samples), every row routed, the batch ended, the run ticked.
fn feed(watch: &mut RunWatch, report: &Report, batch: &RecordBatch, ranks: u32) {
    // The collector's clock: one second a step, as the ranks report.
    let now = report.step as i64 * 1000;
    if let Some(s) = &report.sketch {
        watch.sketch(s.clone(), now);
    }
    black_box(watch.samples(batch, now).expect("a valid batch"));
    black_box(watch.end_batch());
    black_box(watch.tick(Some(ranks), now, false, &Vec::new));
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
        group.throughput(Throughput::Elements(rows));
        // Every batch built before the run, as it always was: 200 steps of reports are tens of
        // megabytes at 64 ranks, so each batch is read cold from memory.
        group.bench_with_input(BenchmarkId::new("cold", ranks), &ranks, |b, &ranks| {
            b.iter_batched(
                || new_watch(&run),
                |mut watch| {
                    for report in &reports {
                        feed(&mut watch, report, &report.batch, ranks);
                    }
                    watch
                },
                BatchSize::PerIteration,
            );
        });
        // As ingest hands batches over: each step's batches built just before the engine
        // reads them (ingest has just decoded and validated each one), their building not timed.
        group.bench_with_input(
            BenchmarkId::new("handed-over", ranks),
            &ranks,
            |b, &ranks| {
                b.iter_custom(|iterations| {
                    let mut spent = Duration::ZERO;
                    for _ in 0..iterations {
                        let mut watch = new_watch(&run);
                        for one_step in reports.chunk_by(|a, b| a.step == b.step) {
                            let batches: Vec<RecordBatch> = one_step
                                .iter()
                                .map(|r| samples::to_batch(&r.samples).expect("a valid batch"))
                                .collect();
                            let started = ThreadCpu.start();
                            for (report, batch) in one_step.iter().zip(&batches) {
                                feed(&mut watch, report, batch, ranks);
                            }
                            spent += ThreadCpu.end(started);
                        }
                        black_box(watch);
                    }
                    spent
                });
            },
        );
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().with_measurement(ThreadCpu);
    targets = engine
}
criterion_main!(benches);
