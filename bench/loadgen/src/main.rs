//! `rankwatch-loadgen`: the operator's load generator (issue 47). Simulates `--ranks` ranks of
//! one training job, each posting the agent's default per-step report once a step, through
//! `--connections` keep-alive connections, for `--seconds`; the bodies, idempotency keys and
//! headers are the agent's own (`rankwatch_agent::wire`). It prints, and writes as JSON, the
//! ack latency (p50/p99/max, overall and by minute), the answers by status, requests with no
//! answer, and its own lag behind the schedule. The collector's CPU and memory are measured
//! by whoever started it (`bench/collector_bench.py operator`).

mod conn;
mod mix;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Parser;
use rankwatch_agent::Table;
use rankwatch_agent::wire;
use rankwatch_analytics::{ModelLayout, RunId, RunInfo};
use serde_json::json;

use crate::conn::{Plan, Tally};

#[derive(Parser)]
#[command(about = "Simulated ranks posting the agent's default report to a collector")]
struct Args {
    /// The collector's base URL (http only).
    #[arg(long)]
    collector: String,
    /// Ranks of the simulated job (its world size).
    #[arg(long, default_value_t = 16_384)]
    ranks: u32,
    /// Connections the ranks share (at most one per rank).
    #[arg(long, default_value_t = 4_096)]
    connections: u32,
    /// How long to post.
    #[arg(long, default_value_t = 600)]
    seconds: u64,
    /// One step every this many milliseconds.
    #[arg(long, default_value_t = 1_000)]
    step_ms: u64,
    /// The captured report (bench/agent_mix.json).
    #[arg(long, default_value = "bench/agent_mix.json")]
    mix: PathBuf,
    /// The run's name.
    #[arg(long, default_value = "operator")]
    run: String,
    /// Length of the gradient sketch (the SDK's default).
    #[arg(long, default_value_t = 1_024)]
    sketch_dim: usize,
    /// Threads of the generator's runtime.
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Where to write the summary as JSON.
    #[arg(long)]
    out: Option<PathBuf>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.connections == 0 || args.connections > args.ranks {
        bail!(
            "--connections must be between 1 and --ranks ({})",
            args.ranks
        );
    }
    if args.seconds == 0 || args.step_ms == 0 {
        bail!("--seconds and --step-ms must be positive");
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.threads.max(1))
        .enable_all()
        .build()?;
    runtime.block_on(run(args))
}

async fn run(args: Args) -> anyhow::Result<()> {
    let host = args
        .collector
        .strip_prefix("http://")
        .context("--collector must be an http:// URL")?
        .trim_end_matches('/')
        .to_owned();
    let addr = tokio::net::lookup_host(&host)
        .await
        .with_context(|| format!("resolving {host}"))?
        .next()
        .with_context(|| format!("{host} resolves to nothing"))?;
    let mix = mix::load(&args.mix)?;
    let run = RunId::new(&args.run)?;
    announce(addr, &host, &run, args.ranks).await?;
    let steps = args.seconds * 1000 / args.step_ms;
    let plan = Arc::new(Plan {
        run,
        ranks: args.ranks,
        connections: args.connections,
        steps,
        step: Duration::from_millis(args.step_ms),
        addr,
        host,
        sketch_dim: args.sketch_dim,
        // A second for every connection to be set up first.
        start: Instant::now() + Duration::from_secs(1),
        answered: AtomicU64::new(0),
        failed: AtomicU64::new(0),
        mix,
    });
    println!(
        "{} ranks, {} connections, {} steps of {} ms, {:.2} rows a rank a step",
        args.ranks,
        args.connections,
        steps,
        args.step_ms,
        plan.mix.rows_per_rank_step()
    );
    let progress = tokio::spawn(progress(plan.clone()));
    let tasks: Vec<_> = (0..args.connections)
        .map(|c| tokio::spawn(conn::drive(c, plan.clone())))
        .collect();
    let mut tally = Tally::default();
    for task in tasks {
        tally.merge(task.await?);
    }
    progress.abort();
    let elapsed = plan.start.elapsed().as_secs_f64();
    let summary = summarize(&args, &tally, elapsed, steps);
    println!("{}", serde_json::to_string_pretty(&summary)?);
    if let Some(out) = &args.out {
        std::fs::write(out, serde_json::to_vec_pretty(&summary)?)
            .with_context(|| format!("writing {}", out.display()))?;
    }
    Ok(())
}

