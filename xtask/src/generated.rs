//! `cargo xtask check` refuses generated files in git: a build output that is tracked is
//! rewritten by every build (the testkit's `egg-info` was, by each editable install), so every
//! build dirties the tree and a stale copy can shadow the real one.

use std::path::Path;
use std::process::Command;

/// Whether `path` (relative to the repository, `/`-separated) is something a build writes.
pub(crate) fn is_generated(path: &str) -> bool {
    let parts: Vec<&str> = path.split('/').collect();
    let under = |top: &[&str]| parts.len() > top.len() && parts[..top.len()] == *top;
    parts
        .iter()
        .any(|p| p.ends_with(".egg-info") || *p == "__pycache__" || *p == "node_modules")
        || path.ends_with(".pyc")
        || under(&["target"])
        || under(&["web", "dist"])
        || (under(&["sdk-python", "rankwatch"])
            && (path.ends_with(".so") || path.ends_with(".pyd")))
}

/// The tracked files that are generated; `None` when git cannot list them (not a checkout).
pub(crate) fn tracked(root: &Path) -> Option<Vec<String>> {
    let out = Command::new("git")
        .arg("-C")
        .arg(root)
        .args(["ls-files", "-z"])
        .output()
        .ok()
        .filter(|o| o.status.success())?;
    Some(
        out.stdout
            .split(|&b| b == 0)
            .filter(|p| !p.is_empty())
            .map(|p| String::from_utf8_lossy(p).into_owned())
            .filter(|p| is_generated(p))
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn build_outputs_are_told_from_sources() {
        for generated in [
            "sdk-python/testkit/rankwatch_testkit.egg-info/PKG-INFO",
            "sdk-python/rankwatch/__pycache__/run.cpython-311.pyc",
            "sdk-python/rankwatch/_native.abi3.so",
            "target/debug/rankwatch",
            "web/dist/index.html",
            "web/node_modules/uplot/package.json",
            "bench/x.pyc",
        ] {
            assert!(is_generated(generated), "{generated}");
        }
        for source in [
            "sdk-python/rankwatch/run.py",
            "sdk-python/rankwatch/_native.pyi",
            "web/src/chart.rs",
            "docs/figures/detection-sweep.json",
            "xtask/src/generated.rs",
            "web/distribution.md",
        ] {
            assert!(!is_generated(source), "{source}");
        }
    }

    #[test]
    fn this_checkout_tracks_no_build_output() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
        if let Some(found) = tracked(root) {
            assert!(found.is_empty(), "generated files tracked: {found:?}");
        }
    }
}
