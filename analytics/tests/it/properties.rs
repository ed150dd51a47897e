//! Property tests of the cross-rank math (proptest).

use nalgebra::DVector;
use proptest::prelude::*;
use rankwatch_analytics::math::sketch::{Sketch, SketchKind, gaussian_vector};
use rankwatch_analytics::math::{cos_pair_mean, cos_weighted, perplexity, sketch_cosine_matrix};

fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

fn vectors(k: usize, dim: usize, seed: u32) -> Vec<DVector<f64>> {
    (0..k)
        .map(|i| DVector::from_vec(gaussian_vector(seed.wrapping_add(i as u32 * 7919), dim)))
        .collect()
}

fn mean_of(gs: &[DVector<f64>]) -> DVector<f64> {
    gs.iter()
        .fold(DVector::zeros(gs[0].len()), |acc, g| acc + g)
        / gs.len() as f64
}

proptest! {
    #![proptest_config(config(128))]

    /// With equal norms, C_w is exactly the mean pairwise cosine.
    #[test]
    fn cos_weighted_is_mean_pairwise_cosine_at_equal_norms(
        k in 2usize..9, dim in 2usize..64, seed in any::<u32>(),
        shared in 0.0f64..3.0, norm in 0.01f64..100.0,
    ) {
        // A shared component makes the cosines non-trivial (positive on average).
        let common = DVector::from_vec(gaussian_vector(seed ^ 0xABCD, dim)) * shared;
        let gs: Vec<DVector<f64>> = vectors(k, dim, seed)
            .into_iter()
            .map(|g| { let g = g + &common; g.normalize() * norm })
            .collect();
        let norms: Vec<f64> = gs.iter().map(|g| g.norm()).collect();
        let mut pairwise = 0.0;
        for i in 0..k { for j in i + 1..k { pairwise += gs[i].dot(&gs[j]) / (norms[i] * norms[j]); } }
        let pairwise = pairwise / (k * (k - 1) / 2) as f64;
        let cw = cos_weighted(&norms, mean_of(&gs).norm()).unwrap();
        prop_assert!((cw - pairwise).abs() <= 1e-9, "C_w {} vs mean pairwise {}", cw, pairwise);
    }

    /// In general C_w is the norm-weighted mean Σ_{i≠j}⟨g_i,g_j⟩ / Σ_{i≠j} n_i n_j.
    #[test]
    fn cos_weighted_is_norm_weighted_in_general(k in 2usize..9, dim in 2usize..64, seed in any::<u32>()) {
        let gs: Vec<DVector<f64>> = vectors(k, dim, seed)
            .into_iter()
            .enumerate()
            .map(|(i, g)| g * (0.1 + i as f64))
            .collect();
        let norms: Vec<f64> = gs.iter().map(|g| g.norm()).collect();
        let (mut num, mut den) = (0.0, 0.0);
        for i in 0..k { for j in 0..k { if i != j { num += gs[i].dot(&gs[j]); den += norms[i] * norms[j]; } } }
        let cw = cos_weighted(&norms, mean_of(&gs).norm()).unwrap();
        prop_assert!((cw - num / den).abs() <= 1e-9 * (1.0 + (num / den).abs()));
    }

    /// exp of the token-weighted mean equals exp of the mean over every token.
    #[test]
    fn perplexity_is_exp_of_the_token_weighted_mean(
        ranks in prop::collection::vec(prop::collection::vec(0.0f64..12.0, 1..40), 1..9),
    ) {
        let pairs: Vec<(f64, f64)> = ranks
            .iter()
            .map(|tokens| (tokens.iter().sum::<f64>() / tokens.len() as f64, tokens.len() as f64))
            .collect();
        let all: Vec<f64> = ranks.iter().flatten().copied().collect();
        let expected = (all.iter().sum::<f64>() / all.len() as f64).exp();
        let got = perplexity(&pairs).unwrap();
        prop_assert!((got - expected).abs() <= 1e-9 * expected, "{} vs {}", got, expected);
    }
}

