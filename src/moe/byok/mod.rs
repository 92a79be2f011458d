//! "Bring your own kernel": judging the user's MoE kernel output (a `--kernel` plugin's, or a
//! tensor handed back to `compare-outputs`) against the BF16 reference and our own NVFP4 path,
//! and naming the engine bug it most likely has.
//!
//! A plugin computes the routed experts' weighted sum only (kernels/include/nvfp4dbg_moe.h);
//! the shared experts are BF16 and identical in every path, so whole-layer comparisons add our
//! shared-expert output to theirs, and the plugin-vs-ours comparison is routed-only, where
//! nothing dilutes a plugin bug.
//!
//! The diagnosis recomputes the routed output on the CPU under each known engine bug (gate/up
//! reversed, block scales read in the other layout, local/global expert ids confused under EP,
//! routing weights not applied or applied to the wrong slots of a token) and names the variant
//! the plugin's output matches (cosine ~1 where the correct path does not).

pub mod dump;

use super::ep::{ExpertMap, Placement};
use super::forward::SwigluClamp;
use super::parallel::{plan_rank, EpFault};
use super::{ActScales, MoeConfig, MoeLayer, Path, Routing};
use crate::error::Result;
use crate::metrics::{compare, max_rel_l2, Metrics};
use crate::nvfp4::layout::{swizzle_offset, ScaleLayout};
use crate::nvfp4::{rcp, Flavor, Fp4Tensor};
use serde::Serialize;

/// A correct kernel against our NVFP4 path: the same function up to FP32 summation order
/// (layertest's kernel check demands the same of the built-in kernels).
pub const AGREE_MIN_COSINE: f64 = 0.99999;
/// A bug variant "explains" the plugin's output at this cosine or above (a plugin with that
/// bug computes that variant up to summation order, so it lands near `AGREE_MIN_COSINE`).
pub const EXPLAINS_MIN_COSINE: f64 = 0.9999;
/// The CPU re-runs the NVFP4 path (layertest's kernel check, the bug variants, a dump's
/// recompute) only below this many multiply-adds ([`routed_macs`]).
pub const KERNEL_CHECK_MAX_MACS: f64 = 4e9;

/// Multiply-adds of one CPU run of the routed experts: `tokens · top_k · 3 · hidden ·
/// moe_intermediate` (w1, w3 and w2 for every slot).
pub fn routed_macs(config: &MoeConfig, routing: &Routing) -> f64 {
    routing.tokens as f64
        * routing.top_k as f64
        * 3.0
        * config.hidden_size as f64
        * config.moe_intermediate_size as f64
}

/// `m` within cosine `c` and within the relative L2 error noise reaches at that cosine
/// ([`max_rel_l2`]): an output "equal up to summation order" but off by a factor (alpha, a
/// global scale applied twice) fails.
fn same_up_to_noise(m: &Metrics, c: f64) -> bool {
    m.passes(c) && m.rel_l2 <= max_rel_l2(c)
}

/// `theirs` is `ours` up to summation order where `ours` is finite, and NaN/Inf exactly where
/// `ours` is (the same Inf): a correct kernel on inputs that make ours non-finite (a NaN block
/// scale) agrees with it, though no cosine of the two is defined.
fn agrees_with_same_nonfinite(theirs: &[f32], ours: &[f32]) -> bool {
    let same_nonfinite = |t: f32, u: f32| {
        t.is_finite() == u.is_finite()
            && (t.is_finite() || t.is_nan() == u.is_nan() && (t.is_nan() || t == u))
    };
    if ours.iter().all(|v| v.is_finite())
        || !theirs.iter().zip(ours).all(|(&t, &u)| same_nonfinite(t, u))
    {
        return false;
    }
    let (t, u): (Vec<f32>, Vec<f32>) = theirs
        .iter()
        .zip(ours)
        .filter(|(t, _)| t.is_finite())
        .map(|(&t, &u)| (t, u))
        .unzip();
    t.is_empty() || same_up_to_noise(&compare(&t, &u), AGREE_MIN_COSINE)
}

/// A known engine bug the diagnosis recomputes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum SuspectedBug {
    /// Gate (w1) and up (w3) exchanged: a fused w13 read as w31.
    GateUpSwapped,
    /// 128x4-swizzled block scales read as linear.
    SwizzledScalesReadLinear,
    /// Linear block scales read as 128x4-swizzled.
    LinearScalesReadSwizzled,
    /// Linear block scales `[N, K/16]` read as `[K/16, N]`: scale `(n, k)` taken from flat
    /// `k · N + n`.
    ScalesReadTransposed,
    /// Handed local ids, applies `expert_map` again (EP): tokens silently dropped.
    LocalIdsReadAsGlobal,
    /// Handed global ids, indexes the local expert table with them (EP).
    GlobalIdsReadAsLocal,
    /// `Σ_e y_e`: the routing weights never multiplied in.
    WeightsNotApplied,
    /// `Σ_e w_e² · y_e`: the routing weights multiplied in twice (by the kernel's finalize
    /// and once more by the engine's own weighted combine).
    WeightsAppliedTwice,
    /// The shared experts added to the routed output (the contract is routed-only).
    SharedExpertsIncluded,
    /// The shared experts added twice to the routed output (once by the kernel, once more by
    /// the engine's own shared-expert add that the kernel was meant to leave to it).
    SharedExpertsAddedTwice,
    /// Each token's weights one slot late: slot j+1 weighted with slot j's weight (cyclic).
    WeightsShiftedForward,
    /// Each token's weights one slot early: slot j weighted with slot j+1's weight (cyclic).
    WeightsShiftedBackward,
    /// `topk_ids` sorted by expert id, `topk_weights` left in router order.
    IdsSortedWeightsNot,
    /// `topk_weights` sorted largest first, `topk_ids` left in router order.
    WeightsSortedIdsNot,
    /// The output written column-major: `[hidden, tokens]` where `[tokens, hidden]` is due.
    OutputTransposed,
    /// The activation global scales taken in the dequant direction: `1/a1_gscale`,
    /// `1/a2_gscale` quantize (a checkpoint `input_scale` handed where `gs` is due).
    GlobalScalesInverted,
    /// The epilogue's alpha built from `gs` instead of `1/gs` (`a1_gscale · weight_scale_2`
    /// where `input_scale · weight_scale_2` is due); the quantization itself right.
    AlphaUsesGs,
    /// The handed activation global scales ignored: every GEMM input quantized with the
    /// engine default gs 2688 (an `input_scale` of 1/2688, amax assumed 1).
    DefaultGsUsed,
    /// The E2M1 codes of the weights read high nibble first (element `2i` is the low one).
    NibblesSwapped,
    /// The up projection scaled with the gate's `weight_scale_2` (vLLM's `w13_weight_scale_2`
    /// keeps one of the two): differs only where an expert's w1 and w3 global scales differ.
    UpUsesGateScale2,
    /// V4's `swiglu_limit` not applied: gate and up enter silu(g) · u unclamped.
    SwigluLimitIgnored,
    /// Only the gate clamped at `swiglu_limit`: up enters silu(g) · u unclamped.
    SwigluGateClampOnly,
    /// Only up clamped at `±swiglu_limit`: the gate enters silu(g) · u unclamped.
    SwigluUpClampOnly,
    /// A model without `swiglu_limit` clamped as gpt-oss (7) or DeepSeek-V4 (10) are.
    SwigluClampWithoutLimit,
    /// gs1 used before the down projection and gs2 before gate/up.
    GsSwapped,
    /// Activations left in BF16: a weight-only (W4A16) kernel, as Marlin's NVFP4 MoE on Hopper.
    ActivationsNotQuantized,
}

