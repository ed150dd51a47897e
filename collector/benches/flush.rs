//! What a flush spends a sample on for the agent's default report (issue 47's "the flush sorts
//! and builds rollups"), side by side in one run: sorting the hot rows into a part, summarising
//! the part into rollups at every level (as before decision 0114) and from each metric's first
//! dense level (as now), writing each rollup part and the samples part to Parquet. The sort is measured from one
//! batch and from the 10,000-row batches a hot buffer holds after `ingest-floor`'s requests.
//!
//! The report is `bench/agent_mix.json` (see the engine bench) replayed for 64 ranks over 400
//! steps, four periods of the schedule, as one part: what a flush of a 64-rank job every 400
//! steps holds. Time is the bench thread's CPU time (`shared/thread_cpu.rs`); throughput is in
//! samples. Run with `cargo bench -p rankwatch-collector --bench flush` (or `cargo xtask bench
//! flush`).

use std::hint::black_box;
use std::time::Duration;

use arrow_array::RecordBatch;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use rankwatch_analytics::RunId;
use rankwatch_analytics::agent_mix::AgentMix;
use rankwatch_analytics::schema::samples;
use rankwatch_collector::disk::RealDisk;
use rankwatch_collector::entry::Table;
use rankwatch_collector::store::{files, rollup};

#[path = "shared/thread_cpu.rs"]
mod thread_cpu;
use thread_cpu::ThreadCpu;

const MIX: &str = include_str!("../../bench/agent_mix.json");
const RANKS: u32 = 64;
const STEPS: u64 = 400;

/// The part's rows as they arrive: step by step, each rank's report in turn.
fn arrived() -> RecordBatch {
    let mix = AgentMix::parse(MIX).expect("bench/agent_mix.json");
    let run = RunId::new("bench").expect("a valid run id");
    let mut rows = Vec::new();
    for step in 0..STEPS {
        for rank in 0..RANKS {
            let time_ms = 1_700_000_000_000 + step as i64 * 1000;
            rows.extend(mix.samples(&run, rank, step, RANKS, time_ms).0);
        }
    }
    files::without_run(&samples::to_batch(&rows).expect("a valid batch")).expect("file schema")
}

fn flush(c: &mut Criterion<ThreadCpu>) {
    let hot = arrived();
    let sorted = files::sorted(Table::Samples, std::slice::from_ref(&hot)).expect("sorted");
    let dir = tempfile::tempdir().expect("a temporary directory");
    let mut group = c.benchmark_group("flush, agent's default report, 64 ranks x 400 steps");
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(10))
        .throughput(Throughput::Elements(hot.num_rows() as u64));
    group.bench_function("sort the part", |b| {
        b.iter(|| files::sorted(Table::Samples, black_box(std::slice::from_ref(&hot))))
    });
    // As the hot buffer holds them: one batch per request (`ingest-floor` posts 10,000 rows).
    let requests: Vec<RecordBatch> = (0..hot.num_rows())
        .step_by(10_000)
        .map(|from| hot.slice(from, 10_000.min(hot.num_rows() - from)))
        .collect();
    group.bench_function("sort the part from 10k-row requests", |b| {
        b.iter(|| files::sorted(Table::Samples, black_box(&requests)))
    });
    let samples_path = dir.path().join("samples.parquet");
    let layout = files::Layout::of(Table::Samples);
    let bytes = files::write(
        &RealDisk,
        layout,
        std::slice::from_ref(&sorted),
        &samples_path,
    )
    .expect("a samples part");
    println!("samples part: {bytes} bytes");
    group.bench_function("write the samples part (Parquet, fsync)", |b| {
        b.iter(|| {
            files::write(
                &RealDisk,
                layout,
                black_box(std::slice::from_ref(&sorted)),
                &samples_path,
            )
        })
    });
    for (name, min_rows) in [
        ("every level (before 0114)", 0),
        ("first dense level", rollup::MIN_ROWS_PER_WINDOW),
    ] {
        let summary = rollup::summarise_with(&sorted, min_rows)
            .expect("summarised")
            .expect("long series");
        let rows: usize = summary.batches.iter().map(RecordBatch::num_rows).sum();
        println!(
            "rollup, {name}: {rows} rows, {:.3} a sample",
            rows as f64 / sorted.num_rows() as f64
        );
        group.bench_function(format!("summarise, {name}"), |b| {
            b.iter(|| rollup::summarise_with(black_box(&sorted), min_rows))
        });
        let path = dir.path().join(format!("rollup-{min_rows}.parquet"));
        let bytes = files::write(&RealDisk, rollup::LAYOUT, &summary.batches, &path)
            .expect("a rollup part");
        println!("rollup part, {name}: {bytes} bytes");
        group.bench_function(format!("write the rollup part, {name}"), |b| {
            b.iter(|| {
                files::write(
                    &RealDisk,
                    rollup::LAYOUT,
                    black_box(&summary.batches),
                    &path,
                )
            })
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().with_measurement(ThreadCpu);
    targets = flush
}
criterion_main!(benches);
