//! rankwatch's task runner: `cargo xtask <task>`.
//!
//! `test` is the project's one test command (the README's and CI's): it checks formatting and
//! the collector's layers, then compiles and runs every Rust test in the workspace with clippy
//! linting the workspace's crates as they compile (warnings denied). Each step first makes
//! sure what it needs is installed (rustfmt and clippy components), so it works on a fresh
//! machine with only the pinned toolchain. After the Rust tests come the Python suites, which
//! use real outside readers and servers against the real `rankwatch` binary: pyarrow and
//! DuckDB reading the Parquet files, a real Prometheus scraping `/metrics`, and schemathesis
//! fuzzing the API from its OpenAPI document. Their tools are installed on demand: a
//! git-ignored virtual environment `.venv` (PyPI) and Debian's packages. They run in two lanes
//! (the SDK's suite, and everything else with the API docs), since much of each waits on a
//! process rather than computing. `bench` runs the benchmarks and prints their tables. `check`
//! holds the collector to its layers (see `layers.rs`). Every step is timed, and `test` ends
//! with the table of its stages (a side lane's stages are marked "(background)").

use std::env;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::sync::Mutex;
use std::time::Instant;

use anyhow::{Context, Result, bail};

mod dist;
mod generated;
mod layers;
mod precompress;

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
  bench [all|analytics|collector|sdk|ui|detection] [ingest|queries|memory]
           benchmarks, printed as tables: power iteration vs dense SVD (criterion), the
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
           on the same runs (bench/detection_collapse.py)
  gpu [--dry-run]
           the GPU suite, on a machine with CUDA (never part of `test`): a full step with
           every probe under sync-debug mode and under the CUDA sanitizer, bf16 spectral
           accuracy on 4096x14336 weights, the fused Triton sketch against its reference,
           per-probe overhead and memory on GPT-2-small and a bf16 ~1B model; --dry-run
           checks the script on CPU at toy sizes
  help     this text
";

