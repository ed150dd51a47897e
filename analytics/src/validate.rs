//! Validated identifiers. A [`RunId`] becomes a directory name (`run=<id>`) in the Hive layout,
//! so its charset is closed: nothing that is a path separator, a Hive delimiter, or a dot-only
//! name. A [`MetricName`] is either a vocabulary metric or a user scalar under the `user/`
//! namespace, with a closed charset, so a label flood of arbitrary bytes cannot enter storage and
//! a misspelt vocabulary name (`spectral.ratoi`) is refused instead of becoming a new series.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::vocab::Metric;

/// Longest accepted run id, in bytes.
pub const MAX_RUN_ID_LEN: usize = 128;
/// Longest accepted metric name, in bytes.
pub const MAX_METRIC_NAME_LEN: usize = 128;

/// The string conversions every validated identifier has; parsing goes through `new`.
macro_rules! validated_string {
    ($ty:ident) => {
        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl FromStr for $ty {
            type Err = Error;
            fn from_str(s: &str) -> Result<Self> {
                $ty::new(s)
            }
        }

        impl TryFrom<String> for $ty {
            type Error = Error;
            fn try_from(s: String) -> Result<Self> {
                $ty::new(s)
            }
        }

        impl From<$ty> for String {
            fn from(value: $ty) -> String {
                value.0
            }
        }
    };
}

/// A run's identifier: 1–128 of `[A-Za-z0-9._-]`, not starting with `.` or `-`, not ending with
/// `.`. Ids are case-sensitive; on a case-insensitive file system `Run` and `run` would share a
/// directory, so deployments there should keep to one case.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct RunId(String);

impl RunId {
    /// Validates `id` as a run id.
    pub fn new(id: impl Into<String>) -> Result<Self> {
        let id = id.into();
        let fail = |reason: &str| Error::InvalidRunId {
            id: id.clone(),
            reason: reason.to_owned(),
        };
        if id.is_empty() {
            return Err(fail("empty"));
        }
        if id.len() > MAX_RUN_ID_LEN {
            return Err(fail(&format!("longer than {MAX_RUN_ID_LEN} bytes")));
        }
        if let Some(c) = id
            .chars()
            .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
        {
            return Err(fail(&format!(
                "character {c:?} not allowed (use letters, digits, '.', '_', '-')"
            )));
        }
        if id.starts_with(['.', '-']) {
            return Err(fail("must not start with '.' or '-'"));
        }
        if id.ends_with('.') {
            return Err(fail("must not end with '.'"));
        }
        Ok(RunId(id))
    }

    /// The id as a string slice.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

validated_string!(RunId);

/// Prefix of user scalars (`run.log(step, lr=…)` is stored as `user/lr`).
pub const USER_PREFIX: &str = "user/";

/// A metric's name: a vocabulary metric, or a user scalar `user/<name>` where `<name>` is
/// 1–123 of `[A-Za-z0-9._:/-]` starting with a letter. Anything else is refused, so a typo of a
/// vocabulary name is an error rather than a silent new metric.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct MetricName(String);

impl MetricName {
    /// Validates `name` as a metric name.
    pub fn new(name: impl Into<String>) -> Result<Self> {
        let name = name.into();
        let fail = |reason: String| Error::InvalidMetricName {
            name: name.clone(),
            reason,
        };
        if name.is_empty() {
            return Err(fail("empty".to_owned()));
        }
        if name.len() > MAX_METRIC_NAME_LEN {
            return Err(fail(format!("longer than {MAX_METRIC_NAME_LEN} bytes")));
        }
        if !name.starts_with(|c: char| c.is_ascii_alphabetic()) {
            return Err(fail("must start with a letter".to_owned()));
        }
        if let Some(c) = name
            .chars()
            .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | ':' | '/' | '-')))
        {
            return Err(fail(format!(
                "character {c:?} not allowed (use letters, digits, '.', '_', ':', '/', '-')"
            )));
        }
        match name.strip_prefix(USER_PREFIX) {
            Some(rest) if !rest.starts_with(|c: char| c.is_ascii_alphabetic()) => Err(fail(
                format!("a user scalar needs a name starting with a letter after '{USER_PREFIX}'"),
            )),
            Some(_) => Ok(MetricName(name)),
            None if name.parse::<Metric>().is_ok() => Ok(MetricName(name)),
            None => Err(fail(format!(
                "unknown metric: not in the vocabulary (user scalars go under '{USER_PREFIX}')"
            ))),
        }
    }

    /// The name as a string slice.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The vocabulary metric this name denotes, if any.
    pub fn known(&self) -> Option<Metric> {
        self.0.parse().ok()
    }
}

impl From<Metric> for MetricName {
    fn from(m: Metric) -> Self {
        MetricName(m.as_str().to_owned())
    }
}

validated_string!(MetricName);

/// 16 hex digits, different for every call: an agent session, a data directory's identity.
/// Std's randomly keyed hasher (seeded once per process), mixed with the time and the process
/// id, so two calls in one process differ too; not for secrets.
pub fn random_hex_id() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.write_u32(std::process::id());
    format!("{:016x}", h.finish())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_ids_that_could_escape_a_directory_are_refused() {
        for bad in [
            "", ".", "..", "../etc", "a/b", "a\\b", "run=1", ".hidden", "-rf", "a b", "nul\0", "é",
        ] {
            let err = RunId::new(bad).unwrap_err().to_string();
            assert!(err.starts_with("invalid run id"), "{bad:?}: {err}");
        }
        assert!(RunId::new("x".repeat(129)).is_err());
        for good in ["llama-ft-7", "a", "run_2026.11.21", &"x".repeat(128)] {
            assert_eq!(RunId::new(good).unwrap().as_str(), good);
        }
    }

    /// A refused name is repeated cut short: a 20 MB metric name in a batch once came back
    /// whole in the 400 that refused it.
    #[test]
    fn a_huge_refused_name_is_not_repeated_whole() {
        let name = format!("m{}", "é".repeat(1 << 20));
        for err in [
            MetricName::new(name.clone()).unwrap_err().to_string(),
            RunId::new(name.clone()).unwrap_err().to_string(),
            name.parse::<Metric>().unwrap_err().to_string(),
        ] {
            assert!(err.len() < 400, "{} bytes", err.len());
            assert!(err.contains(&format!("({} bytes)", name.len())), "{err}");
        }
        let short = MetricName::new("9lives").unwrap_err().to_string();
        assert!(short.contains("\"9lives\":"), "{short}");
    }

    #[test]
    fn metric_names_are_checked_and_vocabulary_recognised() {
        assert_eq!(
            MetricName::new("spectral.ratio").unwrap().known(),
            Some(Metric::SpectralRatio)
        );
        assert_eq!(MetricName::new("user/train/lr").unwrap().known(), None);
        for bad in [
            "",
            "1abc",
            "a b",
            "a\"b",
            "a{b}",
            "ä",
            "train/lr",
            "spectral.ratoi",
            "user/",
            "user/1x",
        ] {
            assert!(MetricName::new(bad).is_err(), "{bad:?}");
        }
        let err = MetricName::new("a b").unwrap_err().to_string();
        assert!(err.contains("' '"), "{err}");
    }
}
