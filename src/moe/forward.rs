//! The MoE block forward of docs/moe-forward.md on the CPU: the NVFP4 path (activations
//! quantized before each expert GEMM) and the BF16 reference. Every accumulation is f64,
//! rounded once to f32.
//!
//! Why f64 makes the NVFP4 path order-independent: every product `e2m1·e4m3 × e2m1·e4m3` has
//! at most 12 significant bits and is a multiple of 2^-20, so the f64 partial sums are exact
//! for any realistic block-scale range; the GPU's FP32 sums differ only by their rounding.

use super::router::token_count;
use super::{ActScales, DenseMlp, Expert, MoeLayer, MoeOutput, Path, Routing};
use crate::error::{Error, Result};
use crate::nvfp4::{quantize_nvfp4, rcp, BlockStats, Flavor, Fp4Tensor, GS_DENOM};
use rayon::prelude::*;

/// `Σ f64(a[i]) · f64(b[i])`; four partial sums so the loop vectorizes.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f64 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut s = [0f64; 4];
    let ca = a.chunks_exact(4);
    let cb = b.chunks_exact(4);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        s[0] += x[0] as f64 * y[0] as f64;
        s[1] += x[1] as f64 * y[1] as f64;
        s[2] += x[2] as f64 * y[2] as f64;
        s[3] += x[3] as f64 * y[3] as f64;
    }
    let mut tail = 0f64;
    for (x, y) in ra.iter().zip(rb) {
        tail += *x as f64 * *y as f64;
    }
    ((s[0] + s[1]) + (s[2] + s[3])) + tail
}

/// Round to BF16 (nearest even) and back.
#[inline]
pub fn bf16(x: f32) -> f32 {
    half::bf16::from_f32(x).to_f32()
}

/// Max |x|, NaN if any element is NaN (as `torch.amax` propagates it).
pub fn amax(x: &[f32]) -> f32 {
    x.par_chunks(1 << 14)
        .map(|c| {
            c.iter().fold(0f32, |m, &v| {
                if m.is_nan() || v.is_nan() {
                    f32::NAN
                } else {
                    m.max(v.abs())
                }
            })
        })
        .reduce(
            || 0.0,
            |a, b| {
                if a.is_nan() || b.is_nan() {
                    f32::NAN
                } else {
                    a.max(b)
                }
            },
        )
}

/// The per-batch global scale `2688 / amax`; an amax of 0 gives 2688 (docs/moe-forward.md).
pub fn dynamic_gs(amax: f32) -> f32 {
    if amax == 0.0 {
        GS_DENOM
    } else {
        GS_DENOM / amax
    }
}

/// Where the rows of a weight `[n, k]` come from, decoded one row at a time so a layer never
/// needs a dense f32 copy of its experts.
pub(crate) enum Rows<'a> {
    /// `e2m1 · block scale` without the global scale (that goes into alpha): exact in f32.
    Fp4NoGlobal(&'a Fp4Tensor),
    /// `bf16(w)` of an f32 `[n, k]` (BF16 originals, shared experts).
    Bf16(&'a [f32]),
    /// `bf16(dequantize(w))`.
    Bf16Dequant(&'a Fp4Tensor),
}

impl Rows<'_> {
    fn row(&self, n: usize, k: usize, buf: &mut [f32]) {
        match self {
            Rows::Fp4NoGlobal(t) => decode_row(t, n, 1.0, buf),
            Rows::Bf16Dequant(t) => {
                decode_row(t, n, t.scale_2, buf);
                buf.iter_mut().for_each(|v| *v = bf16(*v));
            }
            Rows::Bf16(w) => {
                for (o, &v) in buf.iter_mut().zip(&w[n * k..(n + 1) * k]) {
                    *o = bf16(v);
                }
            }
        }
    }
}

fn decode_row(t: &Fp4Tensor, r: usize, scale_2: f32, out: &mut [f32]) {
    let (cols, block) = (t.cols, t.format.block());
    let kb = cols / block;
    crate::nvfp4::dequantize_row(
        t.format,
        &t.packed[r * cols / 2..(r + 1) * cols / 2],
        &t.scales[r * kb..(r + 1) * kb],
        scale_2,
        block,
        out,
    );
}

/// `out[r, n] = f32(Σ_k f64(a[r,k]) · f64(w[n,k]))`, `[m, n_out]`. Parallel over tiles of
/// weight rows: each weight row is decoded once and used for all `m` activation rows.
pub(crate) fn gemm(a: &[f32], m: usize, k: usize, w: &Rows, n_out: usize) -> Vec<f32> {
    const TILE: usize = 16;
    let tiles: Vec<Vec<f32>> = (0..n_out.div_ceil(TILE))
        .into_par_iter()
        .map_init(
            || vec![0f32; k],
            |buf, ti| {
                let n1 = ((ti + 1) * TILE).min(n_out);
                let mut out = Vec::with_capacity((n1 - ti * TILE) * m);
                for n in ti * TILE..n1 {
                    w.row(n, k, buf);
                    for r in 0..m {
                        out.push(dot(&a[r * k..(r + 1) * k], buf) as f32);
                    }
                }
                out
            },
        )
        .collect();
    let mut out = vec![0f32; m * n_out];
    for (ti, tile) in tiles.iter().enumerate() {
        for (j, col) in tile.chunks(m.max(1)).enumerate() {
            let n = ti * TILE + j;
            for (r, &v) in col.iter().enumerate() {
                out[r * n_out + n] = v;
            }
        }
    }
    out
}

/// NaN-propagating `min(v, hi)` and clamp (torch.clamp semantics).
#[inline]
fn min_nan(v: f32, hi: f32) -> f32 {
    if v > hi {
        hi
    } else {
        v
    }
}

#[inline]
fn clamp_nan(v: f32, lo: f32, hi: f32) -> f32 {
    if v > hi {
        hi
    } else if v < lo {
        lo
    } else {
        v
    }
}

/// `silu(g) · u` in f32, with V4's `swiglu_limit`: gate clamped to ≤ L, up to ±L.
#[inline]
pub fn swiglu(g: f32, u: f32, limit: Option<f32>) -> f32 {
    swiglu_clamped(g, u, SwigluClamp::both(limit))
}

/// The SwiGLU clamps side by side: the gate's to `<= gate`, up's to `±up`. A model has both at
/// its `swiglu_limit` or neither; one side alone is an engine bug the byok diagnosis recomputes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SwigluClamp {
    pub gate: Option<f32>,
    pub up: Option<f32>,
}

