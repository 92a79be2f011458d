//! Checks of a routing dump (H4: do tokens reach the right experts?). Each check returns
//! findings (any finding fails the verdict) and notes (conventions recognized, checks skipped).
//! Pure logic over ids and weights: no I/O, no printing.

use super::{owner_rank, ExpertMap, Placement};
use crate::moe::Routing;
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet};

/// A pattern of ids is only called a bug when it would arise by chance with probability
/// below this under uniform routing (real routing is skewed, hence the margin).
const CHANCE: f64 = 1e-6;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FindingKind {
    OutOfRange,
    DuplicateIds,
    NonfiniteWeights,
    NegativeWeights,
    WeightSum,
    TopKMismatch,
    LocalIdsAsGlobal,
    GlobalIdsAsLocal,
    /// The dump's ids are the recomputed ones shifted by ±1 (plainly or modulo E).
    IdsShifted,
    ConfinedToRank,
    IdleRanks,
    RoutingMismatch,
    WeightError,
    LogitsMismatch,
    HashMismatch,
    /// NaN/Inf in the hidden states or router logits the dump holds.
    NonfiniteInputs,
    /// Tokens routed to experts the router would not pick even with its logits moved by their
    /// rounding in the dump's favour: not the near-ties `--min-match` tolerates.
    ClearMismatch,
}

/// Where a finding first shows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Slot {
    pub token: usize,
    pub slot: usize,
    pub id: i64,
}

#[derive(Clone, Debug, Serialize)]
pub struct Finding {
    pub kind: FindingKind,
    pub message: String,
    /// How many slots (or tokens, or ranks: the message says which) are affected.
    pub count: u64,
    pub first: Option<Slot>,
}

impl Finding {
    fn new(kind: FindingKind, count: u64, first: Option<Slot>, message: String) -> Finding {
        Finding {
            kind,
            message,
            count,
            first,
        }
    }
}

/// Which id space the dump is supposed to hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum IdSpace {
    /// Router output: global expert ids in `[0, E)`.
    Global,
    /// After `expert_map`: local ids of this rank in `[0, n_local)`, `-1` for other ranks'.
    Local,
}

/// What the model config says the routing must look like.
#[derive(Clone, Debug, Default)]
pub struct Expectations {
    pub num_experts: usize,
    /// `num_experts_per_tok`, when known.
    pub top_k: Option<usize>,
    pub norm_topk_prob: Option<bool>,
    pub routed_scaling_factor: Option<f32>,
}

/// A borrowed view of the ids and weights under test (`[tokens, top_k]` each).
#[derive(Clone, Copy, Debug)]
pub struct Ids<'a> {
    pub tokens: usize,
    pub top_k: usize,
    pub ids: &'a [i64],
    pub weights: &'a [f32],
}

impl Ids<'_> {
    fn slot(&self, i: usize) -> Slot {
        Slot {
            token: i / self.top_k.max(1),
            slot: i % self.top_k.max(1),
            id: self.ids[i],
        }
    }
    fn row(&self, t: usize) -> &[i64] {
        &self.ids[t * self.top_k..(t + 1) * self.top_k]
    }
}

/// The outcome of all checks run on one dump.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Outcome {
    pub findings: Vec<Finding>,
    pub notes: Vec<String>,
}

impl Outcome {
    pub fn extend(&mut self, o: Outcome) {
        for f in o.findings {
            self.find(f);
        }
        self.notes.extend(o.notes);
    }
    /// One finding per kind: a second check that finds the same (the id ranges, then the
    /// recomputed routing) adds its evidence to the first's message. Counts say different
    /// things (slots in range, slots off the recompute), so the larger one stays.
    fn find(&mut self, f: Finding) {
        match self.findings.iter_mut().find(|g| g.kind == f.kind) {
            Some(g) => {
                g.message = format!("{}. Also: {}", g.message, f.message);
                g.count = g.count.max(f.count);
                g.first = g.first.or(f.first);
            }
            None => self.findings.push(f),
        }
    }
    fn note(&mut self, n: impl Into<String>) {
        self.notes.push(n.into());
    }
}

fn valid_range(space: IdSpace, num_experts: usize, ep: Option<&ExpertMap>) -> (i64, i64) {
    match (space, ep) {
        (IdSpace::Local, Some(m)) => (-1, m.num_local() as i64),
        _ => (0, num_experts as i64),
    }
}

/// Ids outside the valid range, duplicate ids within a token, top-k against the config.
pub fn check_ids(d: &Ids, exp: &Expectations, space: IdSpace, ep: Option<&ExpertMap>) -> Outcome {
    let mut o = Outcome::default();
    let e = exp.num_experts as i64;
    let (lo, hi) = valid_range(space, exp.num_experts, ep);
    let bad: Vec<usize> = (0..d.ids.len())
        .filter(|&i| d.ids[i] < lo || d.ids[i] >= hi)
        .collect();
    if let Some(&i0) = bad.first() {
        let s = d.slot(i0);
        let mut msg = format!(
            "{} of {} topk_ids are outside [{lo}, {hi}); first at token {} slot {}: id {}",
            bad.len(),
            d.ids.len(),
            s.token,
            s.slot,
            s.id
        );
        let vals: BTreeSet<i64> = bad.iter().map(|&i| d.ids[i]).collect();
        if space == IdSpace::Global && vals.iter().all(|&v| v == -1) {
            msg.push_str(if ep.is_some_and(|m| m.ep_size > 1) {
                "; -1 is expert_map's \"another rank's expert\": the dump was taken after expert_map \
                 was applied (pass --ids local with --ep-rank/--ep-size)"
            } else {
                // without expert parallelism -1 is no rank's mark
                "; -1 marks a slot no expert took: a token dropped past an expert's capacity, or \
                 a padding row the engine routed nowhere; under expert parallelism, expert_map's \
                 \"another rank's expert\" (then pass --ids local with --ep-rank/--ep-size)"
            });
        } else if space == IdSpace::Global && vals.iter().all(|&v| v == e) {
            // SGLang's fused shared expert is in every token, once; ids off by one put
            // expert E-1's tokens (about k/E of them) at E
            let at_e: Vec<usize> = (0..d.tokens)
                .map(|t| d.row(t).iter().filter(|&&v| v == e).count())
                .collect();
            if at_e.iter().all(|&n| n == 1) {
                msg.push_str(&sglang_hint(exp.num_experts));
            } else {
                msg.push_str(&format!(
                    "; id {e} = n_routed_experts in {} of {} tokens — not SGLang's fused shared \
                     expert, which every token holds once: ids shifted by +1 put expert {}'s \
                     tokens there",
                    at_e.iter().filter(|&&n| n > 0).count(),
                    d.tokens,
                    e - 1
                ));
            }
        }
        o.find(Finding::new(
            FindingKind::OutOfRange,
            bad.len() as u64,
            Some(s),
            msg,
        ));
    }
    let mut dup_tokens = 0u64;
    let mut first = None;
    for t in 0..d.tokens {
        let row = d.row(t);
        for (j, &v) in row.iter().enumerate() {
            // several `-1` in a local dump are several slots served by other ranks
            if space == IdSpace::Local && v == -1 {
                continue;
            }
            if row[..j].contains(&v) {
                dup_tokens += 1;
                first.get_or_insert(Slot {
                    token: t,
                    slot: j,
                    id: v,
                });
                break;
            }
        }
    }
    if let Some(s) = first {
        o.find(Finding::new(
            FindingKind::DuplicateIds,
            dup_tokens,
            Some(s),
            format!(
                "{dup_tokens} of {} tokens select the same expert twice; first at token {} slot {}: id {} \
                 (top-k never repeats an expert: ids were overwritten or mapped many-to-one)",
                d.tokens, s.token, s.slot, s.id
            ),
        ));
    }
    if let Some(k) = exp.top_k {
        if k != d.top_k {
            o.find(Finding::new(
                FindingKind::TopKMismatch,
                1,
                None,
                format!(
                    "the dump holds {} experts per token, the config's num_experts_per_tok is {k}",
                    d.top_k
                ),
            ));
        }
    }
    o
}

/// What an `out_of_range` finding says when every token holds id `E` once.
pub fn sglang_hint(num_experts: usize) -> String {
    format!(
        "; id {num_experts} = n_routed_experts is where SGLang puts the fused shared expert \
         (shared-expert fusion): not a routed expert"
    )
}

