//! `cargo xtask dist`: the release artifacts, in `target/dist/`.
//!
//! - `rankwatch-<version>-cp310-abi3-manylinux2014_{x86_64,aarch64}.*.whl`: the Python SDK with
//!   the agent compiled in (abi3: one wheel for CPython 3.10 and later), installable with no
//!   Rust toolchain; linked by zig (PyPI's `ziglang`) against glibc 2.17's symbols, and cross-
//!   compiled for aarch64 the same way;
//! - `rankwatch-<version>.tar.gz`: its sdist (builds the agent from source, so needs cargo);
//! - `rankwatch-<version>-<target>.tar.gz`: the collector binary with the dashboard embedded,
//!   and `bin/rankwatch`, the same binary unpacked (what the Docker image copies);
//! - `SHA256SUMS` over the three (`sha256sum -c SHA256SUMS`), and `BUILD.txt`: version,
//!   profile, commit, toolchain.
//!
//! One version for everything: the workspace's (`Cargo.toml`), which maturin also gives the
//! wheel. The collector is built for this machine (`BUILD.txt` names the newest glibc it
//! needs). `--debug` makes the artifacts from the test profile with the host's linker, one
//! wheel, reusing what `cargo xtask test` compiled (a release build of the collector takes
//! minutes on a small machine): the wheel-install test uses them; they are not for release. `--collector` builds only the collector's binary and archive (the Docker
//! build's step, which has no Python).

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::{build_release_collector, collector_binary, maturin_in, root, run, web};

/// What `cargo xtask dist` builds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Options {
    /// The test profile instead of release (for the tests, never for a release).
    pub(crate) debug: bool,
    /// Only the collector (no wheel, no sdist).
    pub(crate) collector_only: bool,
}

impl Options {
    pub(crate) fn parse(args: &[String]) -> Result<Options> {
        let mut options = Options {
            debug: false,
            collector_only: false,
        };
        for arg in args {
            match arg.as_str() {
                "--debug" => options.debug = true,
                "--collector" => options.collector_only = true,
                other => bail!("unknown option {other:?} of dist (--debug, --collector)"),
            }
        }
        Ok(options)
    }
}

/// `target/dist`.
pub(crate) fn dir() -> PathBuf {
    root().join("target/dist")
}

/// The workspace's version, `[workspace.package] version` of the root `Cargo.toml`.
pub(crate) fn workspace_version() -> Result<String> {
    let manifest = fs::read_to_string(root().join("Cargo.toml"))?;
    let mut in_package = false;
    for line in manifest.lines() {
        let line = line.trim();
        if line.starts_with('[') {
            in_package = line == "[workspace.package]";
        } else if in_package && let Some(value) = line.strip_prefix("version") {
            let value = value.trim_start().trim_start_matches('=').trim();
            return Ok(value.trim_matches('"').to_owned());
        }
    }
    bail!("no [workspace.package] version in Cargo.toml")
}

fn host_target() -> Result<String> {
    let out = Command::new("rustc").arg("-vV").output()?;
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("host: ").map(str::to_owned))
        .context("rustc -vV names no host target")
}

/// Builds the artifacts; returns the directory. `collector`: a collector binary already built
/// (`cargo xtask test` passes the one its Rust tests built) instead of building one.
pub(crate) fn build(options: Options, collector: Option<&Path>) -> Result<PathBuf> {
    let version = workspace_version()?;
    let target = host_target()?;
    let out = dir();
    if out.exists() {
        fs::remove_dir_all(&out).with_context(|| format!("clearing {}", out.display()))?;
    }
    fs::create_dir_all(out.join("bin"))?;
    let mut artifacts = Vec::new();

    web()?;
    let binary = if let Some(prebuilt) = collector {
        prebuilt.to_path_buf()
    } else if options.debug {
        collector_binary()?
    } else {
        build_release_collector()?;
        root().join("target/release/rankwatch")
    };
    fs::copy(&binary, out.join("bin/rankwatch"))
        .with_context(|| format!("copying {}", binary.display()))?;
    artifacts.push(collector_archive(&binary, &version, &target, &out)?);

    if !options.collector_only {
        let venv = maturin_venv()?;
        if options.debug {
            // The flags of `maturin develop` in `cargo xtask test`, so cargo reuses its build.
            let mut wheel = maturin_in(&venv, true);
            wheel
                .args(["build", "--locked", "--quiet", "--out"])
                .arg(&out);
            run("build the wheel (maturin build)", wheel)?;
        } else {
            ensure_zig(&venv)?;
            for wheel_target in wheel_targets(&target) {
                // zig links against glibc 2.17's symbols: the manylinux2014 tag, installable on
                // every glibc distribution of the last decade (a host link would require the
                // build machine's glibc, 2.34 here).
                let mut wheel = maturin_in(&venv, false);
                wheel
                    .args(["build", "--release", "--locked", "--quiet", "--zig"])
                    .args([
                        "--compatibility",
                        "manylinux2014",
                        "--target",
                        &wheel_target,
                    ])
                    .arg("--out")
                    .arg(&out);
                run(
                    &format!("build the wheel for {wheel_target} (maturin, zig)"),
                    wheel,
                )?;
            }
        }
        let mut sdist = maturin_in(&venv, false);
        sdist.args(["sdist", "--out"]).arg(&out);
        run("build the sdist (maturin sdist)", sdist)?;
        for entry in fs::read_dir(&out)? {
            let name = entry?.file_name().to_string_lossy().into_owned();
            if name.ends_with(".whl") || name == format!("rankwatch-{version}.tar.gz") {
                artifacts.push(name);
            }
        }
    }
    artifacts.sort();
    let mut sums = Command::new("sha256sum");
    sums.current_dir(&out).args(&artifacts);
    let listing = sums.output().context("running sha256sum")?;
    if !listing.status.success() {
        bail!(
            "sha256sum failed: {}",
            String::from_utf8_lossy(&listing.stderr)
        );
    }
    fs::write(out.join("SHA256SUMS"), &listing.stdout)?;
    fs::write(
        out.join("BUILD.txt"),
        build_notes(&version, &target, &binary, options)?,
    )?;
    println!("\n{}:", out.display());
    for name in &artifacts {
        let bytes = fs::metadata(out.join(name))?.len();
        println!("  {name:<60} {:>8.1} MiB", bytes as f64 / (1 << 20) as f64);
    }
    Ok(out)
}

