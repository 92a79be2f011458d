//! Expert parallelism (EP), the numerics: rank r of N holds the experts its [`ExpertMap`] gives
//! it (`expert_map[global] = local | -1`), computes its share of the routed output for every
//! token (a slot routed to another rank's expert contributes 0 there), rank 0 alone adds the
//! shared experts, and the partial outputs are summed (the all-reduce). [`run`] lays the ranks
//! over devices and does the reduction; this module never touches a device.
//!
//! **How a rank computes nothing for a slot without new kernels.** The rank's layer gets one
//! extra *null expert* (all-zero weights, `weight_scale_2` 1) and the slots it must not compute
//! go there with weight 0: `0 · (x · 0)` is exactly 0, so the rank's partial is the slot-order
//! sum of its own slots, on the CPU and on the GPU kernels alike. The null expert's rows still
//! pass through the activation quantizer; [`RankLayer::null_stats`] recomputes those blocks on
//! the host so the runner can take them out of the activation statistics.
//!
//! **Tolerance against `--ep 1`.** Each (token, slot) expert output `y` is computed from the
//! same row, by the same expert, with the same gs (dynamic gs2 sees the same rows, since the
//! owner sees every row routed to its expert), and expert GEMMs are row-independent, so `y` is
//! bitwise the one of the unsharded run. What changes is the FP32 summation order of the
//! combine: `--ep 1` sums the K products `p = fl(w·y)` in slot order and adds the shared
//! output; EP sums each rank's own products, then the partials in rank order (or in NCCL's
//! ring order). Both are summation trees over the same n ≤ K + 1 non-zero terms (adding an
//! exact zero rounds nothing), so each lies within `γ_K · Σ|terms|` of the exact sum
//! (Higham, *Accuracy and Stability*, §4.2; `γ_n = n·u / (1 − n·u)`, `u = 2^-24`), hence
//! `|ep − ep1| ≤ 2·γ_K·Σ|terms|` elementwise. The shared output is not kept, so `Σ|terms|` is
//! bounded by `(2·Σ_slot |p| + |out_ep1|) / (1 − γ_K)` (`|shared| ≤ |out| + Σ|p|` up to the
//! same rounding). [`combine_bound`] gives that bound; for K = 8 it is ≈ 1e-6 of the
//! magnitudes involved. With one rank the computation is the unsharded one: bitwise equal.
//!
//! **Faults** (`--fault`): the id conventions flipped as buggy engines did. Under `local-ids`
//! a rank is handed local ids (expert_map already applied, -1 for other ranks' experts) and
//! takes them for global ids, applying expert_map again: ids that are not its own global ids
//! map to -1 and the tokens are silently dropped. Under `global-ids` a rank is handed global
//! ids and indexes its local expert table with them: ids below its expert count pick the
//! wrong expert, the rest fall off the table.

pub mod run;

use super::ep::check::IdSpace;
use super::ep::ExpertMap;
use super::forward::{amax, dynamic_gs};
use super::{ActScales, Expert, MoeLayer, MoeOutput, QLinear, Router, Routing};
use crate::error::{Error, Result};
use crate::nvfp4::{e4m3, quantize_nvfp4, BlockStats, Format, Fp4Tensor};
use serde::Serialize;

pub use super::ep::Placement;

/// Unit roundoff of f32.
pub const U: f64 = f32::EPSILON as f64 / 2.0;

/// `γ_n = n·u / (1 − n·u)`: the relative error bound of a sum of n + 1 terms in any order.
pub fn gamma(n: usize) -> f64 {
    let nu = n as f64 * U;
    nu / (1.0 - nu)
}

/// `--fault`: a flipped id convention on every rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum EpFault {
    /// Ranks are handed local ids (expert_map applied, -1 for other ranks) and take them for
    /// global ids: expert_map is applied twice and tokens are silently dropped
    #[value(alias = "local-as-global")]
    LocalIds,
    /// Ranks are handed global ids and index their local expert table with them: expert_map
    /// is never applied, wrong experts run and ids past the table are dropped
    #[value(alias = "global-as-local")]
    GlobalIds,
}