/// The shifts of expert ids tried against a recomputed routing: `(name, shift, modulo)`.
fn shifts() -> [(&'static str, i64, bool); 4] {
    [
        ("plus 1", 1, false),
        ("minus 1", -1, false),
        ("plus 1 modulo E", 1, true),
        ("minus 1 modulo E", -1, true),
    ]
}

fn shifted(g: i64, by: i64, modulo: bool, e: usize) -> i64 {
    if modulo && e > 0 {
        (g + by).rem_euclid(e as i64)
    } else {
        g + by
    }
}

/// The message of an `ids_shifted` finding.
fn shift_what(by: i64, modulo: bool) -> String {
    format!(
        "expert ids shifted by {by:+} (dump id = recomputed id {} 1{}: an off-by-one in the id \
         the engine writes or reads, e.g. a 1-based expert index)",
        if by > 0 { "+" } else { "−" },
        if modulo {
            ", modulo n_routed_experts"
        } else {
            ""
        }
    )
}

/// NaN/Inf in the router's inputs the dump holds (`hidden_states` or `router_logits`,
/// `[tokens, cols]` row-major): the scores of those tokens are NaN and their expert choice is
/// whatever the engine's top-k makes of NaN, so no routing of them is right or wrong; the NaN
/// came from upstream.
pub fn check_inputs_finite(name: &str, data: &[f32], tokens: usize, cols: usize) -> Outcome {
    let mut o = Outcome::default();
    let cols = cols.max(1);
    let (mut nan, mut inf) = (0u64, 0u64);
    let mut first = None;
    let mut bad_tokens = BTreeSet::new();
    for (i, v) in data.iter().enumerate() {
        if v.is_finite() {
            continue;
        }
        if v.is_nan() {
            nan += 1;
        } else {
            inf += 1;
        }
        first.get_or_insert(i);
        bad_tokens.insert(i / cols);
    }
    if let Some(i0) = first {
        o.find(Finding::new(
            FindingKind::NonfiniteInputs,
            bad_tokens.len() as u64,
            None,
            format!(
                "{name} holds {nan} NaN and {inf} Inf value(s) in {} of {tokens} tokens; first at token {} channel {} ({}): \
                 the router scores of those tokens are NaN and their experts whatever top-k makes of NaN — \
                 the NaN comes from before the router (run nan-locate on a trace of the forward pass)",
                bad_tokens.len(),
                i0 / cols,
                i0 % cols,
                data[i0]
            ),
        ));
    }
    o
}

/// Relative slack of one value an engine's router may hold in BF16 (logits, scores, score +
/// bias): BF16 rounds by at most 2^-8 of the magnitude; twice that.
const BF16_SLACK: f32 = 1.0 / 128.0;

/// How far an engine's router logit may sit from the FP32 reference's: [`BF16_SLACK`] of its
/// magnitude (the GEMM's own accumulation order adds far less), and an absolute floor for
/// logits near 0.
pub fn logit_slack(z: f32) -> f32 {
    z.abs() * BF16_SLACK + 1.0 / 4096.0
}

/// Upper and lower bounds of each expert's selection score (score + bias) when every value
/// an engine's router may hold in BF16 (logit, score, score + bias) moves by [`logit_slack`] /
/// [`BF16_SLACK`] of its magnitude.
fn selection_bounds(
    z: &[f32],
    func: crate::moe::config::ScoringFunc,
    bias: Option<&[f32]>,
) -> (Vec<f32>, Vec<f32>) {
    use crate::moe::config::ScoringFunc;
    let e = z.len();
    let zu: Vec<f32> = z.iter().map(|&v| v + logit_slack(v)).collect();
    let zd: Vec<f32> = z.iter().map(|&v| v - logit_slack(v)).collect();
    let (su, sd): (Vec<f32>, Vec<f32>) = match func {
        // one expert's share rises with its own logit and falls with the others'
        ScoringFunc::Softmax => {
            let m = zu.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let eu: Vec<f64> = zu.iter().map(|&v| ((v - m) as f64).exp()).collect();
            let ed: Vec<f64> = zd.iter().map(|&v| ((v - m) as f64).exp()).collect();
            let (tu, td): (f64, f64) = (eu.iter().sum(), ed.iter().sum());
            (0..e)
                .map(|i| {
                    (
                        (eu[i] / (eu[i] + td - ed[i])) as f32,
                        (ed[i] / (ed[i] + tu - eu[i])) as f32,
                    )
                })
                .unzip()
        }
        f => (
            crate::moe::router::score(f, &zu),
            crate::moe::router::score(f, &zd),
        ),
    };
    let b = |i: usize| bias.map_or(0.0, |b| b[i]);
    let up = (0..e)
        .map(|i| {
            let v = su[i] + su[i].abs() * BF16_SLACK + b(i);
            v + v.abs() * BF16_SLACK
        })
        .collect();
    let down = (0..e)
        .map(|i| {
            let v = sd[i] - sd[i].abs() * BF16_SLACK + b(i);
            v - v.abs() * BF16_SLACK
        })
        .collect();
    (up, down)
}

/// Could a router whose values sit within the bounds `(up, down)` choose `want`? Some set of
/// `topk_group` groups holding `want`'s groups must be able to win the group selection (group
/// score: the sum of its top two), and `want` the top-k within those groups.
fn reachable(
    want: &BTreeSet<usize>,
    up: &[f32],
    down: &[f32],
    n_group: usize,
    topk_group: usize,
) -> bool {
    let e = up.len();
    let (n_group, topk_group) = if n_group > 1 && e.is_multiple_of(n_group) {
        (n_group, topk_group.clamp(1, n_group))
    } else {
        (1, 1)
    };
    let gsz = e / n_group;
    let top2 = |v: &[f32], g: usize| {
        let mut x: Vec<f32> = v[g * gsz..(g + 1) * gsz].to_vec();
        x.sort_by(|a, b| b.total_cmp(a));
        x.iter().take(2).sum::<f32>()
    };
    let need: BTreeSet<usize> = want.iter().map(|&i| i / gsz).collect();
    if need.len() > topk_group {
        return false;
    }
    let others: Vec<usize> = (0..n_group).filter(|g| !need.contains(g)).collect();
    let extra = topk_group - need.len();
    // every choice of `extra` further groups (n_group choose a few: 70 at most for V3's 8/4)
    let mut pick: Vec<usize> = (0..extra).collect();
    loop {
        let chosen: BTreeSet<usize> = need
            .iter()
            .copied()
            .chain(pick.iter().map(|&j| others[j]))
            .collect();
        let groups_win = n_group == 1 || {
            let worst_in = chosen
                .iter()
                .map(|&g| top2(up, g))
                .fold(f32::INFINITY, f32::min);
            let best_out = (0..n_group)
                .filter(|g| !chosen.contains(g))
                .map(|g| top2(down, g))
                .fold(f32::NEG_INFINITY, f32::max);
            worst_in >= best_out
        };
        if groups_win {
            let worst_want = want.iter().map(|&i| up[i]).fold(f32::INFINITY, f32::min);
            let best_other = (0..e)
                .filter(|i| chosen.contains(&(i / gsz)) && !want.contains(i))
                .map(|i| down[i])
                .fold(f32::NEG_INFINITY, f32::max);
            if worst_want >= best_other {
                return true;
            }
        }
        // next combination of `extra` indices into `others`
        let n = others.len();
        let mut i = extra;
        loop {
            if i == 0 {
                return false;
            }
            i -= 1;
            if pick[i] < n - extra + i {
                pick[i] += 1;
                for j in i + 1..extra {
                    pick[j] = pick[j - 1] + 1;
                }
                break;
            }
        }
    }
}

/// Tokens whose expert set differs from the recomputed one by more than a near-tie: no router
/// whose every logit, score and selection score sits within twice its BF16 rounding of the
/// FP32 reference's chooses that set (engines round each: vLLM's grouped_topk takes the
/// sigmoid of BF16 logits in BF16), group selection included. `--min-match` tolerates slots
/// that flip at near-ties; these do not flip, so every one is a token at the wrong experts (a
/// top-k kernel race, a row written from another token). `logits` `[T, E]` (FP32 reference);
/// tokens with ids out of range or repeated are left to `check_ids`. A finding when more than
/// `max_tokens` tokens are off.
#[allow(clippy::too_many_arguments)]
pub fn clear_mismatches(
    d: &Ids,
    logits: &[f32],
    e: usize,
    func: crate::moe::config::ScoringFunc,
    bias: Option<&[f32]>,
    n_group: usize,
    topk_group: usize,
    max_tokens: u64,
) -> Outcome {
    use crate::moe::router::{score, select};
    let mut o = Outcome::default();
    let k = d.top_k;
    let sel_of = |z: &[f32]| -> Vec<f32> {
        let s = score(func, z);
        match bias {
            Some(b) => s.iter().zip(b).map(|(s, b)| s + b).collect(),
            None => s,
        }
    };
    let mut off: Vec<(usize, Vec<i64>, Vec<usize>)> = vec![];
    for t in 0..d.tokens {
        let Some(z) = logits.get(t * e..(t + 1) * e) else {
            break;
        };
        if z.iter().any(|v| !v.is_finite()) {
            continue;
        }
        let row = d.row(t);
        let valid = row.iter().all(|&i| i >= 0 && (i as usize) < e)
            && row.iter().enumerate().all(|(j, i)| !row[..j].contains(i));
        if !valid {
            continue;
        }
        let want: BTreeSet<usize> = row.iter().map(|&i| i as usize).collect();
        let reference = select(&sel_of(z), n_group, topk_group, k);
        if reference.iter().copied().collect::<BTreeSet<_>>() == want {
            continue;
        }
        let (up, down) = selection_bounds(z, func, bias);
        if !reachable(&want, &up, &down, n_group, topk_group) {
            off.push((t, row.to_vec(), reference));
        }
    }
    if off.len() as u64 > max_tokens {
        let (t, got, want) = &off[0];
        let mut want = want.clone();
        want.sort_unstable();
        let mut got = got.clone();
        got.sort_unstable();
        let slot = d
            .row(*t)
            .iter()
            .position(|i| *i < 0 || !want.contains(&(*i as usize)))
            .unwrap_or(0);
        o.find(Finding::new(
            FindingKind::ClearMismatch,
            off.len() as u64,
            Some(d.slot(t * k + slot)),
            format!(
                "{} of {} tokens are at experts no router chooses whose logits, scores and selection scores sit \
                 within twice their BF16 rounding of the reference's (not a near-tie, which --min-match tolerates); first at token {t}: \
                 dump {got:?}, recomputed {want:?} — these tokens reach the wrong experts (a top-k kernel race, a row \
                 written from another token?); --max-clear-mismatches N tolerates N",
                off.len(),
                d.tokens
            ),
        ));
    }
    o
}

/// Relative tolerance of a weight sum stored in `dtype`: each of the K weights was rounded
/// once to the dtype. Engines that compute in BF16 (or F16) and store F32 are common: F32/F64
/// weights that are all BF16 (F16) values get that dtype's tolerance.
pub fn sum_tolerance(dtype: safetensors::Dtype, top_k: usize, weights: &[f32]) -> f32 {
    let k = top_k.max(1) as f32;
    let finite = || weights.iter().filter(|w| w.is_finite());
    let dtype = match dtype {
        safetensors::Dtype::F32 | safetensors::Dtype::F64
            if finite().all(|w| w.to_bits() & 0xFFFF == 0) =>
        {
            safetensors::Dtype::BF16
        }
        safetensors::Dtype::F32 | safetensors::Dtype::F64
            if finite().all(|&w| half::f16::from_f32(w).to_f32() == w) =>
        {
            safetensors::Dtype::F16
        }
        d => d,
    };
    match dtype {
        safetensors::Dtype::BF16 => k * (1.0 / 128.0),
        safetensors::Dtype::F16 => k * (1.0 / 1024.0),
        _ => 1e-3,
    }
}

/// NaN/Inf weights (the 0/0 of `norm_topk_prob` without the `+ 1e-20` guard), negative
/// weights, and weight sums against `routed_scaling_factor` when `norm_topk_prob`.
pub fn check_weights(d: &Ids, exp: &Expectations, rel_tol: f32) -> Outcome {
    let mut o = Outcome::default();
    let k = d.top_k.max(1);
    let nonfinite: Vec<usize> = (0..d.weights.len())
        .filter(|&i| !d.weights[i].is_finite())
        .collect();
    if let Some(&i0) = nonfinite.first() {
        let s = d.slot(i0);
        let all_nan_tokens = (0..d.tokens)
            .filter(|&t| d.weights[t * k..(t + 1) * k].iter().all(|w| w.is_nan()))
            .count();
        let mut msg = format!(
            "{} topk_weights are NaN/Inf; first at token {} slot {} (expert {}): {}",
            nonfinite.len(),
            s.token,
            s.slot,
            s.id,
            d.weights[i0]
        );
        if all_nan_tokens > 0 && exp.norm_topk_prob != Some(false) {
            msg.push_str(&format!(
                "; {all_nan_tokens} tokens are NaN in every slot: the 0/0 of norm_topk_prob \
                 (w / Σw with Σw = 0, the `+ 1e-20` guard missing), or NaN router logits"
            ));
        }
        o.find(Finding::new(
            FindingKind::NonfiniteWeights,
            nonfinite.len() as u64,
            Some(s),
            msg,
        ));
    }
    let negative: Vec<usize> = (0..d.weights.len())
        .filter(|&i| d.weights[i] < 0.0)
        .collect();
    if let Some(&i0) = negative.first() {
        let s = d.slot(i0);
        o.find(Finding::new(
            FindingKind::NegativeWeights,
            negative.len() as u64,
            Some(s),
            format!(
                "{} topk_weights are negative; first at token {} slot {}: {} (sigmoid, softmax and \
                 sqrtsoftplus scores are never negative: the weights are not router scores)",
                negative.len(),
                s.token,
                s.slot,
                d.weights[i0]
            ),
        ));
    }
    match exp.norm_topk_prob {
        Some(true) => o.extend(check_sums(d, exp.routed_scaling_factor, rel_tol)),
        Some(false) => o.note("norm_topk_prob is false: weight sums are not constrained"),
        None => o.note(
            "weight sums not checked: norm_topk_prob unknown (pass --checkpoint or --norm-topk-prob)",
        ),
    }
    o
}

fn check_sums(d: &Ids, rsf: Option<f32>, rel_tol: f32) -> Outcome {
    let mut o = Outcome::default();
    let k = d.top_k.max(1);
    let sums: Vec<(usize, f32)> = (0..d.tokens)
        .map(|t| (t, d.weights[t * k..(t + 1) * k].iter().sum::<f32>()))
        .filter(|(_, s)| s.is_finite())
        .collect();
    if sums.is_empty() {
        return o;
    }
    let near = |s: f32, c: f32| (s - c).abs() <= rel_tol * c.abs().max(1e-6);
    let rsf_v = rsf.unwrap_or(1.0);
    // Two conventions are legitimate: weights scaled by routed_scaling_factor (the reference,
    // DESIGN.md §4), or normalized to 1 with the factor applied to the MoE output (vLLM's
    // DeepSeek-V2/V3 model code does this).
    let n_scaled = sums.iter().filter(|(_, s)| near(*s, rsf_v)).count();
    let n_unit = sums.iter().filter(|(_, s)| near(*s, 1.0)).count();
    let target = if n_unit > n_scaled { 1.0 } else { rsf_v };
    if rsf.is_none() {
        o.note("routed_scaling_factor unknown: weight sums checked against 1");
    } else if target == 1.0 && rsf_v != 1.0 {
        o.note(format!(
            "topk_weights sum to 1, not routed_scaling_factor = {rsf_v}: the engine applies the factor \
             to the MoE output (as vLLM does); checked against 1"
        ));
    }
    let off: Vec<&(usize, f32)> = sums.iter().filter(|(_, s)| !near(*s, target)).collect();
    if off.is_empty() {
        o.extend(check_sum_bias(d, &sums, target));
    }
    if let Some(&&(t, s)) = off.first() {
        let mut msg = format!(
            "{} of {} tokens have Σ topk_weights ≠ {target} (norm_topk_prob; tolerance {:.1e} relative); \
             first token {t}: {s}",
            off.len(),
            sums.len(),
            rel_tol
        );
        if near(s, rsf_v * rsf_v) && rsf_v != 1.0 {
            msg.push_str(" = routed_scaling_factor²: the factor is applied twice");
        }
        o.find(Finding::new(
            FindingKind::WeightSum,
            off.len() as u64,
            Some(Slot {
                token: t,
                slot: 0,
                id: d.ids[t * k],
            }),
            msg,
        ));
    }
    o
}

/// Mean relative error of Σ topk_weights over a group of tokens that rounding cannot explain:
/// RNE to BF16 moves one weight by at most 2^-9 of itself and leaves the mean unbiased; even
/// a truncating cast biases a sum by at most ~2^-8 of it. 2^-7 is twice that.
const SUM_BIAS_TOL: f64 = 1.0 / 128.0;
/// Fewest tokens a group needs for its mean to be read.
const SUM_BIAS_MIN_TOKENS: usize = 16;

/// Sums that each pass the per-token tolerance (k/128 under BF16) but are off on average, over
/// all tokens or over the tokens routed to one expert: one expert's weight scaled (x1.2 moves a
/// sum by ~2.5% and passes per token), or every weight scaled by a slightly wrong factor.
fn check_sum_bias(d: &Ids, sums: &[(usize, f32)], target: f32) -> Outcome {
    let mut o = Outcome::default();
    let k = d.top_k.max(1);
    let target = f64::from(target);
    if target <= 0.0 || sums.len() < SUM_BIAS_MIN_TOKENS {
        return o;
    }
    let dev = |s: f32| f64::from(s) / target - 1.0;
    // mean and its standard error: a mean within 4 standard errors of 0 is noise
    let biased = |devs: &[f64]| -> Option<f64> {
        let n = devs.len() as f64;
        let mean = devs.iter().sum::<f64>() / n;
        let var = devs.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1.0).max(1.0);
        (mean.abs() > SUM_BIAS_TOL && mean.abs() > 4.0 * (var / n).sqrt()).then_some(mean)
    };
    let all: Vec<f64> = sums.iter().map(|&(_, s)| dev(s)).collect();
    if let Some(mean) = biased(&all) {
        o.find(Finding::new(
            FindingKind::WeightSum,
            sums.len() as u64,
            None,
            format!(
                "Σ topk_weights is {:+.2}% off {target} on average over {} tokens, each within the \
                 per-token tolerance: more than rounding biases a sum (at most ~0.4%): the weights \
                 are scaled by ×{:.3} on average (a routed_scaling_factor or normalization slightly \
                 off, or one top-k slot's weight scaled)",
                mean * 100.0,
                sums.len(),
                1.0 + mean
            ),
        ));
        return o;
    }
    // per expert: the tokens routed to it, and the factor on its own weight that explains their
    // sums (Σ its weights over Σ its weights less the excess)
    let mut by_expert: BTreeMap<i64, (Vec<f64>, f64, f64, usize)> = BTreeMap::new();
    for &(t, s) in sums {
        for j in 0..k {
            let id = d.ids[t * k + j];
            if id < 0 {
                continue;
            }
            let g = by_expert.entry(id).or_insert((vec![], 0.0, 0.0, t));
            g.0.push(dev(s));
            g.1 += f64::from(s) - target;
            g.2 += f64::from(d.weights[t * k + j]);
        }
    }
    let mut off: Vec<(i64, f64, f64, usize, usize)> = by_expert
        .into_iter()
        .filter(|(_, g)| g.0.len() >= SUM_BIAS_MIN_TOKENS && g.2 > g.1)
        .filter_map(|(id, g)| biased(&g.0).map(|m| (id, m, g.2 / (g.2 - g.1), g.0.len(), g.3)))
        .collect();
    off.sort_by(|a, b| b.1.abs().total_cmp(&a.1.abs()));
    if let Some(&(id, mean, factor, n, t)) = off.first() {
        let rest: Vec<f64> = sums
            .iter()
            .filter(|&&(t, _)| !d.ids[t * k..(t + 1) * k].contains(&id))
            .map(|&(_, s)| dev(s))
            .collect();
        let rest_mean = rest.iter().sum::<f64>() / rest.len().max(1) as f64;
        let others = if off.len() > 1 {
            let ids: Vec<String> = off
                .iter()
                .skip(1)
                .take(8)
                .map(|o| o.0.to_string())
                .collect();
            format!(
                "; {} more expert(s) like it: {}{}",
                off.len() - 1,
                ids.join(", "),
                if off.len() > 9 { ", …" } else { "" }
            )
        } else {
            String::new()
        };
        o.find(Finding::new(
            FindingKind::WeightSum,
            off.len() as u64,
            Some(Slot {
                token: t,
                slot: (0..k).find(|&j| d.ids[t * k + j] == id).unwrap_or(0),
                id,
            }),
            format!(
                "the {n} tokens routed to expert {id} have Σ topk_weights {:+.2}% off {target} on \
                 average, each within the per-token tolerance, while the other {} tokens' are \
                 {:+.2}%: expert {id}'s weight looks scaled by ×{factor:.2}{others}",
                mean * 100.0,
                rest.len(),
                rest_mean * 100.0
            ),
        ));
    }
    o
}

