//! Gradient sketches: a k-dimensional random projection of a rank's local gradient, with a seed
//! shared by all ranks so that ⟨s_i, s_j⟩ estimates ⟨g_i, g_j⟩ without moving gradients.
//!
//! The randomness is a counter-based hash, not a generator's stream, so a client can compute
//! the sign or bucket of coordinate i in isolation (a DDP bucket at a time, on a GPU) and every
//! implementation gives bit-identical answers. All arithmetic is on unsigned 32-bit words
//! modulo 2³²; `lo(i)` and `hi(i)` are the low and high 32 bits of the 64-bit coordinate index.
//!
//! ```text
//! fmix32(h)    = h ^= h >> 16; h *= 0x85EBCA6B; h ^= h >> 13; h *= 0xC2B2AE35; h ^= h >> 16
//! key(seed)    = fmix32(seed ^ 0x9E3779B9)
//! hash(seed,i) = fmix32((fmix32(lo(i) ^ key(seed)) ^ hi(i)) + key(seed))
//! sign(h)      = -1 if h >= 2^31 else +1
//!
//! CountSketch  bucket(i) = (hash(seed,i) & 0x7FFFFFFF) mod k
//!              s[bucket(i)] += sign(hash(seed,i)) · g_i
//! Rademacher   row(j)    = hash(seed, 2^63 + j)            (a seed per output coordinate)
//!              s[j]      = k^(-1/2) · Σ_i sign(hash(row(j), i)) · g_i
//! ```
//!
//! Both are unbiased for inner products, E⟨Sa,Sb⟩ = ⟨a,b⟩, with
//! Var⟨Sa,Sb⟩ = (‖a‖²‖b‖² + ⟨a,b⟩² − 2Σa_i²b_i²)/k, so the cosine estimate ⟨Sa,Sb⟩/(‖a‖‖b‖)
//! (with exact norms) has standard error at most √((1+cos²)/k): 0.031–0.044 at k = 1024.
//! CountSketch costs O(d) per gradient and is the SDK's default; the dense Rademacher
//! projection costs O(dk) and exists for small models and as a reference.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Default sketch dimension.
pub const DEFAULT_SKETCH_DIM: usize = 1024;

/// The murmur3 32-bit finaliser.
pub const fn fmix32(mut h: u32) -> u32 {
    h ^= h >> 16;
    h = h.wrapping_mul(0x85EB_CA6B);
    h ^= h >> 13;
    h = h.wrapping_mul(0xC2B2_AE35);
    h ^= h >> 16;
    h
}

/// The per-seed key.
pub const fn seed_key(seed: u32) -> u32 {
    fmix32(seed ^ 0x9E37_79B9)
}

/// The hash of coordinate `index` under `seed` (see the module documentation).
pub const fn hash32(seed: u32, index: u64) -> u32 {
    let key = seed_key(seed);
    let lo = index as u32;
    let hi = (index >> 32) as u32;
    fmix32((fmix32(lo ^ key) ^ hi).wrapping_add(key))
}

const fn sign_of(h: u32) -> f64 {
    if h >= 0x8000_0000 { -1.0 } else { 1.0 }
}

/// `n` standard normal values from `seed` (Box–Muller on [`hash32`] uniforms); used for start
/// vectors and reproducible test data.
pub fn gaussian_vector(seed: u32, n: usize) -> Vec<f64> {
    let uniform = |i: u64| (f64::from(hash32(seed, i)) + 0.5) / 4_294_967_296.0;
    (0..n)
        .map(|i| {
            let pair = (i / 2) as u64;
            let (u1, u2) = (uniform(2 * pair), uniform(2 * pair + 1));
            let r = (-2.0 * u1.ln()).sqrt();
            let theta = 2.0 * std::f64::consts::PI * u2;
            if i % 2 == 0 {
                r * theta.cos()
            } else {
                r * theta.sin()
            }
        })
        .collect()
}

/// Which projection a sketch uses: the contract's vocabulary.
pub use rankwatch_api::SketchKind;

/// A sketch definition: kind, shared seed and output dimension k. Built only through
/// [`Sketch::new`] (deserialisation too), so k is always valid.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "SketchSpec", into = "SketchSpec")]
pub struct Sketch {
    kind: SketchKind,
    seed: u32,
    dim: usize,
}

/// The serialised form of a [`Sketch`].
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
struct SketchSpec {
    kind: SketchKind,
    seed: u32,
    dim: usize,
}

impl TryFrom<SketchSpec> for Sketch {
    type Error = Error;
    fn try_from(s: SketchSpec) -> Result<Self> {
        Sketch::new(s.kind, s.seed, s.dim)
    }
}

impl From<Sketch> for SketchSpec {
    fn from(s: Sketch) -> Self {
        SketchSpec {
            kind: s.kind,
            seed: s.seed,
            dim: s.dim,
        }
    }
}