impl EpFault {
    pub fn name(self) -> &'static str {
        match self {
            EpFault::LocalIds => "local-ids",
            EpFault::GlobalIds => "global-ids",
        }
    }

    /// The flipped convention, in words.
    pub fn describe(self) -> &'static str {
        match self {
            EpFault::LocalIds => {
                "handed local expert ids (expert_map already applied) but takes them for global ids: \
                 expert_map is applied a second time"
            }
            EpFault::GlobalIds => {
                "handed global expert ids but indexes its local expert table with them: expert_map \
                 is never applied"
            }
        }
    }
}

/// What a rank is handed, and what its MoE kernel takes those ids for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Convention {
    pub handed: IdSpace,
    pub taken_as: IdSpace,
}

impl Convention {
    pub fn of(fault: Option<EpFault>) -> Convention {
        let (handed, taken_as) = match fault {
            None => (IdSpace::Global, IdSpace::Global),
            Some(EpFault::LocalIds) => (IdSpace::Local, IdSpace::Global),
            Some(EpFault::GlobalIds) => (IdSpace::Global, IdSpace::Local),
        };
        Convention { handed, taken_as }
    }
}

/// What one rank did with the (token, slot) pairs of the batch.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct RankSlots {
    /// Pairs routed to this rank's experts.
    pub owned: u64,
    /// Pairs this rank computed, with some local expert.
    pub computed: u64,
    /// Owned pairs computed with the right expert.
    pub correct: u64,
    /// Owned pairs this rank never computed: silently dropped.
    pub dropped: u64,
    /// Owned pairs computed with another expert.
    pub wrong_expert: u64,
    /// Pairs of other ranks' experts this rank computed anyway, with one of its own experts.
    pub spurious: u64,
}

/// One rank's view of a batch: what it is handed and which local expert each slot runs on.
#[derive(Clone, Debug)]
pub struct RankPlan {
    pub map: ExpertMap,
    pub convention: Convention,
    /// `[T*K]`: the ids this rank is handed (`-1` = another rank's expert, local convention).
    pub handed: Vec<i64>,
    /// `[T*K]`: the local expert each slot runs on; `None` = the rank computes nothing for it.
    pub local: Vec<Option<usize>>,
    pub slots: RankSlots,
}

/// Plan rank `map.ep_rank` on `routing` (global ids), under `fault` or the right convention.
pub fn plan_rank(routing: &Routing, map: ExpertMap, fault: Option<EpFault>) -> RankPlan {
    let convention = Convention::of(fault);
    let n_local = map.num_local();
    let mut slots = RankSlots::default();
    let mut handed = Vec::with_capacity(routing.topk_ids.len());
    let mut local = Vec::with_capacity(routing.topk_ids.len());
    for &id in &routing.topk_ids {
        let g = id as i64;
        let h = match convention.handed {
            IdSpace::Global => g,
            IdSpace::Local => map.local(g).map_or(-1, |l| l as i64),
        };
        let l = match convention.taken_as {
            IdSpace::Global => map.local(h),
            IdSpace::Local => usize::try_from(h).ok().filter(|&l| l < n_local),
        };
        let owned = map.owns(g);
        slots.owned += u64::from(owned);
        slots.computed += u64::from(l.is_some());
        match (owned, l) {
            (true, None) => slots.dropped += 1,
            (true, Some(l)) if map.global(l as i64) == usize::try_from(g).ok() => {
                slots.correct += 1
            }
            (true, Some(_)) => slots.wrong_expert += 1,
            (false, Some(_)) => slots.spurious += 1,
            (false, None) => {}
        }
        handed.push(h);
        local.push(l);
    }
    RankPlan {
        map,
        convention,
        handed,
        local,
        slots,
    }
}

/// Global scales of the null expert: fixed 1 (its output is 0 whatever they are), or the
/// per-batch dynamic scales when the layer runs dynamic.
#[derive(Clone, Copy, Debug)]
enum NullGs {
    Fixed,
    Dynamic { gs1: f32 },
}

/// The layer, routing and scales one rank runs.
#[derive(Clone, Debug)]
pub struct RankLayer {
    pub layer: MoeLayer,
    /// Local ids; slots the rank does not compute go to the null expert with weight 0.
    pub routing: Routing,
    pub scales: ActScales,
    /// Local index of the null expert, when some slot needs it.
    pub null_expert: Option<usize>,
    /// The token of every slot sent to the null expert, in slot order.
    null_tokens: Vec<usize>,
    null_gs: NullGs,
}