impl SuspectedBug {
    pub fn describe(self) -> &'static str {
        match self {
            SuspectedBug::GateUpSwapped => {
                "gate_proj (w1) and up_proj (w3) reversed: silu applied to the up projection (a fused w13 read as w31)"
            }
            SuspectedBug::SwizzledScalesReadLinear => {
                "block scales handed in the 128x4 swizzled layout are read as linear [N, K/16]"
            }
            SuspectedBug::LinearScalesReadSwizzled => {
                "block scales handed linear [N, K/16] are read as 128x4 swizzled"
            }
            SuspectedBug::ScalesReadTransposed => {
                "block scales handed linear [N, K/16] are read transposed, as [K/16, N]: the scale of row n, block k is taken from flat k * N + n where n * K/16 + k is due (a column-major scale load, or the scale tensor's dims swapped)"
            }
            SuspectedBug::LocalIdsReadAsGlobal => {
                "local expert ids read as global: expert_map applied to ids that were already local (tokens of other experts silently dropped)"
            }
            SuspectedBug::GlobalIdsReadAsLocal => {
                "global expert ids used as local indices: expert_map never applied (wrong or missing experts)"
            }
            SuspectedBug::WeightsNotApplied => {
                "routing weights not applied: the experts' outputs are summed unweighted"
            }
            SuspectedBug::WeightsAppliedTwice => {
                "routing weights applied twice: each expert's output is weighted with its routing weight squared (the kernel's finalize and the engine's combine both multiply topk_weights in)"
            }
            SuspectedBug::SharedExpertsIncluded => {
                "the shared experts are added to the routed output (the output must be the routed experts' sum only; the shared experts are added once more by the comparison)"
            }
            SuspectedBug::SharedExpertsAddedTwice => {
                "the shared experts are added twice to the routed output (the output must be the routed experts' sum only; with the comparison's own add the layer holds the shared experts three times)"
            }
            SuspectedBug::WeightsShiftedForward => {
                "routing weights applied to the wrong slots: each token's slot j+1 is weighted with slot j's weight (the last slot's wraps to slot 0) - an off-by-one in the topk_weights index"
            }
            SuspectedBug::WeightsShiftedBackward => {
                "routing weights applied to the wrong slots: each token's slot j is weighted with slot j+1's weight (slot 0's wraps to the last slot) - an off-by-one in the topk_weights index"
            }
            SuspectedBug::IdsSortedWeightsNot => {
                "routing weights applied to the wrong slots: topk_ids were sorted by expert id but topk_weights were left in router order, so each weight lands on another of the token's experts (permute both with the same indices)"
            }
            SuspectedBug::WeightsSortedIdsNot => {
                "routing weights applied to the wrong slots: topk_weights were sorted largest first but topk_ids were left in router order, so each weight lands on another of the token's experts (permute both with the same indices)"
            }
            SuspectedBug::OutputTransposed => {
                "the output is written transposed: [hidden, tokens] (token t, channel c at c * tokens + t) where [tokens, hidden] row-major (t * hidden + c) is due - a column-major store or a flat buffer indexed the other way"
            }
            SuspectedBug::GlobalScalesInverted => {
                "the activation global scales are used in the other direction: the kernel quantizes with 1/a1_gscale and 1/a2_gscale - a1_gscale/a2_gscale are gs = 1/input_scale (quant direction), so an input_scale (dequant direction, amax/2688) was handed or taken where gs is due"
            }
            SuspectedBug::AlphaUsesGs => {
                "the GEMM epilogue's alpha uses the activation gs instead of 1/gs: alpha = a1_gscale * weight_scale_2 where input_scale * weight_scale_2 = weight_scale_2 / a1_gscale is due (a2_gscale likewise for w2); the activations themselves are quantized right"
            }
            SuspectedBug::DefaultGsUsed => {
                "a1_gscale/a2_gscale are ignored: every GEMM input is quantized with the engine default gs 2688 (input_scale 1/2688, i.e. amax assumed 1), so blocks of larger activations saturate at 448"
            }
            SuspectedBug::NibblesSwapped => {
                "the packed E2M1 weights are read with the nibbles reversed: element 2i is the low nibble of byte i and 2i+1 the high one, the kernel takes them the other way round"
            }
            SuspectedBug::UpUsesGateScale2 => {
                "the up projection (w3) is scaled with the gate's (w1) weight_scale_2: a fused w13 keeps one global scale per expert (vLLM's w13_weight_scale_2 keeps only the gate's) while this checkpoint's w1 and w3 scales differ - requantize w1/w3 with a shared global scale, or apply each its own"
            }
            SuspectedBug::GsSwapped => {
                "the two activation global scales are swapped: a2_gscale (gs2) quantizes the gate/up input and a1_gscale (gs1) the down projection's input"
            }
            SuspectedBug::ActivationsNotQuantized => {
                "the activations are never quantized to NVFP4: BF16 inputs times the dequantized NVFP4 weights, a weight-only (W4A16) kernel such as Marlin's NVFP4 MoE on Hopper. Expected of such a kernel, a bug in a W4A4 one (Blackwell's block-scaled MMA); a weight-only kernel is judged by its layer cosine against the BF16 reference, not by agreement with the W4A4 path"
            }
            SuspectedBug::SwigluGateClampOnly => {
                "swiglu_limit is applied to the gate only: the gate (w1) output is clamped to <= L but the up (w3) output is not clamped to [-L, L] before silu(gate) * up"
            }
            SuspectedBug::SwigluUpClampOnly => {
                "swiglu_limit is applied to up only: the up (w3) output is clamped to [-L, L] but the gate (w1) output is not clamped to <= L before silu(gate) * up"
            }
            SuspectedBug::SwigluClampWithoutLimit => {
                "the SwiGLU is clamped though the model has no swiglu_limit: gate clamped to <= L and up to [-L, L] at a limit of another model (gpt-oss's 7 or DeepSeek-V4's 10): the kernel's clamp must be off (has_swiglu_limit = 0)"
            }
            SuspectedBug::SwigluLimitIgnored => {
                "swiglu_limit is ignored: the gate (w1) output must be clamped to <= L and the up (w3) output to [-L, L] before silu(gate) * up (DeepSeek-V4's swiglu_limit in config.json)"
            }
        }
    }
}

/// How the plugin was fed: what the variants must reproduce.
#[derive(Clone, Copy, Debug)]
pub struct Feeding {
    /// The block-scale layout handed to it (`None`: unknown, try both misreadings).
    pub layout: Option<ScaleLayout>,
    /// `(ranks, placement)` when it ran as EP ranks.
    pub ep: Option<(usize, Placement)>,
}

/// `out[t] = Σ_slot w · y` in f32, in slot order: the routed part of the forward's combine,
/// bit for bit (docs/moe-forward.md, Combine).
pub fn routed_sum(per_slot: &[f32], routing: &Routing, hidden: usize) -> Vec<f32> {
    let (t, k) = (routing.tokens, routing.top_k);
    let mut out = vec![0f32; t * hidden];
    for (tok, o) in out.chunks_mut(hidden).enumerate() {
        for slot in 0..k {
            let s = tok * k + slot;
            let w = routing.topk_weights[s];
            let y = &per_slot[s * hidden..(s + 1) * hidden];
            for (ov, &v) in o.iter_mut().zip(y) {
                *ov += w * v;
            }
        }
    }
    out
}

/// The routed output of `layer` (CPU NVFP4 path, reference flavor).
pub fn routed_cpu(
    layer: &MoeLayer,
    hidden: &[f32],
    routing: &Routing,
    scales: &ActScales,
) -> Result<Vec<f32>> {
    let ps = per_slot_cpu(layer, hidden, routing, scales)?;
    Ok(routed_sum(&ps, routing, layer.config.hidden_size))
}

/// The unweighted expert outputs `[T*K, hidden]` of `layer` (CPU NVFP4 path, reference
/// flavor), for [`dropped_slots`].
pub fn expert_outputs(
    layer: &MoeLayer,
    hidden: &[f32],
    routing: &Routing,
    scales: &ActScales,
) -> Result<Vec<f32>> {
    per_slot_cpu(
        &variant_layer(layer, |x| x.clone()),
        hidden,
        routing,
        scales,
    )
}

/// The unweighted expert outputs `[T*K, hidden]` of `layer` (CPU NVFP4 path, reference
/// flavor): they do not depend on the routing weights.
fn per_slot_cpu(
    layer: &MoeLayer,
    hidden: &[f32],
    routing: &Routing,
    scales: &ActScales,
) -> Result<Vec<f32>> {
    let path = Path::Nvfp4 {
        scales,
        flavor: Flavor::Reference,
    };
    let o = super::moe_forward(layer, hidden, routing, &path, true)?;
    Ok(o.per_slot.unwrap_or_default())
}

/// For one token's `(ids, weights)`, the slot whose weight each slot gets under a wrong-slot bug.
type WeightSource = fn(&[i32], &[f32]) -> Vec<usize>;

/// The ways an engine applies a token's routing weights to the wrong slots: the slot whose
/// weight slot `s` gets.
fn wrong_slot_bugs() -> [(SuspectedBug, WeightSource); 4] {
    fn forward(ids: &[i32], _: &[f32]) -> Vec<usize> {
        let k = ids.len();
        (0..k).map(|s| (s + k - 1) % k).collect()
    }
    fn backward(ids: &[i32], _: &[f32]) -> Vec<usize> {
        let k = ids.len();
        (0..k).map(|s| (s + 1) % k).collect()
    }
    // the engine's slot i runs expert ids[order[i]] with weight w[i]: slot order[i] gets w[i]
    fn ids_sorted(ids: &[i32], _: &[f32]) -> Vec<usize> {
        let mut order: Vec<usize> = (0..ids.len()).collect();
        order.sort_by_key(|&s| ids[s]);
        let mut from = vec![0; ids.len()];
        for (i, &s) in order.iter().enumerate() {
            from[s] = i;
        }
        from
    }
    // the engine's slot i runs expert ids[i] with weight w[order[i]]
    fn weights_sorted(_: &[i32], w: &[f32]) -> Vec<usize> {
        let mut order: Vec<usize> = (0..w.len()).collect();
        order.sort_by(|&a, &b| w[b].total_cmp(&w[a]));
        order
    }
    [
        (SuspectedBug::WeightsShiftedForward, forward),
        (SuspectedBug::WeightsShiftedBackward, backward),
        (SuspectedBug::IdsSortedWeightsNot, ids_sorted),
        (SuspectedBug::WeightsSortedIdsNot, weights_sorted),
    ]
}

/// `routing` with each token's weights moved to the slots `from` gives.
fn move_weights(routing: &Routing, from: WeightSource) -> Routing {
    let k = routing.top_k.max(1);
    let mut w = routing.topk_weights.clone();
    for (t, row) in w.chunks_mut(k).enumerate() {
        let ids = &routing.topk_ids[t * k..(t + 1) * k];
        let orig = &routing.topk_weights[t * k..(t + 1) * k];
        for (s, src) in from(ids, orig).into_iter().enumerate() {
            row[s] = orig[src];
        }
    }
    Routing {
        topk_weights: w,
        ..routing.clone()
    }
}

fn map_scales(w: &Fp4Tensor, f: impl Fn(&[u8], usize, usize) -> Vec<u8>) -> Fp4Tensor {
    let mut t = w.clone();
    t.scales = f(&w.scales, w.rows, w.cols / w.format.block());
    t
}

/// How a kernel misreads one matrix's block scales `(linear, rows, blocks per row)`.
type ScaleMisread = fn(&[u8], usize, usize) -> Vec<u8>;

/// What a kernel reads as "linear (m, k)" from a swizzled matrix: the byte at `m * kb + k`.
fn swizzled_read_linear(linear: &[u8], rows: usize, kb: usize) -> Vec<u8> {
    let sw = crate::nvfp4::layout::swizzle(linear, rows, kb);
    sw[..rows * kb].to_vec()
}

