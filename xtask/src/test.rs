//! `cargo xtask test`: formatting, the layer check, the Rust suite with clippy, the API docs,
//! then the Python suites in two lanes (the SDK's, and the collector's, the browser's and the
//! demo's).

use super::*;

pub(crate) fn test(extra: &[String]) -> Result<()> {
    let started = Instant::now();
    let outcome = test_stages(extra);
    print_stages(started.elapsed().as_secs_f64());
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
pub(crate) fn with_clippy(cmd: &mut Command) {
    cmd.env("RUSTC_WORKSPACE_WRAPPER", "clippy-driver").env(
        "CLIPPY_ARGS",
        "-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__",
    );
}

/// The API docs: an intra-doc link to something renamed or gone fails the run. In its own
/// target folder, so it never holds the lock of the main one (the demo's test runs `cargo
/// xtask demo`); nothing is lost, as rustdoc needs check builds of the dependencies, which no
/// other step makes.
pub(crate) fn rustdoc() -> Result<()> {
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

pub(crate) fn python_suites(python: &Path, tally: &mut Tally) -> Result<()> {
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
pub(crate) const SIDE_SDK_TESTS: &str = "tests/test_attach.py";

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

/// The collector's Python suites, the dashboard in a browser and the README's main job, one
/// after another, against `binary`; each runs whether or not the one before it passed.
pub(crate) fn collector_browser_and_demo_suites(
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

/// `python -m pytest -q TARGET` in `dir`, offline for Hugging Face.
pub(crate) fn pytest(python: &Path, dir: &Path, target: &str) -> Command {
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
            target,
        ])
        .env("HF_HUB_OFFLINE", "1");
    cmd
}
