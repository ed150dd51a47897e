//! A series' own baseline: where a rule judges a value against where that series settled
//! rather than a fixed threshold. [`TrailingMedian`] follows the series (the median of
//! its values over the last so many steps: `activation_outlier`'s maxima, which grow tenfold
//! in healthy training long after any warm-up, and `rank_collapse`'s ratio and effective
//! rank, which drift several-fold over a healthy run).

use std::collections::VecDeque;

use crate::math::dispersion::median_of_sorted;

/// The median of a series' finite values over its last `span` steps, every value counted (so
/// it cannot latch on a level it will never see again), and at most the last
/// [`TrailingMedian::MAX_VALUES`] of them: a series sampled every step keeps a window of that
/// many steps, so memory and the cost of an update stay bounded per series (1,024 ranks × a few
/// sites × layers are many series).
///
/// The window is kept twice: in step order (what leaves first) and sorted by value, so the
/// median is read, not computed. Sorting the window at every update made `rank_collapse` a
/// fifth of the collector's CPU under sustained ingest (one update per layer and step, 256
/// values each); now an update moves at most a few values.
#[derive(Debug, Clone, Default)]
pub(super) struct TrailingMedian {
    /// Strictly ascending steps: a value joins only after every step at or after its own left.
    values: VecDeque<(u64, f64)>,
    /// The same values, ascending by [`f64::total_cmp`] (all finite).
    sorted: Vec<f64>,
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
        // A resume that went back: the steps at or after it leave (they are the newest).
        while let Some(&(s, v)) = self.values.back()
            && s >= step
        {
            self.values.pop_back();
            self.forget(v);
        }
        while self.values.len() > keep
            && self
                .values
                .front()
                .is_some_and(|&(s, _)| s.saturating_add(span) < step)
        {
            self.forget_oldest();
        }
        let baseline = (self.values.len() >= needed).then(|| median_of_sorted(&self.sorted));
        if value.is_finite() {
            self.values.push_back((step, value));
            let at = self.sorted.partition_point(|v| v.total_cmp(&value).is_lt());
            self.sorted.insert(at, value);
            if self.values.len() > Self::MAX_VALUES {
                self.forget_oldest();
            }
        }
        baseline
    }

    fn forget_oldest(&mut self) {
        if let Some((_, v)) = self.values.pop_front() {
            self.forget(v);
        }
    }

    /// Takes `value` out of the sorted copy (values equal under `total_cmp` are the same
    /// bits, so which of equal copies goes is moot).
    fn forget(&mut self, value: f64) {
        let at = self.sorted.partition_point(|v| v.total_cmp(&value).is_lt());
        debug_assert!(
            self.sorted
                .get(at)
                .is_some_and(|v| v.total_cmp(&value).is_eq())
        );
        self.sorted.remove(at);
    }

    /// The values in the window, oldest first (the latest included).
    pub(super) fn values(&self) -> impl ExactSizeIterator<Item = (u64, f64)> + Clone + '_ {
        self.values.iter().copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::math::dispersion::median;
    use proptest::prelude::*;

    /// The window as it was kept before: filtered and sorted afresh at every update.
    #[derive(Default)]
    struct Naive(VecDeque<(u64, f64)>);

    impl Naive {
        fn update(
            &mut self,
            step: u64,
            value: f64,
            span: u64,
            needed: usize,
            keep: usize,
        ) -> Option<f64> {
            self.0.retain(|&(s, _)| s < step);
            while self.0.len() > keep
                && self
                    .0
                    .front()
                    .is_some_and(|&(s, _)| s.saturating_add(span) < step)
            {
                self.0.pop_front();
            }
            let baseline = (self.0.len() >= needed).then(|| {
                let mut v: Vec<f64> = self.0.iter().map(|&(_, v)| v).collect();
                median(&mut v)
            });
            if value.is_finite() {
                self.0.push_back((step, value));
                if self.0.len() > TrailingMedian::MAX_VALUES {
                    self.0.pop_front();
                }
            }
            baseline
        }
    }

    /// A window at its cap, then a resume back into it, then on again: the same as before.
    #[test]
    fn a_full_window_and_a_resume_into_it_match_sorting_each_time() {
        let (mut fast, mut naive) = (TrailingMedian::default(), Naive::default());
        let steps = (0..600u64).chain(590..900);
        let mut full = false;
        for (i, step) in steps.enumerate() {
            let value = ((i * 37) % 101) as f64 / 7.0;
            let got = fast.update_keeping(step, value, u64::MAX, 2, 2);
            let want = naive.update(step, value, u64::MAX, 2, 2);
            assert_eq!(got.map(f64::to_bits), want.map(f64::to_bits), "step {step}");
            assert_eq!(fast.values().len(), naive.0.len());
            full |= fast.values().len() == TrailingMedian::MAX_VALUES;
        }
        assert!(full, "the window never reached its cap");
    }

    fn value() -> impl Strategy<Value = f64> {
        prop_oneof![
            8 => -5.0..5.0f64,
            // Repeats, so equal values enter and leave.
            4 => (0..4u8).prop_map(f64::from),
            1 => Just(f64::NAN),
            1 => Just(f64::INFINITY),
            1 => Just(-0.0),
        ]
    }

    proptest! {
        /// Every baseline and the window itself equal the sort-every-time version's, bit for
        /// bit, through resumes that go back, non-finite values and a window full to its cap.
        #[test]
        fn incremental_median_equals_sorting_each_time(
            // Mostly forward, so the window also reaches its cap.
            updates in prop::collection::vec((prop_oneof![1 => Just(0u8), 1 => Just(1u8), 30 => Just(2u8)], 1..40u64, value()), 1..700),
            span in prop_oneof![1..300u64, Just(u64::MAX)],
            needed in 0..4usize,
            keep in 0..4usize,
        ) {
            let (mut fast, mut naive) = (TrailingMedian::default(), Naive::default());
            let mut step = 0u64;
            for (kind, delta, value) in updates {
                // Mostly forward; sometimes a resume back or the same step again.
                step = match kind {
                    0 => step.saturating_sub(delta),
                    1 => step,
                    _ => step + delta,
                };
                let got = fast.update_keeping(step, value, span, needed, keep);
                let want = naive.update(step, value, span, needed, keep);
                prop_assert_eq!(got.map(f64::to_bits), want.map(f64::to_bits));
                prop_assert_eq!(
                    fast.values().map(|(s, v)| (s, v.to_bits())).collect::<Vec<_>>(),
                    naive.0.iter().map(|&(s, v)| (s, v.to_bits())).collect::<Vec<_>>()
                );
            }
        }
    }
}