/// Load per expert and per EP rank.
#[derive(Clone, Debug, Serialize)]
pub struct ExpertLoad {
    /// Slots routed to each expert, `[E]`.
    pub counts: Vec<u64>,
    pub slots: u64,
    /// Slots whose id is not an expert (`< 0` or `≥ E`).
    pub out_of_range: u64,
    pub unused_experts: usize,
    pub max: u64,
    pub hottest: Option<usize>,
    pub mean: f64,
    /// `max / mean`: 1 is perfect balance.
    pub max_over_mean: f64,
}

pub fn expert_load(ids: &[i64], num_experts: usize) -> ExpertLoad {
    let mut counts = vec![0u64; num_experts];
    let mut out = 0u64;
    for &v in ids {
        match usize::try_from(v).ok().filter(|&g| g < num_experts) {
            Some(g) => counts[g] += 1,
            None => out += 1,
        }
    }
    let slots = ids.len() as u64;
    let inside = slots - out;
    let (hottest, max) = counts
        .iter()
        .enumerate()
        .max_by_key(|&(i, &c)| (c, std::cmp::Reverse(i)))
        .map(|(i, &c)| (Some(i), c))
        .unwrap_or((None, 0));
    let mean = if num_experts > 0 {
        inside as f64 / num_experts as f64
    } else {
        0.0
    };
    ExpertLoad {
        unused_experts: counts.iter().filter(|&&c| c == 0).count(),
        counts,
        slots,
        out_of_range: out,
        max,
        hottest,
        mean,
        max_over_mean: if mean > 0.0 { max as f64 / mean } else { 0.0 },
    }
}

/// One EP rank's share of the dump's slots.
#[derive(Clone, Debug, Serialize)]
pub struct RankLoad {
    pub rank: usize,
    pub experts: String,
    pub num_local: usize,
    /// Slots whose (global) id this rank owns.
    pub slots: u64,
    /// Slots a uniform router would send here.
    pub expected: f64,
    /// Slots that should reach this rank (by the recomputed routing) but do not.
    pub dropped: Option<u64>,
}

/// The EP picture: per-rank load and the rank-confusion diagnoses.
#[derive(Clone, Debug, Serialize)]
pub struct EpSetup {
    pub ep_rank: usize,
    pub ep_size: usize,
    pub placement: Placement,
    pub ids: IdSpace,
}

/// Probability that `n` independent uniform draws over `e` experts all land in a set of `m`.
fn chance_all_in(m: usize, e: usize, n: usize) -> f64 {
    if e == 0 {
        return 1.0;
    }
    (m as f64 / e as f64).powf(n as f64)
}

