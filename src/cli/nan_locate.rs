//! `nan-locate`: where does the first NaN/Inf appear? (H2/H7.) Scans a trace in completion
//! order (the recorder's counter: forward hooks fire on a module's exit) and names the first
//! module call whose output holds a non-finite value, where in it, whether that module produced
//! it (its inputs were clean) or received it, and the last clean call.

use super::common::{progress, OutArgs};
use crate::error::{Error, Result};
use crate::report::{e, Report, Section, Verdict};
use crate::trace::locate::{locate, BadValue, FirstNonFinite, LocateResult, ScannedCall};
use crate::trace::scan::{Kind, TensorStats};
use crate::trace::{rank_list, Selection, Skipped, TraceIndex};
use serde_json::{json, Value};
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Trace directory: NNNNNN-<module.path>.safetensors files (and one level of rank<N>/ or
    /// step<N>/ subfolders; other subfolders are ignored)
    #[arg(value_name = "TRACE")]
    pub trace: PathBuf,
    /// Rank to scan (a file without `rank` metadata: the N of its rank<N>/ folder, else rank 0)
    #[arg(long, value_name = "R")]
    pub rank: Option<u64>,
    /// Scan only this step (default: all steps in order)
    #[arg(long, value_name = "S")]
    pub step: Option<u64>,
    /// Module calls shown before and after the first bad one (with no bad output, the one whose
    /// input held a NaN)
    #[arg(long, value_name = "N", default_value_t = 5)]
    pub context: usize,
    #[command(flatten)]
    pub out_args: OutArgs,
}

fn index_json(v: &BadValue) -> Value {
    json!({
        "token": v.index.token,
        "channel": v.index.channel,
        "flat": v.index.flat,
        "multi": v.index.multi,
    })
}

fn where_(v: &BadValue) -> String {
    match (v.index.token, v.index.channel) {
        (Some(t), Some(c)) => format!("token {t}, channel {c}, index {:?}", v.index.multi),
        _ => "0-d tensor".into(),
    }
}

fn counter(c: &ScannedCall) -> String {
    match c.step {
        Some(s) => format!("{:06} (step {s})", c.counter),
        None => format!("{:06}", c.counter),
    }
}

/// A row of the table of calls; `mark` is the answer's call (step, counter) and its status
/// (`FIRST BAD`, or a swallowed NaN input's).
fn call_row(c: &ScannedCall, mark: Option<(Option<u64>, u64, &str)>) -> Vec<String> {
    let out = c.outputs().next();
    let shape = out.map(|t| format!("{:?}", t.shape)).unwrap_or_default();
    // over the finite values: none at all (an all-NaN output) has no maximum to show
    let stats = || c.outputs().filter_map(|t| t.stats);
    let any_finite = stats().any(|s| has_finite(&s));
    let max_abs = stats().map(|s| s.max_abs).fold(0f32, f32::max);
    let (nan, inf) = c
        .outputs()
        .filter_map(|t| t.stats)
        .fold((0, 0), |(n, i), s| (n + s.nan_count, i + s.inf_count));
    let inputs = match c.inputs_finite() {
        None => "-".to_string(),
        Some(true) => "clean".to_string(),
        Some(false) if c.inputs().all(|t| t.is_finite() || t.is_mask()) => "mask".to_string(),
        Some(false) => "NaN/Inf".to_string(),
    };
    let status = if let Some((_, _, m)) = mark.filter(|m| (m.0, m.1) == (c.step, c.counter)) {
        m.to_string()
    } else if c.outputs_finite() {
        "clean".to_string()
    } else if c.outputs_ok() {
        "mask (-inf)".to_string()
    } else {
        "bad".to_string()
    };
    vec![
        counter(c),
        c.module.clone(),
        shape,
        if any_finite {
            e(max_abs as f64)
        } else {
            "-".to_string()
        },
        nan.to_string(),
        inf.to_string(),
        inputs,
        status,
    ]
}

/// Whether a scanned tensor holds a finite value (`max_abs` means something).
fn has_finite(s: &TensorStats) -> bool {
    (s.nan_count + s.inf_count) < s.numel as u64
}

/// Whether the first bad call's uncounted input is an additive `0`/`-inf` mask.
fn is_mask_input(f: &FirstNonFinite) -> bool {
    f.uncounted_input
        .as_ref()
        .is_some_and(|b| f.call.inputs().any(|t| t.name == b.tensor && t.is_mask()))
}

