//! `rank_collapse`: a layer's MLP/attention spectral ratio leaving its healthy band, or
//! trending out of it, and — critical — its token cosine approaching 1.
//!
//! The ratio σ_mlp/σ_attn is an early, indirect signal (the public "1:1 rule"); token cosine,
//! the mean pairwise cosine of token states, is the direct one (Noci et al. 2022). The rule
//! fires a warning when the ratio stays outside `[band_low, band_high]` for `pending_for`
//! observations, or when a least-squares fit of log(ratio) over the last `trend_window`
//! observations has a slope with t-statistic ≥ `trend_min_t` that projects it out of the band
//! within `trend_horizon` observations. It is critical once token cosine reaches
//! `token_cosine_critical`. It clears only when the ratio is back inside the band shrunk by
//! `exit_margin` and token cosine is below `token_cosine_exit` (hysteresis).

use std::collections::{BTreeMap, VecDeque};

use serde::{Deserialize, Serialize};

use super::lifecycle::{Breach, LifecycleConfig, Signal, Trackers};
use super::{Detector, short};
use crate::alert::{Alert, Rule, Severity};
use crate::error::{Error, Result};
use crate::validate::RunId;

/// Thresholds of `rank_collapse`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RankCollapseConfig {
    /// Lower edge of the healthy ratio band. Default 0.5.
    pub band_low: f64,
    /// Upper edge of the healthy ratio band. Default 2.0.
    pub band_high: f64,
    /// To clear, the ratio must be inside [low·(1+m), high/(1+m)]. Default 0.05.
    pub exit_margin: f64,
    /// Observations in the trend fit (0 disables the trend test). Default 8.
    pub trend_window: usize,
    /// How far ahead, in observations, the trend may project out of the band. Default 10.
    pub trend_horizon: f64,
    /// Minimum |t| of the fitted slope for a trend to count. Default 4.
    pub trend_min_t: f64,
    /// Token cosine at or above this is critical. Default 0.9.
    pub token_cosine_critical: f64,
    /// Token cosine must fall below this to clear. Default 0.8.
    pub token_cosine_exit: f64,
    /// Default: fire after 3 breaching observations, resolve after 3 clear ones.
    pub lifecycle: LifecycleConfig,
}

impl Default for RankCollapseConfig {
    fn default() -> Self {
        RankCollapseConfig {
            band_low: 0.5,
            band_high: 2.0,
            exit_margin: 0.05,
            trend_window: 8,
            trend_horizon: 10.0,
            trend_min_t: 4.0,
            token_cosine_critical: 0.9,
            token_cosine_exit: 0.8,
            lifecycle: LifecycleConfig {
                pending_for: 3,
                resolve_after: 3,
            },
        }
    }
}

impl RankCollapseConfig {
    /// Checks the band and thresholds are coherent.
    pub fn validate(&self) -> Result<()> {
        let ok = self.band_low > 0.0
            && self.band_high > self.band_low
            && self.exit_margin >= 0.0
            && self.band_low * (1.0 + self.exit_margin) < self.band_high / (1.0 + self.exit_margin)
            && (self.trend_window == 0 || self.trend_window >= 3)
            && self.trend_horizon >= 0.0
            && self.trend_min_t > 0.0
            && self.token_cosine_exit <= self.token_cosine_critical;
        if !ok {
            return Err(Error::Config(format!(
                "rank_collapse: need 0 < band_low < band_high with room for exit_margin, \
                 trend_window 0 or ≥ 3, trend_min_t > 0 and token_cosine_exit ≤ token_cosine_critical; got {self:?}"
            )));
        }
        self.lifecycle.validate("rank_collapse")
    }
}

/// What one probe of one layer measured; either value may be absent (different cadences).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct CollapseObservation {
    pub step: u64,
    pub time_ms: i64,
    pub layer: u32,
    pub ratio: Option<f64>,
    pub token_cosine: Option<f64>,
}