impl SwigluClamp {
    pub fn both(limit: Option<f32>) -> Self {
        SwigluClamp {
            gate: limit,
            up: limit,
        }
    }
}

/// `silu(g) · u` in f32 with each side's clamp of `c`.
#[inline]
fn swiglu_clamped(g: f32, u: f32, c: SwigluClamp) -> f32 {
    let g = c.gate.map_or(g, |l| min_nan(g, l));
    let u = c.up.map_or(u, |l| clamp_nan(u, -l, l));
    (g / (1.0 + (-g).exp())) * u
}

/// The reference SwiGLU input of the down projection, `bf16(silu(x·W1) ⊙ (x·W3))`, for
/// `x` `[m, h]` and BF16 weights `[i, h]`. Used for calibration before experts are quantized.
pub fn swiglu_reference(
    x: &[f32],
    m: usize,
    h: usize,
    i: usize,
    w1: &[f32],
    w3: &[f32],
    limit: Option<f32>,
) -> Vec<f32> {
    let g = gemm(x, m, h, &Rows::Bf16(w1), i);
    let u = gemm(x, m, h, &Rows::Bf16(w3), i);
    g.iter()
        .zip(&u)
        .map(|(&g, &u)| bf16(swiglu(g, u, limit)))
        .collect()
}

/// A BF16 MLP (shared experts or a dense layer) on `x` `[tokens, h]`: `acc(bf16(silu(x·W1) ⊙
/// x·W3) · W2)`. Both paths use it unchanged.
pub fn dense_forward(
    mlp: &DenseMlp,
    x: &[f32],
    tokens: usize,
    h: usize,
    limit: Option<f32>,
) -> Vec<f32> {
    let i = mlp.intermediate;
    let g = gemm(x, tokens, h, &Rows::Bf16(&mlp.w1), i);
    let u = gemm(x, tokens, h, &Rows::Bf16(&mlp.w3), i);
    let a: Vec<f32> = g
        .iter()
        .zip(&u)
        .map(|(&g, &u)| bf16(swiglu(g, u, limit)))
        .collect();
    gemm(&a, tokens, i, &Rows::Bf16(&mlp.w2), h)
}

/// Activation quantization of `[m, k]` rows: returns `e2m1 · block scale` (no global scale)
/// and the block statistics.
fn quantize_act(x: &[f32], m: usize, k: usize, gs: f32) -> (Vec<f32>, BlockStats) {
    let (mut q, st) = quantize_nvfp4(x, m, k, gs);
    q.scale_2 = 1.0;
    (q.dequantize(), st)
}

fn add_stats(a: &mut BlockStats, b: &BlockStats) {
    a.blocks += b.blocks;
    a.saturated += b.saturated;
    a.flushed += b.flushed;
    a.nan_scales += b.nan_scales;
}

