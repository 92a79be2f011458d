//! Two traces, matched call by call. Within each step (both traces record `step`; else over
//! the whole trace) the sequences of module paths are aligned as `diff` aligns lines (a longest
//! common subsequence), so a call only one trace made is listed as such and the calls after it
//! still pair with their counterparts. A call diverges when one of its outputs fails the cosine
//! threshold, holds NaN/Inf, or cannot be compared (shape, dtype, missing). The first
//! divergence in REF's order is where to look — unless its inputs already differed, which puts
//! the cause upstream, in code between recorded modules.

use super::file::{role, Role, TensorRef, TraceFile};
use super::index::{TraceEntry, TraceIndex};
use super::scan::{element_index, paired_blocks, ElementIndex};
use super::tokens::{self, token_min_cosine};
use crate::error::{Error, Result};
use crate::metrics::{max_rel_l2, Accum, Metrics};
use serde::Serialize;
use std::collections::HashMap;
use std::path::PathBuf;

/// One tensor of a matched call pair.
#[derive(Clone, Debug, Serialize)]
pub struct TensorDiff {
    pub tensor: String,
    pub shape_ref: Vec<usize>,
    pub shape_test: Vec<usize>,
    pub dtype_ref: String,
    pub dtype_test: String,
    /// `None` when the tensors could not be compared (see `problem`).
    pub cosine: Option<f64>,
    pub rel_l2: Option<f64>,
    /// `20·log10(‖REF‖/‖TEST−REF‖)`; `None` (JSON null) where infinite (equal tensors).
    pub sqnr_db: Option<f64>,
    pub max_abs_err: Option<f64>,
    /// NaN/Inf in TEST and in REF.
    pub nan_count: u64,
    pub inf_count: u64,
    pub ref_nan_count: u64,
    pub ref_inf_count: u64,
    /// Why this tensor counts as diverged although it may have a cosine, or could not be
    /// compared: "shape mismatch …", "missing in TEST", "NaN/Inf in REF", …
    pub problem: Option<String>,
    /// Something worth knowing that does not make the tensor diverge.
    pub note: Option<String>,
    /// Positions where REF and TEST hold the same NaN or ±Inf (a mask): equal, left out of
    /// the metrics, which are over the rest.
    pub nonfinite_matched: u64,
    /// Where the NaN/Inf that make this tensor diverge begin: TEST's first NaN/Inf that REF
    /// does not share (else REF's first NaN/Inf against a finite TEST value); token and
    /// channel as `nan-locate` gives them.
    pub first_nonfinite_index: Option<ElementIndex>,
    /// Compared, finite on both sides (but for NaN/Inf equal in both), at or above the cosine threshold, and with a relative L2
    /// error no larger than noise reaches at that cosine (`metrics::max_rel_l2`).
    pub matches: bool,
}

impl TensorDiff {
    /// Compared and equal value for value (rel-L2 exactly 0; integers, empty tensors and
    /// tensors only one trace holds: matching). Two runs of the same kernels on the same
    /// inputs give this; a different kernel, however close, does not.
    pub fn identical(&self) -> bool {
        self.matches && self.rel_l2.map_or(self.cosine.is_none(), |e| e == 0.0)
    }
}

/// A module call present in only one trace.
#[derive(Clone, Debug, Serialize)]
pub struct LoneCall {
    pub module: String,
    /// k: this is the k-th call (0-based) of the module path in its step.
    pub call: usize,
    /// `__metadata__` `step`, when recorded.
    pub step: Option<u64>,
    pub counter: u64,
    pub file: PathBuf,
}

/// One matched call pair.
#[derive(Clone, Debug, Serialize)]
pub struct CallDiff {
    pub module: String,
    /// The k-th call of the path in its step, in REF and in TEST (they differ where one trace
    /// has a call of this path the other lacks before it).
    pub call: usize,
    pub call_test: usize,
    pub step: Option<u64>,
    pub counter_ref: u64,
    pub counter_test: u64,
    pub file_ref: PathBuf,
    pub file_test: PathBuf,
    pub tensors: Vec<TensorDiff>,
    /// All outputs match.
    pub outputs_match: bool,
    /// `None` when neither trace recorded inputs for this call.
    pub inputs_match: Option<bool>,
    /// Every output equal value for value ([`TensorDiff::identical`]).
    pub outputs_identical: bool,
    /// Every input both traces hold equal value for value; `None` as for `inputs_match`.
    pub inputs_identical: Option<bool>,
    /// Inputs that fail only because their shapes differ (the token set of this call changed:
    /// routing or batching differs upstream), their values unseen.
    pub inputs_shapes_differ: bool,
}

impl CallDiff {
    /// The output that decides: the first failing one, else `output`.
    pub fn key_output(&self) -> Option<&TensorDiff> {
        let outs = || {
            self.tensors
                .iter()
                .filter(|t| matches!(role(&t.tensor), Role::Output(_)))
        };
        outs().find(|t| !t.matches).or_else(|| outs().next())
    }
    /// The worst-matching input (lowest cosine, failures first).
    pub fn worst_input(&self) -> Option<&TensorDiff> {
        self.tensors
            .iter()
            .filter(|t| matches!(role(&t.tensor), Role::Input(_)))
            // an input without a cosine (a bool mask, ids) that matches has nothing to show
            .filter(|t| t.cosine.is_some() || !t.matches)
            .min_by(|a, b| {
                let k = |t: &TensorDiff| (t.matches, t.cosine.unwrap_or(f64::NEG_INFINITY));
                k(a).partial_cmp(&k(b)).unwrap_or(std::cmp::Ordering::Equal)
            })
    }
}

