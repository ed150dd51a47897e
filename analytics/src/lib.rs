//! The rankwatch domain: what is measured, how it is computed, and when it is worth an alert.
//!
//! This crate has no I/O. It is shared by the in-process agent, the collector daemon and the
//! web dashboard (which compiles it to wasm), so every party agrees on one vocabulary
//! ([`vocab`]), one set of record types ([`record`], [`alert`]), one Arrow layout per table
//! ([`schema`]), one implementation of the metric math ([`math`]) and one set of alert
//! detectors ([`detect`]). `docs/architecture.md` and `docs/detection.md` give the metric
//! definitions and the alert rules; where a formula is not obvious, the module that implements
//! it states it.

pub mod advice;
#[cfg(feature = "test-support")]
pub mod agent_mix;
pub mod alert;
pub mod consistency;
pub mod detect;
pub mod error;
pub mod incident;
pub mod math;
pub mod record;
pub mod schema;
#[cfg(feature = "test-support")]
pub mod simulate;
pub mod validate;
pub mod vocab;

pub use alert::{Alert, AlertState, Rule, Severity};
pub use error::{Error, Result};
pub use record::{AttentionShape, LayerLayout, ModelLayout, RunInfo, Sample, SketchRecord};
pub use validate::{MetricName, RunId, random_hex_id};
pub use vocab::{Metric, Scope, Site};