/// Shapes and the clamp every expert of a layer shares.
#[derive(Clone, Copy)]
struct Dims {
    h: usize,
    i: usize,
    clamp: SwigluClamp,
}

/// One routed expert, NVFP4 path, on its gathered rows `x` `[m, h]`. `gs2 = None` is the
/// per-batch dynamic scale. Returns `y` `[m, h]`, each value rounded to BF16 as the engines'
/// down GEMMs write it (vLLM, FlashInfer and TRT-LLM keep it so until their weighted sum).
fn expert_nvfp4(
    ex: &Expert,
    x: &[f32],
    m: usize,
    d: Dims,
    gs1: f32,
    gs2: Option<f32>,
) -> (Vec<f32>, BlockStats) {
    let Dims { h, i, clamp } = d;
    let (xd, mut stats) = quantize_act(x, m, h, gs1);
    let alpha_g = rcp(gs1) * ex.w1.weight_scale_2();
    let alpha_u = rcp(gs1) * ex.w3.weight_scale_2();
    let g = gemm(&xd, m, h, &Rows::Fp4NoGlobal(&ex.w1.weight), i);
    let u = gemm(&xd, m, h, &Rows::Fp4NoGlobal(&ex.w3.weight), i);
    let a: Vec<f32> = g
        .iter()
        .zip(&u)
        .map(|(&g, &u)| swiglu_clamped(g * alpha_g, u * alpha_u, clamp))
        .collect();
    let gs2 = gs2.unwrap_or_else(|| dynamic_gs(amax(&a)));
    let (ad, st2) = quantize_act(&a, m, i, gs2);
    add_stats(&mut stats, &st2);
    let alpha_d = rcp(gs2) * ex.w2.weight_scale_2();
    let mut y = gemm(&ad, m, i, &Rows::Fp4NoGlobal(&ex.w2.weight), h);
    y.iter_mut().for_each(|v| *v = bf16(*v * alpha_d));
    (y, stats)
}

fn reference_rows(q: &super::QLinear) -> Rows<'_> {
    match &q.original {
        Some(o) => Rows::Bf16(o),
        None => Rows::Bf16Dequant(&q.weight),
    }
}

/// The reference SwiGLU output of one expert on `x` `[m, h]` (before the down projection).
fn expert_reference_act(
    ex: &Expert,
    x: &[f32],
    m: usize,
    h: usize,
    i: usize,
    limit: Option<f32>,
) -> Vec<f32> {
    let g = gemm(x, m, h, &reference_rows(&ex.w1), i);
    let u = gemm(x, m, h, &reference_rows(&ex.w3), i);
    g.iter()
        .zip(&u)
        .map(|(&g, &u)| bf16(swiglu(g, u, limit)))
        .collect()
}

/// Slots `t*K + slot` grouped by expert.
fn slots_by_expert(routing: &Routing, e: usize) -> Vec<Vec<usize>> {
    let mut g = vec![vec![]; e];
    for (s, &id) in routing.topk_ids.iter().enumerate() {
        g[id as usize].push(s);
    }
    g
}

/// Does this routing fit the layer and the batch (shape, global expert ids in range)?
pub fn check_routing(layer: &MoeLayer, routing: &Routing, tokens: usize) -> Result<()> {
    let e = layer.config.n_routed_experts;
    let l = layer.index;
    if routing.tokens != tokens
        || routing.top_k == 0
        || routing.topk_ids.len() != tokens * routing.top_k
        || routing.topk_weights.len() != tokens * routing.top_k
    {
        return Err(Error::usage(format!(
            "MoE layer {l}: routing for {} tokens x top-{} ({} ids, {} weights) does not fit {tokens} tokens",
            routing.tokens,
            routing.top_k,
            routing.topk_ids.len(),
            routing.topk_weights.len()
        )));
    }
    if let Some((s, &id)) = routing
        .topk_ids
        .iter()
        .enumerate()
        .find(|(_, &id)| id < 0 || id as usize >= e)
    {
        return Err(Error::usage(format!(
            "MoE layer {l}: topk_ids[{}, {}] = {id} is not a global expert id (n_routed_experts = {e})",
            s / routing.top_k,
            s % routing.top_k
        )));
    }
    Ok(())
}

/// The MoE block on `hidden` `[tokens, hidden_size]` (BF16-exact values) with a given routing.
pub fn moe_forward(
    layer: &MoeLayer,
    hidden: &[f32],
    routing: &Routing,
    path: &Path,
    per_slot: bool,
) -> Result<MoeOutput> {
    let clamp = SwigluClamp::both(layer.config.swiglu_limit);
    moe_forward_clamped(layer, hidden, routing, path, per_slot, clamp)
}

