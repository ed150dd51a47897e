//! FP64 parity of the warm-started power iteration and the operator products against a dense
//! SVD reference (nalgebra, f64).
//!
//! Stated tolerances: relative error of σ₁ ≤ 1e-8 in f64 (residual tolerance 1e-8; a residual r
//! bounds the relative error by about r) and ≤ 2e-5 for f32 storage. Near-degenerate tops
//! (σ₂ = σ₁(1 − δ)) converge slowly in the vector but not in the value; the iterations taken are
//! printed (run with `--nocapture`) and bounded.

use nalgebra::{DMatrix, DVector};
use proptest::prelude::*;
use rankwatch_analytics::math::reference::{singular_values, spectral_norm};
use rankwatch_analytics::math::sketch::gaussian_vector;
use rankwatch_analytics::math::{
    GroupedOv, LinearOperator, PowerConfig, PowerIteration, Product, Transposed, stable_rank,
};

fn gaussian(seed: u32, rows: usize, cols: usize) -> DMatrix<f64> {
    DMatrix::from_vec(rows, cols, gaussian_vector(seed, rows * cols))
}

fn orthonormal(seed: u32, n: usize, k: usize) -> DMatrix<f64> {
    gaussian(seed, n, k).qr().q()
}

/// U·diag(s)·Vᵀ with random orthonormal U (m×r) and V (n×r).
fn with_singular_values(seed: u32, m: usize, n: usize, s: &[f64]) -> DMatrix<f64> {
    let r = s.len();
    let u = orthonormal(seed, m, r);
    let v = orthonormal(seed + 1, n, r);
    u * DMatrix::from_diagonal(&DVector::from_column_slice(s)) * v.transpose()
}

fn power(tol: f64, max_iters: usize) -> PowerIteration<f64> {
    PowerIteration::new(PowerConfig {
        max_iters,
        tolerance: tol,
        seed: 7,
    })
    .unwrap()
}

fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(f64::MIN_POSITIVE)
}

#[test]
fn random_low_rank_and_ill_conditioned_matrices() {
    let cases: Vec<(&str, DMatrix<f64>)> = vec![
        ("random 120x80", gaussian(1, 120, 80)),
        ("random 64x200", gaussian(2, 64, 200)),
        ("rank 3", with_singular_values(3, 100, 90, &[5.0, 3.0, 1.0])),
        ("rank 1", with_singular_values(5, 50, 70, &[2.5])),
        (
            "condition 1e10",
            with_singular_values(
                7,
                90,
                60,
                &(0..60)
                    .map(|i| 10f64.powf(-10.0 * i as f64 / 59.0))
                    .collect::<Vec<_>>(),
            ),
        ),
    ];
    for (name, a) in cases {
        let reference = spectral_norm(&a);
        let mut p = power(1e-8, 5_000);
        let e = p.estimate(&a);
        assert!(e.converged, "{name}: {e:?}");
        assert!(
            rel(e.sigma, reference) <= 1e-8,
            "{name}: {} vs {reference}",
            e.sigma
        );
        println!(
            "{name:>16}: σ₁ = {reference:.6}, {} iterations, residual {:.1e}",
            e.iterations, e.residual
        );
        // Stable rank against Σσ²/σ₁² from the full spectrum.
        let s = singular_values(&a);
        let expected = s.iter().map(|x| x * x).sum::<f64>() / (s[0] * s[0]);
        assert!(
            rel(stable_rank(a.norm_squared(), e.sigma), expected) <= 1e-7,
            "{name}"
        );
    }
}

#[test]
fn near_degenerate_top_pair() {
    println!("   gap δ  | iterations | rel. error of σ₁");
    for (i, gap) in [1e-1, 1e-2, 1e-3, 1e-4, 0.0].into_iter().enumerate() {
        let mut s = vec![10.0, 10.0 * (1.0 - gap)];
        s.extend((0..20).map(|j| 5.0 - 0.2 * j as f64));
        let a = with_singular_values(100 + i as u32, 80, 60, &s);
        let mut p = power(1e-6, 20_000);
        let e = p.estimate(&a);
        assert!(e.converged, "gap {gap}: {e:?}");
        let err = rel(e.sigma, 10.0);
        println!("  {gap:7.0e} | {:10} | {err:.1e}", e.iterations);
        assert!(err <= 1e-8, "gap {gap}: σ {} (error {err:e})", e.sigma);
        // The vector needs ~ln(r)/ln(1−δ)² steps; the value far fewer. Bound the cost.
        assert!(
            e.iterations <= 10_000,
            "gap {gap}: {} iterations",
            e.iterations
        );
    }
}