fn null_linear(format: Format, rows: usize, cols: usize) -> QLinear {
    QLinear {
        weight: Fp4Tensor {
            format,
            rows,
            cols,
            packed: vec![0; rows * cols / 2],
            scales: vec![0; rows * (cols / format.block())],
            scale_2: 1.0,
        },
        input_scale: None,
        original: None,
    }
}

/// The NVFP4 weights of an expert without the BF16 originals (a rank runs the NVFP4 path
/// only; the reference is computed unsharded).
fn nvfp4_only(x: &Expert) -> Expert {
    let strip = |q: &QLinear| QLinear {
        weight: q.weight.clone(),
        input_scale: q.input_scale,
        original: None,
    };
    Expert {
        w1: strip(&x.w1),
        w3: strip(&x.w3),
        w2: strip(&x.w2),
    }
}

/// Build rank `plan.map.ep_rank`'s layer: its experts in local order (plus the null expert
/// when needed), the shared experts on rank 0 only, a router that is never used (the routing
/// is given) and local global scales.
pub fn rank_layer(
    layer: &MoeLayer,
    plan: &RankPlan,
    routing: &Routing,
    scales: &ActScales,
    hidden: &[f32],
) -> Result<RankLayer> {
    let c = &layer.config;
    let (h, i, e) = (c.hidden_size, c.moe_intermediate_size, c.n_routed_experts);
    let map = &plan.map;
    if map.num_experts != e || layer.experts.len() != e {
        return Err(Error::usage(format!(
            "MoE layer {}: the EP map covers {} experts, the layer has {} (config {e})",
            layer.index,
            map.num_experts,
            layer.experts.len()
        )));
    }
    if plan.local.len() != routing.topk_ids.len()
        || routing.topk_weights.len() != routing.topk_ids.len()
    {
        return Err(Error::usage(format!(
            "MoE layer {}: the EP plan of rank {} covers {} slots, the routing {}",
            layer.index,
            map.ep_rank,
            plan.local.len(),
            routing.topk_ids.len()
        )));
    }
    let mut experts: Vec<Expert> = Vec::with_capacity(map.num_local() + 1);
    for &g in map.local_to_global() {
        let x = layer
            .experts
            .get(g)
            .ok_or_else(|| Error::usage(format!("MoE layer {}: no expert {g}", layer.index)))?;
        experts.push(nvfp4_only(x));
    }
    let n_local = experts.len();
    let k = routing.top_k.max(1);
    let null_tokens: Vec<usize> = plan
        .local
        .iter()
        .enumerate()
        .filter(|(_, l)| l.is_none())
        .map(|(s, _)| s / k)
        .collect();
    let null_expert = (!null_tokens.is_empty()).then_some(n_local);
    if null_expert.is_some() {
        let format = layer
            .experts
            .first()
            .map_or(Format::Nvfp4, |x| x.w1.weight.format);
        experts.push(Expert {
            w1: null_linear(format, i, h),
            w3: null_linear(format, i, h),
            w2: null_linear(format, h, i),
        });
    }
    let n = experts.len();
    let null_id = null_expert.unwrap_or(0) as i32;
    let mut ids = Vec::with_capacity(plan.local.len());
    let mut weights = Vec::with_capacity(plan.local.len());
    for (l, &w) in plan.local.iter().zip(&routing.topk_weights) {
        match l {
            Some(l) => {
                ids.push(*l as i32);
                weights.push(w);
            }
            None => {
                ids.push(null_id);
                weights.push(0.0);
            }
        }
    }
    let (local_scales, null_gs) = match scales {
        ActScales::Fixed { gs1, gs2 } => {
            if gs1.len() != e || gs2.len() != e {
                return Err(Error::usage(format!(
                    "MoE layer {}: {} gs1 and {} gs2 values for {e} experts",
                    layer.index,
                    gs1.len(),
                    gs2.len()
                )));
            }
            let pick = |v: &[f32]| -> Vec<f32> {
                let mut out: Vec<f32> = map.local_to_global().iter().map(|&g| v[g]).collect();
                if null_expert.is_some() {
                    out.push(1.0);
                }
                out
            };
            (
                ActScales::Fixed {
                    gs1: pick(gs1),
                    gs2: pick(gs2),
                },
                NullGs::Fixed,
            )
        }
        ActScales::Dynamic => (
            ActScales::Dynamic,
            NullGs::Dynamic {
                gs1: dynamic_gs(amax(hidden)),
            },
        ),
    };
    let mut config = c.clone();
    config.n_routed_experts = n;
    config.num_experts_per_tok = c.num_experts_per_tok.min(n).max(1);
    config.n_group = 1;
    config.topk_group = 1;
    config.num_hash_layers = 0;
    let rank_layer = MoeLayer {
        index: layer.index,
        config,
        router: Router {
            weight: vec![0.0; n * h],
            e_score_correction_bias: None,
            tid2eid: None,
        },
        experts,
        shared: if map.ep_rank == 0 {
            layer.shared.clone()
        } else {
            None
        },
        norm_weight: None,
    };
    Ok(RankLayer {
        layer: rank_layer,
        routing: Routing {
            tokens: routing.tokens,
            top_k: routing.top_k,
            topk_ids: ids,
            topk_weights: weights,
        },
        scales: local_scales,
        null_expert,
        null_tokens,
        null_gs,
    })
}