/// [`moe_forward`] with the routed experts' NVFP4 SwiGLU clamped per side by `clamp` in place
/// of the layer's `swiglu_limit` (the reference path and the shared experts keep it).
pub fn moe_forward_clamped(
    layer: &MoeLayer,
    hidden: &[f32],
    routing: &Routing,
    path: &Path,
    per_slot: bool,
    clamp: SwigluClamp,
) -> Result<MoeOutput> {
    layer.validate()?;
    let c = &layer.config;
    let (h, i, e) = (c.hidden_size, c.moe_intermediate_size, c.n_routed_experts);
    let tokens = token_count(hidden, h, layer.index)?;
    check_routing(layer, routing, tokens)?;
    let k = routing.top_k;
    let limit = c.swiglu_limit;

    // (gs1, gs2) per expert for the NVFP4 path; None for the reference.
    let scales: Option<(Vec<f32>, Option<Vec<f32>>)> = match path {
        Path::Reference => None,
        Path::Nvfp4 { scales, flavor } => {
            if *flavor != Flavor::Reference {
                return Err(Error::usage(
                    "the cuda-fast flavor (rcp.approx.ftz) exists on the GPU only; use --device cuda",
                ));
            }
            Some(match scales {
                ActScales::Fixed { gs1, gs2 } => {
                    if gs1.len() != e || gs2.len() != e {
                        return Err(Error::usage(format!(
                            "MoE layer {}: {} gs1 and {} gs2 values for {e} experts",
                            layer.index,
                            gs1.len(),
                            gs2.len()
                        )));
                    }
                    (gs1.clone(), Some(gs2.clone()))
                }
                ActScales::Dynamic => (vec![dynamic_gs(amax(hidden)); e], None),
            })
        }
    };

    let groups = slots_by_expert(routing, e);
    let results: Vec<(usize, Vec<f32>, BlockStats)> = groups
        .par_iter()
        .enumerate()
        .filter(|(_, s)| !s.is_empty())
        .map(|(x, slots)| {
            let m = slots.len();
            let mut xe = Vec::with_capacity(m * h);
            for &s in slots {
                let t = s / k;
                xe.extend_from_slice(&hidden[t * h..(t + 1) * h]);
            }
            let ex = &layer.experts[x];
            match &scales {
                Some((gs1, gs2)) => {
                    let d = Dims { h, i, clamp };
                    let (y, st) = expert_nvfp4(ex, &xe, m, d, gs1[x], gs2.as_ref().map(|g| g[x]));
                    (x, y, st)
                }
                None => {
                    let a = expert_reference_act(ex, &xe, m, h, i, limit);
                    let y = gemm(&a, m, i, &reference_rows(&ex.w2), h);
                    (x, y, BlockStats::default())
                }
            }
        })
        .collect();

    let mut slot_out = vec![0f32; tokens * k * h];
    let mut act_stats = BlockStats::default();
    for (x, y, st) in &results {
        add_stats(&mut act_stats, st);
        for (j, &s) in groups[*x].iter().enumerate() {
            slot_out[s * h..(s + 1) * h].copy_from_slice(&y[j * h..(j + 1) * h]);
        }
    }

    let shared = layer
        .shared
        .as_ref()
        .map(|m| dense_forward(m, hidden, tokens, h, limit));
    let mut out = vec![0f32; tokens * h];
    out.par_chunks_mut(h).enumerate().for_each(|(t, o)| {
        for slot in 0..k {
            let s = t * k + slot;
            let w = routing.topk_weights[s];
            for (ov, &y) in o.iter_mut().zip(&slot_out[s * h..(s + 1) * h]) {
                *ov += w * y;
            }
        }
        if let Some(sh) = &shared {
            for (ov, &v) in o.iter_mut().zip(&sh[t * h..(t + 1) * h]) {
                *ov += v;
            }
        }
    });
    Ok(MoeOutput {
        out,
        act_stats,
        per_slot: per_slot.then_some(slot_out),
    })
}

/// One amax per expert; `None` for an expert no token reached.
pub type ExpertAmax = Vec<Option<f32>>;

/// [`expert_input_amax`] of one batch and its routing, run once however many ask: the
/// calibrated gs and the findings on the checkpoint's input scales read the same pass (on
/// DeepSeek-V3 dims a CPU gate/up over every slot).
pub struct BatchAmax<'a> {
    layer: &'a MoeLayer,
    hidden: &'a [f32],
    routing: &'a Routing,
    pass: std::sync::OnceLock<(ExpertAmax, ExpertAmax)>,
}

