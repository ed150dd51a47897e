//! Record types: one [`Sample`] per value in the long-format `samples` table, one
//! [`SketchRecord`] per rank and step in `sketches`, one [`RunInfo`] per run in `runs`.
//!
//! [`Sample::validate`] enforces how a metric's scope constrains rank, layer and site, so the
//! collector can reject a malformed row with a message that names it. Values are never
//! validated: NaN and ±Inf are data (they are what a diverging run looks like) and are counted,
//! not refused.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::math::sketch::SketchKind;
use crate::validate::{MetricName, RunId};
use crate::vocab::{Scope, Site};

/// One value of one metric, from one rank (or all), at one step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    pub run: RunId,
    /// `None` means the value holds for all ranks (collector-derived, or identical on every rank).
    pub rank: Option<u32>,
    pub step: u64,
    /// Wall-clock time of the measurement, milliseconds since the Unix epoch.
    pub time_ms: i64,
    pub metric: MetricName,
    pub layer: Option<u32>,
    pub site: Option<Site>,
    pub value: f64,
}

impl Sample {
    /// Checks that rank, layer and site fit the metric's scope and, when the run is known, its
    /// world size and layer count. User metrics only get the range checks.
    pub fn validate(&self, run: Option<&RunInfo>) -> Result<()> {
        check_shape(
            &self.metric,
            self.metric.known(),
            self.rank,
            self.layer,
            self.site,
            run,
        )
    }
}

/// The checks of [`Sample::validate`] on the parts of a sample, for callers that keep values
/// in their own compact form (the agent) and have already resolved `known`, the vocabulary
/// metric `metric` names, if any.
pub fn check_shape(
    metric: &MetricName,
    known: Option<crate::vocab::Metric>,
    rank: Option<u32>,
    layer: Option<u32>,
    site: Option<Site>,
    run: Option<&RunInfo>,
) -> Result<()> {
    let fail = |reason: String| Error::InvalidSample {
        metric: metric.to_string(),
        reason,
    };
    if let Some(metric) = known {
        match metric.scope() {
            Scope::Rank => {
                if rank.is_none() {
                    return Err(fail("a per-rank metric needs a rank".into()));
                }
                if layer.is_some() || site.is_some() {
                    return Err(fail("a per-rank metric takes no layer or site".into()));
                }
            }
            Scope::AllRanks => {
                if rank.is_some() || layer.is_some() || site.is_some() {
                    return Err(fail(
                        "an all-ranks metric takes no rank, layer or site".into(),
                    ));
                }
            }
            Scope::Layer => {
                let sites = metric.sites();
                match site {
                    None if !sites.is_empty() => {
                        return Err(fail(format!(
                            "needs a site, one of {}",
                            sites
                                .iter()
                                .map(|s| s.as_str())
                                .collect::<Vec<_>>()
                                .join(", ")
                        )));
                    }
                    Some(site) if !sites.contains(&site) => {
                        return Err(fail(format!("does not take site {site}")));
                    }
                    _ => {}
                }
                let model_level = site.is_some_and(Site::is_model_level);
                match (layer, model_level) {
                    (None, false) => return Err(fail("needs a layer".into())),
                    (Some(layer), true) => {
                        return Err(fail(format!(
                            "site {} belongs to the whole model and takes no layer (got {layer})",
                            site.map(Site::as_str).unwrap_or_default()
                        )));
                    }
                    _ => {}
                }
            }
        }
    }
    if let Some(info) = run {
        if let Some(rank) = rank
            && rank >= info.world_size
        {
            return Err(fail(format!(
                "rank {rank} out of range: world size is {}",
                info.world_size
            )));
        }
        // An empty layout means "not discovered", not "no layers".
        if let Some(layer) = layer {
            let count = info.layout.layer_count();
            if count > 0 && layer >= count {
                return Err(fail(format!(
                    "layer {layer} out of range: the model has {count} layers"
                )));
            }
        }
    }
    Ok(())
}

/// The k-dimensional random projection of one rank's local gradient at one step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SketchRecord {
    pub run: RunId,
    pub rank: u32,
    pub step: u64,
    pub time_ms: i64,
    pub kind: SketchKind,
    /// The seed shared by all ranks of the run; sketches with different seeds do not compare.
    pub seed: u32,
    /// ‖g_k‖, exact, so that cosines from sketches divide by true norms.
    pub norm: f64,
    pub vector: Vec<f32>,
}

/// The layout types travel in a run's info: the contract's, validated by [`RunInfo::validate`].
pub use rankwatch_api::{AttentionShape, LayerLayout, ModelLayout};

/// A run's metadata: one row of the `runs` table.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunInfo {
    pub run: RunId,
    pub world_size: u32,
    pub started_at_ms: i64,
    pub layout: ModelLayout,
    /// Free-form key/value metadata (hyper-parameters, host, git commit...).
    #[serde(default)]
    pub tags: BTreeMap<String, String>,
}

