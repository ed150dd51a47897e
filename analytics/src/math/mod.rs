//! The metric math (definitions: `docs/architecture.md`, "The analytics crate"), in plain Rust on `nalgebra` and slices.
//!
//! Spectral norms use warm-started power iteration on linear operators ([`operator`],
//! [`power`]), so products such as W_down·W_up are never formed; [`mod@reference`] holds the dense
//! SVD the tests compare against. The cross-rank statistics ([`dispersion`], [`cosine`],
//! [`noise`], [`mod@perplexity`]) are what the collector computes per step, and [`step`] bundles
//! them; [`locator`] names the tensor two replicas' fingerprints differ in. [`sketch`] defines the gradient sketches precisely enough for any client to reproduce.

pub mod cosine;
pub mod dispersion;
pub mod locator;
pub mod noise;
pub mod operator;
pub mod perplexity;
pub mod power;
pub mod reference;
pub mod sketch;
pub mod step;

pub use cosine::{cos_pair_mean, cos_weighted, sketch_cosine_matrix, sketch_pair_mean};
pub use dispersion::{Dispersion, robust_z_scores};
pub use noise::{NoiseEstimate, NoiseScaleTracker};
pub use operator::{GroupedOv, LinearOperator, Product, Transposed};
pub use perplexity::perplexity;
pub use power::{PowerConfig, PowerIteration, SpectralEstimate, stable_rank};
pub use sketch::{Sketch, SketchKind};
pub use step::{RankValues, StepStats};