#[test]
fn warm_start_needs_fewer_iterations_after_a_small_update() {
    let a = gaussian(11, 150, 100);
    let mut p = power(1e-8, 5_000);
    let cold = p.estimate(&a);
    let update = gaussian(12, 150, 100) * 1e-3;
    let b = &a + update;
    let warm = p.estimate(&b);
    let mut fresh = power(1e-8, 5_000);
    let cold_b = fresh.estimate(&b);
    println!(
        "cold {} iterations, warm after a 1e-3 update {} iterations (cold on the updated matrix {})",
        cold.iterations, warm.iterations, cold_b.iterations
    );
    assert!(warm.converged && rel(warm.sigma, spectral_norm(&b)) <= 1e-8);
    assert!(
        warm.iterations * 2 < cold_b.iterations,
        "{warm:?} vs {cold_b:?}"
    );
    // A shape change resets the vector instead of failing.
    let c = gaussian(13, 150, 90);
    let e = p.estimate(&c);
    assert!(e.converged && rel(e.sigma, spectral_norm(&c)) <= 1e-8);
}

#[test]
fn f32_storage_agrees_with_f64_reference() {
    let a64 = gaussian(21, 256, 192);
    let a32: DMatrix<f32> = a64.map(|x| x as f32);
    let mut p = PowerIteration::<f32>::new(PowerConfig {
        tolerance: 1e-4,
        max_iters: 1000,
        seed: 1,
    })
    .unwrap();
    let e = p.estimate(&a32);
    let reference = spectral_norm(&a32.map(f64::from));
    assert!(
        rel(e.sigma, reference) <= 2e-5,
        "{} vs {reference}",
        e.sigma
    );
}

#[test]
fn non_finite_and_zero_matrices() {
    let mut a = gaussian(31, 20, 10);
    a[(3, 4)] = f64::NAN;
    let mut p = power(1e-8, 100);
    let e = p.estimate(&a);
    assert!(e.sigma.is_nan() && !e.converged);
    assert!(
        p.vector().is_none(),
        "a NaN must not poison the warm vector"
    );
    let z = DMatrix::<f64>::zeros(5, 4);
    let e = p.estimate(&z);
    assert_eq!((e.sigma, e.converged), (0.0, true));
    assert!(stable_rank(1.0, 0.0).is_nan());
}

#[test]
fn zero_products_are_recognised_at_once() {
    // A zero-initialised W_down (or W_o) makes the product zero although neither factor's
    // Frobenius norm is known to the operator.
    let w_up = gaussian(61, 32, 16);
    let w_down = DMatrix::<f64>::zeros(16, 32);
    let op = Product::new(&w_down, &w_up).unwrap();
    let mut p = power(1e-8, 1000);
    let e = p.estimate(&op);
    assert_eq!(
        (e.sigma, e.converged, e.iterations),
        (0.0, true, 1),
        "{e:?}"
    );
    // A warm vector that suddenly maps to zero is retried from a random start first.
    let mut p = power(1e-8, 1000);
    p.estimate(&w_up);
    let e = p.estimate(&Transposed(&DMatrix::<f64>::zeros(16, 32)));
    assert_eq!(
        (e.sigma, e.converged, e.iterations),
        (0.0, true, 2),
        "{e:?}"
    );
}

