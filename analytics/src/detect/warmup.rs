//! The learning rate's first rise: the schedule's warm-up, as the ranks report it
//! (`learning_rate`, read by the agent from the optimizer it watches).
//!
//! Early training is when the learning rate is still climbing to its peak; `rank_collapse`
//! keeps its early phase open until that climb is over, instead of guessing its length from
//! the token states (each held-out set found a post-LN model whose warm-up outlasted the
//! guess, docs/detection.md). Only the *first* rise counts: a rise later in the run (a restart
//! at the wrong step, an LR ramp) is what a fault looks like, not a warm-up.
//!
//! The ranks of a data-parallel job share one schedule but report on their own clocks, so a
//! value is compared with the highest so far only when it comes from a later step: an
//! earlier step's lower value arriving late is not a fall. The rise is over at the first step
//! after the peak with a lower learning rate, or once the peak has held `settle_steps` (a
//! schedule flat from its first step has no rise to wait for).

/// Relative change below which two learning rates are the same (ranks compute the schedule
/// alike, but a scheduler's float arithmetic may differ in the last bits across resumes).
const SAME: f64 = 1e-6;

/// Where the first rise of a run's learning rate stands.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct FirstRise {
    /// The highest learning rate so far and the first step it was reported at.
    peak: Option<(u64, f64)>,
    /// The step at which the rise was seen to be over.
    ended_at: Option<u64>,
}

impl FirstRise {
    /// Folds in one rank's learning rate at `step`. Non-finite and negative values say
    /// nothing about a schedule and are ignored.
    pub(crate) fn observe(&mut self, step: u64, lr: f64, settle_steps: u64) {
        if self.ended_at.is_some() || !lr.is_finite() || lr < 0.0 {
            return;
        }
        let Some((at, peak)) = self.peak else {
            self.peak = Some((step, lr));
            return;
        };
        if step <= at {
            // Another rank's earlier step, or a resume that went back: not a move of the
            // schedule from the peak.
            return;
        }
        if lr > peak * (1.0 + SAME) {
            self.peak = Some((step, lr));
        } else if lr < peak * (1.0 - SAME) || step - at >= settle_steps {
            self.ended_at = Some(step);
        }
    }

    /// Whether early training may end at `step` as far as the learning rate says: no learning
    /// rate was reported (nothing to wait for), or its first rise was over by then.
    pub(crate) fn over_by(&self, step: u64) -> bool {
        self.peak.is_none() || self.ended_at.is_some_and(|end| step >= end)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fed(points: &[(u64, f64)], settle: u64) -> FirstRise {
        let mut rise = FirstRise::default();
        for &(step, lr) in points {
            rise.observe(step, lr, settle);
        }
        rise
    }

    #[test]
    fn a_linear_warm_up_ends_at_the_first_step_below_its_peak() {
        let warm: Vec<(u64, f64)> = (0..=300)
            .map(|s| (s, 1e-3 * s as f64 / 300.0))
            .chain([(301, 0.999e-3)])
            .collect();
        let rise = fed(&warm, 20);
        assert_eq!(rise.ended_at, Some(301));
        assert!(!rise.over_by(300));
        assert!(rise.over_by(301));
    }

    #[test]
    fn a_flat_schedule_settles_and_no_report_waits_for_nothing() {
        let flat: Vec<(u64, f64)> = (0..40).map(|s| (s, 3e-4)).collect();
        assert_eq!(fed(&flat, 20).ended_at, Some(20));
        assert!(FirstRise::default().over_by(0));
        // Still rising: nothing ends it, however late.
        let rising: Vec<(u64, f64)> = (0..1000).map(|s| (s, s as f64)).collect();
        assert!(!fed(&rising, 20).over_by(u64::MAX));
    }

    #[test]
    fn a_late_rank_and_a_later_rise_do_not_move_it() {
        // Rank 1's step 9 arrives after rank 0's step 10: lower, but earlier.
        let mut rise = fed(&[(9, 0.9), (10, 1.0), (9, 0.9), (10, 1.0), (11, 1.1)], 20);
        assert_eq!(rise.ended_at, None);
        rise.observe(12, 1.05, 20);
        assert_eq!(rise.ended_at, Some(12));
        // An LR ramp later in the run is not a second warm-up.
        rise.observe(300, 100.0, 20);
        assert_eq!(rise.ended_at, Some(12));
        // Nor do NaN or negative values start or end anything.
        let odd = fed(
            &[(0, f64::NAN), (1, -1.0), (2, 0.5), (3, f64::INFINITY)],
            20,
        );
        assert_eq!(odd, fed(&[(2, 0.5)], 20));
    }
}