impl<'a> BatchAmax<'a> {
    pub fn new(layer: &'a MoeLayer, hidden: &'a [f32], routing: &'a Routing) -> Self {
        BatchAmax {
            layer,
            hidden,
            routing,
            pass: std::sync::OnceLock::new(),
        }
    }

    /// The batch the pass reads.
    pub fn hidden(&self) -> &'a [f32] {
        self.hidden
    }

    /// Its routing.
    pub fn routing(&self) -> &'a Routing {
        self.routing
    }

    /// The amax before W1/W3 and before W2, per expert.
    pub fn get(&self) -> Result<&(ExpertAmax, ExpertAmax)> {
        if let Some(m) = self.pass.get() {
            return Ok(m);
        }
        let m = expert_input_amax(self.layer, self.hidden, self.routing)?;
        Ok(self.pass.get_or_init(|| m))
    }
}

/// Per expert, the amax of what each NVFP4 GEMM would see, measured on the reference path:
/// the gathered inputs (before W1/W3) and the SwiGLU output (before W2). `None` for an expert
/// no token was routed to. NaN propagates.
pub fn expert_input_amax(
    layer: &MoeLayer,
    hidden: &[f32],
    routing: &Routing,
) -> Result<(ExpertAmax, ExpertAmax)> {
    layer.validate()?;
    let c = &layer.config;
    let (h, i, e) = (c.hidden_size, c.moe_intermediate_size, c.n_routed_experts);
    let tokens = token_count(hidden, h, layer.index)?;
    check_routing(layer, routing, tokens)?;
    let k = routing.top_k;
    let groups = slots_by_expert(routing, e);
    let r: Vec<(Option<f32>, Option<f32>)> = groups
        .par_iter()
        .enumerate()
        .map(|(x, slots)| {
            if slots.is_empty() {
                return (None, None);
            }
            let m = slots.len();
            let mut xe = Vec::with_capacity(m * h);
            for &s in slots {
                xe.extend_from_slice(&hidden[(s / k) * h..(s / k + 1) * h]);
            }
            let a = expert_reference_act(&layer.experts[x], &xe, m, h, i, c.swiglu_limit);
            (Some(amax(&xe)), Some(amax(&a)))
        })
        .collect();
    Ok(r.into_iter().unzip())
}

/// `bf16(rmsnorm(h) · weight)`, `rmsnorm(h) = h / sqrt(mean(h²) + eps)` in f32 (the mean
/// accumulated in f64); unit weight when `weight` is `None`.
pub fn rmsnorm_bf16(h: &[f32], hidden: usize, weight: Option<&[f32]>, eps: f32) -> Vec<f32> {
    let mut out = vec![0f32; h.len()];
    out.par_chunks_mut(hidden)
        .zip(h.par_chunks(hidden))
        .for_each(|(o, x)| {
            let ms = (x.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / hidden as f64) as f32;
            let d = (ms + eps).sqrt();
            for (j, (ov, &v)) in o.iter_mut().zip(x).enumerate() {
                let w = weight.map_or(1.0, |w| w[j]);
                *ov = bf16((v / d) * w);
            }
        });
    out
}

#[cfg(test)]
#[allow(clippy::needless_range_loop)] // the naive forward indexes on purpose
mod tests {
    use super::*;
    use crate::moe::synthetic::test_layer;
    use crate::moe::{router, ScoringFunc};
    use crate::nvfp4::{e2m1, e4m3};
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    // ---- a naive implementation, straight from DESIGN.md §2 and docs/moe-forward.md ----

    /// Nearest E4M3 value by search over all finite codes (ties: even mantissa), saturating.
    fn naive_e4m3(v: f32) -> f32 {
        if v.is_nan() {
            return f32::NAN;
        }
        let mut best = (f32::INFINITY, 0f32, 0u8);
        for c in 0u8..0x7F {
            let d = e4m3::decode(c);
            let err = (d - v.abs()).abs();
            if err < best.0 || (err == best.0 && c % 2 == 0) {
                best = (err, d, c);
            }
        }
        if v.abs() >= 448.0 {
            448f32.copysign(v)
        } else {
            best.1.copysign(v)
        }
    }

