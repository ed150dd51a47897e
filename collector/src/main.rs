//! The `rankwatch` binary.

use anyhow::Context;
use clap::Parser;
use rankwatch_collector::{Cli, Command};
use tracing_subscriber::EnvFilter;

/// `rankwatch run|sync|doctor ...` and `rankwatch attach|detach --pid ...` are the Python SDK's
/// (they start or inject Python code, or check the job's Python): handed to `python -m
/// rankwatch` with the same arguments. The SDK's own `rankwatch` hands this binary's commands
/// back, so either may come first on PATH.
fn python_command(args: &[String]) -> bool {
    match args.get(1).map(String::as_str) {
        Some("run" | "sync" | "doctor") => true,
        Some("attach" | "detach") => args.iter().any(|a| a == "--pid" || a.starts_with("--pid=")),
        _ => false,
    }
}

/// `python -m rankwatch`, except that a Python without the SDK says so by name (and how to
/// pick another) instead of `No module named rankwatch`.
const PYTHON_SIDE: &str = "\
import sys
try:
    from rankwatch.cli import main
except ModuleNotFoundError as e:
    if e.name not in ('rankwatch', 'rankwatch.cli'):
        raise
    sys.exit(f'rankwatch {sys.argv[1]} runs in Python, and {sys.executable} has no rankwatch package '
             '(pip install rankwatch there, or set RANKWATCH_PYTHON to the Python that has it)')
sys.exit(main(sys.argv[1:]))
";

fn exec_python(args: &[String]) -> anyhow::Result<()> {
    let python = std::env::var("RANKWATCH_PYTHON").unwrap_or_else(|_| "python3".to_owned());
    let status = std::process::Command::new(&python)
        .args(["-c", PYTHON_SIDE])
        .args(&args[1..])
        .status()
        .with_context(|| {
            format!("starting {python} -m rankwatch (set RANKWATCH_PYTHON to the Python that has the rankwatch SDK)")
        })?;
    std::process::exit(status.code().unwrap_or(1));
}

/// Bounds glibc's malloc in the collector daemon, by starting the binary again with `MALLOC_ARENA_MAX=2` and
/// `MALLOC_MMAP_THRESHOLD_=1048576` in its environment (`exec`: same process id, nothing else
/// changes) unless the environment already sets either. By default glibc gives each thread its
/// own arena (up to 8 per core) and raises its mmap threshold as large blocks are freed, so the
/// pages of the hot buffer's many small batches and of each flush's sort stayed with the
/// process: under 1,024 ranks × 200 metrics the collector's RSS grew past 1.6 GB in four
/// minutes and kept growing. With the two settings it stayed at 140-300 MiB at the same ingest
/// latency (docs/performance.md § Collector memory). Setting them with `mallopt` from `main`
/// measured worse (700 MiB peaks) and would need `unsafe`; mimalloc peaked at 760 MiB.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn bound_malloc() {
    use std::os::unix::process::CommandExt;
    if std::env::var_os("MALLOC_ARENA_MAX").is_some()
        || std::env::var_os("MALLOC_MMAP_THRESHOLD_").is_some()
    {
        return;
    }
    let Ok(exe) = std::env::current_exe() else {
        return;
    };
    let args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    // Returns only if the exec failed; the collector then runs with glibc's defaults.
    let error = std::process::Command::new(exe)
        .args(args)
        .env("MALLOC_ARENA_MAX", "2")
        .env("MALLOC_MMAP_THRESHOLD_", "1048576")
        .exec();
    eprintln!(
        "rankwatch: could not restart with bounded malloc arenas ({error}); going on without"
    );
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn bound_malloc() {}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if python_command(&args) {
        return exec_python(&args);
    }
    let cli = Cli::parse();
    if matches!(cli.command, Command::Serve(_)) {
        // Only the daemon: the environment must not reach a training job started by `run`.
        bound_malloc();
    }
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_env("RANKWATCH_LOG").unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("rankwatch")
        .build()
        .context("starting the async runtime")?;
    match cli.command {
        Command::Tokens { dir, shared } => {
            let made = rankwatch_collector::tokens::create(&dir, shared)?;
            print!("{}", rankwatch_collector::tokens::report(&dir, &made));
            Ok(())
        }
        Command::Rules { rules } => {
            let config = match rules {
                Some(path) => rankwatch_collector::alerting::rules::load_file(&path)?,
                None => Default::default(),
            };
            print!(
                "{}",
                rankwatch_collector::alerting::rules::to_toml(&config)?
            );
            Ok(())
        }
        Command::Runs { remote, action } => {
            rankwatch_collector::client::runs(&remote, &action, &mut std::io::stdout().lock())?;
            Ok(())
        }
        Command::Attach(args) => switch(&args, true),
        Command::Detach(args) => switch(&args, false),
        Command::Run { .. } | Command::Sync { .. } | Command::Doctor { .. } => {
            anyhow::bail!("this command is handed to python before parsing")
        }
        Command::Replay(args) => replay(&args),
        Command::Export(args) => {
            let path = rankwatch_collector::client::export(&args)?;
            if path != std::path::Path::new("-") {
                eprintln!("wrote {}", path.display());
            }
            Ok(())
        }
        Command::Serve(config) => runtime
            .block_on(async {
                // Handlers first: a SIGTERM that came once the collector said it was listening,
                // but before anything polled a lazily registered handler, killed it unflushed.
                let shutdown = shutdown_signal();
                rankwatch_collector::serve(*config, shutdown).await
            })
            .context("rankwatch serve"),
    }
}

