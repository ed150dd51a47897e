//! The `rankwatch` binary.

use anyhow::Context;
use clap::Parser;
use rankwatch_collector::{Cli, Command};
use tracing_subscriber::EnvFilter;

fn main() -> anyhow::Result<()> {
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