fn main() -> ExitCode {
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
    let mut cmd = Command::new(env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
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

/// Test counts summed over runners.
#[derive(Debug, Default, Clone, Copy)]
struct Tally {
    passed: u64,
    failed: u64,
    skipped: u64,
}

impl Tally {
    /// Adds another runner's counts.
    fn merge(&mut self, other: Tally) {
        self.passed += other.passed;
        self.failed += other.failed;
        self.skipped += other.skipped;
    }

    /// Adds the counts of a pytest summary line (`==== 5 passed, 1 skipped in 3.2s ====`).
    fn add_pytest_line(&mut self, line: &str) {
        let line = line.trim().trim_matches('=').trim();
        if !line.contains(" in ") {
            return;
        }
        for part in line.split(',') {
            let mut words = part.split_whitespace();
            if let (Some(n), Some(what)) = (words.next(), words.next())
                && let Ok(n) = n.parse::<u64>()
            {
                match what {
                    "passed" => self.passed += n,
                    "failed" | "error" | "errors" => self.failed += n,
                    "skipped" | "xfailed" => self.skipped += n,
                    _ => {}
                }
            }
        }
    }

    /// Adds the counts of a cargo `test result: ok. 9 passed; 0 failed; 1 ignored; ...` line.
    fn add_cargo_line(&mut self, line: &str) {
        let Some(rest) = line.strip_prefix("test result: ") else {
            return;
        };
        for part in rest.split([';', '.']) {
            let mut words = part.split_whitespace();
            if let (Some(n), Some(what)) = (words.next(), words.next())
                && let Ok(n) = n.parse::<u64>()
            {
                match what {
                    "passed" => self.passed += n,
                    "failed" => self.failed += n,
                    "ignored" => self.skipped += n,
                    _ => {}
                }
            }
        }
    }
}

/// Runs `cmd`, echoing it, and fails with its exit status. With a tally, its stdout is passed
/// through line by line and cargo's test result lines are counted.
fn run_with(step: &str, cmd: Command, tally: Option<&mut Tally>) -> Result<()> {
    run_counting(step, cmd, tally, Tally::add_cargo_line)
}

fn run_counting(
    step: &str,
    mut cmd: Command,
    mut tally: Option<&mut Tally>,
    count: fn(&mut Tally, &str),
) -> Result<()> {
    // A step on a side lane runs beside the main line: its output is held and printed in one
    // block when it ends, so the two never interleave line by line.
    let side = on_side_lane();
    let mut held = String::new();
    let mut say = |line: &str| {
        if side {
            held.push_str(line);
            held.push('\n');
        } else {
            println!("{line}");
        }
    };
    say(&format!("\n==> {step}: {cmd:?}"));
    let started = Instant::now();
    if tally.is_some() || side {
        cmd.stdout(Stdio::piped());
    }
    let mut child = cmd
        .spawn()
        .with_context(|| format!("{step}: could not start {cmd:?}"))?;
    if let Some(stdout) = child.stdout.take() {
        // Lossy: a line that is not UTF-8 must not end the reading early, which would leave
        // the child running beside the next step.
        for line in BufReader::new(stdout).split(b'\n') {
            let Ok(bytes) = line else { break };
            let line = String::from_utf8_lossy(bytes.strip_suffix(b"\r").unwrap_or(&bytes));
            say(&line);
            if let Some(tally) = tally.as_deref_mut() {
                count(tally, &line);
            }
        }
    }
    let status = child.wait()?;
    let seconds = started.elapsed().as_secs_f64();
    record_stage(step, seconds, status.success());
    if status.success() {
        say(&format!("==> {step}: ok in {seconds:.1}s"));
    }
    if side {
        print!("{held}");
    }
    if !status.success() {
        bail!("{step} failed ({status})");
    }
    Ok(())
}

/// Every step this process ran: name, seconds, success.
static STAGES: Mutex<Vec<(String, f64, bool)>> = Mutex::new(Vec::new());

/// Background steps (run while the main line compiles) are marked, and left out of the sum.
const BACKGROUND: &str = "(background) ";

/// Whether this thread is a side lane (anything but the main thread): its steps run beside
/// the main line.
fn on_side_lane() -> bool {
    std::thread::current().name() != Some("main")
}

fn record_stage(step: &str, seconds: f64, ok: bool) {
    let name = if on_side_lane() {
        format!("{BACKGROUND}{step}")
    } else {
        step.to_owned()
    };
    if let Ok(mut stages) = STAGES.lock() {
        stages.push((name, seconds, ok));
    }
}

/// The stage table: where a run's time went.
fn print_stages(total: f64) {
    let Ok(stages) = STAGES.lock() else {
        return;
    };
    let width = stages
        .iter()
        .map(|(s, ..)| s.len())
        .max()
        .unwrap_or(5)
        .max(5);
    println!("\n{:<width$}  {:>8}  {:>6}", "stage", "seconds", "share");
    for (step, seconds, ok) in stages.iter() {
        let mark = if *ok { "" } else { "  FAILED" };
        println!(
            "{step:<width$}  {seconds:>8.1}  {:>5.1}%{mark}",
            100.0 * seconds / total.max(1e-9)
        );
    }
    let counted: f64 = stages
        .iter()
        .filter(|(step, ..)| !step.starts_with(BACKGROUND))
        .map(|(_, s, _)| s)
        .sum();
    println!(
        "{:<width$}  {:>8.1}  {:>5.1}%",
        "(between stages)",
        total - counted,
        100.0 * (total - counted) / total.max(1e-9)
    );
    println!("{:<width$}  {total:>8.1}", "total");
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

fn run(step: &str, cmd: Command) -> Result<()> {
    run_with(step, cmd, None)
}

fn test(extra: &[String]) -> Result<()> {
    let started = Instant::now();
    let outcome = test_stages(extra);
    print_stages(started.elapsed().as_secs_f64());
    outcome
}

fn test_stages(extra: &[String]) -> Result<()> {
    ensure_component("rustfmt", &["fmt", "--version"])?;
    ensure_component("clippy", &["clippy", "--version"])?;
    let mut fmt = cargo();
    fmt.args(["fmt", "--all", "--check"]);
    run("format", fmt)?;
    check_layers()?;
    // The Python suites' tools (Debian packages, the venv) mostly wait on the network and the
    // disk: they are installed while cargo compiles, and waited for after the Rust tests.
    let tools = std::thread::spawn(python_tools);
    // First: the collector the tests build embeds the dashboard.
    web()?;
    // Clippy lints the workspace's crates *during* the test build (clippy-driver as the
    // workspace's rustc wrapper, warnings denied), as the dashboard's build does: a separate
    // `cargo clippy --all-targets` compiled every dependency a second time, in check mode, for
    // 330 s of a fresh run. The API docs, which need that check build, are built later beside
    // the Python suites, whose processes leave a core idle much of the time.
    let mut tally = Tally::default();
    let mut tests = cargo();
    tests.args(RUST_TEST_ARGS).args(extra);
    with_clippy(&mut tests);
    let mut outcome = run_with(
        "rust tests (clippy -D warnings while compiling)",
        tests,
        Some(&mut tally),
    );
    let started = Instant::now();
    let tools = tools
        .join()
        .map_err(|_| anyhow::anyhow!("installing the Python tools panicked"))
        .and_then(|r| r);
    record_stage(
        "(waiting for the Python tools)",
        started.elapsed().as_secs_f64(),
        tools.is_ok(),
    );
    if outcome.is_ok() {
        outcome = tools.and_then(|python| python_suites(&python, &mut tally));
    }
    // The closing line CI reads: the totals over every suite.
    println!(
        "\ntotal: {} passed, {} failed, {} skipped",
        tally.passed, tally.failed, tally.skipped
    );
    outcome?;
    if tally.passed == 0 {
        bail!("no test ran");
    }
    Ok(())
}

/// Makes a cargo build lint the workspace's own crates with clippy as it compiles them,
/// warnings denied (what `cargo clippy -- -D warnings` passes); dependencies are compiled as
/// usual.
fn with_clippy(cmd: &mut Command) {
    cmd.env("RUSTC_WORKSPACE_WRAPPER", "clippy-driver").env(
        "CLIPPY_ARGS",
        "-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__",
    );
}

/// The API docs: an intra-doc link to something renamed or gone fails the run. In its own
/// target folder, so it never holds the lock of the main one (the demo's test runs `cargo
/// xtask demo`); nothing is lost, as rustdoc needs check builds of the dependencies, which no
/// other step makes.
fn rustdoc() -> Result<()> {
    let mut docs = cargo();
    docs.args([
        "doc",
        "--target-dir",
        "target/rustdoc",
        "--workspace",
        "--exclude",
        WEB_CRATE,
        "--exclude",
        "xtask",
        "--no-deps",
        "--locked",
    ])
    .env(
        "RUSTDOCFLAGS",
        "-D rustdoc::broken_intra_doc_links -D rustdoc::private_intra_doc_links",
    );
    run("rustdoc (broken links denied)", docs)
}

const WEB_CRATE: &str = "rankwatch-web";
/// The Rust test suite's cargo arguments.
const RUST_TEST_ARGS: [&str; 5] = ["test", "--workspace", "--exclude", WEB_CRATE, "--locked"];
const WASM_TARGET: &str = "wasm32-unknown-unknown";

/// The exact wasm-bindgen version in Cargo.lock: the CLI must match the library.
fn locked_wasm_bindgen() -> Result<String> {
    let lock = std::fs::read_to_string(root().join("Cargo.lock")).context("reading Cargo.lock")?;
    let mut lines = lock.lines();
    while let Some(line) = lines.next() {
        if line == "name = \"wasm-bindgen\""
            && let Some(version) = lines.next().and_then(|l| l.strip_prefix("version = "))
        {
            return Ok(version.trim_matches('"').to_owned());
        }
    }
    bail!("Cargo.lock has no wasm-bindgen package")
}

/// The wasm-bindgen CLI of the version in Cargo.lock, installed when missing or different.
fn ensure_wasm_bindgen_cli() -> Result<()> {
    let version = locked_wasm_bindgen()?;
    let have = Command::new("wasm-bindgen")
        .arg("--version")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default();
    if have != format!("wasm-bindgen {version}") {
        let mut cmd = cargo();
        cmd.args([
            "install",
            "--locked",
            "wasm-bindgen-cli",
            "--version",
            &version,
        ]);
        run(&format!("install wasm-bindgen-cli {version}"), cmd)?;
    }
    Ok(())
}

/// Builds the dashboard into `web/dist`: the wasm module (cargo, profile `web`), its JS glue
/// (`wasm-bindgen`), uPlot from npm, and the static files. What it needs is installed first:
/// the wasm32 target, the wasm-bindgen-cli of the locked version, the npm packages.
fn web() -> Result<()> {
    let installed = Command::new("rustup")
        .current_dir(root())
        .args(["target", "list", "--installed"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).contains(WASM_TARGET))
        .unwrap_or(false);
    if !installed {
        let mut cmd = Command::new("rustup");
        cmd.current_dir(root()).args(["target", "add", WASM_TARGET]);
        run("install the wasm32 target", cmd)?;
    }
    // The CLI compiles (minutes on a fresh machine) while the dashboard does: it is needed
    // only for the glue, after the build.
    let cli = std::thread::Builder::new()
        .name("wasm-bindgen-cli".into())
        .spawn(ensure_wasm_bindgen_cli)?;
    let web = root().join("web");
    if !web
        .join("node_modules/uplot/dist/uPlot.iife.min.js")
        .exists()
    {
        let mut npm = Command::new("npm");
        npm.current_dir(&web)
            .args(["ci", "--no-audit", "--no-fund"]);
        run("npm ci (web)", npm)?;
    }
    // Clippy lints the dashboard's crate during this build (`with_clippy`): a separate `cargo
    // clippy --target wasm32` would compile every dependency a second time, in check mode.
    ensure_component("clippy", &["clippy", "--version"])?;
    let mut build = cargo();
    build.args([
        "build",
        "--locked",
        "-p",
        WEB_CRATE,
        "--target",
        WASM_TARGET,
        "--profile",
        "web",
    ]);
    with_clippy(&mut build);
    let built = run("build and clippy the dashboard (wasm32)", build);
    cli.join()
        .map_err(|_| anyhow::anyhow!("installing wasm-bindgen-cli panicked"))??;
    built?;
    // Built into a fresh folder and swapped in, so a failed build never leaves half a
    // dashboard for the collector to embed.
    let staging = root().join("target/web-dist");
    let _ = std::fs::remove_dir_all(&staging);
    std::fs::create_dir_all(&staging)?;
    let module = root().join(format!("target/{WASM_TARGET}/web/rankwatch_web.wasm"));
    // wasm-bindgen's output differs from run to run on the same module (the order of its
    // generated shims), and a changed web/dist recompiles the collector that embeds it: its
    // whole output (the glue, the bindgen'd module, `snippets/`) is kept in target/web-glue and
    // made again only when the module changed. (Keeping only the two glue files lost the
    // snippets on a second run, and with them the dashboard.)
    let glue = root().join("target/web-glue");
    let glued = root().join("target/web-glue.input.wasm");
    let dist = web.join("dist");
    let module_bytes = std::fs::read(&module).context("reading the dashboard's wasm module")?;
    let same_module = std::fs::read(&glued).ok().as_deref() == Some(module_bytes.as_slice())
        && glue.join("rankwatch_web.js").exists();
    if !same_module {
        let _ = std::fs::remove_dir_all(&glue);
        let _ = std::fs::remove_file(&glued);
        let mut bindgen = Command::new("wasm-bindgen");
        bindgen
            .current_dir(root())
            .args(["--target", "web", "--no-typescript", "--out-dir"])
            .arg(&glue)
            .arg(&module);
        run("wasm-bindgen", bindgen)?;
        std::fs::write(&glued, &module_bytes)?;
    }
    copy_tree(&glue, &staging)?;
    let missing = missing_snippets(&staging)?;
    anyhow::ensure!(
        missing.is_empty(),
        "the dashboard's glue imports files its build lacks: {missing:?}"
    );
    for (from, to) in [
        ("static/index.html", "index.html"),
        ("static/style.css", "style.css"),
        (
            "node_modules/uplot/dist/uPlot.iife.min.js",
            "uPlot.iife.min.js",
        ),
        ("node_modules/uplot/dist/uPlot.min.css", "uPlot.min.css"),
    ] {
        std::fs::copy(web.join(from), staging.join(to))
            .with_context(|| format!("copying web/{from}"))?;
    }
    precompress::dashboard(&staging, &dist)?;
    if same_tree(&staging, &dist) {
        // Unchanged: leave the files (and their times) alone, so the collector is not rebuilt.
        return Ok(());
    }
    let _ = std::fs::remove_dir_all(&dist);
    copy_tree(&staging, &dist)?;
    println!("==> dashboard built into {}", dist.display());
    Ok(())
}

/// The `snippets/...` files that the glue (`rankwatch_web.js`) in `dist` imports but `dist`
/// lacks: a dashboard with any of them missing starts as a blank page.
fn missing_snippets(dist: &Path) -> Result<Vec<String>> {
    let js = std::fs::read_to_string(dist.join("rankwatch_web.js"))
        .context("reading the dashboard's glue")?;
    let mut missing = Vec::new();
    for (at, _) in js.match_indices("snippets/") {
        let path: String = js[at..]
            .chars()
            .take_while(|c| !matches!(c, '\'' | '"' | '`'))
            .collect();
        if !dist.join(&path).exists() && !missing.contains(&path) {
            missing.push(path);
        }
    }
    Ok(missing)
}

fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if let Ok(rel) = p.strip_prefix(dir) {
                out.push(rel.to_path_buf());
            }
        }
    }
    out.sort();
    out
}