#[test]
fn mlp_product_as_operator_equals_explicit_product() {
    // Llama-shaped: W_up is d_ff×d, W_down is d×d_ff.
    let (d, d_ff) = (48, 128);
    let w_up = gaussian(41, d_ff, d);
    let w_down = gaussian(42, d, d_ff);
    let explicit = &w_down * &w_up;
    let op = Product::new(&w_down, &w_up).unwrap();
    let x = DVector::from_vec(gaussian_vector(43, d));
    assert!((op.apply(&x) - &explicit * &x).norm() <= 1e-10 * (&explicit * &x).norm());
    let y = DVector::from_vec(gaussian_vector(44, d));
    assert!(
        (op.apply_transpose(&y) - explicit.transpose() * &y).norm()
            <= 1e-10 * y.norm() * explicit.norm()
    );
    let e = power(1e-9, 5_000).estimate(&op);
    assert!(rel(e.sigma, spectral_norm(&explicit)) <= 1e-8);
    // Mismatched shapes are refused with the shapes named.
    let err = Product::new(&w_up, &w_up).unwrap_err().to_string();
    assert!(err.contains("128×48 and 128×48"), "{err}");
}

#[test]
fn transposed_storage_gives_the_same_norm() {
    // GPT-2's Conv1D stores Wᵀ (in × out).
    let w = gaussian(51, 70, 30);
    let stored = w.transpose();
    let e = power(1e-9, 5_000).estimate(&Transposed(&stored));
    assert!(rel(e.sigma, spectral_norm(&w)) <= 1e-8);
    assert_eq!(LinearOperator::<f64>::nrows(&Transposed(&stored)), 70);
}

/// W_o · repeat_kv(W_v), written out independently of the operator.
fn explicit_ov(
    w_o: &DMatrix<f64>,
    w_v: &DMatrix<f64>,
    n_heads: usize,
    n_kv: usize,
    hd: usize,
) -> DMatrix<f64> {
    let d = w_v.ncols();
    let mut rows = Vec::new();
    for h in 0..n_heads {
        let kv = h * n_kv / n_heads;
        for r in 0..hd {
            rows.push(w_v.row(kv * hd + r).clone_owned());
        }
    }
    let repeated = DMatrix::from_rows(&rows);
    assert_eq!(repeated.shape(), (n_heads * hd, d));
    w_o * repeated
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn grouped_query_ov_matches_explicit(
        n_kv in prop::sample::select(vec![1usize, 2, 4]),
        group in prop::sample::select(vec![1usize, 2, 3, 4]),
        hd in 2usize..9,
        d_model in 8usize..40,
        seed in 0u32..1_000_000,
    ) {
        let n_heads = n_kv * group;
        let w_o = gaussian(seed, d_model, n_heads * hd);
        let w_v = gaussian(seed.wrapping_add(1), n_kv * hd, d_model);
        let op = GroupedOv::new(&w_o, &w_v, n_heads, n_kv, hd).unwrap();
        let explicit = explicit_ov(&w_o, &w_v, n_heads, n_kv, hd);
        prop_assert!((op.to_dense() - &explicit).norm() <= 1e-12 * explicit.norm());
        let x = DVector::from_vec(gaussian_vector(seed.wrapping_add(2), d_model));
        prop_assert!((op.apply(&x) - &explicit * &x).norm() <= 1e-10 * explicit.norm() * x.norm());
        let y = DVector::from_vec(gaussian_vector(seed.wrapping_add(3), d_model));
        prop_assert!((op.apply_transpose(&y) - explicit.transpose() * &y).norm() <= 1e-10 * explicit.norm() * y.norm());
        let reference = spectral_norm(&explicit);
        let e = power(1e-9, 20_000).estimate(&op);
        prop_assert!(e.converged);
        prop_assert!(rel(e.sigma, reference) <= 1e-7, "{} vs {}", e.sigma, reference);
    }
}

#[test]
fn grouped_query_shapes_are_checked() {
    let w_o = gaussian(1, 16, 32);
    let w_v = gaussian(2, 8, 16);
    assert!(GroupedOv::new(&w_o, &w_v, 8, 2, 4).is_ok());
    assert!(GroupedOv::new(&w_o, &w_v, 8, 3, 4).is_err());
    let err = GroupedOv::new(&w_o, &w_v, 4, 2, 4).unwrap_err().to_string();
    assert!(err.contains("W_o has 32 columns"), "{err}");
}
