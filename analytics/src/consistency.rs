//! A run's worker-level consistency, as arXiv 2602.14462 uses its three indicators: to assess
//! a configuration, not to page anyone.
//!
//! Loss dispersion, gradient-norm dispersion and the inter-worker cosine say how alike the
//! data-parallel workers' steps are. Alone they have no scale: a cross-rank loss CV of 0.05 is
//! healthy for small batches and suspicious for large ones. The report puts each dispersion
//! beside the one **independent shards** would give: if every rank draws its own batch from
//! the same distribution, the ranks of one step differ as much as one rank's successive steps
//! do. So each rank's own step-to-step noise (robust: 1.4826·MAD of its successive differences
//! over √2, relative to its median) is the expected per-rank spread, and the expected
//! cross-rank CV is that spread times the median of a K-rank sample's standard deviation
//! (χ with K−1 degrees of freedom, Wilson–Hilferty), so a run of independent shards reads
//! ≈ 1 at any K. Read:
//!
//! - **ratio ≪ 1** (below 0.25): the ranks see (nearly) the same batches — a data seed shared
//!   where it must differ; the run pays for K gradients and gets about one;
//! - **ratio ≈ 1** (0.5–2): as independent shards;
//! - **ratio ≫ 1** (above 2): the ranks differ by more than their batches do — different data
//!   (contiguous shards of distinct content), different code or numerics, or a faulty rank;
//!   `ranks` says which rank sits apart, and by how much.
//!
//! The inter-worker cosine C_w is reported as measured (1 when the ranks compute the same
//! gradient); what independent shards give depends on the gradient noise scale, which the
//! same steps cannot estimate apart from C_w itself (docs/detection.md), so no expected value is
//! claimed for it.

use std::collections::BTreeMap;

use crate::math::dispersion::{Dispersion, MAD_TO_SIGMA, median};

pub use rankwatch_api::{ConsistencyReport, ConsistencyVerdict, DispersionIndicator, RankStanding};

/// Steps a run needs with two or more ranks' values before it is assessed.
pub const MIN_STEPS: usize = 20;

/// One rank's (loss, gradient norm) at a step; either may be missing.
pub type LossAndNorm = (Option<f64>, Option<f64>);

/// Picks one quantity of a rank's step.
type Pick = fn(&LossAndNorm) -> Option<f64>;

/// One step: each rank's loss and gradient norm, and the step's C_w when known.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepValues {
    pub step: u64,
    /// rank → (loss, gradient norm); either may be missing.
    pub ranks: BTreeMap<u32, LossAndNorm>,
    pub cos_weighted: Option<f64>,
}

/// The median of a K-sample standard deviation (n − 1) in units of σ: √(median χ²ₖ₋₁ /(K−1));
/// exact medians up to 10 degrees of freedom, Wilson–Hilferty beyond (within 0.1 % there).
fn median_sample_std(k: usize) -> f64 {
    const MEDIAN_CHI2: [f64; 10] = [
        0.454_936, 1.386_294, 2.365_974, 3.356_694, 4.351_460, 5.348_121, 6.345_811, 7.344_121,
        8.342_833, 9.341_818,
    ];
    let dof = k.max(2) - 1;
    let median = MEDIAN_CHI2
        .get(dof - 1)
        .copied()
        .unwrap_or_else(|| dof as f64 * (1.0 - 2.0 / (9.0 * dof as f64)).powi(3));
    (median / dof as f64).sqrt()
}

/// Sample standard deviation over the mean, or `None`.
fn sample_cv(values: &[f64]) -> Option<f64> {
    if values.len() < 2 {
        return None;
    }
    let n = values.len() as f64;
    let mean = values.iter().sum::<f64>() / n;
    let var = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1.0);
    (mean.abs() > 0.0).then(|| var.sqrt() / mean.abs())
}