fn same_tree(a: &Path, b: &Path) -> bool {
    let files = files_under(a);
    files == files_under(b)
        && files
            .iter()
            .all(|f| std::fs::read(a.join(f)).ok() == std::fs::read(b.join(f)).ok())
}

fn copy_tree(from: &Path, to: &Path) -> Result<()> {
    for rel in files_under(from) {
        let target = to.join(&rel);
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent)?;
        }
        std::fs::copy(from.join(&rel), &target)
            .with_context(|| format!("copying {}", rel.display()))?;
    }
    Ok(())
}

/// Requirement files of the Python suites, installed together into one `.venv`.
const REQUIREMENTS: [&str; 3] = [
    "collector/tests/python/requirements.txt",
    "sdk-python/tests/requirements.txt",
    "web/tests/requirements.txt",
];

/// The Python virtual environment with the test requirements, created or updated when the
/// requirements changed. Returns its interpreter.
fn ensure_venv() -> Result<PathBuf> {
    let venv = root().join(".venv");
    let python = venv.join("bin").join("python");
    let mut wanted = String::new();
    for file in REQUIREMENTS {
        let path = root().join(file);
        wanted.push_str(
            &std::fs::read_to_string(&path)
                .with_context(|| format!("reading {}", path.display()))?,
        );
    }
    let stamp = venv.join(".rankwatch-requirements");
    if python.exists() && std::fs::read_to_string(&stamp).ok().as_deref() == Some(&wanted) {
        return Ok(python);
    }
    if !python.exists() {
        let mut cmd = Command::new("python3");
        cmd.current_dir(root()).args(["-m", "venv"]).arg(&venv);
        run("create .venv", cmd)?;
    }
    pip_install(&python, &REQUIREMENTS, "install python test requirements")?;
    std::fs::write(&stamp, wanted)?;
    Ok(python)
}

