//! The DeepSeek MoE layer (DESIGN.md §4): config, router, experts, the NVFP4 path and the
//! BF16 reference. Numerics only: never prints.

pub mod config;
pub mod ep;

pub use config::{MoeConfig, ScoringFunc};

use crate::nvfp4::Fp4Tensor;

/// One NVFP4 linear layer as the checkpoint holds it (`[out, in]`, K = in along the packed dim).
#[derive(Clone, Debug)]
pub struct QLinear {
    pub weight: Fp4Tensor,
    /// Checkpoint `input_scale` (dequant direction, amax/2688), if present.
    pub input_scale: Option<f32>,
    /// The BF16 original `[out, in]` (as f32, BF16-exact), when the checkpoint ships it.
    pub original: Option<Vec<f32>>,
}

impl QLinear {
    pub fn out_features(&self) -> usize {
        self.weight.rows
    }
    pub fn in_features(&self) -> usize {
        self.weight.cols
    }
    /// `weight_scale_2` (dequant direction).
    pub fn weight_scale_2(&self) -> f32 {
        self.weight.scale_2
    }
    /// The weight the reference uses: the BF16 original when present, else dequantized.
    pub fn reference_weight(&self) -> std::borrow::Cow<'_, [f32]> {
        match &self.original {
            Some(o) => std::borrow::Cow::Borrowed(o),
            None => std::borrow::Cow::Owned(self.weight.dequantize()),
        }
    }
}

/// A routed expert: `y = W2 · (silu(clamp(W1 x)) ⊙ clamp(W3 x))`.
#[derive(Clone, Debug)]
pub struct Expert {
    /// gate_proj
    pub w1: QLinear,
    /// up_proj
    pub w3: QLinear,
    /// down_proj
    pub w2: QLinear,
}

/// A BF16 MLP (shared experts, or a dense layer): weights `[out, in]` as f32, BF16-exact.
#[derive(Clone, Debug)]
pub struct DenseMlp {
    pub intermediate: usize,
    pub w1: Vec<f32>,
    pub w3: Vec<f32>,
    pub w2: Vec<f32>,
}

#[derive(Clone, Debug)]
pub struct Router {
    /// `[n_routed_experts, hidden]`, FP32 math.
    pub weight: Vec<f32>,
    pub e_score_correction_bias: Option<Vec<f32>>,
    /// V4 hash layers: `tid2eid[token_id * top_k + j]`, `[vocab, top_k]`.
    pub tid2eid: Option<Vec<i64>>,
}

#[derive(Clone, Debug)]
pub struct MoeLayer {
    pub index: usize,
    pub config: MoeConfig,
    pub router: Router,
    pub experts: Vec<Expert>,
    pub shared: Option<DenseMlp>,
    /// RMSNorm weight applied before this MoE block (post_attention_layernorm), if known.
    pub norm_weight: Option<Vec<f32>>,
}

/// The router's decision for a batch: `[tokens, top_k]` each.
#[derive(Clone, Debug, PartialEq)]
pub struct Routing {
    pub tokens: usize,
    pub top_k: usize,
    /// Global expert ids.
    pub topk_ids: Vec<i32>,
    pub topk_weights: Vec<f32>,
}

/// Activation global scales in the quant direction (`gs = 1/input_scale`) for one layer.
#[derive(Clone, Debug, PartialEq)]
pub enum ActScales {
    /// Per expert: `gs1[e]` before gate/up, `gs2[e]` before down.
    Fixed { gs1: Vec<f32>, gs2: Vec<f32> },
    /// Per batch: each GEMM input's own `2688 / amax` over the rows routed to that expert.
    Dynamic,
}

/// Which path a forward takes.
#[derive(Clone, Debug)]
pub enum Path<'a> {
    /// Activations quantized to NVFP4 before each expert GEMM.
    Nvfp4 {
        scales: &'a ActScales,
        flavor: crate::nvfp4::Flavor,
    },
    /// BF16 activations, reference weights, FP32 (GPU) / FP64 (CPU) accumulation; the SwiGLU
    /// output is rounded to BF16 before the down projection, as a BF16 model does.
    Reference,
}

/// Output of one MoE forward.
#[derive(Clone, Debug, Default)]
pub struct MoeOutput {
    /// `[tokens, hidden]`: `Σ_e w_e · y_e + shared(x)`.
    pub out: Vec<f32>,
    /// Activation quantization statistics over all expert GEMM inputs (NVFP4 path).
    pub act_stats: crate::nvfp4::BlockStats,
    /// `[tokens * top_k, hidden]`, unweighted `y_e` per (token, slot), when asked for.
    pub per_slot: Option<Vec<f32>>,
}