/// What a kernel reads as "swizzled (m, k)" from a linear matrix: the byte at the swizzled
/// offset, 0 past the end (the real kernel reads the next expert's or garbage there).
fn linear_read_swizzled(linear: &[u8], rows: usize, kb: usize) -> Vec<u8> {
    let mut out = vec![0u8; rows * kb];
    for m in 0..rows {
        for k in 0..kb {
            out[m * kb + k] = linear.get(swizzle_offset(m, k, kb)).copied().unwrap_or(0);
        }
    }
    out
}

/// What a kernel reads as "linear (m, k)" when it takes the linear `[rows, kb]` matrix for
/// `[kb, rows]`: the byte at `k * rows + m`.
fn linear_read_transposed(linear: &[u8], rows: usize, kb: usize) -> Vec<u8> {
    let mut out = vec![0u8; rows * kb];
    for m in 0..rows {
        for k in 0..kb {
            out[m * kb + k] = linear[k * rows + m];
        }
    }
    out
}

/// The layer with every expert changed by `f`, no shared experts (routed-only).
fn variant_layer(layer: &MoeLayer, f: impl Fn(&super::Expert) -> super::Expert) -> MoeLayer {
    MoeLayer {
        index: layer.index,
        config: layer.config.clone(),
        router: layer.router.clone(),
        experts: layer.experts.iter().map(f).collect(),
        shared: None,
        norm_weight: None,
    }
}

/// [`variant_layer`] with each expert's three linears mapped by `q`.
fn variant_linears(layer: &MoeLayer, q: impl Fn(&super::QLinear) -> super::QLinear) -> MoeLayer {
    variant_layer(layer, |x| super::Expert {
        w1: q(&x.w1),
        w3: q(&x.w3),
        w2: q(&x.w2),
    })
}

/// Under an EP id bug every rank runs some slots on some local expert: one routing with
/// `ranks * K` slots per token (weight 0 where a rank computes nothing) reproduces the sum.
fn ep_fault_routing(
    routing: &Routing,
    e: usize,
    ranks: usize,
    placement: Placement,
    fault: EpFault,
) -> Result<Routing> {
    let (t, k) = (routing.tokens, routing.top_k);
    let mut ids = vec![0i32; t * k * ranks];
    let mut w = vec![0f32; t * k * ranks];
    for map in ExpertMap::all_ranks(e, ranks, placement)? {
        let r = map.ep_rank;
        let plan = plan_rank(routing, map, Some(fault));
        for (s, l) in plan.local.iter().enumerate() {
            if let Some(g) = l.and_then(|l| plan.map.global(l as i64)) {
                let (tok, slot) = (s / k, s % k);
                let at = tok * k * ranks + r * k + slot;
                ids[at] = g as i32;
                w[at] = routing.topk_weights[s];
            }
        }
    }
    Ok(Routing {
        tokens: t,
        top_k: k * ranks,
        topk_ids: ids,
        topk_weights: w,
    })
}

/// `v` (`[tokens, hidden]`) as a kernel writes it column-major, read back row-major: element
/// `(t, c)` lands at flat `c · tokens + t`.
fn transposed(v: &[f32], tokens: usize, hidden: usize) -> Vec<f32> {
    let mut out = vec![0f32; v.len()];
    for (t, row) in v.chunks(hidden).enumerate() {
        for (c, &x) in row.iter().enumerate() {
            out[c * tokens + t] = x;
        }
    }
    out
}

/// The layer with expert `e` changed by `f(e, expert)`, no shared experts (routed-only).
fn variant_layer_indexed(
    layer: &MoeLayer,
    f: impl Fn(usize, &super::Expert) -> super::Expert,
) -> MoeLayer {
    MoeLayer {
        experts: layer
            .experts
            .iter()
            .enumerate()
            .map(|(e, x)| f(e, x))
            .collect(),
        ..variant_layer(layer, |x| x.clone())
    }
}

/// `l` with its weight's global scale replaced (the reference original dropped: the variant
/// runs the NVFP4 path only).
fn with_scale_2(l: &super::QLinear, scale_2: f32) -> super::QLinear {
    let mut weight = l.weight.clone();
    weight.scale_2 = scale_2;
    super::QLinear {
        weight,
        input_scale: l.input_scale,
        original: None,
    }
}

/// The global-scale and packing bugs: gs taken as input_scale, alpha built from gs, the
/// engine default gs in place of the handed one, the nibbles of the weights reversed, w3 scaled with w1's weight_scale_2. Each one that would
/// not change the output here (gs ≈ 1, MXFP4 weights, equal w1/w3 scales) is left out.
fn scale_and_packing_bugs(
    layer: &MoeLayer,
    hidden: &[f32],
    routing: &Routing,
    scales: &ActScales,
    correct: &[f32],
) -> Result<Vec<(SuspectedBug, Vec<f32>)>> {
    let mut out = vec![];
    let routed_only = variant_layer(layer, |x| x.clone());
    if let ActScales::Fixed { gs1, gs2 } = scales {
        let inv = |v: &[f32]| v.iter().map(|&g| rcp(g)).collect::<Vec<f32>>();
        let flipped = ActScales::Fixed {
            gs1: inv(gs1),
            gs2: inv(gs2),
        };
        out.push((
            SuspectedBug::GlobalScalesInverted,
            routed_cpu(&routed_only, hidden, routing, &flipped)?,
        ));
        // alpha = rcp(gs) · weight_scale_2 in the forward: weight_scale_2 · gs² makes it
        // gs · weight_scale_2 (up to the f32 rounding of the product)
        let (g1, g2) = (gs1.clone(), gs2.clone());
        let alpha_gs = variant_layer_indexed(layer, |e, x| {
            let sq = |g: f32| g * g;
            super::Expert {
                w1: with_scale_2(&x.w1, x.w1.weight.scale_2 * sq(g1[e])),
                w3: with_scale_2(&x.w3, x.w3.weight.scale_2 * sq(g1[e])),
                w2: with_scale_2(&x.w2, x.w2.weight.scale_2 * sq(g2[e])),
            }
        });
        out.push((
            SuspectedBug::AlphaUsesGs,
            routed_cpu(&alpha_gs, hidden, routing, scales)?,
        ));
        let e = layer.config.n_routed_experts;
        let default = ActScales::Fixed {
            gs1: vec![crate::nvfp4::DEFAULT_GS; e],
            gs2: vec![crate::nvfp4::DEFAULT_GS; e],
        };
        out.push((
            SuspectedBug::DefaultGsUsed,
            routed_cpu(&routed_only, hidden, routing, &default)?,
        ));
        // equal scales swap to the same output: not a suspect then
        if gs1 != gs2 {
            let swapped = ActScales::Fixed {
                gs1: gs2.clone(),
                gs2: gs1.clone(),
            };
            out.push((
                SuspectedBug::GsSwapped,
                routed_cpu(&routed_only, hidden, routing, &swapped)?,
            ));
        }
    }
    {
        // W4A16: the reference path on the dequantized NVFP4 weights (no BF16 originals)
        let dequantized = variant_linears(layer, |l| super::QLinear {
            weight: l.weight.clone(),
            input_scale: l.input_scale,
            original: None,
        });
        let o = super::moe_forward(&dequantized, hidden, routing, &Path::Reference, false)?;
        out.push((SuspectedBug::ActivationsNotQuantized, o.out));
    }
    {
        let swap = |l: &super::QLinear| {
            let mut weight = l.weight.clone();
            weight.packed.iter_mut().for_each(|b| *b = b.rotate_left(4));
            super::QLinear {
                weight,
                input_scale: l.input_scale,
                original: None,
            }
        };
        let swapped = variant_linears(layer, swap);
        out.push((
            SuspectedBug::NibblesSwapped,
            routed_cpu(&swapped, hidden, routing, scales)?,
        ));
    }
    if layer
        .experts
        .iter()
        .any(|x| x.w1.weight.scale_2.to_bits() != x.w3.weight.scale_2.to_bits())
    {
        let gate_only = variant_layer(layer, |x| super::Expert {
            w1: x.w1.clone(),
            w3: with_scale_2(&x.w3, x.w1.weight.scale_2),
            w2: x.w2.clone(),
        });
        out.push((
            SuspectedBug::UpUsesGateScale2,
            routed_cpu(&gate_only, hidden, routing, scales)?,
        ));
    }
    // one that does not change the output here cannot be told from a correct kernel; one
    // that a kernel having it would fail by (below the agreement bar) stays a suspect
    out.retain(|(_, v)| !same_up_to_noise(&compare(v, correct), AGREE_MIN_COSINE));
    Ok(out)
}

