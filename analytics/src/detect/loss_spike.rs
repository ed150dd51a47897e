//! `loss_spike`: a loss far above its recent level. The baseline is the median and MAD of the
//! last `window` finite losses of the same series (a rank, or the all-ranks mean), so a single
//! spike barely moves it; a breach needs both a robust z-score of `z_threshold` and a relative
//! jump of `min_relative_jump`, so a flat, nearly noiseless loss does not alert on tiny wiggles.
//!
//! A breach must repeat before the loss falls back below `z_exit` (`pending_for` 2), unless it
//! is `immediate_z` or more above the noise. Why: the loss of one small batch has a heavy right
//! tail — a batch of unusual text. On 30 healthy single-process runs of real text (600 steps,
//! `bench/detection_collapse.py`), one-step spikes of +15–21 % reached z 6.2–7.5, at the same
//! step of the same data seed in every model (the batch, not the model), and fired 5 alerts.
//! The robust z is scale-free, so the tail it allows is the shape of the batch-hardness
//! distribution, not how noisy the loss is; the model's largest spikes there (an unstable deep
//! post-LN model, a learning-rate ramp: z 13–54) still fire on their first step.
//! What it costs: a one-step spike of the model under z 12 (two learning-rate-ramp steps at
//! z 9.0 and 10.8, three steps at z 6–7 of the deep model trained without warm-up) and a rise
//! that crosses z 6 once and then hovers between `z_exit` and `z_threshold` (a data-mix switch
//! in the healthy matrix, +17–22 % at z 6.2 and 6.4, which fired before and would not now;
//! a rank fed shuffled labels lifting the mean loss ~11 %, which `silent_inconsistency`
//! reports) are not reported.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

use super::lifecycle::{Breach, LifecycleConfig, Signal, Trackers};
use super::{Detector, short};
use crate::alert::{Alert, Rule, Severity};
use crate::error::{Error, Result};
use crate::math::dispersion::{Dispersion, MAD_TO_SIGMA};
use crate::validate::RunId;

/// Thresholds of `loss_spike`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LossSpikeConfig {
    /// Recent losses in the baseline. Default 50.
    pub window: usize,
    /// Losses needed before anything can fire. Default 20.
    pub min_history: usize,
    /// Robust z-score that breaches. Default 6.
    pub z_threshold: f64,
    /// Robust z-score below which it clears. Default 3.
    pub z_exit: f64,
    /// The loss must also exceed the median by this fraction of it. Default 0.1.
    pub min_relative_jump: f64,
    /// A breach at this robust z-score or above fires at once, whatever `pending_for` says; at
    /// or below `z_threshold`, every breach does (the rule as it was before the repeat was
    /// asked for). Default 12.
    pub immediate_z: f64,
    /// Default: fire on the second breach (or one at `immediate_z`), resolve after 5 clear
    /// observations.
    pub lifecycle: LifecycleConfig,
}

impl Default for LossSpikeConfig {
    fn default() -> Self {
        LossSpikeConfig {
            window: 50,
            min_history: 20,
            z_threshold: 6.0,
            z_exit: 3.0,
            min_relative_jump: 0.1,
            immediate_z: 12.0,
            lifecycle: LifecycleConfig {
                pending_for: 2,
                resolve_after: 5,
            },
        }
    }
}

impl LossSpikeConfig {
    /// Checks the thresholds are coherent.
    pub fn validate(&self) -> Result<()> {
        let ok = self.window >= 5
            && (3..=self.window).contains(&self.min_history)
            && self.z_exit > 0.0
            && self.z_exit <= self.z_threshold
            && self.immediate_z > 0.0
            && self.min_relative_jump >= 0.0;
        if !ok {
            return Err(Error::Config(format!(
                "loss_spike: need window ≥ 5, 3 ≤ min_history ≤ window, 0 < z_exit ≤ z_threshold, immediate_z > 0; got {self:?}"
            )));
        }
        self.lifecycle.validate("loss_spike")
    }
}

/// One loss value of one series.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LossObservation {
    pub step: u64,
    pub time_ms: i64,
    /// `None` for the all-ranks loss.
    pub rank: Option<u32>,
    pub loss: f64,
}

/// The `loss_spike` detector for one run, per series.
#[derive(Debug, Clone)]
pub struct LossSpike {
    config: LossSpikeConfig,
    history: std::collections::BTreeMap<Option<u32>, VecDeque<f64>>,
    trackers: Trackers<Option<u32>>,
}

impl LossSpike {
    /// A detector for `run`.
    pub fn new(run: RunId, config: LossSpikeConfig) -> Result<Self> {
        config.validate()?;
        Ok(LossSpike {
            config,
            history: Default::default(),
            trackers: Trackers::new(run, Rule::LossSpike, |rank| (None, None, *rank)),
        })
    }
}

impl Detector for LossSpike {
    type Observation = LossObservation;

    fn observe(&mut self, obs: &LossObservation) -> Vec<Alert> {
        // Non-finite losses are the `nonfinite` rule's business.
        if !obs.loss.is_finite() {
            return vec![];
        }
        let c = self.config;
        let mut lifecycle = c.lifecycle;
        let history = self.history.entry(obs.rank).or_default();
        let signal = match Dispersion::of(history.make_contiguous()) {
            Some(d) if history.len() >= c.min_history => {
                let scale = (MAD_TO_SIGMA * d.mad).max(1e-3 * d.median.abs()).max(1e-12);
                let z = (obs.loss - d.median) / scale;
                let jump = obs.loss - d.median;
                if z >= c.z_threshold && jump >= c.min_relative_jump * d.median.abs() {
                    if z >= c.immediate_z {
                        lifecycle.pending_for = 1;
                    }
                    let who = obs
                        .rank
                        .map_or_else(|| "all ranks".to_owned(), |r| format!("rank {r}"));
                    Signal::Breach(Breach {
                        severity: Severity::Warning,
                        value: obs.loss,
                        threshold: d.median + c.z_threshold * scale,
                        explanation: format!(
                            "{who}: loss {} spiked above its recent median {} ({:+.0}%, z={z:.1})",
                            short(obs.loss),
                            short(d.median),
                            100.0 * jump / d.median.abs().max(1e-12)
                        ),
                        outlier_ranks: obs.rank.into_iter().collect(),
                    })
                } else if z < c.z_exit {
                    Signal::Clear
                } else {
                    Signal::Hold
                }
            }
            _ => Signal::Hold,
        };
        history.push_back(obs.loss);
        while history.len() > c.window {
            history.pop_front();
        }
        self.trackers
            .observe(&obs.rank, obs.step, obs.time_ms, signal, &lifecycle)
    }

    fn open_alerts(&self) -> Vec<Alert> {
        self.trackers.open()
    }
}
