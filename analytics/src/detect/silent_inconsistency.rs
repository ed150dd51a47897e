//! `silent_inconsistency`: data-parallel workers that quietly stop agreeing (arXiv 2602.14462).
//!
//! The averaged loss hides it; the per-rank values show it. Each step the rule computes the
//! cross-rank loss CV, gradient-norm CV and C_w ([`StepStats`]). The first `warmup_steps` steps
//! with data form a robust baseline for each (median, and a scale: 1.4826·MAD, floored at
//! `rel_floor`·|median| and `abs_floor` so a perfectly consistent warm-up — all ranks
//! identical — still gives a finite scale). After warm-up a step breaches when a dispersion's
//! robust z-score reaches `z_threshold`, or when C_w's falls that far *and* C_w is below the
//! cosine that sampling noise alone predicts (the gradient-noise-scale estimate from warm-up,
//! [`NoiseEstimate::expected_pair_cosine`], less `noise_margin`). It clears when every z-score
//! is back under `z_exit`. Ranks are named by their robust z-score across ranks (loss, gradient
//! norm, and low cos_to_mean) when it reaches `rank_z`; naming needs at least three ranks.

use serde::{Deserialize, Serialize};

use super::lifecycle::{Breach, LifecycleConfig, Signal, Trackers};
use super::{Detector, short};
use crate::alert::{Alert, AlertKey, Rule, Severity};
use crate::error::{Error, Result};
use crate::math::dispersion::{Dispersion, MAD_TO_SIGMA, robust_z_scores};
use crate::math::noise::NoiseEstimate;
use crate::math::step::{RankValues, StepStats};
use crate::validate::RunId;

/// Thresholds of `silent_inconsistency`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SilentInconsistencyConfig {
    /// Steps (with data) that form the baseline; nothing fires before. Default 30.
    pub warmup_steps: usize,
    /// Robust z-score that breaches. Default 6.
    pub z_threshold: f64,
    /// Every z-score must be below this to clear. Default 3.
    pub z_exit: f64,
    /// Baseline scale floor relative to the baseline median. Default 0.05.
    pub rel_floor: f64,
    /// Absolute baseline scale floor (CVs and cosines are unitless). Default 0.001.
    pub abs_floor: f64,
    /// C_w must be this far below the noise-predicted cosine too. Default 0.05.
    pub noise_margin: f64,
    /// Cross-rank robust z-score that names a rank. Default 3.5.
    pub rank_z: f64,
    /// Cross-rank scale floor relative to the median, so identical ranks give finite scores.
    /// Default 0.01.
    pub rank_rel_floor: f64,
    /// Default: fire after 3 breaching steps, resolve after 10 clear ones.
    pub lifecycle: LifecycleConfig,
}

impl Default for SilentInconsistencyConfig {
    fn default() -> Self {
        SilentInconsistencyConfig {
            warmup_steps: 30,
            z_threshold: 6.0,
            z_exit: 3.0,
            rel_floor: 0.05,
            abs_floor: 1e-3,
            noise_margin: 0.05,
            rank_z: 3.5,
            rank_rel_floor: 0.01,
            lifecycle: LifecycleConfig {
                pending_for: 3,
                resolve_after: 10,
            },
        }
    }
}

impl SilentInconsistencyConfig {
    /// Checks the thresholds are coherent.
    pub fn validate(&self) -> Result<()> {
        let ok = self.warmup_steps >= 5
            && self.z_threshold > 0.0
            && self.z_exit > 0.0
            && self.z_exit <= self.z_threshold
            && self.rel_floor >= 0.0
            && self.abs_floor > 0.0
            && self.noise_margin >= 0.0
            && self.rank_z > 0.0
            && self.rank_rel_floor > 0.0;
        if !ok {
            return Err(Error::Config(format!(
                "silent_inconsistency: need warmup_steps ≥ 5, 0 < z_exit ≤ z_threshold, positive floors and rank_z; got {self:?}"
            )));
        }
        self.lifecycle.validate("silent_inconsistency")
    }
}

type Getter = fn(&RankValues) -> Option<f64>;

/// Every rank's values at one step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepObservation {
    pub step: u64,
    pub time_ms: i64,
    pub world_size: u32,
    pub ranks: Vec<RankValues>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
struct Baseline {
    median: f64,
    scale: f64,
}

