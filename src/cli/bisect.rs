//! `bisect`: where do two runs first diverge? Pairs the module calls of a reference trace and a
//! test trace (within each step, aligning the two sequences of module paths as `diff` aligns
//! lines), compares every tensor, and names the first call, in REF's execution order, whose
//! output drops below the cosine threshold.

use super::common::{progress, OutArgs};
use crate::error::{Error, Result};
use crate::report::{e, f, Report, Section, Verdict};
use crate::trace::bisect::{
    below, bisect, BisectResult, CallDiff, CallSummary, FirstDifference, LoneCall, TensorDiff,
};
use crate::trace::locate::{locate, FirstNonFinite};
use crate::trace::{rank_list, Selection, Skipped, TraceIndex};
use crate::trace::{role, Role};
use serde_json::{json, Value};
use std::path::PathBuf;

/// Rows of the terminal table beyond which the middle is elided (the JSON has every call).
const TABLE_MAX: usize = 400;
const TABLE_EDGE: usize = 40;
const JSON_MAX: usize = 20_000;
const JSON_EDGE: usize = 2_000;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Reference trace directory (e.g. the BF16 run, or eager mode)
    #[arg(value_name = "REF")]
    pub reference: PathBuf,
    /// Test trace directory (e.g. the NVFP4 run, or CUDA graphs)
    #[arg(value_name = "TEST")]
    pub test: PathBuf,
    /// Cosine below which a module's output counts as diverged. 0.99 sits between healthy
    /// NVFP4 noise (one NVFP4 GEMM against BF16 scores about 0.995; the residual stream scores
    /// higher) and real faults (wrong scale layout, wrong global scale, bad weights: far below
    /// 0.9, or NaN). Comparing two runs of the same precision (eager vs CUDA graphs, TP=1 vs
    /// TP=8), raise it to 0.9999. An output in the right direction with the wrong norm (TEST ≈
    /// 2.5 × REF has cosine 1) also diverges: its rel_l2 may not exceed sqrt(1/C² − 1), what
    /// noise reaches at cosine C (0.142 at 0.99).
    #[arg(long, value_name = "C", default_value_t = 0.99, value_parser = super::common::cosine, allow_negative_numbers = true)]
    pub min_cosine: f64,
    /// Rank to compare, in both traces (a file without `rank` metadata: the N of its rank<N>/ folder, else rank 0)
    #[arg(long, value_name = "R")]
    pub rank: Option<u64>,
    /// Rank of REF to compare (overrides --rank for REF): with --test-rank, rank R of one
    /// trace against rank S of the other. A side left unset takes --rank, else the other
    /// side's rank
    #[arg(long, value_name = "R")]
    pub ref_rank: Option<u64>,
    /// Rank of TEST to compare (overrides --rank for TEST); see --ref-rank
    #[arg(long, value_name = "S")]
    pub test_rank: Option<u64>,
    /// Compare only this step (default: all steps in order)
    #[arg(long, value_name = "S")]
    pub step: Option<u64>,
    #[command(flatten)]
    pub out_args: OutArgs,
}

fn opt(v: Option<f64>, digits: usize) -> String {
    v.map(|x| f(x, digits)).unwrap_or_else(|| "-".into())
}

fn status(c: &CallSummary, first: bool, first_difference: bool) -> String {
    match (c.outputs_match, first, c.inputs_match) {
        (true, _, _) if first_difference => "ok (first to differ)".into(),
        (true, _, _) => "ok".into(),
        (false, true, Some(false)) => "FIRST DIVERGENCE (inputs differ)".into(),
        (false, true, _) => "FIRST DIVERGENCE".into(),
        (false, false, _) => "diverged".into(),
    }
}