/// The routed output under each known bug that fits how the plugin was fed.
pub fn bug_variants(
    layer: &MoeLayer,
    hidden: &[f32],
    routing: &Routing,
    scales: &ActScales,
    feeding: Feeding,
) -> Result<Vec<(SuspectedBug, Vec<f32>)>> {
    let mut out = vec![];
    let swapped = variant_layer(layer, |x| super::Expert {
        w1: x.w3.clone(),
        w3: x.w1.clone(),
        w2: x.w2.clone(),
    });
    out.push((
        SuspectedBug::GateUpSwapped,
        routed_cpu(&swapped, hidden, routing, scales)?,
    ));
    let layouts = match feeding.layout {
        Some(l) => vec![l],
        None => vec![ScaleLayout::Swizzled, ScaleLayout::Linear],
    };
    for layout in layouts {
        let (bug, f): (SuspectedBug, ScaleMisread) = match layout {
            ScaleLayout::Swizzled => (SuspectedBug::SwizzledScalesReadLinear, swizzled_read_linear),
            ScaleLayout::Linear => (SuspectedBug::LinearScalesReadSwizzled, linear_read_swizzled),
        };
        let misread = variant_linears(layer, |l| super::QLinear {
            weight: map_scales(&l.weight, f),
            input_scale: l.input_scale,
            original: None,
        });
        out.push((bug, routed_cpu(&misread, hidden, routing, scales)?));
    }
    if feeding.layout != Some(ScaleLayout::Swizzled) {
        let misread = variant_linears(layer, |l| super::QLinear {
            weight: map_scales(&l.weight, linear_read_transposed),
            input_scale: l.input_scale,
            original: None,
        });
        out.push((
            SuspectedBug::ScalesReadTransposed,
            routed_cpu(&misread, hidden, routing, scales)?,
        ));
    }
    let routed_only = variant_layer(layer, |x| x.clone());
    // the weight bugs combine the same expert outputs differently
    let ps = per_slot_cpu(&routed_only, hidden, routing, scales)?;
    let h = layer.config.hidden_size;
    let unweighted = Routing {
        topk_weights: vec![1.0; routing.topk_weights.len()],
        ..routing.clone()
    };
    out.push((
        SuspectedBug::WeightsNotApplied,
        routed_sum(&ps, &unweighted, h),
    ));
    let correct = routed_sum(&ps, routing, h);
    let squared = Routing {
        topk_weights: routing.topk_weights.iter().map(|w| w * w).collect(),
        ..routing.clone()
    };
    let v = routed_sum(&ps, &squared, h);
    // weights of 1 (top-1, renormalized) square to themselves: not a suspect then
    if !same_up_to_noise(&compare(&v, &correct), AGREE_MIN_COSINE) {
        out.push((SuspectedBug::WeightsAppliedTwice, v));
    }
    if layer.config.swiglu_limit.is_some() {
        let mut unclamped = routed_only.clone();
        unclamped.config.swiglu_limit = None;
        let v = routed_cpu(&unclamped, hidden, routing, scales)?;
        // activations that never reach the limit cannot tell it: not a suspect
        if !same_up_to_noise(&compare(&v, &correct), AGREE_MIN_COSINE) {
            out.push((SuspectedBug::SwigluLimitIgnored, v));
        }
    }
    let one_sided = |clamp: SwigluClamp| -> Result<Vec<f32>> {
        let path = Path::Nvfp4 {
            scales,
            flavor: Flavor::Reference,
        };
        let o =
            super::forward::moe_forward_clamped(&routed_only, hidden, routing, &path, true, clamp)?;
        Ok(routed_sum(&o.per_slot.unwrap_or_default(), routing, h))
    };
    let clamps = match layer.config.swiglu_limit {
        Some(l) => vec![
            (
                SuspectedBug::SwigluGateClampOnly,
                SwigluClamp {
                    gate: Some(l),
                    up: None,
                },
            ),
            (
                SuspectedBug::SwigluUpClampOnly,
                SwigluClamp {
                    gate: None,
                    up: Some(l),
                },
            ),
        ],
        None => [7.0, 10.0]
            .map(|l| {
                (
                    SuspectedBug::SwigluClampWithoutLimit,
                    SwigluClamp::both(Some(l)),
                )
            })
            .to_vec(),
    };
    for (bug, clamp) in clamps {
        let v = one_sided(clamp)?;
        // activations that never reach the limit cannot tell it: not a suspect
        if !same_up_to_noise(&compare(&v, &correct), AGREE_MIN_COSINE) {
            out.push((bug, v));
        }
    }
    let mut seen = vec![routing.topk_weights.clone()];
    for (bug, from) in wrong_slot_bugs() {
        let moved = move_weights(routing, from);
        // a permutation another one makes too (top-2: both shifts swap) is named once
        if seen.contains(&moved.topk_weights) {
            continue;
        }
        let v = routed_sum(&ps, &moved, h);
        // one that does not change the output here (top-1, ids already sorted) cannot be
        // told from a correct kernel: not a suspect; near-equal weights (DeepSeek's top-8)
        // change it little, yet enough to fail the agreement bar: a suspect
        if !same_up_to_noise(&compare(&v, &correct), AGREE_MIN_COSINE) {
            out.push((bug, v));
        }
        seen.push(moved.topk_weights);
    }
    out.extend(scale_and_packing_bugs(
        layer, hidden, routing, scales, &correct,
    )?);
    // one token (or one channel): the transpose is the output itself
    if routing.tokens > 1 && h > 1 {
        out.push((
            SuspectedBug::OutputTransposed,
            transposed(&correct, routing.tokens, h),
        ));
    }
    if let Some((ranks, placement)) = feeding.ep.filter(|(r, _)| *r > 1) {
        let e = layer.config.n_routed_experts;
        for (bug, fault) in [
            (SuspectedBug::LocalIdsReadAsGlobal, EpFault::LocalIds),
            (SuspectedBug::GlobalIdsReadAsLocal, EpFault::GlobalIds),
        ] {
            let r = ep_fault_routing(routing, e, ranks, placement, fault)?;
            out.push((bug, routed_cpu(&routed_only, hidden, &r, scales)?));
        }
    }
    Ok(out)
}

/// How well one bug variant explains the plugin's output.
#[derive(Clone, Debug, Serialize)]
pub struct Suspect {
    pub bug: SuspectedBug,
    pub description: &'static str,
    /// The plugin's routed output against this variant.
    pub cosine: f64,
    pub rel_l2: f64,
    pub explains: bool,
}

/// The three-way comparison of a plugin's output.
#[derive(Clone, Debug, Serialize)]
pub struct Judgement {
    /// Whole layer (theirs + our shared experts) vs the BF16 reference.
    pub theirs_vs_reference: Metrics,
    /// Whole layer, our NVFP4 path vs the BF16 reference.
    pub ours_vs_reference: Metrics,
    /// Routed-only, theirs vs our NVFP4 path.
    pub theirs_vs_ours: Metrics,
    /// Least-squares factor `theirs ≈ scale · ours` (routed): far from 1 at a high cosine is
    /// a scale error.
    pub scale_vs_ours: f64,
    pub min_cosine: f64,
    pub agree_min_cosine: f64,
    pub theirs_pass: bool,
    pub ours_pass: bool,
    pub agree: bool,
    /// NaN/Inf in theirs where ours has none (the output was NaN-poisoned before the call,
    /// so these may be values the plugin never wrote).
    pub nonfinite_only_theirs: u64,
    /// Best first; empty when the diagnosis was not run (the plugin agrees, or too large).
    pub suspects: Vec<Suspect>,
    pub diagnosis: Option<SuspectedBug>,
}

/// Inputs of [`judge`]: all `[tokens, hidden]`.
pub struct Outputs<'a> {
    pub theirs_routed: &'a [f32],
    pub ours_routed: &'a [f32],
    pub ours_layer: &'a [f32],
    pub reference_layer: &'a [f32],
    /// Our shared-expert output (zeros without shared experts).
    pub shared: &'a [f32],
}

/// Judge the plugin; `variants` (from [`bug_variants`]) feed the diagnosis, to which the
/// shared experts added to the routed output once or twice (ours + shared, ours + 2·shared) are
/// added here when there are any.
pub fn judge(o: &Outputs, min_cosine: f64, variants: &[(SuspectedBug, Vec<f32>)]) -> Judgement {
    let with_shared: Vec<(SuspectedBug, Vec<f32>)> =
        if variants.is_empty() || o.shared.iter().all(|&v| v == 0.0) {
            vec![]
        } else {
            let plus = |k: f32| {
                o.ours_routed
                    .iter()
                    .zip(o.shared)
                    .map(move |(a, b)| a + k * b)
            };
            vec![
                (SuspectedBug::SharedExpertsIncluded, plus(1.0).collect()),
                (SuspectedBug::SharedExpertsAddedTwice, plus(2.0).collect()),
            ]
        };
    let theirs_layer: Vec<f32> = o
        .theirs_routed
        .iter()
        .zip(o.shared)
        .map(|(a, b)| a + b)
        .collect();
    let tr = compare(&theirs_layer, o.reference_layer);
    let or = compare(o.ours_layer, o.reference_layer);
    let to = compare(o.theirs_routed, o.ours_routed);
    let ok = |m: &Metrics, min: f64| m.passes(min);
    let (theirs_pass, ours_pass, agree) = (
        ok(&tr, min_cosine),
        ok(&or, min_cosine),
        same_up_to_noise(&to, AGREE_MIN_COSINE)
            || agrees_with_same_nonfinite(o.theirs_routed, o.ours_routed),
    );
    let (dot, nn) = o
        .theirs_routed
        .iter()
        .zip(o.ours_routed)
        .fold((0f64, 0f64), |(d, n), (&t, &u)| {
            (d + t as f64 * u as f64, n + u as f64 * u as f64)
        });
    let scale_vs_ours = if nn > 0.0 { dot / nn } else { f64::NAN };
    let ours_bad = or.nan_count + or.inf_count;
    let nonfinite_only_theirs = if ours_bad == 0 {
        to.nan_count + to.inf_count
    } else {
        0
    };
    let mut suspects: Vec<Suspect> = if agree {
        vec![]
    } else {
        variants
            .iter()
            .chain(&with_shared)
            .map(|(bug, v)| {
                let m = compare(o.theirs_routed, v);
                // a variant near ours (a wrong-slot bug under near-equal weights) explains
                // theirs only matched as closely as ours must be: within the explain bar of
                // both, it would name another small deviation (an imprecise kernel, a bias
                // in the weights); and always nearer theirs than ours is
                let near = same_up_to_noise(&compare(v, o.ours_routed), EXPLAINS_MIN_COSINE);
                let bar = if near {
                    AGREE_MIN_COSINE
                } else {
                    EXPLAINS_MIN_COSINE
                };
                Suspect {
                    bug: *bug,
                    description: bug.describe(),
                    cosine: m.cosine,
                    rel_l2: m.rel_l2,
                    explains: same_up_to_noise(&m, bar) && m.rel_l2 < to.rel_l2,
                }
            })
            .collect()
    };
    // those that explain first (cosine alone cannot tell `x` from `2.5·x`), then by cosine
    suspects.sort_by(|a, b| {
        let key = |x: &Suspect| if x.cosine.is_nan() { -2.0 } else { x.cosine };
        b.explains.cmp(&a.explains).then(key(b).total_cmp(&key(a)))
    });
    // a bug tried at several settings (a clamp at 7 and at 10) is listed once, at its best
    let mut listed = vec![];
    suspects.retain(|s| {
        let first = !listed.contains(&s.bug);
        listed.push(s.bug);
        first
    });
    let diagnosis = suspects.first().filter(|s| s.explains).map(|s| s.bug);
    Judgement {
        theirs_vs_reference: tr,
        ours_vs_reference: or,
        theirs_vs_ours: to,
        scale_vs_ours,
        min_cosine,
        agree_min_cosine: AGREE_MIN_COSINE,
        theirs_pass,
        ours_pass,
        agree,
        nonfinite_only_theirs,
        suspects,
        diagnosis,
    }
}

