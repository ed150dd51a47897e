//! Floats on the wire. JSON has no NaN or infinity, and a non-finite value is exactly what a
//! user must see (a loss that diverged), so [`Num`] writes them as the strings `"NaN"`,
//! `"Infinity"` and `"-Infinity"`. Reading is a little more forgiving, as the JSON ingest form
//! always was: `"nan"`, `"inf"`, `"+Infinity"` and `"-inf"` too ([`non_finite`]), and nothing
//! else. `Option<Num>` is the nullable form: `null` when there is no value at all.

use std::fmt;

use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// An `f64` whose non-finite values travel as strings.
///
/// Two `Num`s are equal when their bits are, so a NaN equals itself: what a round trip
/// through JSON must preserve.
#[derive(Debug, Clone, Copy, Default)]
pub struct Num(pub f64);

/// The string spellings of the non-finite values, in the order NaN, +∞, −∞.
pub(crate) const NON_FINITE: [&str; 3] = ["NaN", "Infinity", "-Infinity"];

/// Every spelling read as a non-finite value: the written forms and the lenient ones.
pub(crate) const ACCEPTED: [(&str, f64); 7] = [
    ("NaN", f64::NAN),
    ("nan", f64::NAN),
    ("Infinity", f64::INFINITY),
    ("inf", f64::INFINITY),
    ("+Infinity", f64::INFINITY),
    ("-Infinity", f64::NEG_INFINITY),
    ("-inf", f64::NEG_INFINITY),
];

/// The non-finite value a string spells, if it spells one: the written forms `"NaN"`,
/// `"Infinity"`, `"-Infinity"` and the accepted `"nan"`, `"inf"`, `"+Infinity"`, `"-inf"`.
pub fn non_finite(text: &str) -> Option<f64> {
    ACCEPTED
        .iter()
        .find(|(spelling, _)| *spelling == text)
        .map(|&(_, value)| value)
}

impl Num {
    /// The value, whatever it is.
    pub fn get(self) -> f64 {
        self.0
    }

    /// The value when it is a finite number.
    pub fn finite(self) -> Option<f64> {
        self.0.is_finite().then_some(self.0)
    }
}

impl PartialEq for Num {
    fn eq(&self, other: &Self) -> bool {
        self.0.to_bits() == other.0.to_bits() || (self.0.is_nan() && other.0.is_nan())
    }
}

impl From<f64> for Num {
    fn from(v: f64) -> Self {
        Num(v)
    }
}

impl Serialize for Num {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let v = self.0;
        if v.is_finite() {
            s.serialize_f64(v)
        } else if v.is_nan() {
            s.serialize_str(NON_FINITE[0])
        } else if v > 0.0 {
            s.serialize_str(NON_FINITE[1])
        } else {
            s.serialize_str(NON_FINITE[2])
        }
    }
}

impl<'de> Deserialize<'de> for Num {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(NumVisitor)
    }
}

struct NumVisitor;

impl Visitor<'_> for NumVisitor {
    type Value = Num;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(r#"a number or one of "NaN", "Infinity", "-Infinity""#)
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Num, E> {
        Ok(Num(v))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Num, E> {
        Ok(Num(v as f64))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Num, E> {
        Ok(Num(v as f64))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Num, E> {
        non_finite(v)
            .map(Num)
            .ok_or_else(|| E::invalid_value(de::Unexpected::Str(v), &self))
    }
}