    fn naive_e2m1(v: f32) -> f32 {
        let vals = [0.0f32, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
        let a = v.abs().min(6.0);
        let mut best = 0usize;
        for j in 1..8 {
            let (dj, db) = ((vals[j] - a).abs(), (vals[best] - a).abs());
            if dj < db || (dj == db && j % 2 == 0) {
                best = j;
            }
        }
        vals[best]
    }

    /// `e2m1 · s` values of x quantized with gs (the global scale left out).
    fn naive_quant(x: &[f32], gs: f32) -> Vec<f32> {
        let mut out = vec![];
        for b in x.chunks(16) {
            let vmax = b.iter().fold(0f32, |m, v| m.max(v.abs()));
            let s = naive_e4m3((gs * (vmax * (1.0f32 / 6.0))).min(448.0));
            let inv_gs = if gs == 0.0 { 0.0 } else { 1.0 / gs };
            let p = s * inv_gs;
            let os = if p == 0.0 { 0.0 } else { 1.0 / p };
            for &v in b {
                let q = naive_e2m1((v * os).clamp(-6.0, 6.0));
                out.push(q.copysign(v) * s);
            }
        }
        out
    }

    fn naive_w(t: &Fp4Tensor) -> Vec<f32> {
        let mut out = vec![];
        for r in 0..t.rows {
            for c in 0..t.cols {
                out.push(
                    e2m1::decode(t.code(r, c)) * e4m3::decode(t.scales[r * t.cols / 16 + c / 16]),
                );
            }
        }
        out
    }

    fn naive_mm(x: &[f32], w: &[f32], k: usize) -> Vec<f32> {
        let n = w.len() / k;
        (0..n)
            .map(|j| {
                let mut s = 0f64;
                for q in 0..k {
                    s += x[q] as f64 * w[j * k + q] as f64;
                }
                s as f32
            })
            .collect()
    }

    fn naive_swiglu(g: f32, u: f32, limit: Option<f32>) -> f32 {
        let (mut g, mut u) = (g, u);
        if let Some(l) = limit {
            g = g.min(l);
            u = u.clamp(-l, l);
        }
        (g / (1.0 + (-g).exp())) * u
    }

    /// The BF16 SwiGLU MLP of one token, weights `[w1 (gate), w3 (up), w2 (down)]`.
    fn naive_bf16_mlp(
        xt: &[f32],
        [w1, w3, w2]: [&[f32]; 3],
        inter: usize,
        c: &crate::moe::MoeConfig,
    ) -> Vec<f32> {
        let h = c.hidden_size;
        let g = naive_mm(xt, w1, h);
        let u = naive_mm(xt, w3, h);
        let a: Vec<f32> = g
            .iter()
            .zip(&u)
            .map(|(&g, &u)| bf16(naive_swiglu(g, u, c.swiglu_limit)))
            .collect();
        naive_mm(&a, w2, inter)
    }

    fn naive_forward(
        layer: &MoeLayer,
        x: &[f32],
        r: &Routing,
        gs: Option<(&[f32], &[f32])>,
    ) -> Vec<f32> {
        let c = &layer.config;
        let (h, k) = (c.hidden_size, r.top_k);
        let mut out = vec![];
        for t in 0..r.tokens {
            let xt = &x[t * h..(t + 1) * h];
            let mut acc = vec![0f32; h];
            for slot in 0..k {
                let e = r.topk_ids[t * k + slot] as usize;
                let ex = &layer.experts[e];
                let y: Vec<f32> = match gs {
                    Some((gs1, gs2)) => {
                        let xq = naive_quant(xt, gs1[e]);
                        let g = naive_mm(&xq, &naive_w(&ex.w1.weight), h);
                        let u = naive_mm(&xq, &naive_w(&ex.w3.weight), h);
                        let ag = (1.0 / gs1[e]) * ex.w1.weight.scale_2;
                        let au = (1.0 / gs1[e]) * ex.w3.weight.scale_2;
                        let a: Vec<f32> = g
                            .iter()
                            .zip(&u)
                            .map(|(g, u)| naive_swiglu(g * ag, u * au, c.swiglu_limit))
                            .collect();
                        let aq = naive_quant(&a, gs2[e]);
                        let y = naive_mm(&aq, &naive_w(&ex.w2.weight), c.moe_intermediate_size);
                        let ad = (1.0 / gs2[e]) * ex.w2.weight.scale_2;
                        y.iter().map(|v| bf16(v * ad)).collect()
                    }
                    None => {
                        let w = |q: &crate::moe::QLinear| {
                            q.original
                                .clone()
                                .unwrap()
                                .iter()
                                .map(|&v| bf16(v))
                                .collect::<Vec<_>>()
                        };
                        let inter = c.moe_intermediate_size;
                        naive_bf16_mlp(xt, [&w(&ex.w1), &w(&ex.w3), &w(&ex.w2)], inter, c)
                    }
                };
                let w = r.topk_weights[t * k + slot];
                for j in 0..h {
                    acc[j] += w * y[j];
                }
            }
            if let Some(sh) = &layer.shared {
                // The NVFP4 path's check takes the shared expert from dense_forward, which both
                // paths run unchanged: the BF16 MLP's f64 sums are exact only while no product
                // lies 37+ binades below the largest, and a SwiGLU output of a very negative
                // gate (~1e-33) breaks that, so the summation order can show in the last f32
                // bit (seed 167203527568847304: out[19] one ulp apart). The reference path's
                // check below runs the naive MLP, within an order tolerance.
                let y = match gs {
                    Some(_) => dense_forward(sh, xt, 1, h, c.swiglu_limit),
                    None => naive_bf16_mlp(xt, [&sh.w1, &sh.w3, &sh.w2], sh.intermediate, c),
                };
                for j in 0..h {
                    acc[j] += y[j];
                }
            }
            out.extend(acc);
        }
        out
    }

    fn random_input(rng: &mut ChaCha8Rng, t: usize, h: usize, scale: f32) -> Vec<f32> {
        (0..t * h)
            .map(|j| {
                let v: f32 = rng.sample(rand_distr::StandardNormal);
                // a couple of outlier channels
                let m = if j % h == 3 || j % h == 17 { 12.0 } else { 1.0 };
                bf16(v * m * scale)
            })
            .collect()
    }

    fn case(seed: u64, limit: Option<f32>) -> (MoeLayer, Vec<f32>, Routing) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let func = [
            ScoringFunc::Sigmoid,
            ScoringFunc::Softmax,
            ScoringFunc::Sqrtsoftplus,
        ][rng.gen_range(0..3)];
        let mut layer = test_layer(&mut rng, 64, 32, 8, 3, func);
        layer.config.swiglu_limit = limit;
        let t = rng.gen_range(2..12);
        let x = random_input(&mut rng, t, 64, 2.0);
        let r = router::route(&layer, &x, None).unwrap();
        (layer, x, r)
    }

