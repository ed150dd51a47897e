//! `activation_outlier`: an activation maximum that exceeds an absolute limit (off by default;
//! [`FP8_E4M3_MAX`], 448, is the value to set for a model cast to FP8 without scaling) or grows by
//! `growth_factor` over its own baseline: the median of its values over the last
//! `baseline_steps` steps after `warmup_steps`, once there are `baseline_observations` of them.
//! Activations grow several-fold from their initial scale in healthy training, so a baseline
//! taken at initialisation calls ordinary learning an outlier; and they keep growing long after
//! any fixed warm-up (a 4-layer byte-level GPT on real text: attention outputs 0.09 at step 150,
//! 1.0 at step 475, with a 100-step learning-rate warm-up), so a baseline learned once, early,
//! does too — it fired on 2 of 14 healthy runs of the detection benchmark. A trailing median
//! follows that growth and still sees a sudden jump; what it cannot see is growth slower than
//! about `growth_factor` per `baseline_steps`/2 steps, which it absorbs.
//! A non-finite maximum is critical. It clears once the value is below `exit_ratio` of every
//! limit it can breach.
//!
//! Why no absolute limit by default: healthy pretrained LLMs carry residual-stream maxima of
//! 10²–10⁵ (the massive activations of a few channels), and FP8 recipes scale each tensor before
//! the cast (Transformer Engine's delayed scaling), so 448 on an unscaled value says nothing
//! about saturation. Growth over the site's own baseline is what the rule judges unless told
//! otherwise.

use serde::{Deserialize, Serialize};

use super::baseline::TrailingMedian;
use super::lifecycle::{Breach, LifecycleConfig, Signal, Trackers};
use super::{Detector, short};

use crate::alert::{Alert, Rule, Severity};
use crate::error::{Error, Result};
use crate::validate::RunId;
use crate::vocab::Site;

/// A growth factor: one decimal (10.7×), in powers of ten past a million.
fn growth(x: f64) -> String {
    if x.is_finite() && x.abs() < 1e6 {
        format!("{x:.1}")
    } else {
        short(x)
    }
}

/// The largest finite value of FP8 E4M3.
pub const FP8_E4M3_MAX: f64 = 448.0;

/// Thresholds of `activation_outlier`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ActivationOutlierConfig {
    /// Absolute limit on max|a|; `None` disables it. Default off.
    pub absolute_limit: Option<f64>,
    /// Growth over the baseline that breaches; `None` disables it. Default 10.
    pub growth_factor: Option<f64>,
    /// Steps whose values do not enter the baseline (initialisation). Default 50.
    pub warmup_steps: u64,
    /// Observations after the warm-up needed before the baseline judges. Default 5.
    pub baseline_observations: usize,
    /// Steps of history in the trailing median. Default 1,000.
    pub baseline_steps: u64,
    /// To clear, the value must be below this fraction of each limit. Default 0.8.
    pub exit_ratio: f64,
    /// Default: fire after 2 breaching observations, resolve after 3 clear ones.
    pub lifecycle: LifecycleConfig,
}

impl Default for ActivationOutlierConfig {
    fn default() -> Self {
        ActivationOutlierConfig {
            absolute_limit: None,
            growth_factor: Some(10.0),
            warmup_steps: 50,
            baseline_observations: 5,
            baseline_steps: 1000,
            exit_ratio: 0.8,
            lifecycle: LifecycleConfig {
                pending_for: 2,
                resolve_after: 3,
            },
        }
    }
}

impl ActivationOutlierConfig {
    /// Checks the limits are coherent.
    pub fn validate(&self) -> Result<()> {
        let ok = self.absolute_limit.is_none_or(|l| l > 0.0)
            && self.growth_factor.is_none_or(|g| g > 1.0)
            && self.baseline_observations >= 1
            && self.baseline_steps >= 1
            && self.exit_ratio > 0.0
            && self.exit_ratio <= 1.0;
        if !ok {
            return Err(Error::Config(format!(
                "activation_outlier: need absolute_limit > 0, growth_factor > 1, baseline_observations ≥ 1, baseline_steps ≥ 1, 0 < exit_ratio ≤ 1; got {self:?}"
            )));
        }
        self.lifecycle.validate("activation_outlier")
    }
}

