//! A series' own baseline: where a rule judges a value against where that series settled
//! rather than a fixed threshold. [`TrailingMedian`] follows the series (the median of
//! its values over the last so many steps: `activation_outlier`'s maxima, which grow tenfold
//! in healthy training long after any warm-up, and `rank_collapse`'s ratio and effective
//! rank, which drift several-fold over a healthy run).

use std::collections::VecDeque;

use crate::math::dispersion::median;

/// The median of a series' finite values over its last `span` steps, every value counted (so
/// it cannot latch on a level it will never see again), and at most the last
/// [`TrailingMedian::MAX_VALUES`] of them: a series sampled every step keeps a window of that
/// many steps, so memory and the median's sort stay bounded per series (1,024 ranks × a few
/// sites × layers are many series).
#[derive(Debug, Clone, Default)]
pub(super) struct TrailingMedian {
    values: VecDeque<(u64, f64)>,
}

impl TrailingMedian {
    /// The most values kept.
    pub(super) const MAX_VALUES: usize = 256;

    /// The median of the values within `span` steps before `step` (when at least `needed`),
    /// then `value` joins them (if finite).
    pub(super) fn update(
        &mut self,
        step: u64,
        value: f64,
        span: u64,
        needed: usize,
    ) -> Option<f64> {
        self.update_keeping(step, value, span, needed, 0)
    }

    /// As [`TrailingMedian::update`], but values older than `span` are dropped only while more
    /// than `keep` remain: a series probed rarely (a spectral cadence of hundreds of steps) is
    /// still judged against its last `keep` values. Steps at or after `step` (a resume that
    /// went back) leave the window.
    pub(super) fn update_keeping(
        &mut self,
        step: u64,
        value: f64,
        span: u64,
        needed: usize,
        keep: usize,
    ) -> Option<f64> {
        self.values.retain(|&(s, _)| s < step);
        while self.values.len() > keep
            && self
                .values
                .front()
                .is_some_and(|&(s, _)| s.saturating_add(span) < step)
        {
            self.values.pop_front();
        }
        let baseline = (self.values.len() >= needed).then(|| {
            let mut v: Vec<f64> = self.values.iter().map(|&(_, v)| v).collect();
            median(&mut v)
        });
        if value.is_finite() {
            self.values.push_back((step, value));
            if self.values.len() > Self::MAX_VALUES {
                self.values.pop_front();
            }
        }
        baseline
    }

    /// The values in the window, oldest first (the latest included).
    pub(super) fn values(&self) -> impl Iterator<Item = (u64, f64)> + '_ {
        self.values.iter().copied()
    }
}