/// `pip install -r` each of `files` (paths relative to the repository) into `python`'s env.
fn pip_install(python: &Path, files: &[&str], step: &str) -> Result<()> {
    let mut pip = Command::new(python);
    pip.current_dir(root()).args([
        "-m",
        "pip",
        "install",
        "--quiet",
        "--disable-pip-version-check",
        // torch's wheels are gigabytes; a cached second copy once filled CI's disk.
        "--no-cache-dir",
    ]);
    for file in files {
        pip.arg("-r").arg(file);
    }
    run(step, pip)
}

/// Builds the SDK's native module into the venv (`maturin develop`, editable install). Cargo
/// reuses the workspace's `target/`. With `lint`, clippy lints the workspace's crates as they
/// compile (warnings denied): `cargo test` never builds this one, a cdylib without tests.
fn ensure_native_module(python: &Path, release: bool, lint: bool) -> Result<()> {
    let mut cmd = maturin_in(&root().join(".venv"), lint);
    cmd.args(["develop", "--quiet"]);
    if release {
        cmd.arg("--release");
    }
    let step = if lint {
        "build rankwatch._native (maturin develop, clippy -D warnings)"
    } else {
        "build rankwatch._native (maturin develop)"
    };
    run(step, cmd)?;
    let mut check = Command::new(python);
    check.args(["-c", "import rankwatch._native"]);
    run("import rankwatch._native", check)
}