/// `; N outputs held only 0 and -inf …`: mask outputs that were not counted as bad.
fn mask_note(r: &LocateResult) -> String {
    match &r.mask_outputs {
        None => String::new(),
        Some((c, m, t, n)) => format!(
            "; {} output(s) held only 0 and -inf (attention masks, not counted), the first `{m}` \
             {t} ({n} -inf, counter {c:06})",
            r.mask_output_count
        ),
    }
}

fn mask_json(r: &LocateResult) -> Value {
    match &r.mask_outputs {
        None => Value::Null,
        Some((c, m, t, n)) => json!({
            "count": r.mask_output_count,
            "first": {"module": m, "counter": c, "tensor": t, "inf_count": n},
        }),
    }
}

fn call_json(c: &ScannedCall) -> Value {
    json!({
        "module": c.module,
        "counter": c.counter,
        "step": c.step,
        "file": c.file,
        "outputs_finite": c.outputs_finite(),
        "inputs_clean": c.inputs_finite(),
        "tensors": c.tensors.iter().map(|t| json!({
            "tensor": t.name,
            "dtype": t.dtype,
            "shape": t.shape,
            "nan_count": t.stats.map(|s| s.nan_count),
            "inf_count": t.stats.map(|s| s.inf_count),
            "max_abs": t.stats.filter(has_finite).map(|s| s.max_abs),
        })).collect::<Vec<_>>(),
    })
}

pub fn run(args: &Args) -> Result<Report> {
    // Without --rank every rank is scanned: a NaN on rank 1 of a clean rank 0 (expert or data
    // parallelism: ranks see different experts or tokens) must not pass.
    let indexes = match args.rank {
        Some(_) => vec![TraceIndex::open(
            &args.trace,
            Selection {
                rank: args.rank,
                step: args.step,
            },
        )?],
        None => TraceIndex::open_each_rank(&args.trace, args.step)?,
    };
    let total = indexes.iter().map(|i| i.entries.len() as u64).sum();
    let pb = progress(total, "nan-locate", args.out_args.quiet);
    let mut results = Vec::with_capacity(indexes.len());
    for index in &indexes {
        results.push(locate(index, args.context, &mut || pb.inc(1))?);
    }
    pb.finish_and_clear();
    if indexes.len() == 1 {
        return report(&indexes[0], &results[0]);
    }
    let reports = indexes
        .iter()
        .zip(&results)
        .map(|(i, r)| report(i, r))
        .collect::<Result<Vec<_>>>()?;
    Ok(merge_ranks(&indexes, &results, reports))
}

/// Where a NaN/Inf shows, in (step, counter) order; at one counter a call's input comes before
/// its output (and before another rank's output at that counter: an all-to-all's input is sent
/// before any rank's output holds it).
type At = (Option<u64>, u64, u8);

fn at_input(c: &ScannedCall) -> At {
    (c.step, c.counter, 0)
}

fn at_output(c: &ScannedCall) -> At {
    (c.step, c.counter, 1)
}

/// What a rank's own report names under `first_nonfinite`: the NaN input its first bad output
/// received, else that output, else a NaN input swallowed with no bad output after it. (call,
/// tensor, whether it is an input, where.)
fn rank_answer(r: &LocateResult) -> Option<(&ScannedCall, &str, bool, At)> {
    fn input((c, b): &(ScannedCall, BadValue)) -> (&ScannedCall, &str, bool, At) {
        (c, b.tensor.as_str(), true, at_input(c))
    }
    if let Some(n) = received_nan_input(r) {
        return Some(input(n));
    }
    match &r.first {
        Some(f) => Some((&f.call, f.output.tensor.as_str(), false, at_output(&f.call))),
        None => r.nan_input.as_ref().map(input),
    }
}