/// What is kept of every matched call: the deciding output and the worst input. Full
/// per-tensor detail is kept for the first divergence only, so 100k calls stay small.
#[derive(Clone, Debug, Serialize)]
pub struct CallSummary {
    pub module: String,
    pub call: usize,
    pub call_test: usize,
    pub step: Option<u64>,
    pub counter_ref: u64,
    pub counter_test: u64,
    pub output: Option<TensorDiff>,
    pub worst_input: Option<TensorDiff>,
    pub outputs_match: bool,
    pub inputs_match: Option<bool>,
    pub outputs_identical: bool,
}

impl CallSummary {
    fn of(d: &CallDiff) -> CallSummary {
        CallSummary {
            module: d.module.clone(),
            call: d.call,
            call_test: d.call_test,
            step: d.step,
            counter_ref: d.counter_ref,
            counter_test: d.counter_test,
            output: d.key_output().cloned(),
            worst_input: d.worst_input().cloned(),
            outputs_match: d.outputs_match,
            inputs_match: d.inputs_match,
            outputs_identical: d.outputs_identical,
        }
    }
}

#[derive(Clone, Debug)]
pub struct BisectResult {
    /// Matched calls in REF's execution order.
    pub calls: Vec<CallSummary>,
    /// Index into `calls` of the first divergence, and its full detail.
    pub first_divergence: Option<(usize, CallDiff)>,
    pub only_in_ref: Vec<LoneCall>,
    pub only_in_test: Vec<LoneCall>,
    /// Calls after the last matched one, in each trace's order: one trace going on where the
    /// other stopped (a crashed or interrupted run) has these on its side only.
    pub trailing_only_in_ref: usize,
    pub trailing_only_in_test: usize,
    /// Modules called a different number of times in the two traces (in one step).
    pub count_differs: Vec<CountDiff>,
    /// Steps whose calls differ too much to align (more than `MAX_EDITS` unpaired): there the
    /// k-th call of a path was paired with the k-th.
    pub paired_by_count: Vec<Option<u64>>,
    /// Whether the calls were grouped by `step` (both traces record it).
    pub by_step: bool,
    /// Where a small difference that a later module blew up began, when the runs are
    /// otherwise deterministic (see [`FirstDifference`]).
    pub first_difference: Option<FirstDifference>,
}

/// The earliest paired call whose output is not bit-identical, before the first divergence,
/// in two runs shown deterministic up to it: at least one paired call of its step before it
/// is bit-identical (so all are: it is the first that differs), and the first divergence's
/// inputs are not bit-identical (its cause may lie here). Two runs that differ everywhere by a
/// little (BF16 against FP32, another kernel) differ from their first call on: no hint.
#[derive(Clone, Debug, Serialize)]
pub struct FirstDifference {
    /// Index into `BisectResult::calls`.
    pub index: usize,
    pub module: String,
    pub call: usize,
    pub step: Option<u64>,
    pub counter_ref: u64,
    pub counter_test: u64,
    pub file_ref: PathBuf,
    pub file_test: PathBuf,
    /// Its output that differs most (highest rel-L2).
    pub output: TensorDiff,
    /// Bit-identical paired calls of its step before it.
    pub identical_before: usize,
    /// The `--min-cosine` (0.9…9 or 1) at which this output fails, so that bisect stops here.
    pub stop_min_cosine: Option<f64>,
}

/// The least `--min-cosine` of the form 0.9, 0.99, …, 0.999999999999999, else 1, under
/// which `t` fails the whole-tensor check (cosine under it, or rel-L2 past
/// [`max_rel_l2`] of it). Parsed from its decimal form, as the flag would be.
fn stop_min_cosine(t: &TensorDiff) -> Option<f64> {
    let (cos, rel) = (t.cosine?, t.rel_l2?);
    (1..=15)
        .filter_map(|k| format!("0.{}", "9".repeat(k)).parse::<f64>().ok())
        .chain([1.0])
        .find(|&bar| cos < bar || rel > max_rel_l2(bar))
}

/// A module path called a different number of times in REF and TEST.
#[derive(Clone, Debug, Serialize)]
pub struct CountDiff {
    pub module: String,
    pub step: Option<u64>,
    pub calls_ref: usize,
    pub calls_test: usize,
}

/// Edits beyond which a step's calls are paired by call number instead of aligned: the
/// alignment costs O((N + M) · D) time and O(D²) memory for D calls only one side has.
const MAX_EDITS: usize = 2000;

/// A longest common subsequence of `a` and `b` (Myers' O((N+M)·D) greedy diff): index pairs
/// `(i, j)` with `a[i] == b[j]`, increasing in both. `None` when more than `max_d` calls would
/// be left unpaired.
fn lcs(a: &[u32], b: &[u32], max_d: usize) -> Option<Vec<(usize, usize)>> {
    let (n, m) = (a.len() as isize, b.len() as isize);
    let limit = max_d.min(a.len() + b.len()) as isize;
    let off = limit + 1;
    let mut v = vec![0isize; 2 * limit as usize + 3];
    // trace[d]: v[-d..=d] as it stood before round d
    let mut trace: Vec<Vec<isize>> = Vec::new();
    let at = |k: isize| (off + k) as usize;
    for d in 0..=limit {
        trace.push(v[at(-d)..=at(d)].to_vec());
        let mut k = -d;
        while k <= d {
            let mut x = if k == -d || (k != d && v[at(k - 1)] < v[at(k + 1)]) {
                v[at(k + 1)]
            } else {
                v[at(k - 1)] + 1
            };
            let mut y = x - k;
            while x < n && y < m && a[x as usize] == b[y as usize] {
                x += 1;
                y += 1;
            }
            v[at(k)] = x;
            if x >= n && y >= m {
                return Some(backtrack(&trace, n, m));
            }
            k += 2;
        }
    }
    None
}

