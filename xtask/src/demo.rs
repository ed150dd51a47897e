//! `cargo xtask demo`: the README's main job — the collector with the dashboard and a real
//! multi-rank training job with scripted trouble (`xtask/demo.py`).

use super::*;

/// The main job: a collector with the dashboard and a real multi-rank training job with
/// scripted trouble (`xtask/demo.py` tells the story). Everything it needs is installed first.
pub(crate) fn demo(extra: &[String]) -> Result<()> {
    // `--attach` on x86-64 needs no debugger (the SDK's own ptrace); elsewhere it takes gdb.
    if extra.iter().any(|a| a == "--attach") && !cfg!(target_arch = "x86_64") {
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
pub(crate) fn collector_binary() -> Result<PathBuf> {
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