    #[test]
    fn nvfp4_path_is_bit_exact_against_a_naive_implementation() {
        // the seed that once showed the shared expert's summation order, then fresh ones
        let base: u64 = rand::random();
        for rep in 0..7 {
            let seed = if rep == 6 {
                167203527568847304
            } else {
                base.wrapping_add(rep)
            };
            let limit = if rep % 2 == 0 { None } else { Some(0.75) };
            let (layer, x, r) = case(seed, limit);
            let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 77);
            let gs1: Vec<f32> = (0..8).map(|_| rng.gen_range(20.0..3000.0)).collect();
            let gs2: Vec<f32> = (0..8).map(|_| rng.gen_range(20.0..3000.0)).collect();
            let scales = ActScales::Fixed {
                gs1: gs1.clone(),
                gs2: gs2.clone(),
            };
            let path = Path::Nvfp4 {
                scales: &scales,
                flavor: Flavor::Reference,
            };
            let got = moe_forward(&layer, &x, &r, &path, false).unwrap();
            let want = naive_forward(&layer, &x, &r, Some((&gs1, &gs2)));
            assert_eq!(got.out.len(), want.len());
            for (j, (a, b)) in got.out.iter().zip(&want).enumerate() {
                assert!(
                    a.to_bits() == b.to_bits(),
                    "seed {seed}: out[{j}] = {a} vs naive {b}"
                );
            }
            assert!(got.act_stats.blocks > 0);
        }
    }

    #[test]
    fn reference_path_matches_a_naive_implementation() {
        let base: u64 = rand::random();
        for rep in 0..6 {
            let seed = base.wrapping_add(rep);
            let limit = if rep % 2 == 0 { None } else { Some(0.75) };
            let (layer, x, r) = case(seed, limit);
            let got = moe_forward(&layer, &x, &r, &Path::Reference, true).unwrap();
            let want = naive_forward(&layer, &x, &r, None);
            // f64 sums of exact BF16 products: only the summation order differs
            for (j, (a, b)) in got.out.iter().zip(&want).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                    "seed {seed}: out[{j}] = {a} vs naive {b}"
                );
            }
            let ps = got.per_slot.unwrap();
            assert_eq!(ps.len(), r.tokens * r.top_k * 64);
        }
    }

    #[test]
    fn per_slot_rows_recombine_into_the_output() {
        let (layer, x, r) = case(rand::random(), None);
        let o = moe_forward(&layer, &x, &r, &Path::Reference, true).unwrap();
        let ps = o.per_slot.unwrap();
        let shared = dense_forward(layer.shared.as_ref().unwrap(), &x, r.tokens, 64, None);
        for t in 0..r.tokens {
            for j in 0..64 {
                let mut acc = 0f32;
                for s in 0..r.top_k {
                    acc += r.topk_weights[t * r.top_k + s] * ps[(t * r.top_k + s) * 64 + j];
                }
                acc += shared[t * 64 + j];
                assert_eq!(acc, o.out[t * 64 + j]);
            }
        }
    }

    #[test]
    fn swiglu_limit_clamps_gate_above_and_up_both_ways() {
        let s = |g: f32| g / (1.0 + (-g).exp());
        assert_eq!(swiglu(50.0, 3.0, Some(10.0)), s(10.0) * 3.0);
        assert_eq!(swiglu(-50.0, 3.0, Some(10.0)), s(-50.0) * 3.0);
        assert_eq!(swiglu(2.0, 30.0, Some(10.0)), s(2.0) * 10.0);
        assert_eq!(swiglu(2.0, -30.0, Some(10.0)), s(2.0) * -10.0);
        assert_eq!(swiglu(50.0, 30.0, None), s(50.0) * 30.0);
        assert!(swiglu(f32::NAN, 1.0, Some(10.0)).is_nan());
        // a clamp that is active changes the layer output
        let (mut layer, x, r) = case(rand::random(), None);
        let a = moe_forward(&layer, &x, &r, &Path::Reference, false).unwrap();
        layer.config.swiglu_limit = Some(0.05);
        let b = moe_forward(&layer, &x, &r, &Path::Reference, false).unwrap();
        assert_ne!(a.out, b.out);
    }

    #[test]
    fn dynamic_scales_follow_the_batch_amax() {
        let (layer, x, r) = case(rand::random(), None);
        let d = ActScales::Dynamic;
        let got = moe_forward(
            &layer,
            &x,
            &r,
            &Path::Nvfp4 {
                scales: &d,
                flavor: Flavor::Reference,
            },
            false,
        )
        .unwrap();
        // gs1 = 2688 / amax(h) for all: the max-magnitude input block hits exactly 448
        assert!(got.act_stats.saturated >= 1);
        assert_eq!(got.act_stats.nan_scales, 0);
        assert_eq!(dynamic_gs(0.0), 2688.0);
        assert!(got.out.iter().all(|v| v.is_finite()));
    }

    #[test]
    fn nvfp4_vs_reference_error_is_in_the_expected_range() {
        let (layer, x, r) = case(rand::random(), None);
        let (a1, a2) = expert_input_amax(&layer, &x, &r).unwrap();
        let gs1: Vec<f32> = a1
            .iter()
            .map(|a| a.map_or(2688.0, |a| 2688.0 / a))
            .collect();
        let gs2: Vec<f32> = a2
            .iter()
            .map(|a| a.map_or(2688.0, |a| 2688.0 / a))
            .collect();
        let sc = ActScales::Fixed { gs1, gs2 };
        let q = moe_forward(
            &layer,
            &x,
            &r,
            &Path::Nvfp4 {
                scales: &sc,
                flavor: Flavor::Reference,
            },
            false,
        )
        .unwrap();
        let f = moe_forward(&layer, &x, &r, &Path::Reference, false).unwrap();
        let m = crate::metrics::compare(&q.out, &f.out);
        assert!(m.rel_l2 > 0.01 && m.rel_l2 < 0.4, "rel_l2 {}", m.rel_l2);
    }

    #[test]
    fn bad_routing_is_an_error_not_a_panic() {
        let (layer, x, mut r) = case(rand::random(), None);
        r.topk_ids[0] = 99;
        assert!(moe_forward(&layer, &x, &r, &Path::Reference, false).is_err());
        r.topk_ids[0] = -1;
        assert!(moe_forward(&layer, &x, &r, &Path::Reference, false).is_err());
        r.topk_ids.pop();
        assert!(moe_forward(&layer, &x, &r, &Path::Reference, false).is_err());
        assert!(moe_forward(&layer, &x[1..], &r, &Path::Reference, false).is_err());
    }

    #[test]
    fn rmsnorm_normalizes_rows() {
        let h: Vec<f32> = (0..64).map(|i| (i as f32 - 20.0) * 0.7).collect();
        let x = rmsnorm_bf16(&h, 32, None, 1e-6);
        for row in x.chunks(32) {
            let ms: f32 = row.iter().map(|v| v * v).sum::<f32>() / 32.0;
            assert!((ms - 1.0).abs() < 0.02, "{ms}");
        }
        let w = vec![2.0f32; 32];
        let y = rmsnorm_bf16(&h, 32, Some(&w), 1e-6);
        for (a, b) in x.iter().zip(&y) {
            assert_eq!(bf16(a * 2.0), *b);
        }
    }
}