impl RankLayer {
    /// The activation blocks the null expert's rows added to the rank's statistics, computed
    /// as the forward does: its gate/up input is the token rows quantized with its gs1; its
    /// GEMMs give 0 (NaN for a row whose quantized input holds a NaN scale), so its down input
    /// is rows of 0 (or NaN) quantized with its gs2 (dynamic: 2688 / amax of those rows).
    pub fn null_stats(&self, hidden: &[f32]) -> BlockStats {
        let c = &self.layer.config;
        let (h, i) = (c.hidden_size, c.moe_intermediate_size);
        let m = self.null_tokens.len();
        if m == 0 || h == 0 || i == 0 {
            return BlockStats::default();
        }
        let mut x = Vec::with_capacity(m * h);
        for &t in &self.null_tokens {
            match hidden.get(t * h..(t + 1) * h) {
                Some(row) => x.extend_from_slice(row),
                None => return BlockStats::default(),
            }
        }
        let gs1 = match self.null_gs {
            NullGs::Fixed => 1.0,
            NullGs::Dynamic { gs1 } => gs1,
        };
        let (q, mut stats) = quantize_nvfp4(&x, m, h, gs1);
        let kb = h / 16;
        let mut a = Vec::with_capacity(m * i);
        for r in 0..m {
            let nan_row = q
                .scales
                .get(r * kb..(r + 1) * kb)
                .is_some_and(|s| s.iter().any(|&code| e4m3::is_nan(code)));
            let v = if nan_row { f32::NAN } else { 0.0 };
            a.extend(std::iter::repeat_n(v, i));
        }
        let gs2 = match self.null_gs {
            NullGs::Fixed => 1.0,
            NullGs::Dynamic { .. } => dynamic_gs(amax(&a)),
        };
        let (_, st2) = quantize_nvfp4(&a, m, i, gs2);
        stats.blocks += st2.blocks;
        stats.saturated += st2.saturated;
        stats.flushed += st2.flushed;
        stats.nan_scales += st2.nan_scales;
        stats
    }
}

/// `a − b` per counter (never below 0).
pub fn stats_minus(a: &BlockStats, b: &BlockStats) -> BlockStats {
    BlockStats {
        blocks: a.blocks.saturating_sub(b.blocks),
        saturated: a.saturated.saturating_sub(b.saturated),
        flushed: a.flushed.saturating_sub(b.flushed),
        nan_scales: a.nan_scales.saturating_sub(b.nan_scales),
    }
}

pub fn stats_plus(a: &BlockStats, b: &BlockStats) -> BlockStats {
    BlockStats {
        blocks: a.blocks + b.blocks,
        saturated: a.saturated + b.saturated,
        flushed: a.flushed + b.flushed,
        nan_scales: a.nan_scales + b.nan_scales,
    }
}

/// The all-reduce on the host: `((p0 + p1) + p2) + …`, in rank order.
pub fn sum_in_rank_order(partials: &[&[f32]]) -> Vec<f32> {
    let mut it = partials.iter();
    let mut acc = it.next().map_or_else(Vec::new, |p| p.to_vec());
    for p in it {
        for (a, &v) in acc.iter_mut().zip(p.iter()) {
            *a += v;
        }
    }
    acc
}