/// maturin of `venv`, run in `sdk-python/` as both `maturin develop` and `dist --debug`'s wheel
/// build run it: the same environment, so that cargo reuses one build for both. With `lint`,
/// clippy lints the workspace's crates as they compile (warnings denied).
fn maturin_in(venv: &Path, lint: bool) -> Command {
    let mut cmd = Command::new(venv.join("bin").join("maturin"));
    without_package_env(&mut cmd);
    cmd.current_dir(root().join("sdk-python"))
        .env("VIRTUAL_ENV", venv)
        .env(
            "PATH",
            format!(
                "{}:{}",
                venv.join("bin").display(),
                std::env::var("PATH").unwrap_or_default()
            ),
        );
    if env::var_os("CI").is_some() {
        cmd.env("CARGO_INCREMENTAL", "0");
    }
    if lint {
        with_clippy(&mut cmd);
    }
    cmd
}

/// Installs a Debian package when `binary` is missing.
fn ensure_debian(package: &str, binary: &str) -> Result<()> {
    if Path::new(binary).exists() {
        return Ok(());
    }
    let root_user = Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout.starts_with(b"0"));
    let apt = |args: &[&str]| {
        let mut cmd = if root_user {
            Command::new("apt-get")
        } else {
            let mut c = Command::new("sudo");
            c.arg("apt-get");
            c
        };
        cmd.args(args).env("DEBIAN_FRONTEND", "noninteractive");
        cmd
    };
    run("apt-get update", apt(&["update", "-qq"]))?;
    run(
        &format!("install {package}"),
        apt(&["install", "-y", "-qq", "--no-install-recommends", package]),
    )
}