fn backtrack(trace: &[Vec<isize>], n: isize, m: isize) -> Vec<(usize, usize)> {
    let (mut x, mut y) = (n, m);
    let mut out = Vec::new();
    for (d, v) in trace.iter().enumerate().rev() {
        let d = d as isize;
        let get = |k: isize| v[(k + d) as usize];
        let k = x - y;
        let prev_k = if k == -d || (k != d && get(k - 1) < get(k + 1)) {
            k + 1
        } else {
            k - 1
        };
        let (px, py) = if d == 0 {
            (0, 0)
        } else {
            let px = get(prev_k);
            (px, px - prev_k)
        };
        while x > px && y > py {
            x -= 1;
            y -= 1;
            out.push((x as usize, y as usize));
        }
        x = px;
        y = py;
    }
    out.reverse();
    out
}

/// Pairs of calls (indices into the REF and TEST entries of one step, REF's order) whose
/// module paths align: the longest common subsequence of the two sequences of module paths,
/// as `diff` aligns lines, so one call only one side made pairs nothing else wrongly. Calls
/// left over are then paired by module path in order (two engines that call modules in
/// another order: a shared expert before the routed ones). Past [`MAX_EDITS`] the k-th call
/// of a path pairs with the k-th; the bool says so.
fn align(r: &[TraceEntry], t: &[TraceEntry]) -> (Vec<(usize, usize)>, bool) {
    let mut ids: HashMap<&str, u32> = HashMap::new();
    let mut a: Vec<u32> = Vec::with_capacity(r.len());
    let mut b: Vec<u32> = Vec::with_capacity(t.len());
    for (list, out) in [(r, &mut a), (t, &mut b)] {
        for e in list {
            let n = ids.len() as u32;
            out.push(*ids.entry(e.module.as_str()).or_insert(n));
        }
    }
    let pre = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
    let suf = a[pre..]
        .iter()
        .rev()
        .zip(b[pre..].iter().rev())
        .take_while(|(x, y)| x == y)
        .count();
    let (ma, mb) = (&a[pre..a.len() - suf], &b[pre..b.len() - suf]);
    let mut pairs: Vec<(usize, usize)> = (0..pre).map(|i| (i, i)).collect();
    let mut by_count = false;
    let mut mid: Vec<(usize, usize)> = match lcs(ma, mb, MAX_EDITS) {
        Some(p) => p,
        None => {
            by_count = true;
            Vec::new()
        }
    };
    // what is left over: paired by path, in order
    let mut used_a = vec![false; ma.len()];
    let mut used_b = vec![false; mb.len()];
    for &(i, j) in &mid {
        used_a[i] = true;
        used_b[j] = true;
    }
    let mut free_b: HashMap<u32, std::collections::VecDeque<usize>> = HashMap::new();
    for (j, &x) in mb.iter().enumerate() {
        if !used_b[j] {
            free_b.entry(x).or_default().push_back(j);
        }
    }
    for (i, &x) in ma.iter().enumerate() {
        if !used_a[i] {
            if let Some(j) = free_b.get_mut(&x).and_then(|q| q.pop_front()) {
                mid.push((i, j));
            }
        }
    }
    pairs.extend(mid.into_iter().map(|(i, j)| (i + pre, j + pre)));
    let (ea, eb) = (a.len() - suf, b.len() - suf);
    pairs.extend((0..suf).map(|k| (ea + k, eb + k)));
    pairs.sort_unstable();
    (pairs, by_count)
}

/// The k of every entry: it is the k-th call (0-based) of its module path in its step.
fn call_numbers(entries: &[TraceEntry]) -> Vec<usize> {
    let mut seen: HashMap<(Option<u64>, &str), usize> = HashMap::new();
    entries
        .iter()
        .map(|e| {
            let k = seen.entry((e.step, e.module.as_str())).or_insert(0);
            *k += 1;
            *k - 1
        })
        .collect()
}

fn lone(e: &TraceEntry, call: usize) -> LoneCall {
    LoneCall {
        module: e.module.clone(),
        call,
        step: e.step,
        counter: e.counter,
        file: e.path.clone(),
    }
}

