//! rankwatch's task runner: `cargo xtask <task>`.
//!
//! `test` is the project's one test command (the README's and CI's): it checks formatting and
//! the collector's layers, then compiles and runs every Rust test in the workspace with clippy
//! linting the workspace's crates as they compile (warnings denied). Each step first makes
//! sure what it needs is installed (rustfmt and clippy components), so it works on a fresh
//! machine with only the pinned toolchain. After the Rust build come the Python suites, which
//! use real outside readers and servers against the real `rankwatch` binary: pyarrow and
//! DuckDB reading the Parquet files, a real Prometheus scraping `/metrics`, and schemathesis
//! fuzzing the API from its OpenAPI document. Their tools are installed on demand: a
//! git-ignored virtual environment `.venv` (PyPI) and Debian's packages. They run in two lanes
//! (the SDK's suite; and the Rust test executables, then everything else), since much of each
//! waits on a process rather than computing; the API docs build at the lowest CPU priority
//! beside it all. `bench` runs the benchmarks and prints their tables. `check`
//! holds the collector to its layers (see `layers.rs`). Every step is timed, and `test` ends
//! with the table of its stages (a side lane's stages are marked "(background)").

use std::env;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::sync::Mutex;
use std::time::Instant;

use anyhow::{Context, Result, bail};

mod bench;
mod demo;
mod dist;
mod failure_lines;
mod generated;
mod layers;
mod precompress;
mod python_env;
mod rust_tests;
mod steps;
mod test;
mod web;

use bench::*;
use demo::*;
use failure_lines::*;
use python_env::*;
use steps::*;
use test::*;
use web::*;
const USAGE: &str = "\
usage: cargo xtask <task>

tasks:
  demo [--steps N] [--ranks N] [--no-faults] [--port P] [--exit]
           the main job: collector + dashboard on 127.0.0.1:7070 and a real DDP training
           job on CPU with scripted trouble; prints each incident as it opens (Ctrl-C stops)
  test     formatting, the layer check, clippy (-D warnings), the API docs (broken links
           denied), every test of the workspace with the browser tests of the dashboard, and
           ruff + mypy --strict on the Python SDK; ends with a table of its stages' times
  check    the collector's modules import only from lower layers (xtask/src/layers.rs),
           and git tracks no generated file (egg-info, __pycache__, target, web/dist)
  openapi  rewrites the component schemas of collector/openapi.json from the contract's
           types (rankwatch-api); `test` fails while the file differs from them
  dist [--debug] [--collector]
           the release artifacts in target/dist: the SDK's abi3 manylinux wheel (no Rust
           needed to install it) and sdist, the collector binary with the dashboard embedded
           (archive and bin/rankwatch, what the Docker image copies), SHA256SUMS, BUILD.txt;
           --debug: the same from the test profile (for the tests), --collector: only the
           collector (the Docker build)
  web      builds the dashboard (web/dist) that the collector embeds: wasm32 target,
           wasm-bindgen-cli and npm packages are installed on demand
  bench [all|analytics|engine|flush|collector|sdk|ui|detection] [ingest|queries|memory|ingest-floor|...]
           benchmarks, printed as tables: power iteration vs dense SVD (criterion), the
           alert engine's CPU per sample on the agent's default report (criterion), the
           flush's sort, rollups and rollup writes on that report (criterion), the
           collector's ingest, query and memory targets beside VictoriaMetrics and DuckDB,
           the SDK's log() cost beside other loggers and each probe's step overhead and peak
           memory on a ~100M-parameter model, and the dashboard's load and zoom times on a
           100,000-step x 64-layer x 8-rank run; `detection` (not in all: hours on
           2 cores): the default rules' false alerts per 1,000 steps over 32 healthy
           real-text runs, with confidence intervals (bench/detection_bench.py; its
           options follow, e.g. --steps 300 --only tiny-k2); `detection --suite faults`:
           the fault-size sweep, judged under threshold grids by `rankwatch replay`,
           beside simple baselines, with ROC and delay plots (bench/detection_sweep.py);
           `detection --suite collapse`: alert lead time on natural collapses (LR ramp,
           MLP-only LR, deep post-LN without warm-up) with healthy twins; with
           --thresholds, rank_collapse's and activation_outlier's threshold grids replayed
           on the same runs (bench/detection_collapse.py); `detection --suite flips`:
           random single-bit flips in one replica's weights (DDP float32 and bf16, HSDP),
           each to be named with its rank and tensor at the next fingerprint
           (bench/replica_flips.py); `detection --suite sizes`: every fault kind of the
           held-out sweep at several sizes on the tuning harness, and the smallest size
           to tell a user of under the policy fixed in docs/detection.md
           (bench/fault_sizes.py); `detection --suite heldout [--set tuning|heldout|heldout1|…|heldout5]`:
           the frozen rules on runs no rule was tuned on, beside a gradient-norm threshold
           and a Minder-style baseline, in parts (bench/detection_heldout.py)
  gpu [--dry-run]
           the GPU suite, on a machine with CUDA (never part of `test`): a full step with
           every probe under sync-debug mode and under the CUDA sanitizer, bf16 spectral
           accuracy on 4096x14336 weights, the fused Triton sketch against its reference,
           per-probe overhead and memory on GPT-2-small and a bf16 ~1B model; --dry-run
           checks the script on CPU at toy sizes
  help     this text
