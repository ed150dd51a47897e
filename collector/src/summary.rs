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

    /// Adds another summary.
    pub fn absorb(&mut self, other: &Cell) {
        self.merge(
            other.count,
            other.nonfinite,
            other.min.zip(other.max),
            other.last_step,
            &other.last_values,
        );
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

/// Summaries of aligned windows, ascending by window start.
pub type Windows = Vec<(u64, Cell)>;

/// The windows of `2^shift` steps of rows `(step, value)` given in ascending step order.
pub fn windows_of(rows: impl IntoIterator<Item = (u64, f64)>, shift: u32) -> Windows {
    let mut out: Windows = Vec::new();
    for (step, value) in rows {
        let start = step >> shift << shift;
        match out.last_mut() {
            Some((s, cell)) if *s == start => cell.add(step, value),
            _ => {
                let mut cell = Cell::default();
                cell.add(step, value);
                out.push((start, cell));
            }
        }
    }
    out
}

/// The same values in windows of `2^shift` steps, from finer windows in ascending order.
pub fn coarsen(windows: &[(u64, Cell)], shift: u32) -> Windows {
    let mut out: Windows = Vec::with_capacity(windows.len() / 2 + 1);
    for (start, cell) in windows {
        let start = start >> shift << shift;
        match out.last_mut() {
            Some((s, c)) if *s == start => c.absorb(cell),
            _ => out.push((start, cell.clone())),
        }
    }
    out
}

/// Several ascending window lists of the same width merged into one (windows with the same
/// start combined, in list order). The lists of one group's series mostly hold the same
/// windows, so each is absorbed in place when it does, merged pairwise when not; sorting
/// their concatenation moved every cell several times (a tenth of a flush).
pub fn pool<'a>(lists: impl IntoIterator<Item = &'a Windows>) -> Windows {
    let mut lists = lists.into_iter();
    let Some(first) = lists.next() else {
        return Windows::new();
    };
    let mut out = first.clone();
    for list in lists {
        let same_windows =
            list.len() == out.len() && list.iter().zip(&out).all(|(a, b)| a.0 == b.0);
        if same_windows {
            for ((_, into), (_, cell)) in out.iter_mut().zip(list) {
                into.absorb(cell);
            }
        } else {
            out = merge(out, list);
        }
    }
    out
}

/// Two ascending window lists as one; `into`'s cell absorbs `other`'s at an equal start.
fn merge(into: Windows, other: &Windows) -> Windows {
    let mut out = Windows::with_capacity(into.len().max(other.len()));
    let mut other = other.iter().peekable();
    for (start, mut cell) in into {
        while let Some((s, c)) = other.next_if(|(s, _)| *s < start) {
            out.push((*s, c.clone()));
        }
        if let Some((_, c)) = other.next_if(|(s, _)| *s == start) {
            cell.absorb(c);
        }
        out.push((start, cell));
    }
    out.extend(other.cloned());
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

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

    fn rows() -> impl Strategy<Value = Vec<(u64, f64)>> {
        proptest::collection::vec(
            (
                0u64..300,
                prop_oneof![
                    8 => -1e3f64..1e3,
                    1 => Just(f64::NAN),
                    1 => Just(f64::INFINITY),
                    1 => Just(0.0),
                    1 => Just(-0.0),
                ],
            ),
            0..200,
        )
        .prop_map(|mut r| {
            r.sort_by_key(|x| x.0);
            r
        })
    }

    /// A window's fields as bits: (start, count, nonfinite, min, max, last step, last).
    type Bits = (u64, u64, u64, Option<u64>, Option<u64>, u64, Option<u64>);

    fn bits(w: &Windows) -> Vec<Bits> {
        w.iter()
            .map(|(s, c)| {
                (
                    *s,
                    c.count,
                    c.nonfinite,
                    c.min.map(f64::to_bits),
                    c.max.map(f64::to_bits),
                    c.last_step,
                    c.last().map(f64::to_bits),
                )
            })
            .collect()
    }

    proptest! {
        /// Coarsened windows equal windows built from the rows at that width, and pooled
        /// windows of several lists equal the windows of all their rows together.
        #[test]
        fn coarsening_and_pooling_equal_building_from_rows(
            a in rows(),
            b in rows(),
            fine in 0u32..4,
            extra in 1u32..5,
        ) {
            let coarse = fine + extra;
            prop_assert_eq!(bits(&coarsen(&windows_of(a.clone(), fine), coarse)), bits(&windows_of(a.clone(), coarse)));
            // Lists with other windows (merged) and with the same windows (absorbed in place).
            let mut all = [a.clone(), b.clone(), a.clone()].concat();
            all.sort_by_key(|x| x.0);
            prop_assert_eq!(
                bits(&pool(&[windows_of(a.clone(), fine), windows_of(b, fine), windows_of(a.clone(), fine)])),
                bits(&windows_of(all, fine))
            );
            let mut twice = [a.clone(), a.clone()].concat();
            twice.sort_by_key(|x| x.0);
            prop_assert_eq!(
                bits(&pool(&[windows_of(a.clone(), fine), windows_of(a, fine)])),
                bits(&windows_of(twice, fine))
            );
        }
    }
}