/// One report over several ranks, as if their calls were one trace in (step, counter) order: the
/// first bad output of any rank, unless a NaN input swallowed earlier (its outputs clean) is where
/// it first shows. That is so on its own rank when that rank's first bad output received its
/// value (see [`received_nan_input`]), and across ranks when a rank's first bad output received a
/// NaN through its inputs with no NaN before it on that rank: expert parallelism moves tokens
/// between ranks (all-to-all dispatch and combine), so a NaN one rank's dispatch input holds
/// shows up in another rank's input. A swallowed NaN no bad output received (a masked op on one
/// rank, an unrelated bad output elsewhere) is a second fault, said beside the answer as on one
/// rank; with no bad output on any rank, the earliest one is the answer. Ties: the lower rank.
/// Else a failing rank (files not scanned), else rank 0's report with the headline and counts of
/// all ranks; a table of every rank's outcome is added.
fn merge_ranks(indexes: &[TraceIndex], results: &[LocateResult], reports: Vec<Report>) -> Report {
    let rank_of = |i: &TraceIndex| i.selection.rank.unwrap_or(0);
    let ranks: Vec<u64> = indexes.iter().map(rank_of).collect();
    let any_bad_output = results.iter().any(|r| r.first.is_some());
    // a rank's first bad output that received a NaN/Inf with none before it on its own rank,
    // of a kind `from` can have become
    let unexplained = |k: usize, from: &BadValue| {
        let r = &results[k];
        r.first
            .as_ref()
            .filter(|f| {
                f.inputs_clean == Some(false)
                    && r.nan_input.is_none()
                    && can_become(from, &f.output)
            })
            .map(|f| at_output(&f.call))
    };
    // (where, rank, position, the rank whose bad output received it across ranks)
    let mut candidates: Vec<(At, u64, usize, Option<usize>)> = vec![];
    for (k, r) in results.iter().enumerate() {
        if let Some((_, _, _, at)) = rank_answer(r).filter(|_| r.first.is_some()) {
            candidates.push((at, ranks[k], k, None));
        }
        let Some((c, swallowed)) = r
            .nan_input
            .as_ref()
            .filter(|_| received_nan_input(r).is_none())
        else {
            continue;
        };
        let at = at_input(c);
        if !any_bad_output {
            candidates.push((at, ranks[k], k, None));
            continue;
        }
        let receiver = (0..results.len())
            .filter(|&o| o != k)
            .filter_map(|o| {
                unexplained(o, swallowed)
                    .filter(|&b| b > at)
                    .map(|b| (b, ranks[o], o))
            })
            .min()
            .map(|(_, _, o)| o);
        if receiver.is_some() {
            candidates.push((at, ranks[k], k, receiver));
        }
    }
    let bad = candidates.iter().min().copied();
    let failing = (0..reports.len()).find(|&k| reports[k].verdict == Verdict::Fail);
    let pick = bad.map(|b| b.2).or(failing).unwrap_or(0);
    let ranks_text = rank_list(&ranks);
    let mut table = Section::new(
        format!("Ranks scanned ({})", ranks.len()),
        &["rank", "calls scanned", "first NaN/Inf", "verdict"],
    );
    let mut per_rank = vec![];
    for ((index, r), rep) in indexes.iter().zip(results).zip(&reports) {
        // the rank's own answer, and a NaN input swallowed before a bad output it made itself
        let answer = rank_answer(r);
        let swallowed = r
            .nan_input
            .as_ref()
            .filter(|_| r.first.is_some() && received_nan_input(r).is_none());
        let mut first = answer
            .map(|(c, t, input, _)| {
                format!(
                    "{} {} {t}{}",
                    counter(c),
                    c.module,
                    if input {
                        " (an input, output clean)"
                    } else {
                        ""
                    }
                )
            })
            .unwrap_or_else(|| "-".into());
        if let Some((c, b)) = swallowed {
            first.push_str(&format!(
                "; before it, NaN swallowed: {} {} {}",
                counter(c),
                c.module,
                b.tensor
            ));
        }
        table.row(vec![
            rank_of(index).to_string(),
            r.calls_scanned.to_string(),
            first,
            format!("{:?}", rep.verdict).to_lowercase(),
        ]);
        per_rank.push(json!({
            "rank": rank_of(index),
            "calls_scanned": r.calls_scanned,
            "verdict": rep.verdict,
            "first_nonfinite": answer.map(|(c, t, _, _)| json!({
                "module": c.module,
                "tensor": t,
                "counter": c.counter,
                "step": c.step,
            })),
            "nan_input": r.nan_input.as_ref().map(|(c, b)| json!({
                "module": c.module,
                "tensor": b.tensor,
                "counter": c.counter,
                "step": c.step,
            })),
        }));
    }
    let scanned: usize = results.iter().map(|r| r.calls_scanned).sum();
    let mut rep = reports.into_iter().nth(pick).expect("one report per rank");
    let picked_rank = ranks[pick];
    if let Some((_, _, j, Some(k))) = bad {
        received_across_ranks(&mut rep, &indexes[j], &results[j], &results[k], ranks[k]);
    }
    // a NaN swallowed on another rank before the answer that no bad output received
    let second = bad.and_then(|(at, _, j, _)| {
        (0..results.len())
            .filter(|&k| k != j)
            .filter_map(|k| {
                let r = &results[k];
                let (c, b) = r.nan_input.as_ref()?;
                (received_nan_input(r).is_none() && at_input(c) < at)
                    .then(|| (at_input(c), ranks[k], c, b))
            })
            .min_by_key(|s| (s.0, s.1))
    });
    if let Some((_, k, c, b)) = second {
        rep.headline.push_str(&format!(
            "; before it, rank {k}'s `{}` {} (counter {}) held {} NaN (first at [{}]) that no \
             recorded output held and no bad output received through its inputs: swallowed \
             there (a masked op, or a second fault)",
            c.module,
            b.tensor,
            counter(c),
            b.nan_count,
            where_(b)
        ));
    }
    rep.headline = match (bad, rep.verdict) {
        (Some(_), _) => format!(
            "rank {picked_rank}: {} (ranks scanned: {ranks_text})",
            rep.headline
        ),
        (None, Verdict::Pass) => format!(
            "no NaN/Inf in the outputs of {scanned} module calls over {} ranks ({ranks_text}){}",
            ranks.len(),
            indexes[0]
                .selection
                .step
                .map(|s| format!(", step {s}"))
                .unwrap_or_default()
        ),
        (None, _) => format!("rank {picked_rank}: {}", rep.headline),
    };
    if let Value::Object(s) = &mut rep.summary {
        s.insert("ranks".into(), json!(ranks));
        s.insert("calls_scanned_all_ranks".into(), json!(scanned));
    }
    rep.sections.insert(0, table);
    rep.with("ranks", per_rank)
}