impl Baseline {
    fn learn(values: &[f64], rel_floor: f64, abs_floor: f64) -> Option<Self> {
        let d = Dispersion::of(values)?;
        let scale = (MAD_TO_SIGMA * d.mad)
            .max(rel_floor * d.median.abs())
            .max(abs_floor);
        Some(Baseline {
            median: d.median,
            scale,
        })
    }
    fn z(&self, x: f64) -> f64 {
        (x - self.median) / self.scale
    }
}

#[derive(Debug, Clone, Default)]
struct Warmup {
    loss_cv: Vec<f64>,
    grad_cv: Vec<f64>,
    cos: Vec<f64>,
    signal_sq: Vec<f64>,
    noise_sq: Vec<f64>,
    steps: usize,
}

#[derive(Debug, Clone)]
struct Baselines {
    loss_cv: Option<Baseline>,
    grad_cv: Option<Baseline>,
    cos: Option<Baseline>,
    noise_cosine: Option<f64>,
}

/// The `silent_inconsistency` detector for one run.
#[derive(Debug, Clone)]
pub struct SilentInconsistency {
    run: RunId,
    config: SilentInconsistencyConfig,
    warmup: Warmup,
    baselines: Option<Baselines>,
    trackers: Trackers<()>,
}

impl SilentInconsistency {
    /// A detector for `run`.
    pub fn new(run: RunId, config: SilentInconsistencyConfig) -> Result<Self> {
        config.validate()?;
        Ok(SilentInconsistency {
            run,
            config,
            warmup: Warmup::default(),
            baselines: None,
            trackers: Trackers::new(),
        })
    }

    /// Whether the warm-up baseline is in place.
    pub fn is_warmed_up(&self) -> bool {
        self.baselines.is_some()
    }

    /// Ranks whose values deviate from the other ranks', most deviant first, with their score.
    pub fn outlier_ranks(&self, ranks: &[RankValues]) -> Vec<(u32, f64)> {
        if ranks.len() < 3 {
            return vec![];
        }
        let mut score = vec![0.0f64; ranks.len()];
        let columns: [(Getter, f64); 3] = [
            (|r| r.loss, 1.0),
            (|r| r.grad_norm, 1.0),
            (|r| r.cos_to_mean, -1.0),
        ];
        for (get, direction) in columns {
            let values: Vec<f64> = ranks.iter().map(|r| get(r).unwrap_or(f64::NAN)).collect();
            let Some(d) = Dispersion::of(&values) else {
                continue;
            };
            let floor = self.config.rank_rel_floor * d.median.abs().max(1e-12);
            for (s, z) in score.iter_mut().zip(robust_z_scores(&values, floor)) {
                // For loss and norm either direction is suspicious; for cosine only low.
                let z = if direction < 0.0 { -z } else { z.abs() };
                if z.is_finite() {
                    *s = s.max(z);
                }
            }
        }
        let mut named: Vec<(u32, f64)> = ranks
            .iter()
            .zip(score)
            .filter(|(_, s)| *s >= self.config.rank_z)
            .map(|(r, s)| (r.rank, s))
            .collect();
        named.sort_by(|a, b| b.1.total_cmp(&a.1));
        named
    }

    fn learn(&mut self, stats: &StepStats) {
        let w = &mut self.warmup;
        let push = |v: &mut Vec<f64>, x: Option<f64>| v.extend(x.filter(|x| x.is_finite()));
        push(
            &mut w.loss_cv,
            stats.loss.filter(|d| d.count >= 2).and_then(|d| d.cv),
        );
        push(
            &mut w.grad_cv,
            stats.grad_norm.filter(|d| d.count >= 2).and_then(|d| d.cv),
        );
        push(&mut w.cos, stats.cos_weighted);
        if let Some(n) = stats.noise {
            push(&mut w.signal_sq, Some(n.signal_sq));
            push(&mut w.noise_sq, Some(n.noise_sq));
        }
        w.steps += 1;
        if w.steps < self.config.warmup_steps {
            return;
        }
        let (rel, abs) = (self.config.rel_floor, self.config.abs_floor);
        let mean = |v: &[f64]| (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64);
        // Average the moments before dividing, as for the noise scale itself.
        let noise_cosine = match (mean(&w.signal_sq), mean(&w.noise_sq)) {
            (Some(signal_sq), Some(noise_sq)) if signal_sq > 0.0 && noise_sq >= 0.0 => Some(
                NoiseEstimate {
                    signal_sq,
                    noise_sq,
                }
                .expected_pair_cosine(),
            ),
            _ => None,
        };
        self.baselines = Some(Baselines {
            loss_cv: Baseline::learn(&w.loss_cv, rel, abs),
            grad_cv: Baseline::learn(&w.grad_cv, rel, abs),
            // C_w lives in [-1, 1]: its floor is relative to 1, not to its median.
            cos: Baseline::learn(&w.cos, 0.0, abs.max(rel * 0.1)),
            noise_cosine,
        });
    }

