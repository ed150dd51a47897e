//! The all-ranks statistics of one step (the all-ranks metrics of `docs/architecture.md`), from what each rank
//! reported. The collector's step aligner calls [`StepStats::compute`] once a step is complete
//! (or timed out) and stores [`StepStats::samples`] with `rank = null`.

use serde::{Deserialize, Serialize};

use crate::math::cosine::cos_weighted;
use crate::math::dispersion::Dispersion;
use crate::math::noise::NoiseEstimate;
use crate::math::perplexity::perplexity;
use crate::record::Sample;
use crate::validate::{MetricName, RunId};
use crate::vocab::Metric;

/// What one rank reported for a step; any field may be missing.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct RankValues {
    pub rank: u32,
    pub loss: Option<f64>,
    pub tokens: Option<f64>,
    pub grad_norm: Option<f64>,
    pub grad_norm_mean: Option<f64>,
    pub cos_to_mean: Option<f64>,
}

/// Cross-rank statistics of one step.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct StepStats {
    /// Ranks that reported anything.
    pub ranks: usize,
    pub loss: Option<Dispersion>,
    pub grad_norm: Option<Dispersion>,
    /// ‖ḡ‖ as the ranks reported it (the median, should one rank disagree).
    pub grad_norm_mean: Option<f64>,
    /// Only when every rank of the world reported its norm: C_w needs all K terms.
    pub cos_weighted: Option<f64>,
    pub noise: Option<NoiseEstimate>,
    /// B_simple in tokens, from this step alone: only when every rank reported its tokens and
    /// the |G|² estimate is positive. Single-step estimates are noisy; smooth them over steps
    /// with [`crate::math::NoiseScaleTracker`] before reading trends.
    pub noise_scale: Option<f64>,
    pub perplexity: Option<f64>,
    /// Token-weighted mean loss (plain mean when some rank sent no token count): the averaged
    /// curve, which hides what the dispersions show.
    pub loss_mean: Option<f64>,
}

impl StepStats {
    /// Statistics over `ranks` for a run of `world_size` ranks.
    pub fn compute(ranks: &[RankValues], world_size: u32) -> Self {
        // Sized for every rank up front: collecting a filter grows the vector five times over
        // at 64 ranks, and this runs at every step.
        let collect = |f: fn(&RankValues) -> Option<f64>| -> Vec<f64> {
            let mut values = Vec::with_capacity(ranks.len());
            values.extend(ranks.iter().filter_map(f));
            values
        };
        let losses = collect(|r| r.loss);
        let norms = collect(|r| r.grad_norm);
        let grad_norm_mean = Dispersion::of(&collect(|r| r.grad_norm_mean)).map(|d| d.median);
        // Distinct ranks: a rank reported twice must not stand in for a missing one.
        let mut reporting = Vec::with_capacity(ranks.len());
        reporting.extend(
            ranks
                .iter()
                .filter(|r| r.grad_norm.is_some())
                .map(|r| r.rank),
        );
        reporting.sort_unstable();
        reporting.dedup();
        let complete = world_size >= 2
            && norms.len() == world_size as usize
            && reporting.len() == world_size as usize;
        let cos_weighted = grad_norm_mean
            .filter(|_| complete)
            .and_then(|m| cos_weighted(&norms, m));
        let noise = grad_norm_mean
            .filter(|_| complete)
            .and_then(|m| NoiseEstimate::from_norms(&norms, m));
        let tokens = collect(|r| r.tokens);
        let noise_scale = noise
            .filter(|n| n.signal_sq > 0.0 && n.noise_sq >= 0.0)
            .filter(|_| tokens.len() == ranks.len() && !tokens.is_empty())
            .map(|n| n.noise_scale(tokens.iter().sum::<f64>() / tokens.len() as f64));
        let mut pairs = Vec::with_capacity(ranks.len());
        pairs.extend(ranks.iter().filter_map(|r| Some((r.loss?, r.tokens?))));
        let loss_mean = if pairs.len() == losses.len() && !pairs.is_empty() {
            let tokens: f64 = pairs.iter().map(|(_, t)| t).sum();
            (tokens > 0.0).then(|| pairs.iter().map(|(l, t)| l * t).sum::<f64>() / tokens)
        } else {
            None
        }
        .or_else(|| (!losses.is_empty()).then(|| losses.iter().sum::<f64>() / losses.len() as f64));
        StepStats {
            ranks: ranks.len(),
            loss_mean,
            loss: Dispersion::of(&losses),
            grad_norm: Dispersion::of(&norms),
            grad_norm_mean,
            cos_weighted,
            noise,
            noise_scale,
            perplexity: perplexity(&pairs),
        }
    }

