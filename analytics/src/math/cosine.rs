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
    check_shapes(sketches, norms)?;
    let k = sketches.len();
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

/// The mean of the finite entries of the strictly upper triangle of [`sketch_cosine_matrix`],
/// in O(K·d) instead of the matrix's O(K²·d). The usable ranks are those whose whole row of the
/// matrix is finite: a finite positive norm and every entry finite. With w_i = s_i/n_i over
/// them, Σ_{i<j} ⟨w_i,w_j⟩ = (‖Σ_i w_i‖² − Σ_i ‖w_i‖²)/2, so the mean of the M(M−1)/2 pairs
/// is (‖Σ w_i‖² − Σ ‖w_i‖²)/(M(M−1)). Equal to `cos_pair_mean(&sketch_cosine_matrix(..))` up
/// to rounding (tested against it): what the alert engine computes at every sketched step,
/// where with thousands of ranks the matrix was the largest cost it had. `None` with fewer
/// than two usable ranks; the same shape errors as the matrix.
pub fn sketch_pair_mean(sketches: &[&[f32]], norms: &[f64]) -> Result<Option<f64>> {
    check_shapes(sketches, norms)?;
    let dim = sketches.first().map_or(0, |s| s.len());
    let mut sum = vec![0.0f64; dim];
    let (mut own, mut usable) = (0.0f64, 0usize);
    for (s, &n) in sketches.iter().zip(norms) {
        if !(n.is_finite() && n > 0.0) {
            continue;
        }
        let inverse = 1.0 / n;
        let square = sum_of_squares(s, inverse);
        if !square.is_finite() {
            continue; // an entry that is not finite: every cosine of this rank is NaN or ±inf
        }
        for (total, x) in sum.iter_mut().zip(s.iter()) {
            *total += f64::from(*x) * inverse;
        }
        own += square;
        usable += 1;
    }
    if usable < 2 {
        return Ok(None);
    }
    let total = sum_of_squares(&sum, 1.0);
    let pairs = (usable * (usable - 1)) as f64;
    Ok(Some((total - own) / pairs).filter(|c| c.is_finite()))
}

/// Σ(x·scale)², in eight running sums rather than one: a single sum waits for each addition
/// before the next (a chain as long as the sketch, most of this function's time at 1,024
/// entries); eight independent ones overlap. The rounding differs from one sum's by a few ulps.
fn sum_of_squares<T: Copy + Into<f64>>(values: &[T], scale: f64) -> f64 {
    let mut lanes = [0.0f64; 8];
    let chunks = values.chunks_exact(8);
    let rest = chunks.remainder();
    for chunk in chunks {
        for (lane, &x) in lanes.iter_mut().zip(chunk) {
            let y = x.into() * scale;
            *lane += y * y;
        }
    }
    for (lane, &x) in lanes.iter_mut().zip(rest) {
        let y = x.into() * scale;
        *lane += y * y;
    }
    lanes.iter().sum()
}

fn check_shapes(sketches: &[&[f32]], norms: &[f64]) -> Result<()> {
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
    Ok(())
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

    /// The O(K·d) pair mean against the FP64 matrix it replaces, over random ranks, lengths,
    /// agreement, and ranks made unusable (zero, infinite or NaN norm; a NaN or infinite entry).
    #[test]
    fn the_pair_mean_without_the_matrix_agrees_with_it() {
        use proptest::prelude::*;
        let rank = (
            -4.0f32..4.0,
            0.2f64..5.0,
            prop_oneof![8 => Just(None), 1 => Just(Some(0.0)), 1 => Just(Some(f64::INFINITY)),
                        1 => Just(Some(f64::NAN)), 1 => Just(Some(-1.0))],
            prop_oneof![8 => Just(None), 1 => Just(Some(f32::NAN)), 1 => Just(Some(f32::INFINITY))],
        );
        let case = (
            1usize..40,
            prop::collection::vec(-1.0f32..1.0, 64),
            prop::collection::vec(rank, 0..24),
            0.0f32..3.0,
        );
        proptest!(ProptestConfig::with_cases(512), |((dim, shared, ranks, spread) in case)| {
            let mut vectors = Vec::new();
            let mut norms = Vec::new();
            for (i, (noise, scale, bad_norm, bad_entry)) in ranks.iter().enumerate() {
                // A shared direction plus each rank's own: cosines anywhere in [-1, 1].
                let mut v: Vec<f32> = (0..dim)
                    .map(|k| shared[k] + spread * noise * shared[(k * 7 + i * 13 + 5) % 64])
                    .collect();
                if let Some(bad) = bad_entry {
                    v[i % dim] = *bad;
                }
                let norm = v.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt() * scale;
                norms.push(bad_norm.unwrap_or(norm));
                vectors.push(v);
            }
            let slices: Vec<&[f32]> = vectors.iter().map(Vec::as_slice).collect();
            let reference = cos_pair_mean(&sketch_cosine_matrix(&slices, &norms).unwrap()).filter(|c| c.is_finite());
            let fast = sketch_pair_mean(&slices, &norms).unwrap();
            match (reference, fast) {
                (None, None) => {}
                (Some(r), Some(f)) => prop_assert!((r - f).abs() <= 1e-9 * (1.0 + r.abs()), "{r} vs {f}"),
                other => prop_assert!(false, "{other:?}"),
            }
        });
        let err = sketch_pair_mean(&[&[1.0, 0.0], &[1.0]], &[1.0, 1.0])
            .unwrap_err()
            .to_string();
        assert!(err.contains("sketch 1 has 1 entries"), "{err}");
    }
}