/// Local-vs-global confusion judged from the ids alone (`ids` global space), and per-rank load.
/// `maps` are the maps of all ranks; `rank` is the rank the dump came from.
pub fn check_ep_ids(
    d: &Ids,
    maps: &[ExpertMap],
    rank: usize,
    space: IdSpace,
) -> (Outcome, Vec<RankLoad>) {
    let mut o = Outcome::default();
    let Some(me) = maps.get(rank) else {
        return (o, vec![]);
    };
    let e = me.num_experts;
    let r_size = maps.len();
    let valid: Vec<i64> = d
        .ids
        .iter()
        .copied()
        .filter(|&v| v >= 0 && (v as usize) < e)
        .collect();
    let n = valid.len();
    let mut loads: Vec<RankLoad> = maps
        .iter()
        .map(|m| RankLoad {
            rank: m.ep_rank,
            experts: m.describe_owned(),
            num_local: m.num_local(),
            slots: 0,
            expected: n as f64 * m.num_local() as f64 / e.max(1) as f64,
            dropped: None,
        })
        .collect();
    if space == IdSpace::Local {
        // Local ids say nothing about other ranks; what can go wrong is global ids left unmapped.
        let n_local = me.num_local() as i64;
        let unmapped: Vec<usize> = (0..d.ids.len())
            .filter(|&i| d.ids[i] >= n_local && me.owns(d.ids[i]))
            .collect();
        let beyond = d.ids.iter().filter(|&&v| v >= n_local).count();
        // On a rank whose own experts keep their ids under expert_map (rank 0 of a linear
        // placement) the unmapped ids are the other ranks' experts, never -1 as they should be:
        // a local dump in which no slot is -1 is one where every token chose only this rank's
        // experts, which chance does not do.
        let others: Vec<usize> = (0..d.ids.len())
            .filter(|&i| d.ids[i] >= n_local && (d.ids[i] as usize) < e && !me.owns(d.ids[i]))
            .collect();
        let no_minus_one =
            !d.ids.contains(&-1) && chance_all_in(me.num_local(), e, d.ids.len()) < CHANCE;
        if unmapped.is_empty() && no_minus_one && others.len() * 2 >= beyond {
            if let Some(&i0) = others.first() {
                let s = d.slot(i0);
                o.find(Finding::new(
                    FindingKind::GlobalIdsAsLocal,
                    others.len() as u64,
                    Some(s),
                    format!(
                        "global ids used as local ids: {} ids are ≥ rank {rank}'s {} local experts, \
                         each a global id of another rank's expert, and no slot is -1 — expert_map \
                         was not applied (rank {rank}'s own experts {} keep their ids under it; first \
                         token {} slot {}: id {}, which expert_map maps to -1)",
                        others.len(),
                        n_local,
                        me.describe_owned(),
                        s.token,
                        s.slot,
                        s.id,
                    ),
                ));
            }
        }
        if let Some(&i0) = unmapped.first() {
            if unmapped.len() * 2 >= beyond {
                let s = d.slot(i0);
                o.find(Finding::new(
                    FindingKind::GlobalIdsAsLocal,
                    unmapped.len() as u64,
                    Some(s),
                    format!(
                        "global ids used as local ids: {} ids are ≥ rank {rank}'s {} local experts but are \
                         global ids of its experts {} — expert_map was not applied (first token {} slot {}: \
                         id {}, local id would be {})",
                        unmapped.len(),
                        n_local,
                        me.describe_owned(),
                        s.token,
                        s.slot,
                        s.id,
                        me.local(s.id).map_or("-1".into(), |l| l.to_string())
                    ),
                ));
            }
        }
        return (o, vec![]);
    }
    for &v in &valid {
        if let Some(q) = owner_rank(e, r_size, me.placement, v) {
            loads[q].slots += 1;
        }
    }
    if n == 0 {
        return (o, loads);
    }
    let local_range: BTreeSet<i64> = (0..me.num_local() as i64).collect();
    let owned: BTreeSet<i64> = me.local_to_global().iter().map(|&g| g as i64).collect();
    let all_in = |s: &BTreeSet<i64>| valid.iter().all(|v| s.contains(v));
    let significant = |m: usize| chance_all_in(m, e, n) < CHANCE;
    if local_range == owned {
        if all_in(&owned) && significant(owned.len()) {
            o.find(Finding::new(
                FindingKind::LocalIdsAsGlobal,
                n as u64,
                None,
                format!(
                    "all {n} topk_ids lie in [0, {}), which is both rank {rank}'s experts and the local id \
                     range: either local ids used as global ids, or the router saw only this rank's \
                     experts (global routing spreads over all {r_size} ranks)",
                    me.num_local()
                ),
            ));
        }
    } else if all_in(&local_range) && significant(local_range.len()) {
        let wrong_owners: BTreeSet<usize> = local_range
            .iter()
            .filter_map(|&v| owner_rank(e, r_size, me.placement, v))
            .collect();
        o.find(Finding::new(
            FindingKind::LocalIdsAsGlobal,
            n as u64,
            None,
            format!(
                "local ids used as global ids: all {n} topk_ids lie in [0, {}) — rank {rank}'s local id \
                 range — while rank {rank} owns experts {}. Read as global ids they select experts of \
                 rank(s) {:?}, and rank {rank}'s expert_map gives -1 for them: its tokens are silently \
                 dropped",
                me.num_local(),
                me.describe_owned(),
                wrong_owners
            ),
        ));
    } else if all_in(&owned) && significant(owned.len()) {
        o.find(Finding::new(
            FindingKind::ConfinedToRank,
            n as u64,
            None,
            format!(
                "all {n} topk_ids are rank {rank}'s own experts {}: the router saw only this rank's \
                 experts (an EP-sharded gate weight, or a local top-k offset to global ids); global \
                 routing spreads over all {r_size} ranks",
                me.describe_owned()
            ),
        ));
    }
    let idle: Vec<usize> = loads
        .iter()
        .filter(|l| l.slots == 0 && chance_all_in(e - l.num_local, e, n) < CHANCE)
        .map(|l| l.rank)
        .collect();
    if !idle.is_empty() {
        o.find(Finding::new(
            FindingKind::IdleRanks,
            idle.len() as u64,
            None,
            format!(
                "EP rank(s) {idle:?} receive none of the {n} slots: their experts never run, and tokens \
                 meant for them are silently dropped (expert_map = -1 there) or served by other experts"
            ),
        ));
    }
    (o, loads)
}

/// Agreement of the dump with a recomputed routing.
#[derive(Clone, Debug, Serialize)]
pub struct Agreement {
    /// Where the reference came from ("hidden_states + gate", "router_logits", "tid2eid").
    pub source: String,
    /// Fraction of slots whose id is among the reference's ids of that token (order ignored),
    /// under `id_transform`.
    pub match_rate: f64,
    /// The same with the ids read as declared (global, or local under `expert_map`).
    pub declared_match_rate: f64,
    /// Fraction of tokens whose id set equals the reference's.
    pub token_match_rate: f64,
    /// Fraction of slots equal position by position (engines need not sort by score).
    pub ordered_match_rate: f64,
    /// How dump ids relate to the reference ids ("identity", "expert_map", "minus offset 8").
    pub id_transform: String,
    pub first_mismatch: Option<Slot>,
    /// Weight metrics over tokens whose id set matches, weights aligned by expert id.
    pub weights: Option<crate::metrics::Metrics>,
    /// Least-squares factor `dump ≈ factor · reference` over those weights.
    pub weight_factor: Option<f64>,
    /// Slots per rank that the reference sends there but the dump does not (EP only).
    pub dropped_by_rank: Option<Vec<u64>>,
    /// The weights differ slot by slot but agree as each token's set: topk_ids and
    /// topk_weights misaligned (the weight finding says so).
    #[serde(skip)]
    pub weights_misaligned: bool,
    /// Tokens whose expert set differs from the reference's tie-break but is a top-k under
    /// exact ties of the selection score: counted as matching, their weights compared with
    /// those recomputed for the dump's experts.
    pub tokens_accepted_under_ties: u64,
}

/// Thresholds of the comparison with a recomputed routing.
#[derive(Clone, Copy, Debug)]
pub struct Tolerances {
    /// Minimum `match_rate`: near-ties flip between a BF16 engine router and the FP32 reference.
    pub min_match: f64,
    /// Maximum `rel_l2` of the aligned weights.
    pub weight_rel_l2: f64,
}

/// A named mapping from reference (global) ids to what a dump may hold.
type Transform<'a> = (String, Box<dyn Fn(i64) -> i64 + 'a>);

/// Name of the transform that maps global ids with the other placement's expert_map.
const OTHER_PLACEMENT: &str = "expert_map of placement";

/// Name of the transform that adds this rank's offset to ids that are already global.
const PLUS_OFFSET: &str = "plus rank offset";

/// The candidate mappings, the expected one first.
fn transforms(space: IdSpace, ep: Option<&ExpertMap>, e: usize) -> Vec<Transform<'_>> {
    let mut v: Vec<Transform<'_>> = vec![("identity".into(), Box::new(|g| g))];
    if let Some(m) = ep {
        v.push((
            "expert_map".into(),
            Box::new(move |g| m.local(g).map_or(-1, |l| l as i64)),
        ));
        if let Some(off) = m.linear_offset().filter(|&o| o > 0) {
            v.push((
                format!("minus rank offset {off}"),
                Box::new(move |g| g - off as i64),
            ));
            if space == IdSpace::Global {
                // the local-to-global conversion applied to ids that were already global
                v.push((
                    format!("{PLUS_OFFSET} {off}"),
                    Box::new(move |g| g + off as i64),
                ));
            }
        }
        if m.placement == Placement::RoundRobin {
            let r = m.ep_size as i64;
            v.push((format!("divided by ep_size {r}"), Box::new(move |g| g / r)));
        }
        // the engine's expert_placement_strategy is the other one
        let other = match m.placement {
            Placement::Linear => Placement::RoundRobin,
            Placement::RoundRobin => Placement::Linear,
        };
        if let Ok(om) = ExpertMap::new(m.num_experts, m.ep_rank, m.ep_size, other) {
            v.push((
                format!("{OTHER_PLACEMENT} {}", other.name()),
                Box::new(move |g| om.local(g).map_or(-1, |l| l as i64)),
            ));
        }
    }
    // in local space the expected transform is expert_map; identity is then the bug
    if space == IdSpace::Local {
        v.rotate_left(1);
    } else {
        for (name, by, modulo) in shifts() {
            v.push((
                name.to_string(),
                Box::new(move |g| shifted(g, by, modulo, e)),
            ));
        }
    }
    v
}

/// Agreement counts of a dump with a reference under one id mapping.
#[derive(Clone, Copy, Debug)]
struct MatchCount {
    slots: u64,
    tokens: u64,
    ordered: u64,
    first: Option<Slot>,
}