/// The run's metadata, with its world size, as the agent of rank 0 sends it first.
async fn announce(
    addr: std::net::SocketAddr,
    host: &str,
    run: &RunId,
    ranks: u32,
) -> anyhow::Result<()> {
    let info = RunInfo {
        run: run.clone(),
        world_size: ranks,
        started_at_ms: rankwatch_agent::now_ms(),
        layout: ModelLayout::default(),
        tags: Default::default(),
    };
    let body = wire::runs_body(&info)?;
    let key = wire::idempotency_key(run, 0, &format!("loadgen-{}-runs", std::process::id()), 1);
    match conn::Client::new(addr)
        .post(host, Table::Runs, &key, body)
        .await
    {
        Some(status) if (200..300).contains(&status) => Ok(()),
        Some(status) => bail!("the collector refused the run's metadata ({status})"),
        None => bail!("no answer from the collector at {addr}"),
    }
}

/// A line every ten seconds: answers a second since the last line, and failures.
async fn progress(plan: Arc<Plan>) {
    let mut last = (0u64, Instant::now());
    loop {
        tokio::time::sleep(Duration::from_secs(10)).await;
        let answered = plan.answered.load(Relaxed);
        let rate = (answered - last.0) as f64 / last.1.elapsed().as_secs_f64();
        println!(
            "t={:>5.0} s  {:>8.0} answers/s  {} without an answer",
            plan.start.elapsed().as_secs_f64(),
            rate,
            plan.failed.load(Relaxed)
        );
        last = (answered, Instant::now());
    }
}

/// This process's CPU time so far (user + system, from /proc; Linux's clock ticks are USER_HZ,
/// 100 a second, whatever the kernel's own rate); NaN where there is no /proc.
fn own_cpu_seconds() -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return f64::NAN;
    };
    // Fields after the command name, which may hold spaces but ends at the last ')'.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map_or(vec![], |(_, rest)| rest.split_whitespace().collect());
    let ticks = |i: usize| fields.get(i).and_then(|f| f.parse::<f64>().ok());
    match (ticks(11), ticks(12)) {
        (Some(user), Some(system)) => (user + system) / 100.0,
        _ => f64::NAN,
    }
}

/// `q`-quantile of sorted `v`, in milliseconds.
fn quantile_ms(v: &[u32], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let i = ((q * v.len() as f64) as usize).min(v.len() - 1);
    f64::from(v[i]) / 1000.0
}

fn summarize(args: &Args, tally: &Tally, elapsed: f64, steps: u64) -> serde_json::Value {
    let mut all: Vec<u32> = tally.latency_us.iter().flatten().copied().collect();
    all.sort_unstable();
    let minutes: Vec<_> = tally
        .latency_us
        .iter()
        .enumerate()
        .map(|(minute, v)| {
            let mut v = v.clone();
            v.sort_unstable();
            json!({
                "minute": minute,
                "answers": v.len(),
                "p50_ms": quantile_ms(&v, 0.5),
                "p99_ms": quantile_ms(&v, 0.99),
                "max_ms": quantile_ms(&v, 1.0),
            })
        })
        .collect();
    let answered: u64 = tally.statuses.values().sum();
    let ok: u64 = tally
        .statuses
        .iter()
        .filter(|(s, _)| (200..300).contains(*s))
        .map(|(_, n)| n)
        .sum();
    json!({
        "ranks": args.ranks,
        "connections": args.connections,
        "steps": steps,
        "step_ms": args.step_ms,
        "seconds": elapsed,
        "requests": answered + tally.failed,
        "answered": answered,
        "ok": ok,
        "refused": answered - ok,
        "statuses": tally.statuses.iter().map(|(s, n)| (s.to_string(), json!(n))).collect::<serde_json::Map<_, _>>(),
        "without_answer": tally.failed,
        "rows": tally.rows,
        "sketches": tally.sketches,
        "body_bytes": tally.body_bytes,
        "rows_per_second": tally.rows as f64 / elapsed,
        "requests_per_second": (answered + tally.failed) as f64 / elapsed,
        "p50_ms": quantile_ms(&all, 0.5),
        "p99_ms": quantile_ms(&all, 0.99),
        "p999_ms": quantile_ms(&all, 0.999),
        "max_ms": quantile_ms(&all, 1.0),
        "generator_cpu_seconds": own_cpu_seconds(),
        "late_steps": tally.late_steps,
        "max_lag_ms": tally.max_lag.as_secs_f64() * 1000.0,
        "by_minute": minutes,
    })
}