fn diff_tensor(
    name: &str,
    r: Option<TensorRef>,
    t: Option<TensorRef>,
    min_cosine: f64,
) -> TensorDiff {
    let mut d = TensorDiff {
        tensor: name.to_string(),
        shape_ref: r.map(|x| x.shape.to_vec()).unwrap_or_default(),
        shape_test: t.map(|x| x.shape.to_vec()).unwrap_or_default(),
        dtype_ref: r.map(|x| format!("{:?}", x.dtype)).unwrap_or_default(),
        dtype_test: t.map(|x| format!("{:?}", x.dtype)).unwrap_or_default(),
        cosine: None,
        rel_l2: None,
        sqnr_db: None,
        max_abs_err: None,
        nan_count: 0,
        inf_count: 0,
        ref_nan_count: 0,
        ref_inf_count: 0,
        problem: None,
        note: None,
        nonfinite_matched: 0,
        first_nonfinite_index: None,
        matches: false,
    };
    let (r, t) = match (r, t) {
        (Some(r), Some(t)) => (r, t),
        // `output` itself must be in both; an input or further tuple member one trace lacks
        // is how the engines' signatures differ (transformers' eager attention returns its
        // weights and takes a mask, vLLM's decoder layer returns its residual): noted, not
        // compared, and no evidence about the call's inputs either way.
        (r, _) if name != "output" => {
            let side = if r.is_some() { "REF" } else { "TEST" };
            d.note = Some(format!(
                "only in {side}: not compared (the two runs' modules take or return different \
                 tensors)"
            ));
            d.matches = true;
            return d;
        }
        (Some(_), None) => {
            d.problem = Some("missing in TEST".into());
            return d;
        }
        _ => {
            d.problem = Some("missing in REF".into());
            return d;
        }
    };
    if !r.is_float() || !t.is_float() {
        // ids, masks, positions: the same values (I32 ids against I64 ones are the same ids)
        d.problem = match (r.read_i64(), t.read_i64()) {
            _ if r.shape != t.shape => Some(format!(
                "shape mismatch: REF {:?}, TEST {:?} (non-float)",
                r.shape, t.shape
            )),
            (Some(a), Some(b)) => {
                let mut diff = a.iter().zip(&b).enumerate().filter(|(_, (x, y))| x != y);
                diff.next().map(|(i, (x, y))| {
                    format!(
                        "integer values differ at {} of {} positions, first at {:?} (REF {x}, \
                         TEST {y})",
                        1 + diff.count(),
                        a.len(),
                        element_index(r.shape, i).multi
                    )
                })
            }
            _ if r.dtype == t.dtype && same_bytes(&r, &t) => None,
            _ => Some("non-float tensors differ".to_string()),
        };
        if d.problem.is_none() && r.dtype != t.dtype {
            d.note = Some(format!(
                "the same values as {:?} and {:?}",
                r.dtype, t.dtype
            ));
        }
        d.matches = d.problem.is_none();
        return d;
    }
    if r.numel() == 0 && t.numel() == 0 {
        // nothing to compare: no cosine (it would read 1.0), matching when the shapes agree
        if r.shape == t.shape {
            d.note = Some("empty (0 elements): nothing to compare".into());
            d.matches = true;
        } else {
            d.problem = Some(format!(
                "shape mismatch: REF {:?}, TEST {:?} (both empty)",
                r.shape, t.shape
            ));
        }
        return d;
    }
    if r.shape != t.shape {
        // [1, T, H] (transformers) against [T, H] (vLLM) is the same data: compare flat.
        let same_data = r.numel() == t.numel() && r.shape.last() == t.shape.last();
        if !same_data {
            d.problem = Some(format!(
                "shape mismatch: REF {:?}, TEST {:?}",
                r.shape, t.shape
            ));
            return d;
        }
    }
    let (m, ref_stats, rows) = tokens::compare(&t, &r, min_cosine);
    d.cosine = Some(m.cosine).filter(|c| c.is_finite());
    d.rel_l2 = Some(m.rel_l2).filter(|c| c.is_finite());
    d.sqnr_db = Some(m.sqnr_db).filter(|c| c.is_finite());
    d.max_abs_err = Some(m.max_abs_err).filter(|c| c.is_finite());
    d.nan_count = m.nan_count;
    d.inf_count = m.inf_count;
    d.ref_nan_count = ref_stats.nan_count;
    d.ref_inf_count = ref_stats.inf_count;
    // NaN/Inf at the same places in both runs (an attention mask of -inf, masked scores) are
    // the same values: the finite rest decides. Only non-finite values that differ, or that
    // one side holds alone, are a divergence (REF alone: the reference is broken).
    let nf =
        (!ref_stats.is_finite() || m.nan_count + m.inf_count > 0).then(|| nonfinite_pairs(&t, &r));
    if let Some(p) = &nf {
        d.nonfinite_matched = p.same;
    }
    if let Some(p) = nf.as_ref().filter(|p| p.test_only + p.differ > 0) {
        let mut what = format!(
            "NaN/Inf in TEST ({} NaN, {} Inf; {} where REF is finite",
            m.nan_count, m.inf_count, p.test_only
        );
        if p.differ > 0 {
            what.push_str(&format!(", {} where REF holds another NaN/Inf", p.differ));
        }
        if p.same > 0 {
            what.push_str(&format!(", {} equal to REF's", p.same));
        }
        what.push(')');
        if let Some(i) = p.first_test_bad {
            let ix = element_index(t.shape, i);
            what.push_str(&format!(", first at {:?}", ix.multi));
            d.first_nonfinite_index = Some(ix);
        }
        if p.ref_only > 0 {
            what.push_str(&format!(
                "; REF holds {} NaN/Inf where TEST is finite",
                p.ref_only
            ));
        }
        d.problem = Some(what);
    } else if let Some(p) = nf.as_ref().filter(|p| p.ref_only > 0) {
        let ix = p.first_ref_only.map(|i| element_index(r.shape, i));
        d.problem = Some(format!(
            "NaN/Inf in REF ({} NaN, {} Inf; {} where TEST is finite{}): the reference itself \
             is broken here",
            ref_stats.nan_count,
            ref_stats.inf_count,
            p.ref_only,
            ix.as_ref()
                .map(|ix| format!(", first at {:?}", ix.multi))
                .unwrap_or_default()
        ));
        d.first_nonfinite_index = ix;
    } else if let Some(p) = &nf {
        let f = p.finite.clone();
        d.cosine = Some(f.cosine).filter(|c| c.is_finite());
        d.rel_l2 = Some(f.rel_l2).filter(|c| c.is_finite());
        d.sqnr_db = Some(f.sqnr_db).filter(|c| c.is_finite());
        d.max_abs_err = Some(f.max_abs_err).filter(|c| c.is_finite());
        d.note = Some(format!(
            "{} NaN/Inf at the same places in REF and TEST ({} NaN, {} Inf: a mask?): compared \
             on the {} finite values",
            p.same,
            m.nan_count,
            m.inf_count,
            f.len as u64 - p.same
        ));
        if !f.passes(min_cosine) {
            d.problem = Some(format!(
                "cosine {} < {min_cosine} on the finite values",
                below(f.cosine, min_cosine)
            ));
        } else if f.rel_l2 > max_rel_l2(min_cosine) {
            d.problem = Some(format!(
                "rel_l2 {:.3e} > {:.3e} on the finite values (cosine {:.6} passes: a scale error)",
                f.rel_l2,
                max_rel_l2(min_cosine),
                f.cosine
            ));
        } else {
            d.matches = true;
        }
    } else if !m.passes(min_cosine) {
        d.problem = Some(format!(
            "cosine {} < {min_cosine}",
            below(m.cosine, min_cosine)
        ));
    } else if m.rel_l2 > max_rel_l2(min_cosine) {
        // the right direction, the wrong norm: a factor (routed_scaling_factor twice, a global
        // scale) that a cosine cannot see, and that RMSNorm hides until a residual add
        d.problem = Some(format!(
            "TEST ≈ {:.4} × REF: rel_l2 {:.3e} > {:.3e}, the most noise reaches at cosine \
             {min_cosine} (cosine {:.6} passes: a scale error)",
            norm_ratio(&t, &r) * m.cosine,
            m.rel_l2,
            max_rel_l2(min_cosine),
            m.cosine
        ));
    } else if let Some(w) = rows.and_then(|rows| tokens::worst(&rows, min_cosine)) {
        // the mean over all tokens hides a few bad ones (one position's RoPE, a padded row,
        // rows of two tokens swapped): each token is held to a looser bar of its own
        d.problem = Some(format!(
            "{} of {} tokens diverge although the whole tensor scores cosine {:.6}: token {} \
             has cosine {:.6} < {:.4} (the bar for one token at --min-cosine {min_cosine})",
            w.count,
            w.tokens,
            m.cosine,
            w.token,
            w.cosine,
            token_min_cosine(min_cosine)
        ));
    } else {
        d.matches = true;
    }
    if r.shape != t.shape && d.note.is_none() {
        d.note = Some(format!(
            "shapes differ (REF {:?}, TEST {:?}), compared flat",
            r.shape, t.shape
        ));
    }
    d
}

