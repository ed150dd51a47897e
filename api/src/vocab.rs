//! The names an alert carries on the wire: which rule raised it, how urgent it is, where it
//! is in its lifecycle. The analytics crate's detectors use these very types.

use std::fmt;

use serde::{Deserialize, Serialize};

/// A name that is not one of a vocabulary's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownName {
    /// The vocabulary, e.g. `severity`.
    pub kind: &'static str,
    /// What was given.
    pub given: String,
    /// Every name it accepts.
    pub expected: &'static [&'static str],
}

impl fmt::Display for UnknownName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "unknown {} {}; expected one of {}",
            self.kind,
            quoted(&self.given),
            self.expected.join(", ")
        )
    }
}

/// Most characters of a refused value an error message repeats.
const SHOWN_CHARS: usize = 80;

/// A refused value as an error message shows it: quoted, and cut to its first 80
/// (`SHOWN_CHARS`) characters with its length when longer, so that a 20 MB name in a batch
/// is not sent back whole in the answer that refuses it.
pub fn quoted(value: &str) -> String {
    match value.char_indices().nth(SHOWN_CHARS) {
        None => format!("{value:?}"),
        Some((cut, _)) => format!("{:?}… ({} bytes)", &value[..cut], value.len()),
    }
}

impl std::error::Error for UnknownName {}

/// A closed set of names: the enum, its `ALL` and `NAMES` in declaration order, `as_str`,
/// `Display`, and a `FromStr` whose error lists every name. Each name is written once, here,
/// and serde uses the same one.
macro_rules! vocabulary {
    ($(#[$meta:meta])* $ty:ident ($kind:literal) { $($variant:ident = $name:literal),* $(,)? }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
        pub enum $ty {
            $(#[serde(rename = $name)] $variant),*
        }

        impl $ty {
            /// Every value, in declaration order.
            pub const ALL: &'static [$ty] = &[$($ty::$variant),*];
            /// Every wire name, in declaration order.
            pub const NAMES: &'static [&'static str] = &[$($name),*];
            /// The wire and storage name.
            pub const fn as_str(self) -> &'static str {
                match self { $($ty::$variant => $name),* }
            }
        }

        impl std::fmt::Display for $ty {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl std::str::FromStr for $ty {
            type Err = $crate::UnknownName;
            fn from_str(s: &str) -> Result<Self, $crate::UnknownName> {
                $ty::ALL.iter().copied().find(|v| v.as_str() == s).ok_or_else(|| $crate::UnknownName {
                    kind: $kind,
                    given: s.to_owned(),
                    expected: $ty::NAMES,
                })
            }
        }
    };
}
pub(crate) use vocabulary;

vocabulary!(
    /// The rule that raised an alert.
    Rule ("rule") {
        RankCollapse = "rank_collapse",
        SilentInconsistency = "silent_inconsistency",
        Nonfinite = "nonfinite",
        LossSpike = "loss_spike",
        ActivationOutlier = "activation_outlier",
        StaleRank = "stale_rank",
        ReplicaDivergence = "replica_divergence",
    }
);

vocabulary!(
    /// How urgent an alert is. Ordered: `Info < Warning < Critical`.
    Severity ("severity") {
        Info = "info",
        Warning = "warning",
        Critical = "critical",
    }
);

vocabulary!(
    /// Where an alert is in its lifecycle: pending → firing → resolved.
    AlertState ("alert state") {
        Pending = "pending",
        Firing = "firing",
        Resolved = "resolved",
    }
);
