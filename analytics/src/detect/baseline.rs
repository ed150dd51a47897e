//! A series' own baseline, learned once: its first finite values until there are enough, then
//! their median. Used where a rule judges a value against where that series settled
//! (`activation_outlier`'s maxima, `rank_collapse`'s log ratio) rather than a fixed threshold.

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