/// `‖t‖ / ‖r‖` over the first `min(numel)` elements, read block by block.
fn norm_ratio(t: &TensorRef, r: &TensorRef) -> f64 {
    let (mut nt, mut nr) = (0f64, 0f64);
    paired_blocks(t, r, |_, x, y| {
        nt += x.iter().map(|&v| v as f64 * v as f64).sum::<f64>();
        nr += y.iter().map(|&v| v as f64 * v as f64).sum::<f64>();
        true
    });
    (nt / nr).sqrt()
}

/// How the NaN/Inf of a tensor pair line up, and the metrics over the positions finite in both.
struct NonfinitePairs {
    /// Positions where both hold the same non-finite value (the same ±Inf, or NaN in both).
    same: u64,
    /// REF non-finite, TEST finite.
    ref_only: u64,
    /// TEST non-finite, REF finite.
    test_only: u64,
    /// Both non-finite, different values (+Inf against -Inf or NaN).
    differ: u64,
    /// Flat index of the first `test_only` or `differ` position, and of the first `ref_only`.
    first_test_bad: Option<usize>,
    first_ref_only: Option<usize>,
    /// Over the positions finite in both (`len` counts every position).
    finite: Metrics,
}

fn nonfinite_pairs(t: &TensorRef, r: &TensorRef) -> NonfinitePairs {
    let (mut same, mut ref_only, mut test_only, mut differ) = (0u64, 0u64, 0u64, 0u64);
    let (mut first_test_bad, mut first_ref_only) = (None, None);
    let mut acc = Accum::default();
    let (mut bt, mut br) = (Vec::new(), Vec::new());
    paired_blocks(t, r, |start, x, y| {
        bt.clear();
        br.clear();
        for (i, (&a, &b)) in x.iter().zip(y).enumerate() {
            match (a.is_finite(), b.is_finite()) {
                (true, true) => {
                    bt.push(a);
                    br.push(b);
                    continue;
                }
                (true, false) => {
                    ref_only += 1;
                    first_ref_only.get_or_insert(start + i);
                }
                (false, true) => {
                    test_only += 1;
                    first_test_bad.get_or_insert(start + i);
                }
                (false, false) if a == b || (a.is_nan() && b.is_nan()) => same += 1,
                (false, false) => {
                    differ += 1;
                    first_test_bad.get_or_insert(start + i);
                }
            }
            // a position left out of the sums: a zero pair keeps indices of the rest
            bt.push(0.0);
            br.push(0.0);
        }
        acc = acc.merge(Accum::over(&bt, &br, start));
        true
    });
    NonfinitePairs {
        same,
        ref_only,
        test_only,
        differ,
        first_test_bad,
        first_ref_only,
        finite: acc.finish(),
    }
}

fn same_bytes(a: &TensorRef, b: &TensorRef) -> bool {
    a.raw() == b.raw()
}

/// A router's output: top-k expert ids `[.., k]` beside their weights of the same shape
/// (HF DeepSeek's gate returns `(topk_idx, topk_weight)`, SGLang's `TopK` weights, ids and
/// logits). The k slots' order is not part of the result (`topk(sorted=False)`, another
/// kernel's tie order): the pair is compared as each token's weight on every expert.
struct RoutingOutputs {
    ids: String,
    weights: String,
    experts: usize,
}

/// Experts a routing comparison spans at most (ids past it are not expert ids).
const MAX_ROUTED_EXPERTS: i64 = 1 << 16;
/// Tokens × experts a routing comparison holds at most (1 GiB of F32 a side).
const MAX_ROUTING_VALUES: usize = 1 << 28;

