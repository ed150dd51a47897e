//! Gradient noise scale from the per-rank norms (McCandlish et al. 2018, "An Empirical Model of
//! Large-Batch Training", appendix A), used as the noise baseline for inter-worker cosines.
//!
//! Model each rank's gradient as g_k = G + ξ_k with independent noise of trace S_b per local
//! batch. Then E n_k² = |G|² + S_b and E‖ḡ‖² = |G|² + S_b/K, which gives unbiased estimates
//! |G|² ≈ (K‖ḡ‖² − mean n_k²)/(K−1) and S_b ≈ K(mean n_k² − ‖ḡ‖²)/(K−1). Under pure sampling
//! noise two ranks' gradients have expected cosine ≈ |G|²/(|G|² + S_b): a low cosine is only
//! inconsistency when it is lower than that. Single-step estimates are noisy and can be
//! negative, so [`NoiseScaleTracker`] smooths numerator and denominator separately before
//! dividing, as the paper recommends.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// One step's estimates.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct NoiseEstimate {
    /// |G|², the squared norm of the true gradient.
    pub signal_sq: f64,
    /// S_b = tr(Σ)/b, the noise in one rank's local-batch gradient.
    pub noise_sq: f64,
}

impl NoiseEstimate {
    /// From K ≥ 2 local norms and the norm of their average; `None` if undefined.
    pub fn from_norms(norms: &[f64], mean_norm: f64) -> Option<Self> {
        let k = norms.len();
        if k < 2 || !mean_norm.is_finite() || norms.iter().any(|n| !n.is_finite()) {
            return None;
        }
        let k = k as f64;
        let mean_sq = norms.iter().map(|n| n * n).sum::<f64>() / k;
        let avg_sq = mean_norm * mean_norm;
        Some(NoiseEstimate {
            signal_sq: (k * avg_sq - mean_sq) / (k - 1.0),
            noise_sq: k * (mean_sq - avg_sq) / (k - 1.0),
        })
    }

    /// S_b/|G|²: the noise scale B_simple in units of local batches.
    pub fn noise_to_signal(&self) -> f64 {
        self.noise_sq / self.signal_sq
    }

    /// B_simple in samples (or tokens) given the local batch size in the same unit.
    pub fn noise_scale(&self, local_batch: f64) -> f64 {
        local_batch * self.noise_to_signal()
    }

    /// Expected cosine of two ranks' gradients if they differ by sampling noise only.
    pub fn expected_pair_cosine(&self) -> f64 {
        self.signal_sq / (self.signal_sq + self.noise_sq)
    }
}

/// Exponential moving averages of |G|² and S_b.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct NoiseScaleTracker {
    alpha: f64,
    smoothed: Option<NoiseEstimate>,
}

impl NoiseScaleTracker {
    /// `alpha` in (0, 1] is the weight of each new step.
    pub fn new(alpha: f64) -> Result<Self> {
        if !(alpha > 0.0 && alpha <= 1.0) {
            return Err(Error::Config(format!(
                "noise-scale smoothing alpha must be in (0, 1], got {alpha}"
            )));
        }
        Ok(NoiseScaleTracker {
            alpha,
            smoothed: None,
        })
    }

    /// Folds in one step; a non-finite estimate is skipped so it cannot poison the average.
    pub fn update(&mut self, e: NoiseEstimate) -> Option<NoiseEstimate> {
        if !(e.signal_sq.is_finite() && e.noise_sq.is_finite()) {
            return self.smoothed;
        }
        let s = match self.smoothed {
            None => e,
            Some(p) => NoiseEstimate {
                signal_sq: p.signal_sq + self.alpha * (e.signal_sq - p.signal_sq),
                noise_sq: p.noise_sq + self.alpha * (e.noise_sq - p.noise_sq),
            },
        };
        self.smoothed = Some(s);
        Some(s)
    }

    /// The current smoothed estimate.
    pub fn current(&self) -> Option<NoiseEstimate> {
        self.smoothed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recovers_signal_and_noise_from_exact_moments() {
        // |G|² = 4, S_b = 12, K = 4: n_k² = 16, ‖ḡ‖² = 4 + 3 = 7.
        let e = NoiseEstimate::from_norms(&[4.0; 4], 7f64.sqrt()).unwrap();
        assert!((e.signal_sq - 4.0).abs() < 1e-12);
        assert!((e.noise_sq - 12.0).abs() < 1e-12);
        assert!((e.noise_to_signal() - 3.0).abs() < 1e-12);
        assert!((e.expected_pair_cosine() - 0.25).abs() < 1e-12);
        assert!((e.noise_scale(8.0) - 24.0).abs() < 1e-12);
    }

    #[test]
    fn tracker_smooths_and_skips_non_finite_steps() {
        let e = |signal_sq, noise_sq| NoiseEstimate {
            signal_sq,
            noise_sq,
        };
        let mut t = NoiseScaleTracker::new(0.5).unwrap();
        t.update(e(2.0, 0.0));
        let s = t.update(e(4.0, 2.0)).unwrap();
        assert_eq!((s.signal_sq, s.noise_sq), (3.0, 1.0));
        let s = t.update(e(f64::NAN, 2.0)).unwrap();
        assert_eq!((s.signal_sq, s.noise_sq), (3.0, 1.0));
        assert!(NoiseScaleTracker::new(f64::NAN).is_err());
        assert!(NoiseScaleTracker::new(0.0).is_err());
    }
}