fn set_match(d: &Ids, reference: &Routing, f: &dyn Fn(i64) -> i64) -> MatchCount {
    let (mut slots, mut tokens, mut ordered) = (0u64, 0u64, 0u64);
    let mut first = None;
    for t in 0..d.tokens {
        let want: Vec<i64> = reference.topk_ids[t * reference.top_k..(t + 1) * reference.top_k]
            .iter()
            .map(|&g| f(g as i64))
            .collect();
        let got = d.row(t);
        let mut all = got.len() == want.len();
        for (j, &g) in got.iter().enumerate() {
            if want.contains(&g) {
                slots += 1;
            } else {
                all = false;
                first.get_or_insert(Slot {
                    token: t,
                    slot: j,
                    id: g,
                });
            }
            if want.get(j) == Some(&g) {
                ordered += 1;
            }
        }
        tokens += u64::from(all);
    }
    MatchCount {
        slots,
        tokens,
        ordered,
        first,
    }
}

/// How to compare a dump with a recomputed routing.
#[derive(Clone, Copy, Debug)]
pub struct RefCompare<'a> {
    /// Where the reference came from, for messages ("hidden_states + gate", "router_logits").
    pub source: &'a str,
    pub space: IdSpace,
    /// This rank's map and all ranks' maps, under EP.
    pub ep: Option<(&'a ExpertMap, &'a [ExpertMap])>,
    pub routed_scaling_factor: Option<f32>,
    pub tol: Tolerances,
    /// `n_routed_experts` (the modulo of shifted ids).
    pub num_experts: usize,
    /// Ids were already judged by an exact check (hash layers): report weights only.
    pub ids_checked_elsewhere: bool,
}