/// Which values arrived with the current observation.
#[derive(Debug, Clone, Copy)]
struct Fresh {
    ratio: bool,
    token_cosine: bool,
}

#[derive(Debug, Clone, Default)]
struct LayerState {
    log_ratios: VecDeque<f64>,
    ratio: Option<f64>,
    token_cosine: Option<f64>,
    previous_token_cosine: Option<f64>,
}

/// The `rank_collapse` detector for one run, all layers.
#[derive(Debug, Clone)]
pub struct RankCollapse {
    config: RankCollapseConfig,
    layers: BTreeMap<u32, LayerState>,
    trackers: Trackers<u32>,
}

impl RankCollapse {
    /// A detector for `run`.
    pub fn new(run: RunId, config: RankCollapseConfig) -> Result<Self> {
        config.validate()?;
        Ok(RankCollapse {
            config,
            layers: BTreeMap::new(),
            trackers: Trackers::new(run, Rule::RankCollapse, |layer| (Some(*layer), None, None)),
        })
    }
}

/// Slope per observation of a least-squares line through `ys`, with its t-statistic.
fn fitted_trend(ys: &VecDeque<f64>) -> Option<(f64, f64, f64)> {
    let n = ys.len() as f64;
    if ys.len() < 3 {
        return None;
    }
    let x_mean = (n - 1.0) / 2.0;
    let y_mean = ys.iter().sum::<f64>() / n;
    let sxx: f64 = (0..ys.len()).map(|i| (i as f64 - x_mean).powi(2)).sum();
    let sxy: f64 = ys
        .iter()
        .enumerate()
        .map(|(i, y)| (i as f64 - x_mean) * (y - y_mean))
        .sum();
    let slope = sxy / sxx;
    let intercept = y_mean - slope * x_mean;
    let sse: f64 = ys
        .iter()
        .enumerate()
        .map(|(i, y)| (y - intercept - slope * i as f64).powi(2))
        .sum();
    let se = (sse / (n - 2.0) / sxx).sqrt();
    let t = if se > 0.0 {
        slope / se
    } else if slope == 0.0 {
        0.0
    } else {
        f64::INFINITY.copysign(slope)
    };
    let last_fit = intercept + slope * (n - 1.0);
    Some((slope, t, last_fit))
}

impl RankCollapseConfig {
    /// Only values that arrived with this observation can breach (so one out-of-band probe is
    /// not counted again by the token-cosine observations that follow it); the latest known
    /// values decide whether the layer is clear.
    fn signal(
        &self,
        layer: u32,
        state: &LayerState,
        fresh: Fresh,
        since: u64,
        step: u64,
    ) -> Signal {
        let c = self;
        // Explanations are built only on a breach: most observations are clear.
        let cosine_note = || match (state.token_cosine, state.previous_token_cosine) {
            (Some(tc), Some(prev)) if tc > prev + 1e-3 => {
                format!("; token cosine {} and rising", short(tc))
            }
            (Some(tc), Some(prev)) if tc < prev - 1e-3 => {
                format!("; token cosine {} and falling", short(tc))
            }
            (Some(tc), _) => format!("; token cosine {}", short(tc)),
            _ => String::new(),
        };
        let ratio_note = || {
            state
                .ratio
                .map(|r| format!("; MLP/attention spectral ratio {}", short(r)))
                .unwrap_or_default()
        };
        if let Some(tc) = state.token_cosine.filter(|_| fresh.token_cosine)
            && tc >= c.token_cosine_critical
        {
            return Signal::Breach(Breach {
                severity: Severity::Critical,
                value: tc,
                threshold: c.token_cosine_critical,
                explanation: format!(
                    "layer {layer}: token cosine {} ≥ {}: token states are collapsing onto one direction{}",
                    short(tc),
                    short(c.token_cosine_critical),
                    ratio_note()
                ),
                outlier_ranks: vec![],
            });
        }
        if let Some(ratio) = state.ratio.filter(|_| fresh.ratio) {
            let steps = step.saturating_sub(since);
            if let Some(breach) = self.ratio_breach(layer, ratio, state, &cosine_note, steps) {
                return Signal::Breach(breach);
            }
        }
        let inside = state.ratio.is_none_or(|ratio| {
            ratio >= c.band_low * (1.0 + c.exit_margin)
                && ratio <= c.band_high / (1.0 + c.exit_margin)
        });
        let calm = state.token_cosine.is_none_or(|tc| tc < c.token_cosine_exit);
        if inside && calm {
            Signal::Clear
        } else {
            Signal::Hold
        }
    }