";

fn main() -> ExitCode {
    std::sync::LazyLock::force(&RUN_STARTED);
    let args: Vec<String> = env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("demo") => demo(&args[1..]),
        Some("test") => test(&args[1..]),
        Some("bench") => bench(&args[1..]),
        Some("web") => web(),
        Some("gpu") => gpu(&args[1..]),
        Some("check") => check_layers(),
        Some("openapi") => openapi(),
        Some("dist") => {
            dist::Options::parse(&args[1..]).and_then(|o| dist::build(o, None).map(|_| ()))
        }
        Some("help" | "-h" | "--help") | None => {
            print!("{USAGE}");
            Ok(())
        }
        Some(other) => Err(anyhow::anyhow!("unknown task {other:?}\n\n{USAGE}")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_path_buf()
}

fn cargo() -> Command {
    cargo_command(Command::new(cargo_program()))
}

/// `cargo` at the lowest CPU priority (`nice -n 19`, inherited by every compiler it starts):
/// for work that should take only what the other steps leave idle. Plain `cargo` where
/// `nice` is missing.
fn cargo_at_lowest_priority() -> Command {
    let nice = Command::new("nice")
        .args(["-n", "19", "true"])
        .status()
        .is_ok_and(|s| s.success());
    if !nice {
        return cargo();
    }
    let mut cmd = Command::new("nice");
    cmd.args(["-n", "19"]).arg(cargo_program());
    cargo_command(cmd)
}

fn cargo_program() -> String {
    env::var("CARGO").unwrap_or_else(|_| "cargo".into())
}

/// The environment every cargo command of xtask gets.
fn cargo_command(mut cmd: Command) -> Command {
    cmd.current_dir(root());
    without_package_env(&mut cmd);
    if env::var_os("CI").is_some() {
        // A clean clone is built once: incremental state would only cost disk and time.
        cmd.env("CARGO_INCREMENTAL", "0");
    }
    cmd
}

/// Removes the package variables `cargo run -p xtask` gave this process from a command that
/// builds: build scripts that read one of them through `rerun-if-env-changed` (ring's reads
/// CARGO_MANIFEST_DIR and CARGO_PKG_*) would see a change against a build run from the shell,
/// and ring's rebuild cascades through rustls and object_store into all of DataFusion. Without
/// them, `cargo test` by hand, `cargo xtask test|demo` and maturin share one build.
fn without_package_env(cmd: &mut Command) {
    for (key, _) in env::vars_os() {
        if let Some(key) = key.to_str()
            && (key.starts_with("CARGO_PKG_")
                || matches!(
                    key,
                    "CARGO_MANIFEST_DIR"
                        | "CARGO_MANIFEST_PATH"
                        | "CARGO_MANIFEST_LINKS"
                        | "CARGO_CRATE_NAME"
                        | "CARGO_BIN_NAME"
                        | "CARGO_PRIMARY_PACKAGE"
                ))
        {
            cmd.env_remove(key);
        }
    }
}

/// Makes sure a rustup component is installed for the pinned toolchain.
fn ensure_component(component: &str, probe: &[&str]) -> Result<()> {
    let present = cargo()
        .args(probe)
        .output()
        .is_ok_and(|o| o.status.success());
    if present {
        return Ok(());
    }
    let mut cmd = Command::new("rustup");
    cmd.current_dir(root())
        .args(["component", "add", component]);
    run(&format!("install {component}"), cmd)
}

/// `cargo xtask check`: the collector's import layers, and no generated file in git.
fn check_layers() -> Result<()> {
    if let Some(found) = generated::tracked(&root())
        && !found.is_empty()
    {
        for path in &found {
            eprintln!("tracked but generated: {path}");
        }
        bail!(
            "{} generated file(s) are tracked by git: `git rm -r --cached` them (.gitignore \
             keeps them out)",
            found.len()
        );
    }
    let src = root().join("collector/src");
    let started = Instant::now();
    let violations = layers::check(&src, layers::COLLECTOR_LAYERS)
        .with_context(|| format!("reading {}", src.display()))?;
    record_stage(
        "layer check",
        started.elapsed().as_secs_f64(),
        violations.is_empty(),
    );
    if violations.is_empty() {
        println!("==> layer check: collector/src imports only from lower layers");
        return Ok(());
    }
    for v in &violations {
        eprintln!("collector/src/{v}");
    }
    bail!(
        "{} import(s) break the collector's layers (the table is in xtask/src/layers.rs)",
        violations.len()
    )
}

#[cfg(test)]
mod tests {
    use super::missing_snippets;

    #[test]
    fn a_snippet_the_glue_imports_but_the_build_lacks_is_named() {
        let dist = tempfile::tempdir().unwrap();
        let snippet = "snippets/rankwatch-web-0123/js/charts.js";
        std::fs::write(
            dist.path().join("rankwatch_web.js"),
            format!("import {{ draw }} from './{snippet}';\nimport * as x from \"./{snippet}\";\n"),
        )
        .unwrap();
        assert_eq!(missing_snippets(dist.path()).unwrap(), [snippet]);
        let path = dist.path().join(snippet);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, "export function draw() {}").unwrap();
        assert!(missing_snippets(dist.path()).unwrap().is_empty());
    }
}