/// One quantity's indicator: observed vs independent shards; `None` without enough data.
fn indicator(steps: &[StepValues], get: Pick) -> Option<DispersionIndicator> {
    // Observed: the cross-rank CV of each step where every reporting rank has a value.
    let mut observed = Vec::new();
    let mut k_seen = Vec::new();
    for s in steps {
        let values: Vec<f64> = s.ranks.values().filter_map(|r| usable(get(r))).collect();
        if values.len() == s.ranks.len()
            && let Some(cv) = sample_cv(&values)
        {
            observed.push(cv);
            k_seen.push(values.len());
        }
    }
    if observed.len() < MIN_STEPS {
        return None;
    }
    // Expected: each rank's own step-to-step noise, relative to its level.
    let mut per_rank: BTreeMap<u32, Vec<(u64, f64)>> = BTreeMap::new();
    for s in steps {
        for (&rank, r) in &s.ranks {
            if let Some(v) = usable(get(r)) {
                per_rank.entry(rank).or_default().push((s.step, v));
            }
        }
    }
    let mut relative_noise = Vec::new();
    for series in per_rank.values() {
        let diffs: Vec<f64> = series
            .windows(2)
            .filter(|w| w[1].0 == w[0].0 + 1)
            .map(|w| w[1].1 - w[0].1)
            .collect();
        if diffs.len() < MIN_STEPS {
            continue;
        }
        let Some(steps_apart) = Dispersion::of(&diffs) else {
            continue;
        };
        let sigma = MAD_TO_SIGMA * steps_apart.mad / std::f64::consts::SQRT_2;
        let level = median(&mut series.iter().map(|&(_, v)| v).collect::<Vec<_>>());
        if level > 0.0 {
            relative_noise.push(sigma / level);
        }
    }
    if relative_noise.is_empty() {
        return None;
    }
    let k = median(&mut k_seen.iter().map(|&k| k as f64).collect::<Vec<_>>()).round() as usize;
    let expected = median(&mut relative_noise) * median_sample_std(k);
    let observed = median(&mut observed);
    Some(DispersionIndicator {
        observed_cv: observed,
        expected_cv: expected,
        ratio: rankwatch_api::Num(if expected > 0.0 {
            observed / expected
        } else {
            f64::INFINITY
        }),
    })
}

/// A value the report can use: finite and positive (a CV and a ratio need a level).
fn usable(v: Option<f64>) -> Option<f64> {
    v.filter(|v| v.is_finite() && *v > 0.0)
}

/// Each rank's median, over the steps where two or more ranks have the quantity, of its value
/// over the median of the other ranks'.
fn relative_to_others(steps: &[StepValues], get: Pick) -> BTreeMap<u32, f64> {
    let mut ratios: BTreeMap<u32, Vec<f64>> = BTreeMap::new();
    for s in steps {
        let values: Vec<(u32, f64)> = s
            .ranks
            .iter()
            .filter_map(|(&rank, r)| usable(get(r)).map(|v| (rank, v)))
            .collect();
        if values.len() < 2 {
            continue;
        }
        for &(rank, own) in &values {
            let mut others: Vec<f64> = values
                .iter()
                .filter(|(r, _)| *r != rank)
                .map(|&(_, v)| v)
                .collect();
            ratios
                .entry(rank)
                .or_default()
                .push(own / median(&mut others));
        }
    }
    ratios
        .into_iter()
        .map(|(rank, mut r)| (rank, median(&mut r)))
        .collect()
}

/// Each rank's typical loss and gradient norm relative to the median of the others'.
fn standings(steps: &[StepValues]) -> Vec<RankStanding> {
    let loss = relative_to_others(steps, |r| r.0);
    let grad = relative_to_others(steps, |r| r.1);
    let ranks: std::collections::BTreeSet<u32> = loss.keys().chain(grad.keys()).copied().collect();
    ranks
        .into_iter()
        .map(|rank| RankStanding {
            rank,
            loss_vs_others: loss.get(&rank).copied(),
            grad_norm_vs_others: grad.get(&rank).copied(),
        })
        .collect()
}

