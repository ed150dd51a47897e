//! `cargo xtask bench|gpu|openapi`: the benchmarks' tables, the GPU suite, and the OpenAPI
//! document rewritten from the types.

use super::*;

/// `target/release/rankwatch`, for the benchmarks.
pub(crate) fn build_release_collector() -> Result<()> {
    let mut build = cargo();
    build.args([
        "build",
        "--release",
        "--locked",
        "-p",
        "rankwatch-collector",
        "--bin",
        "rankwatch",
    ]);
    run("build rankwatch (release)", build)
}

/// Rewrites `collector/openapi.json`'s schemas from the types: the collector's own test of the
/// document, in its writing mode (the test knows the document's layout and the metric
/// vocabulary; xtask stays free of the workspace's crates).
pub(crate) fn openapi() -> Result<()> {
    let mut cmd = cargo();
    cmd.args([
        "test",
        "-p",
        "rankwatch-collector",
        "--test",
        "it",
        "openapi::the_checked_in_document",
    ])
    .env("RANKWATCH_WRITE_OPENAPI", "1");
    run("write collector/openapi.json", cmd)
}

/// The GPU suite (`bench/gpu_suite.py`): needs CUDA, so it is never part of `test`.
pub(crate) fn gpu(extra: &[String]) -> Result<()> {
    let python = ensure_venv()?;
    ensure_native_module(&python, true, false)?;
    let mut cmd = Command::new(python);
    cmd.current_dir(root())
        .arg("bench/gpu_suite.py")
        .args(extra);
    run("gpu suite", cmd)
}

pub(crate) fn bench(extra: &[String]) -> Result<()> {
    let which = extra.first().map(String::as_str).unwrap_or("all");
    if matches!(which, "all" | "analytics") {
        let mut cmd = cargo();
        cmd.args([
            "bench",
            "-p",
            "rankwatch-analytics",
            "--features",
            "bench-svd",
            "--bench",
            "power_vs_svd",
        ]);
        run("bench power_vs_svd", cmd)?;
    }
    if matches!(which, "all" | "engine") {
        // The alert engine alone, on the agent's default report (bench/agent_mix.json).
        let mut cmd = cargo();
        cmd.args(["bench", "-p", "rankwatch-collector", "--bench", "engine"]);
        run("bench engine", cmd)?;
    }
    if matches!(which, "all" | "flush") {
        // The flush's sort, rollups and rollup writes, on the same report (decision 0114's
        // side-by-side: every level against each metric's first dense level).
        let mut cmd = cargo();
        cmd.args(["bench", "-p", "rankwatch-collector", "--bench", "flush"]);
        run("bench flush", cmd)?;
    }
    if matches!(which, "all" | "collector") {
        ensure_debian("victoria-metrics", "/usr/bin/victoria-metrics")?;
        // ingest-fsync and ingest-floor make the collector's fsyncs no-ops with it.
        ensure_debian("eatmydata", "/usr/lib/x86_64-linux-gnu/libeatmydata.so")?;
        let python = ensure_venv()?;
        pip_install(
            &python,
            &["bench/collector-requirements.txt"],
            "install the benchmark's encoders",
        )?;
        build_release_collector()?;
        if extra.get(1).is_some_and(|b| b == "operator") {
            // The operator's figure posts through the agent's own encoder (bench/loadgen).
            let mut build = cargo();
            build.args(["build", "--release", "--locked", "-p", "rankwatch-loadgen"]);
            run("build rankwatch-loadgen (release)", build)?;
        }
        let mut cmd = Command::new(python);
        cmd.current_dir(root())
            .arg("bench/collector_bench.py")
            .args(extra.iter().skip(1))
            .env("RANKWATCH_BIN", root().join("target/release/rankwatch"));
        run("bench collector", cmd)?;
    }
    if matches!(which, "all" | "sdk") {
        let python = ensure_venv()?;
        pip_install(
            &python,
            &["bench/sdk-requirements.txt"],
            "install the comparison loggers",
        )?;
        ensure_native_module(&python, true, false)?;
        let mut cmd = Command::new(&python);
        cmd.current_dir(root())
            .arg("bench/sdk_bench.py")
            .args(extra.iter().skip(1));
        run("bench sdk", cmd)?;
        let mut cmd = Command::new(python);
        cmd.current_dir(root())
            .arg("bench/probe_costs.py")
            .args(["--model", "gpt2-100m"]);
        run("bench sdk: per-probe cost", cmd)?;
    }
    if matches!(which, "all" | "ui") {
        ensure_debian("chromium", "/usr/bin/chromium")?;
        let python = ensure_venv()?;
        web()?;
        build_release_collector()?;
        let mut cmd = Command::new(python);
        cmd.current_dir(root())
            .arg("bench/ui_bench.py")
            .env("RANKWATCH_BIN", root().join("target/release/rankwatch"));
        run("bench ui", cmd)?;
    }
    // Not part of `all`: two hours on a 2-core machine. It is run on its own and its table
    // recorded in docs/detection.md.
    if which == "detection" {
        let python = ensure_venv()?;
        ensure_native_module(&python, true, false)?;
        build_release_collector()?;
        // `--suite faults` (the fault-size sweep with its curves), `--suite collapse` (lead
        // time on natural collapses), `--suite flips` (replica fingerprints against random
        // bit flips), `--suite sizes` (which fault sizes a user must be told of) and `--suite
        // heldout` (the frozen rules on runs no rule was tuned on) are scripts of their own.
        let mut args: Vec<&String> = extra.iter().skip(1).collect();
        let own_script = args.windows(2).position(|w| {
            w[0] == "--suite"
                && matches!(
                    w[1].as_str(),
                    "faults" | "collapse" | "flips" | "sizes" | "heldout"
                )
        });
        let script = match own_script {
            Some(at) => {
                let suite = args[at + 1].clone();
                args.drain(at..at + 2);
                match suite.as_str() {
                    "faults" => "bench/detection_sweep.py",
                    "flips" => "bench/replica_flips.py",
                    "sizes" => "bench/fault_sizes.py",
                    "heldout" => "bench/detection_heldout.py",
                    _ => "bench/detection_collapse.py",
                }
            }
            None => "bench/detection_bench.py",
        };
        let mut cmd = Command::new(python);
        cmd.current_dir(root())
            .arg(script)
            .args(args)
            .env("RANKWATCH_BIN", root().join("target/release/rankwatch"));
        run("bench detection", cmd)?;
    }
    if !matches!(
        which,
        "all" | "analytics" | "engine" | "flush" | "collector" | "sdk" | "ui" | "detection"
    ) {
        bail!(
            "unknown benchmark {which:?}: all, analytics, engine, flush, collector, sdk, ui or detection"
        );
    }
    Ok(())
}
