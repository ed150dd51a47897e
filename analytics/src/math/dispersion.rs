//! Dispersion of one value per rank: mean, population standard deviation, range, coefficient
//! of variation, median and MAD. Non-finite values are counted, not averaged: one NaN rank must
//! not turn every statistic into NaN, and must not vanish either.

use serde::{Deserialize, Serialize};

/// MAD × this estimates σ for normal data.
pub const MAD_TO_SIGMA: f64 = 1.482_602_218_505_602;

/// Statistics over the finite values of a slice.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Dispersion {
    /// Finite values used.
    pub count: usize,
    /// Values skipped because they were NaN or ±Inf.
    pub nonfinite: usize,
    pub mean: f64,
    /// Population standard deviation (divides by n).
    pub std: f64,
    pub min: f64,
    pub max: f64,
    /// max − min.
    pub range: f64,
    /// std / |mean|; `None` when the mean is 0.
    pub cv: Option<f64>,
    pub median: f64,
    /// Median absolute deviation from the median (unscaled).
    pub mad: f64,
}

impl Dispersion {
    /// Statistics of `values`; `None` when no value is finite.
    pub fn of(values: &[f64]) -> Option<Self> {
        let mut finite = Vec::with_capacity(values.len());
        finite.extend(values.iter().copied().filter(|v| v.is_finite()));
        let count = finite.len();
        if count == 0 {
            return None;
        }
        let n = count as f64;
        let mean = finite.iter().sum::<f64>() / n;
        let var = finite.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n;
        let std = var.sqrt();
        let min = finite.iter().copied().fold(f64::INFINITY, f64::min);
        let max = finite.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let median = median(&mut finite);
        // The deviations overwrite the values (no second buffer): only the median was needed.
        for v in &mut finite {
            *v = (*v - median).abs();
        }
        let mad = self::median(&mut finite);
        Some(Dispersion {
            count,
            nonfinite: values.len() - count,
            mean,
            std,
            min,
            max,
            range: max - min,
            cv: (mean != 0.0).then(|| std / mean.abs()),
            median,
            mad,
        })
    }

    /// 1.4826·MAD: a σ estimate that ignores outliers.
    pub fn robust_sigma(&self) -> f64 {
        MAD_TO_SIGMA * self.mad
    }

    /// Robust z-scores of `values` against these statistics (see [`robust_z_scores`]).
    pub fn z_scores(&self, values: &[f64], min_scale: f64) -> Vec<f64> {
        let scale = self.robust_sigma().max(min_scale).max(f64::MIN_POSITIVE);
        values.iter().map(|v| (v - self.median) / scale).collect()
    }
}

/// Median of finite values (the slice is reordered, not sorted: the middle values are
/// selected in linear time, and the result is the sorted slice's to the bit). NaN for an empty
/// slice.
pub fn median(values: &mut [f64]) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    let (mid, even) = (values.len() / 2, values.len().is_multiple_of(2));
    let (below, at, _) = values.select_nth_unstable_by(mid, f64::total_cmp);
    let upper = *at;
    if even {
        // The value before the middle in sorted order is the largest of those below it.
        let lower = below
            .iter()
            .copied()
            .max_by(f64::total_cmp)
            .unwrap_or(upper);
        (lower + upper) / 2.0
    } else {
        upper
    }
}

/// The median of values already sorted ascending (NaN when there are none).
pub fn median_of_sorted(values: &[f64]) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    let mid = values.len() / 2;
    if values.len().is_multiple_of(2) {
        (values[mid - 1] + values[mid]) / 2.0
    } else {
        values[mid]
    }
}

/// Robust z-scores (v − median)/max(1.4826·MAD, `min_scale`) of each value; NaN stays NaN.
/// `min_scale` keeps the score finite when most values are identical (ranks fed the same
/// data), which is exactly when a single deviating rank matters most.
pub fn robust_z_scores(values: &[f64], min_scale: f64) -> Vec<f64> {
    match Dispersion::of(values) {
        Some(d) => d.z_scores(values, min_scale),
        None => vec![f64::NAN; values.len()],
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The selected median is the sorted slice's, to the bit: odd and even lengths, ties,
        /// signed zeros, NaN (which `total_cmp` places by its sign).
        #[test]
        fn the_selected_median_is_the_sorted_median(values in prop::collection::vec(prop_oneof![
            6 => -1e3..1e3f64,
            2 => (0..3u8).prop_map(f64::from),
            1 => Just(-0.0),
            1 => Just(f64::NAN),
            1 => Just(f64::INFINITY),
        ], 0..70)) {
            let mut sorted = values.clone();
            sorted.sort_by(f64::total_cmp);
            let want = median_of_sorted(&sorted);
            let got = median(&mut values.clone());
            prop_assert_eq!(got.to_bits(), want.to_bits());
        }
    }

    #[test]
    fn known_values() {
        let d = Dispersion::of(&[1.0, 2.0, 3.0, 4.0, f64::NAN, f64::INFINITY]).unwrap();
        assert_eq!((d.count, d.nonfinite), (4, 2));
        assert_eq!(d.mean, 2.5);
        assert!((d.std - 1.25f64.sqrt()).abs() < 1e-15);
        assert_eq!(
            (d.min, d.max, d.range, d.median, d.mad),
            (1.0, 4.0, 3.0, 2.5, 1.0)
        );
        assert!((d.cv.unwrap() - 1.25f64.sqrt() / 2.5).abs() < 1e-15);
        assert!(Dispersion::of(&[f64::NAN]).is_none());
        assert_eq!(Dispersion::of(&[-1.0, 1.0]).unwrap().cv, None);
    }

    #[test]
    fn robust_z_names_the_outlier_even_when_the_rest_agree() {
        let z = robust_z_scores(&[2.0, 2.0, 2.0, 2.0, 5.0], 0.01);
        assert!(z[..4].iter().all(|v| *v == 0.0));
        assert!(z[4] > 100.0);
    }
}
