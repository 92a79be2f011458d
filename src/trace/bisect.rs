//! Two traces, matched call by call: the k-th call of a module path in REF is the k-th call of
//! that path in TEST. A call diverges when one of its outputs fails the cosine threshold, holds
//! NaN/Inf, or cannot be compared (shape, dtype, missing). The first divergence in REF's order
//! is where to look — unless its inputs already differed, which puts the cause upstream, in code
//! between recorded modules.

use super::file::{role, Role, TensorRef, TraceFile};
use super::index::{TraceEntry, TraceIndex};
use super::scan::paired_blocks;
use super::tokens::{self, token_min_cosine};
use crate::error::Result;
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
    /// Compared, finite on both sides, at or above the cosine threshold, and with a relative L2
    /// error no larger than noise reaches at that cosine (`metrics::max_rel_l2`).
    pub matches: bool,
}

/// A module call present in only one trace.
#[derive(Clone, Debug, Serialize)]
pub struct LoneCall {
    pub module: String,
    /// k: this is the k-th call (0-based) of the module path.
    pub call: usize,
    pub counter: u64,
    pub file: PathBuf,
}

/// One matched call pair.
#[derive(Clone, Debug, Serialize)]
pub struct CallDiff {
    pub module: String,
    pub call: usize,
    pub counter_ref: u64,
    pub counter_test: u64,
    pub file_ref: PathBuf,
    pub file_test: PathBuf,
    pub tensors: Vec<TensorDiff>,
    /// All outputs match.
    pub outputs_match: bool,
    /// `None` when neither trace recorded inputs for this call.
    pub inputs_match: Option<bool>,
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
    pub counter_ref: u64,
    pub counter_test: u64,
    pub output: Option<TensorDiff>,
    pub worst_input: Option<TensorDiff>,
    pub outputs_match: bool,
    pub inputs_match: Option<bool>,
}