/// A pair of unit vectors with cosine `c` (exactly, up to rounding).
fn pair_with_cosine(seed: u32, dim: usize, c: f64) -> (Vec<f32>, Vec<f32>, f64) {
    let a = DVector::from_vec(gaussian_vector(seed, dim)).normalize();
    let r = DVector::from_vec(gaussian_vector(seed ^ 0x5555_5555, dim));
    let orth = (&r - &a * a.dot(&r)).normalize();
    let b = &a * c + orth * (1.0 - c * c).sqrt();
    let to32 = |v: &DVector<f64>| v.iter().map(|x| *x as f32).collect::<Vec<f32>>();
    let (a32, b32) = (to32(&a), to32(&b));
    let n = |v: &[f32]| v.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    let dot: f64 = a32
        .iter()
        .zip(&b32)
        .map(|(x, y)| f64::from(*x) * f64::from(*y))
        .sum();
    let exact = dot / (n(&a32) * n(&b32));
    (a32, b32, exact)
}

/// Theoretical standard deviation of the sketch cosine for unit vectors a, b:
/// Var = (1 + cos² − 2Σa_i²b_i²)/k (see `math::sketch`).
fn theoretical_sd(a: &[f32], b: &[f32], c: f64, k: usize) -> f64 {
    let fourth: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| (f64::from(*x) * f64::from(*y)).powi(2))
        .sum();
    ((1.0 + c * c - 2.0 * fourth) / k as f64).sqrt()
}

fn check_sketch(
    kind: SketchKind,
    k: usize,
    dim: usize,
    cosine: f64,
    seed: u32,
    trials: u32,
) -> Result<(), TestCaseError> {
    let (a, b, exact) = pair_with_cosine(seed, dim, cosine);
    let norms = [1.0f64, 1.0];
    let sd = theoretical_sd(&a, &b, exact, k);
    let estimates: Vec<f64> = (0..trials)
        .map(|t| {
            let sketch = Sketch::new(kind, seed.wrapping_mul(31).wrapping_add(t), k).unwrap();
            let (sa, sb) = (sketch.project(&a), sketch.project(&b));
            sketch_cosine_matrix(&[&sa, &sb], &norms).unwrap()[(0, 1)]
        })
        .collect();
    let n = f64::from(trials);
    let mean = estimates.iter().sum::<f64>() / n;
    let var = estimates.iter().map(|e| (e - mean).powi(2)).sum::<f64>() / (n - 1.0);
    // Unbiased: the mean over seeds is within 5 standard errors of the exact cosine.
    prop_assert!(
        (mean - exact).abs() <= 5.0 * sd / n.sqrt(),
        "{kind} k={k}: mean {mean} vs {exact} (sd {sd})"
    );
    // Within the theoretical error: no single estimate beyond 6 sd, and the spread matches.
    for e in &estimates {
        prop_assert!(
            (e - exact).abs() <= 6.0 * sd,
            "{kind} k={k}: estimate {e} vs {exact} (sd {sd})"
        );
    }
    let ratio = var / (sd * sd);
    let slack = 5.0 * (2.0 / (n - 1.0)).sqrt();
    prop_assert!(
        (1.0 - slack..=1.0 + slack).contains(&ratio),
        "{kind} k={k}: variance ratio {ratio}"
    );
    Ok(())
}

proptest! {
    #![proptest_config(config(6))]

    #[test]
    fn countsketch_cosines_are_unbiased_within_theory(
        k in prop::sample::select(vec![1024usize, 4096]),
        cosine in -0.9f64..0.95,
        seed in any::<u32>(),
    ) {
        check_sketch(SketchKind::CountSketch, k, 8192, cosine, seed, 200)?;
    }

    #[test]
    fn rademacher_cosines_are_unbiased_within_theory(
        k in prop::sample::select(vec![1024usize, 4096]),
        cosine in -0.9f64..0.95,
        seed in any::<u32>(),
    ) {
        check_sketch(SketchKind::Rademacher, k, 96, cosine, seed, 120)?;
    }
}

#[test]
fn pair_mean_of_a_sketch_matrix() {
    let (a, b, _) = pair_with_cosine(3, 2000, 0.5);
    let sketch = Sketch::new(SketchKind::CountSketch, 9, 4096).unwrap();
    let (sa, sb) = (sketch.project(&a), sketch.project(&b));
    let m = sketch_cosine_matrix(&[&sa, &sb, &sa], &[1.0, 1.0, 1.0]).unwrap();
    assert_eq!(m[(0, 0)], 1.0);
    assert!((m[(0, 1)] - m[(1, 0)]).abs() < 1e-12, "symmetric");
    let expected = (m[(0, 1)] + m[(0, 2)] + m[(1, 2)]) / 3.0;
    assert!((cos_pair_mean(&m).unwrap() - expected).abs() < 1e-12);
    assert!((m[(0, 1)] - 0.5).abs() < 6.0 * theoretical_sd(&a, &b, 0.5, 4096));
}
