//! `gs-sweep`: is the activation global scale wrong (H1/H6)? The layer under every gs source
//! (default 1/2688, checkpoint `input_scale`, warm-up on randn, calibrated, dynamic) and a
//! log-spaced sweep of one gs for every GEMM; the gs in use must not lose much against the best.

use super::common::{progress, DeviceArgs, OutArgs, Steps};
use super::expert_check::{ExpertCheck, ExpertVerdict, DEFAULT_MIN_EXPERT_SLOTS};
use super::kernel::{self, KernelArgs};
use super::layertest::{
    below, block_summary, check_unsharded, ep_disagreement, ep_json_with, input_nonfinite,
    layer_and_batch, nvfp4_forward, scales_json, slots, token_bar, token_failure, BlockSummary,
    EpArgs, GsArgs, InputArgs, Model, ScaleFindings, DEFAULT_MIN_COSINE, DEFAULT_MIN_EXPERT_COSINE,
    DEFAULT_MIN_TOKEN_COSINE,
};
use crate::error::{Error, Result};
use crate::metrics::Metrics;
use crate::moe::breakdown::{per_expert, per_token, worst_first};
use crate::moe::forward::BatchAmax;
use crate::moe::gs::{self, Calibration, GsSource};
use crate::moe::parallel::tolerance_text;
use crate::moe::{ActScales, Path as MoePath};
use crate::nvfp4::DEFAULT_GS;
use crate::report::svg::{Plot, Series};
use crate::report::{e, f, Report, Section, Verdict};
use serde::Serialize;
use serde_json::json;

/// Default `--max-loss` in cosine against the best gs found. A healthy NVFP4 layer sits near
/// cosine 0.974 (rel-L2 ~0.23); losing 0.01 takes it to ~0.964, i.e. ~20% more error than the
/// best scale gives: well past the gs-to-gs noise of a sweep, well short of the saturation
/// collapse a wrong gs causes.
pub const DEFAULT_MAX_LOSS: f64 = 0.01;

#[derive(clap::Args, Debug)]
#[command(
    after_help = "Verdict: fail when the gs in use (--gs, default `default`: the engines' \
1/2688, i.e. amax assumed 1) loses more than --max-loss (default 0.01) cosine against the best \
gs found, or gives NaN/Inf, or when one expert's own output fails under it (layertest's \
--min-expert-cosine bar) while the scales calibrated on this batch pass that expert: its input \
scale is wrong, though few tokens reach it and the layer's cosine hides it. When even the best gs leaves the layer below --min-cosine (0.95, \
layertest's default) against the BF16 reference, or every gs gives NaN/Inf, no activation gs fixes \
it: the verdict fails with cause `not_gs` (the weights, their scales, the reference or the kernel), \
not `gs`. Writes gs-sweep.svg (cosine vs gs) and gs-sweep-blocks.svg \
(saturated / flushed blocks vs gs) into the report dir. With --ep N every point runs sharded over N \
expert-parallel ranks, and the gs in use must also equal the unsharded run up to FP32 summation order."
)]
pub struct Args {
    #[command(flatten)]
    pub input: InputArgs,
    /// MoE layer index (default: the first MoE layer)
    #[arg(long, value_name = "L")]
    pub layer: Option<usize>,
    #[command(flatten)]
    pub gs: GsArgs,
    /// Points of the log-spaced sweep
    #[arg(long, value_name = "N", default_value_t = 25, value_parser = super::common::sweep_points)]
    pub points: usize,
    /// Decades the sweep covers on each side of the calibrated gs (widened to include every
    /// source's median gs)
    #[arg(long, value_name = "DECADES", default_value_t = 2.5)]
    pub span: f64,
    /// Fail when the gs in use loses more than this cosine against the best
    #[arg(long, value_name = "C", default_value_t = DEFAULT_MAX_LOSS, value_parser = super::common::cosine_loss)]
    pub max_loss: f64,
    /// Fail with cause `not_gs` when even the best gs leaves the layer below this cosine
    #[arg(long, value_name = "C", default_value_t = DEFAULT_MIN_COSINE, value_parser = super::common::cosine, allow_negative_numbers = true)]
    pub min_cosine: f64,
    /// Fail when, under the gs in use, one token's output falls below this cosine (layertest's
    /// per-token bar): one token of huge norm carries the layer's cosine and sets the gs
    #[arg(long, value_name = "C", default_value_t = DEFAULT_MIN_TOKEN_COSINE, value_parser = super::common::cosine, allow_negative_numbers = true)]
    pub min_token_cosine: f64,
    /// Fail when, under the gs in use, one expert's own output falls below this cosine
    /// (layertest's bar, ramped down for experts few slots reached) while the scales
    /// calibrated on this batch pass it: one expert's wrong input_scale, which the layer's
    /// cosine hides when few tokens reach that expert
    #[arg(long, value_name = "C", default_value_t = DEFAULT_MIN_EXPERT_COSINE, value_parser = super::common::cosine, allow_negative_numbers = true)]
    pub min_expert_cosine: f64,
    /// Slots an expert needs to be judged at --min-expert-cosine (layertest's rule)
    #[arg(long, value_name = "N", default_value_t = DEFAULT_MIN_EXPERT_SLOTS)]
    pub min_expert_slots: usize,
    #[command(flatten)]
    pub ep: EpArgs,
    #[command(flatten)]
    pub kernel: KernelArgs,
    #[command(flatten)]
    pub device: DeviceArgs,
    #[command(flatten)]
    pub out_args: OutArgs,
}

