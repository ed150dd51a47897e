//! `cargo xtask test`: formatting, the layer check, the Rust build with clippy, then the
//! suites in two lanes (the SDK's and the demo's; and the Rust tests, the collector's, the
//! browser's and the SDK's side files), with the API docs at the lowest priority beside it all.

use super::*;

pub(crate) fn test(extra: &[String]) -> Result<()> {
    let outcome = test_stages(extra);
    print_stages();
    print_failures();
    outcome
}

pub(crate) fn test_stages(extra: &[String]) -> Result<()> {
    ensure_component("rustfmt", &["fmt", "--version"])?;
    ensure_component("clippy", &["clippy", "--version"])?;
    let mut fmt = cargo();
    fmt.args(["fmt", "--all", "--check"]);
    run("format", fmt)?;
    check_layers()?;
    // The Python suites' tools (Debian packages, the venv) mostly wait on the network and the
    // disk: they are installed while cargo compiles, and waited for after the Rust build.
    let tools = std::thread::spawn(python_tools);
    // The API docs need check builds of every dependency, which no other step makes (several
    // minutes of CPU on a fresh machine). At the lowest priority from the start they take
    // what the other steps leave idle (a fresh run left a quarter of its core-seconds idle),
    // instead of running last, alone.
    let docs = std::thread::Builder::new()
        .name("api docs".into())
        .spawn(rustdoc)?;
    // Last run's per-test reports would pass for this one's where a suite does not run.
    let _ = std::fs::remove_dir_all(root().join("target/test-reports"));
    let mut tally = Tally::default();
    let (cargo_args, test_args) = rust_tests::split_extra(extra);
    // First the dashboard: the collector the tests build embeds it.
    let built = web().and_then(|()| rust_tests::build(&cargo_args));
    // The tools are waited for even when the build failed: left running, an apt-get or pip
    // would outlive this process and hold the dpkg lock or the venv against the next run.
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
    // After the tools, as the Rust tests need Debian's Alertmanager (its tests skip without
    // it); the pip install beside the build ends well before the build does.
    let outcome = built.and_then(|binaries| suites(tools, binaries, test_args, &mut tally));
    let docs = docs
        .join()
        .map_err(|_| anyhow::anyhow!("building the API docs panicked"))
        .and_then(|r| r);
    // The closing line CI reads: the totals over every suite.
    println!(
        "\ntotal: {} passed, {} failed, {} skipped",
        tally.passed, tally.failed, tally.skipped
    );
    let mut failures = Failures::default();
    failures.note(outcome);
    failures.note(docs);
    failures.into_result()?;
    if tally.passed == 0 {
        bail!("no test ran");
    }
    Ok(())
}

/// Makes a cargo build lint the workspace's own crates with clippy as it compiles them,
/// warnings denied (what `cargo clippy -- -D warnings` passes); dependencies are compiled as
/// usual.
pub(crate) fn with_clippy(cmd: &mut Command) {
    cmd.env("RUSTC_WORKSPACE_WRAPPER", "clippy-driver").env(
        "CLIPPY_ARGS",
        "-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__",
    );
}