/// What the Python suites need besides the build: Debian's Prometheus, Alertmanager, gdb and
/// Chromium, and the venv. Returns the venv's interpreter.
fn python_tools() -> Result<PathBuf> {
    ensure_debian("prometheus", "/usr/bin/prometheus")?;
    ensure_debian(
        "prometheus-alertmanager",
        "/usr/bin/prometheus-alertmanager",
    )?;
    // `rankwatch attach --pid` on Python < 3.14 goes through gdb (the SDK's attach tests and
    // `demo --attach`).
    ensure_debian("gdb", "/usr/bin/gdb")?;
    // The dashboard in a real browser: Debian's Chromium, driven by Playwright.
    ensure_debian("chromium", "/usr/bin/chromium")?;
    ensure_venv()
}

fn python_suites(python: &Path, tally: &mut Tally) -> Result<()> {
    // The deployment test trains a real run with the SDK.
    ensure_native_module(python, false, true)?;
    // `cargo test` has just built the binary for the collector's integration tests; a separate
    // `cargo build` would compile it again under another profile.
    let binary = root().join("target/debug/rankwatch");
    if !binary.exists() {
        bail!("{} is missing: the Rust tests build it", binary.display());
    }
    // The release artifacts' layout, from the test profile: the SDK suite installs the wheel
    // into a fresh venv without Rust and runs a job against the binary in it.
    let dist = dist::build(
        dist::Options {
            debug: true,
            collector_only: false,
        },
        Some(&binary),
    )?;
    // Two lanes, since much of each suite waits (on a flush, a timeout, a page, a paced job)
    // rather than computing: the SDK's suite, the longest, on this thread; the static checks,
    // the collector's suites, the browser tests, the demo, the SDK's attach tests and the API
    // docs on a side thread. The attach tests are mostly paced jobs waiting for a switch (two
    // minutes of sleeping); beside the SDK suite's CPU-bound detection runs they cost little,
    // and at its end they made the main lane the longer by that much.
    let side_python = python.to_path_buf();
    let side_binary = binary.clone();
    let side = std::thread::Builder::new()
        .name("checks, collector, browser, demo, attach and docs".into())
        .spawn(move || {
            let mut tally = Tally::default();
            let mut failures = Failures::default();
            failures.note(sdk_static_checks(&side_python));
            collector_browser_and_demo_suites(
                &side_python,
                &side_binary,
                &mut tally,
                &mut failures,
            );
            let mut attach = pytest(&side_python, &root().join("sdk-python"), SIDE_SDK_TESTS);
            attach.env("RANKWATCH_BIN", &side_binary);
            failures.note(run_counting(
                "python sdk suite: attach tests",
                attach,
                Some(&mut tally),
                Tally::add_pytest_line,
            ));
            failures.note(rustdoc());
            (failures.into_result(), tally)
        })?;
    let mut sdk = pytest(python, &root().join("sdk-python"), "tests");
    sdk.arg(format!("--ignore={SIDE_SDK_TESTS}"))
        .env("RANKWATCH_BIN", &binary)
        .env("RANKWATCH_DIST", &dist);
    let sdk_outcome = run_counting("python sdk suite", sdk, Some(tally), Tally::add_pytest_line);
    let (side_outcome, side_tally) = side
        .join()
        .map_err(|_| anyhow::anyhow!("the side lane of the Python suites panicked"))?;
    tally.merge(side_tally);
    let mut failures = Failures::default();
    failures.note(sdk_outcome);
    failures.note(side_outcome);
    failures.into_result()
}

