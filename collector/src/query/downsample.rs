//! Spike-preserving downsampling: a step range cut into at most `points` equal buckets, each
//! keeping min, max, last, count and the number of non-finite values. Min and max are over the
//! finite values, so one NaN does not hide the spike next to it, and the NaN itself is counted,
//! so it is never averaged away at any zoom. When the range has no more steps than `points`,
//! buckets are one step wide and the values are the raw ones.

use rankwatch_api::{Bucket, BucketRange, Num};

/// How a step range is cut into buckets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Buckets {
    pub from: u64,
    pub to: u64,
    pub width: u64,
    pub count: usize,
}

impl Buckets {
    /// Buckets covering `from..=to` with at most `points` buckets.
    pub fn new(from: u64, to: u64, points: usize) -> Buckets {
        // u128: the span of 0..=u64::MAX does not fit in a u64.
        let span = u128::from(to.saturating_sub(from)) + 1;
        let points = points.max(1) as u128;
        let width = span.div_ceil(points).max(1);
        Buckets {
            from,
            to,
            width: u64::try_from(width).unwrap_or(u64::MAX),
            count: span.div_ceil(width) as usize,
        }
    }

    /// The buckets as the API describes them.
    pub fn range(&self) -> BucketRange {
        BucketRange {
            from: self.from,
            to: self.to,
            width: self.width,
            count: self.count as u64,
        }
    }

    /// The bucket of `step`, if it is in range.
    pub fn index(&self, step: u64) -> Option<usize> {
        (step >= self.from && step <= self.to)
            .then(|| (((step - self.from) / self.width) as usize).min(self.count - 1))
    }

    /// First step of bucket `i`.
    pub fn start(&self, i: usize) -> u64 {
        self.from
            .saturating_add((i as u64).saturating_mul(self.width))
    }

    /// Last step of bucket `i`.
    pub fn end(&self, i: usize) -> u64 {
        if i + 1 >= self.count {
            return self.to;
        }
        self.start(i).saturating_add(self.width - 1).min(self.to)
    }
}

/// One bucket's summary.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Cell {
    pub count: u64,
    pub nonfinite: u64,
    pub min: Option<f64>,
    pub max: Option<f64>,
    pub last_step: u64,
    last_sum: f64,
    last_n: u32,
}

impl Cell {
    /// Adds one value.
    pub fn add(&mut self, step: u64, value: f64) {
        self.count += 1;
        if value.is_finite() {
            self.min = Some(self.min.map_or(value, |m| m.min(value)));
            self.max = Some(self.max.map_or(value, |m| m.max(value)));
        } else {
            self.nonfinite += 1;
        }
        // `last` is the value at the greatest step; several values there (several ranks in a
        // heatmap cell) are averaged, and a NaN among them makes it NaN, which is the truth.
        if self.count == 1 || step > self.last_step {
            self.last_step = step;
            self.last_sum = value;
            self.last_n = 1;
        } else if step == self.last_step {
            self.last_sum += value;
            self.last_n += 1;
        }
    }

    /// The value at the last step.
    pub fn last(&self) -> Option<f64> {
        (self.count > 0).then(|| self.last_sum / f64::from(self.last_n.max(1)))
    }
}

/// The non-empty buckets, as the API returns them.
pub fn render(buckets: &Buckets, cells: &[Cell]) -> Vec<Bucket> {
    cells
        .iter()
        .enumerate()
        .filter(|(_, c)| c.count > 0)
        .map(|(i, c)| Bucket {
            start: buckets.start(i),
            end: buckets.end(i),
            count: c.count,
            nonfinite: c.nonfinite,
            min: c.min.map(Num),
            max: c.max.map(Num),
            last: c.last().map(Num),
            last_step: c.last_step,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn narrow_ranges_keep_raw_values() {
        let b = Buckets::new(10, 19, 1000);
        assert_eq!((b.width, b.count), (1, 10));
        assert_eq!(b.index(10), Some(0));
        assert_eq!(b.index(19), Some(9));
        assert_eq!(b.index(20), None);
    }

    #[test]
    fn the_whole_u64_range_buckets_without_overflow() {
        for points in [1, 3, 5, 15, 17, 1000] {
            let b = Buckets::new(0, u64::MAX, points);
            assert!(b.count <= points);
            assert_eq!(b.index(u64::MAX), Some(b.count - 1));
            assert_eq!(b.end(b.count - 1), u64::MAX);
        }
    }

    #[test]
    fn a_nan_is_counted_and_does_not_hide_the_spike() {
        let mut c = Cell::default();
        for (s, v) in [(1, 1.0), (2, f64::NAN), (3, 1e9), (4, 2.0)] {
            c.add(s, v);
        }
        assert_eq!((c.count, c.nonfinite), (4, 1));
        assert_eq!((c.min, c.max, c.last()), (Some(1.0), Some(1e9), Some(2.0)));
    }

    proptest! {
        /// Whatever the zoom, the global max and every non-finite value survive, and counts add
        /// up to the rows.
        #[test]
        fn extremes_and_nans_survive_every_zoom(
            values in proptest::collection::vec(
                prop_oneof![8 => -1e6f64..1e6, 1 => Just(f64::NAN), 1 => Just(f64::INFINITY)],
                1..400,
            ),
            points in 1usize..50,
        ) {
            let b = Buckets::new(0, values.len() as u64 - 1, points);
            prop_assert!(b.count <= points);
            let mut cells = vec![Cell::default(); b.count];
            for (s, &v) in values.iter().enumerate() {
                cells[b.index(s as u64).unwrap()].add(s as u64, v);
            }
            let out = render(&b, &cells);
            let count: u64 = out.iter().map(|o| o.count).sum();
            prop_assert_eq!(count as usize, values.len());
            let nonfinite: u64 = out.iter().map(|o| o.nonfinite).sum();
            prop_assert_eq!(nonfinite as usize, values.iter().filter(|v| !v.is_finite()).count());
            let finite_max = values.iter().copied().filter(|v| v.is_finite()).fold(None, |m: Option<f64>, v| Some(m.map_or(v, |m| m.max(v))));
            let got_max = out.iter().filter_map(|o| o.max.map(|n| n.0)).fold(None, |m: Option<f64>, v| Some(m.map_or(v, |m| m.max(v))));
            prop_assert_eq!(finite_max, got_max);
        }
    }
}
