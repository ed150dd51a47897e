//! Spectral norm by warm-started power iteration.
//!
//! One step maps the right vector v to u = Av/‖Av‖ and back to w = Aᵀu; the estimate is
//! σ = ‖w‖ and the next v is w/σ. Between calls the vector is kept, so for weights that moved a
//! little since the last probe one or two steps suffice (σReparam, Zhai et al. 2023, takes one
//! per forward pass).
//!
//! Stopping uses the residual ‖Aᵀu − ‖Av‖·v‖ / ‖Av‖ rather than the change in σ. A residual ε
//! means (σ̂, v) is an approximate eigenpair of AᵀA, and by the residual bound for symmetric
//! matrices some singular value lies within a relative ~ε of σ̂. That certifies the value even
//! when σ₁ ≈ σ₂, where the vector converges slowly (rate (σ₂/σ₁)² per step) but the value does
//! not care which vector of the near-degenerate top pair it found. The bound names *some*
//! singular value: from a random start that is σ₁ almost surely, but a warm vector kept across
//! a change in which direction is largest can stop on the old one until the new one grows in
//! (a rate set by the gap), so probes should do a few steps per call, not stop at one.

use nalgebra::{DVector, RealField};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::math::operator::LinearOperator;
use crate::math::sketch::gaussian_vector;

/// When to stop iterating.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PowerConfig {
    /// Most steps per call.
    pub max_iters: usize,
    /// Stop once the relative residual is at most this.
    pub tolerance: f64,
    /// Seed of the deterministic random start vector used on the first call.
    pub seed: u32,
}

impl Default for PowerConfig {
    fn default() -> Self {
        PowerConfig {
            max_iters: 100,
            tolerance: 1e-4,
            seed: 0x5EED,
        }
    }
}

/// The result of one call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SpectralEstimate {
    /// Estimated ‖A‖₂ (NaN if A holds non-finite values).
    pub sigma: f64,
    /// Steps taken by this call.
    pub iterations: usize,
    /// Relative residual after the last step.
    pub residual: f64,
    /// Whether the residual reached the tolerance.
    pub converged: bool,
}

/// A power iteration that remembers its right singular vector between calls.
#[derive(Debug, Clone)]
pub struct PowerIteration<T: RealField> {
    config: PowerConfig,
    v: Option<DVector<T>>,
}

impl<T: RealField + Copy + Into<f64>> PowerIteration<T> {
    /// A fresh iteration; the first call starts from a seeded random vector.
    pub fn new(config: PowerConfig) -> Result<Self> {
        check(&config)?;
        Ok(PowerIteration { config, v: None })
    }

    /// Changes the stopping rule, keeping the warm vector.
    pub fn set_config(&mut self, config: PowerConfig) -> Result<()> {
        check(&config)?;
        self.config = config;
        Ok(())
    }

    /// The current right singular vector estimate, if any.
    pub fn vector(&self) -> Option<&DVector<T>> {
        self.v.as_ref()
    }

    /// Forgets the warm vector.
    pub fn reset(&mut self) {
        self.v = None;
    }

    /// Runs up to `max_iters` steps from the kept vector and returns the estimate.
    pub fn estimate<A: LinearOperator<T>>(&mut self, op: &A) -> SpectralEstimate {
        let n = op.ncols();
        let random_start = |attempt: u32| {
            let g = gaussian_vector(self.config.seed.wrapping_add(attempt), n);
            let mut v = DVector::from_iterator(n, g.into_iter().map(nalgebra::convert));
            v.normalize_mut();
            v
        };
        // Whether `v` was just drawn at random: if such a vector maps to zero, A is zero
        // (almost surely); a warm vector mapping to zero only means A changed under it.
        let mut fresh = self.v.as_ref().is_none_or(|v| v.len() != n);
        let mut v = match self.v.take() {
            Some(v) if v.len() == n => v,
            _ => random_start(0),
        };
        let mut estimate = SpectralEstimate {
            sigma: 0.0,
            iterations: 0,
            residual: f64::INFINITY,
            converged: false,
        };
        if n == 0 || op.nrows() == 0 {
            estimate.converged = true;
            estimate.residual = 0.0;
            return estimate;
        }
        for i in 1..=self.config.max_iters {
            estimate.iterations = i;
            let mut u = op.apply(&v);
            let su = u.norm();
            let su_f: f64 = su.into();
            if !su_f.is_finite() {
                // Non-finite weights: report NaN and drop the poisoned vector.
                estimate.sigma = f64::NAN;
                estimate.residual = f64::NAN;
                return estimate;
            }
            if su == T::zero() {
                if fresh {
                    estimate.residual = 0.0;
                    estimate.converged = true;
                    return estimate;
                }
                v = random_start(i as u32);
                fresh = true;
                continue;
            }
            fresh = false;
            u /= su;
            let w = op.apply_transpose(&u);
            let sigma = w.norm();
            let residual: f64 = ((&w - &v * su).norm() / su).into();
            v = w / sigma;
            estimate.sigma = sigma.into();
            estimate.residual = residual;
            if residual <= self.config.tolerance {
                estimate.converged = true;
                break;
            }
        }
        self.v = Some(v);
        estimate
    }
}

fn check(config: &PowerConfig) -> Result<()> {
    // Written so that a NaN tolerance is refused too.
    if config.max_iters == 0
        || config.tolerance.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater)
    {
        return Err(Error::Config(format!(
            "power iteration needs max_iters ≥ 1 and tolerance > 0, got {} and {}",
            config.max_iters, config.tolerance
        )));
    }
    Ok(())
}

/// Stable rank ‖W‖_F²/σ₁²: between 1 (rank one) and rank(W). NaN when σ₁ is 0 or not finite.
pub fn stable_rank(frobenius_sq: f64, sigma: f64) -> f64 {
    if sigma > 0.0 && sigma.is_finite() {
        frobenius_sq / (sigma * sigma)
    } else {
        f64::NAN
    }
}
