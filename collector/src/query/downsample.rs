//! Spike-preserving downsampling: a step range cut into at most `points` equal buckets, each
//! keeping min, max, last, count and the number of non-finite values. Min and max are over the
//! finite values, so one NaN does not hide the spike next to it, and the NaN itself is counted,
//! so it is never averaged away at any zoom. When the range has no more steps than `points`,
//! buckets are one step wide and the values are the raw ones.
//!
//! A bucket is a [`Cell`], the same whether it was filled row by row or merged from the
//! per-window summaries of [`crate::store::rollup`].

use rankwatch_api::{Bucket, BucketRange, Num};

/// How a step range is cut into buckets: the contract's aligned grid.
pub type Buckets = BucketRange;

pub use crate::summary::Cell;

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
    fn buckets_are_aligned_powers_of_two_and_the_edges_are_cut() {
        // 1..=1000 in at most 100 buckets: width 16, the first bucket 1..=15, the last 992..=1000.
        let b = Buckets::new(1, 1000, 100);
        assert_eq!((b.width, b.count), (16, 63));
        assert_eq!((b.start(0), b.end(0)), (1, 15));
        assert_eq!((b.start(1), b.end(1)), (16, 31));
        assert_eq!((b.start(62), b.end(62)), (992, 1000));
        assert_eq!(b.index(15), Some(0));
        assert_eq!(b.index(16), Some(1));
        // Alignment adding a bucket widens the grid: 0..=15 fits 2 buckets of 8, 1..=16 does not.
        assert_eq!(Buckets::new(0, 15, 2).width, 8);
        assert_eq!(Buckets::new(1, 16, 2).width, 16);
    }

    #[test]
    fn the_whole_u64_range_buckets_without_overflow() {
        for points in [2, 3, 5, 15, 17, 1000] {
            let b = Buckets::new(0, u64::MAX, points);
            assert!(b.count <= points);
            assert_eq!(b.index(u64::MAX), Some(b.count as usize - 1));
            assert_eq!(b.end(b.count as usize - 1), u64::MAX);
        }
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
            let b = Buckets::new(0, values.len() as u64 - 1, points as u64);
            prop_assert!(b.count <= points as u64);
            let mut cells = vec![Cell::default(); b.count as usize];
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