/// Compare the dump with a recomputed routing (global ids). Recognizes dumps holding local
/// ids (expert_map applied, or the rank offset subtracted) and names the ranks that lose
/// tokens; compares weights on tokens whose id sets agree.
pub fn compare_with_reference(
    d: &Ids,
    reference: &Routing,
    c: &RefCompare,
) -> (Outcome, Option<Agreement>) {
    let mut o = Outcome::default();
    let source = c.source;
    if reference.tokens != d.tokens || reference.top_k != d.top_k {
        o.find(Finding::new(
            FindingKind::RoutingMismatch,
            1,
            None,
            format!(
                "the recomputed routing ({source}) is [{}, {}], the dump [{}, {}]",
                reference.tokens, reference.top_k, d.tokens, d.top_k
            ),
        ));
        return (o, None);
    }
    let total = (d.tokens * d.top_k) as u64;
    let slots_total = total.max(1) as f64;
    let cands = transforms(c.space, c.ep.map(|(m, _)| m), c.num_experts);
    let scored: Vec<MatchCount> = cands
        .iter()
        .map(|(_, f)| set_match(d, reference, f.as_ref()))
        .collect();
    let expected = scored[0];
    // the best mapping; the expected one (index 0) wins ties, and any mapping that does not
    // explain the dump (a mapping that fits a few slots by chance names nothing)
    let best_i = (0..scored.len())
        .max_by(|&a, &b| scored[a].slots.cmp(&scored[b].slots).then(b.cmp(&a)))
        .filter(|&i| scored[i].slots as f64 / slots_total >= c.tol.min_match)
        .unwrap_or(0);
    let best = scored[best_i];
    let match_rate = best.slots as f64 / slots_total;
    let name = cands[best_i].0.clone();
    let exp_rate = expected.slots as f64 / slots_total;
    let first_wrong = expected
        .first
        .map(|s| format!("; first at token {} slot {}: id {}", s.token, s.slot, s.id));
    if best_i != 0 && match_rate >= c.tol.min_match {
        let shift = shifts().into_iter().find(|s| s.0 == name);
        let (kind, what) = match (c.space, name.as_str()) {
            (IdSpace::Global, _) if shift.is_some() => {
                let (_, by, modulo) = shift.unwrap_or_default();
                (FindingKind::IdsShifted, shift_what(by, modulo))
            }
            (IdSpace::Global, n) if n.starts_with(PLUS_OFFSET) => (
                FindingKind::IdsShifted,
                format!(
                    "expert ids shifted by this rank's offset (+{}, rank {} of {} owns {}): the \
                     local-to-global conversion applied to ids that were already global",
                    c.ep.and_then(|(m, _)| m.linear_offset()).unwrap_or(0),
                    c.ep.map_or(0, |(m, _)| m.ep_rank),
                    c.ep.map_or(0, |(m, _)| m.ep_size),
                    c.ep.map_or(String::new(), |(m, _)| m.describe_owned()),
                ),
            ),
            (IdSpace::Global, _) => (
                FindingKind::LocalIdsAsGlobal,
                "local ids used as global ids".to_string(),
            ),
            (IdSpace::Local, n) if n.starts_with(OTHER_PLACEMENT) => (
                FindingKind::RoutingMismatch,
                format!(
                    "local ids made with the other expert placement (vLLM's \
                     expert_placement_strategy), not the declared {} one (--placement / \
                     `placement` metadata) under which this rank owns {}",
                    c.ep.map_or("", |(m, _)| m.placement.name()),
                    c.ep.map_or(String::new(), |(m, _)| m.describe_owned()),
                ),
            ),
            (IdSpace::Local, "identity") => (
                FindingKind::GlobalIdsAsLocal,
                "global ids used as local ids (expert_map not applied)".to_string(),
            ),
            (IdSpace::Local, _) => (
                FindingKind::RoutingMismatch,
                "local ids made without expert_map (other ranks' experts are not -1)".to_string(),
            ),
        };
        o.find(Finding::new(
            kind,
            total - expected.slots,
            expected.first,
            format!(
                "{what}: {:.1}% of the dump's ids equal the recomputed ids ({source}) under \
                 `{name}`, {:.1}% as they should be{}",
                100.0 * match_rate,
                100.0 * exp_rate,
                first_wrong.unwrap_or_default()
            ),
        ));
    } else if exp_rate < c.tol.min_match && !c.ids_checked_elsewhere {
        o.find(Finding::new(
            FindingKind::RoutingMismatch,
            total - expected.slots,
            expected.first,
            format!(
                "only {:.1}% of topk_ids agree with the routing recomputed from {source} \
                 (minimum {:.1}%){}",
                100.0 * exp_rate,
                100.0 * c.tol.min_match,
                first_wrong.unwrap_or_default()
            ),
        ));
    }
    // Ranks losing slots: a slot the reference sends to rank q whose expert the dump does not
    // name (read as global ids).
    let dropped_by_rank = c.ep.filter(|_| c.space == IdSpace::Global).map(|(m, all)| {
        let mut dropped = vec![0u64; all.len()];
        for t in 0..d.tokens {
            let got = d.row(t);
            for &g in &reference.topk_ids[t * d.top_k..(t + 1) * d.top_k] {
                if let Some(q) = owner_rank(m.num_experts, all.len(), m.placement, g as i64) {
                    if !got.contains(&(g as i64)) {
                        dropped[q] += 1;
                    }
                }
            }
        }
        dropped
    });
    if let (Some(dr), true) = (&dropped_by_rank, best_i != 0 && !o.findings.is_empty()) {
        let losing: Vec<usize> = (0..dr.len()).filter(|&q| dr[q] > 0).collect();
        if let Some(f) = o.findings.last_mut().filter(|_| !losing.is_empty()) {
            f.message.push_str(&format!(
                ". Rank(s) {losing:?} silently drop slots (their expert_map gives -1 for the ids \
                 they receive, or the ids name other experts): {dr:?} slots per rank"
            ));
        }
    }
    let f_best = cands[best_i].1.as_ref();
    let (weights, factor) = compare_weights(d, reference, f_best);
    let mut weights_misaligned = false;
    if let (Some(m), Some(fac)) = (&weights, factor) {
        let rsf_v = c.routed_scaling_factor.unwrap_or(1.0) as f64;
        let unscaled = rsf_v != 1.0 && (fac * rsf_v - 1.0).abs() < c.tol.weight_rel_l2;
        if unscaled {
            o.note(format!(
                "topk_weights ≈ recomputed / routed_scaling_factor ({rsf_v}): the engine applies \
                 the factor to the MoE output"
            ));
        }
        let rel = if unscaled {
            rescaled_rel_l2(d, reference, f_best, 1.0 / rsf_v)
        } else {
            m.rel_l2
        };
        if m.nan_count + m.inf_count == 0 && rel > c.tol.weight_rel_l2 {
            // with or without routed_scaling_factor (the slot mix-up hides the fit factor)
            let sorted = sorted_rel_l2(d, reference, f_best, 1.0).min(sorted_rel_l2(
                d,
                reference,
                f_best,
                1.0 / rsf_v,
            ));
            weights_misaligned = sorted <= c.tol.weight_rel_l2;
            let misaligned = if weights_misaligned {
                format!(
                    "; each token's weights agree as a set (rel_l2 {sorted:.3e} sorted): they sit in \
                     other slots than their ids — topk_ids and topk_weights misaligned (one sorted or \
                     permuted without the other)"
                )
            } else {
                String::new()
            };
            o.find(Finding::new(
                FindingKind::WeightError,
                m.len as u64,
                None,
                format!(
                    "topk_weights differ from the weights recomputed from {source}: rel_l2 {rel:.3e} \
                     (maximum {:.1e}), max_abs_err {:.3e}, best fit dump ≈ {fac:.4} × recomputed{misaligned}",
                    c.tol.weight_rel_l2, m.max_abs_err
                ),
            ));
        } else if m.nan_count + m.inf_count == 0 {
            let by = if unscaled { 1.0 / rsf_v } else { 1.0 };
            let tol = TOKEN_WEIGHT_ERR_FACTOR * c.tol.weight_rel_l2;
            if let (n, Some(tw)) = token_weight_outliers(d, reference, f_best, by, tol) {
                let TokenWeights {
                    token: t,
                    rel_l2: t_rel,
                    got,
                    want,
                } = tw;
                let slots = |v: &[f32]| {
                    v.iter()
                        .map(|w| format!("{w:.4}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                };
                o.find(Finding::new(
                    FindingKind::WeightError,
                    n,
                    // the slot whose weight is furthest off
                    (0..got.len())
                        .max_by(|&i, &j| {
                            (got[i] - want[i])
                                .abs()
                                .total_cmp(&(got[j] - want[j]).abs())
                        })
                        .map(|j| d.slot(t * d.top_k + j)),
                    format!(
                        "{n} token(s) route to the right experts with the wrong weights (rel_l2 \
                         above {tol:.2e} each, the layer's {rel:.3e} within its maximum): token \
                         {t} holds [{}] where [{}] is recomputed from {source} for the same \
                         experts (rel_l2 {t_rel:.3e}): weights written to other slots, or from \
                         another token",
                        slots(&got),
                        slots(&want),
                    ),
                ));
            }
        }
    }
    let agreement = Agreement {
        source: source.to_string(),
        match_rate,
        declared_match_rate: exp_rate,
        token_match_rate: best.tokens as f64 / d.tokens.max(1) as f64,
        ordered_match_rate: best.ordered as f64 / slots_total,
        id_transform: name,
        first_mismatch: best.first,
        weights,
        weight_factor: factor,
        dropped_by_rank,
        weights_misaligned,
        tokens_accepted_under_ties: 0,
    };
    (o, Some(agreement))
}

/// Pairs (dump weight, reference weight) for tokens whose id multisets agree, aligned by id:
/// `k` pairs a token. An id the token holds more than once (`-1`, every other rank's expert,
/// in a dump of local ids) cannot say which slot is which: its weights are paired as sorted
/// sets. Skipping such tokens left no token to compare once each held two slots of other
/// ranks (EP 8 with top-4 of 16 experts, or DeepSeek-V3's top-8 of 256 at EP 8), and weights
/// of any value passed.
fn aligned_weights(d: &Ids, reference: &Routing, f: &dyn Fn(i64) -> i64) -> (Vec<f32>, Vec<f32>) {
    let (mut a, mut b) = (vec![], vec![]);
    for t in 0..d.tokens {
        if let Some((x, y)) = token_weights(d, reference, f, t) {
            a.extend(x);
            b.extend(y);
        }
    }
    (a, b)
}

/// Token `t`'s (dump, reference) weights aligned by id, as [`aligned_weights`] pairs them;
/// None where its id multiset differs from the reference's.
fn token_weights(
    d: &Ids,
    reference: &Routing,
    f: &dyn Fn(i64) -> i64,
    t: usize,
) -> Option<(Vec<f32>, Vec<f32>)> {
    let k = d.top_k;
    let (mut a, mut b) = (vec![], vec![]);
    let want: Vec<i64> = reference.topk_ids[t * k..(t + 1) * k]
        .iter()
        .map(|&g| f(g as i64))
        .collect();
    let got = d.row(t);
    let (mut gs, mut ws) = (got.to_vec(), want.clone());
    gs.sort_unstable();
    ws.sort_unstable();
    if gs != ws {
        return None;
    }
    let mut repeated: BTreeSet<i64> = BTreeSet::new();
    for (j, g) in got.iter().enumerate() {
        let at: Vec<usize> = (0..k).filter(|&p| want[p] == *g).collect();
        if let [p] = at[..] {
            a.push(d.weights[t * k + j]);
            b.push(reference.topk_weights[t * k + p]);
        } else {
            repeated.insert(*g);
        }
    }
    for g in repeated {
        let mut x: Vec<f32> = (0..k)
            .filter(|&j| got[j] == g)
            .map(|j| d.weights[t * k + j])
            .collect();
        let mut y: Vec<f32> = (0..k)
            .filter(|&p| want[p] == g)
            .map(|p| reference.topk_weights[t * k + p])
            .collect();
        x.sort_by(|p, q| q.total_cmp(p));
        y.sort_by(|p, q| q.total_cmp(p));
        a.extend(x);
        b.extend(y);
    }
    Some((a, b))
}

/// How far one token's weights may stray from the recomputed ones (rel_l2 over its K slots)
/// as a multiple of the layer's `--max-weight-err`: a BF16 router (BF16 logits, scores and
/// weights) strays up to ~0.005 on a token whose experts it picks as the reference does.
const TOKEN_WEIGHT_ERR_FACTOR: f64 = 2.5;

/// One token's weights against the recomputed ones, aligned by id (the dump's slot order).
struct TokenWeights {
    token: usize,
    rel_l2: f64,
    got: Vec<f32>,
    want: Vec<f32>,
}

/// Tokens whose experts are right but whose weights alone are off by more than `tol` (rel_l2
/// over the token's slots, the reference times `by`): one token's weights written in other
/// slots, or from another token, sit under a layer-wide rel_l2 of thousands of tokens. The
/// count, and the first.
fn token_weight_outliers(
    d: &Ids,
    reference: &Routing,
    f: &dyn Fn(i64) -> i64,
    by: f64,
    tol: f64,
) -> (u64, Option<TokenWeights>) {
    let (mut n, mut first) = (0, None);
    for t in 0..d.tokens {
        let Some((a, b)) = token_weights(d, reference, f, t) else {
            continue;
        };
        let b: Vec<f32> = b.iter().map(|&v| (v as f64 * by) as f32).collect();
        let m = crate::metrics::compare(&a, &b);
        if m.nan_count + m.inf_count == 0 && m.rel_l2 > tol {
            n += 1;
            first.get_or_insert(TokenWeights {
                token: t,
                rel_l2: m.rel_l2,
                got: a,
                want: b,
            });
        }
    }
    (n, first)
}

fn compare_weights(
    d: &Ids,
    reference: &Routing,
    f: &dyn Fn(i64) -> i64,
) -> (Option<crate::metrics::Metrics>, Option<f64>) {
    let (a, b) = aligned_weights(d, reference, f);
    if a.is_empty() {
        return (None, None);
    }
    let m = crate::metrics::compare(&a, &b);
    let (ab, bb) = a
        .iter()
        .zip(&b)
        .filter(|(x, _)| x.is_finite())
        .fold((0f64, 0f64), |(s, n), (&x, &y)| {
            (s + x as f64 * y as f64, n + y as f64 * y as f64)
        });
    (Some(m), (bb > 0.0).then(|| ab / bb))
}

/// Relative L2 of the weights with each token's `k` sorted on both sides (`by` scales the
/// reference): small when the weights are right but in other slots.
fn sorted_rel_l2(d: &Ids, reference: &Routing, f: &dyn Fn(i64) -> i64, by: f64) -> f64 {
    let (mut a, b) = aligned_weights(d, reference, f);
    let mut b: Vec<f32> = b.iter().map(|&v| (v as f64 * by) as f32).collect();
    let k = d.top_k.max(1);
    for row in a.chunks_mut(k).chain(b.chunks_mut(k)) {
        row.sort_by(|x, y| y.total_cmp(x));
    }
    crate::metrics::compare(&a, &b).rel_l2
}

fn rescaled_rel_l2(d: &Ids, reference: &Routing, f: &dyn Fn(i64) -> i64, by: f64) -> f64 {
    let (a, b) = aligned_weights(d, reference, f);
    let b: Vec<f32> = b.iter().map(|&v| (v as f64 * by) as f32).collect();
    crate::metrics::compare(&a, &b).rel_l2
}

/// V4 hash layers: `topk_ids[t]` must be `tid2eid[input_ids[t]]` exactly (no tolerance: a
/// table lookup cannot flip at ties). `tid2eid` is `[vocab, hash_k]`.
pub fn check_hash(
    d: &Ids,
    input_ids: &[i64],
    tid2eid: &[i64],
    hash_k: usize,
    num_experts: usize,
) -> (Outcome, Option<Agreement>) {
    let mut o = Outcome::default();
    if hash_k != d.top_k || hash_k == 0 {
        o.find(Finding::new(
            FindingKind::HashMismatch,
            1,
            None,
            format!(
                "tid2eid holds {hash_k} experts per token id, the dump {}",
                d.top_k
            ),
        ));
        return (o, None);
    }
    let vocab = tid2eid.len() / hash_k;
    let bad_tok: Vec<usize> = (0..input_ids.len())
        .filter(|&t| usize::try_from(input_ids[t]).map_or(true, |v| v >= vocab))
        .collect();
    if let Some(&t0) = bad_tok.first() {
        o.find(Finding::new(
            FindingKind::HashMismatch,
            bad_tok.len() as u64,
            None,
            format!(
                "{} input_ids are outside tid2eid's vocabulary of {vocab}; first token {t0}: {}",
                bad_tok.len(),
                input_ids[t0]
            ),
        ));
        return (o, None);
    }
    // tid2eid's rows `rows[t]` as a routing; none when a row is outside the table
    let lookup = |rows: &[i64]| -> Option<Routing> {
        let mut topk_ids = Vec::with_capacity(rows.len() * hash_k);
        for &v in rows {
            let v = usize::try_from(v).ok().filter(|&v| v < vocab)?;
            topk_ids.extend(
                tid2eid[v * hash_k..(v + 1) * hash_k]
                    .iter()
                    .map(|&e| e as i32),
            );
        }
        Some(Routing {
            tokens: d.tokens,
            top_k: hash_k,
            topk_ids,
            topk_weights: vec![0.0; d.tokens * hash_k],
        })
    };
    // every id is in range: checked above
    let Some(reference) = lookup(input_ids) else {
        return (o, None);
    };
    let MatchCount {
        slots,
        tokens,
        ordered,
        first,
    } = set_match(d, &reference, &|g| g);
    let total = (d.tokens * d.top_k).max(1) as f64;
    let all = (d.tokens * d.top_k) as u64;
    // ids off by one: every slot (a table lookup has no near-ties) is tid2eid's id shifted
    let shift = (slots < all)
        .then(|| {
            shifts().into_iter().find(|&(_, by, modulo)| {
                set_match(d, &reference, &|g| shifted(g, by, modulo, num_experts)).slots == all
            })
        })
        .flatten();
    if let Some((name, by, modulo)) = shift {
        o.find(Finding::new(
            FindingKind::IdsShifted,
            all - slots,
            first,
            format!(
                "{}: every topk_id equals tid2eid[input_ids] under `{name}`, {:.1}% as they \
                 should be (hash layer)",
                shift_what(by, modulo),
                100.0 * slots as f64 / total
            ),
        ));
    } else if slots < all {
        let s = first;
        // the table read at another row than the token's id: every slot matches it
        let positions: Vec<i64> = (0..d.tokens as i64).collect();
        let next: Vec<i64> = input_ids.iter().map(|&v| v + 1).collect();
        let previous: Vec<i64> = input_ids.iter().map(|&v| v - 1).collect();
        let row_bug = [
            (
                "tid2eid[position]: the table indexed by each token's position in the batch, \
                 not by its input id",
                &positions,
            ),
            (
                "tid2eid[input_ids + 1]: the table row one past the token's id (an off-by-one \
                 in the lookup or a table with a row too few at its start)",
                &next,
            ),
            (
                "tid2eid[input_ids - 1]: the table row one before the token's id (an off-by-one \
                 in the lookup or a table with an extra row at its start)",
                &previous,
            ),
        ]
        .into_iter()
        .find(|(_, rows)| lookup(rows).is_some_and(|r| set_match(d, &r, &|g| g).slots == all))
        .map(|(what, _)| format!("; every topk_id matches {what}"))
        .unwrap_or_default();
        o.find(Finding::new(
            FindingKind::HashMismatch,
            (d.tokens * d.top_k) as u64 - slots,
            s,
            format!(
                "hash layer: {} of {} topk_ids differ from tid2eid[input_ids]{}{row_bug}",
                (d.tokens * d.top_k) as u64 - slots,
                d.tokens * d.top_k,
                s.map(|s| {
                    let v = input_ids[s.token] as usize;
                    format!(
                        "; first token {} (input id {}) slot {}: id {}, tid2eid says {:?}",
                        s.token,
                        input_ids[s.token],
                        s.slot,
                        s.id,
                        &tid2eid[v * hash_k..(v + 1) * hash_k]
                    )
                })
                .unwrap_or_default()
            ),
        ));
    }
    let ag = Agreement {
        source: "tid2eid[input_ids]".into(),
        match_rate: slots as f64 / total,
        declared_match_rate: slots as f64 / total,
        token_match_rate: tokens as f64 / d.tokens.max(1) as f64,
        ordered_match_rate: ordered as f64 / total,
        id_transform: "identity".into(),
        first_mismatch: first,
        weights: None,
        weight_factor: None,
        dropped_by_rank: None,
        weights_misaligned: false,
        tokens_accepted_under_ties: 0,
    };
    (o, Some(ag))
}

/// Router logits from the dump against `hidden · Wg^T` (f64 accumulation): a mismatch means
/// the gate weight the engine used is not the checkpoint's.
pub fn check_logits(
    logits: &[f32],
    hidden: &[f32],
    gate: &[f32],
    tokens: usize,
    hidden_size: usize,
    num_experts: usize,
    min_cosine: f64,
) -> (Outcome, crate::metrics::Metrics) {
    use rayon::prelude::*;
    let mut o = Outcome::default();
    let reference: Vec<f32> = (0..tokens * num_experts)
        .into_par_iter()
        .map(|i| {
            let (t, e) = (i / num_experts, i % num_experts);
            let h = &hidden[t * hidden_size..(t + 1) * hidden_size];
            let w = &gate[e * hidden_size..(e + 1) * hidden_size];
            h.iter()
                .zip(w)
                .map(|(&a, &b)| a as f64 * b as f64)
                .sum::<f64>() as f32
        })
        .collect();
    let m = crate::metrics::compare(logits, &reference);
    if !m.passes(min_cosine) {
        o.find(Finding::new(
            FindingKind::LogitsMismatch,
            m.len as u64,
            None,
            format!(
                "router_logits disagree with hidden_states · gate.weightᵀ: cosine {:.6}, rel_l2 {:.3e}, \
                 {} NaN / {} Inf — the engine's gate weight or its input is not what the checkpoint holds",
                m.cosine, m.rel_l2, m.nan_count, m.inf_count
            ),
        ));
    }
    (o, m)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{seq::SliceRandom, Rng, SeedableRng};

    fn rng() -> (u64, rand_chacha::ChaCha8Rng) {
        let seed: u64 = rand::random();
        (seed, rand_chacha::ChaCha8Rng::seed_from_u64(seed))
    }

    #[test]
    fn nonfinite_router_inputs_are_a_finding() {
        let (t, c) = (5, 8);
        let mut h = vec![0.5f32; t * c];
        assert!(check_inputs_finite("hidden_states", &h, t, c)
            .findings
            .is_empty());
        h[3 * c + 6] = f32::NAN;
        h[4 * c] = f32::INFINITY;
        let o = check_inputs_finite("hidden_states", &h, t, c);
        assert_eq!(o.findings.len(), 1);
        let f = &o.findings[0];
        assert_eq!(f.kind, FindingKind::NonfiniteInputs);
        assert_eq!(f.count, 2);
        assert!(
            f.message.contains("1 NaN and 1 Inf") && f.message.contains("token 3 channel 6"),
            "{}",
            f.message
        );
    }

    /// A plausible global routing: distinct ids per token, weights summing to `rsf`.
    fn routing(r: &mut impl Rng, t: usize, k: usize, e: usize, rsf: f32) -> (Vec<i64>, Vec<f32>) {
        let all: Vec<i64> = (0..e as i64).collect();
        let mut ids = vec![];
        let mut w = vec![];
        for _ in 0..t {
            ids.extend(all.choose_multiple(r, k).copied());
            let raw: Vec<f32> = (0..k).map(|_| r.gen_range(0.05f32..1.0)).collect();
            let s: f32 = raw.iter().sum();
            w.extend(raw.iter().map(|v| v / s * rsf));
        }
        (ids, w)
    }

    fn exp(e: usize, k: usize, rsf: f32) -> Expectations {
        Expectations {
            num_experts: e,
            top_k: Some(k),
            norm_topk_prob: Some(true),
            routed_scaling_factor: Some(rsf),
        }
    }

    #[test]
    fn clean_routing_has_no_findings() {
        let (seed, mut r) = rng();
        let (t, k, e) = (r.gen_range(8..64), r.gen_range(2..8), r.gen_range(16..64));
        let rsf = r.gen_range(1.0f32..3.0);
        let (ids, w) = routing(&mut r, t, k, e, rsf);
        let d = Ids {
            tokens: t,
            top_k: k,
            ids: &ids,
            weights: &w,
        };
        let mut o = check_ids(&d, &exp(e, k, rsf), IdSpace::Global, None);
        o.extend(check_weights(&d, &exp(e, k, rsf), 1e-4));
        assert!(o.findings.is_empty(), "seed {seed}: {:?}", o.findings);
    }

    #[test]
    fn range_duplicates_nan_and_sums_are_found() {
        let (seed, mut r) = rng();
        let (t, k, e) = (32, 4, 32);
        let (mut ids, mut w) = routing(&mut r, t, k, e, 2.5);
        let (a, b, c, s) = (
            r.gen_range(0..t),
            r.gen_range(0..t),
            r.gen_range(0..t),
            r.gen_range(0..t),
        );
        ids[a * k + 1] = e as i64 + r.gen_range(0..5);
        ids[b * k + 3] = ids[b * k];
        for j in 0..k {
            w[c * k + j] = f32::NAN;
        }
        w[s * k] += 0.5;
        let d = Ids {
            tokens: t,
            top_k: k,
            ids: &ids,
            weights: &w,
        };
        let ex = exp(e, k, 2.5);
        let mut o = check_ids(&d, &ex, IdSpace::Global, None);
        o.extend(check_weights(&d, &ex, 1e-4));
        let kinds: Vec<FindingKind> = o.findings.iter().map(|f| f.kind).collect();
        for want in [
            FindingKind::OutOfRange,
            FindingKind::DuplicateIds,
            FindingKind::NonfiniteWeights,
        ] {
            assert!(
                kinds.contains(&want),
                "seed {seed}: {want:?} missing in {kinds:?}"
            );
        }
        let oor = o
            .findings
            .iter()
            .find(|f| f.kind == FindingKind::OutOfRange)
            .unwrap();
        assert_eq!(oor.first.unwrap().token, a, "seed {seed}");
        let nan = o
            .findings
            .iter()
            .find(|f| f.kind == FindingKind::NonfiniteWeights)
            .unwrap();
        assert!(nan.message.contains("1e-20"), "{}", nan.message);
        if s != c {
            assert!(
                kinds.contains(&FindingKind::WeightSum),
                "seed {seed}: {kinds:?}"
            );
        }
    }

    #[test]
    fn weights_summing_to_one_are_the_vllm_convention() {
        let (seed, mut r) = rng();
        let (ids, w) = routing(&mut r, 16, 4, 16, 1.0);
        let d = Ids {
            tokens: 16,
            top_k: 4,
            ids: &ids,
            weights: &w,
        };
        let o = check_weights(&d, &exp(16, 4, 2.5), 1e-4);
        assert!(o.findings.is_empty(), "seed {seed}: {:?}", o.findings);
        assert!(
            o.notes.iter().any(|n| n.contains("MoE output")),
            "{:?}",
            o.notes
        );
        // applied twice is named
        let w2: Vec<f32> = w.iter().map(|v| v * 2.5 * 2.5).collect();
        let d = Ids { weights: &w2, ..d };
        let o = check_weights(&d, &exp(16, 4, 2.5), 1e-4);
        assert!(
            o.findings[0].message.contains("twice"),
            "seed {seed}: {:?}",
            o.findings
        );
    }

    #[test]
    fn local_ids_on_a_rank_whose_block_is_elsewhere() {
        let (seed, mut r) = rng();
        let (t, k, e, ep) = (24, 4, 32, 4);
        let maps = ExpertMap::all_ranks(e, ep, Placement::Linear).unwrap();
        let rank = r.gen_range(1..ep);
        // the engine wrote local ids of its own rank: every id in [0, 8)
        let (ids, w) = routing(&mut r, t, k, e / ep, 1.0);
        let d = Ids {
            tokens: t,
            top_k: k,
            ids: &ids,
            weights: &w,
        };
        let (o, loads) = check_ep_ids(&d, &maps, rank, IdSpace::Global);
        let f = o
            .findings
            .iter()
            .find(|f| f.kind == FindingKind::LocalIdsAsGlobal);
        assert!(
            f.is_some_and(|f| f.message.contains("local ids")),
            "seed {seed}: {:?}",
            o.findings
        );
        assert!(
            o.findings.iter().any(|f| f.kind == FindingKind::IdleRanks),
            "seed {seed}"
        );
        assert_eq!(loads[0].slots, (t * k) as u64);
        // the same ids are fine from nowhere: global ids over all experts give nothing
        let (ids, w) = routing(&mut r, t, k, e, 1.0);
        let d = Ids {
            tokens: t,
            top_k: k,
            ids: &ids,
            weights: &w,
        };
        let (o, _) = check_ep_ids(&d, &maps, rank, IdSpace::Global);
        assert!(o.findings.is_empty(), "seed {seed}: {:?}", o.findings);
    }

    #[test]
    fn confined_to_own_block_and_too_few_ids() {
        let (seed, mut r) = rng();
        let maps = ExpertMap::all_ranks(32, 2, Placement::Linear).unwrap();
        let (ids, w) = routing(&mut r, 16, 4, 16, 1.0);
        let ids: Vec<i64> = ids.iter().map(|v| v + 16).collect();
        let d = Ids {
            tokens: 16,
            top_k: 4,
            ids: &ids,
            weights: &w,
        };
        let (o, _) = check_ep_ids(&d, &maps, 1, IdSpace::Global);
        assert!(
            o.findings
                .iter()
                .any(|f| f.kind == FindingKind::ConfinedToRank),
            "seed {seed}"
        );
        // two ids in [0, 16) prove nothing
        let d = Ids {
            tokens: 1,
            top_k: 2,
            ids: &[1, 2],
            weights: &[0.5, 0.5],
        };
        let (o, _) = check_ep_ids(&d, &maps, 1, IdSpace::Global);
        assert!(o.findings.is_empty(), "{:?}", o.findings);
    }

    #[test]
    fn global_ids_in_a_local_dump() {
        let maps = ExpertMap::all_ranks(16, 2, Placement::Linear).unwrap();
        // rank 1 owns [8, 16): the dump should hold 0..8 or -1
        let ids = vec![9i64, -1, 12, 15, -1, 10];
        let w = vec![0.5f32; 6];
        let d = Ids {
            tokens: 3,
            top_k: 2,
            ids: &ids,
            weights: &w,
        };
        let (o, _) = check_ep_ids(&d, &maps, 1, IdSpace::Local);
        assert_eq!(
            o.findings[0].kind,
            FindingKind::GlobalIdsAsLocal,
            "{:?}",
            o.findings
        );
        let o = check_ids(&d, &exp(16, 2, 1.0), IdSpace::Local, Some(&maps[1]));
        assert_eq!(o.findings[0].kind, FindingKind::OutOfRange);
        assert_eq!(o.findings[0].count, 4);
    }

    fn reference_of(ids: &[i64], w: &[f32], t: usize, k: usize) -> Routing {
        Routing {
            tokens: t,
            top_k: k,
            topk_ids: ids.iter().map(|&v| v as i32).collect(),
            topk_weights: w.to_vec(),
        }
    }

    #[test]
    fn agreement_with_a_recomputed_routing() {
        let (seed, mut r) = rng();
        let (t, k, e) = (40, 4, 32);
        let (ids, w) = routing(&mut r, t, k, e, 1.0);
        let reference = reference_of(&ids, &w, t, k);
        let tol = Tolerances {
            min_match: 0.95,
            weight_rel_l2: 0.01,
        };
        let compare = |ids: &[i64], weights: &[f32]| {
            let d = Ids {
                tokens: t,
                top_k: k,
                ids,
                weights,
            };
            let c = RefCompare {
                source: "test",
                space: IdSpace::Global,
                ep: None,
                routed_scaling_factor: Some(1.0),
                tol,
                num_experts: e,
                ids_checked_elsewhere: false,
            };
            compare_with_reference(&d, &reference, &c)
        };
        // shuffled slot order and bf16 weights: still a match
        let mut ids2 = ids.clone();
        let mut w2 = w.clone();
        for tt in 0..t {
            let mut p: Vec<usize> = (0..k).collect();
            p.shuffle(&mut r);
            for j in 0..k {
                ids2[tt * k + j] = ids[tt * k + p[j]];
                w2[tt * k + j] = half::bf16::from_f32(w[tt * k + p[j]]).to_f32();
            }
        }
        let (o, ag) = compare(&ids2, &w2);
        let ag = ag.unwrap();
        assert!(o.findings.is_empty(), "seed {seed}: {:?}", o.findings);
        assert_eq!(ag.match_rate, 1.0);
        assert!(ag.weights.unwrap().rel_l2 < 0.01);
        // a quarter of tokens routed elsewhere: mismatch named
        let mut ids3 = ids.clone();
        for tt in (0..t).step_by(4) {
            ids3[tt * k] = (0..e as i64)
                .find(|v| !ids[tt * k..(tt + 1) * k].contains(v))
                .unwrap();
        }
        let (o, _) = compare(&ids3, &w);
        assert_eq!(
            o.findings[0].kind,
            FindingKind::RoutingMismatch,
            "seed {seed}"
        );
        assert_eq!(o.findings[0].first.unwrap().token, 0);
        // wrong weights
        let w4: Vec<f32> = w.iter().map(|v| v * r.gen_range(0.5f32..1.5)).collect();
        let (o, _) = compare(&ids, &w4);
        assert_eq!(o.findings[0].kind, FindingKind::WeightError, "seed {seed}");
    }

    /// A dump of global ids on `rank` of `maps` against `reference` (min_match 0.95).
    fn compare_global_under_ep(
        d: &Ids,
        reference: &Routing,
        maps: &[ExpertMap],
        rank: usize,
    ) -> (Outcome, Option<Agreement>) {
        compare_with_reference(
            d,
            reference,
            &RefCompare {
                source: "test",
                space: IdSpace::Global,
                ep: Some((&maps[rank], maps)),
                routed_scaling_factor: None,
                tol: Tolerances {
                    min_match: 0.95,
                    weight_rel_l2: 0.01,
                },
                num_experts: maps[rank].num_experts,
                ids_checked_elsewhere: false,
            },
        )
    }

    #[test]
    fn recomputed_routing_names_the_local_id_transform_and_losing_ranks() {
        let (seed, mut r) = rng();
        let (t, k, e, ep) = (40, 4, 32, 4);
        let maps = ExpertMap::all_ranks(e, ep, Placement::Linear).unwrap();
        let rank = r.gen_range(1..ep);
        let (ids, w) = routing(&mut r, t, k, e, 1.0);
        let reference = reference_of(&ids, &w, t, k);
        let off = maps[rank].linear_offset().unwrap() as i64;
        let shifted: Vec<i64> = ids.iter().map(|v| v - off).collect();
        let d = Ids {
            tokens: t,
            top_k: k,
            ids: &shifted,
            weights: &w,
        };
        let (o, ag) = compare_global_under_ep(&d, &reference, &maps, rank);
        let f = &o.findings[0];
        assert_eq!(
            f.kind,
            FindingKind::LocalIdsAsGlobal,
            "seed {seed}: {:?}",
            o.findings
        );
        assert!(
            f.message.contains("minus rank offset") && f.message.contains("silently drop"),
            "{}",
            f.message
        );
        let ag = ag.unwrap();
        assert_eq!(ag.match_rate, 1.0);
        let dropped = ag.dropped_by_rank.unwrap();
        let mut want = vec![0u64; ep];
        for i in 0..t * k {
            if !d.row(i / k).contains(&ids[i]) {
                want[owner_rank(e, ep, Placement::Linear, ids[i]).unwrap()] += 1;
            }
        }
        assert_eq!(dropped, want, "seed {seed}");
        assert!(dropped.iter().sum::<u64>() > 0, "seed {seed}");
    }

    // Guards: global ids with the rank offset added twice were labelled "plus 1" at a few
    // percent agreement; they are named as the offset, and a dump no mapping explains gets
    // the declared mapping, not whichever fits a few slots by chance.
    #[test]
    fn rank_offset_added_to_global_ids_is_named_and_chance_fits_are_not() {
        let (seed, mut r) = rng();
        let (t, k, e, ep) = (48, 4, 32, 4);
        let maps = ExpertMap::all_ranks(e, ep, Placement::Linear).unwrap();
        let rank = r.gen_range(1..ep);
        let (ids, w) = routing(&mut r, t, k, e, 1.0);
        let reference = reference_of(&ids, &w, t, k);
        let off = maps[rank].linear_offset().unwrap() as i64;
        let twice: Vec<i64> = ids.iter().map(|v| v + off).collect();
        let unrelated: Vec<i64> = routing(&mut r, t, k, e, 1.0).0;
        let run = |dump: &[i64]| {
            let d = Ids {
                tokens: t,
                top_k: k,
                ids: dump,
                weights: &w,
            };
            compare_global_under_ep(&d, &reference, &maps, rank)
        };
        let (o, ag) = run(&twice);
        let f = &o.findings[0];
        assert_eq!(
            f.kind,
            FindingKind::IdsShifted,
            "seed {seed}: {:?}",
            o.findings
        );
        assert!(
            f.message.contains(&format!("+{off}")) && f.message.contains("already global"),
            "seed {seed}: {}",
            f.message
        );
        let ag = ag.unwrap();
        assert_eq!(ag.id_transform, format!("plus rank offset {off}"));
        assert_eq!(ag.match_rate, 1.0);
        let (o, ag) = run(&unrelated);
        let ag = ag.unwrap();
        assert_eq!(ag.id_transform, "identity", "seed {seed}");
        assert!(ag.match_rate < 0.95, "seed {seed}");
        assert_eq!(
            o.findings[0].kind,
            FindingKind::RoutingMismatch,
            "seed {seed}"
        );
    }

    #[test]
    fn hash_routing() {
        let (seed, mut r) = rng();
        let (vocab, k, e, t) = (50, 3, 16, 20);
        let tid2eid: Vec<i64> = (0..vocab * k).map(|_| r.gen_range(0..e as i64)).collect();
        let input_ids: Vec<i64> = (0..t).map(|_| r.gen_range(0..vocab as i64)).collect();
        let ids: Vec<i64> = input_ids
            .iter()
            .flat_map(|&v| tid2eid[v as usize * k..(v as usize + 1) * k].to_vec())
            .collect();
        let w = vec![0.3f32; t * k];
        let d = Ids {
            tokens: t,
            top_k: k,
            ids: &ids,
            weights: &w,
        };
        let (o, _) = check_hash(&d, &input_ids, &tid2eid, k, e);
        assert!(o.findings.is_empty(), "seed {seed}");
        let mut bad = ids.clone();
        let j = r.gen_range(0..t * k);
        bad[j] = (0..e as i64)
            .find(|v| !ids[j / k * k..j / k * k + k].contains(v))
            .unwrap();
        let d = Ids { ids: &bad, ..d };
        let (o, _) = check_hash(&d, &input_ids, &tid2eid, k, e);
        assert_eq!(o.findings[0].kind, FindingKind::HashMismatch);
        assert_eq!(o.findings[0].first.unwrap().token, j / k, "seed {seed}");
    }

    #[test]
    fn load_histogram() {
        let l = expert_load(&[0, 1, 1, 3, -1, 9], 4);
        assert_eq!(l.counts, vec![1, 2, 0, 1]);
        assert_eq!(l.out_of_range, 2);
        assert_eq!(l.unused_experts, 1);
        assert_eq!(l.hottest, Some(1));
        assert!((l.max_over_mean - 2.0).abs() < 1e-12);
    }

    #[test]
    fn logits_against_hidden_and_gate() {
        let (seed, mut r) = rng();
        let (t, h, e) = (5, 32, 8);
        let hid: Vec<f32> = (0..t * h).map(|_| r.gen_range(-1.0f32..1.0)).collect();
        let gate: Vec<f32> = (0..e * h).map(|_| r.gen_range(-1.0f32..1.0)).collect();
        let logits: Vec<f32> = (0..t * e)
            .map(|i| {
                (0..h)
                    .map(|c| hid[i / e * h + c] * gate[i % e * h + c])
                    .sum()
            })
            .collect();
        let (o, m) = check_logits(&logits, &hid, &gate, t, h, e, 0.999);
        assert!(o.findings.is_empty() && m.cosine > 0.99999, "seed {seed}");
        let mut gate2 = gate.clone();
        gate2.reverse();
        let (o, _) = check_logits(&logits, &hid, &gate2, t, h, e, 0.999);
        assert_eq!(
            o.findings[0].kind,
            FindingKind::LogitsMismatch,
            "seed {seed}"
        );
    }
}