/// The API docs: an intra-doc link to something renamed or gone fails the run. In its own
/// target folder, so it never holds the lock of the main one (the native module and the demo
/// build there while it runs); nothing is lost, as rustdoc needs check builds of the
/// dependencies, which no other step makes. At the lowest CPU priority (`nice -n 19`).
pub(crate) fn rustdoc() -> Result<()> {
    let mut docs = cargo_at_lowest_priority();
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

/// What the Python suites run against: the venv's interpreter, the debug collector the Rust
/// build made, and the release artifacts' layout built from it.
struct PythonSetup {
    python: PathBuf,
    binary: PathBuf,
    dist: PathBuf,
}

/// Everything after the Rust build, in two lanes, since much of each suite waits (on a flush,
/// a timeout, a page, a paced job) rather than computing. The main lane builds the native
/// module and the release layout, then runs the SDK's suite, the longest, and the demo. The
/// side lane runs the Rust test executables meanwhile (no cargo lock held, see `rust_tests`),
/// then, once the main lane has built what they use, the static checks, the collector's
/// suites, the browser tests and the SDK's side files (the attach tests, mostly paced jobs
/// waiting for a switch, and enough besides to even the lanes). Each suite runs whether or not
/// the one before it passed.
fn suites(
    tools: Result<PathBuf>,
    binaries: Vec<rust_tests::TestBinary>,
    test_args: Vec<String>,
    tally: &mut Tally,
) -> Result<()> {
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<PythonSetup>();
    let side = std::thread::Builder::new()
        .name("rust tests, checks, collector, browser, sdk side files".into())
        .spawn(move || {
            let mut tally = Tally::default();
            let mut failures = Failures::default();
            failures.note(rust_tests::run(&binaries, &test_args, &mut tally));
            // Nothing comes when the main lane could not build what the Python suites use
            // (its error is reported there): the sender is dropped.
            if let Ok(setup) = ready_rx.recv() {
                failures.note(sdk_static_checks(&setup.python));
                collector_and_browser_suites(
                    &setup.python,
                    &setup.binary,
                    &mut tally,
                    &mut failures,
                );
                let mut side_sdk =
                    pytest(&setup.python, &root().join("sdk-python"), SIDE_SDK_TESTS[0]);
                side_sdk
                    .args(&SIDE_SDK_TESTS[1..])
                    .env("RANKWATCH_BIN", &setup.binary)
                    .env("RANKWATCH_DIST", &setup.dist);
                failures.note(run_counting(
                    "python sdk suite: side files (attach, wheel, compiled activations)",
                    side_sdk,
                    Some(&mut tally),
                    Tally::add_pytest_line,
                ));
            }
            (failures.into_result(), tally)
        })?;
    let setup = tools.and_then(python_setup);
    let mut failures = Failures::default();
    match setup {
        Ok(setup) => {
            let mut sdk = pytest(&setup.python, &root().join("sdk-python"), "tests");
            for file in SIDE_SDK_TESTS {
                sdk.arg(format!("--ignore={file}"));
            }
            sdk.env("RANKWATCH_BIN", &setup.binary)
                .env("RANKWATCH_DIST", &setup.dist);
            let (python, binary) = (setup.python.clone(), setup.binary.clone());
            let _ = ready_tx.send(setup);
            failures.note(run_counting(
                "python sdk suite",
                sdk,
                Some(tally),
                Tally::add_pytest_line,
            ));
            // The demo on this lane, after the suite: with it on the side lane, a warm run's
            // side lane ended at 997 s and this one at 783 s.
            failures.note(demo_suite(&python, &binary, tally));
        }
        Err(e) => {
            // Now, not at the end of this function: the side lane waits on it, and is joined
            // below.
            drop(ready_tx);
            failures.note(Err(e));
        }
    }
    match side.join() {
        Ok((side_outcome, side_tally)) => {
            tally.merge(side_tally);
            failures.note(side_outcome);
        }
        Err(_) => failures.note(Err(anyhow::anyhow!(
            "the side lane of the suites panicked (its tests' counts are lost)"
        ))),
    }
    failures.into_result()
}

/// The native module (`maturin develop`) and the release layout from the test profile's
/// collector, which the Python suites use.
fn python_setup(python: PathBuf) -> Result<PythonSetup> {
    // The deployment test trains a real run with the SDK.
    ensure_native_module(&python, false, true)?;
    // The Rust build has just made the binary for the collector's integration tests; a
    // separate `cargo build` would compile it again under another profile.
    let binary = root().join("target/debug/rankwatch");
    if !binary.exists() {
        bail!("{} is missing: the Rust tests build it", binary.display());
    }
    // The SDK suite installs the wheel into a fresh venv without Rust and runs a job against
    // the binary in it.
    let dist = dist::build(
        dist::Options {
            debug: true,
            collector_only: false,
        },
        Some(&binary),
    )?;
    Ok(PythonSetup {
        python,
        binary,
        dist,
    })
}

/// The SDK tests that run on the side lane (relative to `sdk-python`), not in the main suite:
/// the attach tests (mostly waiting), and two files that even the lanes' lengths.
pub(crate) const SIDE_SDK_TESTS: [&str; 3] = [
    "tests/test_attach.py",
    "tests/test_wheel.py",
    "tests/test_compiled_activations.py",
];

/// The SDK's typed boundary: ruff, then mypy --strict (both configured in its pyproject); then
/// mypy over what surrounds the package (its tests, the testkit, the examples and `bench/`),
/// strict less torch's typing noise (sdk-python/mypy-tests.toml).
pub(crate) fn sdk_static_checks(python: &Path) -> Result<()> {
    let sdk_dir = root().join("sdk-python");
    let mut ruff = Command::new(python);
    ruff.current_dir(&sdk_dir)
        .args(["-m", "ruff", "check", "rankwatch"]);
    let mut failures = Failures::default();
    failures.note(run("ruff (sdk-python/rankwatch)", ruff));
    let mut mypy = Command::new(python);
    mypy.current_dir(&sdk_dir).args(["-m", "mypy", "rankwatch"]);
    failures.note(run("mypy --strict (sdk-python/rankwatch)", mypy));
    let mut mypy_around = Command::new(python);
    mypy_around.current_dir(&sdk_dir).args([
        "-m",
        "mypy",
        "--config-file",
        "mypy-tests.toml",
        "tests",
        "testkit",
        "examples",
        "../bench",
    ]);
    failures.note(run("mypy (tests, testkit, examples, bench)", mypy_around));
    failures.into_result()
}

/// The collector's Python suites and the dashboard in a browser, one after the other, against
/// `binary`; each runs whether or not the one before it passed.
pub(crate) fn collector_and_browser_suites(
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
}

/// The README's main job, as a user runs it, on the binary the Rust tests built.
pub(crate) fn demo_suite(python: &Path, binary: &Path, tally: &mut Tally) -> Result<()> {
    let mut demo = pytest(python, &root(), "xtask/tests");
    demo.env("RANKWATCH_BIN", binary);
    run_counting("demo test", demo, Some(tally), Tally::add_pytest_line)
}

/// `python -m pytest -q TARGET` in `dir`, offline for Hugging Face. Every test's time and CPU
/// go to a JUnit report in `target/test-reports/` (named after `dir` and `target`), for
/// finding where a suite's time goes beyond the slowest printed.
pub(crate) fn pytest(python: &Path, dir: &Path, target: &str) -> Command {
    let reports = root().join("target/test-reports");
    let _ = std::fs::create_dir_all(&reports);
    let label = dir
        .strip_prefix(root())
        .unwrap_or(dir)
        .join(target)
        .to_string_lossy()
        .replace(['/', '.'], "_");
    let mut cmd = Command::new(python);
    cmd.current_dir(dir)
        // The slowest tests are printed, so a suite that grows slow shows where.
        .args([
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-q",
            "--durations=25",
            // Each test's CPU, its own and its children's, into the report and a summary:
            // on two busy cores CPU, not wall time, is what a test costs the run.
            "-p",
            "rankwatch_testkit.cpu_times",
        ])
        .arg(format!(
            "--junitxml={}",
            reports
                .join(format!("{}.xml", label.trim_matches('_')))
                .display()
        ))
        .arg(target)
        .env("HF_HUB_OFFLINE", "1")
        // One torch thread a process: the two lanes already fill both cores, and torch's
        // OpenMP threads spin while the other lane holds a core. Two in-process MiniLM
        // spectral tests beside a busy core took 70 s and 87 CPU-seconds with two threads,
        // 39 s and 38 CPU-seconds with one (docs/performance.md). The tests' training ranks
        // set it themselves; the test kit forks ranks from a launcher left single-threaded.
        .env("OMP_NUM_THREADS", "1");
    cmd
}