fn row(c: &CallSummary, first: bool, first_difference: bool) -> Vec<String> {
    let out = c.output.as_ref();
    let inp = c.worst_input.as_ref();
    vec![
        format!("{:06}", c.counter_ref),
        c.module.clone(),
        c.call.to_string(),
        out.map(|t| t.tensor.clone()).unwrap_or_else(|| "-".into()),
        opt(out.and_then(|t| t.cosine), 6),
        out.and_then(|t| t.rel_l2)
            .map(e)
            .unwrap_or_else(|| "-".into()),
        out.and_then(|t| t.max_abs_err)
            .map(e)
            .unwrap_or_else(|| "-".into()),
        out.map(|t| {
            format!(
                "{}/{}",
                t.nan_count + t.inf_count,
                t.ref_nan_count + t.ref_inf_count
            )
        })
        .unwrap_or_default(),
        inp.map(|t| opt(t.cosine, 6)).unwrap_or_else(|| "-".into()),
        status(c, first, first_difference),
    ]
}

fn tensor_json(t: &TensorDiff) -> Value {
    serde_json::to_value(t).unwrap_or(Value::Null)
}

pub fn run(args: &Args) -> Result<Report> {
    let ref_rank = args.ref_rank.or(args.rank).or(args.test_rank);
    let test_rank = args.test_rank.or(args.rank).or(args.ref_rank);
    let sel = |rank| Selection {
        rank,
        step: args.step,
    };
    // Without --rank every rank both traces hold is compared: a divergence on rank 1 only
    // (expert parallelism: ranks run different experts) must not pass.
    // ranks only one trace holds (another parallelism on each side, or a rank not recorded):
    // listed, not failed, as calls only one trace recorded are
    let mut unmatched: (Vec<u64>, Vec<u64>) = (vec![], vec![]);
    // TEST's ranks REF lacks (an unsharded reference against a TP/EP run): nothing to compare
    // them with, but a NaN/Inf there is a fault whatever the reference
    let mut test_only: Vec<TraceIndex> = vec![];
    // two whole traces are compared: a damaged file in either is bad input wherever it lies
    let readable = |i: TraceIndex| i.require_readable().map(|_| i);
    let pairs: Vec<(TraceIndex, TraceIndex)> = match (ref_rank, test_rank) {
        (Some(_), Some(_)) => vec![(
            TraceIndex::open(&args.reference, sel(ref_rank))
                .and_then(readable)
                .map_err(|e| on_side(e, "REF"))?,
            TraceIndex::open(&args.test, sel(test_rank))
                .and_then(readable)
                .map_err(|e| on_side(e, "TEST"))?,
        )],
        _ => {
            let refs = TraceIndex::open_each_rank(&args.reference, args.step)?;
            let mut tests = TraceIndex::open_each_rank(&args.test, args.step)?;
            for i in refs.iter().chain(&tests) {
                i.require_readable()?;
            }
            let rank = |i: &TraceIndex| i.selection.rank.unwrap_or(0);
            let ref_ranks: Vec<u64> = refs.iter().map(rank).collect();
            let test_ranks: Vec<u64> = tests.iter().map(rank).collect();
            let pairs: Vec<(TraceIndex, TraceIndex)> = refs
                .into_iter()
                .filter_map(|r| {
                    let k = tests.iter().position(|t| rank(t) == rank(&r))?;
                    Some((r, tests.remove(k)))
                })
                .collect();
            if pairs.is_empty() {
                return Err(Error::usage(format!(
                    "no rank is in both traces (REF ranks {}, TEST ranks {}): compare rank R \
                     of REF with rank S of TEST by --ref-rank R --test-rank S",
                    rank_list(&ref_ranks),
                    rank_list(&test_ranks)
                )));
            }
            unmatched = (
                ref_ranks
                    .iter()
                    .copied()
                    .filter(|r| !test_ranks.contains(r))
                    .collect(),
                tests.iter().map(rank).collect(),
            );
            test_only = tests;
            pairs
        }
    };
    let total = pairs
        .iter()
        .map(|(r, _)| r.entries.len() as u64)
        .sum::<u64>()
        + test_only
            .iter()
            .map(|t| t.entries.len() as u64)
            .sum::<u64>();
    let pb = progress(total, "bisect", args.out_args.quiet);
    let mut results = Vec::with_capacity(pairs.len());
    for (reference, test) in &pairs {
        results.push(bisect(reference, test, args.min_cosine, &mut || pb.inc(1))?);
    }
    let mut test_only_bad = vec![];
    for t in &test_only {
        if let Some(first) = locate(t, 0, &mut || pb.inc(1))?.first {
            test_only_bad.push((t.selection.rank.unwrap_or(0), first));
        }
    }
    pb.finish_and_clear();
    let reports: Vec<Report> = pairs
        .iter()
        .zip(&results)
        .map(|((reference, test), r)| report(args, reference, test, r))
        .collect();
    let rep = if reports.len() == 1 {
        let mut rep = reports.into_iter().next().expect("one report");
        let (r, t) = (&pairs[0].0.selection.rank, &pairs[0].1.selection.rank);
        if r != t {
            rep.headline = format!(
                "REF rank {} against TEST rank {}: {}",
                r.unwrap_or(0),
                t.unwrap_or(0),
                rep.headline
            );
        }
        rep
    } else {
        merge_ranks(&pairs, &results, reports)
    };
    Ok(with_nonfinite_test_ranks(
        with_unmatched_ranks(rep, &unmatched),
        &test_only_bad,
    ))
}

