//! Two ranks, each against its own history: the part of `silent_inconsistency` that can name
//! the odd rank of a 2-rank job.
//!
//! With two ranks there is no majority: each rank's distance from "the others" is the other
//! rank's distance from it, so the stand-out test (`peers`) cannot tell which one changed, and
//! the run-level test waits for its baseline (past step 200). What does tell them apart is
//! time: a rank whose labels are corrupted, whose gradient is scaled or whose data went
//! off-task changes *against its own past*, while the healthy one does not.
//!
//! Each step with both ranks' loss and gradient norm, the test takes the log-ratios
//! q = ln(loss₁/loss₀) and g = ln(‖g₁‖/‖g₀‖). Whatever moves both ranks alike — the loss falling
//! during warm-up, a learning-rate decay, a data-source switch both read — leaves them where
//! they were, so they need no warm-up: they are judged from the first window. A step breaches
//! when the median of the last `recent` steps' ratio left the median of the `window` steps
//! before them by at least `min_effect` (relative, either way: the stand-out test's floor) and
//! by at least `z` robust standard deviations of that baseline (1.4826·MAD, floored at 1 %).
//! Both windows are bounded in *steps* and need a minimum of observations, so logging every
//! 10th step neither stretches them over hundreds of steps nor judges on a handful of values.
//!
//! The rank named is the one whose own statistic moved more across the change: its own
//! log-loss (or log-norm) over the recent steps against the `recent` steps just before them
//! (over so few steps a trend both share is small beside a fault's jump). The baseline keeps rolling, so a fault
//! that persists becomes the baseline after `window` steps and the alert resolves, as the
//! run-level test's does; the alert history keeps it.

use std::collections::VecDeque;

use super::lifecycle::Breach;
use super::short;
use crate::alert::Severity;
use crate::math::dispersion::{Dispersion, MAD_TO_SIGMA, median};
use crate::math::step::RankValues;

/// Thresholds, from `SilentInconsistencyConfig`.
#[derive(Debug, Clone, Copy)]
pub(super) struct PairConfig {
    /// Steps of baseline before the recent part.
    pub(super) window: u64,
    /// Steps of the recent part.
    pub(super) recent: u64,
    /// Observations the baseline needs before anything is judged.
    pub(super) min_observations: usize,
    pub(super) min_effect: f64,
    pub(super) z: f64,
}

/// The pair's verdict on one step.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum PairVerdict {
    Breach(Breach),
    /// Not two ranks with values, or not enough observations yet: no opinion.
    Abstain,
    Clear,
}

/// One step of a 2-rank run: each rank's log-loss and log-norm.
#[derive(Debug, Clone, Copy)]
struct Point {
    step: u64,
    /// The two ranks, lower first; the arrays below follow this order.
    ranks: [u32; 2],
    /// ln loss of rank 0 and rank 1 (by rank number).
    loss: [f64; 2],
    norm: [f64; 2],
}

impl Point {
    fn of(step: u64, ranks: &[RankValues]) -> Option<Point> {
        let [a, b] = ranks else { return None };
        let (a, b) = if a.rank <= b.rank { (a, b) } else { (b, a) };
        let ln = |v: Option<f64>| v.filter(|v| v.is_finite() && *v > 0.0).map(f64::ln);
        Some(Point {
            step,
            ranks: [a.rank, b.rank],
            loss: [ln(a.loss)?, ln(b.loss)?],
            norm: [ln(a.grad_norm)?, ln(b.grad_norm)?],
        })
    }
}

/// The two ranks' numbers, in rank order, so a breach can name them.
#[derive(Debug, Clone, Default)]
pub(super) struct Pair {
    points: VecDeque<Point>,
    ranks: [u32; 2],
    /// The breach at the onset of the current run of breaching steps. Its naming is kept while
    /// the shift lasts: a few steps in, the recent steps and the ones just before are both
    /// inside the fault, and which rank "moved more" between them is noise.
    onset: Option<Breach>,
}