fn routing_outputs(rf: &TraceFile, tf: &TraceFile) -> Option<RoutingOutputs> {
    let outs = |f: &TraceFile| -> Vec<String> {
        f.tensors()
            .filter(|t| matches!(role(t.name), Role::Output(_)))
            .map(|t| t.name.to_string())
            .collect()
    };
    let names = outs(rf);
    let ids = names.iter().find(|n| {
        let (Some(r), Some(t)) = (rf.tensor(n), tf.tensor(n)) else {
            return false;
        };
        r.shape.len() >= 2
            && r.shape == t.shape
            && r.shape.last().is_some_and(|&k| (1..=64).contains(&k))
            && !r.is_float()
            && !t.is_float()
    })?;
    let shape = rf.tensor(ids)?.shape.to_vec();
    let weights = names.iter().find(|n| {
        let (Some(r), Some(t)) = (rf.tensor(n), tf.tensor(n)) else {
            return false;
        };
        r.is_float() && t.is_float() && r.shape == shape.as_slice() && t.shape == shape.as_slice()
    })?;
    let mut top = -1;
    for f in [rf, tf] {
        for &i in f.tensor(ids)?.read_i64()?.iter() {
            if i >= MAX_ROUTED_EXPERTS {
                return None;
            }
            top = top.max(i);
        }
    }
    let experts = (top + 1).max(1) as usize;
    let tokens = shape[..shape.len() - 1].iter().product::<usize>();
    if tokens.saturating_mul(experts) > MAX_ROUTING_VALUES {
        return None;
    }
    Some(RoutingOutputs {
        ids: ids.clone(),
        weights: weights.clone(),
        experts,
    })
}

impl RoutingOutputs {
    /// `[tokens.., experts]`: each token's weight on every expert (ids < 0, an EP rank's
    /// experts it does not hold, carry none), as F32 bytes.
    fn dense(&self, f: &TraceFile) -> (Vec<usize>, Vec<u8>) {
        let ids = f
            .tensor(&self.ids)
            .and_then(|t| t.read_i64())
            .unwrap_or_default();
        let w = f.tensor(&self.weights).expect("checked by routing_outputs");
        let mut wv = Vec::new();
        w.read_f32(0, w.numel(), &mut wv);
        let k = *w.shape.last().unwrap_or(&1);
        let mut out = vec![0f32; ids.len() / k.max(1) * self.experts];
        for (slot, (&e, &x)) in ids.iter().zip(&wv).enumerate() {
            if e >= 0 {
                out[slot / k * self.experts + e as usize] += x;
            }
        }
        let mut shape = w.shape[..w.shape.len() - 1].to_vec();
        shape.push(self.experts);
        (shape, out.iter().flat_map(|v| v.to_le_bytes()).collect())
    }

    fn diff(&self, name: &str, rf: &TraceFile, tf: &TraceFile, min_cosine: f64) -> TensorDiff {
        let ((shape, rb), (_, tb)) = (self.dense(rf), self.dense(tf));
        let (rv, tv) = (
            TensorRef::f32_view(&self.ids, &shape, &rb),
            TensorRef::f32_view(&self.ids, &shape, &tb),
        );
        let mut d = diff_tensor(name, Some(rv), Some(tv), min_cosine);
        let (r, t) = (rf.tensor(name), tf.tensor(name));
        d.shape_ref = r.map(|x| x.shape.to_vec()).unwrap_or_default();
        d.shape_test = t.map(|x| x.shape.to_vec()).unwrap_or_default();
        d.dtype_ref = r.map(|x| format!("{:?}", x.dtype)).unwrap_or_default();
        d.dtype_test = t.map(|x| format!("{:?}", x.dtype)).unwrap_or_default();
        let ids = |f: &TraceFile| f.tensor(&self.ids).and_then(|t| t.read_i64());
        let reordered = if rb == tb && ids(rf) != ids(tf) {
            "; the same experts and weights, in another slot order"
        } else {
            ""
        };
        d.note = Some(format!(
            "routing: `{}` (ids) with `{}` (weights) compared as each token's weight on each of \
             {} experts, slot order ignored{reordered}",
            self.ids, self.weights, self.experts
        ));
        d
    }
}

/// A tensor only one trace holds: nothing was compared.
fn one_sided(t: &TensorDiff) -> bool {
    t.dtype_ref.is_empty() || t.dtype_test.is_empty()
}

fn diff_call(
    re: &TraceEntry,
    te: &TraceEntry,
    (call, call_test): (usize, usize),
    min_cosine: f64,
) -> Result<CallDiff> {
    let rf = TraceFile::open(&re.path)?;
    let tf = TraceFile::open(&te.path)?;
    let mut names: Vec<&str> = rf.tensors().map(|t| t.name).collect();
    for t in tf.tensors() {
        if !names.contains(&t.name) {
            names.push(t.name);
        }
    }
    names.sort_by(|a, b| (role(a), a).cmp(&(role(b), b)));
    let routing = routing_outputs(&rf, &tf);
    let tensors: Vec<TensorDiff> = names
        .iter()
        .map(|n| match &routing {
            Some(rt) if *n == rt.ids || *n == rt.weights => rt.diff(n, &rf, &tf, min_cosine),
            _ => diff_tensor(n, rf.tensor(n), tf.tensor(n), min_cosine),
        })
        .collect();
    let outs: Vec<&TensorDiff> = tensors
        .iter()
        .filter(|t| matches!(role(&t.tensor), Role::Output(_)))
        .collect();
    // A call with no output at all on either side has nothing to match: count it as diverged.
    let outputs_match = !outs.is_empty() && outs.iter().all(|t| t.matches);
    let ins: Vec<&TensorDiff> = tensors
        .iter()
        .filter(|t| matches!(role(&t.tensor), Role::Input(_)) && !one_sided(t))
        .collect();
    let inputs_match = (!ins.is_empty()).then(|| ins.iter().all(|t| t.matches));
    let inputs_identical = (!ins.is_empty()).then(|| ins.iter().all(|t| t.identical()));
    let outputs_identical = outputs_match && outs.iter().all(|t| t.identical());
    let failing: Vec<&&TensorDiff> = ins.iter().filter(|t| !t.matches).collect();
    let inputs_shapes_differ = !failing.is_empty()
        && failing.iter().all(|t| {
            t.cosine.is_none() && t.shape_ref != t.shape_test && t.dtype_ref == t.dtype_test
        });
    Ok(CallDiff {
        module: re.module.clone(),
        call,
        call_test,
        step: re.step,
        counter_ref: re.counter,
        counter_test: te.counter,
        file_ref: re.path.clone(),
        file_test: te.path.clone(),
        tensors,
        outputs_match,
        inputs_match,
        outputs_identical,
        inputs_identical,
        inputs_shapes_differ,
    })
}