/// A rank-selection error names the trace it is about, and the flags that choose a rank.
fn on_side(e: Error, side: &str) -> Error {
    match e {
        Error::Usage(m) => Error::usage(format!(
            "{side}: {m} (--ref-rank and --test-rank choose each trace's rank)"
        )),
        e => e,
    }
}

/// A NaN/Inf in a TEST rank REF has no counterpart for fails the run, naming the rank and
/// the first bad call (`summary.test_only_nonfinite`): it passed as "not compared".
fn with_nonfinite_test_ranks(mut rep: Report, bad: &[(u64, FirstNonFinite)]) -> Report {
    let Some((rank, first)) = bad.first() else {
        return rep;
    };
    let o = &first.output;
    rep.verdict = Verdict::Fail;
    rep.headline = format!(
        "TEST rank {rank} (not in REF, so not compared) holds {} NaN and {} Inf, the first {} in `{}` of call {} {}{}; {}",
        o.nan_count,
        o.inf_count,
        o.value,
        o.tensor,
        first.call.counter,
        first.call.module,
        match (o.index.token, o.index.channel) {
            (Some(t), Some(c)) => format!(" (first at token {t}, channel {c})"),
            _ => String::new(),
        },
        rep.headline
    );
    if let Value::Object(s) = &mut rep.summary {
        s.insert(
            "test_only_nonfinite".into(),
            bad.iter()
                .map(|(r, f)| {
                    json!({
                        "rank": r,
                        "module": f.call.module,
                        "counter": f.call.counter,
                        "file": f.call.file,
                        "tensor": f.output.tensor,
                        "kind": f.output.kind.as_str(),
                        "index": f.output.index.multi,
                    })
                })
                .collect(),
        );
    }
    rep
}

/// Name the ranks only one trace holds in the headline and the summary
/// (`ranks_not_compared`).
fn with_unmatched_ranks(mut rep: Report, (in_ref, in_test): &(Vec<u64>, Vec<u64>)) -> Report {
    if in_ref.is_empty() && in_test.is_empty() {
        return rep;
    }
    let mut parts = vec![];
    if !in_ref.is_empty() {
        parts.push(format!("REF rank {} (not in TEST)", rank_list(in_ref)));
    }
    if !in_test.is_empty() {
        parts.push(format!("TEST rank {} (not in REF)", rank_list(in_test)));
    }
    rep.headline = format!("{}; not compared: {}", rep.headline, parts.join(", "));
    if let Value::Object(s) = &mut rep.summary {
        s.insert(
            "ranks_not_compared".into(),
            json!({ "reference": in_ref, "test": in_test }),
        );
    }
    rep
}

