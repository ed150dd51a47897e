//! Alert detectors (the rules of `docs/detection.md`): pure, deterministic state machines fed one observation
//! at a time. They never read a clock or storage; time arrives inside observations, so a
//! replay of the same observations gives the same alerts, ids included.
//!
//! Each rule decides, per observation and per subject (layer, rank, site), a [`Signal`]:
//! breach, clear, or hold (inside the hysteresis band between the enter and exit thresholds).
//! The shared [`lifecycle::AlertTracker`] turns signals into the pending → firing → resolved
//! lifecycle: `pending_for` breaches with no clear between them to fire (a hold, inside the
//! hysteresis band, neither adds nor resets), `resolve_after` consecutive clears to resolve, at
//! most one open alert per key. A detector returns an [`Alert`] snapshot whenever
//! one changes state or escalates in severity; nothing otherwise, so sinks are not flooded.
//!
//! Every threshold is in a serde struct with documented defaults ([`DetectorsConfig`]), loaded
//! from TOML by the collector; the defaults are starting points, not laws (the 0.5–2 band of
//! the spectral "1:1 rule" is not peer reviewed).

pub mod activation_outlier;
mod baseline;
pub mod config;
pub mod lifecycle;
pub mod loss_spike;
pub mod nonfinite;
mod pair;
mod peers;
pub mod rank_collapse;
pub mod replica_divergence;
mod same_batches;
mod shift;
pub mod silent_inconsistency;
pub mod stale_rank;
mod warmup;

pub use activation_outlier::{ActivationObservation, ActivationOutlier, ActivationOutlierConfig};
pub use config::DetectorsConfig;
pub use lifecycle::{AlertTracker, Breach, LifecycleConfig, Signal};
pub use loss_spike::{LossObservation, LossSpike, LossSpikeConfig};
pub use nonfinite::{Nonfinite, NonfiniteConfig, NonfiniteObservation};
pub use rank_collapse::{CollapseObservation, RankCollapse, RankCollapseConfig};
pub use replica_divergence::{
    RankFingerprint, ReplicaDivergence, ReplicaDivergenceConfig, ReplicaObservation, TENSORS_TAG,
};
pub use silent_inconsistency::{SilentInconsistency, SilentInconsistencyConfig, StepObservation};
pub use stale_rank::{RankActivity, StaleRank, StaleRankConfig};

use crate::alert::Alert;

/// A rule's state machine.
pub trait Detector {
    /// What the rule is fed.
    type Observation;
    /// Folds in one observation; returns the alerts that changed.
    fn observe(&mut self, observation: &Self::Observation) -> Vec<Alert>;
    /// The alerts currently open (pending or firing).
    fn open_alerts(&self) -> Vec<Alert>;
}

/// What the tests that find ranks reading the same data say of them: the bit-identical test
/// (`peers`) and the near-identical one (`same_batches`); the suggested action reads it.
pub(crate) const SAME_BATCHES: &str = "fed the same batches";

/// A number for an explanation: at most three decimals, trailing zeros dropped ("2.7"); in
/// powers of ten with three significant digits outside [0.001, 10⁶) ("2.07e36").
pub(crate) fn short(x: f64) -> String {
    if !x.is_finite() {
        return x.to_string();
    }
    // Three decimals read well between 0.001 and a million; outside it they print a bit-flipped
    // weight's 2e36 with 37 digits, or a small gradient norm as 0.
    if x != 0.0 && !(1e-3..1e6).contains(&x.abs()) {
        return format!("{x:.2e}");
    }
    let s = format!("{x:.3}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    if s == "-0" {
        "0".to_owned()
    } else {
        s.to_owned()
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn short_numbers() {
        assert_eq!(super::short(2.7), "2.7");
        assert_eq!(super::short(0.5), "0.5");
        assert_eq!(super::short(2.0), "2");
        assert_eq!(super::short(0.81234), "0.812");
        assert_eq!(super::short(f64::NAN), "NaN");
        assert_eq!(super::short(0.0), "0");
        assert_eq!(super::short(999_999.0), "999999");
        assert_eq!(super::short(1.966e36), "1.97e36");
        assert_eq!(super::short(-2.5e-5), "-2.50e-5");
    }
}