/// The per-slot outputs the EP run effectively used: for each slot, the sum (in rank order)
/// of the rows of the ranks that computed it (0 when none did). `[T*K, hidden]`.
pub fn effective_per_slot(plans: &[&RankPlan], per_slot: &[&[f32]], h: usize) -> Vec<f32> {
    let n = plans.first().map_or(0, |p| p.local.len());
    let mut out = vec![0f32; n * h];
    for (plan, rows) in plans.iter().zip(per_slot) {
        for (s, l) in plan.local.iter().enumerate() {
            if l.is_none() {
                continue;
            }
            if let (Some(dst), Some(src)) = (
                out.get_mut(s * h..(s + 1) * h),
                rows.get(s * h..(s + 1) * h),
            ) {
                for (d, &v) in dst.iter_mut().zip(src) {
                    *d += v;
                }
            }
        }
    }
    out
}

/// Elementwise bound on `|out_ep − out_ep1|` (module docs): `2·γ_K·(2·Σ_slot |fl(w·y)| +
/// |out_ep1|) / (1 − γ_K)` from the unsharded run's output and per-slot rows. Infinite where
/// a term is not finite.
pub fn combine_bound(
    out1: &[f32],
    per_slot1: &[f32],
    weights: &[f32],
    k: usize,
    h: usize,
) -> Vec<f64> {
    let g = gamma(k.max(1));
    let factor = 2.0 * g / (1.0 - g);
    out1.iter()
        .enumerate()
        .map(|(j, &o)| {
            let (t, c) = (j / h.max(1), j % h.max(1));
            let mut s = 0f64;
            for slot in 0..k {
                let e = t * k + slot;
                let w = weights.get(e).copied().unwrap_or(f32::NAN);
                let y = per_slot1.get(e * h + c).copied().unwrap_or(f32::NAN);
                s += ((w * y) as f64).abs();
            }
            let b = factor * (2.0 * s + (o as f64).abs());
            if b.is_finite() {
                b
            } else {
                f64::INFINITY
            }
        })
        .collect()
}

/// How the EP output compares with the unsharded one.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Agreement {
    pub len: usize,
    /// Every element equal (+0 and −0 count as equal, NaN equals NaN).
    pub bitwise_equal: bool,
    pub differing: usize,
    pub first_differing_index: Option<usize>,
    pub max_abs_diff: f64,
    pub max_abs_diff_index: Option<usize>,
    /// max `|Δ| / bound` (0 when equal; infinite where a NaN/Inf is on one side only).
    pub max_bound_ratio: f64,
    pub outside_bound: usize,
    pub first_outside_index: Option<usize>,
    pub within_bound: bool,
}

fn same(a: f32, b: f32) -> bool {
    a == b || (a.is_nan() && b.is_nan())
}

/// Compare `ep` with `ep1` under the elementwise `bound` ([`combine_bound`]).
pub fn agreement(ep: &[f32], ep1: &[f32], bound: &[f64]) -> Agreement {
    let mut a = Agreement {
        len: ep1.len(),
        bitwise_equal: ep.len() == ep1.len(),
        differing: 0,
        first_differing_index: None,
        max_abs_diff: 0.0,
        max_abs_diff_index: None,
        max_bound_ratio: 0.0,
        outside_bound: 0,
        first_outside_index: None,
        within_bound: ep.len() == ep1.len(),
    };
    for (j, (&x, &y)) in ep.iter().zip(ep1).enumerate() {
        if same(x, y) {
            continue;
        }
        a.differing += 1;
        a.first_differing_index.get_or_insert(j);
        let d = (x as f64 - y as f64).abs();
        let d = if d.is_nan() { f64::INFINITY } else { d };
        if d > a.max_abs_diff || a.max_abs_diff_index.is_none() {
            a.max_abs_diff = d;
            a.max_abs_diff_index = Some(j);
        }
        let b = bound.get(j).copied().unwrap_or(0.0);
        let ratio = if d.is_infinite() {
            f64::INFINITY
        } else if b > 0.0 {
            d / b
        } else {
            f64::INFINITY
        };
        if ratio > a.max_bound_ratio {
            a.max_bound_ratio = ratio;
        }
        if ratio > 1.0 {
            a.outside_bound += 1;
            a.first_outside_index.get_or_insert(j);
        }
    }
    a.bitwise_equal &= a.differing == 0;
    a.within_bound &= a.outside_bound == 0;
    a
}