/// One report over several ranks: the rank whose first divergence comes first in REF's
/// (step, counter) order (ties: the lower rank), else a failing rank, else rank 0's report
/// with the headline of all ranks; a table of every rank's outcome is added.
fn merge_ranks(
    pairs: &[(TraceIndex, TraceIndex)],
    results: &[BisectResult],
    reports: Vec<Report>,
) -> Report {
    let rank = |k: usize| pairs[k].0.selection.rank.unwrap_or(0);
    let first_at = |k: usize| {
        results[k]
            .first_divergence
            .as_ref()
            .map(|(_, d)| (d.step, d.counter_ref))
    };
    let diverged = (0..results.len())
        .filter(|&k| results[k].first_divergence.is_some())
        .min_by_key(|&k| (first_at(k), rank(k)));
    let failing = (0..reports.len()).find(|&k| reports[k].verdict == Verdict::Fail);
    let pick = diverged.or(failing).unwrap_or(0);
    let ranks: Vec<u64> = (0..pairs.len()).map(rank).collect();
    let ranks_text = rank_list(&ranks);
    let mut table = Section::new(
        format!("Ranks compared ({})", ranks.len()),
        &["rank", "calls compared", "first divergence", "verdict"],
    );
    let mut per_rank = vec![];
    for (k, (r, rep)) in results.iter().zip(&reports).enumerate() {
        let first = r
            .first_divergence
            .as_ref()
            .map(|(_, d)| format!("{:06} {} (call {})", d.counter_ref, d.module, d.call));
        table.row(vec![
            rank(k).to_string(),
            r.calls.len().to_string(),
            first.unwrap_or_else(|| "-".into()),
            format!("{:?}", rep.verdict).to_lowercase(),
        ]);
        per_rank.push(json!({
            "rank": rank(k),
            "calls_compared": r.calls.len(),
            "verdict": rep.verdict,
            "first_divergence": r.first_divergence.as_ref().map(|(_, d)| json!({
                "module": d.module,
                "call": d.call,
                "counter_ref": d.counter_ref,
            })),
        }));
    }
    let compared: usize = results.iter().map(|r| r.calls.len()).sum();
    let mut rep = reports.into_iter().nth(pick).expect("one report per rank");
    rep.headline = match rep.verdict {
        Verdict::Pass => format!(
            "all {compared} matched module calls agree over {} ranks ({ranks_text})",
            ranks.len()
        ),
        Verdict::Fail => format!(
            "rank {}: {} (ranks compared: {ranks_text})",
            ranks[pick], rep.headline
        ),
    };
    if let Value::Object(s) = &mut rep.summary {
        s.insert("ranks".into(), json!(ranks));
        s.insert("calls_compared_all_ranks".into(), json!(compared));
    }
    if let Some(Value::Object(f)) = rep.body.get_mut("first_divergence") {
        f.insert("rank".into(), json!(ranks[pick]));
    }
    rep.sections.insert(0, table);
    rep.with("ranks", per_rank)
}