/// Where a deviating output deviates: which tokens, and what they share.
#[derive(Clone, Debug, Serialize)]
pub struct Localization {
    pub tokens: usize,
    /// Tokens whose row is not ours up to summation order (cosine and norm).
    pub deviating_tokens: Vec<usize>,
    /// The worst rows: (token, cosine against ours).
    pub worst: Vec<(usize, f64)>,
    /// Deviating rows that are all zeros where ours is not (never written).
    pub zero_tokens: Vec<usize>,
    /// The one expert every deviating token routes to (and most of its tokens deviate).
    pub expert: Option<usize>,
    /// `(row, token)`: the row holds that other token's output (tokens permuted).
    pub permuted: Vec<(usize, usize)>,
    /// `(min, max)` of `theirs / ours` over the deviating rows when every one of them has our
    /// direction: each token's output scaled by a factor of its own (its routing weights).
    pub token_factors: Option<(f64, f64)>,
    /// The finding in words.
    pub text: String,
}

/// Rows compared when looking for a permutation (each against every row of ours).
const PERMUTATION_ROWS: usize = 16;

/// Compare `theirs` and `ours` (`[T, hidden]`, routed) row by row and say what the deviating
/// tokens share: one expert (its output wrong or missing), a permutation of rows, rows never
/// written. `None` when no row deviates.
pub fn localize(
    theirs: &[f32],
    ours: &[f32],
    routing: &Routing,
    hidden: usize,
) -> Option<Localization> {
    let t = routing.tokens;
    if hidden == 0 || theirs.len() != t * hidden || ours.len() != t * hidden {
        return None;
    }
    let row = |v: &[f32], i: usize| -> Vec<f32> { v[i * hidden..(i + 1) * hidden].to_vec() };
    let per: Vec<Metrics> = (0..t)
        .map(|i| compare(&row(theirs, i), &row(ours, i)))
        .collect();
    let deviating: Vec<usize> = (0..t)
        .filter(|&i| !same_up_to_noise(&per[i], AGREE_MIN_COSINE))
        .collect();
    if deviating.is_empty() {
        return None;
    }
    let mut worst: Vec<(usize, f64)> = deviating.iter().map(|&i| (i, per[i].cosine)).collect();
    worst.sort_by(|a, b| {
        let k = |c: f64| if c.is_nan() { -2.0 } else { c };
        k(a.1).total_cmp(&k(b.1))
    });
    worst.truncate(5);
    let zero_tokens: Vec<usize> = deviating
        .iter()
        .copied()
        .filter(|&i| {
            theirs[i * hidden..(i + 1) * hidden]
                .iter()
                .all(|&v| v == 0.0)
                && ours[i * hidden..(i + 1) * hidden].iter().any(|&v| v != 0.0)
        })
        .collect();
    // one expert shared by every deviating token, most of whose tokens deviate
    let k = routing.top_k;
    let mut expert = None;
    if deviating.len() >= 2 && k > 0 {
        let served = |e: i32| -> Vec<usize> {
            (0..t)
                .filter(|&i| {
                    (0..k).any(|s| {
                        routing.topk_ids[i * k + s] == e && routing.topk_weights[i * k + s] != 0.0
                    })
                })
                .collect()
        };
        let mut ids: Vec<i32> = routing.topk_ids[deviating[0] * k..(deviating[0] + 1) * k].to_vec();
        ids.sort_unstable();
        ids.dedup();
        let fits: Vec<(i32, usize)> = ids
            .into_iter()
            .map(|e| (e, served(e)))
            .filter(|(_, s)| {
                s.len() < t
                    && deviating.iter().all(|d| s.contains(d))
                    && 2 * deviating.len() >= s.len()
            })
            .map(|(e, s)| (e, s.len()))
            .collect();
        // several fit: the one all of whose tokens deviate, when it is one
        let exact: Vec<i32> = fits
            .iter()
            .filter(|(_, n)| *n == deviating.len())
            .map(|(e, _)| *e)
            .collect();
        expert = match (&fits[..], &exact[..]) {
            ([(e, _)], _) | (_, [e]) => usize::try_from(*e).ok(),
            _ => None,
        };
    }
    // rows holding another token's output
    let mut permuted = vec![];
    if deviating.len() >= 2 {
        for &i in deviating.iter().take(PERMUTATION_ROWS) {
            let mine = row(theirs, i);
            let j = (0..t).find(|&j| {
                j != i && same_up_to_noise(&compare(&mine, &row(ours, j)), AGREE_MIN_COSINE)
            });
            match j {
                Some(j) => permuted.push((i, j)),
                None => {
                    permuted.clear();
                    break;
                }
            }
        }
    }
    let token_factors = token_factors(theirs, ours, &deviating, &per, hidden);
    let n = deviating.len();
    let list = |v: &[usize]| {
        let mut s: Vec<String> = v.iter().take(8).map(|x| x.to_string()).collect();
        if v.len() > 8 {
            s.push(format!("… {} more", v.len() - 8));
        }
        s.join(", ")
    };
    let text = if !permuted.is_empty() {
        let pairs: Vec<String> = permuted
            .iter()
            .take(4)
            .map(|(i, j)| format!("row {i} holds token {j}"))
            .collect();
        format!(
            "{n} of {t} tokens deviate and their rows hold other tokens' outputs: tokens permuted \
             ({}{}) - a wrong token order in the combine / un-permute step",
            pairs.join(", "),
            if n > pairs.len() { ", …" } else { "" }
        )
    } else if let Some((lo, hi)) = token_factors {
        if hi - lo > TOKEN_FACTOR_SPREAD * hi.abs() {
            format!(
                "{n} of {t} tokens deviate, each with our direction (cosine >= {AGREE_MIN_COSINE}) \
                 but scaled by a factor of its own (x{lo:.4} to x{hi:.4} of ours): each token's \
                 routing weights are off by a per-token factor - top-k weights not renormalized \
                 to sum 1 (norm_topk_prob), or renormalized when they should not be (tokens {})",
                list(&deviating)
            )
        } else {
            format!(
                "{n} of {t} tokens deviate, each with our direction (cosine >= {AGREE_MIN_COSINE}) \
                 but x{hi:.4} of ours: those tokens' routing weights or outputs are scaled \
                 (tokens {})",
                list(&deviating)
            )
        }
    } else if let Some(e) = expert {
        format!(
            "{n} of {t} tokens deviate, and every one of them routes to expert {e} (tokens not \
             routed to it match): expert {e}'s output is wrong or missing (tokens {})",
            list(&deviating)
        )
    } else if zero_tokens.len() == n {
        format!(
            "{n} of {t} tokens deviate, all of them rows of zeros where ours is not: never \
             written (tokens {})",
            list(&zero_tokens)
        )
    } else {
        let w: Vec<String> = worst
            .iter()
            .map(|(i, c)| format!("token {i} cosine {c:.4}"))
            .collect();
        format!("{n} of {t} tokens deviate; worst: {}", w.join(", "))
    };
    Some(Localization {
        tokens: t,
        deviating_tokens: deviating,
        worst,
        zero_tokens,
        expert,
        permuted,
        token_factors,
        text,
    })
}

/// The `deviating` tokens each of whose rows is ours less exactly one slot's weighted expert
/// output (`per_slot`: [`expert_outputs`]), that slot's contribution dropped: `(token,
/// expert)` for every one of them, or None when one is not so explained. Unlike
/// [`Localization::expert`] this needs no other token: an expert that served one token, or
/// several experts each missing somewhere, are named too.
pub fn dropped_slots(
    theirs: &[f32],
    ours: &[f32],
    per_slot: &[f32],
    routing: &Routing,
    hidden: usize,
    deviating: &[usize],
) -> Option<Vec<(usize, i32)>> {
    let k = routing.top_k;
    if deviating.is_empty() || per_slot.len() != routing.tokens * k * hidden {
        return None;
    }
    deviating
        .iter()
        .map(|&i| {
            let row = |v: &[f32]| v[i * hidden..(i + 1) * hidden].to_vec();
            let (mine, base) = (row(theirs), row(ours));
            (0..k).find_map(|slot| {
                let s = i * k + slot;
                let w = routing.topk_weights[s];
                if w == 0.0 {
                    return None;
                }
                let y = &per_slot[s * hidden..(s + 1) * hidden];
                let less: Vec<f32> = base.iter().zip(y).map(|(&b, &v)| b - w * v).collect();
                same_up_to_noise(&compare(&mine, &less), AGREE_MIN_COSINE)
                    .then_some((i, routing.topk_ids[s]))
            })
        })
        .collect()
}

/// Replace `l`'s text with the dropped expert slots when they explain every deviating row
/// (not for rows permuted or scaled per token, which say more): `per_slot` as
/// [`expert_outputs`] gives it.
pub fn name_dropped_slots(
    l: &mut Localization,
    theirs: &[f32],
    ours: &[f32],
    per_slot: &[f32],
    routing: &Routing,
    hidden: usize,
) {
    if !l.permuted.is_empty() || l.token_factors.is_some() {
        return;
    }
    if let Some(p) = dropped_slots(theirs, ours, per_slot, routing, hidden, &l.deviating_tokens) {
        l.text = dropped_slots_text(&p, routing.tokens);
    }
}