/// A headline's lead for the NaN input `b` of call `c` that the call swallowed: where it is,
/// and after which clean call (`on`: " on rank N" across ranks) code between recorded
/// modules made it.
fn swallowed_lead(c: &ScannedCall, b: &BadValue, r: &LocateResult, on: &str) -> String {
    format!(
        "first NaN in `{}` {} [{}] (counter {}), an input: every recorded output before it{on} \
         was clean, so code between recorded modules made it ({}), and this module swallowed it",
        c.module,
        b.tensor,
        where_(b),
        counter(c),
        r.clean_before_nan_input
            .as_ref()
            .map(|p| format!("after `{}`, counter {}", p.module, counter(p)))
            .unwrap_or_else(|| "before the first recorded call".into())
    )
}

/// `nan_input` and `first_nonfinite` of a swallowed NaN input (`r.nan_input`) that the bad
/// output `f` received: the input, with `first_bad_output` (its `rank` when across ranks).
fn received_json(
    index: &TraceIndex,
    r: &LocateResult,
    f: &FirstNonFinite,
    rank: Option<u64>,
) -> (Option<Value>, Value) {
    let o = &f.output;
    let mut bad = json!({
        "module": f.call.module,
        "file": f.call.file,
        "tensor": o.tensor,
        "index": index_json(o),
        "kind": o.kind,
        "counter": f.call.counter,
        "step": f.call.step,
        "inputs_clean": f.inputs_clean,
    });
    if let (Some(k), Value::Object(m)) = (rank, &mut bad) {
        m.insert("rank".into(), json!(k));
    }
    let nan_input = nan_input_json(index, r);
    let mut first = nan_input.clone().unwrap_or(Value::Null);
    if let Value::Object(m) = &mut first {
        m.insert("first_bad_output".into(), bad);
    }
    (nan_input, first)
}

/// The "First non-finite value" table of a NaN input (`c`, `b`) its call swallowed and a later
/// output (`first_bad_output`, described) received.
fn swallowed_nan_section(
    c: &ScannedCall,
    b: &BadValue,
    first_bad_output: String,
    r: &LocateResult,
) -> Section {
    let mut rows = value_rows(c, b);
    rows.extend([
        (
            "inputs",
            "hold it, the output is clean (made between recorded modules)".into(),
        ),
        ("first bad output", first_bad_output),
        (
            "last clean call",
            last_clean_cell(r.clean_before_nan_input.as_ref()),
        ),
    ]);
    Section::kv("First non-finite value", &rows)
}