impl CallSummary {
    fn of(d: &CallDiff) -> CallSummary {
        CallSummary {
            module: d.module.clone(),
            call: d.call,
            counter_ref: d.counter_ref,
            counter_test: d.counter_test,
            output: d.key_output().cloned(),
            worst_input: d.worst_input().cloned(),
            outputs_match: d.outputs_match,
            inputs_match: d.inputs_match,
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
}

/// (module path, k) for every entry: the k-th call of that path in this trace's order.
fn call_keys(entries: &[TraceEntry]) -> Vec<(&str, usize)> {
    let mut seen: HashMap<&str, usize> = HashMap::new();
    entries
        .iter()
        .map(|e| {
            let k = seen.entry(e.module.as_str()).or_insert(0);
            *k += 1;
            (e.module.as_str(), *k - 1)
        })
        .collect()
}

fn lone(e: &TraceEntry, call: usize) -> LoneCall {
    LoneCall {
        module: e.module.clone(),
        call,
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
        max_abs_err: None,
        nan_count: 0,
        inf_count: 0,
        ref_nan_count: 0,
        ref_inf_count: 0,
        problem: None,
        note: None,
        matches: false,
    };
    let (r, t) = match (r, t) {
        (Some(r), Some(t)) => (r, t),
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
        // ids and masks: equal bytes or not
        d.problem = (r.dtype != t.dtype || r.shape != t.shape || !same_bytes(&r, &t))
            .then(|| "non-float tensors differ".to_string());
        d.matches = d.problem.is_none();
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
    d.max_abs_err = Some(m.max_abs_err).filter(|c| c.is_finite());
    d.nan_count = m.nan_count;
    d.inf_count = m.inf_count;
    d.ref_nan_count = ref_stats.nan_count;
    d.ref_inf_count = ref_stats.inf_count;
    // an input both runs passed with the same NaN/Inf at the same places (an attention mask of
    // -inf) is the same input: its finite values decide
    let same_nonfinite_input = (matches!(role(name), Role::Input(_))
        && !ref_stats.is_finite()
        && ref_stats.nan_count == m.nan_count
        && ref_stats.inf_count == m.inf_count)
        .then(|| finite_if_same_nonfinite(&t, &r))
        .flatten();
    if let Some(f) = same_nonfinite_input {
        d.cosine = Some(f.cosine).filter(|c| c.is_finite());
        d.rel_l2 = Some(f.rel_l2).filter(|c| c.is_finite());
        d.max_abs_err = Some(f.max_abs_err).filter(|c| c.is_finite());
        d.note = Some(format!(
            "{} NaN, {} Inf at the same places in REF and TEST (a mask?): compared on the \
             finite values",
            m.nan_count, m.inf_count
        ));
        if !f.passes(min_cosine) {
            d.problem = Some(format!("cosine {:.6} < {min_cosine}", f.cosine));
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
    } else if !ref_stats.is_finite() {
        d.problem = Some(format!(
            "NaN/Inf in REF ({} NaN, {} Inf): the reference itself is broken here",
            ref_stats.nan_count, ref_stats.inf_count
        ));
    } else if m.nan_count + m.inf_count > 0 {
        d.problem = Some(format!(
            "NaN/Inf in TEST ({} NaN, {} Inf)",
            m.nan_count, m.inf_count
        ));
    } else if !m.passes(min_cosine) {
        d.problem = Some(format!("cosine {:.6} < {min_cosine}", m.cosine));
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

/// When every NaN of one tensor is a NaN of the other at the same index and every ±Inf the
/// same ±Inf: the metrics over the finite values (both sides finite there). `None` otherwise.
fn finite_if_same_nonfinite(t: &TensorRef, r: &TensorRef) -> Option<Metrics> {
    let mut acc = Accum::default();
    let all = paired_blocks(t, r, |start, x, y| {
        let same = x.iter().zip(y).all(|(&a, &b)| {
            a.is_finite() == b.is_finite() && (a.is_finite() || a == b || a.is_nan() && b.is_nan())
        });
        // TEST's non-finite values are left out of the sums, and they are exactly REF's
        if same {
            acc = acc.merge(Accum::over(x, y, start));
        }
        same
    });
    if !all {
        return None;
    }
    acc.nan = 0;
    acc.inf = 0;
    acc.first_nan = None;
    acc.first_inf = None;
    Some(acc.finish())
}

fn same_bytes(a: &TensorRef, b: &TensorRef) -> bool {
    a.raw() == b.raw()
}

fn diff_call(re: &TraceEntry, te: &TraceEntry, call: usize, min_cosine: f64) -> Result<CallDiff> {
    let rf = TraceFile::open(&re.path)?;
    let tf = TraceFile::open(&te.path)?;
    let mut names: Vec<&str> = rf.tensors().map(|t| t.name).collect();
    for t in tf.tensors() {
        if !names.contains(&t.name) {
            names.push(t.name);
        }
    }
    names.sort_by(|a, b| (role(a), a).cmp(&(role(b), b)));
    let tensors: Vec<TensorDiff> = names
        .iter()
        .map(|n| diff_tensor(n, rf.tensor(n), tf.tensor(n), min_cosine))
        .collect();
    let outs: Vec<&TensorDiff> = tensors
        .iter()
        .filter(|t| matches!(role(&t.tensor), Role::Output(_)))
        .collect();
    // A call with no output at all on either side has nothing to match: count it as diverged.
    let outputs_match = !outs.is_empty() && outs.iter().all(|t| t.matches);
    let ins: Vec<&TensorDiff> = tensors
        .iter()
        .filter(|t| matches!(role(&t.tensor), Role::Input(_)))
        .collect();
    let inputs_match = (!ins.is_empty()).then(|| ins.iter().all(|t| t.matches));
    Ok(CallDiff {
        module: re.module.clone(),
        call,
        counter_ref: re.counter,
        counter_test: te.counter,
        file_ref: re.path.clone(),
        file_test: te.path.clone(),
        tensors,
        outputs_match,
        inputs_match,
    })
}

/// Compare every matched call; `tick` once per REF call.
pub fn bisect(
    reference: &TraceIndex,
    test: &TraceIndex,
    min_cosine: f64,
    tick: &mut dyn FnMut(),
) -> Result<BisectResult> {
    let ref_keys = call_keys(&reference.entries);
    let test_keys = call_keys(&test.entries);
    let test_at: HashMap<(&str, usize), usize> =
        test_keys.iter().enumerate().map(|(i, &k)| (k, i)).collect();
    let mut matched_test = vec![false; test.entries.len()];
    let mut calls = Vec::new();
    let mut only_in_ref = Vec::new();
    let mut first_divergence = None;
    let mut trailing_only_in_ref = 0;
    for (re, &key) in reference.entries.iter().zip(&ref_keys) {
        tick();
        let Some(&ti) = test_at.get(&key) else {
            only_in_ref.push(lone(re, key.1));
            trailing_only_in_ref += 1;
            continue;
        };
        trailing_only_in_ref = 0;
        matched_test[ti] = true;
        let d = diff_call(re, &test.entries[ti], key.1, min_cosine)?;
        calls.push(CallSummary::of(&d));
        if !d.outputs_match && first_divergence.is_none() {
            first_divergence = Some((calls.len() - 1, d));
        }
    }
    let trailing_only_in_test = matched_test.iter().rev().take_while(|&&m| !m).count();
    let only_in_test = test
        .entries
        .iter()
        .zip(&test_keys)
        .zip(&matched_test)
        .filter(|(_, &m)| !m)
        .map(|((e, k), _)| lone(e, k.1))
        .collect();
    Ok(BisectResult {
        calls,
        first_divergence,
        only_in_ref,
        only_in_test,
        trailing_only_in_ref,
        trailing_only_in_test,
    })
}
