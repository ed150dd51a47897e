//! Dense SVD references in FP64, against which the iterative estimates are tested. These form
//! products explicitly and cost O(mn·min(m,n)); they are for checking, not for production use.

use nalgebra::DMatrix;

/// Singular values of `a`, largest first.
pub fn singular_values(a: &DMatrix<f64>) -> Vec<f64> {
    let mut s: Vec<f64> = a.singular_values().iter().copied().collect();
    s.sort_by(|x, y| y.total_cmp(x));
    s
}

/// ‖a‖₂, the largest singular value, from a full SVD.
pub fn spectral_norm(a: &DMatrix<f64>) -> f64 {
    singular_values(a).first().copied().unwrap_or(0.0)
}