/// One activation maximum.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ActivationObservation {
    pub step: u64,
    pub time_ms: i64,
    /// `None` for model-level sites (embed, final_norm).
    pub layer: Option<u32>,
    pub site: Site,
    pub rank: Option<u32>,
    pub value: f64,
}

type Subject = (Option<u32>, Site, Option<u32>);

/// The `activation_outlier` detector for one run, per (layer, site, rank).
#[derive(Debug, Clone)]
pub struct ActivationOutlier {
    config: ActivationOutlierConfig,
    /// Hashed: every `act_max` row looks its subject up (ranks × layers × sites of them), and
    /// nothing reads them in order.
    baselines: foldhash::HashMap<Subject, TrailingMedian>,
    trackers: Trackers<Subject>,
}

impl ActivationOutlier {
    /// A detector for `run`.
    pub fn new(run: RunId, config: ActivationOutlierConfig) -> Result<Self> {
        config.validate()?;
        Ok(ActivationOutlier {
            config,
            baselines: Default::default(),
            trackers: Trackers::new(run, Rule::ActivationOutlier, |&(layer, site, rank)| {
                (layer, Some(site), rank)
            }),
        })
    }
}

impl Detector for ActivationOutlier {
    type Observation = ActivationObservation;

    fn observe(&mut self, obs: &ActivationObservation) -> Vec<Alert> {
        let c = self.config;
        let subject = (obs.layer, obs.site, obs.rank);
        let baseline = self.baselines.entry(subject).or_default();
        let baseline = if obs.step >= c.warmup_steps {
            baseline.update(
                obs.step,
                obs.value.abs(),
                c.baseline_steps,
                c.baseline_observations,
            )
        } else {
            None
        };
        // Where the value was taken, for an explanation; built only on a breach.
        let place = || match obs.layer {
            Some(l) => format!("layer {l} {}", obs.site),
            None => obs.site.to_string(),
        };
        let on = || {
            obs.rank
                .map(|r| format!(" on rank {r}"))
                .unwrap_or_default()
        };
        let v = obs.value.abs();
        let growth_limit = baseline
            .zip(c.growth_factor)
            .map(|(b, g)| b * g)
            .filter(|l| *l > 0.0);
        // No outlier ranks: the alert's `rank` grew against its own past, which makes it an
        // outlier among ranks only if the others did not (the incident tells which).
        let signal = if !v.is_finite() {
            Signal::Breach(Breach {
                severity: Severity::Critical,
                value: obs.value,
                threshold: c.absolute_limit.unwrap_or(f64::MAX),
                explanation: format!("{}: activation maximum is {}{}", place(), obs.value, on()),
                outlier_ranks: vec![],
            })
        } else if let Some(limit) = c.absolute_limit.filter(|l| v >= *l) {
            Signal::Breach(Breach {
                severity: Severity::Warning,
                value: v,
                threshold: limit,
                explanation: format!(
                    "{}: activation maximum {} above the absolute limit {}{}",
                    place(),
                    short(v),
                    short(limit),
                    on()
                ),
                outlier_ranks: vec![],
            })
        } else if let Some(limit) = growth_limit.filter(|l| v >= *l) {
            let b = baseline.unwrap_or(f64::NAN);
            Signal::Breach(Breach {
                severity: Severity::Warning,
                value: v,
                threshold: limit,
                explanation: format!(
                    "{}: activation maximum {} grew {}× over its baseline {}{}",
                    place(),
                    short(v),
                    growth(v / b),
                    short(b),
                    on()
                ),
                outlier_ranks: vec![],
            })
        } else {
            let under = |limit: Option<f64>| limit.is_none_or(|l| v < c.exit_ratio * l);
            if under(c.absolute_limit) && under(growth_limit) {
                Signal::Clear
            } else {
                Signal::Hold
            }
        };
        self.trackers
            .observe(&subject, obs.step, obs.time_ms, signal, &c.lifecycle)
    }

    fn open_alerts(&self) -> Vec<Alert> {
        self.trackers.open()
    }
}