/// The first rows of a "First non-finite value" table: where the value `b` of call `c` is.
fn value_rows(c: &ScannedCall, b: &BadValue) -> Vec<(&'static str, String)> {
    vec![
        ("module", c.module.clone()),
        ("file", c.file.display().to_string()),
        ("tensor", format!("{} {} {:?}", b.tensor, b.dtype, b.shape)),
        ("index", where_(b)),
        ("kind", format!("{} (value {})", b.kind.as_str(), b.value)),
        (
            "NaN / Inf in tensor",
            format!("{} / {}", b.nan_count, b.inf_count),
        ),
    ]
}

/// Rewrite the report of the rank whose swallowed NaN input (`r.nan_input`) is where the value
/// first shows: `first_nonfinite` names that input, its `first_bad_output` the output of rank
/// `to_rank` (`to`) that received it through its inputs.
fn received_across_ranks(
    rep: &mut Report,
    index: &TraceIndex,
    r: &LocateResult,
    to: &LocateResult,
    to_rank: u64,
) {
    let (Some((c, b)), Some(f)) = (&r.nan_input, &to.first) else {
        return;
    };
    let o = &f.output;
    let rank = index.selection.rank.unwrap_or(0);
    rep.verdict = Verdict::Fail;
    rep.headline = format!(
        "{}; rank {to_rank}'s first bad output, `{}` {} (counter {}, {}), received a NaN/Inf \
         through its inputs with none in rank {to_rank}'s calls before it: it came from another \
         rank (expert parallelism moves tokens between ranks in its all-to-all), and this input \
         is where it first shows",
        swallowed_lead(c, b, r, &format!(" on rank {rank}")),
        f.call.module,
        o.tensor,
        counter(&f.call),
        o.kind.as_str(),
    );
    let (nan_input, first) = received_json(index, r, f, Some(to_rank));
    let kv = swallowed_nan_section(
        c,
        b,
        format!(
            "rank {to_rank}: {} {} {}",
            counter(&f.call),
            f.call.module,
            o.tensor
        ),
        r,
    );
    // the rank's own answer (a bad output it made later, or none) gives way to this one
    rep.sections.retain(|s| s.title != kv.title);
    rep.sections.insert(0, kv);
    let last_clean = r.clean_before_nan_input.as_ref().map(clean_json);
    rep.body.insert("first_nonfinite".into(), first);
    rep.body.insert("nan_input".into(), json!(nan_input));
    rep.body.insert("last_clean".into(), json!(last_clean));
}

/// `file: reason` of the first few skipped calls, for a headline or an error message.
fn first_skips(unscanned: &[&Skipped]) -> String {
    const SHOWN: usize = 3;
    let mut s = unscanned
        .iter()
        .take(SHOWN)
        .map(|k| format!("{}: {}", k.file.display(), k.reason))
        .collect::<Vec<_>>()
        .join("; ");
    if unscanned.len() > SHOWN {
        s.push_str(&format!("; … {} more", unscanned.len() - SHOWN));
    }
    s
}

/// Runs of counters absent between two recorded calls of one step, `(first, last)` absent: a
/// recorder numbers every call it writes, so a gap is calls never written or deleted since,
/// where a NaN would go unseen. Several ranks in one directory interleave their counters: not
/// judged there.
fn counter_gaps(index: &TraceIndex) -> Vec<(u64, u64)> {
    if index.ranks.len() > 1 {
        return vec![];
    }
    index
        .entries
        .windows(2)
        .filter(|w| w[0].step == w[1].step && w[1].counter > w[0].counter + 1)
        .map(|w| (w[0].counter + 1, w[1].counter - 1))
        .collect()
}

