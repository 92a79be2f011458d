//! The router on the GPU: FP32 logits through cuBLAS, then kernels/router.cu for scoring,
//! group-limited top-k or hash ids, and the weights.
//!
//! The logits: where the router weight and the hidden states are all BF16-exact (a BF16
//! checkpoint's gate, a BF16 model's residual stream), a BF16 GEMM on the tensor cores with
//! FP32 accumulation: every product `h·w` of two BF16 values is exact in FP32, so only the
//! accumulation differs from a SIMT FP32 dot product (order and rounding of the FP32 sums,
//! what any two FP32 GEMMs differ by). Otherwise, or with `NVFP4DBG_ROUTER_FP32=1`, plain
//! FP32 on the FMA pipes (cuBLAS pedantic: no TF32).

use super::blas;
use super::device::{Gpu, KArg};
use super::nvrtc::ROUTER;
use crate::error::{Error, Result};
use crate::moe::{MoeConfig, MoeLayer, Routing, ScoringFunc};
use cudarc::driver::{CudaSlice, LaunchConfig};

const WARPS: u32 = 4;

/// Which router kernel takes this layer's top-k: `router_topk_keys8` / `16` (the top-k and
/// the group limit on rank keys in registers, 8 or 16 a lane) where E is a multiple of 32 up
/// to 256 / 512, k <= 32, and the groups are of 32 experts or absent, on a layer without hash
/// routing; else `router_topk`. `NVFP4DBG_ROUTER_KERNEL=general` takes `router_topk`
/// everywhere (A/B runs).
fn topk_kernel(c: &MoeConfig, hash: bool) -> &'static str {
    let (e, k, g) = (c.n_routed_experts, c.num_experts_per_tok, c.n_group);
    let fits = !hash
        && e.is_multiple_of(32)
        && e <= 512
        && k <= 32
        && (g <= 1 || g * 32 == e)
        && !std::env::var("NVFP4DBG_ROUTER_KERNEL").is_ok_and(|v| v == "general");
    if fits && e <= 256 {
        "router_topk_keys8"
    } else if fits {
        "router_topk_keys16"
    } else {
        "router_topk"
    }
}

/// A layer's router tensors on the GPU.
pub struct DevRouter {
    pub(crate) weight: CudaSlice<f32>,
    /// The weight as BF16 when every value is BF16-exact (and `NVFP4DBG_ROUTER_FP32` is not
    /// set): the logits then run on the tensor cores.
    pub(crate) weight_bf16: Option<CudaSlice<u16>>,
    pub(crate) bias: Option<CudaSlice<f32>>,
    pub(crate) tid2eid: Option<CudaSlice<i64>>,
    pub(crate) vocab: usize,
    pub(crate) hash: bool,
}

pub(crate) fn check_router(layer: &MoeLayer) -> Result<()> {
    crate::moe::validate_router(&layer.config, layer.index, &layer.router)?;
    if layer.is_hash_layer() && layer.router.tid2eid.is_none() {
        return Err(Error::usage(format!(
            "MoE layer {} is a hash layer (num_hash_layers = {}) but has no gate.tid2eid table",
            layer.index, layer.config.num_hash_layers
        )));
    }
    Ok(())
}

impl DevRouter {
    pub fn upload(gpu: &Gpu, layer: &MoeLayer) -> Result<Self> {
        check_router(layer)?;
        let r = &layer.router;
        let hash = layer.config.is_hash_layer(layer.index);
        let k = layer.config.num_experts_per_tok;
        let fp32_only = std::env::var("NVFP4DBG_ROUTER_FP32").is_ok_and(|v| v == "1");
        Ok(DevRouter {
            weight: gpu.upload(&r.weight, "the router weight")?,
            weight_bf16: match bf16_exact(&r.weight) {
                Some(bits) if !fp32_only => Some(gpu.upload(&bits, "the router weight (BF16)")?),
                _ => None,
            },
            bias: match &r.e_score_correction_bias {
                Some(b) => Some(gpu.upload(b, "e_score_correction_bias")?),
                None => None,
            },
            tid2eid: match (&r.tid2eid, hash) {
                (Some(t), true) => Some(gpu.upload(t, "tid2eid")?),
                _ => None,
            },
            vocab: r.tid2eid.as_ref().map_or(0, |t| t.len() / k),
            hash,
        })
    }

    /// Check `input_ids` against the hash table (a hash layer needs them).
    pub(crate) fn check_input_ids(
        &self,
        layer: usize,
        tokens: usize,
        ids: Option<&[i64]>,
    ) -> Result<()> {
        if !self.hash {
            return Ok(());
        }
        let ids = ids.ok_or_else(|| {
            Error::usage(format!(
                "MoE layer {layer} routes by tid2eid[input_ids]: input_ids are required"
            ))
        })?;
        if ids.len() != tokens {
            return Err(Error::usage(format!(
                "MoE layer {layer}: {} input_ids for {tokens} tokens",
                ids.len()
            )));
        }
        if let Some((t, &id)) = ids
            .iter()
            .enumerate()
            .find(|(_, &id)| id < 0 || id as usize >= self.vocab)
        {
            return Err(Error::usage(format!(
                "MoE layer {layer}: input_ids[{t}] = {id} is outside tid2eid's vocabulary of {}",
                self.vocab
            )));
        }
        Ok(())
    }
}