    /// The statistics as all-ranks samples (only those that are defined).
    pub fn samples(&self, run: &RunId, step: u64, time_ms: i64) -> Vec<Sample> {
        let loss = self.loss.filter(|d| d.count >= 2);
        let grad = self.grad_norm.filter(|d| d.count >= 2);
        [
            (Metric::LossStd, loss.map(|d| d.std)),
            (Metric::LossRange, loss.map(|d| d.range)),
            (Metric::LossCv, loss.and_then(|d| d.cv)),
            (Metric::GradNormStd, grad.map(|d| d.std)),
            (Metric::GradNormCv, grad.and_then(|d| d.cv)),
            (Metric::CosWeighted, self.cos_weighted),
            (Metric::NoiseScale, self.noise_scale),
            (Metric::Perplexity, self.perplexity),
            (Metric::LossMean, self.loss_mean),
        ]
        .into_iter()
        .filter_map(|(metric, value)| {
            Some(Sample {
                run: run.clone(),
                rank: None,
                step,
                time_ms,
                metric: MetricName::from(metric),
                layer: None,
                site: None,
                value: value?,
            })
        })
        .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn complete_step() {
        let ranks: Vec<RankValues> = (0..4)
            .map(|rank| RankValues {
                rank,
                loss: Some(2.0 + f64::from(rank)),
                tokens: Some(100.0),
                grad_norm: Some(4.0),
                grad_norm_mean: Some(7f64.sqrt()),
                cos_to_mean: None,
            })
            .collect();
        let s = StepStats::compute(&ranks, 4);
        assert_eq!(s.loss.unwrap().range, 3.0);
        assert!((s.perplexity.unwrap() - 3.5f64.exp()).abs() < 1e-9);
        // Equal norms 4 and ‖ḡ‖² = 7: C_w = (16·7 − 64)/(256 − 64) = 0.25.
        assert!((s.cos_weighted.unwrap() - 0.25).abs() < 1e-12);
        assert!((s.noise_scale.unwrap() - 300.0).abs() < 1e-9);
        let samples = s.samples(&RunId::new("r").unwrap(), 9, 0);
        assert_eq!(samples.len(), 9);
        assert!((s.loss_mean.unwrap() - 3.5).abs() < 1e-12);
        assert!(
            samples
                .iter()
                .all(|x| x.validate(None).is_ok() && x.rank.is_none())
        );
        // A missing rank: no C_w (it needs all K norms), dispersion still computed.
        let s = StepStats::compute(&ranks[..3], 4);
        assert_eq!(s.cos_weighted, None);
        assert_eq!(s.loss.unwrap().count, 3);
        // A rank reported twice does not stand in for a missing one.
        let doubled = [&ranks[..3], &ranks[..1]].concat();
        assert_eq!(StepStats::compute(&doubled, 4).cos_weighted, None);
        // Without every rank's tokens there is no noise scale (no silent change of unit), and a
        // non-positive |G|² estimate gives none either.
        let mut no_tokens = ranks.clone();
        no_tokens[2].tokens = None;
        assert_eq!(StepStats::compute(&no_tokens, 4).noise_scale, None);
        let mut opposed = ranks.clone();
        opposed
            .iter_mut()
            .for_each(|r| r.grad_norm_mean = Some(0.1));
        assert_eq!(StepStats::compute(&opposed, 4).noise_scale, None);
    }
}