/// `[start, end)` ranges of entries sharing one step, in order (one range when `by_step` is
/// false).
fn step_ranges(entries: &[TraceEntry], by_step: bool) -> Vec<(Option<u64>, usize, usize)> {
    let mut out: Vec<(Option<u64>, usize, usize)> = Vec::new();
    for (i, e) in entries.iter().enumerate() {
        let s = if by_step { e.step } else { None };
        match out.last_mut() {
            Some((last, _, end)) if *last == s => *end = i + 1,
            _ => out.push((s, i, i + 1)),
        }
    }
    out
}

/// Compare every matched call; `tick` once per REF call. Calls are paired within each step
/// (when both traces record steps) by aligning the two sequences of module paths.
pub fn bisect(
    reference: &TraceIndex,
    test: &TraceIndex,
    min_cosine: f64,
    tick: &mut dyn FnMut(),
) -> Result<BisectResult> {
    let (re, te) = (&reference.entries, &test.entries);
    let by_step = re.iter().any(|e| e.step.is_some()) && te.iter().any(|e| e.step.is_some());
    if by_step {
        // pairing is within a step: traces that share no step number have nothing to pair
        let steps = |es: &[TraceEntry]| {
            let mut s: Vec<u64> = es.iter().filter_map(|e| e.step).collect();
            s.sort_unstable();
            s.dedup();
            s
        };
        let (rs, ts) = (steps(re), steps(te));
        if !rs.iter().any(|s| ts.contains(s)) {
            let list = |s: &[u64]| s.iter().map(u64::to_string).collect::<Vec<_>>().join(", ");
            return Err(Error::usage(format!(
                "no step is in both traces (REF steps {}, TEST steps {}): calls are paired within \
                 a step (`__metadata__` step), so these are other forward passes, or the same \
                 ones numbered from another start: record the same steps",
                list(&rs),
                list(&ts)
            )));
        }
    }
    let ref_k = call_numbers(re);
    let test_k = call_numbers(te);
    // REF index → TEST index
    let mut pair_of: Vec<Option<usize>> = vec![None; re.len()];
    let mut matched_test = vec![false; te.len()];
    let mut count_differs = Vec::new();
    let mut paired_by_count = Vec::new();
    let tr = step_ranges(te, by_step);
    for (step, r0, r1) in step_ranges(re, by_step) {
        let Some(&(_, t0, t1)) = tr.iter().find(|(s, _, _)| *s == step) else {
            continue;
        };
        let (pairs, by_count) = align(&re[r0..r1], &te[t0..t1]);
        if by_count {
            paired_by_count.push(step);
        }
        for (i, j) in pairs {
            pair_of[r0 + i] = Some(t0 + j);
            matched_test[t0 + j] = true;
        }
        count_differs.extend(call_counts_differ(&re[r0..r1], &te[t0..t1], step));
    }
    let mut calls = Vec::new();
    let mut only_in_ref = Vec::new();
    let mut first_divergence = None;
    // the first call whose outputs are not all bit-identical
    let (mut first_change, mut changed_yet): (Option<FirstDifference>, bool) = (None, false);
    let mut trailing_only_in_ref = 0;
    for (i, e) in re.iter().enumerate() {
        tick();
        let Some(ti) = pair_of[i] else {
            only_in_ref.push(lone(e, ref_k[i]));
            trailing_only_in_ref += 1;
            continue;
        };
        trailing_only_in_ref = 0;
        // the first recorded call of both (an embedding, typically): other token counts
        // there are other prompts, not a divergence
        if i == 0 && ti == 0 {
            same_tokens(e, &te[ti])?;
        }
        let d = diff_call(e, &te[ti], (ref_k[i], test_k[ti]), min_cosine)?;
        calls.push(CallSummary::of(&d));
        if !d.outputs_identical && !changed_yet {
            changed_yet = true;
            first_change = changed(&d, calls.len() - 1);
        }
        if !d.outputs_match && first_divergence.is_none() {
            first_divergence = Some((calls.len() - 1, d));
        }
    }
    let trailing_only_in_test = matched_test.iter().rev().take_while(|&&m| !m).count();
    let first_difference = first_change.and_then(|mut fd| {
        let (fi, d) = first_divergence.as_ref()?;
        // the divergence's own inputs equal: it introduced it, whatever came before
        if fd.index >= *fi || d.inputs_identical == Some(true) {
            return None;
        }
        // evidence that the runs are deterministic: bit-identical calls of its step before it
        fd.identical_before = calls[..fd.index]
            .iter()
            .filter(|c| c.step == fd.step)
            .count();
        (fd.identical_before > 0).then_some(fd)
    });
    let only_in_test = te
        .iter()
        .zip(&test_k)
        .zip(&matched_test)
        .filter(|(_, &m)| !m)
        .map(|((e, &k), _)| lone(e, k))
        .collect();
    Ok(BisectResult {
        calls,
        first_divergence,
        only_in_ref,
        only_in_test,
        trailing_only_in_ref,
        trailing_only_in_test,
        count_differs,
        paired_by_count,
        by_step,
        first_difference,
    })
}

