//! Warm-started power iteration against a dense SVD, on f32 weight matrices of the sizes of a
//! 7–8B model's attention (4096×4096) and MLP (4096×14336) projections.
//!
//! Matrices are "spiked": a random bulk (entries N(0, 1/n), singular values in
//! [1 − √(m/n), 1 + √(m/n)]) plus four strong directions (σ = 4, 3.5, 3, 2.5), the shape of
//! trained weights' spectra. The anchor is faer's dense singular values (no U or V, the cheapest
//! full-spectrum path), run sequentially so both sides use one core. The power-iteration cases:
//! - `warm_1_step`: one step from the kept vector — what a probe costs per call on unchanged or
//!   slowly changing weights (σReparam's regime);
//! - `warm_restart`: from the vector kept before an update of relative size 1e-3, to a residual
//!   of 1e-3;
//! - `cold`: from a random vector to a residual of 1e-3.
//!
//! Run with `cargo xtask bench` (or `cargo bench -p rankwatch-analytics --features bench-svd`).

use std::hint::black_box;
use std::time::Duration;

use criterion::{BatchSize, BenchmarkId, Criterion, criterion_group, criterion_main};
use nalgebra::DMatrix;
use rankwatch_analytics::math::sketch::gaussian_vector;
use rankwatch_analytics::math::{PowerConfig, PowerIteration};

const SHAPES: [(usize, usize); 2] = [(4096, 4096), (4096, 14336)];

fn spiked(rows: usize, cols: usize, seed: u32) -> DMatrix<f32> {
    let scale = 1.0 / (cols as f64).sqrt();
    let bulk = gaussian_vector(seed, rows * cols);
    let mut w = DMatrix::from_iterator(rows, cols, bulk.into_iter().map(|x| (x * scale) as f32));
    for (k, s) in [4.0f64, 3.5, 3.0, 2.5].into_iter().enumerate() {
        let u =
            nalgebra::DVector::from_vec(gaussian_vector(seed + 10 + k as u32, rows)).normalize();
        let v =
            nalgebra::DVector::from_vec(gaussian_vector(seed + 20 + k as u32, cols)).normalize();
        for j in 0..cols {
            let vj = s * v[j];
            for i in 0..rows {
                w[(i, j)] += (u[i] * vj) as f32;
            }
        }
    }
    w
}

fn perturbed(w: &DMatrix<f32>, seed: u32) -> DMatrix<f32> {
    // Relative Frobenius size 1e-3, like one optimiser step on trained weights.
    let noise = gaussian_vector(seed, w.len());
    let scale = 1e-3 * f64::from(w.norm()) / (w.len() as f64).sqrt();
    DMatrix::from_iterator(
        w.nrows(),
        w.ncols(),
        w.iter().zip(noise).map(|(x, n)| x + (n * scale) as f32),
    )
}

fn power(max_iters: usize, tolerance: f64) -> PowerIteration<f32> {
    PowerIteration::new(PowerConfig {
        max_iters,
        tolerance,
        seed: 3,
    })
    .expect("valid config")
}

fn bench(c: &mut Criterion) {
    faer::set_global_parallelism(faer::Par::Seq);
    for (rows, cols) in SHAPES {
        let label = format!("{rows}x{cols}");
        let w = spiked(rows, cols, 1);
        let w2 = perturbed(&w, 2);

        // Converge once so the warm cases start from a kept vector.
        let mut warm = power(1000, 1e-6);
        let converged = warm.estimate(&w);
        warm.set_config(PowerConfig {
            max_iters: 1000,
            tolerance: 1e-3,
            seed: 3,
        })
        .expect("valid config");
        let restart = warm.clone().estimate(&w2);
        let cold = power(1000, 1e-3).estimate(&w);
        let faer_w = faer::Mat::<f32>::from_fn(rows, cols, |i, j| w[(i, j)]);
        let reference = faer_w.singular_values().expect("svd converges")[0];
        println!(
            "{label}: σ₁ power {:.6} vs SVD {:.6}; iterations: cold {} (to 1e-3), warm restart after a 1e-3 update {}, first convergence to 1e-6 {}",
            converged.sigma, reference, cold.iterations, restart.iterations, converged.iterations
        );

        let mut group = c.benchmark_group("spectral");
        group
            .sample_size(10)
            .warm_up_time(Duration::from_millis(500));
        let mut one_step = {
            let mut p = power(1, 1e-12);
            p.estimate(&w);
            p
        };
        group.bench_function(BenchmarkId::new("warm_1_step", &label), |b| {
            b.iter(|| black_box(one_step.estimate(black_box(&w))))
        });
        group.bench_function(BenchmarkId::new("warm_restart", &label), |b| {
            b.iter_batched(
                || warm.clone(),
                |mut p| black_box(p.estimate(&w2)),
                BatchSize::LargeInput,
            )
        });
        group.bench_function(BenchmarkId::new("cold", &label), |b| {
            b.iter(|| black_box(power(1000, 1e-3).estimate(black_box(&w))))
        });
        group
            .warm_up_time(Duration::from_millis(1))
            .measurement_time(Duration::from_secs(1));
        group.bench_function(BenchmarkId::new("svd_singular_values", &label), |b| {
            b.iter(|| black_box(faer_w.singular_values().expect("svd converges")))
        });
        group.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