#[derive(Clone, Serialize)]
struct Point {
    /// Source name, or `sweep`.
    label: String,
    /// Median gs1 / gs2 (quant direction); None for dynamic.
    gs1: Option<f32>,
    gs2: Option<f32>,
    cosine: f64,
    rel_l2: f64,
    nan_count: u64,
    inf_count: u64,
    blocks: BlockSummary,
}

/// Largest `--span` (decades on each side).
const MAX_SPAN: f64 = 30.0;

pub fn run(args: &Args) -> Result<Report> {
    // f32 global scales span ~76 decades; a sweep past them is all 0 or inf
    if !(args.span.is_finite() && args.span > 0.0 && args.span <= MAX_SPAN) {
        return Err(Error::usage(format!(
            "--span {}: decades on each side of the calibrated gs, in (0, {MAX_SPAN}]",
            args.span
        )));
    }
    let devices = args.ep.open(&args.device, args.out_args.quiet)?;
    let plugin = kernel::open(&args.kernel, &devices)?;
    let ep = args.ep.shard();
    let backend = devices.main();
    let model = Model::open(&args.input)?;
    let l = model.pick_layer(args.layer)?;
    // what comes before the sweep's own bar: on a DeepSeek-V3 layer, many seconds
    let steps = Steps::new(2, args.out_args.quiet);
    steps.next(&format!("loading layer {l}"));
    let (layer, batch) = layer_and_batch(&model, l, &args.input, &devices, false, true)?;
    let c = &layer.config;
    let ids = batch.input_ids.as_deref();
    steps.next("BF16 reference");
    let routing = backend.route(&layer, &batch.hidden, ids)?;
    let reference =
        backend.moe_forward(&layer, &batch.hidden, &routing, &MoePath::Reference, false)?;
    drop(steps);
    let amax = BatchAmax::new(&layer, &batch.hidden, &routing);
    let cal = Calibration {
        hidden: &batch.hidden,
        input_ids: ids,
        routing: Some(&routing),
        amax: Some(&amax),
    };
    let reduce = args.gs.input_scale_reduce;
    let used_source = args.gs.gs.unwrap_or(GsSource::Default);

    // the NVFP4 layer at scales `s`, sharded with --ep
    let forward = |s: &ActScales| {
        nvfp4_forward(
            &args.ep,
            &devices,
            &layer,
            &batch.hidden,
            &routing,
            s,
            false,
        )
    };
    let reduce_info = std::cell::RefCell::new(None);
    // the layer's output at scales `s`, and our forward's block statistics; with --kernel the
    // user's kernel is the one swept (block statistics stay ours: the quantization they
    // describe is the same function)
    let output = |s: &ActScales| -> Result<(Vec<f32>, crate::moe::MoeOutput)> {
        let (mut o, r) = forward(s)?;
        if r.is_some() {
            *reduce_info.borrow_mut() = r;
        }
        let out = match &plugin {
            Some((p, g)) => kernel::plugin_layer(p, g, &layer, &batch.hidden, &routing, s, ep)?,
            None => std::mem::take(&mut o.out),
        };
        Ok((out, o))
    };
    let eval = |label: String, s: &ActScales| -> Result<Point> {
        let (out, o) = output(s)?;
        let m: Metrics = backend.compare(&out, &reference.out)?;
        let med = gs::summary(s);
        Ok(Point {
            label,
            gs1: med.map(|(a, _)| a[1]),
            gs2: med.map(|(_, b)| b[1]),
            cosine: m.cosine,
            rel_l2: m.rel_l2,
            nan_count: m.nan_count,
            inf_count: m.inf_count,
            blocks: block_summary(&o.act_stats),
        })
    };

    // ---- the sources ----
    let mut source_list = vec![
        GsSource::Default,
        GsSource::Checkpoint,
        GsSource::Warmup,
        GsSource::Calibrated,
        GsSource::Dynamic,
    ];
    if let GsSource::Value(_) = used_source {
        source_list.push(used_source);
    }
    let pb = progress(
        (source_list.len() + args.points) as u64,
        "gs-sweep",
        args.out_args.quiet,
    );
    let mut sources: Vec<Point> = vec![];
    let mut unavailable: Vec<(String, String)> = vec![];
    let mut used_scales = None;
    let mut calibrated_scales = None;
    let mut calibrated_center = None;
    for src in &source_list {
        match gs::resolve(*src, &layer, reduce, &cal, args.input.seed) {
            Ok(ActScales::Dynamic) if plugin.is_some() => {
                let why = "the plugin ABI takes fixed per-expert scales; dynamic ones are computed inside the kernel";
                if *src == used_source {
                    return Err(Error::usage(format!("--gs dynamic with --kernel: {why}")));
                }
                unavailable.push((src.to_string(), why.to_string()));
            }
            Ok(s) => {
                let p = eval(src.to_string(), &s)?;
                if *src == GsSource::Calibrated {
                    calibrated_scales = Some(s.clone());
                    calibrated_center = p
                        .gs1
                        .zip(p.gs2)
                        .map(|(a, b)| ((a as f64) * (b as f64)).sqrt());
                }
                if *src == used_source {
                    used_scales = Some(s);
                }
                sources.push(p);
            }
            Err(e) if *src != used_source => unavailable.push((src.to_string(), e.to_string())),
            Err(e) => return Err(e),
        }
        pb.inc(1);
    }

    // ---- the sweep: one gs for both GEMMs of every expert ----
    let center = calibrated_center.unwrap_or(DEFAULT_GS as f64);
    let span = 10f64.powf(args.span.max(0.1));
    let (mut lo, mut hi) = (center / span, center * span);
    for p in &sources {
        for g in [p.gs1, p.gs2].into_iter().flatten() {
            let g = g as f64;
            if g.is_finite() && g > 0.0 {
                lo = lo.min(g / 2.0);
                hi = hi.max(g * 2.0);
            }
        }
    }
    let n = args.points;
    let mut sweep: Vec<Point> = vec![];
    for j in 0..n {
        let g = (lo.ln() + (hi.ln() - lo.ln()) * j as f64 / (n - 1) as f64).exp() as f32;
        sweep.push(eval(
            "sweep".into(),
            &gs::resolve(GsSource::Value(g), &layer, reduce, &cal, 0)?,
        )?);
        pb.inc(1);
    }
    pb.finish_and_clear();

    // ---- EP: the gs in use, sharded, against the unsharded run ----
    let ep_agreement = match (&used_scales, args.ep.sharded()) {
        (Some(s), true) => {
            let (o, _) = forward(s)?;
            Some(check_unsharded(
                &devices,
                &layer,
                &batch.hidden,
                &routing,
                s,
                &o.out,
            )?)
        }
        _ => None,
    };

    // what the scales in use do to their inputs, from one pass over them: under --gs
    // checkpoint its input scales far above what their inputs need named in the failures;
    // the checkpoint's input scales judged both ways in the JSON whatever the gs in use (the
    // engine takes them), and the amax the reciprocal check below reads
    let findings = match &used_scales {
        Some(s) => Some(ScaleFindings::of(&layer, &amax, s, used_source, reduce)?),
        None => None,
    };
    let flushes = || worst_flushes(findings.as_ref());

    // ---- verdict ----
    let clean = |p: &&Point| p.nan_count + p.inf_count == 0 && p.cosine.is_finite();
    let best = sources
        .iter()
        .chain(&sweep)
        .filter(clean)
        .max_by(|a, b| a.cosine.total_cmp(&b.cosine))
        .cloned();
    let best_sweep = sweep
        .iter()
        .filter(clean)
        .max_by(|a, b| a.cosine.total_cmp(&b.cosine))
        .cloned();
    let used = sources
        .iter()
        .find(|p| p.label == used_source.to_string())
        .cloned();
    let loss_of = |p: &Point| -> f64 {
        match &best {
            Some(b) if clean(&p) => b.cosine - p.cosine,
            _ => f64::INFINITY,
        }
    };
    let used_loss = used.as_ref().map_or(f64::INFINITY, loss_of);
    let (in_bad, in_json) = input_nonfinite(&batch.hidden, layer.config.hidden_size);
    let mut failures: Vec<String> = in_bad.iter().cloned().collect();
    // what the first failure blames: a CI script tells "fix the gs" from "look elsewhere"
    let mut cause = in_bad.is_some().then_some("input");
    // no gs reaches the bar: a sweep that "wins" by saturating a too-large expert output or
    // flushing a broken one is no fix, and calling it a gs problem sends the user the wrong way
    let not_gs = match &best {
        None => Some("every gs gives NaN/Inf".to_string()),
        Some(b) if below(b.cosine, args.min_cosine) => Some(format!(
            "no activation gs brings the layer near the BF16 reference: the best, {}, reaches \
             cosine {} < --min-cosine {}",
            describe_gs(b),
            f(b.cosine, 4),
            args.min_cosine
        )),
        Some(_) => None,
    };
    if let Some(m) = not_gs {
        let (suspects, next) = match &plugin {
            Some(_) => (
                "your kernel, the weights, their scales or the reference",
                "`layertest --kernel` (your kernel against the built-in one), ",
            ),
            None => ("the weights, their scales or the reference", ""),
        };
        failures.push(format!(
            "{m}; the fault is not the activation scale but {suspects}: run {next}`audit` \
             (scales, and weights against the BF16 originals), `layertest` (expert by expert) \
             and `compare-weights` (what the engine loaded)"
        ));
        cause.get_or_insert("not_gs");
    } else if let Some(u) = &used {
        if u.nan_count + u.inf_count > 0 {
            failures.push(format!(
                "gs `{used_source}` gives NaN/Inf: {} NaN, {} Inf in the layer output",
                u.nan_count, u.inf_count
            ));
            cause.get_or_insert("gs");
        } else if used_loss > args.max_loss {
            // too large a gs saturates blocks at 448, too small a one flushes them to zero:
            // name the one that happened, not saturation alone
            let blocks = if u.blocks.flushed_pct > u.blocks.saturated_pct {
                format!(
                    "{:.1}% of its activation blocks flush to zero (gs too small){}",
                    u.blocks.flushed_pct,
                    flushes()
                )
            } else {
                format!(
                    "{:.1}% of its activation blocks saturate (block scale at 448, the E4M3 max){}",
                    u.blocks.saturated_pct,
                    worst_overshoots(findings.as_ref())
                )
            };
            failures.push(format!(
                "gs `{used_source}` loses {} cosine against the best ({} at {}) > --max-loss {}; {blocks}{}",
                f(used_loss, 4),
                f(best.as_ref().map_or(f64::NAN, |b| b.cosine), 4),
                best.as_ref().map_or("-".into(), describe_gs),
                args.max_loss,
                fixing_source(&sources, u, args.max_loss, &loss_of),
            ));
            cause.get_or_insert("gs");
        }
    }
    if let Some(m) = ep_agreement.as_ref().and_then(|a| {
        ep_disagreement(
            &args.ep,
            a,
            c.hidden_size,
            &format!("output under gs `{used_source}`"),
        )
    }) {
        failures.push(m);
        cause.get_or_insert("ep");
    }
    // one expert's wrong input_scale hides in the layer's cosine when few tokens reach it:
    // judge each expert under the gs in use as layertest does, and blame the gs where the
    // scales calibrated on this batch pass the same expert
    let check = ExpertCheck {
        min_cosine: args.min_expert_cosine,
        min_slots: args.min_expert_slots,
    };
    let mut expert_json = None;
    if let (None, Some(s), Some(cal)) = (
        &plugin,
        &used_scales,
        calibrated_scales
            .as_ref()
            .filter(|_| used_source != GsSource::Calibrated),
    ) {
        let forward = |s: &ActScales| {
            nvfp4_forward(&args.ep, &devices, &layer, &batch.hidden, &routing, s, true)
        };
        let rf = backend.moe_forward(&layer, &batch.hidden, &routing, &MoePath::Reference, true)?;
        let (hsz, ne) = (c.hidden_size, c.n_routed_experts);
        let experts = |o: &crate::moe::MoeOutput| -> Result<_> {
            Ok(per_expert(&routing, slots(o)?, slots(&rf)?, hsz, ne))
        };
        let mut used_e = experts(&forward(s)?.0)?;
        let cal_e = experts(&forward(cal)?.0)?;
        used_e.sort_by(|a, b| worst_first(&a.metrics, &b.metrics));
        let wrong: Vec<(String, f64, f64)> = used_e
            .iter()
            .filter_map(|x| {
                let ExpertVerdict::Fail(line) = check.judge(x) else {
                    return None;
                };
                let cal = cal_e.iter().find(|y| y.expert == x.expert)?;
                (check.judge(cal) == ExpertVerdict::Pass).then_some((
                    line,
                    x.metrics.cosine,
                    cal.metrics.cosine,
                ))
            })
            .collect();
        expert_json = Some(json!({
            "wrong_scale_experts": wrong.len(),
            "min_expert_cosine": args.min_expert_cosine,
            "min_expert_slots": args.min_expert_slots,
        }));
        if let Some((line, _, cal_cos)) = wrong.first() {
            failures.push(format!(
                "gs `{used_source}`: {} expert(s) fail under it but pass under the scales \
                 calibrated on this batch, so their input scales are wrong; first: {line} \
                 (calibrated: cosine {}){}",
                wrong.len(),
                f(*cal_cos, 4),
                worst_overshoots(findings.as_ref()) + &flushes()
            ));
            cause.get_or_insert("gs");
        }
    }
    // a gs that passes the layer can still ruin tokens the whole-tensor cosine does not see:
    // one token of huge norm carries it and sets the scales of its experts (an input problem).
    // And a fixed gs that fails the layer may fail one token only: fixed scales quantize each
    // token on its own, so a gs that fits every token but one of huge norm is not the fault,
    // that token is (it would be blamed on the gs, and the user sent to recalibrate)
    let gs_blamed = cause == Some("gs");
    if failures.is_empty() || gs_blamed {
        if let (Some(s), Some(u)) = (&used_scales, used.as_ref().filter(|u| clean(u))) {
            let hsz = c.hidden_size;
            let mut tokens = per_token(&output(s)?.0, &reference.out, hsz);
            tokens.sort_by(|a, b| worst_first(&a.metrics, &b.metrics));
            // under a blamed gs the one huge token went unnamed and the gs took the blame
            let bar = token_bar(gs_blamed, args.min_cosine, args.min_token_cosine);
            if let Some(t) =
                token_failure(&tokens, &reference.out, &batch.hidden, hsz, bar, u.cosine)
            {
                if !gs_blamed {
                    failures.push(format!("gs `{used_source}`: {}", t.line));
                    cause = Some(if !t.dominant.is_empty() {
                        "input"
                    } else {
                        "not_gs"
                    });
                } else if !t.bad.is_empty() && t.bad.iter().all(|b| t.outliers.contains(b)) {
                    // a few tokens of outsized norm (10x the median token's output) fail and
                    // the rest pass: those inputs, not the gs (one token or several alike)
                    let (n, m) = (tokens.len(), t.bad.len());
                    let mut which = t.bad.clone();
                    which.sort_unstable();
                    let which: Vec<String> = which.iter().map(|b| b.to_string()).collect();
                    let (these, input) = if m == 1 {
                        ("token", "that token's input")
                    } else {
                        ("tokens", "those tokens' inputs")
                    };
                    failures.insert(
                        0,
                        format!(
                            "gs `{used_source}` fails {these} {} only: {}; the other {} \
                             token(s) pass under it, so the fault is {input} (output norm 10x \
                             the median token's or more), not the gs",
                            which.join(", "),
                            t.line,
                            n - m
                        ),
                    );
                    cause = Some("input");
                }
            }
        }
    }
    // checkpoint input scales that read as their own reciprocals, whatever the gs in use (the
    // engine takes them): under --gs checkpoint the cause behind the overshoots above, named
    // before them; under another gs a note beside the verdict on that gs
    let reciprocal = findings
        .as_ref()
        .and_then(|s| model.reciprocal_input_scales(l, &layer, &s.amax));
    let reciprocal_in_use = reciprocal
        .as_ref()
        .filter(|_| used_source == GsSource::Checkpoint);
    // a convention mix-up this batch survives is still one: smaller activations quantize
    // further into the E4M3 subnormals under it (the verdict said nothing, the JSON named it)
    match (reciprocal_in_use, cause) {
        (Some((t, _)), Some("gs")) => {
            failures.insert(0, format!("gs `{used_source}`: {t}"));
            cause = Some("input_scale_reciprocal");
        }
        (Some((t, _)), None) => {
            failures.push(format!(
                "gs `{used_source}`: {t}; this batch stays within {} cosine of the best under \
                 it, batches of other amax will not",
                f(used_loss.max(0.0), 4)
            ));
            cause = Some("input_scale_reciprocal");
        }
        _ => {}
    }
    let pass = failures.is_empty();
    let headline = if pass {
        format!(
            "layer {l}: gs `{used_source}` is within {} cosine of the best ({})",
            f(used_loss.max(0.0), 4),
            best.as_ref().map_or("-".into(), describe_gs)
        )
    } else {
        format!("layer {l}: {}", failures[0])
    };

    let cost =
        |name: &str| -> Option<f64> { sources.iter().find(|p| p.label == name).map(loss_of) };
    let summary = json!({
        "layer": l,
        "kernel": plugin.as_ref().map_or("builtin".to_string(), |(p, _)| p.path.display().to_string()),
        "tokens": batch.tokens,
        "gs": used_source.to_string(),
        "used_cosine": used.as_ref().map(|u| u.cosine),
        "loss": used_loss,
        "max_loss": args.max_loss,
        "min_cosine": args.min_cosine,
        "min_token_cosine": args.min_token_cosine,
        "experts": expert_json,
        "cause": cause,
        "input_scale_reciprocal": reciprocal.as_ref().map(|(_, j)| j),
        "input_scale_flush": findings.as_ref().and_then(|s| s.flush_json()),
        "input_scale_saturate": findings.as_ref().and_then(|s| s.saturate_json()),
        "best_cosine": best.as_ref().map(|b| b.cosine),
        "best": best.as_ref().map(describe_gs),
        "best_sweep_gs": best_sweep.as_ref().and_then(|b| b.gs1),
        "default_loss": cost("default"),
        "warmup_loss": cost("warmup"),
        "nan_count": used.as_ref().map_or(0, |u| u.nan_count),
        "ep": args.ep.ep,
        "ep_within_bound": ep_agreement.as_ref().map(|a| a.within_bound),
        "device": backend.name(),
        "model": model.describe(),
    });

    let mut src_table = Section::new(
        "gs sources",
        &[
            "source",
            "gs1 (median)",
            "gs2 (median)",
            "cosine",
            "rel_l2",
            "loss vs best",
            "at 448 %",
            "flushed %",
            "NaN",
        ],
    );
    for p in &sources {
        src_table.row(vec![
            if p.label == used_source.to_string() {
                format!("{} (in use)", p.label)
            } else {
                p.label.clone()
            },
            p.gs1.map_or("per batch".into(), |g| e(g as f64)),
            p.gs2.map_or("per batch".into(), |g| e(g as f64)),
            f(p.cosine, 5),
            f(p.rel_l2, 4),
            f(loss_of(p), 4),
            format!("{:.2}", p.blocks.saturated_pct),
            format!("{:.2}", p.blocks.flushed_pct),
            p.nan_count.to_string(),
        ]);
    }
    for (s, why) in &unavailable {
        src_table.row(vec![
            s.clone(),
            "-".into(),
            "-".into(),
            "n/a".into(),
            why.clone(),
            "".into(),
            "".into(),
            "".into(),
            "".into(),
        ]);
    }
    let mut sweep_table = Section::new(
        "Sweep (one gs for every GEMM)",
        &["gs", "cosine", "rel_l2", "at 448 %", "flushed %", "NaN"],
    );
    for p in &sweep {
        sweep_table.row(vec![
            e(p.gs1.unwrap_or(f32::NAN) as f64),
            f(p.cosine, 5),
            f(p.rel_l2, 4),
            format!("{:.2}", p.blocks.saturated_pct),
            format!("{:.2}", p.blocks.flushed_pct),
            p.nan_count.to_string(),
        ]);
    }

    let markers: Vec<(f64, String)> = sources
        .iter()
        .filter_map(|p| p.gs1.map(|g| (g as f64, p.label.clone())))
        .collect();
    let pts = |sel: &dyn Fn(&Point) -> f64| -> Vec<(f64, f64)> {
        sweep
            .iter()
            .map(|p| (p.gs1.unwrap_or(f32::NAN) as f64, sel(p)))
            .collect()
    };
    let cos_plot = Plot {
        title: format!("layer {l}: cosine vs activation gs (NVFP4 vs BF16)"),
        x_label: "gs (quant direction, log)".into(),
        y_label: "cosine".into(),
        log_x: true,
        series: vec![Series {
            name: "cosine".into(),
            points: pts(&|p| p.cosine),
        }],
        markers: markers.clone(),
    };
    let block_plot = Plot {
        title: format!("layer {l}: activation blocks vs gs"),
        x_label: "gs (quant direction, log)".into(),
        y_label: "% of blocks".into(),
        log_x: true,
        series: vec![
            Series {
                name: "scale at 448 %".into(),
                points: pts(&|p| p.blocks.saturated_pct),
            },
            Series {
                name: "flushed %".into(),
                points: pts(&|p| p.blocks.flushed_pct),
            },
        ],
        markers,
    };

    let mut setup = Section::kv(
        format!("gs-sweep: MoE layer {l}"),
        &[
            ("model", model.describe()),
            ("input", batch.origin.clone()),
            ("device", backend.name()),
            (
                "gs in use",
                format!("{used_source} ({} input scales)", reduce),
            ),
            ("sweep", format!("{n} points, gs {} .. {}", e(lo), e(hi))),
            (
                "best",
                best.as_ref().map_or("-".into(), |b| {
                    format!("{} (cosine {})", describe_gs(b), f(b.cosine, 5))
                }),
            ),
            (
                "default costs",
                cost("default").map_or("-".into(), |v| format!("{} cosine", f(v, 4))),
            ),
            (
                "warmup costs",
                cost("warmup").map_or("-".into(), |v| format!("{} cosine", f(v, 4))),
            ),
        ],
    );
    if args.ep.sharded() {
        setup.row(vec![
            "expert parallelism".into(),
            format!(
                "EP {} ({}) on {}",
                args.ep.ep,
                args.ep.placement.name(),
                devices.names().join(", ")
            ),
        ]);
    }

    let mut report = Report::new("gs-sweep", Verdict::from_pass(pass), headline)
        .summary(summary)
        .with("sources", &sources)
        .with(
            "unavailable",
            unavailable
                .iter()
                .map(|(s, w)| json!({"source": s, "why": w}))
                .collect::<Vec<_>>(),
        )
        .with("sweep", &sweep)
        .with("best", &best)
        .with("used", &used)
        .with("input_nonfinite", &in_json)
        .with("failures", &failures)
        .section(setup)
        .section(src_table)
        .section(sweep_table)
        .plot("gs-sweep.svg", cos_plot.render())
        .plot("gs-sweep-blocks.svg", block_plot.render());
    if let Some(s) = &used_scales {
        report = report.with("gs_in_use", scales_json(used_source, reduce, s));
    }
    // the checkpoint's input scales an engine takes, named beside the verdict on the gs in use
    let recip = reciprocal.as_ref().filter(|_| reciprocal_in_use.is_none());
    if let Some(s) =
        ScaleFindings::checkpoint_section(findings.as_ref(), recip.map(|r| r.0.as_str()))
    {
        report = report.section(s);
    }
    if args.ep.sharded() {
        let mut j = ep_json_with(&args.ep, &devices, reduce_info.borrow().as_ref());
        j["tolerance"] = json!(tolerance_text(routing.top_k));
        j["agreement"] = json!(ep_agreement);
        report = report.with("ep", j);
    }
    Ok(report)
}