#[derive(Debug, Clone, Copy)]
enum Quantity {
    Loss,
    GradNorm,
}

impl Quantity {
    fn noun(self) -> &'static str {
        match self {
            Quantity::Loss => "loss",
            Quantity::GradNorm => "gradient norm",
        }
    }
    fn get(self, p: &Point) -> [f64; 2] {
        match self {
            Quantity::Loss => p.loss,
            Quantity::GradNorm => p.norm,
        }
    }
}

impl Pair {
    /// Folds in one step (only 2-rank steps count; anything else abstains).
    pub(super) fn observe(
        &mut self,
        step: u64,
        ranks: &[RankValues],
        c: PairConfig,
    ) -> PairVerdict {
        let verdict = self.judge(step, ranks, c);
        match &verdict {
            PairVerdict::Breach(b) => match &self.onset {
                Some(onset) => {
                    return PairVerdict::Breach(Breach {
                        value: b.value,
                        ..onset.clone()
                    });
                }
                None => self.onset = Some(b.clone()),
            },
            _ => self.onset = None,
        }
        verdict
    }

    fn judge(&mut self, step: u64, ranks: &[RankValues], c: PairConfig) -> PairVerdict {
        let Some(point) = Point::of(step, ranks) else {
            return PairVerdict::Abstain;
        };
        self.ranks = point.ranks;
        // A step that goes back (a resume) starts over.
        if self.points.back().is_some_and(|p| p.step >= step) {
            self.points.clear();
        }
        self.points.push_back(point);
        let oldest = step.saturating_sub(c.window + c.recent);
        while self
            .points
            .front()
            .is_some_and(|p| p.step <= oldest && p.step != step)
        {
            self.points.pop_front();
        }
        let split = step.saturating_sub(c.recent);
        let (base, recent): (Vec<Point>, Vec<Point>) =
            self.points.iter().partition(|p| p.step <= split);
        // At least half the recent steps, and the baseline's minimum.
        let recent_needed = (c.recent as usize).div_ceil(2).max(1);
        if base.len() < c.min_observations || recent.len() < recent_needed {
            return PairVerdict::Abstain;
        }
        let mut worst: Option<(f64, Quantity, f64, [f64; 2])> = None;
        for q in [Quantity::Loss, Quantity::GradNorm] {
            let ratio = |p: &Point| q.get(p)[1] - q.get(p)[0];
            let Some(spread) = Dispersion::of(&base.iter().map(ratio).collect::<Vec<_>>()) else {
                continue;
            };
            let (centre, scale) = (spread.median, MAD_TO_SIGMA * spread.mad);
            let now = median(&mut recent.iter().map(ratio).collect::<Vec<_>>());
            let shift = now - centre;
            let z = shift.abs() / scale.max(0.01);
            if shift.abs() < (1.0 + c.min_effect).ln() || z < c.z {
                continue;
            }
            // Each rank against its own past just before: how far its own log-value moved
            // across the change. Over so few steps a trend both share (the loss falling) is
            // small beside a fault's jump; over the whole window it is not.
            let just_before: Vec<&Point> =
                base.iter().filter(|p| p.step + c.recent > split).collect();
            let own = |r: usize| {
                let before =
                    median(&mut just_before.iter().map(|p| q.get(p)[r]).collect::<Vec<_>>());
                let after = median(&mut recent.iter().map(|p| q.get(p)[r]).collect::<Vec<_>>());
                after - before
            };
            if worst.is_none_or(|(wz, ..)| z > wz) {
                worst = Some((z, q, shift, [own(0), own(1)]));
            }
        }
        let Some((z, q, shift, moved)) = worst else {
            return PairVerdict::Clear;
        };
        let odd = usize::from(moved[1].abs() > moved[0].abs());
        let (rank, other) = (self.ranks[odd], self.ranks[1 - odd]);
        let factor = |ln: f64| (ln.exp() * 100.0).round() / 100.0;
        let explanation = format!(
            "rank {rank}'s {noun} moved {}× over {} steps while rank {other}'s moved {}× (their \
             ratio {}× its usual over the last {} steps, z={z:.1}); with two ranks, the one whose \
             own statistics changed is named",
            short(factor(moved[odd])),
            c.recent,
            short(factor(moved[1 - odd])),
            short(factor(shift)),
            c.window,
            noun = q.noun(),
        );
        PairVerdict::Breach(Breach {
            severity: Severity::Warning,
            value: z,
            threshold: c.z,
            explanation,
            outlier_ranks: vec![rank],
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const C: PairConfig = PairConfig {
        window: 40,
        recent: 5,
        min_observations: 20,
        min_effect: 0.25,
        z: 6.0,
    };

    fn ranks(loss: [f64; 2], norm: [f64; 2]) -> Vec<RankValues> {
        (0..2)
            .map(|r| RankValues {
                rank: r as u32,
                loss: Some(loss[r]),
                grad_norm: Some(norm[r]),
                ..RankValues::default()
            })
            .collect()
    }

    /// A deterministic wobble of a few per cent, different per rank and step.
    fn wobble(step: u64, rank: usize) -> f64 {
        let x = ((step * 7919 + rank as u64 * 104_729) % 1000) as f64 / 1000.0;
        1.0 + 0.06 * (x - 0.5)
    }

    #[test]
    fn a_rank_whose_loss_leaves_its_own_past_is_named_and_a_shared_fall_is_not() {
        let mut pair = Pair::default();
        let mut first = None;
        let mut named_later = Vec::new();
        for step in 0..80u64 {
            // Both losses fall fast (warm-up), together: never a breach.
            let common = 4.0 * (-(step as f64) / 30.0).exp() + 1.0;
            let mut loss = [common * wobble(step, 0), common * wobble(step, 1)];
            if step >= 50 {
                loss[1] *= 1.6; // rank 1's labels corrupted
            }
            let verdict = pair.observe(step, &ranks(loss, [wobble(step, 1), wobble(step, 0)]), C);
            if step < 50 {
                assert!(
                    !matches!(verdict, PairVerdict::Breach(_)),
                    "step {step}: {verdict:?}"
                );
            }
            if let PairVerdict::Breach(b) = verdict {
                if first.is_none() {
                    first = Some((step, b));
                } else {
                    named_later.push(b.outlier_ranks);
                }
            }
        }
        let (step, breach) = first.expect("never breached");
        assert!((50..=55).contains(&step), "{step}");
        assert!(named_later.iter().all(|r| *r == vec![1]), "{named_later:?}");
        assert_eq!(breach.outlier_ranks, vec![1]);
        assert!(
            breach.explanation.starts_with("rank 1's loss moved 1."),
            "{}",
            breach.explanation
        );
    }

    #[test]
    fn sparse_logging_does_not_stretch_the_window_and_too_few_points_abstain() {
        let mut pair = Pair::default();
        // Every 10th step: 4 points in a 40-step window, fewer than the 20 needed.
        for step in (0..400u64).step_by(10) {
            let loss = if step >= 200 { [1.0, 3.0] } else { [1.0, 1.0] };
            assert_eq!(
                pair.observe(step, &ranks(loss, [1.0, 1.0]), C),
                PairVerdict::Abstain
            );
        }
        assert!(pair.points.len() <= 5, "{}", pair.points.len());
    }

    #[test]
    fn more_or_fewer_than_two_ranks_abstain() {
        let mut pair = Pair::default();
        let three: Vec<RankValues> = (0..3)
            .map(|r| RankValues {
                rank: r,
                loss: Some(1.0),
                grad_norm: Some(1.0),
                ..RankValues::default()
            })
            .collect();
        assert_eq!(pair.observe(0, &three, C), PairVerdict::Abstain);
        assert_eq!(pair.observe(1, &three[..1], C), PairVerdict::Abstain);
    }
}