/// Call `d` (at `index` of the calls) as a [`FirstDifference`], by its output that differs
/// most; `None` when it has no output with a rel-L2 (it diverged outright: NaN, a shape).
fn changed(d: &CallDiff, index: usize) -> Option<FirstDifference> {
    let output = d
        .tensors
        .iter()
        .filter(|t| matches!(role(&t.tensor), Role::Output(_)) && !t.identical())
        .filter(|t| t.rel_l2.is_some())
        .max_by(|a, b| {
            a.rel_l2
                .partial_cmp(&b.rel_l2)
                .unwrap_or(std::cmp::Ordering::Equal)
        })?
        .clone();
    Some(FirstDifference {
        index,
        module: d.module.clone(),
        call: d.call,
        step: d.step,
        counter_ref: d.counter_ref,
        counter_test: d.counter_test,
        file_ref: d.file_ref.clone(),
        file_test: d.file_test.clone(),
        stop_min_cosine: stop_min_cosine(&output),
        output,
        identical_before: 0,
    })
}

/// Modules of one step called a different number of times in REF and TEST, in REF's order of
/// first call (then TEST's).
fn call_counts_differ(r: &[TraceEntry], t: &[TraceEntry], step: Option<u64>) -> Vec<CountDiff> {
    let mut order: Vec<&str> = Vec::new();
    let mut counts: HashMap<&str, (usize, usize)> = HashMap::new();
    for (side, list) in [(0, r), (1, t)] {
        for e in list {
            let c = counts.entry(e.module.as_str()).or_insert_with(|| {
                order.push(e.module.as_str());
                (0, 0)
            });
            if side == 0 {
                c.0 += 1
            } else {
                c.1 += 1
            }
        }
    }
    order
        .into_iter()
        .filter_map(|m| {
            let (a, b) = counts[m];
            // a path one trace lacks altogether is another engine's naming, listed apart
            (a != b && a > 0 && b > 0).then(|| CountDiff {
                module: m.to_string(),
                step,
                calls_ref: a,
                calls_test: b,
            })
        })
        .collect()
}

/// Tokens of a tensor: all elements over the last dim (`[1, T, H]` and `[T, H]` alike).
fn tokens_of(shape: &[usize]) -> Option<usize> {
    let last = *shape.last()?;
    (last > 0 && shape.len() >= 2).then(|| shape.iter().product::<usize>() / last)
}

/// The first recorded calls of both traces, paired, holding other numbers of tokens (same
/// hidden size) are two runs of different inputs: nothing after them can be compared.
fn same_tokens(re: &TraceEntry, te: &TraceEntry) -> Result<()> {
    let rf = TraceFile::open(&re.path)?;
    let tf = TraceFile::open(&te.path)?;
    let (Some(r), Some(t)) = (rf.tensor("output"), tf.tensor("output")) else {
        return Ok(());
    };
    match (tokens_of(r.shape), tokens_of(t.shape)) {
        (Some(a), Some(b)) if a != b && r.shape.last() == t.shape.last() => {
            Err(Error::usage(format!(
                "the two runs have different inputs ({a} vs {b} tokens): not comparable; the \
                 first recorded call `{}` has output {:?} in REF ({}) and {:?} in TEST ({}). \
                 Record both runs on the same prompt and batch",
                re.module,
                r.shape,
                re.path.display(),
                t.shape,
                te.path.display()
            )))
        }
        _ => Ok(()),
    }
}

/// `cosine` printed to 6 digits, or to as many more as it takes to show it under `bar`
/// ("0.9951849 < 0.995185", not "0.995185 < 0.995185").
pub fn below(cosine: f64, bar: f64) -> String {
    let mut digits = 6;
    while digits < 15
        && format!("{cosine:.digits$}")
            .parse::<f64>()
            .is_ok_and(|c| c >= bar)
    {
        digits += 1;
    }
    format!("{cosine:.digits$}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    // Guards: a cosine just under the bar printed equal to it ("0.995185 < 0.995185").
    #[test]
    fn a_cosine_just_under_the_bar_prints_under_it() {
        let seed: u64 = rand::random();
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let bar: f64 = r.gen_range(0.9..0.9999);
        let c = bar - r.gen_range(1e-12..1e-8);
        let shown: f64 = below(c, bar).parse().unwrap();
        assert!(
            shown < bar,
            "seed {seed}: {} printed for {c} under {bar}",
            below(c, bar)
        );
        assert_eq!(below(0.5, bar), "0.500000");
    }

    fn lcs_len(a: &[u32], b: &[u32]) -> usize {
        let mut dp = vec![vec![0usize; b.len() + 1]; a.len() + 1];
        for i in (0..a.len()).rev() {
            for j in (0..b.len()).rev() {
                dp[i][j] = if a[i] == b[j] {
                    dp[i + 1][j + 1] + 1
                } else {
                    dp[i + 1][j].max(dp[i][j + 1])
                };
            }
        }
        dp[0][0]
    }

    /// The alignment is a longest common subsequence: as long as the quadratic DP's, of equal
    /// symbols, increasing on both sides; past the edit limit it gives up.
    #[test]
    fn lcs_is_a_longest_common_subsequence() {
        let seed: u64 = rand::random();
        let mut g = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        for _ in 0..500 {
            let alpha = g.gen_range(1..6);
            let a: Vec<u32> = (0..g.gen_range(0..30))
                .map(|_| g.gen_range(0..alpha))
                .collect();
            let b: Vec<u32> = (0..g.gen_range(0..30))
                .map(|_| g.gen_range(0..alpha))
                .collect();
            let p = lcs(&a, &b, 100).expect("within the limit");
            assert_eq!(p.len(), lcs_len(&a, &b), "seed {seed}: {a:?} {b:?}");
            for w in p.windows(2) {
                assert!(w[0].0 < w[1].0 && w[0].1 < w[1].1, "seed {seed}");
            }
            assert!(p.iter().all(|&(i, j)| a[i] == b[j]), "seed {seed}");
            let d = a.len() + b.len() - 2 * p.len();
            if d > 0 {
                assert!(lcs(&a, &b, d - 1).is_none(), "seed {seed}");
            }
        }
    }
}