fn report(args: &Args, reference: &TraceIndex, test: &TraceIndex, r: &BisectResult) -> Report {
    let diverged = r.calls.iter().filter(|c| !c.outputs_match).count();
    let summary = json!({
        "reference": reference.dir,
        "test": test.dir,
        "rank": reference.selection.rank.unwrap_or(0),
        "rank_test": test.selection.rank.unwrap_or(0),
        "step": reference.selection.step,
        "min_cosine": args.min_cosine,
        "calls_ref": reference.entries.len(),
        "calls_test": test.entries.len(),
        "calls_compared": r.calls.len(),
        "calls_diverged": diverged,
        "only_in_ref": r.only_in_ref.len(),
        "only_in_test": r.only_in_test.len(),
        "skipped_ref": reference.skipped.len(),
        "skipped_test": test.skipped.len(),
        "trailing_only_in_ref": r.trailing_only_in_ref,
        "trailing_only_in_test": r.trailing_only_in_test,
        "calls_unscanned": reference.skipped.iter().chain(&test.skipped).filter(|k| k.unscanned_call).count(),
        "paired_by_step": r.by_step,
        "count_differs": r.count_differs.len(),
    });
    let mut lone_note = if r.only_in_ref.is_empty() && r.only_in_test.is_empty() {
        String::new()
    } else {
        format!(
            "; {} calls only in REF, {} only in TEST",
            r.only_in_ref.len(),
            r.only_in_test.len()
        )
    };
    if let Some(c) = r.count_differs.first() {
        lone_note.push_str(&format!(
            "; `{}` is called {} times in REF, {} in TEST{}{}",
            c.module,
            c.calls_ref,
            c.calls_test,
            c.step.map(|s| format!(" (step {s})")).unwrap_or_default(),
            match r.count_differs.len() {
                1 => String::new(),
                n => format!(" (and {} more modules: see count_differs)", n - 1),
            }
        ));
    }
    if !r.paired_by_count.is_empty() {
        lone_note.push_str(&format!(
            "; the calls of {} differ too much to align: there the k-th call of a module is \
             paired with the k-th",
            if r.by_step {
                format!(
                    "step {}",
                    r.paired_by_count
                        .iter()
                        .map(|s| s.unwrap_or(0).to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            } else {
                "the traces".to_string()
            }
        ));
    }
    // Trace files skipped on either side were not compared and cannot be vouched for. Calls
    // one trace recorded and the other did not are different (two engines name and fuse
    // modules differently: matching by name is the contract), so they are listed, not failed.
    let unscanned: Vec<(&str, &Skipped)> = reference
        .skipped
        .iter()
        .map(|s| ("REF", s))
        .chain(test.skipped.iter().map(|s| ("TEST", s)))
        .filter(|(_, s)| s.unscanned_call)
        .collect();
    let unscanned_note = match unscanned.len() {
        0 => String::new(),
        n => format!(
            "; {n} trace files were NOT compared (see Skipped files), e.g. {} {}: {}",
            unscanned[0].0,
            unscanned[0].1.file.display(),
            unscanned[0].1.reason
        ),
    };
    // One trace going on where the other stopped is a run that crashed or was interrupted (or
    // recorded fewer steps): what it never recorded cannot be vouched for. Lone calls on both
    // sides at the end are two engines' naming (HF `lm_head`, vLLM `logits_processor`), and
    // one lone call at the end is more likely a module one recorder hooked (a sampler).
    let stopped = match (r.trailing_only_in_ref, r.trailing_only_in_test) {
        (n, 0) if n > 1 && !r.calls.is_empty() => Some(("TEST", n, reference.entries.len())),
        (0, n) if n > 1 && !r.calls.is_empty() => Some(("REF", n, test.entries.len())),
        _ => None,
    };
    let stopped_note = stopped
        .map(|(side, n, of)| {
            let other = if side == "TEST" { "REF" } else { "TEST" };
            let from = if side == "TEST" {
                r.only_in_ref.get(r.only_in_ref.len() - n)
            } else {
                r.only_in_test.get(r.only_in_test.len() - n)
            };
            format!(
                "{side} stops early: the last {n} of {of} {other} calls{} have no match in \
                 {side} (a crashed or interrupted run, or fewer steps recorded: compare one \
                 with --step)",
                from.map(|l| format!(" (from `{}`, counter {:06})", l.module, l.counter))
                    .unwrap_or_default()
            )
        })
        .unwrap_or_default();
    let first = r.first_divergence.as_ref().map(|(_, d)| d);
    let incomplete = !unscanned.is_empty();
    let (verdict, headline) = match first {
        _ if r.calls.is_empty() => (
            Verdict::Fail,
            format!(
                "no module call is in both traces ({} in REF, {} in TEST): different module paths?",
                reference.entries.len(),
                test.entries.len()
            ),
        ),
        None if stopped.is_some() => (
            Verdict::Fail,
            format!(
                "not a pass: {stopped_note}; the {} matched module calls agree (every output \
                 cosine ≥ {}){lone_note}{unscanned_note}",
                r.calls.len(),
                args.min_cosine
            ),
        ),
        None if incomplete => (
            Verdict::Fail,
            format!(
                "not a pass: trace files were skipped; the {} matched module calls agree \
                 (every output cosine ≥ {}){lone_note}{unscanned_note}",
                r.calls.len(),
                args.min_cosine
            ),
        ),
        None => (
            Verdict::Pass,
            format!(
                "all {} matched module calls agree (every output cosine ≥ {}){lone_note}",
                r.calls.len(),
                args.min_cosine
            ),
        ),
        Some(c) => {
            let out = c.key_output();
            let what = out
                .and_then(|t| t.problem.clone())
                .unwrap_or_else(|| "no output to compare".into());
            let cause = cause_text(c, r);
            let hint = r
                .first_difference
                .as_ref()
                .map(first_difference_text)
                .unwrap_or_default();
            (
                Verdict::Fail,
                format!(
                    "first divergence at `{}` (call {}{}, counter {:06}) {}: {what}; {cause}{hint}{lone_note}{unscanned_note}",
                    c.module,
                    c.call,
                    c.step.map(|s| format!(" of step {s}")).unwrap_or_default(),
                    c.counter_ref,
                    out.map(|t| t.tensor.as_str()).unwrap_or("output"),
                ),
            )
        }
    };
    let mut rep = Report::new("bisect", verdict, headline).summary(summary);
    let first_json = first.map(|c| {
        let out = c.key_output();
        json!({
            "module": c.module,
            "call": c.call,
            "call_test": c.call_test,
            "step": c.step,
            "rank": reference.selection.rank.unwrap_or(0),
            "rank_test": test.selection.rank.unwrap_or(0),
            "counter_ref": c.counter_ref,
            "counter_test": c.counter_test,
            "file_ref": c.file_ref,
            "file_test": c.file_test,
            "tensor": out.map(|t| t.tensor.clone()),
            "cosine": out.and_then(|t| t.cosine),
            "rel_l2": out.and_then(|t| t.rel_l2),
            "sqnr_db": out.and_then(|t| t.sqnr_db),
            "max_abs_err": out.and_then(|t| t.max_abs_err),
            "nan_count": out.map(|t| t.nan_count),
            "inf_count": out.map(|t| t.inf_count),
            "ref_nan_count": out.map(|t| t.ref_nan_count),
            "ref_inf_count": out.map(|t| t.ref_inf_count),
            "first_nonfinite_index": out.and_then(|t| t.first_nonfinite_index.clone()),
            "problem": out.and_then(|t| t.problem.clone()),
            "inputs_diverged": c.inputs_match.map(|m| !m),
            "inputs_identical": c.inputs_identical,
            "cause": match c.inputs_match {
                Some(false) if c.inputs_shapes_differ => "shapes differ",
                Some(false) => "upstream",
                Some(true) => "this module",
                None => "unknown",
            },
            "tensors": c.tensors.iter().map(tensor_json).collect::<Vec<_>>(),
        })
    });
    rep = rep.with("first_divergence", first_json).with(
        "first_difference",
        r.first_difference.as_ref().map(|d| {
            json!({
                "module": d.module,
                "call": d.call,
                "step": d.step,
                "counter": d.counter_ref,
                "counter_test": d.counter_test,
                "file": d.file_ref,
                "file_test": d.file_test,
                "tensor": d.output.tensor,
                "cosine": d.output.cosine,
                "rel_l2": d.output.rel_l2,
                "max_abs_err": d.output.max_abs_err,
                "identical_before": d.identical_before,
                "stop_min_cosine": d.stop_min_cosine,
            })
        }),
    );

    if let Some(c) = first {
        let mut s = Section::new(
            format!("First divergence: {} (call {})", c.module, c.call),
            &[
                "tensor",
                "shape REF",
                "shape TEST",
                "cosine",
                "rel_l2",
                "max_abs_err",
                "NaN/Inf TEST",
                "NaN/Inf REF",
                "problem",
            ],
        );
        for t in &c.tensors {
            s.row(vec![
                t.tensor.clone(),
                format!("{:?} {}", t.shape_ref, t.dtype_ref),
                format!("{:?} {}", t.shape_test, t.dtype_test),
                opt(t.cosine, 6),
                t.rel_l2.map(e).unwrap_or_else(|| "-".into()),
                t.max_abs_err.map(e).unwrap_or_else(|| "-".into()),
                format!("{}/{}", t.nan_count, t.inf_count),
                format!("{}/{}", t.ref_nan_count, t.ref_inf_count),
                t.problem
                    .clone()
                    .or_else(|| t.note.clone())
                    .unwrap_or_default(),
            ]);
        }
        rep = rep.section(s);
    }

    let mut table = Section::new(
        "Module calls (REF execution order)",
        &[
            "counter",
            "module",
            "call",
            "tensor",
            "cosine",
            "rel_l2",
            "max_abs_err",
            "NaN+Inf test/ref",
            "worst input cos",
            "status",
        ],
    );
    let n = r.calls.len();
    let fi = r.first_divergence.as_ref().map(|(i, _)| *i);
    let mut elided = 0;
    let gap = |k: usize| {
        let mut v = vec![String::new(); 10];
        v[1] = format!("… {k} calls …");
        v
    };
    for (i, c) in r.calls.iter().enumerate() {
        if !kept(i, n, fi, TABLE_MAX, TABLE_EDGE) {
            elided += 1;
            continue;
        }
        if elided > 0 {
            table.row(gap(elided));
            elided = 0;
        }
        let fd = r.first_difference.as_ref().is_some_and(|d| d.index == i);
        table.row(row(c, Some(i) == fi, fd));
    }
    if elided > 0 {
        table.row(gap(elided));
    }
    rep = rep.section(table);

    if !r.only_in_ref.is_empty() || !r.only_in_test.is_empty() {
        let mut s = Section::new(
            "Module calls in one trace only",
            &["trace", "counter", "module", "call"],
        );
        for (side, list) in [("REF", &r.only_in_ref), ("TEST", &r.only_in_test)] {
            for l in list.iter().take(20) {
                s.row(vec![
                    side.into(),
                    format!("{:06}", l.counter),
                    l.module.clone(),
                    l.call.to_string(),
                ]);
            }
            if list.len() > 20 {
                s.row(vec![
                    side.into(),
                    String::new(),
                    format!("… {} more (see JSON)", list.len() - 20),
                    String::new(),
                ]);
            }
        }
        rep = rep.section(s);
    }
    let skipped: Vec<_> = reference
        .skipped
        .iter()
        .map(|s| ("REF", s))
        .chain(test.skipped.iter().map(|s| ("TEST", s)))
        .collect();
    if !skipped.is_empty() {
        let mut s = Section::new(
            format!(
                "Skipped files ({} trace files not compared, {} other entries)",
                unscanned.len(),
                skipped.len() - unscanned.len()
            ),
            &["trace", "file", "reason"],
        );
        let mut listed = skipped.clone();
        // unscanned calls first: they are what the verdict depends on
        listed.sort_by_key(|(_, k)| !k.unscanned_call);
        for (side, k) in listed.iter().take(20) {
            let what = if k.unscanned_call {
                format!("NOT COMPARED: {}", k.reason)
            } else {
                format!("ignored: {}", k.reason)
            };
            s.row(vec![side.to_string(), k.file.display().to_string(), what]);
        }
        if listed.len() > 20 {
            s.row(vec![
                String::new(),
                format!(
                    "… {} more (see JSON skipped_ref, skipped_test)",
                    listed.len() - 20
                ),
                String::new(),
            ]);
        }
        rep = rep.section(s);
    }
    // Every call in JSON up to JSON_MAX (compact: the deciding output and the worst input);
    // beyond, the same elision as the table, so a 100k-call trace gives a report of megabytes.
    let modules: Vec<Value> = r
        .calls
        .iter()
        .enumerate()
        .filter(|(i, _)| kept(*i, n, fi, JSON_MAX, JSON_EDGE))
        .map(|(_, c)| {
            json!({
                "module": c.module,
                "call": c.call,
                "call_test": c.call_test,
                "step": c.step,
                "counter_ref": c.counter_ref,
                "counter_test": c.counter_test,
                "outputs_match": c.outputs_match,
                "inputs_match": c.inputs_match,
                "output": c.output.as_ref().map(tensor_json),
                "worst_input": c.worst_input.as_ref().map(tensor_json),
            })
        })
        .collect();
    rep.with("only_in_ref", &r.only_in_ref)
        .with("only_in_test", &r.only_in_test)
        .with("count_differs", &r.count_differs)
        .with("skipped_ref", &reference.skipped)
        .with("skipped_test", &test.skipped)
        .with("modules_elided", n - modules.len())
        .with("modules", modules)
}

/// Why the first divergence happened, as far as its inputs tell.
fn cause_text(c: &CallDiff, r: &BisectResult) -> String {
    match c.inputs_match {
        Some(false) if c.inputs_shapes_differ => {
            let t = c
                .tensors
                .iter()
                .find(|t| matches!(role(&t.tensor), Role::Input(_)) && !t.matches);
            format!(
                "its inputs have other shapes{}: the token set of this call changed (routing or \
                 batching differs upstream)",
                t.map(|t| format!(" (REF {:?}, TEST {:?})", t.shape_ref, t.shape_test))
                    .unwrap_or_default()
            )
        }
        Some(false) => {
            // a call only one trace made before this one in its step may be what changed
            let before = |l: &&LoneCall, counter: u64| l.step == c.step && l.counter < counter;
            let lone: Vec<String> = r
                .only_in_ref
                .iter()
                .filter(|l| before(l, c.counter_ref))
                .map(|l| format!("REF `{}` (counter {:06})", l.module, l.counter))
                .chain(
                    r.only_in_test
                        .iter()
                        .filter(|l| before(l, c.counter_test))
                        .map(|l| format!("TEST `{}` (counter {:06})", l.module, l.counter)),
                )
                .collect();
            match lone.first() {
                None => "its inputs already differed: the cause is upstream, between recorded \
                         modules"
                    .to_string(),
                Some(l) => format!(
                    "its inputs already differed while every earlier paired call matched: the \
                     cause is upstream, between recorded modules, or in the {} call(s) only one \
                     trace made before it, e.g. {l}",
                    lone.len()
                ),
            }
        }
        Some(true) => {
            // passing the bar is not being equal: say by how much they differed
            let differing = c
                .tensors
                .iter()
                .filter(|t| matches!(role(&t.tensor), Role::Input(_)) && !t.identical())
                .max_by(|a, b| {
                    let k = |t: &TensorDiff| t.rel_l2.unwrap_or(f64::INFINITY);
                    k(a).partial_cmp(&k(b)).unwrap_or(std::cmp::Ordering::Equal)
                });
            match differing {
                None => "its inputs matched: this module introduced it".to_string(),
                Some(t) => format!(
                    "its inputs differed only by a little (`{}`: cosine {}, rel_l2 {}; within \
                     --min-cosine, not bit-identical): {}",
                    t.tensor,
                    t.cosine
                        .map(|c| below(c, 1.0))
                        .unwrap_or_else(|| "-".into()),
                    t.rel_l2.map(e).unwrap_or_else(|| "-".into()),
                    if r.first_difference.is_some() {
                        "this module introduced it, or blew up a difference from upstream"
                    } else {
                        "this module introduced it"
                    }
                ),
            }
        }
        None => "no inputs recorded".to_string(),
    }
}

/// The hint of a [`FirstDifference`]: where the two runs, bit-identical until then, first
/// differ, and the `--min-cosine` that stops bisect there.
fn first_difference_text(d: &FirstDifference) -> String {
    format!(
        "; the runs are bit-identical for the {} call{} before `{}` (call {}, counter {:06}), \
         whose `{}` is the first to differ (cosine {}, rel_l2 {}): if the runs should be \
         deterministic, that is where it starts{}",
        d.identical_before,
        if d.identical_before == 1 { "" } else { "s" },
        d.module,
        d.call,
        d.counter_ref,
        d.output.tensor,
        d.output
            .cosine
            .map(|c| below(c, 1.0))
            .unwrap_or_else(|| "-".into()),
        d.output.rel_l2.map(e).unwrap_or_else(|| "-".into()),
        d.stop_min_cosine
            .map(|c| format!(" (rerun with --min-cosine {c} to stop there)"))
            .unwrap_or_default()
    )
}

/// Whether call `i` of `n` is shown when at most `max` are: the first and last `edge`, and
/// `edge` either side of the first divergence.
fn kept(i: usize, n: usize, first: Option<usize>, max: usize, edge: usize) -> bool {
    n <= max || i < edge || i + edge >= n || first.is_some_and(|f| i + edge >= f && i <= f + edge)
}
