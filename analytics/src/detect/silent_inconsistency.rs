//! `silent_inconsistency`: data-parallel workers that quietly stop agreeing (arXiv 2602.14462).
//!
//! The averaged loss hides it; the per-rank values show it. Two tests, either of which breaches.
//! The *peer* tests (`peers`: a rank standing out from the other ranks step after step, ranks
//! fed identical batches) need no history and judge from step 0; with two ranks, where no rank
//! can stand out from "the others", each rank is held against its own history instead (`pair`:
//! the one whose own loss or gradient norm left its past is named, from its first 20 steps); and
//! a rank whose loss rose a little against its peers' and stayed there is found by where it
//! sits among them (`shift`, any number of ranks). The *run-level* test, below, judges the run against its own recent past. At the run level, each step the rule computes the
//! cross-rank loss CV, gradient-norm CV and C_w ([`StepStats`]) and scores each against a robust
//! baseline: median, and 1.4826·MAD floored at `rel_floor`·|median| and `abs_floor` (so a
//! perfectly consistent warm-up, all ranks identical, still has a finite scale). A step breaches
//! when a dispersion's robust z-score reaches `z_threshold` or C_w's falls that far; it clears
//! when every z-score is under `z_exit`. Ranks are named by their robust z-score across ranks
//! (loss, gradient norm, and low cos_to_mean) when it reaches `rank_z` (three ranks or more).
//!
//! The baseline is the noise baseline. Gradient noise makes ranks disagree by itself, and more
//! so as training goes on (|G| shrinks relative to the noise). A noise-scale estimate from the
//! same step's scalars cannot separate that from inconsistency: under g_k = G + ξ_k its
//! predicted cosine |G|²/(|G|² + S_b) is C_w itself when norms are equal. What does separate
//! them is time: sampling noise drifts slowly, a fault arrives at a step. So the baseline is
//! learned from the first `warmup_steps` steps with data after `skip_steps` and then rolls
//! over the last `baseline_steps` steps, every step, clear or not.
//!
//! Why skip 200 steps: the first steps of training are not a baseline. The loss falls fastest
//! there and the gradient's signal dominates its noise, so the workers agree unusually well and
//! then stop doing so, healthily: on real text (a byte-level GPT, 100-step learning-rate
//! warm-up, 4 ranks) C_w fell from 0.9 at step 70 to 0.05–0.35 by step 200 and stayed there; on
//! the synthetic bigram example the loss CV rose 0.01 → 0.07 over the first 80 steps. A
//! baseline learned inside that transient called the rest of training inconsistent. Set
//! `skip_steps` past a longer learning-rate warm-up.
//!
//! Why every step, not only the clear ones: a baseline fed only clear steps latches. After a
//! legitimate level shift (learning-rate decay, a resume, a data-mix switch) that scores above
//! `z_exit`, no step is clear again, the baseline never moves, and the alert fires for the rest
//! of the run. A median over every step still scores a sudden change against what came before
//! it (half the window must be new before the median moves), and a level that persists becomes
//! the baseline about `baseline_steps`/2 steps later, so the alert resolves. A fault that
//! persists is absorbed the same way: it fires, stays firing for about 100 steps by default,
//! and resolves; the alert history keeps it. (The noise scale itself is stored as the
//! `noise_scale` metric.)

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

use super::lifecycle::{Breach, LifecycleConfig, Signal, Trackers};
use super::pair::{Pair, PairConfig, PairVerdict};
use super::peers::{PeerConfig, PeerStep, PeerVerdict, Peers, against_others};
use super::same_batches::SameBatchConfig;
use super::shift::{ShiftConfig, Shifts};
use super::{Detector, short};
use crate::alert::{Alert, Rule, Severity};
use crate::error::{Error, Result};
use crate::math::dispersion::{Dispersion, MAD_TO_SIGMA};
use crate::math::step::{RankValues, StepStats};
use crate::validate::RunId;

