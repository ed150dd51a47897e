//! The metric vocabulary: one set of names for the SDK, the collector, the
//! UI, the alerts and the docs.
//!
//! A [`Metric`] knows its string form, its [`Scope`] (reported per rank, per layer, or computed
//! across all ranks) and which [`Site`]s it accepts. User-defined scalars are not in this enum;
//! they travel as any valid [`crate::MetricName`] and are stored and plotted the same way.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::Error;

/// Where a metric is produced and what identifies one series of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Scope {
    /// One value per rank per step; `layer` and `site` are null.
    Rank,
    /// One value per layer (and site, where the metric has sites); `rank` may be null when the
    /// value is the same on every rank (weights under data parallelism).
    Layer,
    /// Derived across all ranks by the collector; `rank` is null.
    AllRanks,
}

/// Where in the model a value belongs: the contract's vocabulary, validated here.
pub use rankwatch_api::Site;

macro_rules! metrics {
    ($( $(#[$doc:meta])* $variant:ident = $name:literal, $scope:ident, $sites:expr; )*) => {
        /// A metric of the design vocabulary.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum Metric {
            $( $(#[$doc])* $variant, )*
        }

        impl Metric {
            /// Every metric of the vocabulary.
            pub const ALL: &'static [Metric] = &[ $( Metric::$variant, )* ];

            /// The metric's wire and storage name.
            pub const fn as_str(self) -> &'static str {
                match self { $( Metric::$variant => $name, )* }
            }

            /// Where the metric is produced.
            pub const fn scope(self) -> Scope {
                match self { $( Metric::$variant => Scope::$scope, )* }
            }

            /// The sites this metric must name; empty when it takes none.
            pub const fn sites(self) -> &'static [Site] {
                match self { $( Metric::$variant => $sites, )* }
            }
        }
    };
}

const NONE: &[Site] = &[];

metrics! {
    /// Token-weighted local cross-entropy Σℓ_t/|T_k| of one rank.
    Loss = "loss", Rank, NONE;
    /// Tokens behind `loss` on that rank.
    Tokens = "tokens", Rank, NONE;
    /// ‖g_k‖: the rank's local gradient before the all-reduce.
    GradNorm = "grad_norm", Rank, NONE;
    /// ‖ḡ‖: the averaged gradient after the all-reduce.
    GradNormMean = "grad_norm_mean", Rank, NONE;
    /// cos(g_k, ḡ), exact ("dot mode").
    CosToMean = "cos_to_mean", Rank, NONE;
    /// NaN/Inf values in the logged loss plus the rank's gradient tensors holding a NaN/Inf.
    Nonfinite = "nonfinite", Rank, NONE;
    /// Records the rank's agent dropped because its queue and spool were full (cumulative).
    Dropped = "dropped", Rank, NONE;
    /// 1 when the mixed-precision loss scaler skips the optimizer step this gradient belongs to
    /// (its reduced gradient held an Inf/NaN), else 0. Such a gradient is not counted in
    /// `nonfinite`: overflow steps are the scaler's normal way of finding its scale.
    AmpSkipped = "amp_skipped", Rank, NONE;
    /// Values `log()` refused on that rank (bad name, type or shape), cumulative.
    Rejected = "rejected", Rank, NONE;
    /// 1, sent once by a rank's `finish()` at its last step: the rank is done. When every rank of
    /// the world has sent it, the run is over and its open alerts resolve.
    Finished = "finished", Rank, NONE;
    /// The learning rate of the first parameter group of the optimizer the agent watches, as
    /// its optimizer step used it (read on the host at the step, never from the device):
    /// `rank_collapse` waits out the schedule's warm-up with it.
    LearningRate = "learning_rate", Rank, NONE;
    /// Milliseconds the gradient probe spent on that rank since its last report (host time in
    /// its hooks and end-of-backward work).
    ProbeMsGrad = "probe_ms.grad", Rank, NONE;
    /// Milliseconds the activation probe spent on that rank since its last report.
    ProbeMsActivations = "probe_ms.activations", Rank, NONE;
    /// Milliseconds one spectral call took on that rank (device time where there is one).
    ProbeMsSpectral = "probe_ms.spectral", Rank, NONE;
    /// Milliseconds the replica fingerprint took on that rank since its last report.
    ProbeMsFingerprint = "probe_ms.fingerprint", Rank, NONE;
    /// The rank's replica fingerprint: an exact, order-independent 52-bit digest of the raw bits
    /// of every parameter it replicates (an integer, exact in an f64). Replicas of one model
    /// send equal values; see `replica_divergence`.
    ParamFingerprint = "param_fingerprint", Rank, NONE;
    /// The same digest over the rank's optimizer state (Adam's moments and step counts), at a
    /// slower cadence: replicas' optimizer states are equal too.
    OptimFingerprint = "optim_fingerprint", Rank, NONE;
    /// The locator beside `param_fingerprint`: Σ S_i·(2i+1)² mod 2^52 over the same tensors.
    /// Two replicas that differ in one tensor only differ in it and in the digest by δ·(2i+1)²
    /// and δ·(2i+1): their quotient names tensor i (`replica_divergence`).
    ParamLocator = "param_locator", Rank, NONE;
    /// The locator beside `optim_fingerprint`: names the parameter whose optimizer state differs.
    OptimLocator = "optim_locator", Rank, NONE;
    /// The replica set of the rank, where not every rank holds the same parameters (HSDP: the
    /// index of the shards it holds): its fingerprints are compared with its set's only.
    ReplicaSet = "replica_set", Rank, NONE;
    /// σ₁ of one weight matrix of a block.
    SpectralSigma = "spectral.sigma", Layer, &Site::MATRICES;
    /// σ_mlp = ‖W_down·W_up‖₂.
    SpectralMlp = "spectral.mlp", Layer, NONE;
    /// σ_attn = ‖W_o‖₂.
    SpectralAttn = "spectral.attn", Layer, NONE;
    /// σ_mlp/σ_attn, the "1:1 rule" ratio.
    SpectralRatio = "spectral.ratio", Layer, NONE;
    /// σ_OV = ‖W_o·W_v‖₂, GQA-aware.
    SpectralOv = "spectral.ov", Layer, NONE;
    /// σ_mlp/σ_OV.
    SpectralRatioOv = "spectral.ratio_ov", Layer, NONE;
    /// ‖W‖_F²/σ₁² of one weight matrix.
    StableRank = "stable_rank", Layer, &Site::MATRICES;
    /// Mean pairwise cosine of token states in the residual stream after a block.
    TokenCosine = "token_cosine", Layer, NONE;
    /// Participation ratio (Σσ²)²/Σσ⁴ of a block's linearised map
    /// (I + W_down·W_up)(I + W_o·R·W_v) (R: GQA's head replication), from the weights alone:
    /// how many directions it keeps.
    EffectiveRank = "effective_rank", Layer, NONE;
    /// max|a| at a hook point.
    ActMax = "act_max", Layer, &Site::ACTIVATIONS;
    /// The replica fingerprint of one block's parameters, per rank: names the blocks in which
    /// replicas differ.
    LayerFingerprint = "layer_fingerprint", Layer, NONE;
    /// Population standard deviation of the ranks' losses.
    LossStd = "loss_std", AllRanks, NONE;
    /// max − min of the ranks' losses.
    LossRange = "loss_range", AllRanks, NONE;
    /// loss_std / mean loss.
    LossCv = "loss_cv", AllRanks, NONE;
    /// Population standard deviation of the ranks' gradient norms.
    GradNormStd = "grad_norm_std", AllRanks, NONE;
    /// grad_norm_std / mean gradient norm.
    GradNormCv = "grad_norm_cv", AllRanks, NONE;
    /// C_w, the norm-weighted mean pairwise cosine, exact from scalars.
    CosWeighted = "cos_weighted", AllRanks, NONE;
    /// Mean over rank pairs of sketch cosines.
    CosPairMean = "cos_pair_mean", AllRanks, NONE;
    /// Gradient-noise-scale estimate.
    NoiseScale = "noise_scale", AllRanks, NONE;
    /// exp of the token-weighted mean loss over all ranks.
    Perplexity = "perplexity", AllRanks, NONE;
    /// Token-weighted mean of the ranks' losses: the averaged curve ordinary trackers show.
    LossMean = "loss_mean", AllRanks, NONE;
    /// Ranks of the world that had reported nothing for the step when the aligner closed it
    /// (on its timeout): their values are absent from the step's other statistics.
    RanksMissing = "ranks_missing", AllRanks, NONE;
}

impl Metric {
    /// Whether `site` is a valid site for this metric.
    pub fn accepts_site(self, site: Site) -> bool {
        self.sites().contains(&site)
    }
}

impl fmt::Display for Metric {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Metric {
    /// The vocabulary metric called `name`, if any (no allocation: the alert engine asks this
    /// of every row).
    pub fn from_name(name: &str) -> Option<Metric> {
        Metric::ALL.iter().copied().find(|m| m.as_str() == name)
    }
}

impl FromStr for Metric {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        Metric::from_name(s).ok_or_else(|| Error::InvalidMetricName {
            name: s.to_owned(),
            reason: "not a metric of the vocabulary".to_owned(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_are_unique() {
        let mut seen = std::collections::HashSet::new();
        for &m in Metric::ALL {
            assert!(seen.insert(m.as_str()), "duplicate name {m}");
            assert_eq!(m.as_str().parse::<Metric>().unwrap(), m);
        }
        for &s in Site::ALL {
            assert_eq!(s.as_str().parse::<Site>().unwrap(), s);
        }
        assert!("bogus".parse::<Site>().is_err());
    }

    #[test]
    fn scopes_follow_the_design() {
        assert_eq!(Metric::Loss.scope(), Scope::Rank);
        assert_eq!(Metric::SpectralRatio.scope(), Scope::Layer);
        assert_eq!(Metric::Perplexity.scope(), Scope::AllRanks);
        assert!(Metric::ActMax.accepts_site(Site::Residual));
        assert!(!Metric::ActMax.accepts_site(Site::Q));
        assert!(Metric::SpectralSigma.accepts_site(Site::Gate));
        assert!(Metric::ActMax.accepts_site(Site::Gate));
    }
}
