//! The Rust suite in two halves: one `cargo test --no-run` (clippy linting the workspace's
//! crates as they compile), then each test executable it built, run directly.
//!
//! Why not one `cargo test`: its run half (about 165 s on a fresh 2-core machine, most of it
//! the collector's integration tests waiting on the binaries they spawn) left a core idle a
//! third of the time, and cargo holds the build directory's lock until it exits, so nothing
//! that builds (the SDK's native module, the wheel) could use that core. Run directly, the
//! executables hold no lock: they run on a side lane while the main one builds the native
//! module and starts the SDK suite. Each runs as cargo would run it: in its package's
//! directory, with `CARGO_MANIFEST_DIR` set. The crates have no doctests (`doctest = false`),
//! so nothing `cargo test` would run is left out.

use serde_json::Value;

use super::*;

/// One test executable `cargo test --no-run` built.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct TestBinary {
    /// `package target`, e.g. `rankwatch-collector it`.
    pub(crate) name: String,
    pub(crate) executable: PathBuf,
    /// The package's directory, where cargo runs its tests.
    pub(crate) package_dir: PathBuf,
}

/// Splits `cargo xtask test` arguments into cargo's and the test executables': those after
/// `--` are the executables', and so is a bare word before it that no cargo option takes as
/// its value (`cargo xtask test rollups` filters the tests by name, as `cargo test rollups`
/// does; `--no-run` would otherwise drop it).
pub(crate) fn split_extra(extra: &[String]) -> (Vec<String>, Vec<String>) {
    let (before, after) = match extra.iter().position(|a| a == "--") {
        Some(at) => (&extra[..at], &extra[at + 1..]),
        None => (extra, &[][..]),
    };
    let mut cargo_args = Vec::new();
    let mut test_args = Vec::new();
    let mut takes_value = false;
    for arg in before {
        if takes_value || arg.starts_with('-') {
            takes_value = !takes_value && CARGO_OPTIONS_WITH_VALUES.contains(&arg.as_str());
            cargo_args.push(arg.clone());
        } else {
            test_args.push(arg.clone());
        }
    }
    test_args.extend(after.iter().cloned());
    (cargo_args, test_args)
}

/// `cargo test`'s options that take the next argument as their value.
const CARGO_OPTIONS_WITH_VALUES: [&str; 17] = [
    "-p",
    "--package",
    "--exclude",
    "-F",
    "--features",
    "--test",
    "--bin",
    "--example",
    "--bench",
    "--target",
    "--target-dir",
    "--profile",
    "-j",
    "--jobs",
    "--manifest-path",
    "--config",
    "--color",
];

/// Compiles every test of the workspace (clippy on its crates, warnings denied) and returns
/// the executables, in the order cargo would run them.
pub(crate) fn build(cargo_args: &[String]) -> Result<Vec<TestBinary>> {
    let mut build = cargo();
    build
        .args(RUST_TEST_ARGS)
        .args(["--no-run", "--message-format=json-render-diagnostics"])
        .args(cargo_args);
    with_clippy(&mut build);
    // The JSON messages are read, not shown (cargo renders its diagnostics to stderr).
    let mut binaries = Vec::new();
    run_reading(
        "rust tests: build (clippy -D warnings while compiling)",
        build,
        Some(&mut |line: &str| {
            binaries.extend(test_binary(line));
            false
        }),
    )?;
    // cargo test runs them by package, then unit tests before integration tests.
    binaries.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(binaries)
}

/// The test executable a `compiler-artifact` message announces, if it is one.
fn test_binary(line: &str) -> Option<TestBinary> {
    let message: Value = serde_json::from_str(line).ok()?;
    if message["reason"] != "compiler-artifact" || message["profile"]["test"] != true {
        return None;
    }
    let executable = PathBuf::from(message["executable"].as_str()?);
    let manifest = Path::new(message["manifest_path"].as_str()?);
    let package = message["package_id"]
        .as_str()
        .and_then(package_name)
        .unwrap_or("?");
    let target = message["target"]["name"].as_str().unwrap_or("?");
    let kind = message["target"]["kind"][0].as_str().unwrap_or("");
    // A package's unit tests sort before its integration tests, as cargo runs them.
    let name = if matches!(kind, "lib" | "bin") {
        format!("{package} (unit {target})")
    } else {
        format!("{package} {target}")
    };
    Some(TestBinary {
        name,
        executable,
        package_dir: manifest.parent()?.to_path_buf(),
    })
}

/// The package's name in a package id: `path+file:///…/collector#rankwatch-collector@0.1.0`,
/// `path+file:///…/xtask#0.1.0` where the name is the directory's (cargo ≥ 1.77), or the older
/// `rankwatch-collector 0.1.0 (path+file:///…)`.
fn package_name(id: &str) -> Option<&str> {
    match id.rsplit_once('#') {
        Some((_, fragment)) if fragment.contains('@') => fragment.split('@').next(),
        Some((url, _)) => url.rsplit('/').next(),
        None => id.split_whitespace().next(),
    }
}