/// `v` as BF16 bits when every value is exactly a BF16 (bit for bit: a NaN with payload bits
/// BF16 drops is not), else None.
pub(crate) fn bf16_exact(v: &[f32]) -> Option<Vec<u16>> {
    v.iter()
        .map(|&x| {
            let b = half::bf16::from_f32(x);
            (b.to_f32().to_bits() == x.to_bits()).then_some(b.to_bits())
        })
        .collect()
}

fn scoring_code(s: ScoringFunc) -> u32 {
    match s {
        ScoringFunc::Sigmoid => 0,
        ScoringFunc::Softmax => 1,
        ScoringFunc::Sqrtsoftplus => 2,
    }
}

/// Device buffers the router writes.
pub(crate) struct RouteBufs {
    pub logits: u64,
    pub topk_ids: u64,
    pub topk_weights: u64,
}

/// Enqueue routing of `tokens` rows at `hidden` (f32 `[tokens, H]`; `hidden_bf16`, when
/// given, the same values as BF16, which the caller has checked are exact). No host sync.
#[allow(clippy::too_many_arguments)]
pub(crate) fn enqueue_route(
    gpu: &Gpu,
    c: &MoeConfig,
    r: &DevRouter,
    hidden: u64,
    hidden_bf16: Option<u64>,
    tokens: usize,
    input_ids: Option<u64>,
    out: &RouteBufs,
) -> Result<()> {
    let (h, e, k) = (c.hidden_size, c.n_routed_experts, c.num_experts_per_tok);
    if tokens == 0 {
        return Ok(());
    }
    match (&r.weight_bf16, hidden_bf16) {
        (Some(w), Some(x)) => blas::gemm_bf16(
            gpu,
            tokens,
            e,
            h,
            x,
            gpu.ptr(w),
            out.logits,
            blas::Out::F32,
            "router logits",
        )?,
        _ => blas::gemm_f32(
            gpu,
            tokens,
            e,
            h,
            hidden,
            gpu.ptr(&r.weight),
            out.logits,
            "router logits",
        )?,
    }
    let smem = WARPS as usize * (2 * e * 4 + e);
    let smem = u32::try_from(smem)
        .map_err(|_| Error::usage(format!("{e} experts is too many for the router kernel")))?;
    let tid = match (&r.tid2eid, r.hash) {
        (Some(t), true) => gpu.ptr(t),
        _ => 0,
    };
    if r.hash && input_ids.is_none() {
        return Err(Error::usage("a hash layer needs input_ids"));
    }
    gpu.launch(
        &ROUTER,
        topk_kernel(c, r.hash),
        LaunchConfig {
            grid_dim: ((tokens as u32).div_ceil(WARPS), 1, 1),
            block_dim: (WARPS * 32, 1, 1),
            shared_mem_bytes: smem,
        },
        &[
            KArg::U64(out.logits),
            KArg::U32(tokens as u32),
            KArg::U32(e as u32),
            KArg::U32(k as u32),
            KArg::U32(scoring_code(c.scoring_func)),
            KArg::U64(r.bias.as_ref().map_or(0, |b| gpu.ptr(b))),
            KArg::U32(if r.hash { 1 } else { c.n_group as u32 }),
            KArg::U32(c.topk_group as u32),
            KArg::U32(c.norm_topk_prob as u32),
            KArg::F32(c.routed_scaling_factor),
            KArg::U64(tid),
            KArg::U64(input_ids.unwrap_or(0)),
            KArg::U64(out.topk_ids),
            KArg::U64(out.topk_weights),
        ],
    )
}

/// Route a batch on the GPU and bring the decision back.
pub fn route(
    gpu: &Gpu,
    layer: &MoeLayer,
    hidden: &[f32],
    input_ids: Option<&[i64]>,
) -> Result<Routing> {
    let c = &layer.config;
    let (h, e, k) = (c.hidden_size, c.n_routed_experts, c.num_experts_per_tok);
    if h == 0 || !hidden.len().is_multiple_of(h) {
        return Err(Error::usage(format!(
            "MoE layer {}: hidden states of {} values are not [tokens, {h}]",
            layer.index,
            hidden.len()
        )));
    }
    let tokens = hidden.len() / h;
    let r = DevRouter::upload(gpu, layer)?;
    r.check_input_ids(layer.index, tokens, input_ids)?;
    let x = gpu.upload(hidden, "the hidden states")?;
    let x_bf16 = match r.weight_bf16.as_ref().and_then(|_| bf16_exact(hidden)) {
        Some(bits) => Some(gpu.upload(&bits, "the hidden states (BF16)")?),
        None => None,
    };
    let ids_dev = match input_ids {
        Some(ids) if r.hash => Some(gpu.upload(ids, "input_ids")?),
        _ => None,
    };
    let logits = gpu.alloc::<f32>(tokens * e, "router logits")?;
    let topk_ids = gpu.alloc::<i32>(tokens * k, "topk_ids")?;
    let topk_w = gpu.alloc::<f32>(tokens * k, "topk_weights")?;
    enqueue_route(
        gpu,
        c,
        &r,
        gpu.ptr(&x),
        x_bf16.as_ref().map(|d| gpu.ptr(d)),
        tokens,
        ids_dev.as_ref().map(|d| gpu.ptr(d)),
        &RouteBufs {
            logits: gpu.ptr(&logits),
            topk_ids: gpu.ptr(&topk_ids),
            topk_weights: gpu.ptr(&topk_w),
        },
    )?;
    Ok(Routing {
        tokens,
        top_k: k,
        topk_ids: gpu.download(&topk_ids, tokens * k, "topk_ids")?,
        topk_weights: gpu.download(&topk_w, tokens * k, "topk_weights")?,
    })
}
