//! The DeepSeek MoE fields of `config.json` (DESIGN.md §3). Parsing lives in
//! `checkpoint::config`; this is the validated result.

use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ScoringFunc {
    /// DeepSeek-V3 / R1
    Sigmoid,
    Softmax,
    /// DeepSeek-V4: `sqrt(softplus(logit))`
    Sqrtsoftplus,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MoeConfig {
    pub hidden_size: usize,
    pub moe_intermediate_size: usize,
    /// Intermediate size of dense layers (the first `first_k_dense_replace`).
    pub intermediate_size: usize,
    pub n_routed_experts: usize,
    pub num_experts_per_tok: usize,
    pub n_shared_experts: usize,
    pub n_group: usize,
    pub topk_group: usize,
    pub routed_scaling_factor: f32,
    pub scoring_func: ScoringFunc,
    pub norm_topk_prob: bool,
    pub first_k_dense_replace: usize,
    pub num_hidden_layers: usize,
    /// V4: the first `num_hash_layers` MoE layers route by `tid2eid[input_ids]`.
    pub num_hash_layers: usize,
    /// V4: gate clamped to ≤ L, up to ±L.
    pub swiglu_limit: Option<f32>,
    pub rms_norm_eps: f32,
    pub vocab_size: usize,
}

impl MoeConfig {
    /// Is layer `l` an MoE layer (not one of the first dense ones)?
    pub fn is_moe_layer(&self, l: usize) -> bool {
        l >= self.first_k_dense_replace && l < self.num_hidden_layers
    }
    /// Does MoE layer `l` route by hash (V4's first layers)?
    pub fn is_hash_layer(&self, l: usize) -> bool {
        l < self.num_hash_layers
    }
}
