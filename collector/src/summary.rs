//! One summary of a set of values at steps: how many, how many non-finite, the finite min and
//! max, and every value at the greatest step. A dashboard bucket and a rollup window are both
//! one of these.
//!
//! Summaries merge exactly: counts add, extremes compare, and the last step's values are kept
//! (not averaged) until [`Cell::last`] averages them in one fixed order. So a summary built
//! row by row equals one merged from summaries of any split of the rows, bit for bit — which
//! is what lets the collector answer from rollups instead of raw rows
//! (`crate::store::rollup`) and makes answers independent of how files were cut.

use smallvec::SmallVec;

/// The summary of some values: see the module docs.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Cell {
    pub count: u64,
    pub nonfinite: u64,
    /// Over the finite values.
    pub min: Option<f64>,
    pub max: Option<f64>,
    pub last_step: u64,
    /// Every value at `last_step` (several ranks in a heatmap cell), in arrival order.
    last_values: SmallVec<[f64; 2]>,
}

impl Cell {
    /// Adds one value.
    pub fn add(&mut self, step: u64, value: f64) {
        self.count += 1;
        if value.is_finite() {
            self.extremes(value, value);
        } else {
            self.nonfinite += 1;
        }
        self.at_step(self.count == 1, step, std::slice::from_ref(&value));
    }

    /// Adds a summary of `count` values (`nonfinite` of them non-finite) whose finite extremes
    /// are `min..=max` and whose greatest step `last_step` holds `last_values`.
    pub fn merge(
        &mut self,
        count: u64,
        nonfinite: u64,
        extremes: Option<(f64, f64)>,
        last_step: u64,
        last_values: &[f64],
    ) {
        if count == 0 {
            return;
        }
        let first = self.count == 0;
        self.count += count;
        self.nonfinite += nonfinite;
        if let Some((min, max)) = extremes {
            self.extremes(min, max);
        }
        self.at_step(first, last_step, last_values);
    }

    /// In `f64::total_cmp`'s order, which puts −0 below +0 (`f64::min` may return either
    /// zero, so the sign of a zero extreme would depend on the order the rows came in).
    fn extremes(&mut self, min: f64, max: f64) {
        self.min = Some(
            self.min
                .map_or(min, |m| std::cmp::min_by(m, min, f64::total_cmp)),
        );
        self.max = Some(
            self.max
                .map_or(max, |m| std::cmp::max_by(m, max, f64::total_cmp)),
        );
    }

    fn at_step(&mut self, first: bool, step: u64, values: &[f64]) {
        if first || step > self.last_step {
            self.last_step = step;
            self.last_values.clear();
            self.last_values.extend_from_slice(values);
        } else if step == self.last_step {
            self.last_values.extend_from_slice(values);
        }
    }

    /// The values at the last step, in a fixed order (`f64::total_cmp`: ascending, a NaN last
    /// unless its sign bit is set, then first).
    pub fn last_values(&self) -> SmallVec<[f64; 2]> {
        let mut values = self.last_values.clone();
        values.sort_by(f64::total_cmp);
        values
    }

    /// The value at the last step: the mean of the values there, summed in ascending order
    /// (so the same values give the same bits whatever order they came in); a NaN among them
    /// makes it NaN, which is the truth.
    pub fn last(&self) -> Option<f64> {
        if self.count == 0 || self.last_values.is_empty() {
            return None;
        }
        if let [only] = self.last_values.as_slice() {
            return Some(*only);
        }
        Some(self.with_last_values(|sorted| sorted.iter().sum::<f64>() / sorted.len() as f64))
    }

    /// `f` of the values at the last step in the order of [`Cell::last_values`], sorted on the
    /// stack when they fit (a heatmap asks this of every cell, a rollup of every window).
    pub fn with_last_values<R>(&self, f: impl FnOnce(&[f64]) -> R) -> R {
        let values = self.last_values.as_slice();
        let mut buffer = [0f64; 16];
        match buffer.get_mut(..values.len()) {
            Some(small) => {
                small.copy_from_slice(values);
                small.sort_unstable_by(f64::total_cmp);
                f(small)
            }
            None => f(&self.last_values()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_nan_is_counted_and_does_not_hide_the_spike() {
        let mut c = Cell::default();
        for (s, v) in [(1, 1.0), (2, f64::NAN), (3, 1e9), (4, 2.0)] {
            c.add(s, v);
        }
        assert_eq!((c.count, c.nonfinite), (4, 1));
        assert_eq!((c.min, c.max, c.last()), (Some(1.0), Some(1e9), Some(2.0)));
    }

    #[test]
    fn last_is_the_same_bits_whatever_the_order() {
        let values = [0.1, 0.7, 1e-17, 3.3, -2.2];
        let mut forward = Cell::default();
        let mut backward = Cell::default();
        for v in values {
            forward.add(9, v);
        }
        for v in values.iter().rev() {
            backward.add(9, *v);
        }
        assert_eq!(
            forward.last().unwrap().to_bits(),
            backward.last().unwrap().to_bits()
        );
    }

    #[test]
    fn the_extremes_of_signed_zeros_are_the_same_bits_whatever_the_order() {
        let mut forward = Cell::default();
        let mut backward = Cell::default();
        for v in [0.0, -0.0, 0.0] {
            forward.add(3, v);
        }
        for v in [-0.0, 0.0, -0.0] {
            backward.add(3, v);
        }
        for c in [&forward, &backward] {
            assert_eq!(c.min.map(f64::to_bits), Some((-0.0f64).to_bits()));
            assert_eq!(c.max.map(f64::to_bits), Some(0.0f64.to_bits()));
        }
    }
}