/// Runs each executable with `args`, as cargo would; every one runs, and the failures are
/// reported together.
pub(crate) fn run(binaries: &[TestBinary], args: &[String], tally: &mut Tally) -> Result<()> {
    if binaries.is_empty() {
        bail!("cargo built no test executable");
    }
    let mut failures = Failures::default();
    for binary in binaries {
        let mut cmd = Command::new(&binary.executable);
        // Not xtask's own package variables (`cargo run -p xtask` set them): the package's
        // directory, as cargo sets it for a test it runs.
        without_package_env(&mut cmd);
        cmd.current_dir(&binary.package_dir)
            .env("CARGO_MANIFEST_DIR", &binary.package_dir)
            .args(args);
        failures.note(run_with(
            &format!("rust tests: {}", binary.name),
            cmd,
            Some(tally),
        ));
    }
    failures.into_result()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_test_artifact_is_read_with_its_package_and_directory() {
        let line = r#"{"reason":"compiler-artifact","package_id":"path+file:///w/collector#rankwatch-collector@0.1.0","manifest_path":"/w/collector/Cargo.toml","target":{"kind":["test"],"name":"it"},"profile":{"test":true},"executable":"/w/target/debug/deps/it-abc"}"#;
        assert_eq!(
            test_binary(line),
            Some(TestBinary {
                name: "rankwatch-collector it".into(),
                executable: "/w/target/debug/deps/it-abc".into(),
                package_dir: "/w/collector".into(),
            })
        );
        let unit = line.replace(
            r#"["test"],"name":"it""#,
            r#"["lib"],"name":"rankwatch_collector""#,
        );
        assert_eq!(
            test_binary(&unit).unwrap().name,
            "rankwatch-collector (unit rankwatch_collector)"
        );
    }

    #[test]
    fn libraries_binaries_and_other_messages_are_not_test_executables() {
        let library = r#"{"reason":"compiler-artifact","package_id":"a 0.1.0 (path+file:///w/a)","manifest_path":"/w/a/Cargo.toml","target":{"kind":["lib"],"name":"a"},"profile":{"test":false},"executable":null}"#;
        assert_eq!(test_binary(library), None);
        let binary = library
            .replace(r#"["lib"]"#, r#"["bin"]"#)
            .replace("null", r#""/w/target/debug/a""#);
        assert_eq!(test_binary(&binary), None, "a plain binary is not a test");
        assert_eq!(
            test_binary(r#"{"reason":"build-finished","success":true}"#),
            None
        );
        assert_eq!(test_binary("Compiling a v0.1.0"), None);
    }

    #[test]
    fn package_names_are_read_from_both_id_forms() {
        assert_eq!(
            package_name("path+file:///w/collector#rankwatch-collector@0.1.0"),
            Some("rankwatch-collector")
        );
        assert_eq!(
            package_name("rankwatch-collector 0.1.0 (path+file:///w/collector)"),
            Some("rankwatch-collector")
        );
        assert_eq!(package_name("path+file:///w/xtask#0.1.0"), Some("xtask"));
    }

    fn split(args: &[&str]) -> (Vec<String>, Vec<String>) {
        split_extra(&args.iter().map(|a| a.to_string()).collect::<Vec<_>>())
    }

    #[test]
    fn arguments_after_a_double_dash_go_to_the_executables() {
        let (cargo, tests) = split(&["-p", "x", "--", "--exact", "t"]);
        assert_eq!(cargo, ["-p", "x"]);
        assert_eq!(tests, ["--exact", "t"]);
        assert_eq!(split(&["-p", "x"]).1.len(), 0);
    }

    #[test]
    fn a_bare_word_is_a_test_filter_unless_an_option_takes_it() {
        let (cargo, tests) = split(&["rollups", "-p", "rankwatch-collector", "--release"]);
        assert_eq!(cargo, ["-p", "rankwatch-collector", "--release"]);
        assert_eq!(tests, ["rollups"]);
        let (cargo, tests) = split(&[
            "--features",
            "f",
            "--test",
            "it",
            "engine",
            "--",
            "--nocapture",
        ]);
        assert_eq!(cargo, ["--features", "f", "--test", "it"]);
        assert_eq!(tests, ["engine", "--nocapture"]);
        // `--features=f` carries its value: the next word is a filter.
        let (cargo, tests) = split(&["--features=f", "engine"]);
        assert_eq!(cargo, ["--features=f"]);
        assert_eq!(tests, ["engine"]);
    }
}
