//! A series' own baseline: where a rule judges a value against where that series settled
//! rather than a fixed threshold. [`Baseline`] is learned once (its first finite values until
//! there are enough, then their median: `rank_collapse`'s log ratio, which must remember where
//! it started to see a slow drift); [`TrailingMedian`] follows the series (the median of its
//! values over the last so many steps: `activation_outlier`'s maxima, which grow tenfold in
//! healthy training long after any warm-up).

use std::collections::VecDeque;

use crate::math::dispersion::median;

#[derive(Debug, Clone)]
pub(super) enum Baseline {
    Learning(Vec<f64>),
    Learned(f64),
}

impl Default for Baseline {
    fn default() -> Self {
        Baseline::Learning(Vec::new())
    }
}

impl Baseline {
    /// The learned value, after folding in `value` if still learning (non-finite values are
    /// skipped).
    pub(super) fn update(&mut self, value: f64, needed: usize) -> Option<f64> {
        if let Baseline::Learning(early) = self {
            if value.is_finite() {
                early.push(value);
            }
            if early.len() >= needed {
                *self = Baseline::Learned(median(early));
            }
            return None;
        }
        self.learned()
    }

    /// The learned value, if there is one yet.
    pub(super) fn learned(&self) -> Option<f64> {
        match self {
            Baseline::Learned(b) => Some(*b),
            Baseline::Learning(_) => None,
        }
    }
}

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
        while self
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
}
