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

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if python_command(&args) {
        return exec_python(&args);
    }
    let cli = Cli::parse();
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
        Command::Export(args) => {
            let path = rankwatch_collector::client::export(&args)?;
            if path != std::path::Path::new("-") {
                eprintln!("wrote {}", path.display());
            }
            Ok(())
        }
        Command::Serve(config) => runtime
            .block_on(rankwatch_collector::serve(*config, shutdown_signal()))
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

/// Resolves on SIGINT or SIGTERM.
async fn shutdown_signal() {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = match tokio::signal::unix::signal(
            tokio::signal::unix::SignalKind::terminate(),
        ) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGTERM; only SIGINT stops the collector");
                let _ = interrupt.await;
                return;
            }
        };
        tokio::select! {
            _ = interrupt => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = interrupt.await;
    }
}