/// `rankwatch-<version>-<target>.tar.gz`: a directory with the binary and the README, as
/// ripgrep's and VictoriaMetrics' releases are laid out.
fn collector_archive(binary: &Path, version: &str, target: &str, out: &Path) -> Result<String> {
    let stem = format!("rankwatch-{version}-{target}");
    let staging = out.join(&stem);
    fs::create_dir_all(&staging)?;
    fs::copy(binary, staging.join("rankwatch"))?;
    fs::copy(root().join("README.md"), staging.join("README.md"))?;
    let archive = format!("{stem}.tar.gz");
    let mut tar = Command::new("tar");
    tar.current_dir(out)
        .args(["--owner=0", "--group=0", "-czf", &archive, &stem]);
    run("archive the collector", tar)?;
    fs::remove_dir_all(&staging)?;
    Ok(archive)
}

fn build_notes(version: &str, target: &str, binary: &Path, options: Options) -> Result<String> {
    let output = |cmd: &mut Command| {
        cmd.output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
            .unwrap_or_default()
    };
    let commit = output(
        Command::new("git")
            .current_dir(root())
            .args(["rev-parse", "HEAD"]),
    );
    let dirty = !output(
        Command::new("git")
            .current_dir(root())
            .args(["status", "--porcelain"]),
    )
    .is_empty();
    let rustc = output(Command::new("rustc").arg("--version"));
    let profile = if options.debug {
        "test (cargo xtask dist --debug: for the tests, not a release)"
    } else {
        "release"
    };
    let glibc = newest_glibc(binary).map_or("unknown (no objdump)".to_owned(), |v| {
        format!("glibc >= {v}")
    });
    Ok(format!(
        "version: {version}\ntarget: {target}\nprofile: {profile}\ncommit: {commit}{}\nrustc: {rustc}\ncollector needs: {glibc}\n",
        if dirty {
            " (with uncommitted changes)"
        } else {
            ""
        }
    ))
}

/// The newest `GLIBC_x.y` symbol version `binary` links against: the oldest glibc it runs on.
fn newest_glibc(binary: &Path) -> Option<String> {
    let out = Command::new("objdump")
        .arg("-T")
        .arg(binary)
        .output()
        .ok()?;
    String::from_utf8_lossy(&out.stdout)
        .split(|c: char| c.is_whitespace() || c == '(' || c == ')')
        .filter_map(|word| word.strip_prefix("GLIBC_"))
        .filter_map(|v| {
            let mut parts = v.split('.').map(|p| p.parse::<u32>().ok());
            Some((parts.next()??, parts.next().flatten().unwrap_or(0)))
        })
        .max()
        .map(|(major, minor)| format!("{major}.{minor}"))
}

/// The wheels' targets: this machine's, and aarch64 Linux from x86_64 when rustup can add its
/// standard library (zig is the cross linker).
fn wheel_targets(host: &str) -> Vec<String> {
    let mut targets = vec![host.to_owned()];
    let arm = "aarch64-unknown-linux-gnu";
    if host == "x86_64-unknown-linux-gnu" {
        let mut add = Command::new("rustup");
        add.current_dir(root()).args(["target", "add", arm]);
        match run(&format!("install the {arm} target"), add) {
            Ok(()) => targets.push(arm.to_owned()),
            Err(e) => eprintln!("no {arm} wheel: {e:#}"),
        }
    }
    targets
}

/// zig, the linker maturin's `--zig` uses, from PyPI's `ziglang` into `venv`.
fn ensure_zig(venv: &Path) -> Result<()> {
    let python = venv.join("bin/python");
    let found = Command::new(&python)
        .args(["-c", "import ziglang"])
        .status()
        .is_ok_and(|s| s.success());
    if !found {
        pip_add(&python, "ziglang>=0.13", "install zig (PyPI ziglang)")?;
    }
    Ok(())
}

/// `pip install requirement` into `python`'s environment.
fn pip_add(python: &Path, requirement: &str, step: &str) -> Result<()> {
    let mut pip = Command::new(python);
    pip.args([
        "-m",
        "pip",
        "install",
        "--quiet",
        "--disable-pip-version-check",
        requirement,
    ]);
    run(step, pip)
}

/// A venv with maturin: the test venv when it exists, else a small one of its own under
/// `target/` (building a release needs no torch).
fn maturin_venv() -> Result<PathBuf> {
    let test_venv = root().join(".venv");
    if test_venv.join("bin/maturin").exists() {
        return Ok(test_venv);
    }
    let venv = root().join("target/maturin-venv");
    if !venv.join("bin/maturin").exists() {
        let mut create = Command::new("python3");
        create.args(["-m", "venv"]).arg(&venv);
        run("create target/maturin-venv", create)?;
        pip_add(
            &venv.join("bin/python"),
            "maturin>=1.8,<2",
            "install maturin",
        )?;
    }
    Ok(venv)
}