    fn ratio_breach(
        &self,
        layer: u32,
        ratio: f64,
        state: &LayerState,
        cosine_note: &dyn Fn() -> String,
        steps: u64,
    ) -> Option<Breach> {
        let c = self;
        let band = format!("{}–{}", short(c.band_low), short(c.band_high));
        if ratio < c.band_low || ratio > c.band_high {
            let (side, edge) = if ratio > c.band_high {
                ("above", c.band_high)
            } else {
                ("below", c.band_low)
            };
            return Some(Breach {
                severity: Severity::Warning,
                value: ratio,
                threshold: edge,
                explanation: format!(
                    "layer {layer}: MLP/attention spectral ratio {} {side} band {band} for {steps} steps{}",
                    short(ratio),
                    cosine_note()
                ),
                outlier_ranks: vec![],
            });
        }
        if c.trend_window >= 3
            && state.log_ratios.len() == c.trend_window
            && let Some((slope, t, last_fit)) = fitted_trend(&state.log_ratios)
            && t.abs() >= c.trend_min_t
        {
            let projected = (last_fit + slope * c.trend_horizon).exp();
            let leaving =
                (slope > 0.0 && projected > c.band_high) || (slope < 0.0 && projected < c.band_low);
            if leaving {
                let edge = if slope > 0.0 { c.band_high } else { c.band_low };
                return Some(Breach {
                    severity: Severity::Warning,
                    value: ratio,
                    threshold: edge,
                    explanation: format!(
                        "layer {layer}: MLP/attention spectral ratio {} trending {} ({:+.1}% per probe), projected to leave band {band} within {} probes{}",
                        short(ratio),
                        if slope > 0.0 { "up" } else { "down" },
                        (slope.exp() - 1.0) * 100.0,
                        short(c.trend_horizon),
                        cosine_note()
                    ),
                    outlier_ranks: vec![],
                });
            }
        }
        None
    }
}

impl Detector for RankCollapse {
    type Observation = CollapseObservation;

    fn observe(&mut self, obs: &CollapseObservation) -> Vec<Alert> {
        let window = self.config.trend_window;
        let state = self.layers.entry(obs.layer).or_default();
        // NaN is the `nonfinite` rule's business; 0 and +Inf (a zero σ) are out of band.
        let fresh_ratio = obs.ratio.filter(|r| !r.is_nan() && *r >= 0.0);
        if let Some(r) = fresh_ratio {
            state.ratio = Some(r);
            if window >= 3 && r.is_finite() && r > 0.0 {
                state.log_ratios.push_back(r.ln());
                while state.log_ratios.len() > window {
                    state.log_ratios.pop_front();
                }
            }
        }
        let fresh_tc = obs.token_cosine.filter(|t| t.is_finite());
        if let Some(tc) = fresh_tc {
            state.previous_token_cosine = state.token_cosine;
            state.token_cosine = Some(tc);
        }
        if fresh_ratio.is_none() && fresh_tc.is_none() {
            return vec![];
        }
        let fresh = Fresh {
            ratio: fresh_ratio.is_some(),
            token_cosine: fresh_tc.is_some(),
        };
        let since = self.trackers.breach_started(&obs.layer).unwrap_or(obs.step);
        let signal = self.config.signal(obs.layer, state, fresh, since, obs.step);
        self.trackers.observe(
            &obs.layer,
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