/// `; worst: expert E GEMM input (gs G, Rx the F its amax allows), ...` for the (up to three)
/// expert inputs the scales in use saturate most: a single expert's bad input_scale shows in
/// the layer's loss but not in which expert it is.
fn worst_overshoots(findings: Option<&ScaleFindings>) -> String {
    // a gs within 5% of its expert's own amax is rounding, not an overshoot worth naming
    let worst: Vec<String> = findings
        .iter()
        .flat_map(|s| &s.over)
        .filter(|o| o.ratio >= 1.05)
        .take(3)
        .map(|o| {
            format!(
                "expert {} {} input (gs {}, {}x the {} its amax allows)",
                o.expert,
                o.gemm,
                e(o.gs as f64),
                f(o.ratio as f64, 1),
                e(o.fits as f64)
            )
        })
        .collect();
    match worst.is_empty() {
        true => String::new(),
        false => format!("; worst: {}", worst.join(", ")),
    }
}

/// `; worst: expert E gate_proj/up_proj input_scale S is Rx the N its amax needs ...` for
/// the (up to three) checkpoint input scales in use that sit at least `gs::MIN_FLUSH_RATIO`
/// above what their inputs need ([`ScaleFindings`], under `--gs checkpoint`): the flush
/// counterpart of [`worst_overshoots`], where one expert's input_scale, under `global-max`
/// every expert's, flushes the layer's blocks.
fn worst_flushes(findings: Option<&ScaleFindings>) -> String {
    let worst: Vec<String> = findings
        .iter()
        .flat_map(|s| &s.too_large)
        .take(3)
        .map(|o| o.describe())
        .collect();
    match worst.is_empty() {
        true => String::new(),
        false => format!("; worst: {}", worst.join(", ")),
    }
}

