//! `nonfinite`: NaN or ±Inf in a rank's loss or gradients. Critical at the first occurrence
//! (there is no healthy amount), resolved after `resolve_after` clean observations.

use serde::{Deserialize, Serialize};

use super::Detector;
use super::lifecycle::{Breach, LifecycleConfig, Signal, Trackers};
use crate::alert::{Alert, Rule, Severity};
use crate::error::Result;
use crate::validate::RunId;

/// Persistence of `nonfinite`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NonfiniteConfig {
    /// Default: fire at once, resolve after 10 clean observations.
    pub lifecycle: LifecycleConfig,
}

impl Default for NonfiniteConfig {
    fn default() -> Self {
        NonfiniteConfig {
            lifecycle: LifecycleConfig {
                pending_for: 1,
                resolve_after: 10,
            },
        }
    }
}

/// One rank's count at one step; `loss` is checked too when given.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct NonfiniteObservation {
    pub step: u64,
    pub time_ms: i64,
    pub rank: Option<u32>,
    /// NaN/Inf values counted in the loss and gradients.
    pub count: u64,
    pub loss: Option<f64>,
}

/// The `nonfinite` detector for one run, per rank.
#[derive(Debug, Clone)]
pub struct Nonfinite {
    config: NonfiniteConfig,
    trackers: Trackers<Option<u32>>,
}

impl Nonfinite {
    /// A detector for `run`.
    pub fn new(run: RunId, config: NonfiniteConfig) -> Result<Self> {
        config.lifecycle.validate("nonfinite")?;
        Ok(Nonfinite {
            config,
            trackers: Trackers::new(run, Rule::Nonfinite, |rank| (None, None, *rank)),
        })
    }
}

impl Detector for Nonfinite {
    type Observation = NonfiniteObservation;

    fn observe(&mut self, obs: &NonfiniteObservation) -> Vec<Alert> {
        let bad_loss = obs.loss.is_some_and(|l| !l.is_finite());
        let signal = if obs.count > 0 || bad_loss {
            let who = obs
                .rank
                .map_or_else(|| "all ranks".to_owned(), |r| format!("rank {r}"));
            let what = match (obs.count, obs.loss) {
                (0, Some(l)) => format!("loss is {l}"),
                (n, Some(l)) if bad_loss => format!("loss is {l} and {n} non-finite values"),
                (n, _) => format!("{n} non-finite values (NaN/Inf) in loss and gradients"),
            };
            Signal::Breach(Breach {
                severity: Severity::Critical,
                value: obs.count as f64,
                threshold: 0.0,
                explanation: format!("{who}: {what} at step {}", obs.step),
                outlier_ranks: obs.rank.into_iter().collect(),
            })
        } else {
            Signal::Clear
        };
        self.trackers.observe(
            &obs.rank,
            obs.step,
            obs.time_ms,
            signal,
            &self.config.lifecycle,
        )
    }

    fn open_alerts(&self) -> Vec<Alert> {
        self.trackers.open()
    }
}