fn report(index: &TraceIndex, r: &LocateResult) -> Result<Report> {
    let scope = index.selection.describe();
    let mut skipped = index.skipped.clone();
    skipped.extend(r.skipped.iter().cloned());
    // A verdict over files that were not looked at is no verdict: nothing scanned is bad input,
    // and a clean scan with recorded calls left out is not a pass.
    let unscanned: Vec<&Skipped> = skipped.iter().filter(|k| k.unscanned_call).collect();
    let gaps = counter_gaps(index);
    if r.calls_scanned == 0 {
        return Err(Error::bad_file(
            &index.dir,
            format!(
                "nothing to scan ({scope}): not one of the {} selected trace files holds an \
                 `output` tensor; {} skipped: {}",
                index.entries.len(),
                unscanned.len(),
                first_skips(&unscanned)
            ),
        ));
    }
    let summary = json!({
        "trace": index.dir,
        "rank": index.selection.rank.unwrap_or(0),
        "step": index.selection.step,
        "files_total": index.files_total,
        "calls_selected": index.entries.len(),
        "calls_scanned": r.calls_scanned,
        "skipped": skipped.len(),
        "calls_unscanned": unscanned.len(),
        "found": r.first.is_some(),
        "counter_gaps": gaps,
    });
    let first_counter = r.first.as_ref().map(|f| f.call.counter);
    // the call the table marks: the first bad output, else the call that swallowed a NaN input
    let mark = match (&r.first, &r.nan_input) {
        (Some(f), _) => Some((f.call.step, f.call.counter, "FIRST BAD")),
        (None, Some((c, _))) => Some((c.step, c.counter, "FIRST NaN (input)")),
        (None, None) => None,
    };
    // where the answer lies: the NaN input the first bad output received, else that output
    let answer_counter = received_nan_input(r)
        .map(|(c, _)| c.counter)
        .or(first_counter);
    let mut table = Section::new(
        "Module calls around it (completion order)",
        &[
            "counter",
            "module",
            "output shape",
            "max |out|",
            "NaN",
            "Inf",
            "inputs",
            "status",
        ],
    );
    for c in &r.window {
        table.row(call_row(c, mark));
    }
    let unscanned_note = match unscanned.len() {
        0 => String::new(),
        n => format!(
            "; {n} trace files were NOT scanned (see Skipped files), so an earlier NaN/Inf \
             may hide there: {}",
            first_skips(&unscanned)
        ),
    };
    let mut rep = match &r.first {
        None => {
            let (verdict, headline) = if let Some((c, b)) = &r.nan_input {
                (
                    Verdict::Fail,
                    format!(
                        "no NaN/Inf in any output, but `{}` {} holds {} NaN (first non-finite at \
                         [{}], counter {}) while every output before it was clean: code between \
                         recorded modules made it (or hooks recorded out of order), and this \
                         module swallowed it ({scope}){unscanned_note}",
                        c.module,
                        b.tensor,
                        b.nan_count,
                        where_(b),
                        counter(c)
                    ),
                )
            } else if unscanned.is_empty() {
                (
                    Verdict::Pass,
                    format!(
                        "no NaN/Inf in the outputs of {} module calls ({scope}){}",
                        r.calls_scanned,
                        mask_note(r)
                    ),
                )
            } else {
                (
                    Verdict::Fail,
                    format!(
                        "not a pass: {} of {} trace files were not scanned; no NaN/Inf in the \
                         outputs of the {} module calls that were ({scope}): {}",
                        unscanned.len(),
                        r.calls_scanned + unscanned.len(),
                        r.calls_scanned,
                        first_skips(&unscanned)
                    ),
                )
            };
            // a NaN input is the trace's first bad tensor: CI reads it where it reads an output's
            let nan_input = nan_input_json(index, r);
            let last_clean = match &r.nan_input {
                Some(_) => r.clean_before_nan_input.as_ref(),
                None => r.last_clean.as_ref(),
            };
            let mut rep = Report::new("nan-locate", verdict, headline)
                .summary(summary)
                .with("first_nonfinite", nan_input.clone())
                .with("nan_input", nan_input)
                .with("last_clean", last_clean.map(clean_json));
            if r.nan_input.is_none() {
                table.title = "Last module calls scanned".into();
            }
            rep = rep.section(table);
            rep
        }
        // the first bad output received its NaN/Inf through its inputs, and an earlier call
        // already held a NaN in an input alone: that input is where the value first shows
        Some(f) if received_nan_input(r).is_some() => {
            let (c, b) = received_nan_input(r).expect("matched by the guard");
            let o = &f.output;
            let headline = format!(
                "{}; the first bad output, `{}` {} (counter {}, {}), received it through its \
                 inputs ({scope}){}{unscanned_note}",
                swallowed_lead(c, b, r, ""),
                f.call.module,
                o.tensor,
                counter(&f.call),
                o.kind.as_str(),
                mask_note(r),
            );
            let (nan_input, first) = received_json(index, r, f, None);
            let kv = swallowed_nan_section(
                c,
                b,
                format!("{} {} {}", counter(&f.call), f.call.module, o.tensor),
                r,
            );
            Report::new("nan-locate", Verdict::Fail, headline)
                .summary(summary)
                .with("first_nonfinite", first)
                .with("nan_input", nan_input)
                .with(
                    "last_clean",
                    r.clean_before_nan_input.as_ref().map(clean_json),
                )
                .section(kv)
                .section(table)
        }
        Some(f) => {
            let o = &f.output;
            let verdict_why =
                match f.inputs_clean {
                    Some(true) => match &r.near_overflow {
                        // finite is not clean when a value upstream already sat at the dtype's
                        // limit: the Inf here is that overflow arriving
                        Some((c, t, m, max)) if o.kind.as_str() == "inf" => format!(
                            "its inputs were finite, but `{}` {t} (counter {}) already reached \
                             {m:.4e}, within 2x of its dtype's largest finite value {max:.4e}: \
                             the overflow started there",
                            c.module,
                            counter(c)
                        ),
                        _ => match &f.uncounted_input {
                            Some(b) if is_mask_input(f) => format!(
                                "its inputs were clean ({} holds only 0 and -inf: an attention \
                                 mask, not a fault): this module produced it{}",
                                b.tensor,
                                if o.kind == Kind::Nan {
                                    " (a fully masked softmax row gives NaN)"
                                } else {
                                    ", or passed the mask's -inf on"
                                }
                            ),
                            Some(b) => format!(
                                "its inputs held no NaN, but {} holds {} Inf (first at [{}]): \
                                 this module made the NaN from them (inf − inf, 0 · inf)",
                                b.tensor,
                                b.inf_count,
                                where_(b)
                            ),
                            None => "its inputs were clean: this module produced it".to_string(),
                        },
                    },
                    Some(false) => format!(
                    "its inputs were already bad ({} at {}): it came from code that ran before, \
                     not recorded as a module",
                    f.bad_input.as_ref().map(|b| b.tensor.as_str()).unwrap_or("an input"),
                    f.bad_input.as_ref().map(where_).unwrap_or_default()
                ),
                    None => "no inputs recorded: cannot tell whether it produced or received it"
                        .to_string(),
                };
            // a NaN swallowed earlier (an input only) is a second fault: said, not dropped
            let nan_input_note = match &r.nan_input {
                Some((c, b)) => format!(
                    "; before it, `{}` {} (counter {}) already held {} NaN (first at [{}]) that \
                     no recorded output held: made between recorded modules, and swallowed there",
                    c.module,
                    b.tensor,
                    counter(c),
                    b.nan_count,
                    where_(b)
                ),
                None => String::new(),
            };
            let headline = format!(
                "first {} in `{}` {} [{}] (counter {}); {verdict_why}{}{nan_input_note}{unscanned_note}",
                if o.kind.as_str() == "nan" {
                    "NaN"
                } else {
                    "Inf"
                },
                f.call.module,
                o.tensor,
                where_(o),
                counter(&f.call),
                mask_note(r),
            );
            let first = json!({
                "module": f.call.module,
                "file": f.call.file,
                "tensor": o.tensor,
                "index": index_json(o),
                "kind": o.kind,
                "value": o.value.to_string(),
                "counter": f.call.counter,
                "step": f.call.step,
                "rank": index.selection.rank.unwrap_or(0),
                "shape": o.shape,
                "dtype": o.dtype,
                "nan_count": o.nan_count,
                "inf_count": o.inf_count,
                "inputs_clean": f.inputs_clean,
                "near_overflow": r.near_overflow.as_ref().map(|(c, t, m, max)| json!({
                    "module": c.module,
                    "counter": c.counter,
                    "tensor": t,
                    "max_abs": m,
                    "dtype_max": max,
                })),
                "bad_input": f.bad_input.as_ref().map(|b| json!({
                    "tensor": b.tensor,
                    "index": index_json(b),
                    "kind": b.kind,
                    "nan_count": b.nan_count,
                    "inf_count": b.inf_count,
                })),
                "uncounted_input": f.uncounted_input.as_ref().map(|b| json!({
                    "tensor": b.tensor,
                    "index": index_json(b),
                    "kind": b.kind,
                    "value": b.value.to_string(),
                    "nan_count": b.nan_count,
                    "inf_count": b.inf_count,
                    "mask": is_mask_input(f),
                })),
            });
            let mut rows = value_rows(&f.call, o);
            rows.extend([
                (
                    "inputs",
                    match f.inputs_clean {
                        Some(true) => match &f.uncounted_input {
                            Some(b) if is_mask_input(f) => format!(
                                "clean ({} is a 0/-inf attention mask; this module produced it)",
                                b.tensor
                            ),
                            Some(b) => {
                                format!("no NaN ({} holds Inf; this module made the NaN)", b.tensor)
                            }
                            None => "clean (this module produced it)".into(),
                        },
                        Some(false) => "already bad (it came from earlier)".into(),
                        None => "not recorded".into(),
                    },
                ),
                ("last clean call", last_clean_cell(r.last_clean.as_ref())),
            ]);
            let kv = Section::kv("First non-finite value", &rows);
            Report::new("nan-locate", Verdict::Fail, headline)
                .summary(summary)
                .with("first_nonfinite", first)
                .with("nan_input", nan_input_json(index, r))
                .with("last_clean", r.last_clean.as_ref().map(clean_json))
                .section(kv)
                .section(table)
        }
    };
    // gaps before the answer are calls a NaN could hide in; those after it do not matter
    let before: Vec<&(u64, u64)> = gaps
        .iter()
        .filter(|g| answer_counter.is_none_or(|c| g.1 < c))
        .collect();
    if let Some((a, b)) = before.first() {
        let missing: u64 = before.iter().map(|g| g.1 - g.0 + 1).sum();
        rep.headline.push_str(&format!(
            "; note: {missing} counter(s) absent from the trace (first {a:06}{}): calls never \
             recorded or deleted since, not scanned",
            if a == b {
                String::new()
            } else {
                format!("-{b:06}")
            }
        ));
    }
    rep = rep.with("mask_outputs", mask_json(r)).with(
        "modules",
        r.window.iter().map(call_json).collect::<Vec<_>>(),
    );
    if !skipped.is_empty() {
        // unscanned calls first: they are what the verdict depends on
        let mut s = Section::new(
            format!(
                "Skipped files ({} trace files not scanned, {} other entries)",
                unscanned.len(),
                skipped.len() - unscanned.len()
            ),
            &["file", "reason"],
        );
        let mut listed: Vec<&Skipped> = skipped.iter().collect();
        listed.sort_by_key(|k| !k.unscanned_call);
        for k in listed.iter().take(20) {
            let what = if k.unscanned_call {
                format!("NOT SCANNED: {}", k.reason)
            } else {
                format!("ignored: {}", k.reason)
            };
            s.row(vec![k.file.display().to_string(), what]);
        }
        if skipped.len() > 20 {
            s.row(vec![
                format!("… {} more (see JSON `skipped`)", skipped.len() - 20),
                String::new(),
            ]);
        }
        rep = rep.section(s);
    }
    Ok(rep.with("skipped", &skipped))
}