/// `; the gs source that fixes it: ...` naming the best other source within `max_loss` of the
/// best gs: the sweep's best is one gs for both GEMMs of every expert, which no engine
/// configures, while a source (calibrated input scales, dynamic per batch) is what to use.
fn fixing_source(
    sources: &[Point],
    used: &Point,
    max_loss: f64,
    loss_of: &dyn Fn(&Point) -> f64,
) -> String {
    let Some(p) = sources
        .iter()
        .filter(|p| p.label != used.label && loss_of(p) <= max_loss)
        .max_by(|a, b| a.cosine.total_cmp(&b.cosine))
    else {
        return "; no gs source reaches it, only the sweep".into();
    };
    let how = match p.label.as_str() {
        "calibrated" => "input_scale = amax/2688 per expert GEMM input, on this batch",
        "dynamic" => "gs from each batch's own amax",
        "checkpoint" => "the checkpoint's input_scale",
        "warmup" => "amax of a randn warm-up batch",
        "default" => "1/2688",
        _ => "the gs given",
    };
    format!(
        "; the source that fits: `{}` ({how}{}) reaches cosine {} (loss {})",
        p.label,
        match (p.gs1, p.gs2) {
            (Some(a), Some(b)) => format!(": gs1 {}, gs2 {}", e(a as f64), e(b as f64)),
            _ => String::new(),
        },
        f(p.cosine, 4),
        f(loss_of(p).max(0.0), 4)
    )
}

fn describe_gs(p: &Point) -> String {
    match (p.label.as_str(), p.gs1, p.gs2) {
        ("sweep", Some(g), _) => format!("gs {}", e(g as f64)),
        (l, Some(a), Some(b)) => format!("{l} (gs1 {}, gs2 {})", e(a as f64), e(b as f64)),
        (l, _, _) => l.to_string(),
    }
}
