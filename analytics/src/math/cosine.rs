//! Inter-worker gradient cosines.
//!
//! C_w is exact from scalars every rank already has: with K ranks, local norms n_i and the norm
//! of the average ‖ḡ‖, K²‖ḡ‖² = Σ_i n_i² + Σ_{i≠j} ⟨g_i,g_j⟩, hence
//! C_w = (K²‖ḡ‖² − Σn_i²) / ((Σn_i)² − Σn_i²) = Σ_{i≠j}⟨g_i,g_j⟩ / Σ_{i≠j} n_i n_j,
//! the norm-weighted mean of the pairwise cosines (equal to their plain mean when all norms are
//! equal). The full matrix needs sketches: cos_ij ≈ ⟨s_i,s_j⟩/(n_i n_j) with exact norms.

use nalgebra::DMatrix;

use crate::error::{Error, Result};

/// C_w from the ranks' local norms and the norm of their average. `None` when it is undefined
/// (fewer than two ranks, all-zero norms, or non-finite inputs).
pub fn cos_weighted(norms: &[f64], mean_norm: f64) -> Option<f64> {
    let k = norms.len();
    if k < 2 || !mean_norm.is_finite() || norms.iter().any(|n| !n.is_finite()) {
        return None;
    }
    let k = k as f64;
    let sum: f64 = norms.iter().sum();
    let sum_sq: f64 = norms.iter().map(|n| n * n).sum();
    let denominator = sum * sum - sum_sq;
    (denominator > 0.0).then(|| (k * k * mean_norm * mean_norm - sum_sq) / denominator)
}

/// The K×K matrix of sketch cosines ⟨s_i,s_j⟩/(n_i n_j), with a unit diagonal. Estimates are
/// not clipped to [−1, 1]: clipping would bias them; a UI may clip for display. A rank whose
/// norm is zero or not finite has no direction: its row and column are NaN (diagonal included),
/// shown as such rather than hidden.
pub fn sketch_cosine_matrix(sketches: &[&[f32]], norms: &[f64]) -> Result<DMatrix<f64>> {
    let k = sketches.len();
    if norms.len() != k {
        return Err(Error::Dimension(format!(
            "{k} sketches but {} norms",
            norms.len()
        )));
    }
    if let Some(first) = sketches.first()
        && let Some(bad) = sketches.iter().position(|s| s.len() != first.len())
    {
        return Err(Error::Dimension(format!(
            "sketch {bad} has {} entries, sketch 0 has {}",
            sketches[bad].len(),
            first.len()
        )));
    }
    let usable = |i: usize| norms[i].is_finite() && norms[i] > 0.0;
    Ok(DMatrix::from_fn(k, k, |i, j| {
        if !usable(i) || !usable(j) {
            return f64::NAN;
        }
        if i == j {
            return 1.0;
        }
        let dot: f64 = sketches[i]
            .iter()
            .zip(sketches[j])
            .map(|(a, b)| f64::from(*a) * f64::from(*b))
            .sum();
        dot / (norms[i] * norms[j])
    }))
}

/// Mean of the finite entries of the strictly upper triangle of a cosine matrix; `None` when
/// there is no such entry (fewer than two usable ranks).
pub fn cos_pair_mean(matrix: &DMatrix<f64>) -> Option<f64> {
    let k = matrix.nrows();
    let pairs: Vec<f64> = (0..k)
        .flat_map(|i| (i + 1..k).map(move |j| (i, j)))
        .map(|(i, j)| matrix[(i, j)])
        .filter(|c| c.is_finite())
        .collect();
    (!pairs.is_empty()).then(|| pairs.iter().sum::<f64>() / pairs.len() as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identical_gradients_have_cosine_one() {
        // Four identical gradients of norm 3: the mean has norm 3 as well.
        let c = cos_weighted(&[3.0; 4], 3.0).unwrap();
        assert!((c - 1.0).abs() < 1e-12);
        // Two opposite gradients average to zero: cosine −1.
        let c = cos_weighted(&[2.0, 2.0], 0.0).unwrap();
        assert!((c + 1.0).abs() < 1e-12);
        assert_eq!(cos_weighted(&[1.0], 1.0), None);
        assert_eq!(cos_weighted(&[1.0, f64::NAN], 1.0), None);
    }

    #[test]
    fn matrix_shape_errors_are_named() {
        let a = [1.0f32, 0.0];
        let b = [1.0f32];
        let err = sketch_cosine_matrix(&[&a, &b], &[1.0, 1.0])
            .unwrap_err()
            .to_string();
        assert!(err.contains("sketch 1 has 1 entries"), "{err}");
        assert!(sketch_cosine_matrix(&[&a], &[1.0, 2.0]).is_err());
    }

    #[test]
    fn a_zero_norm_rank_is_nan_and_skipped_in_the_mean() {
        let s = [1.0f32, 0.0];
        let m = sketch_cosine_matrix(&[&s, &s, &[0.0, 0.0]], &[1.0, 1.0, 0.0]).unwrap();
        assert!(m[(0, 2)].is_nan() && m[(2, 1)].is_nan() && m[(2, 2)].is_nan());
        assert_eq!(m[(0, 1)], 1.0);
        assert_eq!(cos_pair_mean(&m), Some(1.0));
        let lone = sketch_cosine_matrix(&[&s, &s], &[1.0, f64::INFINITY]).unwrap();
        assert_eq!(cos_pair_mean(&lone), None);
    }
}