/// Elements of `a` and `b` that differ (+0/−0 and NaN/NaN count as equal) and the first one.
pub fn count_differing(a: &[f32], b: &[f32]) -> (usize, Option<usize>) {
    let mut n = a.len().abs_diff(b.len());
    let mut first = (n > 0).then_some(a.len().min(b.len()));
    for (j, (&x, &y)) in a.iter().zip(b).enumerate() {
        if !same(x, y) {
            n += 1;
            first = Some(first.map_or(j, |f| f.min(j)));
        }
    }
    (n, first)
}

/// Elements whose bits differ (`to_bits`: −0 and +0 differ, NaNs differ by payload), and the
/// first one: "bit for bit" as a CUDA-graph replay must match its eager run.
pub fn bits_differing(a: &[f32], b: &[f32]) -> (usize, Option<usize>) {
    let mut n = a.len().abs_diff(b.len());
    let mut first = (n > 0).then_some(a.len().min(b.len()));
    for (j, (&x, &y)) in a.iter().zip(b).enumerate() {
        if x.to_bits() != y.to_bits() {
            n += 1;
            first = Some(first.map_or(j, |f| f.min(j)));
        }
    }
    (n, first)
}

/// Compare an EP output with the unsharded run `one` (which must carry its per-slot rows) on
/// `routing`, under [`combine_bound`].
pub fn against_unsharded(
    ep: &[f32],
    one: &MoeOutput,
    routing: &Routing,
    h: usize,
) -> Result<Agreement> {
    let ps = one.per_slot.as_deref().ok_or_else(|| {
        Error::usage("internal: the unsharded run has no per-slot outputs for the EP bound")
    })?;
    let bound = combine_bound(&one.out, ps, &routing.topk_weights, routing.top_k, h);
    Ok(agreement(ep, &one.out, &bound))
}

