//! Where in the model a value belongs, and the model's layout as the SDK discovered it: the
//! words an ingest body uses ([`Site`], [`SketchKind`]) and the `layout` of its run info. The
//! analytics crate validates with these very types and re-exports them.

use serde::{Deserialize, Serialize};

use crate::vocab::vocabulary;

vocabulary!(
    /// The point in the model a value refers to: a weight matrix (spectral metrics) or a hook
    /// point (activation maxima). `gate` names both the gate projection and its activations;
    /// the metric says which is meant.
    Site ("site") {
        Q = "q",
        K = "k",
        V = "v",
        O = "o",
        Up = "up",
        Gate = "gate",
        Down = "down",
        Embed = "embed",
        Residual = "residual",
        AttnOut = "attn_out",
        MlpOut = "mlp_out",
        FinalNorm = "final_norm",
    }
);

impl Site {
    /// The weight matrices of a transformer block.
    pub const MATRICES: [Site; 7] = [
        Site::Q,
        Site::K,
        Site::V,
        Site::O,
        Site::Up,
        Site::Gate,
        Site::Down,
    ];
    /// The hook points where activation maxima are taken.
    pub const ACTIVATIONS: [Site; 6] = [
        Site::Embed,
        Site::Residual,
        Site::AttnOut,
        Site::MlpOut,
        Site::Gate,
        Site::FinalNorm,
    ];

    /// Sites that belong to the whole model rather than to one block: a value there has no layer.
    pub const fn is_model_level(self) -> bool {
        matches!(self, Site::Embed | Site::FinalNorm)
    }
}

vocabulary!(
    /// Which random projection a gradient sketch uses.
    SketchKind ("sketch kind") {
        Rademacher = "rademacher",
        CountSketch = "countsketch",
    }
);

/// Shape of a block's attention, needed for σ_OV under grouped-query attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
pub struct AttentionShape {
    pub n_heads: u32,
    pub n_kv_heads: u32,
    pub head_dim: u32,
}

/// What one transformer block holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
pub struct LayerLayout {
    pub index: u32,
    /// The weight matrices found for this block.
    pub sites: Vec<Site>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention: Option<AttentionShape>,
    /// Number of MLP experts for mixture-of-experts blocks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub experts: Option<u32>,
}

/// The model's layout as the SDK discovered it; empty when nothing was discovered.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
pub struct ModelLayout {
    /// Model family as named by layer discovery (`llama`, `gpt2`, `gpt_neox`, `generic`, ...).
    pub family: String,
    pub layers: Vec<LayerLayout>,
}

impl ModelLayout {
    /// Nothing discovered: no family, no layers (what a body without a layout means).
    pub fn is_empty(&self) -> bool {
        self.family.is_empty() && self.layers.is_empty()
    }

    /// Number of blocks.
    pub fn layer_count(&self) -> u32 {
        u32::try_from(self.layers.len()).unwrap_or(u32::MAX)
    }
}
