//! The DeepSeek MoE layer (DESIGN.md §4): config, router, experts, the NVFP4 path and the
//! BF16 reference. Numerics only: never prints.

pub mod breakdown;
pub mod byok;
pub mod config;
pub mod ep;
pub mod forward;
pub mod gs;
pub mod parallel;
pub mod router;
pub mod synthetic;

pub use config::{MoeConfig, ScoringFunc};
pub use forward::{moe_forward, rmsnorm_bf16};
pub use gs::{GsSource, InputScaleReduce};
pub use router::route;

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

impl MoeLayer {
    /// Does this layer route by `tid2eid[input_ids]` (V4's first layers)?
    pub fn is_hash_layer(&self) -> bool {
        self.config.is_hash_layer(self.index)
    }

    /// Token ids valid for this layer: the rows of its `tid2eid` table when it has one (a
    /// config may not state `vocab_size`), else the config's `vocab_size`; at least 1.
    pub fn token_vocab(&self) -> usize {
        let k = self.config.num_experts_per_tok.max(1);
        self.router
            .tid2eid
            .as_ref()
            .map(|t| t.len() / k)
            .unwrap_or(self.config.vocab_size)
            .max(1)
    }

    /// Check that every tensor has the shape the config promises, so the forward can index
    /// without panicking on a bad checkpoint.
    pub fn validate(&self) -> crate::Result<()> {
        validate_router(&self.config, self.index, &self.router)?;
        let c = &self.config;
        let (h, i, e) = (c.hidden_size, c.moe_intermediate_size, c.n_routed_experts);
        let bad = |what: String| crate::Error::usage(format!("MoE layer {}: {what}", self.index));
        if self.experts.len() != e {
            return Err(bad(format!(
                "{} experts loaded, config says {e}",
                self.experts.len()
            )));
        }
        for (x, ex) in self.experts.iter().enumerate() {
            for (name, q, rows, cols) in [
                ("gate_proj (w1)", &ex.w1, i, h),
                ("up_proj (w3)", &ex.w3, i, h),
                ("down_proj (w2)", &ex.w2, h, i),
            ] {
                q.check_shape(rows, cols)
                    .map_err(|w| bad(format!("expert {x} {name}: {w}")))?;
            }
        }
        if let Some(s) = &self.shared {
            s.check_shape(h)
                .map_err(|w| bad(format!("shared experts: {w}")))?;
        }
        if let Some(n) = &self.norm_weight {
            if n.len() != h {
                return Err(bad(format!(
                    "norm weight has {} values, expected [{h}]",
                    n.len()
                )));
            }
        }
        Ok(())
    }
}

/// Check the config and the router tensors (what routing needs; no experts).
pub fn validate_router(c: &MoeConfig, index: usize, router: &Router) -> crate::Result<()> {
    let (h, i, e, k) = (
        c.hidden_size,
        c.moe_intermediate_size,
        c.n_routed_experts,
        c.num_experts_per_tok,
    );
    let bad = |what: String| crate::Error::usage(format!("MoE layer {index}: {what}"));
    if h == 0 || e == 0 || k == 0 || k > e {
        return Err(bad(format!(
            "config has hidden_size {h}, n_routed_experts {e}, num_experts_per_tok {k}"
        )));
    }
    if h % 16 != 0 || i % 16 != 0 {
        return Err(bad(format!(
            "hidden_size {h} and moe_intermediate_size {i} must be multiples of the NVFP4 block (16)"
        )));
    }
    if c.n_group > 1 {
        if e % c.n_group != 0 {
            return Err(bad(format!(
                "n_routed_experts {e} is not a multiple of n_group {}",
                c.n_group
            )));
        }
        if c.topk_group == 0 || c.topk_group > c.n_group || c.topk_group * (e / c.n_group) < k {
            return Err(bad(format!(
                "topk_group {} of n_group {} leaves fewer than num_experts_per_tok {k} experts",
                c.topk_group, c.n_group
            )));
        }
    }
    if router.weight.len() != e * h {
        return Err(bad(format!(
            "router weight (gate.weight) has {} values, expected [{e}, {h}]",
            router.weight.len()
        )));
    }
    if let Some(b) = &router.e_score_correction_bias {
        if b.len() != e {
            return Err(bad(format!(
                "e_score_correction_bias has {} values, expected [{e}]",
                b.len()
            )));
        }
    }
    if let Some(t) = &router.tid2eid {
        if t.is_empty() || t.len() % k != 0 {
            return Err(bad(format!(
                "tid2eid has {} values, not a [vocab, {k}] table",
                t.len()
            )));
        }
        if let Some((j, v)) = t
            .iter()
            .enumerate()
            .find(|(_, &v)| v < 0 || v as usize >= e)
        {
            return Err(bad(format!(
                "tid2eid[{}, {}] = {v} is not an expert id (n_routed_experts = {e})",
                j / k,
                j % k
            )));
        }
    }
    Ok(())
}

impl QLinear {
    fn check_shape(&self, rows: usize, cols: usize) -> std::result::Result<(), String> {
        let w = &self.weight;
        let block = w.format.block();
        if w.rows != rows || w.cols != cols {
            return Err(format!(
                "shape [{}, {}], expected [{rows}, {cols}]",
                w.rows, w.cols
            ));
        }
        if !cols.is_multiple_of(block)
            || w.packed.len() != rows * cols / 2
            || w.scales.len() != rows * (cols / block)
        {
            return Err(format!(
                "{} packed bytes and {} block scales do not fit [{rows}, {cols}]",
                w.packed.len(),
                w.scales.len()
            ));
        }
        if let Some(o) = &self.original {
            if o.len() != rows * cols {
                return Err(format!(
                    "BF16 original has {} values, expected [{rows}, {cols}]",
                    o.len()
                ));
            }
        }
        Ok(())
    }
}

impl DenseMlp {
    fn check_shape(&self, h: usize) -> std::result::Result<(), String> {
        let i = self.intermediate;
        if self.w1.len() != i * h || self.w3.len() != i * h || self.w2.len() != h * i {
            return Err(format!(
                "weights of {}, {}, {} values do not fit intermediate {i} x hidden {h}",
                self.w1.len(),
                self.w3.len(),
                self.w2.len()
            ));
        }
        Ok(())
    }
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