/// Thresholds of `silent_inconsistency`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SilentInconsistencyConfig {
    /// Training steps before which the run-level test learns and judges nothing (the peer
    /// tests judge from step 0). Default 200.
    pub skip_steps: u64,
    /// Steps with data (after `skip_steps`) that form the run-level test's first baseline; it
    /// fires nothing before. Default 30.
    pub warmup_steps: usize,
    /// Steps the rolling baseline keeps after warm-up, clear or not. Default 200.
    pub baseline_steps: usize,
    /// Robust z-score that breaches. Default 6.
    pub z_threshold: f64,
    /// Every z-score must be below this to clear. Default 3.
    pub z_exit: f64,
    /// Baseline scale floor relative to the baseline median. Default 0.05.
    pub rel_floor: f64,
    /// Absolute baseline scale floor (CVs and cosines are unitless). Default 0.001.
    pub abs_floor: f64,
    /// Cross-rank robust z-score that names a rank. Default 3.5.
    pub rank_z: f64,
    /// Cross-rank scale floor relative to the median, so identical ranks give finite scores.
    /// Default 0.01.
    pub rank_rel_floor: f64,
    /// Steps in the window of the per-rank stand-out test (0 disables it; see `peers`): the
    /// window is bounded in steps, whatever the logging cadence. Default 50.
    pub peer_window: usize,
    /// Observations the stand-out window needs before it judges (so sparse logging does not
    /// judge on a handful of steps). Default 40.
    pub peer_min_observations: usize,
    /// Share of the window at which one rank standing out breaches. Default 0.8.
    pub peer_share: f64,
    /// Logged steps in a row at which one rank standing out breaches before its share of the
    /// window can (0: only the share breaches). Default 12.
    pub peer_run: usize,
    /// How far from the other ranks' median a rank must be to stand out at a step: loss or
    /// gradient norm relative to theirs (0.25: 1.25× or 1/1.25×), or cosine to the mean below
    /// theirs. Default 0.25.
    pub peer_min_effect: f64,
    /// Steps in a row of ranks with bit-identical loss and gradient norm that breach (0
    /// disables it). Default 10: with different batches two float losses and gradient norms
    /// agree to the bit at no step, so ten in a row is as certain as twenty, and names a
    /// duplicated shard ten steps sooner.
    pub identical_steps: u32,
    /// Ranks fed the same batches that do not agree to the bit (dropout, nondeterministic
    /// kernels; see `same_batches`): a pair of ranks is close at a step when its loss and
    /// gradient-norm gaps are both at most this share of the run's usual gaps between ranks (0
    /// disables the test). Default 0.35.
    pub same_batch_closeness: f64,
    /// Steps whose close steps are counted (at most 1,000). Default 10.
    pub same_batch_window: u64,
    /// Close steps within that window that breach. Default 8.
    pub same_batch_steps: usize,
    /// A rank whose loss rose against its peers' (see `shift`): the sign CUSUM's limit (0
    /// disables the test). Default 16.
    pub shift_limit: f64,
    /// Subtracted from each step's ±1 in that CUSUM; below 1. Default 0.4.
    pub shift_allowance: f64,
    /// Steps an observation waits before it enters a rank's baseline. Default 100.
    pub shift_delay: u64,
    /// Observations a rank's baseline keeps. Default 200.
    pub shift_baseline: usize,
    /// Observations a rank's baseline needs before the rank is judged. Default 30.
    pub shift_min_observations: usize,
    /// Two-rank jobs: steps of each rank's own history the recent steps are compared with (0
    /// disables the test; see `pair`). Default 100.
    pub pair_window: u64,
    /// Two-rank jobs: the recent steps whose median ratio is compared. Default 5.
    pub pair_recent: u64,
    /// Two-rank jobs: observations the history needs before anything is judged. Default 20.
    pub pair_min_observations: usize,
    /// Two-rank jobs: robust z-score of the ratio's move that breaches (beside the
    /// `peer_min_effect` floor on its size). Default 6.
    pub pair_z: f64,
    /// Default: fire after 3 breaching steps, resolve after 10 clear ones.
    pub lifecycle: LifecycleConfig,
}

