//! Alert rules: the `--rules` TOML file over the documented defaults, and per-run overrides.
//!
//! A rules file names only what it changes; every other threshold keeps its default
//! ([`DetectorsConfig`]). It is checked whole at start-up, and a problem is reported with its
//! line: TOML syntax and unknown keys by the parser's own position, incoherent thresholds
//! (an inverted band, a zero persistence) by the line of the rule's table. A per-run override
//! is a partial document of the same shape, merged over the file's rules (not over the
//! defaults), checked the same way, and kept in `<data-dir>/rules/<run>.json` so it survives a
//! restart; a bad one is refused and the rules in force stay.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use rankwatch_analytics::RunId;
use rankwatch_analytics::detect::DetectorsConfig;
use serde_json::Value;

use crate::error::{Error, Result};
use crate::fsutil::write_atomic;

/// Reads and checks a rules file.
pub fn load_file(path: &Path) -> Result<DetectorsConfig> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        Error::bad(format!(
            "rules file {}: cannot read it: {e}",
            path.display()
        ))
    })?;
    parse(&text).map_err(|why| Error::bad(format!("rules file {}: {why}", path.display())))
}

/// Parses and checks rules text; the error names the line.
pub fn parse(text: &str) -> std::result::Result<DetectorsConfig, String> {
    let config: DetectorsConfig = toml::from_str(text).map_err(|e| {
        // The parser's message already says "at line L, column C" and shows the line.
        e.to_string().trim_end().to_owned()
    })?;
    config.validate().map_err(|e| {
        let why = e.to_string();
        match rule_line(text, &why) {
            Some(line) => format!("line {line}: {why}"),
            None => why,
        }
    })?;
    Ok(config)
}

/// The line of the table (or dotted key) of the rule a validation message starts with.
fn rule_line(text: &str, message: &str) -> Option<usize> {
    let rule = rankwatch_analytics::Rule::ALL
        .iter()
        .map(|r| r.as_str())
        .filter_map(|r| message.find(&format!("{r}:")).map(|at| (at, r)))
        .min()?
        .1;
    text.lines()
        .position(|line| {
            let line = line.trim();
            line.strip_prefix('[')
                .and_then(|l| l.strip_suffix(']'))
                .is_some_and(|name| {
                    name.trim() == rule || name.trim().starts_with(&format!("{rule}."))
                })
                || line.starts_with(&format!("{rule}."))
                || line.starts_with(&format!("{rule} "))
                || line.starts_with(&format!("{rule}="))
        })
        .map(|i| i + 1)
}

/// The rules as a TOML document (what `rankwatch rules` prints).
pub fn to_toml(config: &DetectorsConfig) -> Result<String> {
    toml::to_string(config).map_err(|e| Error::bad(format!("rules cannot be written as toml: {e}")))
}

/// Merges a partial rules document over `base` and checks the result.
pub fn merge(base: &DetectorsConfig, partial: &Value) -> Result<DetectorsConfig> {
    if !partial.is_object() {
        return Err(Error::bad(
            "rules override must be an object of rule tables",
        ));
    }
    let mut merged = serde_json::to_value(base)?;
    deep_merge(&mut merged, partial);
    let config: DetectorsConfig =
        serde_json::from_value(merged).map_err(|e| Error::bad(format!("rules override: {e}")))?;
    config
        .validate()
        .map_err(|e| Error::bad(format!("rules override: {e}")))?;
    Ok(config)
}

fn deep_merge(into: &mut Value, from: &Value) {
    match (into, from) {
        (Value::Object(into), Value::Object(from)) => {
            for (key, value) in from {
                match into.get_mut(key) {
                    Some(slot) if slot.is_object() && value.is_object() => deep_merge(slot, value),
                    _ => {
                        into.insert(key.clone(), value.clone());
                    }
                }
            }
        }
        (into, from) => *into = from.clone(),
    }
}

/// A partial rules document from a request body: JSON, or TOML for `application/toml` and
/// `text/plain`.
pub fn parse_override(body: &[u8], content_type: Option<&str>) -> Result<Value> {
    let text =
        std::str::from_utf8(body).map_err(|_| Error::bad("rules override is not utf-8 text"))?;
    let media = crate::decode::media_type(content_type.unwrap_or("application/json"));
    match media.as_str() {
        "application/json" => Ok(serde_json::from_str(text)?),
        "application/toml" | "text/plain" => {
            let table: toml::Table = toml::from_str(text)
                .map_err(|e| Error::bad(format!("rules override: {}", e.to_string().trim_end())))?;
            Ok(serde_json::to_value(table)?)
        }
        other => Err(Error::UnsupportedMediaType(other.to_owned())),
    }
}

/// The rules in force: the file's, and each run's override.
#[derive(Debug)]
pub struct RuleBook {
    base: DetectorsConfig,
    dir: PathBuf,
    overrides: Mutex<BTreeMap<RunId, (Value, DetectorsConfig)>>,
}