/// The SDK tests that run on the side lane (relative to `sdk-python`), not in the main suite.
const SIDE_SDK_TESTS: &str = "tests/test_attach.py";

/// The SDK's typed boundary: ruff, then mypy --strict (both configured in its pyproject).
fn sdk_static_checks(python: &Path) -> Result<()> {
    let sdk_dir = root().join("sdk-python");
    let mut ruff = Command::new(python);
    ruff.current_dir(&sdk_dir)
        .args(["-m", "ruff", "check", "rankwatch"]);
    let mut failures = Failures::default();
    failures.note(run("ruff (sdk-python/rankwatch)", ruff));
    let mut mypy = Command::new(python);
    mypy.current_dir(&sdk_dir).args(["-m", "mypy", "rankwatch"]);
    failures.note(run("mypy --strict (sdk-python/rankwatch)", mypy));
    failures.into_result()
}

/// The collector's Python suites, the dashboard in a browser and the README's main job, one
/// after another, against `binary`; each runs whether or not the one before it passed.
fn collector_browser_and_demo_suites(
    python: &Path,
    binary: &Path,
    tally: &mut Tally,
    failures: &mut Failures,
) {
    let mut collector = pytest(python, &root(), "collector/tests/python");
    collector
        .env("RANKWATCH_BIN", binary)
        .env("PROMETHEUS_BIN", "/usr/bin/prometheus");
    failures.note(run_counting(
        "python suites",
        collector,
        Some(tally),
        Tally::add_pytest_line,
    ));
    let mut ui = pytest(python, &root().join("web/tests"), ".");
    ui.env("RANKWATCH_BIN", binary);
    failures.note(run_counting(
        "browser tests (dashboard)",
        ui,
        Some(tally),
        Tally::add_pytest_line,
    ));
    // The README's main job, as a user runs it, on the binary the Rust tests built.
    let mut demo = pytest(python, &root(), "xtask/tests");
    demo.env("RANKWATCH_BIN", binary);
    failures.note(run_counting(
        "demo test",
        demo,
        Some(tally),
        Tally::add_pytest_line,
    ));
}

/// Independent suites' outcomes, gathered so that one failing suite does not keep the ones
/// after it from running: a run then shows every suite that fails, not only the first.
#[derive(Default)]
struct Failures(Vec<anyhow::Error>);

impl Failures {
    fn note(&mut self, outcome: Result<()>) {
        if let Err(e) = outcome {
            self.0.push(e);
        }
    }

    /// Ok when nothing failed, else one error naming every failure.
    fn into_result(self) -> Result<()> {
        if self.0.is_empty() {
            return Ok(());
        }
        let each: Vec<String> = self.0.iter().map(|e| format!("{e:#}")).collect();
        Err(anyhow::anyhow!("{}", each.join("; ")))
    }
}

