//! `cargo xtask web`: the dashboard's wasm build into `web/dist`, with what it needs installed
//! (the wasm32 target, the locked wasm-bindgen CLI, npm packages).

use super::*;

pub(crate) const WEB_CRATE: &str = "rankwatch-web";
/// The Rust test suite's cargo arguments.
pub(crate) const RUST_TEST_ARGS: [&str; 5] =
    ["test", "--workspace", "--exclude", WEB_CRATE, "--locked"];
pub(crate) const WASM_TARGET: &str = "wasm32-unknown-unknown";

/// The exact wasm-bindgen version in Cargo.lock: the CLI must match the library.
pub(crate) fn locked_wasm_bindgen() -> Result<String> {
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
pub(crate) fn ensure_wasm_bindgen_cli() -> Result<()> {
    let version = locked_wasm_bindgen()?;
    let have = Command::new("wasm-bindgen")
        .arg("--version")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default();
    if have != format!("wasm-bindgen {version}") {
        // Unoptimised: on a fresh machine the CLI compiles while the dashboard does, and the
        // dashboard then waited for it. Measured alone on this 2-vCPU VM (2026-11-30, 0.2.105):
        // an optimised build takes 160 s and 307 CPU-s, this one 73 s and 136 CPU-s, and its
        // one run a build makes takes 1.4 s instead of 0.3 (the output is the same but for
        // the order of generated functions, which differs run to run in both).
        let mut cmd = cargo();
        cmd.args([
            "install",
            "--locked",
            "--debug",
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
pub(crate) fn web() -> Result<()> {
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
pub(crate) fn missing_snippets(dist: &Path) -> Result<Vec<String>> {
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

pub(crate) fn files_under(dir: &Path) -> Vec<PathBuf> {
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

pub(crate) fn same_tree(a: &Path, b: &Path) -> bool {
    let files = files_under(a);
    files == files_under(b)
        && files
            .iter()
            .all(|f| std::fs::read(a.join(f)).ok() == std::fs::read(b.join(f)).ok())
}

pub(crate) fn copy_tree(from: &Path, to: &Path) -> Result<()> {
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