/// [`dropped_slots`] in words.
pub fn dropped_slots_text(pairs: &[(usize, i32)], tokens: usize) -> String {
    let mut experts: Vec<i32> = pairs.iter().map(|p| p.1).collect();
    experts.sort_unstable();
    experts.dedup();
    let n = pairs.len();
    let shown: Vec<String> = pairs
        .iter()
        .take(8)
        .map(|(t, e)| format!("token {t}: expert {e}"))
        .collect();
    let more = if n > 8 {
        format!(", … {} more", n - 8)
    } else {
        String::new()
    };
    match experts[..] {
        [e] => format!(
            "{n} of {tokens} tokens deviate, each by exactly its slot of expert {e} (our output \
             less that expert's weighted output): expert {e}'s output is wrong or missing - its \
             contribution is dropped ({}{more})",
            shown.join(", ")
        ),
        _ => format!(
            "{n} of {tokens} tokens deviate, each by exactly one slot's weighted expert output: \
             the contributions of experts {} are dropped ({}{more})",
            experts
                .iter()
                .map(|e| e.to_string())
                .collect::<Vec<_>>()
                .join(", "),
            shown.join(", ")
        ),
    }
}

/// An expert whose own rows (the tokens routed to it) are off ours by more than this relative
/// L2 error fails, even where the whole output agrees with ours: an error in one expert that
/// serves one or two of many tokens (a `weight_scale_2` of its own off by 2) moves the layer's
/// cosine by less than the agreement bar. A correct kernel moves a row only where FP32
/// summation order flips an E2M1 code or block scale before w2: emulated with every expert's
/// alpha moved by up to 1e-5 relative (~10x FP32 order noise; tiny layers, 37 to 1024 tokens,
/// 18 runs), the worst row moved by 0.10 and the worst expert's rows by 0.0074; one expert's
/// gate `weight_scale_2` doubled moves its rows by 0.14 to 0.33 at the least and ~0.5
/// typically. The dump recompute's row bar ([`dump::TOKEN_MAX_REL_ERR`], the same
/// noise) serves.
pub const EXPERT_ROWS_MAX_REL_ERR: f64 = dump::TOKEN_MAX_REL_ERR;

/// One expert's rows judged on their own ([`deviating_experts`]).
#[derive(Clone, Debug, Serialize)]
pub struct ExpertRows {
    pub expert: usize,
    /// Token slots routed to it (weight not 0).
    pub slots: usize,
    /// Theirs against ours over the rows of the tokens routed to it.
    pub cosine: f64,
    pub rel_l2: f64,
}

/// The experts whose own rows (the tokens routed to them with a weight not 0) are off ours
/// (`[T, hidden]`, routed) by more than [`EXPERT_ROWS_MAX_REL_ERR`], worst first.
pub fn deviating_experts(
    theirs: &[f32],
    ours: &[f32],
    routing: &Routing,
    hidden: usize,
    experts: usize,
) -> Vec<ExpertRows> {
    let (t, k) = (routing.tokens, routing.top_k);
    if hidden == 0 || theirs.len() != t * hidden || ours.len() != t * hidden {
        return vec![];
    }
    let mut out: Vec<ExpertRows> = (0..experts)
        .filter_map(|e| {
            let slots: Vec<usize> = (0..t * k)
                .filter(|&s| routing.topk_ids[s] == e as i32 && routing.topk_weights[s] != 0.0)
                .collect();
            let mut tokens: Vec<usize> = slots.iter().map(|s| s / k).collect();
            tokens.dedup();
            if tokens.is_empty() || tokens.len() == t {
                return None;
            }
            let rows = |v: &[f32]| -> Vec<f32> {
                tokens
                    .iter()
                    .flat_map(|&i| v[i * hidden..(i + 1) * hidden].iter().copied())
                    .collect()
            };
            let m = compare(&rows(theirs), &rows(ours));
            // NaN/Inf rows are the layer-wide check's (a correct kernel reproduces ours)
            (m.rel_l2 > EXPERT_ROWS_MAX_REL_ERR).then_some(ExpertRows {
                expert: e,
                slots: slots.len(),
                cosine: m.cosine,
                rel_l2: m.rel_l2,
            })
        })
        .collect();
    out.sort_by(|a, b| b.rel_l2.total_cmp(&a.rel_l2));
    out
}

/// [`deviating_experts`] in words.
pub fn deviating_experts_text(d: &[ExpertRows], routed_cosine: f64) -> String {
    let shown: Vec<String> = d
        .iter()
        .take(4)
        .map(|x| {
            format!(
                "expert {} ({} slot{}): rel_l2 {:.3}, cosine {:.4}",
                x.expert,
                x.slots,
                if x.slots == 1 { "" } else { "s" },
                x.rel_l2,
                x.cosine
            )
        })
        .collect();
    format!(
        "the whole routed output agrees with ours (cosine {routed_cosine:.6}), but the rows of the \
         tokens routed to {} are off by more than rel_l2 {EXPERT_ROWS_MAX_REL_ERR} ({}{}): that \
         expert's output is wrong, an error diluted among the layer's tokens (a weight_scale_2, \
         block scale or weight of that expert read wrong)",
        if d.len() == 1 { "one expert" } else { "some experts" },
        shown.join("; "),
        if d.len() > 4 { "; …" } else { "" }
    )
}

/// Relative spread of the per-token factors past which they are a factor of each token's
/// own, not one scale error (f32 summation noise moves a factor by ~1e-6).
const TOKEN_FACTOR_SPREAD: f64 = 1e-3;

/// `(min, max)` of the least-squares factor `theirs ≈ f · ours` over the `deviating` rows,
/// when every one of them keeps our direction (cosine >= [`AGREE_MIN_COSINE`]).
fn token_factors(
    theirs: &[f32],
    ours: &[f32],
    deviating: &[usize],
    per: &[Metrics],
    hidden: usize,
) -> Option<(f64, f64)> {
    if deviating.is_empty() || !deviating.iter().all(|&i| per[i].cosine >= AGREE_MIN_COSINE) {
        return None;
    }
    let factor = |i: usize| {
        let r = i * hidden..(i + 1) * hidden;
        let (d, nn) = theirs[r.clone()]
            .iter()
            .zip(&ours[r])
            .fold((0f64, 0f64), |(d, n), (&a, &b)| {
                (d + a as f64 * b as f64, n + b as f64 * b as f64)
            });
        d / nn
    };
    let fs: Vec<f64> = deviating.iter().map(|&i| factor(i)).collect();
    if fs.iter().any(|f| !f.is_finite()) {
        return None;
    }
    Some((
        fs.iter().copied().fold(f64::INFINITY, f64::min),
        fs.iter().copied().fold(f64::NEG_INFINITY, f64::max),
    ))
}

impl Judgement {
    /// The plugin passes: it matches the reference within NVFP4 error and our path within
    /// summation order.
    pub fn pass(&self) -> bool {
        self.theirs_pass && self.agree
    }