/// `python -m pytest -q TARGET` in `dir`, offline for Hugging Face.
fn pytest(python: &Path, dir: &Path, target: &str) -> Command {
    let mut cmd = Command::new(python);
    cmd.current_dir(dir)
        // The slowest tests are printed, so a suite that grows slow shows where.
        .args([
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-q",
            "--durations=15",
            target,
        ])
        .env("HF_HUB_OFFLINE", "1");
    cmd
}

/// The main job: a collector with the dashboard and a real multi-rank training job with
/// scripted trouble (`xtask/demo.py` tells the story). Everything it needs is installed first.
fn demo(extra: &[String]) -> Result<()> {
    if extra.iter().any(|a| a == "--attach") {
        ensure_debian("gdb", "/usr/bin/gdb")?;
    }
    // pip mostly waits on the network and the disk: it fills the venv while cargo compiles.
    let venv = std::thread::spawn(ensure_venv);
    let built = web().and_then(|()| collector_binary());
    let python = venv
        .join()
        .map_err(|_| anyhow::anyhow!("creating the venv panicked"))??;
    let binary = built?;
    ensure_native_module(&python, false, false)?;
    let mut story = Command::new(&python);
    story
        .current_dir(root())
        .arg(root().join("xtask/demo.py"))
        .arg("--bin")
        .arg(binary)
        .args(extra);
    // Replace this process: the terminal's Ctrl-C then reaches only the demo script, which
    // stops the training job and the collector in order.
    use std::os::unix::process::CommandExt;
    Err(anyhow::Error::new(story.exec()).context("starting xtask/demo.py"))
}

/// The collector binary the demo runs: `RANKWATCH_BIN` when set (`cargo xtask test` passes the
/// one its Rust tests built), else `rankwatch` alone, built in the test profile so that it lands
/// where the tests' build puts it and reuses the dependencies a test run compiled (the
/// workspace's dependency table keeps one package's features equal to the whole workspace's).
fn collector_binary() -> Result<PathBuf> {
    if let Some(bin) = env::var_os("RANKWATCH_BIN").filter(|b| !b.is_empty()) {
        let bin = PathBuf::from(bin);
        if !bin.exists() {
            bail!("RANKWATCH_BIN={} does not exist", bin.display());
        }
        return Ok(bin);
    }
    let mut build = cargo();
    build.args([
        "build",
        "--locked",
        "--profile",
        "test",
        "-p",
        "rankwatch-collector",
        "--bin",
        "rankwatch",
    ]);
    run("build rankwatch (the collector)", build)?;
    Ok(root().join("target/debug/rankwatch"))
}

/// `target/release/rankwatch`, for the benchmarks.
fn build_release_collector() -> Result<()> {
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
fn openapi() -> Result<()> {
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
fn gpu(extra: &[String]) -> Result<()> {
    let python = ensure_venv()?;
    ensure_native_module(&python, true, false)?;
    let mut cmd = Command::new(python);
    cmd.current_dir(root())
        .arg("bench/gpu_suite.py")
        .args(extra);
    run("gpu suite", cmd)
}

fn bench(extra: &[String]) -> Result<()> {
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
    if matches!(which, "all" | "collector") {
        ensure_debian("victoria-metrics", "/usr/bin/victoria-metrics")?;
        let python = ensure_venv()?;
        pip_install(
            &python,
            &["bench/collector-requirements.txt"],
            "install the benchmark's encoders",
        )?;
        build_release_collector()?;
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
        // `--suite faults` (the fault-size sweep with its curves) and `--suite collapse` (lead
        // time on natural collapses) are scripts of their own.
        let mut args: Vec<&String> = extra.iter().skip(1).collect();
        let own_script = args
            .windows(2)
            .position(|w| w[0] == "--suite" && matches!(w[1].as_str(), "faults" | "collapse"));
        let script = match own_script {
            Some(at) => {
                let suite = args[at + 1].clone();
                args.drain(at..at + 2);
                if suite == "faults" {
                    "bench/detection_sweep.py"
                } else {
                    "bench/detection_collapse.py"
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
        "all" | "analytics" | "collector" | "sdk" | "ui" | "detection"
    ) {
        bail!("unknown benchmark {which:?}: all, analytics, collector, sdk, ui or detection");
    }
    Ok(())
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
