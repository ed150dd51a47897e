//! All rules' thresholds in one serde struct: the `[rules]` file the collector loads with
//! `--rules`. Every field has a default, so a file names only what it changes, and an unknown
//! key is an error (a typo must not silently keep a default).

use serde::{Deserialize, Serialize};

use super::{
    ActivationOutlierConfig, LossSpikeConfig, NonfiniteConfig, RankCollapseConfig,
    ReplicaDivergenceConfig, SilentInconsistencyConfig, StaleRankConfig,
};
use crate::error::Result;

/// Thresholds for every rule.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DetectorsConfig {
    pub rank_collapse: RankCollapseConfig,
    pub silent_inconsistency: SilentInconsistencyConfig,
    pub nonfinite: NonfiniteConfig,
    pub loss_spike: LossSpikeConfig,
    pub activation_outlier: ActivationOutlierConfig,
    pub stale_rank: StaleRankConfig,
    pub replica_divergence: ReplicaDivergenceConfig,
}

impl DetectorsConfig {
    /// Checks every rule's thresholds.
    pub fn validate(&self) -> Result<()> {
        self.rank_collapse.validate()?;
        self.silent_inconsistency.validate()?;
        self.nonfinite.lifecycle.validate("nonfinite")?;
        self.loss_spike.validate()?;
        self.activation_outlier.validate()?;
        self.replica_divergence
            .lifecycle
            .validate("replica_divergence")?;
        self.stale_rank.validate()
    }
}