impl RunInfo {
    /// Checks the invariants the rest of the system relies on: at least one rank, layers
    /// numbered 0..n in order, only weight-matrix sites in a layout, and head counts that divide.
    pub fn validate(&self) -> Result<()> {
        let fail = |reason: String| Error::InvalidRunInfo {
            run: self.run.to_string(),
            reason,
        };
        if self.world_size == 0 {
            return Err(fail("world size must be at least 1".into()));
        }
        for (i, layer) in self.layout.layers.iter().enumerate() {
            if layer.index as usize != i {
                return Err(fail(format!(
                    "layer {i} is numbered {}: layers must be numbered 0..n in order",
                    layer.index
                )));
            }
            if let Some(site) = layer.sites.iter().find(|s| !Site::MATRICES.contains(s)) {
                return Err(fail(format!(
                    "layer {i}: site {site} is not a weight matrix"
                )));
            }
            if let Some(a) = layer.attention {
                if a.n_heads == 0 || a.n_kv_heads == 0 || a.head_dim == 0 {
                    return Err(fail(format!("layer {i}: head counts must be positive")));
                }
                if a.n_heads % a.n_kv_heads != 0 {
                    return Err(fail(format!(
                        "layer {i}: {} query heads do not divide into {} key/value heads",
                        a.n_heads, a.n_kv_heads
                    )));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vocab::Metric;

    fn sample(metric: &str, rank: Option<u32>, layer: Option<u32>, site: Option<Site>) -> Sample {
        Sample {
            run: RunId::new("r").unwrap(),
            rank,
            step: 1,
            time_ms: 0,
            metric: MetricName::new(metric).unwrap(),
            layer,
            site,
            value: f64::NAN,
        }
    }

    fn info(world: u32, layers: u32) -> RunInfo {
        RunInfo {
            run: RunId::new("r").unwrap(),
            world_size: world,
            started_at_ms: 0,
            layout: ModelLayout {
                family: "llama".into(),
                layers: (0..layers)
                    .map(|index| LayerLayout {
                        index,
                        sites: Site::MATRICES.to_vec(),
                        attention: Some(AttentionShape {
                            n_heads: 8,
                            n_kv_heads: 2,
                            head_dim: 16,
                        }),
                        experts: None,
                    })
                    .collect(),
            },
            tags: BTreeMap::new(),
        }
    }

    #[test]
    fn scope_rules_are_enforced_with_clear_messages() {
        let run = info(4, 2);
        let ok = [
            sample("loss", Some(0), None, None),
            sample("spectral.ratio", None, Some(1), None),
            sample("spectral.sigma", Some(3), Some(0), Some(Site::Down)),
            sample("act_max", Some(0), None, Some(Site::Embed)),
            sample("perplexity", None, None, None),
            sample("user/train/lr", None, Some(1), Some(Site::Q)),
        ];
        for s in &ok {
            s.validate(Some(&run)).unwrap();
        }
        let bad = [
            (sample("loss", None, None, None), "needs a rank"),
            (sample("loss", Some(0), Some(1), None), "no layer or site"),
            (sample("perplexity", Some(0), None, None), "no rank"),
            (
                sample("spectral.sigma", None, Some(0), None),
                "needs a site",
            ),
            (
                sample("act_max", None, Some(0), Some(Site::Q)),
                "does not take site q",
            ),
            (
                sample("act_max", None, Some(0), Some(Site::Embed)),
                "whole model",
            ),
            (sample("token_cosine", None, None, None), "needs a layer"),
            (
                sample("loss", Some(4), None, None),
                "rank 4 out of range: world size is 4",
            ),
            (
                sample("token_cosine", None, Some(2), None),
                "layer 2 out of range",
            ),
        ];
        for (s, want) in &bad {
            let err = s.validate(Some(&run)).unwrap_err().to_string();
            assert!(err.contains(want), "{err:?} should contain {want:?}");
        }
        // Non-finite values are data, never a validation error.
        for value in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
            let s = Sample {
                value,
                ..sample("loss", Some(0), None, None)
            };
            s.validate(Some(&run)).unwrap();
        }
        assert_eq!(Metric::Loss.as_str(), "loss");
    }

    #[test]
    fn run_info_invariants() {
        info(2, 3).validate().unwrap();
        let mut bad = info(2, 3);
        bad.world_size = 0;
        assert!(
            bad.validate()
                .unwrap_err()
                .to_string()
                .contains("world size")
        );
        let mut bad = info(2, 3);
        bad.layout.layers[1].index = 5;
        assert!(bad.validate().unwrap_err().to_string().contains("numbered"));
        let mut bad = info(2, 3);
        bad.layout.layers[0].attention = Some(AttentionShape {
            n_heads: 8,
            n_kv_heads: 3,
            head_dim: 4,
        });
        assert!(bad.validate().unwrap_err().to_string().contains("divide"));
        let mut bad = info(2, 3);
        bad.layout.layers[2].sites.push(Site::Residual);
        assert!(
            bad.validate()
                .unwrap_err()
                .to_string()
                .contains("not a weight matrix")
        );
    }
}
