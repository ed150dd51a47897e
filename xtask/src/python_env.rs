//! The Python side's tools: the git-ignored `.venv` with the suites' requirements, the SDK's
//! native module (maturin), and Debian's packages (Prometheus, Alertmanager, Chromium; gdb off x86-64).

use super::*;

/// Requirement files of the Python suites, installed together into one `.venv`.
pub(crate) const REQUIREMENTS: [&str; 3] = [
    "collector/tests/python/requirements.txt",
    "sdk-python/tests/requirements.txt",
    "web/tests/requirements.txt",
];

/// The Python virtual environment with the test requirements, created or updated when the
/// requirements changed. Returns its interpreter.
pub(crate) fn ensure_venv() -> Result<PathBuf> {
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
pub(crate) fn pip_install(python: &Path, files: &[&str], step: &str) -> Result<()> {
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
pub(crate) fn ensure_native_module(python: &Path, release: bool, lint: bool) -> Result<()> {
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
pub(crate) fn maturin_in(venv: &Path, lint: bool) -> Command {
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
pub(crate) fn ensure_debian(package: &str, binary: &str) -> Result<()> {
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

/// What the Python suites need besides the build: Debian's Prometheus, Alertmanager and
/// Chromium (and gdb off x86-64), and the venv. Returns the venv's interpreter.
pub(crate) fn python_tools() -> Result<PathBuf> {
    ensure_debian("prometheus", "/usr/bin/prometheus")?;
    ensure_debian(
        "prometheus-alertmanager",
        "/usr/bin/prometheus-alertmanager",
    )?;
    // `rankwatch attach --pid` on Python < 3.14 goes through the SDK's own ptrace on x86-64
    // and through gdb elsewhere (the SDK's attach tests and `demo --attach`).
    if !cfg!(target_arch = "x86_64") {
        ensure_debian("gdb", "/usr/bin/gdb")?;
    }
    // The dashboard in a real browser: Debian's Chromium, driven by Playwright.
    ensure_debian("chromium", "/usr/bin/chromium")?;
    ensure_venv()
}