    fn signal(&self, b: &Baselines, stats: &StepStats, obs: &StepObservation) -> Signal {
        let c = &self.config;
        let loss_cv = stats.loss.filter(|d| d.count >= 2).and_then(|d| d.cv);
        let grad_cv = stats.grad_norm.filter(|d| d.count >= 2).and_then(|d| d.cv);
        let z_loss = b.loss_cv.zip(loss_cv).map(|(b, x)| b.z(x));
        let z_grad = b.grad_cv.zip(grad_cv).map(|(b, x)| b.z(x));
        let z_cos = b.cos.zip(stats.cos_weighted).map(|(b, x)| -b.z(x));
        let below_noise = match (stats.cos_weighted, b.noise_cosine) {
            (Some(cw), Some(expected)) => cw < expected - c.noise_margin,
            (Some(_), None) => true,
            _ => false,
        };
        let mut reasons = Vec::new();
        let mut worst = 0.0f64;
        let mut check = |z: Option<f64>, gate: bool, text: &dyn Fn(f64) -> String| {
            if let Some(z) = z.filter(|z| *z >= c.z_threshold && gate) {
                worst = worst.max(z);
                reasons.push(text(z));
            }
        };
        check(z_loss, true, &|z| {
            format!(
                "loss CV {} vs baseline {} (z={:.1})",
                short(loss_cv.unwrap_or(f64::NAN)),
                short(b.loss_cv.map_or(f64::NAN, |b| b.median)),
                z
            )
        });
        check(z_grad, true, &|z| {
            format!(
                "gradient-norm CV {} vs baseline {} (z={:.1})",
                short(grad_cv.unwrap_or(f64::NAN)),
                short(b.grad_cv.map_or(f64::NAN, |b| b.median)),
                z
            )
        });
        check(z_cos, below_noise, &|z| {
            let noise = b
                .noise_cosine
                .map(|n| format!(", noise predicts {}", short(n)))
                .unwrap_or_default();
            format!(
                "worker cosine C_w {} vs baseline {}{noise} (z={:.1})",
                short(stats.cos_weighted.unwrap_or(f64::NAN)),
                short(b.cos.map_or(f64::NAN, |b| b.median)),
                z
            )
        });
        if !reasons.is_empty() {
            let named = self.outlier_ranks(&obs.ranks);
            let who = match named.as_slice() {
                [] => String::new(),
                [(r, s)] => format!("; outlier rank {r} (z={s:.1})"),
                many => format!(
                    "; outlier ranks {}",
                    many.iter()
                        .map(|(r, _)| r.to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            };
            return Signal::Breach(Breach {
                severity: Severity::Warning,
                value: worst,
                threshold: c.z_threshold,
                explanation: format!("workers disagree: {}{who}", reasons.join("; ")),
                outlier_ranks: named.into_iter().map(|(r, _)| r).collect(),
            });
        }
        let zs = [z_loss, z_grad, z_cos];
        if zs.iter().all(Option::is_none) {
            Signal::Hold
        } else if zs.iter().flatten().all(|z| *z < c.z_exit) {
            Signal::Clear
        } else {
            Signal::Hold
        }
    }
}

impl Detector for SilentInconsistency {
    type Observation = StepObservation;

    fn observe(&mut self, obs: &StepObservation) -> Vec<Alert> {
        let stats = StepStats::compute(&obs.ranks, obs.world_size);
        let Some(baselines) = self.baselines.clone() else {
            self.learn(&stats);
            return vec![];
        };
        let signal = self.signal(&baselines, &stats, obs);
        let key = || AlertKey {
            run: self.run.clone(),
            rule: Rule::SilentInconsistency,
            layer: None,
            site: None,
            rank: None,
        };
        self.trackers
            .observe(
                &(),
                key,
                obs.step,
                obs.time_ms,
                signal,
                &self.config.lifecycle,
            )
            .into_iter()
            .collect()
    }

    fn open_alerts(&self) -> Vec<Alert> {
        self.trackers.open()
    }
}