/// The report over `steps` (any order; a run's steps with per-rank values).
pub fn assess(run: &str, world_size: Option<u32>, mut steps: Vec<StepValues>) -> ConsistencyReport {
    steps.sort_by_key(|s| s.step);
    steps.retain(|s| s.ranks.len() >= 2);
    let loss = indicator(&steps, |r| r.0);
    let grad_norm = indicator(&steps, |r| r.1);
    let mut cos: Vec<f64> = steps
        .iter()
        .filter_map(|s| s.cos_weighted.filter(|c| c.is_finite()))
        .collect();
    let cos_weighted_median = (!cos.is_empty()).then(|| rankwatch_api::Num(median(&mut cos)));
    let ratios: Vec<f64> = [&loss, &grad_norm]
        .into_iter()
        .flatten()
        .map(|i| i.ratio.0)
        .collect();
    let (verdict, reading) = if ratios.is_empty() {
        (
            ConsistencyVerdict::TooFewSteps,
            format!(
                "too few steps with every rank's loss and gradient norm to assess (needs {MIN_STEPS})"
            ),
        )
    } else if ratios.iter().all(|&r| r < 0.25) {
        (
            ConsistencyVerdict::SameBatches,
            "the ranks differ far less than independent batches would: they see (nearly) the same data — a data seed or sampler shared where it must differ — and the run gets about one gradient for the K it pays for".to_owned(),
        )
    } else if ratios.iter().any(|&r| r > 2.0) {
        (
            ConsistencyVerdict::MoreDispersed,
            "the ranks differ more than independent batches would: different data per rank (contiguous shards of distinct content), different code or numerics, or a faulty rank — see each rank's standing".to_owned(),
        )
    } else if ratios.iter().all(|&r| (0.5..=2.0).contains(&r)) {
        (
            ConsistencyVerdict::IndependentShards,
            "the ranks differ as independent batches of the same data do: consistent".to_owned(),
        )
    } else {
        (
            ConsistencyVerdict::Between,
            "between the readings: the ranks share part of their data, or differ a little more than independent batches".to_owned(),
        )
    };
    ConsistencyReport {
        run: run.to_owned(),
        world_size,
        from_step: steps.first().map(|s| s.step),
        to_step: steps.last().map(|s| s.step),
        steps: steps.len() as u64,
        loss,
        grad_norm,
        cos_weighted_median,
        verdict,
        reading,
        ranks: standings(&steps),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simulate::{DataParallelSim, Fault};

    /// `steps` steps of the simulator; `same_batches` gives every rank rank 0's values.
    fn simulated(
        world: u32,
        steps: u64,
        seed: u32,
        fault: Fault,
        same_batches: bool,
    ) -> Vec<StepValues> {
        let mut sim = DataParallelSim::new(world, 1024, seed);
        (0..steps)
            .map(|step| {
                let obs = sim.step(step, fault);
                let first = obs.ranks[0];
                let ranks = obs
                    .ranks
                    .iter()
                    .map(|r| {
                        let v = if same_batches { first } else { *r };
                        (r.rank, (v.loss, v.grad_norm))
                    })
                    .collect();
                StepValues {
                    step,
                    ranks,
                    cos_weighted: None,
                }
            })
            .collect()
    }

    #[test]
    fn independent_shards_read_about_one_at_any_world_size() {
        for world in [2, 4, 8] {
            let report = assess(
                "r",
                Some(world),
                simulated(world, 600, world + 3, Fault::None, false),
            );
            let loss = report.loss.unwrap();
            assert!((0.6..=1.6).contains(&loss.ratio.0), "K={world}: {loss:?}");
            assert_eq!(
                report.verdict,
                ConsistencyVerdict::IndependentShards,
                "K={world}: {report:?}"
            );
        }
    }

    #[test]
    fn shared_batches_read_far_below_one_and_a_faulty_rank_far_above() {
        let same = assess("r", Some(4), simulated(4, 600, 5, Fault::None, true));
        assert_eq!(same.verdict, ConsistencyVerdict::SameBatches, "{same:?}");
        let off = assess(
            "r",
            Some(4),
            simulated(4, 600, 6, Fault::LossOffset(2, 0.8), false),
        );
        assert_eq!(off.verdict, ConsistencyVerdict::MoreDispersed, "{off:?}");
        let worst = off
            .ranks
            .iter()
            .max_by(|a, b| {
                a.loss_vs_others
                    .unwrap()
                    .total_cmp(&b.loss_vs_others.unwrap())
            })
            .unwrap();
        assert_eq!(worst.rank, 2);
        assert!(worst.loss_vs_others.unwrap() > 1.2, "{worst:?}");
    }

    #[test]
    fn too_few_steps_say_so() {
        let report = assess("r", Some(4), simulated(4, 10, 7, Fault::None, false));
        assert_eq!(report.verdict, ConsistencyVerdict::TooFewSteps);
        assert!(report.loss.is_none() && report.grad_norm.is_none());
    }

    #[test]
    fn the_median_sample_std_factor_matches_a_simulation() {
        // The exact medians √(0.4549/1) and √(2.366/3), and Wilson–Hilferty taking over
        // smoothly past the table (within 0.1 % of the exact √(10.3410/11) at K = 12).
        assert!((median_sample_std(2) - 0.4549f64.sqrt()).abs() < 1e-4);
        assert!((median_sample_std(4) - (2.366f64 / 3.0).sqrt()).abs() < 1e-4);
        assert!((median_sample_std(12) / (10.3410f64 / 11.0).sqrt() - 1.0).abs() < 1e-3);
        // Against a simulation: the median of 20,000 sample stds of 4 standard normals.
        let mut rng = 0x2545_f491_4f6c_dd1du64;
        let mut normal = || {
            // Box–Muller over a xorshift stream.
            let mut uniform = || {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                (rng >> 11) as f64 / (1u64 << 53) as f64
            };
            let (u, v) = (uniform().max(1e-300), uniform());
            (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
        };
        let mut stds: Vec<f64> = (0..20_000)
            .map(|_| {
                let x: Vec<f64> = (0..4).map(|_| normal()).collect();
                let mean = x.iter().sum::<f64>() / 4.0;
                (x.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / 3.0).sqrt()
            })
            .collect();
        assert!((median(&mut stds) / median_sample_std(4) - 1.0).abs() < 0.02);
    }
}
