//! `cargo xtask check`: the collector's modules stay in layers.
//!
//! The collector's top-level modules are ranked, lowest first, in [`COLLECTOR_LAYERS`]: a
//! module may import from a module of a *lower* layer only. Two modules of one layer know
//! nothing of each other, and nothing reaches upwards, so the import graph has no cycle by
//! construction — the shape that lets `Collector::open` build every part in dependency order
//! and hand it what it needs, with no back-reference patched in later.
//!
//! The check reads the source, not the compiler's view: every `crate::name` path (in `use`
//! items, `crate::{a, b::c}` groups and inline paths) outside comments, in every file under
//! `collector/src`, attributed to the top-level module the file belongs to. Names that
//! `lib.rs` re-exports (`crate::Error`, `crate::app`) count as the module they come from. A
//! module missing from the table is an error too, so a new module is placed on purpose.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The collector's layers, lowest first.
pub(crate) const COLLECTOR_LAYERS: &[&[&str]] = &[
    // The error type and the metric helpers everything shares.
    &["error", "instrument"],
    // File helpers, the file-system seam, the data directory's lock and the clock.
    &["fsutil", "disk", "dirlock", "clock"],
    // The data model and the durable primitives under the store.
    &[
        "entry",
        "summary",
        "wal",
        "idempotency",
        "switches",
        "tokens",
    ],
    // Parsing bodies into entries; the store (hot buffer + Parquet).
    &["decode", "store"],
    // Writing an entry durably; reading the store.
    &["commit", "query"],
    // The alert engine: consumes entries over its own channel, writes through `commit`.
    &["alerting"],
    // What drives the engine and the store: ingest, retention, export.
    &["ingest", "retention", "export"],
    // Gathering every component's counters; the command line.
    &["telemetry", "config"],
    // HTTP: the server's API, its connection loop, and the CLI's client.
    &["api", "http", "client"],
    // Start-up and shutdown: builds everything below in order.
    &["server"],
];

/// One import that breaks the layering.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Violation {
    pub(crate) file: PathBuf,
    pub(crate) line: usize,
    pub(crate) from: String,
    pub(crate) to: String,
    pub(crate) why: String,
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}:{}: `{}` imports `{}`: {}",
            self.file.display(),
            self.line,
            self.from,
            self.to,
            self.why
        )
    }
}

/// Checks every file under `src` (a crate's source folder) against `layers`.
pub(crate) fn check(src: &Path, layers: &[&[&str]]) -> std::io::Result<Vec<Violation>> {
    let rank: BTreeMap<&str, usize> = layers
        .iter()
        .enumerate()
        .flat_map(|(i, names)| names.iter().map(move |n| (*n, i)))
        .collect();
    let lib = std::fs::read_to_string(src.join("lib.rs"))?;
    let reexports = reexports(&lib);
    let mut violations = Vec::new();
    for file in rust_files(src)? {
        let rel = file.strip_prefix(src).unwrap_or(&file).to_path_buf();
        let Some(from) = owning_module(&rel) else {
            continue;
        };
        let text = std::fs::read_to_string(&file)?;
        let Some(&from_rank) = rank.get(from.as_str()) else {
            violations.push(Violation {
                file: rel.clone(),
                line: 1,
                from: from.clone(),
                to: from.clone(),
                why: "this module is not in the layer table (xtask/src/layers.rs): place it".into(),
            });
            continue;
        };
        for (line, to) in crate_paths(&text) {
            let to = reexports.get(&to).cloned().unwrap_or(to);
            if to == from {
                continue;
            }
            let why = match rank.get(to.as_str()) {
                None => format!("`{to}` is not in the layer table (xtask/src/layers.rs)"),
                Some(&r) if r == from_rank => {
                    format!("both are in layer {from_rank}; a layer's modules are independent")
                }
                Some(&r) if r > from_rank => {
                    format!("layer {r} is above layer {from_rank}: imports only go down")
                }
                Some(_) => continue,
            };
            violations.push(Violation {
                file: rel.clone(),
                line,
                from: from.clone(),
                to,
                why,
            });
        }
    }
    Ok(violations)
}

/// The top-level module a file belongs to: `alerting/sinks.rs` → `alerting`, `ingest.rs` →
/// `ingest`. `None` for the crate root (`lib.rs`) and binaries (`main.rs`, `bin/`), which sit
/// above every module.
fn owning_module(rel: &Path) -> Option<String> {
    let mut parts = rel.components();
    let first = parts.next()?.as_os_str().to_str()?;
    if parts.next().is_some() {
        return (first != "bin").then(|| first.to_owned());
    }
    let stem = first.strip_suffix(".rs")?;
    (!matches!(stem, "lib" | "main")).then(|| stem.to_owned())
}

/// `pub use module::{A, b}` lines of `lib.rs`: re-exported name → its module.
fn reexports(lib: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for line in lib.lines() {
        let Some(rest) = line.trim().strip_prefix("pub use ") else {
            continue;
        };
        let rest = rest.trim_end_matches(';');
        let Some((module, names)) = rest.split_once("::") else {
            continue;
        };
        let names = names.trim_start_matches('{').trim_end_matches('}');
        for name in names.split(',') {
            let name = name.trim().rsplit("::").next().unwrap_or("").trim();
            if !name.is_empty() {
                out.insert(name.to_owned(), module.to_owned());
            }
        }
    }
    out
}

