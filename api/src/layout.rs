//! Where in the model a value belongs, and the model's layout as the SDK discovered it: the
//! words an ingest body uses ([`Site`], [`SketchKind`]) and the `layout` of its run info. The
//! analytics crate validates with these very types and re-exports them.

use serde::{Deserialize, Serialize};

use crate::vocab::text_form;

/// The point in the model a value refers to: a weight matrix (spectral metrics) or a hook point
/// (activation maxima). `gate` names both the gate projection and its activations; the metric
/// says which is meant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Site {
    Q,
    K,
    V,
    O,
    Up,
    Gate,
    Down,
    Embed,
    Residual,
    AttnOut,
    MlpOut,
    FinalNorm,
}

impl Site {
    /// Every site, in vocabulary order.
    pub const ALL: [Site; 12] = [
        Site::Q,
        Site::K,
        Site::V,
        Site::O,
        Site::Up,
        Site::Gate,
        Site::Down,
        Site::Embed,
        Site::Residual,
        Site::AttnOut,
        Site::MlpOut,
        Site::FinalNorm,
    ];
    /// Every wire name, in vocabulary order.
    pub const NAMES: &'static [&'static str] = &[
        "q",
        "k",
        "v",
        "o",
        "up",
        "gate",
        "down",
        "embed",
        "residual",
        "attn_out",
        "mlp_out",
        "final_norm",
    ];
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

    /// The site's wire and storage name.
    pub const fn as_str(self) -> &'static str {
        Site::NAMES[self as usize]
    }

    /// Sites that belong to the whole model rather than to one block: a value there has no layer.
    pub const fn is_model_level(self) -> bool {
        matches!(self, Site::Embed | Site::FinalNorm)
    }
}

text_form!(Site, "site");

/// Which random projection a gradient sketch uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SketchKind {
    Rademacher,
    CountSketch,
}

impl SketchKind {
    /// Every kind, in the order of [`SketchKind::NAMES`].
    pub const ALL: [SketchKind; 2] = [SketchKind::Rademacher, SketchKind::CountSketch];
    /// Every wire name.
    pub const NAMES: &'static [&'static str] = &["rademacher", "countsketch"];

    /// The wire and storage name.
    pub const fn as_str(self) -> &'static str {
        SketchKind::NAMES[self as usize]
    }
}

text_form!(SketchKind, "sketch kind");

/// Shape of a block's attention, needed for σ_OV under grouped-query attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttentionShape {
    pub n_heads: u32,
    pub n_kv_heads: u32,
    pub head_dim: u32,
}

/// What one transformer block holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
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
