//! Synthetic training signals with injected faults, for demos and tests of the detectors.
//!
//! A data-parallel step draws each rank's gradient as g_k = G + ξ_k: a slowly rotating true
//! gradient G of unit norm plus independent noise of the same expected norm (noise-to-signal
//! 1, so healthy ranks have pairwise cosine ≈ 0.5), and each rank's loss as 2 ± 0.05. Faults
//! act on one rank the way real ones do: a scaled or sign-flipped local gradient (a faulty
//! kernel or silent data corruption before the all-reduce) or an offset loss (a rank fed other
//! data). Everything is deterministic in the seed.

use nalgebra::DVector;

use crate::detect::StepObservation;
use crate::math::sketch::gaussian_vector;
use crate::math::step::RankValues;

/// A deterministic stream of standard normal values.
#[derive(Debug, Clone)]
pub struct Noise {
    values: Vec<f64>,
    at: usize,
}

impl Noise {
    /// A stream from `seed` (it cycles after 2²⁰ values).
    pub fn new(seed: u32) -> Self {
        Noise {
            values: gaussian_vector(seed, 1 << 20),
            at: 0,
        }
    }

    /// The next value.
    pub fn next_value(&mut self) -> f64 {
        self.at = (self.at + 1) % self.values.len();
        self.values[self.at]
    }

    /// The next `n` values as a vector.
    pub fn vector(&mut self, n: usize) -> DVector<f64> {
        DVector::from_fn(n, |_, _| self.next_value())
    }
}

/// What goes wrong on one rank.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Fault {
    None,
    /// The rank's local gradient is multiplied by the factor.
    ScaleGradient(u32, f64),
    /// The rank's local gradient has its sign flipped.
    FlipGradient(u32),
    /// The rank's loss is offset (it sees different data).
    LossOffset(u32, f64),
}

/// A simulated data-parallel job.
#[derive(Debug, Clone)]
pub struct DataParallelSim {
    pub world_size: u32,
    pub dim: usize,
    /// Expected norm of each rank's gradient noise relative to the true gradient's (1 at
    /// construction). Raising it over a run mimics training, where |G| shrinks against the noise.
    pub noise_level: f64,
    rng: Noise,
}

impl DataParallelSim {
    /// `world_size` ranks with gradients of dimension `dim`.
    pub fn new(world_size: u32, dim: usize, seed: u32) -> Self {
        DataParallelSim {
            world_size,
            dim,
            noise_level: 1.0,
            rng: Noise::new(seed),
        }
    }

    /// One step's per-rank values, with `fault` applied.
    pub fn step(&mut self, step: u64, fault: Fault) -> StepObservation {
        let dim = self.dim;
        let signal = DVector::from_fn(dim, |i, _| {
            (i as f64 + step as f64 * 0.01).sin() / (dim as f64 / 2.0).sqrt()
        });
        let mut grads: Vec<DVector<f64>> = (0..self.world_size)
            .map(|_| &signal + self.rng.vector(dim) * (self.noise_level / (dim as f64).sqrt()))
            .collect();
        let mut losses: Vec<f64> = (0..self.world_size)
            .map(|_| 2.0 + 0.05 * self.rng.next_value())
            .collect();
        match fault {
            Fault::None => {}
            Fault::ScaleGradient(r, s) => grads[r as usize] *= s,
            Fault::FlipGradient(r) => grads[r as usize] *= -1.0,
            Fault::LossOffset(r, o) => losses[r as usize] += o,
        }
        let mean =
            grads.iter().fold(DVector::zeros(dim), |a, g| a + g) / f64::from(self.world_size);
        let ranks = grads
            .iter()
            .zip(&losses)
            .enumerate()
            .map(|(k, (g, loss))| RankValues {
                rank: k as u32,
                loss: Some(*loss),
                tokens: Some(512.0),
                grad_norm: Some(g.norm()),
                grad_norm_mean: Some(mean.norm()),
                cos_to_mean: Some(g.dot(&mean) / (g.norm() * mean.norm())),
            })
            .collect();
        StepObservation {
            step,
            time_ms: step as i64 * 100,
            world_size: self.world_size,
            ranks,
        }
    }
}