/// The NaN input the first bad output received: an earlier call held a NaN in an input alone
/// (its outputs clean) and the first bad output's inputs were already bad, so that input is
/// where the value first shows. `None` when the first bad output made its own (clean inputs,
/// or none recorded), or holds only Inf where the swallowed input held only NaN (arithmetic
/// never turns a NaN into an Inf): a swallowed NaN before it is then a second fault, noted
/// beside it.
fn received_nan_input(r: &LocateResult) -> Option<&(ScannedCall, BadValue)> {
    let f = r.first.as_ref()?;
    r.nan_input
        .as_ref()
        .filter(|(_, b)| f.inputs_clean == Some(false) && can_become(b, &f.output))
}

/// Whether the non-finite values of `from` can have become those of `to`: a NaN stays NaN, an
/// Inf can become either (Inf - Inf, 0 * Inf).
fn can_become(from: &BadValue, to: &BadValue) -> bool {
    to.nan_count > 0 || from.inf_count > 0
}

/// The first NaN held by an input only, before any bad output (`LocateResult::nan_input`).
fn nan_input_json(index: &TraceIndex, r: &LocateResult) -> Option<Value> {
    r.nan_input.as_ref().map(|(c, b)| {
        json!({
            "module": c.module,
            "file": c.file,
            "tensor": b.tensor,
            "index": index_json(b),
            "kind": b.kind,
            "value": b.value.to_string(),
            "counter": c.counter,
            "step": c.step,
            "rank": index.selection.rank.unwrap_or(0),
            "shape": b.shape,
            "dtype": b.dtype,
            "nan_count": b.nan_count,
            "inf_count": b.inf_count,
            "inputs_clean": false,
        })
    })
}

/// The table's "last clean call" cell.
fn last_clean_cell(c: Option<&ScannedCall>) -> String {
    c.map(|c| format!("{} {}", counter(c), c.module))
        .unwrap_or_else(|| "none: the first call is already bad".into())
}

fn clean_json(c: &ScannedCall) -> Value {
    json!({
        "module": c.module,
        "file": c.file,
        "counter": c.counter,
        "step": c.step,
        "tensor": c.outputs().next().map(|t| t.name.clone()),
    })
}