fn switch(args: &rankwatch_collector::config::SwitchArgs, on: bool) -> anyhow::Result<()> {
    rankwatch_collector::client::switch_probes(
        &args.remote,
        &args.run,
        on,
        &mut std::io::stdout().lock(),
    )?;
    Ok(())
}

/// Registers for SIGINT and SIGTERM at once (inside the runtime) and resolves on either.
fn shutdown_signal() -> impl std::future::Future<Output = ()> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let interrupt = signal(SignalKind::interrupt());
        let term = signal(SignalKind::terminate());
        async move {
            match (interrupt, term) {
                (Ok(mut interrupt), Ok(mut term)) => {
                    tokio::select! {
                        _ = interrupt.recv() => {}
                        _ = term.recv() => {}
                    }
                }
                (interrupt, term) => {
                    let e = interrupt.err().or(term.err());
                    tracing::warn!(error = ?e, "cannot listen for SIGINT and SIGTERM; falling back to Ctrl-C");
                    let _ = tokio::signal::ctrl_c().await;
                }
            }
        }
    }
    #[cfg(not(unix))]
    {
        let interrupt = tokio::signal::ctrl_c();
        async move {
            let _ = interrupt.await;
        }
    }
}

/// `rankwatch replay`: one JSON line `{"rules", "alerts", "incidents"}` per rules file.
fn replay(args: &rankwatch_collector::config::ReplayArgs) -> anyhow::Result<()> {
    use rankwatch_collector::alerting::{replay::StoredRun, replay::read_parquet, rules};
    use std::io::Write;
    let samples = read_parquet(&args.samples)?;
    let sketches = match &args.sketches {
        Some(path) => read_parquet(path)?,
        None => Vec::new(),
    };
    let run = StoredRun::new(&samples, &sketches, args.world_size)?;
    let configs = if args.rules.is_empty() {
        vec![("defaults".to_owned(), Default::default())]
    } else {
        args.rules
            .iter()
            .map(|p| Ok((p.display().to_string(), rules::load_file(p)?)))
            .collect::<anyhow::Result<Vec<_>>>()?
    };
    let mut out = std::io::stdout().lock();
    for (name, config) in configs {
        let alerts = run.replay(config, args.align_timeout.as_millis() as i64)?;
        // Grouped as the live collector groups them, so a replay can be judged by incident.
        let incidents = rankwatch_analytics::incident::group(
            alerts.iter().cloned(),
            |_| Some(run.world_size),
            rankwatch_analytics::incident::DEFAULT_WINDOW_STEPS,
        );
        let alerts: Vec<rankwatch_api::Alert> = alerts.iter().map(Into::into).collect();
        serde_json::to_writer(
            &mut out,
            &serde_json::json!({ "rules": name, "run": run.run.as_str(), "world_size": run.world_size, "alerts": alerts, "incidents": incidents }),
        )?;
        writeln!(out)?;
    }
    Ok(())
}