/// The tolerance in words, for reports.
pub fn tolerance_text(k: usize) -> String {
    format!(
        "|out_ep − out_ep1| ≤ 2·γ_K·(2·Σ_slot|w·y| + |out_ep1|)/(1 − γ_K) elementwise, γ_K = K·u/(1 − K·u), \
         u = 2^-24, K = {k} (γ_K = {:.3e}): per-slot expert outputs are bitwise those of the \
         unsharded run; only the FP32 order of the combine sum changes",
        gamma(k.max(1))
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::moe::ep::Placement;
    use crate::moe::forward::moe_forward;
    use crate::moe::synthetic::{Preset, SyntheticModel};
    use crate::moe::Path;
    use crate::nvfp4::Flavor;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn routing(rng: &mut ChaCha8Rng, t: usize, k: usize, e: usize) -> Routing {
        let mut ids = vec![];
        for _ in 0..t {
            let mut row: Vec<i32> = vec![];
            while row.len() < k {
                let x = rng.gen_range(0..e as i32);
                if !row.contains(&x) {
                    row.push(x);
                }
            }
            ids.extend(row);
        }
        Routing {
            tokens: t,
            top_k: k,
            topk_weights: (0..t * k).map(|_| rng.gen_range(0.05..1.0)).collect(),
            topk_ids: ids,
        }
    }

    #[test]
    fn clean_plans_cover_every_slot_exactly_once() {
        let seed: u64 = rand::random();
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        for _ in 0..20 {
            let n = rng.gen_range(1..=8);
            let e = rng.gen_range(n..=4 * n + 3);
            let k = rng.gen_range(1..=e.min(6));
            let t = rng.gen_range(1..40);
            let r = routing(&mut rng, t, k, e);
            for placement in [Placement::Linear, Placement::RoundRobin] {
                let maps = ExpertMap::all_ranks(e, n, placement).unwrap();
                let plans: Vec<RankPlan> =
                    maps.into_iter().map(|m| plan_rank(&r, m, None)).collect();
                for s in 0..r.topk_ids.len() {
                    let g = r.topk_ids[s] as usize;
                    let who: Vec<&RankPlan> =
                        plans.iter().filter(|p| p.local[s].is_some()).collect();
                    assert_eq!(who.len(), 1, "seed {seed}: slot {s}");
                    let l = who[0].local[s].unwrap();
                    assert_eq!(who[0].map.local_to_global()[l], g, "seed {seed}");
                }
                let total: u64 = plans.iter().map(|p| p.slots.correct).sum();
                assert_eq!(total as usize, r.topk_ids.len(), "seed {seed}");
                assert!(plans
                    .iter()
                    .all(|p| p.slots.dropped + p.slots.wrong_expert + p.slots.spurious == 0));
            }
        }
    }

    #[test]
    fn flipped_conventions_drop_and_misroute_as_engines_do() {
        let seed: u64 = rand::random();
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let r = routing(&mut rng, 50, 4, 16);
        let maps = ExpertMap::all_ranks(16, 2, Placement::Linear).unwrap();
        // local ids taken as global: rank 0's local ids are its global ids (harmless), rank 1's
        // local ids [0, 8) are rank 0's experts: expert_map gives -1, every token dropped
        let p0 = plan_rank(&r, maps[0].clone(), Some(EpFault::LocalIds));
        let p1 = plan_rank(&r, maps[1].clone(), Some(EpFault::LocalIds));
        assert_eq!(p0.slots.correct, p0.slots.owned, "seed {seed}");
        assert_eq!(p1.slots.dropped, p1.slots.owned, "seed {seed}");
        assert!(p1.slots.owned > 0);
        assert!(p1.handed.iter().all(|&h| (-1..8).contains(&h)));
        // global ids as local: rank 1 indexes its table [0, 8) with global ids: ids < 8 are
        // rank 0's slots computed with rank 1's experts, its own ids ≥ 8 fall off the table
        let q1 = plan_rank(&r, maps[1].clone(), Some(EpFault::GlobalIds));
        assert_eq!(q1.slots.dropped, q1.slots.owned, "seed {seed}");
        assert_eq!(q1.slots.spurious, p0.slots.owned, "seed {seed}");
        let q0 = plan_rank(&r, maps[0].clone(), Some(EpFault::GlobalIds));
        assert_eq!(q0.slots.correct, q0.slots.owned, "seed {seed}");
        // round-robin: local ids taken as global pick wrong experts
        let rr = ExpertMap::all_ranks(16, 4, Placement::RoundRobin).unwrap();
        let w: u64 = rr
            .iter()
            .map(|m| {
                plan_rank(&r, m.clone(), Some(EpFault::LocalIds))
                    .slots
                    .wrong_expert
            })
            .sum();
        assert!(w > 0, "seed {seed}");
    }

    fn layer_and_batch(seed: u64, tokens: usize) -> (MoeLayer, Vec<f32>, Routing) {
        let m = SyntheticModel::new(Preset::Tiny, seed);
        let layer = m.moe_layer(1).unwrap();
        let (x, ids) = m.activations(1, tokens, seed);
        let r = crate::moe::route(&layer, &x, Some(&ids)).unwrap();
        (layer, x, r)
    }

    /// The rank partials sum to the unsharded output within the bound, per-slot rows are
    /// bitwise the unsharded ones and the activation statistics add up exactly.
    #[test]
    fn ranks_sum_to_the_unsharded_layer_within_the_bound() {
        let seed: u64 = rand::random();
        let (layer, x, r) = layer_and_batch(seed, 12);
        let e = layer.config.n_routed_experts;
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let fixed = ActScales::Fixed {
            gs1: (0..e).map(|_| rng.gen_range(50.0..3000.0)).collect(),
            gs2: (0..e).map(|_| rng.gen_range(50.0..3000.0)).collect(),
        };
        for scales in [fixed, ActScales::Dynamic] {
            let path = Path::Nvfp4 {
                scales: &scales,
                flavor: Flavor::Reference,
            };
            let one = moe_forward(&layer, &x, &r, &path, true).unwrap();
            let ps1 = one.per_slot.clone().unwrap();
            let bound = combine_bound(&one.out, &ps1, &r.topk_weights, r.top_k, 256);
            for n in [1, 3, 4] {
                let maps = ExpertMap::all_ranks(e, n, Placement::RoundRobin).unwrap();
                let plans: Vec<RankPlan> =
                    maps.into_iter().map(|m| plan_rank(&r, m, None)).collect();
                let mut parts = vec![];
                let mut rows = vec![];
                let mut stats = BlockStats::default();
                for p in &plans {
                    let rl = rank_layer(&layer, p, &r, &scales, &x).unwrap();
                    let path = Path::Nvfp4 {
                        scales: &rl.scales,
                        flavor: Flavor::Reference,
                    };
                    let o = moe_forward(&rl.layer, &x, &rl.routing, &path, true).unwrap();
                    stats = stats_plus(&stats, &stats_minus(&o.act_stats, &rl.null_stats(&x)));
                    parts.push(o.out);
                    rows.push(o.per_slot.unwrap());
                }
                let refs: Vec<&[f32]> = parts.iter().map(|p| p.as_slice()).collect();
                let out = sum_in_rank_order(&refs);
                let a = agreement(&out, &one.out, &bound);
                assert!(a.within_bound, "seed {seed} n {n}: {a:?}");
                if n == 1 {
                    assert!(a.bitwise_equal, "seed {seed}: {a:?}");
                }
                let pr: Vec<&RankPlan> = plans.iter().collect();
                let rr: Vec<&[f32]> = rows.iter().map(|p| p.as_slice()).collect();
                let eff = effective_per_slot(&pr, &rr, 256);
                assert_eq!(count_differing(&eff, &ps1).0, 0, "seed {seed} n {n}");
                assert_eq!(stats, one.act_stats, "seed {seed} n {n}");
            }
        }
    }

    #[test]
    fn null_stats_follow_nan_rows_and_dynamic_scales() {
        let seed: u64 = rand::random();
        let (layer, mut x, r) = layer_and_batch(seed, 6);
        // a NaN in token 2: its null rows have NaN scales at both quantizations
        x[2 * 256 + 5] = f32::NAN;
        for scales in [
            ActScales::Fixed {
                gs1: vec![300.0; 16],
                gs2: vec![300.0; 16],
            },
            ActScales::Dynamic,
        ] {
            let maps = ExpertMap::all_ranks(16, 2, Placement::Linear).unwrap();
            for m in maps {
                let p = plan_rank(&r, m, None);
                let rl = rank_layer(&layer, &p, &r, &scales, &x).unwrap();
                let path = Path::Nvfp4 {
                    scales: &rl.scales,
                    flavor: Flavor::Reference,
                };
                let o = moe_forward(&rl.layer, &x, &rl.routing, &path, false).unwrap();
                // the null expert alone: the same layer with every slot sent there
                let mut only_null = rl.clone();
                only_null.routing.topk_ids = vec![rl.null_expert.unwrap() as i32; r.topk_ids.len()];
                only_null.null_tokens = (0..r.topk_ids.len()).map(|s| s / r.top_k).collect();
                let path = Path::Nvfp4 {
                    scales: &only_null.scales,
                    flavor: Flavor::Reference,
                };
                let on =
                    moe_forward(&only_null.layer, &x, &only_null.routing, &path, false).unwrap();
                assert_eq!(only_null.null_stats(&x), on.act_stats, "seed {seed}");
                assert!(o.act_stats.blocks >= rl.null_stats(&x).blocks);
            }
        }
    }

    #[test]
    fn agreement_counts_and_bounds() {
        let bound = vec![1e-6; 4];
        let a = agreement(&[1.0, 2.0, 3.0, -0.0], &[1.0, 2.0, 3.0, 0.0], &bound);
        assert!(a.bitwise_equal && a.within_bound);
        let a = agreement(
            &[1.0, 2.0 + 2.5e-7, 3.0, 0.0],
            &[1.0, 2.0, 3.0, 0.0],
            &bound,
        );
        assert!(!a.bitwise_equal && a.within_bound && a.differing == 1);
        let a = agreement(&[1.0, 2.5, f32::NAN, 0.0], &[1.0, 2.0, 3.0, 0.0], &bound);
        assert_eq!(a.outside_bound, 2);
        assert_eq!(a.first_outside_index, Some(1));
        assert!(a.max_bound_ratio.is_infinite());
        assert_eq!(
            count_differing(&[1.0, f32::NAN], &[1.0, f32::NAN]),
            (0, None)
        );
        assert_eq!(count_differing(&[1.0, 2.0], &[1.0, 3.0]), (1, Some(1)));
        assert!(gamma(8) > 8.0 * U && gamma(8) < 8.1 * U);
    }
}