    /// Who is to blame, in words, when something failed.
    pub fn blame(&self) -> Option<String> {
        if self.pass() {
            return None;
        }
        let d = self.diagnosis.map(|b| {
            let s = self.suspects.iter().find(|s| s.bug == b);
            format!(
                "; its output matches the known bug \"{}\" (cosine {:.6} against that variant, recomputed on the CPU)",
                b.describe(),
                s.map_or(f64::NAN, |s| s.cosine)
            )
        });
        let unwritten = (self.nonfinite_only_theirs > 0).then(|| {
            format!(
                "; {} NaN/Inf values where ours has none: computed so, or never written (`layertest --kernel` poisons the output with NaN before the call)",
                self.nonfinite_only_theirs
            )
        });
        let to = &self.theirs_vs_ours;
        let scaled = (to.passes(AGREE_MIN_COSINE) && !self.agree).then(|| {
            format!(
                "; its output has the right direction (cosine {:.6}) but is {:.4} × ours (rel_l2 {:.3e}): a scale error (alpha, a global scale, or routed_scaling_factor applied twice or not at all)",
                to.cosine, self.scale_vs_ours, to.rel_l2
            )
        });
        let detail = format!(
            "{}{}{}",
            scaled.unwrap_or_default(),
            d.unwrap_or_default(),
            unwritten.unwrap_or_default()
        );
        Some(match (self.agree, self.ours_pass) {
            (false, true) => format!(
                "the kernel under test deviates from the built-in NVFP4 kernel (routed-only cosine {:.6}, agreement needs {}) while the built-in one matches the BF16 reference (cosine {:.4}): the bug is in the kernel under test{detail}",
                self.theirs_vs_ours.cosine, AGREE_MIN_COSINE, self.ours_vs_reference.cosine
            ),
            (false, false) => format!(
                "the kernel under test deviates from the built-in NVFP4 kernel (routed-only cosine {:.6}) and the built-in one misses the BF16 reference too (cosine {:.4}): look at the inputs (gs, weights) and at the kernel under test{detail}",
                self.theirs_vs_ours.cosine, self.ours_vs_reference.cosine
            ),
            (true, _) => format!(
                "the kernel under test agrees with the built-in NVFP4 kernel, and both miss the BF16 reference (cosine {:.4} < {}): the inputs (activation gs, weights), not the kernel",
                self.theirs_vs_reference.cosine, self.min_cosine
            ),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::moe::synthetic::{Preset, SyntheticModel};

    /// `theirs` judged against `ours` as the routed output (no shared expert, reference = ours).
    fn judge_routed(
        theirs: &[f32],
        ours: &[f32],
        zeros: &[f32],
        variants: &[(SuspectedBug, Vec<f32>)],
    ) -> Judgement {
        judge(
            &Outputs {
                theirs_routed: theirs,
                ours_routed: ours,
                ours_layer: ours,
                reference_layer: ours,
                shared: zeros,
            },
            0.95,
            variants,
        )
    }

    fn setup(seed: u64) -> (MoeLayer, Vec<f32>, Routing, ActScales) {
        let m = SyntheticModel::new(Preset::Tiny, seed);
        let layer = m.moe_layer(1).unwrap();
        let (x, ids) = m.activations(1, 12, seed);
        let r = crate::moe::route(&layer, &x, Some(&ids)).unwrap();
        let e = layer.config.n_routed_experts;
        let s = ActScales::Fixed {
            gs1: vec![crate::nvfp4::GS_DENOM / crate::moe::forward::amax(&x); e],
            gs2: vec![2000.0; e],
        };
        (layer, x, r, s)
    }

    #[test]
    fn routed_sum_is_the_forward_without_shared_experts() {
        let seed: u64 = rand::random();
        let (layer, x, r, s) = setup(seed);
        let p = Path::Nvfp4 {
            scales: &s,
            flavor: Flavor::Reference,
        };
        let full = crate::moe::moe_forward(&layer, &x, &r, &p, true).unwrap();
        let routed = routed_cpu(&layer, &x, &r, &s).unwrap();
        let h = layer.config.hidden_size;
        let shared = layer
            .shared
            .as_ref()
            .map(|m| crate::moe::forward::dense_forward(m, &x, r.tokens, h, None))
            .unwrap_or_else(|| vec![0.0; x.len()]);
        for (j, ((&f, &a), &b)) in full.out.iter().zip(&routed).zip(&shared).enumerate() {
            assert_eq!(f.to_bits(), (a + b).to_bits(), "seed {seed} at {j}");
        }
    }

    #[test]
    fn each_bug_variant_is_named_and_the_correct_output_passes() {
        let seed: u64 = rand::random();
        let (layer, x, r, s) = setup(seed);
        let ours = routed_cpu(&layer, &x, &r, &s).unwrap();
        let zeros = vec![0f32; ours.len()];
        for layout in [ScaleLayout::Swizzled, ScaleLayout::Linear] {
            let feeding = Feeding {
                layout: Some(layout),
                ep: Some((4, Placement::Linear)),
            };
            let variants = bug_variants(&layer, &x, &r, &s, feeding).unwrap();
            // gate/up, one scale misreading, weights not applied or applied twice, the
            // transpose, 2 EP, the wrong-slot permutations this routing tells apart (top-4: both
            // shifts at least), gs inverted, alpha from gs, the default gs, gs1/gs2 swapped
            // (where they differ), BF16 activations (W4A16), the nibbles (w1/w3 scales are equal),
            // the scales read transposed (linear layout), a clamp at 7 or 10 where the tiny
            // layer's activations reach it (no swiglu_limit)
            let named: Vec<SuspectedBug> = variants.iter().map(|(b, _)| *b).collect();
            assert!(
                (14..=21).contains(&variants.len())
                    && named.contains(&SuspectedBug::WeightsAppliedTwice)
                    && named.contains(&SuspectedBug::ActivationsNotQuantized)
                    && named.contains(&SuspectedBug::OutputTransposed)
                    && named.contains(&SuspectedBug::WeightsShiftedForward)
                    && named.contains(&SuspectedBug::WeightsShiftedBackward),
                "seed {seed}: {named:?}"
            );
            fn o<'a>(theirs: &'a [f32], ours: &'a [f32], zeros: &'a [f32]) -> Outputs<'a> {
                Outputs {
                    theirs_routed: theirs,
                    ours_routed: ours,
                    ours_layer: ours,
                    reference_layer: ours,
                    shared: zeros,
                }
            }
            let ok = judge(&o(&ours, &ours, &zeros), 0.95, &variants);
            assert!(
                ok.pass() && ok.diagnosis.is_none() && ok.blame().is_none(),
                "seed {seed}"
            );
            for (bug, v) in &variants {
                // every variant must differ from the correct output by more than a correct
                // kernel may, else it could not be told apart (a wrong-slot one may differ on
                // a few tokens only: weights sorted where the router nearly sorts them)
                let m = compare(v, &ours);
                assert!(
                    !same_up_to_noise(&m, AGREE_MIN_COSINE),
                    "seed {seed}: {bug:?} is indistinguishable ({}, {})",
                    m.cosine,
                    m.rel_l2
                );
                let j = judge(&o(v, &ours, &zeros), 0.95, &variants);
                assert!(!j.pass(), "seed {seed} {bug:?}");
                assert_eq!(j.diagnosis, Some(*bug), "seed {seed}: {:?}", j.suspects);
                assert!(j.blame().unwrap().contains(bug.describe()), "seed {seed}");
            }
        }
    }

    /// A kernel with a global-scale or packing bug, built here from the bug's own definition:
    /// it used to fail as "N of T tokens deviate" with no cause; now the bug is named.
    #[test]
    fn global_scale_and_nibble_bugs_are_named() {
        use rand::{Rng, SeedableRng};
        let seed: u64 = rand::random();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let (mut layer, x, r, _) = setup(seed);
        let e = layer.config.n_routed_experts;
        // calibrated-like per-expert scales, and w3 global scales that differ from w1's
        let s = ActScales::Fixed {
            gs1: (0..e).map(|_| rng.gen_range(50.0..600.0)).collect(),
            gs2: (0..e).map(|_| rng.gen_range(50.0..600.0)).collect(),
        };
        for ex in layer.experts.iter_mut() {
            ex.w3.weight.scale_2 *= rng.gen_range(1.5f32..3.0);
        }
        let ours = routed_cpu(&layer, &x, &r, &s).unwrap();
        let zeros = vec![0f32; ours.len()];
        let ActScales::Fixed { gs1, gs2 } = &s else {
            unreachable!()
        };
        let bare = |f: &dyn Fn(&mut crate::moe::Expert, usize)| {
            let mut l = layer.clone();
            l.shared = None;
            for (i, ex) in l.experts.iter_mut().enumerate() {
                f(ex, i);
            }
            l
        };
        let inverted = ActScales::Fixed {
            gs1: gs1.iter().map(|g| 1.0 / g).collect(),
            gs2: gs2.iter().map(|g| 1.0 / g).collect(),
        };
        let default = ActScales::Fixed {
            gs1: vec![2688.0; e],
            gs2: vec![2688.0; e],
        };
        // alpha = gs · weight_scale_2: the per-expert global scales times gs²
        let alpha = bare(&|ex, i| {
            ex.w1.weight.scale_2 *= gs1[i] * gs1[i];
            ex.w3.weight.scale_2 *= gs1[i] * gs1[i];
            ex.w2.weight.scale_2 *= gs2[i] * gs2[i];
        });
        let nibbles = bare(&|ex, _| {
            for w in [&mut ex.w1, &mut ex.w3, &mut ex.w2] {
                for b in w.weight.packed.iter_mut() {
                    *b = (*b % 16) * 16 + *b / 16; // low nibble up, high down
                }
            }
        });
        let gate_scale = bare(&|ex, _| ex.w3.weight.scale_2 = ex.w1.weight.scale_2);
        let cases = [
            (
                SuspectedBug::GlobalScalesInverted,
                routed_cpu(&layer, &x, &r, &inverted).unwrap(),
            ),
            (
                SuspectedBug::DefaultGsUsed,
                routed_cpu(&layer, &x, &r, &default).unwrap(),
            ),
            (
                SuspectedBug::AlphaUsesGs,
                routed_cpu(&alpha, &x, &r, &s).unwrap(),
            ),
            (
                SuspectedBug::NibblesSwapped,
                routed_cpu(&nibbles, &x, &r, &s).unwrap(),
            ),
            (
                SuspectedBug::UpUsesGateScale2,
                routed_cpu(&gate_scale, &x, &r, &s).unwrap(),
            ),
        ];
        let feeding = Feeding {
            layout: None,
            ep: None,
        };
        let variants = bug_variants(&layer, &x, &r, &s, feeding).unwrap();
        let o = |theirs: &'_ [f32]| judge_routed(theirs, &ours, &zeros, &variants);
        assert!(o(&ours).pass(), "seed {seed}");
        for (bug, theirs) in &cases {
            let j = o(theirs);
            assert!(!j.pass(), "seed {seed} {bug:?}");
            assert_eq!(j.diagnosis, Some(*bug), "seed {seed}: {:?}", j.suspects);
            assert!(j.blame().unwrap().contains(bug.describe()), "seed {seed}");
        }
        // equal w1/w3 global scales: the gate-scale bug changes nothing and is no suspect
        let (layer, x, r, _) = setup(seed);
        let v = bug_variants(&layer, &x, &r, &s, feeding).unwrap();
        assert!(
            !v.iter().any(|(b, _)| *b == SuspectedBug::UpUsesGateScale2),
            "seed {seed}"
        );
    }

    /// Guards: a wrong-slot bug under near-equal routing weights (DeepSeek's top-8 of normalized
    /// sigmoid scores) moves the output past the agreement bar but within what "explains"
    /// tolerates; it was dropped as no suspect, so compare-outputs failed it naming nothing. It
    /// is named now, and an imprecise kernel as far from ours is not given its name.
    #[test]
    fn a_wrong_slot_bug_under_near_equal_weights_is_named() {
        use rand::{Rng, SeedableRng};
        let seed: u64 = rand::random();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let (layer, x, r, s) = setup(seed);
        let h = layer.config.hidden_size;
        let ps = per_slot_cpu(&variant_layer(&layer, |x| x.clone()), &x, &r, &s).unwrap();
        let shift = wrong_slot_bugs()[0];
        assert_eq!(shift.0, SuspectedBug::WeightsShiftedForward);
        let eps: Vec<f32> = (0..r.topk_weights.len())
            .map(|_| rng.gen_range(-1.0f32..1.0))
            .collect();
        // weights (2.5 / K)·(1 + a·eps) (normalized, routed_scaling_factor 2.5), `a` set so
        // the shifted output lands between the two bars
        let (agree, explain) = (
            max_rel_l2(AGREE_MIN_COSINE),
            max_rel_l2(EXPLAINS_MIN_COSINE),
        );
        let c = 2.5 / r.top_k as f32;
        let near_equal = |a: f32| Routing {
            topk_weights: eps.iter().map(|e| c * (1.0 + a * e)).collect(),
            ..r.clone()
        };
        let rel = |a: f32| {
            let ra = near_equal(a);
            let ours = routed_sum(&ps, &ra, h);
            compare(&routed_sum(&ps, &move_weights(&ra, shift.1), h), &ours).rel_l2
        };
        let a = 0.01 * ((agree * explain).sqrt() / rel(0.01)) as f32;
        let m = rel(a);
        assert!(agree < m && m < explain, "seed {seed}: rel-L2 {m}");
        let r = near_equal(a);
        let ours = routed_sum(&ps, &r, h);
        let theirs = routed_sum(&ps, &move_weights(&r, shift.1), h);
        // ours plus noise of the same rel-L2 as the bug's
        let noise: Vec<f32> = ours.iter().map(|_| rng.gen_range(-1.0f32..1.0)).collect();
        let norm = |v: &[f32]| v.iter().map(|&x| (x as f64).powi(2)).sum::<f64>().sqrt();
        let k = (m * norm(&ours) / norm(&noise)) as f32;
        let imprecise: Vec<f32> = ours.iter().zip(&noise).map(|(o, n)| o + k * n).collect();
        let zeros = vec![0f32; ours.len()];
        let feeding = Feeding {
            layout: None,
            ep: None,
        };
        let variants = bug_variants(&layer, &x, &r, &s, feeding).unwrap();
        let o = |theirs: &'_ [f32]| judge_routed(theirs, &ours, &zeros, &variants);
        assert!(o(&ours).pass(), "seed {seed}");
        let j = o(&theirs);
        assert!(!j.pass(), "seed {seed}");
        assert_eq!(
            j.diagnosis,
            Some(SuspectedBug::WeightsShiftedForward),
            "seed {seed}: {:?}",
            j.suspects
        );
        let j = o(&imprecise);
        assert!(
            !j.pass() && j.diagnosis.is_none(),
            "seed {seed}: {:?}",
            j.suspects
        );
        // nearer the bug's output than ours, yet not it (another small routing-weight error,
        // e.g. the selection bias left in the weights): not given its name either
        let k = 0.7 * k;
        let near_miss: Vec<f32> = theirs.iter().zip(&noise).map(|(t, n)| t + k * n).collect();
        let j = o(&near_miss);
        assert!(
            !j.pass() && j.diagnosis.is_none(),
            "seed {seed}: {:?}",
            j.suspects
        );
    }

    /// Guards: a kernel clamping only one side of the SwiGLU at swiglu_limit (gate only, or up
    /// only) failed with no known bug named.
    #[test]
    fn a_one_sided_swiglu_clamp_is_named() {
        let seed: u64 = rand::random();
        let (mut layer, x, r, s) = setup(seed);
        layer.config.swiglu_limit = Some(0.75);
        let ours = routed_cpu(&layer, &x, &r, &s).unwrap();
        let zeros = vec![0f32; ours.len()];
        let feeding = Feeding {
            layout: None,
            ep: None,
        };
        let variants = bug_variants(&layer, &x, &r, &s, feeding).unwrap();
        let path = Path::Nvfp4 {
            scales: &s,
            flavor: Flavor::Reference,
        };
        for (bug, clamp) in [
            (
                SuspectedBug::SwigluGateClampOnly,
                SwigluClamp {
                    gate: Some(0.75),
                    up: None,
                },
            ),
            (
                SuspectedBug::SwigluUpClampOnly,
                SwigluClamp {
                    gate: None,
                    up: Some(0.75),
                },
            ),
        ] {
            let o = crate::moe::forward::moe_forward_clamped(
                &variant_layer(&layer, |x| x.clone()),
                &x,
                &r,
                &path,
                true,
                clamp,
            )
            .unwrap();
            let theirs = routed_sum(&o.per_slot.unwrap(), &r, layer.config.hidden_size);
            let j = judge_routed(&theirs, &ours, &zeros, &variants);
            assert!(!j.pass(), "seed {seed}: {bug:?} passed");
            assert_eq!(j.diagnosis, Some(bug), "seed {seed}: {:?}", j.suspects);
        }
        // the correct output names nothing
        assert!(judge_routed(&ours, &ours, &zeros, &variants).pass());
    }

    /// Guards: one expert serving a single token of many, its output wrong (gate
    /// weight_scale_2 doubled), passed: the error stays under the layer-wide agreement bar.
    #[test]
    fn one_wrong_expert_row_among_many_tokens_is_named() {
        use rand::{Rng, SeedableRng};
        let seed: u64 = rand::random();
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let (t, k, h, e) = (8192usize, 4usize, 64usize, 16usize);
        // expert 0 serves token 0 only; the others the rest
        let mut ids = vec![0i32; t * k];
        for (s, id) in ids.iter_mut().enumerate() {
            *id = if s == 0 {
                0
            } else {
                1 + ((s * 7 + s / k) % (e - 1)) as i32
            };
        }
        let r = Routing {
            tokens: t,
            top_k: k,
            topk_ids: ids,
            topk_weights: vec![0.25; t * k],
        };
        let ours: Vec<f32> = (0..t * h).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
        // token 0's row off by 0.3 of its norm (a single slot's gate scale doubled: 0.14 to
        // 0.6), and every value by FP32 summation noise
        let mut theirs: Vec<f32> = ours
            .iter()
            .map(|&v| v * (1.0 + rng.gen_range(-3e-7f32..3e-7)))
            .collect();
        let norm = ours[..h].iter().map(|v| v * v).sum::<f32>().sqrt();
        let d: Vec<f32> = (0..h).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
        let dn = d.iter().map(|v| v * v).sum::<f32>().sqrt();
        for (o, dv) in theirs[..h].iter_mut().zip(&d) {
            *o += 0.3 * norm * dv / dn;
        }
        let zeros = vec![0f32; ours.len()];
        // the layer-wide judgement lets it through ...
        assert!(
            judge_routed(&theirs, &ours, &zeros, &[]).pass(),
            "seed {seed}"
        );
        // ... the expert's own rows do not
        let bad = deviating_experts(&theirs, &ours, &r, h, e);
        assert_eq!(bad.len(), 1, "seed {seed}: {bad:?}");
        assert_eq!((bad[0].expert, bad[0].slots), (0, 1), "seed {seed}");
        assert!(deviating_experts_text(&bad, 1.0).contains("expert 0 (1 slot)"));
        // summation noise alone names no expert
        let clean: Vec<f32> = ours
            .iter()
            .map(|&v| v * (1.0 + rng.gen_range(-3e-7f32..3e-7)))
            .collect();
        assert!(
            deviating_experts(&clean, &ours, &r, h, e).is_empty(),
            "seed {seed}"
        );
    }

    /// An output off by a factor has cosine 1 with ours: it used to "agree" with the built-in
    /// kernel, and the blame went to the inputs ("not the kernel"). Now it fails as the kernel's
    /// scale error, with the factor.
    #[test]
    fn a_scaled_output_is_a_kernel_scale_error() {
        let seed: u64 = rand::random();
        let (layer, x, r, s) = setup(seed);
        let ours = routed_cpu(&layer, &x, &r, &s).unwrap();
        let zeros = vec![0f32; ours.len()];
        let factor = 1.5 + rand::random::<f32>();
        let theirs: Vec<f32> = ours.iter().map(|v| v * factor).collect();
        let o = Outputs {
            theirs_routed: &theirs,
            ours_routed: &ours,
            ours_layer: &ours,
            reference_layer: &ours,
            shared: &zeros,
        };
        let j = judge(&o, 0.95, &[]);
        assert!(!j.agree && !j.pass(), "seed {seed}");
        assert!(
            (j.scale_vs_ours - factor as f64).abs() < 1e-4,
            "seed {seed}"
        );
        let b = j.blame().unwrap();
        assert!(b.contains("scale error"), "seed {seed}: {b}");
        assert!(
            b.contains("bug is in the kernel under test"),
            "seed {seed}: {b}"
        );
        assert!(!b.contains("not the kernel"), "seed {seed}: {b}");
        // a BF16-rounded copy of ours still agrees
        let bf: Vec<f32> = ours
            .iter()
            .map(|&v| half::bf16::from_f32(v).to_f32())
            .collect();
        let o = Outputs {
            theirs_routed: &bf,
            ..o
        };
        assert!(judge(&o, 0.95, &[]).pass(), "seed {seed}");

        // the shared experts added to the routed output are named, not just "a deviation"
        let h = layer.config.hidden_size;
        let shared = crate::moe::forward::dense_forward(
            layer.shared.as_ref().expect("tiny has a shared expert"),
            &x,
            r.tokens,
            h,
            layer.config.swiglu_limit,
        );
        let layer_out: Vec<f32> = ours.iter().zip(&shared).map(|(a, b)| a + b).collect();
        let feeding = Feeding {
            layout: Some(ScaleLayout::Linear),
            ep: None,
        };
        let variants = bug_variants(&layer, &x, &r, &s, feeding).unwrap();
        let o = Outputs {
            theirs_routed: &layer_out,
            ours_routed: &ours,
            ours_layer: &layer_out,
            reference_layer: &layer_out,
            shared: &shared,
        };
        let j = judge(&o, 0.95, &variants);
        assert!(!j.pass(), "seed {seed}");
        assert_eq!(
            j.diagnosis,
            Some(SuspectedBug::SharedExpertsIncluded),
            "seed {seed}: {:?}",
            j.suspects
        );
    }
}