impl Default for SilentInconsistencyConfig {
    fn default() -> Self {
        SilentInconsistencyConfig {
            skip_steps: 200,
            warmup_steps: 30,
            baseline_steps: 200,
            z_threshold: 6.0,
            z_exit: 3.0,
            rel_floor: 0.05,
            abs_floor: 1e-3,
            rank_z: 3.5,
            rank_rel_floor: 0.01,
            peer_window: 50,
            peer_min_observations: 40,
            peer_share: 0.8,
            peer_run: 12,
            peer_min_effect: 0.25,
            identical_steps: 10,
            same_batch_closeness: 0.35,
            same_batch_window: 10,
            same_batch_steps: 8,
            shift_limit: 16.0,
            shift_allowance: 0.4,
            shift_delay: 100,
            shift_baseline: 200,
            shift_min_observations: 30,
            pair_window: 100,
            pair_recent: 5,
            pair_min_observations: 20,
            pair_z: 6.0,
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
            && self.baseline_steps >= self.warmup_steps
            && self.z_threshold > 0.0
            && self.z_exit > 0.0
            && self.z_exit <= self.z_threshold
            && self.rel_floor >= 0.0
            && self.abs_floor > 0.0
            && self.rank_z > 0.0
            && self.rank_rel_floor > 0.0
            && self.peer_share > 0.0
            && self.peer_share <= 1.0
            && self.peer_min_effect > 0.0
            && (self.peer_window == 0
                || ((1..=self.peer_window).contains(&self.peer_min_observations)
                    && (self.peer_run == 0 || (2..=self.peer_window).contains(&self.peer_run))))
            && (self.same_batch_closeness == 0.0
                || (self.same_batch_closeness > 0.0
                    && self.same_batch_closeness < 1.0
                    && self.same_batch_steps >= 2
                    && self.same_batch_steps as u64 <= self.same_batch_window
                    && self.same_batch_window <= 1000))
            && (self.shift_limit == 0.0
                || (self.shift_limit > 0.0
                    && self.shift_allowance > 0.0
                    && self.shift_allowance < 1.0
                    && (1..=self.shift_baseline).contains(&self.shift_min_observations)))
            && (self.pair_window == 0
                || (self.pair_recent >= 1
                    && self.pair_min_observations >= 5
                    && self.pair_min_observations as u64 <= self.pair_window
                    && self.pair_z > 0.0));
        if !ok {
            return Err(Error::Config(format!(
                "silent_inconsistency: need 5 ≤ warmup_steps ≤ baseline_steps, 0 < z_exit ≤ z_threshold, positive floors, rank_z and peer_min_effect, 0 < peer_share ≤ 1, 1 ≤ peer_min_observations ≤ peer_window, peer_run 0 or 2 ≤ peer_run ≤ peer_window, (unless same_batch_closeness is 0) 0 < same_batch_closeness < 1 and 2 ≤ same_batch_steps ≤ same_batch_window ≤ 1000, (unless shift_limit is 0) shift_limit > 0, 0 < shift_allowance < 1 and 1 ≤ shift_min_observations ≤ shift_baseline, and (unless pair_window is 0) pair_recent ≥ 1, 5 ≤ pair_min_observations ≤ pair_window and pair_z > 0; got {self:?}"
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

/// One step's run-level signals.
#[derive(Debug, Clone, Copy)]
struct Signals {
    loss_cv: Option<f64>,
    grad_cv: Option<f64>,
    cos: Option<f64>,
}

impl Signals {
    /// A step where some rank's loss (or gradient norm) is not finite is not judged on the loss
    /// (or gradient) signals: that rank is `nonfinite`'s to report, and the dispersion of the
    /// others is of a different set of ranks that moves with what the fault does to training —
    /// a rank whose gradient norm overflowed stalls every update (clipping zeroes them), the
    /// finite ranks drift apart, and one of them was named the outlier (the fault sweep's
    /// gradient bit flips, docs/detection.md).
    fn of(stats: &StepStats) -> Self {
        let finite = |x: Option<f64>| x.filter(|x| x.is_finite());
        let judged = |d: &Dispersion| d.count >= 2 && d.nonfinite == 0;
        let grads_finite = stats.grad_norm.is_none_or(|d| d.nonfinite == 0);
        Signals {
            loss_cv: finite(stats.loss.filter(judged).and_then(|d| d.cv)),
            grad_cv: finite(stats.grad_norm.filter(judged).and_then(|d| d.cv)),
            cos: finite(stats.cos_weighted.filter(|_| grads_finite)),
        }
    }
    fn is_empty(&self) -> bool {
        self.loss_cv.is_none() && self.grad_cv.is_none() && self.cos.is_none()
    }
}

/// The recent values each baseline is learned from.
#[derive(Debug, Clone, Default)]
struct History {
    loss_cv: VecDeque<f64>,
    grad_cv: VecDeque<f64>,
    cos: VecDeque<f64>,
    steps: usize,
}

impl History {
    fn push(&mut self, s: Signals, cap: usize) {
        for (values, x) in [
            (&mut self.loss_cv, s.loss_cv),
            (&mut self.grad_cv, s.grad_cv),
            (&mut self.cos, s.cos),
        ] {
            values.extend(x);
            while values.len() > cap {
                values.pop_front();
            }
        }
        self.steps += 1;
    }
}

#[derive(Debug, Clone)]
struct Baselines {
    loss_cv: Option<Baseline>,
    grad_cv: Option<Baseline>,
    cos: Option<Baseline>,
}

impl Baselines {
    fn learn(h: &mut History, c: &SilentInconsistencyConfig) -> Self {
        let (rel, abs) = (c.rel_floor, c.abs_floor);
        Baselines {
            loss_cv: Baseline::learn(h.loss_cv.make_contiguous(), rel, abs),
            grad_cv: Baseline::learn(h.grad_cv.make_contiguous(), rel, abs),
            // C_w lives in [-1, 1]: its floor is relative to 1, not to its median.
            cos: Baseline::learn(h.cos.make_contiguous(), 0.0, abs.max(rel * 0.1)),
        }
    }
}

/// The `silent_inconsistency` detector for one run.
#[derive(Debug, Clone)]
pub struct SilentInconsistency {
    config: SilentInconsistencyConfig,
    history: History,
    peers: Peers,
    shifts: Shifts,
    pair: Pair,
    trackers: Trackers<()>,
}

impl SilentInconsistency {
    /// A detector for `run`.
    pub fn new(run: RunId, config: SilentInconsistencyConfig) -> Result<Self> {
        config.validate()?;
        Ok(SilentInconsistency {
            config,
            history: History::default(),
            peers: Peers::default(),
            shifts: Shifts::default(),
            pair: Pair::default(),
            trackers: Trackers::new(run, Rule::SilentInconsistency, |_| (None, None, None)),
        })
    }

    /// Whether the run-level test's warm-up is over (it can fire; the peer tests always can).
    pub fn is_warmed_up(&self) -> bool {
        self.history.steps >= self.config.warmup_steps
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
            for (s, z) in score.iter_mut().zip(d.z_scores(&values, floor)) {
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

    fn signal(&self, b: &Baselines, s: Signals, obs: &StepObservation) -> Signal {
        let c = &self.config;
        let (loss_cv, grad_cv) = (s.loss_cv, s.grad_cv);
        let z_loss = b.loss_cv.zip(loss_cv).map(|(b, x)| b.z(x));
        let z_grad = b.grad_cv.zip(grad_cv).map(|(b, x)| b.z(x));
        let z_cos = b.cos.zip(s.cos).map(|(b, x)| -b.z(x));
        let mut reasons = Vec::new();
        let mut worst = 0.0f64;
        let mut check = |z: Option<f64>, text: &dyn Fn(f64) -> String| {
            if let Some(z) = z.filter(|z| *z >= c.z_threshold) {
                worst = worst.max(z);
                reasons.push(text(z));
            }
        };
        check(z_loss, &|z| {
            format!(
                "loss CV {} vs baseline {} (z={:.1})",
                short(loss_cv.unwrap_or(f64::NAN)),
                short(b.loss_cv.map_or(f64::NAN, |b| b.median)),
                z
            )
        });
        check(z_grad, &|z| {
            format!(
                "gradient-norm CV {} vs baseline {} (z={:.1})",
                short(grad_cv.unwrap_or(f64::NAN)),
                short(b.grad_cv.map_or(f64::NAN, |b| b.median)),
                z
            )
        });
        check(z_cos, &|z| {
            format!(
                "worker cosine C_w {} vs baseline {} (z={:.1})",
                short(s.cos.unwrap_or(f64::NAN)),
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

impl SilentInconsistencyConfig {
    fn peer_config(&self) -> PeerConfig {
        PeerConfig {
            window: self.peer_window,
            min_observations: self.peer_min_observations,
            share: self.peer_share,
            run: self.peer_run,
            min_effect: self.peer_min_effect,
            identical_steps: self.identical_steps,
            same_batch: SameBatchConfig {
                closeness: self.same_batch_closeness,
                window: self.same_batch_window,
                steps: self.same_batch_steps,
            },
        }
    }
}

impl SilentInconsistencyConfig {
    fn shift_config(&self) -> ShiftConfig {
        ShiftConfig {
            limit: self.shift_limit,
            allowance: self.shift_allowance,
            delay: self.shift_delay,
            baseline: self.shift_baseline,
            min_observations: self.shift_min_observations,
        }
    }
}

impl SilentInconsistencyConfig {
    fn pair_config(&self) -> PairConfig {
        PairConfig {
            window: self.pair_window,
            recent: self.pair_recent,
            min_observations: self.pair_min_observations,
            min_effect: self.peer_min_effect,
            z: self.pair_z,
        }
    }
}

impl SilentInconsistency {
    /// The run-level verdict against the rolling baseline; `None` before it judges (the
    /// skipped steps, the warm-up, a step without usable values). The peers' verdict alone
    /// decides then, and a clear from them counts as clear.
    fn run_level(&mut self, obs: &StepObservation) -> Option<Signal> {
        let c = self.config;
        if obs.step < c.skip_steps {
            return Some(Signal::Clear);
        }
        let signals = Signals::of(&StepStats::compute(&obs.ranks, obs.world_size));
        if signals.is_empty() {
            return None;
        }
        if self.history.steps < c.warmup_steps {
            self.history.push(signals, c.baseline_steps);
            return Some(Signal::Clear);
        }
        let baselines = Baselines::learn(&mut self.history, &c);
        let signal = self.signal(&baselines, signals, obs);
        self.history.push(signals, c.baseline_steps);
        Some(signal)
    }
}

impl Detector for SilentInconsistency {
    type Observation = StepObservation;

    fn observe(&mut self, obs: &StepObservation) -> Vec<Alert> {
        let c = self.config;
        // The peers judge from step 0: they need no baseline; with two ranks, each rank's own
        // history does what the peers cannot (name the one that changed).
        // Each rank's loss against the others', sorted once for both tests that read it.
        let loss = against_others(&obs.ranks, |r| r.loss);
        let at = PeerStep {
            step: obs.step,
            ranks: &obs.ranks,
            loss: &loss,
        };
        let mut peers = self
            .peers
            .observe(at, c.peer_config())
            .either(self.shifts.observe(at, c.shift_config()));
        if c.pair_window > 0
            && let PairVerdict::Breach(found) =
                self.pair.observe(obs.step, &obs.ranks, c.pair_config())
        {
            peers = peers.either(PeerVerdict::Breach(found));
        }
        let run_level = self.run_level(obs);
        let signal = match (peers, run_level) {
            (PeerVerdict::Breach(found), Some(Signal::Breach(b))) => Signal::Breach(b.join(found)),
            (PeerVerdict::Breach(mut found), _) => {
                found.explanation = format!("workers are inconsistent: {}", found.explanation);
                Signal::Breach(found)
            }
            (_, Some(breach @ Signal::Breach(_))) => breach,
            (PeerVerdict::Hold, _) => Signal::Hold,
            (PeerVerdict::Clear, Some(signal)) => signal,
            (PeerVerdict::Clear, None) => Signal::Clear,
        };
        self.trackers
            .observe(&(), obs.step, obs.time_ms, signal, &self.config.lifecycle)
    }

    fn open_alerts(&self) -> Vec<Alert> {
        self.trackers.open()
    }
}