/// Every top-level name reached through `crate::` in `text`, with its line (1-based).
/// Comments are skipped: a doc link is not an import.
fn crate_paths(text: &str) -> Vec<(usize, String)> {
    let code = strip_comments(text);
    let mut out = Vec::new();
    let mut rest = code.as_str();
    let mut offset = 0;
    while let Some(at) = rest.find("crate::") {
        let start = offset + at;
        let preceded = code[..start]
            .chars()
            .next_back()
            .is_some_and(|c| c.is_alphanumeric() || c == '_');
        let after = &code[start + "crate::".len()..];
        let line = code[..start].matches('\n').count() + 1;
        if !preceded {
            if let Some(group) = after.strip_prefix('{') {
                for name in top_level_names(group) {
                    out.push((line, name));
                }
            } else {
                let name: String = after
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                if !name.is_empty() {
                    out.push((line, name));
                }
            }
        }
        offset = start + "crate::".len();
        rest = &code[offset..];
    }
    out
}

/// The first path segment of each item of a `{a, b::{c, d}, e}` group (its opening brace
/// already consumed), up to the matching closing brace.
fn top_level_names(group: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut depth = 0usize;
    let mut item = String::new();
    let mut take = |item: &mut String| {
        let name: String = item
            .trim()
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        if !name.is_empty() && name != "self" {
            names.push(name);
        }
        item.clear();
    };
    for c in group.chars() {
        match c {
            '{' => {
                depth += 1;
                item.push(c);
            }
            '}' if depth == 0 => break,
            '}' => {
                depth -= 1;
                item.push(c);
            }
            ',' if depth == 0 => take(&mut item),
            _ => item.push(c),
        }
    }
    take(&mut item);
    names
}

/// `text` with `//` comments blanked (line structure kept). String literals that contain
/// `//` (URLs) are left alone: a comment starts only outside a string.
fn strip_comments(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for line in text.lines() {
        let mut in_string = false;
        let mut escaped = false;
        let mut cut = line.len();
        let bytes = line.as_bytes();
        for (i, &b) in bytes.iter().enumerate() {
            match b {
                b'\\' if in_string => {
                    escaped = !escaped;
                    continue;
                }
                b'"' if !escaped => in_string = !in_string,
                b'/' if !in_string && bytes.get(i + 1) == Some(&b'/') => {
                    cut = i;
                    break;
                }
                _ => {}
            }
            escaped = false;
        }
        out.push_str(&line[..cut]);
        out.push('\n');
    }
    out
}

fn rust_files(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d)? {
            let path = entry?.path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    out.sort();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, rel: &str, text: &str) {
        let path = dir.join(rel);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    }

    /// A small crate laid out like the collector: lib.rs with a re-export, a nested module.
    fn fixture(store_mod: &str) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path();
        write(
            src,
            "lib.rs",
            "pub mod error;\npub mod store;\npub mod alerting;\npub use error::{Error, Result};\n",
        );
        write(src, "error.rs", "pub struct Error;\n");
        write(src, "store/mod.rs", store_mod);
        write(
            src,
            "alerting/mod.rs",
            "use crate::store::Store;\nuse crate::{Error, error::Result};\n",
        );
        dir
    }

    const LAYERS: &[&[&str]] = &[&["error"], &["store"], &["alerting"]];

    #[test]
    fn the_collector_keeps_its_layers() {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../collector/src");
        let violations = check(&src, COLLECTOR_LAYERS).unwrap();
        let listed: Vec<String> = violations.iter().map(ToString::to_string).collect();
        assert!(listed.is_empty(), "layering broken:\n{}", listed.join("\n"));
    }

    #[test]
    fn downward_imports_and_doc_links_pass() {
        let dir = fixture(
            "//! Feeds [`crate::alerting`] (a doc link, not an import).\n\
             use crate::error::Error; // see crate::alerting\n\
             const URL: &str = \"http://x//y\"; use crate::Result;\n",
        );
        let violations = check(dir.path(), LAYERS).unwrap();
        assert!(violations.is_empty(), "{violations:?}");
        // The `//` inside the string does not hide what follows it on the line.
        let paths = crate_paths("const URL: &str = \"http://x//y\"; use crate::alerting::A;\n");
        assert_eq!(paths, [(1, "alerting".to_owned())]);
    }

    #[test]
    fn an_upward_import_fails_with_file_line_and_layers() {
        let dir = fixture("use crate::error::Error;\n\nuse crate::{alerting::Engine, Result};\n");
        let violations = check(dir.path(), LAYERS).unwrap();
        assert_eq!(violations.len(), 1, "{violations:?}");
        let v = &violations[0];
        assert_eq!(
            (v.file.as_path(), v.line, v.from.as_str(), v.to.as_str()),
            (Path::new("store/mod.rs"), 3, "store", "alerting")
        );
        assert!(v.why.contains("above"), "{}", v.why);
    }

    #[test]
    fn an_inline_path_into_a_peer_of_the_same_layer_fails() {
        let layers: &[&[&str]] = &[&["error"], &["store", "alerting"]];
        let dir = fixture("fn f() { crate::alerting::go(); }\n");
        let violations = check(dir.path(), layers).unwrap();
        let pairs: Vec<(&str, &str)> = violations
            .iter()
            .map(|v| (v.from.as_str(), v.to.as_str()))
            .collect();
        assert_eq!(pairs, [("alerting", "store"), ("store", "alerting")]);
        assert!(violations[0].why.contains("same") || violations[0].why.contains("both"));
    }

    #[test]
    fn a_module_missing_from_the_table_is_reported() {
        let dir = fixture("use crate::error::Error;\n");
        write(dir.path(), "newthing.rs", "use crate::error::Error;\n");
        let violations = check(dir.path(), LAYERS).unwrap();
        assert_eq!(violations.len(), 1, "{violations:?}");
        assert!(violations[0].why.contains("not in the layer table"));
    }
}