impl RuleBook {
    /// The rule book over `base`, with the overrides saved in `dir` (read now; one that no
    /// longer fits the base is reported and skipped, never silently applied in part).
    pub fn open(base: DetectorsConfig, dir: PathBuf) -> Result<RuleBook> {
        let mut overrides = BTreeMap::new();
        for (run, path) in crate::fsutil::run_files(&dir)? {
            let loaded = std::fs::read(&path)
                .map_err(Error::from)
                .and_then(|bytes| Ok(serde_json::from_slice::<Value>(&bytes)?))
                .and_then(|partial| Ok((merge(&base, &partial)?, partial)));
            match loaded {
                Ok((config, partial)) => {
                    overrides.insert(run, (partial, config));
                }
                Err(e) => {
                    tracing::error!(path = %path.display(), error = %e, "saved rules override skipped");
                }
            }
        }
        Ok(RuleBook {
            base,
            dir,
            overrides: Mutex::new(overrides),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<RunId, (Value, DetectorsConfig)>> {
        self.overrides.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The rules file's (or default) rules.
    pub fn base(&self) -> &DetectorsConfig {
        &self.base
    }

    /// The rules in force for `run`.
    pub fn for_run(&self, run: &RunId) -> DetectorsConfig {
        self.lock().get(run).map_or(self.base, |(_, c)| *c)
    }

    /// The override of `run`, if any.
    pub fn override_of(&self, run: &RunId) -> Option<Value> {
        self.lock().get(run).map(|(v, _)| v.clone())
    }

    /// Sets `run`'s override (checked, saved, then in force); returns the rules now in force.
    pub fn set_override(&self, run: &RunId, partial: Value) -> Result<DetectorsConfig> {
        let config = merge(&self.base, &partial)?;
        std::fs::create_dir_all(&self.dir)?;
        write_atomic(
            &self.dir.join(format!("{run}.json")),
            &serde_json::to_vec_pretty(&partial)?,
        )?;
        self.lock().insert(run.clone(), (partial, config));
        Ok(config)
    }

    /// Drops `run`'s override; returns the rules now in force.
    pub fn clear_override(&self, run: &RunId) -> Result<DetectorsConfig> {
        let path = self.dir.join(format!("{run}.json"));
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e.into()),
        }
        self.lock().remove(run);
        Ok(self.base)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_keys_bad_values_and_inverted_bands_name_their_line() {
        let err = parse("[rank_collapse]\nband_low = 0.5\nband_hi = 3.0\n").unwrap_err();
        assert!(err.contains("line 3") && err.contains("band_hi"), "{err}");
        let err = parse("[stale_rank]\ntimeout_ms = \"soon\"\n").unwrap_err();
        assert!(err.contains("line 2"), "{err}");
        let err =
            parse("# comment\n\n[rank_collapse]\nband_low = 2.0\nband_high = 0.5\n").unwrap_err();
        assert!(
            err.starts_with("line 3: ") && err.contains("rank_collapse:"),
            "{err}"
        );
        let err =
            parse("[nonfinite]\nlifecycle = { pending_for = 0, resolve_after = 1 }\n").unwrap_err();
        assert!(
            err.starts_with("line 1: ") && err.contains("nonfinite"),
            "{err}"
        );
        let err = parse("[no_such_rule]\n").unwrap_err();
        assert!(
            err.contains("no_such_rule") && err.contains("line 1"),
            "{err}"
        );
        assert_eq!(parse("").unwrap(), DetectorsConfig::default());
    }

    #[test]
    fn overrides_merge_over_the_base_and_bad_ones_leave_it_in_force() {
        let dir = tempfile::tempdir().unwrap();
        let base = parse("[rank_collapse]\nband_low = 0.5\nband_high = 3.0\n").unwrap();
        let book = RuleBook::open(base, dir.path().join("rules")).unwrap();
        let run = RunId::new("r1").unwrap();
        let partial = serde_json::json!({"rank_collapse": {"band_low": 0.25}});
        let c = book.set_override(&run, partial).unwrap();
        assert_eq!(
            (c.rank_collapse.band_low, c.rank_collapse.band_high),
            (Some(0.25), Some(3.0))
        );
        let inverted = serde_json::json!({"rank_collapse": {"band_low": 5.0}});
        assert!(
            book.set_override(&run, inverted)
                .unwrap_err()
                .to_string()
                .contains("band_low")
        );
        let unknown = serde_json::json!({"loss_spike": {"z": 1}});
        assert!(
            book.set_override(&run, unknown)
                .unwrap_err()
                .to_string()
                .contains("unknown field")
        );
        assert_eq!(book.for_run(&run).rank_collapse.band_low, Some(0.25));
        // Saved, and read back by a new book.
        let again = RuleBook::open(base, dir.path().join("rules")).unwrap();
        assert_eq!(again.for_run(&run).rank_collapse.band_low, Some(0.25));
        assert_eq!(again.clear_override(&run).unwrap(), base);
        assert_eq!(again.for_run(&run), base);
        let toml = parse_override(
            b"[stale_rank]\ntimeout_ms = 5000\n",
            Some("application/toml"),
        )
        .unwrap();
        assert_eq!(merge(&base, &toml).unwrap().stale_rank.timeout_ms, 5000);
    }
}