impl Sketch {
    /// A sketch of dimension `dim` ≥ 1.
    pub fn new(kind: SketchKind, seed: u32, dim: usize) -> Result<Self> {
        if dim == 0 || dim > 1 << 24 {
            return Err(Error::Config(format!(
                "sketch dimension must be in 1..=16777216, got {dim}"
            )));
        }
        Ok(Sketch { kind, seed, dim })
    }

    /// The projection used.
    pub fn kind(&self) -> SketchKind {
        self.kind
    }

    /// The seed shared by all ranks.
    pub fn seed(&self) -> u32 {
        self.seed
    }

    /// The output dimension k.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// Adds the contribution of `chunk`, the coordinates `offset..offset+chunk.len()` of the
    /// full gradient, into `acc` (length k). Sketching is linear, so a gradient may arrive in
    /// any number of chunks (DDP buckets) in any order.
    pub fn accumulate(&self, chunk: &[f32], offset: u64, acc: &mut [f64]) -> Result<()> {
        if acc.len() != self.dim {
            return Err(Error::Dimension(format!(
                "sketch accumulator has {} entries, sketch dimension is {}",
                acc.len(),
                self.dim
            )));
        }
        match self.kind {
            SketchKind::CountSketch => {
                for (i, &g) in chunk.iter().enumerate() {
                    let h = hash32(self.seed, offset + i as u64);
                    let bucket = (h & 0x7FFF_FFFF) as usize % self.dim;
                    acc[bucket] += sign_of(h) * f64::from(g);
                }
            }
            SketchKind::Rademacher => {
                let scale = 1.0 / (self.dim as f64).sqrt();
                for (j, out) in acc.iter_mut().enumerate() {
                    let row = hash32(self.seed, (1 << 63) + j as u64);
                    let dot: f64 = chunk
                        .iter()
                        .enumerate()
                        .map(|(i, &g)| sign_of(hash32(row, offset + i as u64)) * f64::from(g))
                        .sum();
                    *out += scale * dot;
                }
            }
        }
        Ok(())
    }

    /// The sketch of a whole gradient.
    pub fn project(&self, gradient: &[f32]) -> Vec<f32> {
        let mut acc = vec![0.0; self.dim];
        self.accumulate(gradient, 0, &mut acc)
            .expect("accumulator sized to the sketch");
        acc.into_iter().map(|x| x as f32).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_is_pinned() {
        // Pinned values: any client implementation must reproduce these exactly.
        assert_eq!(fmix32(0), 0);
        assert_eq!(fmix32(1), 0x514E_28B7);
        let got: Vec<u32> = [0u64, 1, 2, 1 << 32, u64::MAX]
            .iter()
            .map(|&i| hash32(42, i))
            .collect();
        assert_eq!(got, PINNED_HASHES);
    }

    // Computed by an independent Python implementation of the module's definition.
    const PINNED_HASHES: [u32; 5] = [
        0x837B_1BE9,
        0x9B17_D22B,
        0x98A8_D0F2,
        0x5F27_E438,
        0xC444_3598,
    ];

    #[test]
    fn chunked_accumulation_equals_whole() {
        let g: Vec<f32> = gaussian_vector(7, 1000).iter().map(|&x| x as f32).collect();
        for kind in [SketchKind::CountSketch, SketchKind::Rademacher] {
            let sk = Sketch::new(kind, 3, 64).unwrap();
            let whole = sk.project(&g);
            let mut acc = vec![0.0; 64];
            sk.accumulate(&g[600..], 600, &mut acc).unwrap();
            sk.accumulate(&g[..600], 0, &mut acc).unwrap();
            for (a, b) in whole.iter().zip(&acc) {
                assert!((f64::from(*a) - b).abs() < 1e-4, "{kind}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn countsketch_with_one_bucket_is_the_signed_sum() {
        // With one bucket every coordinate lands in it with its hash's sign.
        let sk = Sketch::new(SketchKind::CountSketch, 1, 1).unwrap();
        let g = [1.0f32, 2.0, 4.0];
        let expected: f64 = (0..3)
            .map(|i| sign_of(hash32(1, i as u64)) * f64::from(g[i]))
            .sum();
        assert_eq!(f64::from(sk.project(&g)[0]), expected);
        assert!(Sketch::new(SketchKind::CountSketch, 1, 0).is_err());
        assert!("dense".parse::<SketchKind>().is_err());
        // Deserialisation goes through the same check.
        let bad = r#"{"kind":"countsketch","seed":1,"dim":0}"#;
        assert!(serde_json::from_str::<Sketch>(bad).is_err());
        let good: Sketch =
            serde_json::from_str(r#"{"kind":"rademacher","seed":1,"dim":8}"#).unwrap();
        assert_eq!(
            (good.kind(), good.seed(), good.dim()),
            (SketchKind::Rademacher, 1, 8)
        );
    }

    #[test]
    fn gaussian_vector_has_unit_variance() {
        let g = gaussian_vector(11, 20_000);
        let mean = g.iter().sum::<f64>() / g.len() as f64;
        let var = g.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / g.len() as f64;
        assert!(mean.abs() < 0.03, "{mean}");
        assert!((var - 1.0).abs() < 0.05, "{var}");
    }
}
