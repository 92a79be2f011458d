//! `multilayer`: does error grow through the residual stream (H5)? Consecutive MoE layers
//! with RMSNorm + residual (docs/moe-forward.md, "Multilayer"); the NVFP4 model and the BF16
//! reference each carry their own hidden state and route on it.

use super::common::{progress, DeviceArgs, OutArgs};
use super::expert_check::{ExpertCheck, ExpertVerdict, DEFAULT_MIN_EXPERT_SLOTS};
use super::kernel::{self, KernelArgs};
use super::layertest::{
    at, below, block_summary, check_unsharded, ep_disagreement, ep_json_with, input_nonfinite,
    layer_and_batch, nonfinite_weights, nvfp4_forward, ranges, unreached_nonfinite_experts, EpArgs,
    GsArgs, InputArgs, Model, ScaleFindings,
};
use crate::error::{Error, Result};
use crate::metrics::{compare, Metrics};
use crate::moe::breakdown::{expert_input_blocks, per_expert};
use crate::moe::forward::BatchAmax;
use crate::moe::gs::GsSource;
use crate::moe::parallel::{tolerance_text, Agreement};
use crate::moe::synthetic::{Preset, SyntheticModel};
use crate::moe::{rmsnorm_bf16, Path as MoePath, Routing};
use crate::nvfp4::BlockStats;
use crate::report::svg::{Plot, Series};
use crate::report::{f, Report, Section, Verdict};
use serde::Serialize;
use serde_json::json;

/// Layers of the built-in synthetic model multilayer runs on (tiny dims, first layer dense).
pub const SYNTHETIC_LAYERS: usize = 8;
/// Default `--min-cosine` of the residual stream after the last layer. The residual carries
/// the embedding and every earlier layer, so its relative error is far below one layer's
/// ~0.23 rel-L2; 0.99 (rel-L2 ≈ 0.14) leaves room for a few dozen healthy layers.
pub const DEFAULT_MIN_COSINE: f64 = 0.99;
/// Default `--max-amplification`: how much more error a layer leaves than the incoming error
/// and its own quantization error add up to in quadrature. 1 is purely additive; healthy
/// synthetic layers sit at 1.05-1.35 (routing flips and the SwiGLU pass some of the incoming
/// error on, amplified). Above 2 a layer more than doubles what additive errors would give:
/// the error is feeding on itself.
pub const DEFAULT_MAX_AMPLIFICATION: f64 = 2.0;

#[derive(clap::Args, Debug)]
#[command(
    after_help = "--input holds the residual stream entering the first layer's norm \
(hidden_states [T, hidden], optional input_ids [T]). Without --checkpoint: the built-in synthetic \
tiny model with 8 layers (MoE layers 1..=7). Columns: growth = residual rel-L2 / the previous \
layer's; amplification = error after the layer / sqrt(error before² + the layer's own error²); \
layer-alone cosine = NVFP4 vs BF16 on the BF16 model's input (what layertest measures). Verdict: \
fail on NaN/Inf, a residual-stream cosine below --min-cosine (0.99) after the last layer, a \
layer-alone cosine below --min-layer-cosine (0.95, layertest's default), one expert of a layer alone \
below --min-expert-cosine (0.90, or a rel-L2 past sqrt(1/0.9^2 - 1) = 0.484, over at least \
--min-expert-slots 3 token slots, as in layertest), or an \
amplification above --max-amplification (2.0). With --ep N the NVFP4 model runs sharded over N expert-parallel ranks, and \
each layer alone must equal the unsharded run up to FP32 summation order."
)]
pub struct Args {
    #[command(flatten)]
    pub input: InputArgs,
    /// Layers to run: A..B (B excluded), A..=B, or A (default: every MoE layer)
    #[arg(long, value_name = "A..B")]
    pub layers: Option<String>,
    #[command(flatten)]
    pub gs: GsArgs,
    /// Fail when the residual stream's cosine after the last layer is below this
    #[arg(long, value_name = "C", default_value_t = DEFAULT_MIN_COSINE, value_parser = super::common::cosine, allow_negative_numbers = true)]
    pub min_cosine: f64,
    /// Fail when one layer alone (NVFP4 vs BF16 on the same input) is below this cosine
    #[arg(long, value_name = "C", default_value_t = super::layertest::DEFAULT_MIN_COSINE, value_parser = super::common::cosine, allow_negative_numbers = true)]
    pub min_layer_cosine: f64,
    /// Fail when one expert's own output in one layer alone falls below this cosine, or its
    /// rel-L2 exceeds sqrt(1/C^2 - 1) (layertest's rule: a broken expert barely moves its
    /// layer's cosine)
    #[arg(long, value_name = "C", default_value_t = super::layertest::DEFAULT_MIN_EXPERT_COSINE, value_parser = super::common::cosine, allow_negative_numbers = true)]
    pub min_expert_cosine: f64,
    /// Judge an expert by --min-expert-cosine over at least N token slots (layertest's rule:
    /// below, the bar ramps from cosine 0.7 on one slot; between it and --min-expert-cosine is
    /// too few tokens to judge). 1 judges every expert by --min-expert-cosine
    #[arg(long, value_name = "N", default_value_t = DEFAULT_MIN_EXPERT_SLOTS)]
    pub min_expert_slots: usize,
    /// Fail when a layer amplifies the incoming error beyond this factor
    #[arg(long, value_name = "X", default_value_t = DEFAULT_MAX_AMPLIFICATION, value_parser = super::common::factor)]
    pub max_amplification: f64,
    #[command(flatten)]
    pub ep: EpArgs,
    #[command(flatten)]
    pub kernel: KernelArgs,
    #[command(flatten)]
    pub device: DeviceArgs,
    #[command(flatten)]
    pub out_args: OutArgs,
}

#[derive(Serialize)]
struct LayerRow {
    layer: usize,
    /// The hidden state after this layer, NVFP4 model vs BF16 model.
    residual: Metrics,
    /// This layer's MoE output (each on its own input).
    moe_out: Metrics,
    /// This layer alone: NVFP4 vs BF16 on the BF16 model's input (what layertest measures).
    local: Metrics,
    /// `‖e_after‖ / sqrt(‖e_before‖² + ‖local‖²)`: 1 when the incoming error and this layer's
    /// own error just add; above 1 when the layer amplifies the error it was handed.
    amplification: Option<f64>,
    /// residual rel-L2 / the previous layer's.
    growth: Option<f64>,
    /// Fraction of (token, slot) expert ids the NVFP4 model shares with the reference.
    routing_agreement: f64,
    act_saturated_pct: f64,
    act_flushed_pct: f64,
    unit_norm_weight: bool,
    /// With --ep: this layer alone, sharded, against the unsharded run.
    ep_agreement: Option<Agreement>,
    /// This layer alone, expert by expert: each that fails --min-expert-cosine.
    expert_failures: Vec<String>,
    /// Experts that miss --min-expert-cosine on fewer than --min-expert-slots slots, within
    /// NVFP4 noise there: too few tokens to judge.
    experts_too_few_slots: Vec<usize>,
    /// The checkpoint's input scales far above what this layer's inputs need (blocks flush to
    /// zero), under every --gs where the checkpoint carries them, as layertest lists them.
    input_scale_flush: Option<serde_json::Value>,
    /// The same for the expert GEMM inputs whose gs, 1/input_scale, saturates them.
    input_scale_saturate: Option<serde_json::Value>,
}

/// Parse `A..B`, `A..=B` or `A`.
fn parse_range(s: &str) -> Result<Vec<usize>> {
    let bad = || Error::usage(format!("--layers `{s}`: expected A..B, A..=B or A"));
    let num = |v: &str| v.trim().parse::<usize>().map_err(|_| bad());
    // [first, end)
    let (first, end) = if let Some((a, b)) = s.split_once("..=") {
        (num(a)?, num(b)?.saturating_add(1))
    } else if let Some((a, b)) = s.split_once("..") {
        (num(a)?, num(b)?)
    } else {
        let a = num(s)?;
        (a, a.saturating_add(1))
    };
    if end <= first {
        return Err(Error::usage(format!(
            "--layers `{s}`: an empty range (A..B runs A to B - 1, A..=B to B)"
        )));
    }
    // more layers than any model has: a typo, not a walk to make
    if end - first > 1 << 16 {
        return Err(Error::usage(format!(
            "--layers `{s}`: {} layers, more than any model has",
            end - first
        )));
    }
    Ok((first..end).collect())
}

fn l2_diff(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(&x, &y)| {
            let d = x as f64 - y as f64;
            d * d
        })
        .sum::<f64>()
        .sqrt()
}

fn agreement(a: &Routing, b: &Routing) -> f64 {
    let k = a.top_k.max(1);
    let mut same = 0usize;
    for t in 0..a.tokens.min(b.tokens) {
        let rb = &b.topk_ids[t * k..(t + 1) * k];
        same += a.topk_ids[t * k..(t + 1) * k]
            .iter()
            .filter(|id| rb.contains(id))
            .count();
    }
    if a.topk_ids.is_empty() {
        1.0
    } else {
        same as f64 / a.topk_ids.len() as f64
    }
}

/// The table's `activation gs` row: where each layer's scales come from. Only `calibrated`
/// is measured on the BF16 model's activations; a fixed gs is the same everywhere.
fn gs_label(source: GsSource) -> String {
    let how = match source {
        GsSource::Calibrated => "per layer, calibrated on the BF16 model's activations",
        GsSource::Warmup => "per layer, amax of a randn warm-up batch",
        GsSource::Dynamic => "per batch, on each model's own activations",
        GsSource::Checkpoint => "each layer's checkpoint input_scale",
        GsSource::Default | GsSource::Value(_) => "fixed: every expert of every layer",
    };
    format!("{source} ({how})")
}

pub fn run(args: &Args) -> Result<Report> {
    let devices = args.ep.open(&args.device, args.out_args.quiet)?;
    let plugin = kernel::open(&args.kernel, &devices)?;
    let ep = args.ep.shard();
    let backend = devices.main();
    let model = match &args.input.checkpoint {
        None => Model::Synthetic(
            SyntheticModel::new(Preset::Tiny, args.input.seed).with_layers(SYNTHETIC_LAYERS),
        ),
        Some(_) => Model::open(&args.input)?,
    };
    let moe_layers = model.moe_layers();
    let layers = match (&args.layers, &model) {
        (Some(s), _) => parse_range(s)?,
        // every MoE layer: the ones an engine runs, or the walk steps over a layer it cannot
        // load and passes
        (None, Model::Checkpoint { ckpt, .. }) => {
            ckpt.check_moe_walk()?;
            moe_layers.clone()
        }
        (None, Model::Synthetic(_)) => moe_layers.clone(),
    };
    for &l in &layers {
        model.check_layer(l)?;
    }
    if layers.is_empty() {
        // no MoE layer: say why, as the other commands do
        model.pick_layer(None)?;
    }
    let pb = progress(layers.len() as u64, "layers", args.out_args.quiet);
    pb.enable_steady_tick(std::time::Duration::from_millis(250));
    pb.set_message(format!("layer {}", layers[0]));
    let (first, batch) = layer_and_batch(&model, layers[0], &args.input, &devices, true, false)?;
    let first_k = first.config.num_experts_per_tok;
    let (hsz, eps) = (first.config.hidden_size, first.config.rms_norm_eps);
    let ids = batch.input_ids.as_deref();
    let source = args.gs.gs.unwrap_or(GsSource::Calibrated);

    let mut h_nv = batch.hidden.clone();
    let mut h_rf = batch.hidden.clone();
    let check = ExpertCheck {
        min_cosine: args.min_expert_cosine,
        min_slots: args.min_expert_slots,
    };
    let mut rows: Vec<LayerRow> = vec![];
    let mut first_bad: Option<(usize, Metrics)> = None;
    let mut unit_norm_layers = vec![];
    let mut reduce_info = None;
    let mut layer = Some(first);
    for &l in &layers {
        let ly = match layer.take() {
            Some(x) => x,
            None => model.layer(l)?,
        };
        pb.set_message(format!("layer {l}"));
        let norm = ly.norm_weight.as_deref();
        if norm.is_none() {
            unit_norm_layers.push(l);
        }
        let x_nv = rmsnorm_bf16(&h_nv, hsz, norm, eps);
        let x_rf = rmsnorm_bf16(&h_rf, hsz, norm, eps);
        let r_nv = backend.route(&ly, &x_nv, ids)?;
        let r_rf = backend.route(&ly, &x_rf, ids)?;
        // scales are calibrated on what the BF16 model feeds this layer
        let amax = BatchAmax::new(&ly, &x_rf, &r_rf);
        let scales = args
            .gs
            .resolve(source, &ly, ids, &amax, args.input.seed ^ l as u64)?;
        let (mut o_nv, reduce) =
            nvfp4_forward(&args.ep, &devices, &ly, &x_nv, &r_nv, &scales, false)?;
        // with --kernel, the user's kernel carries the NVFP4 residual stream
        if let Some((p, g)) = &plugin {
            o_nv.out = kernel::plugin_layer(p, g, &ly, &x_nv, &r_nv, &scales, ep)?;
        }
        if reduce.is_some() {
            reduce_info = reduce;
        }
        let o_rf = backend.moe_forward(&ly, &x_rf, &r_rf, &MoePath::Reference, true)?;
        // the error this layer adds by itself: NVFP4 on the reference model's input, expert
        // by expert too
        let (o_local, _) = nvfp4_forward(&args.ep, &devices, &ly, &x_rf, &r_rf, &scales, true)?;
        let experts = match (&o_local.per_slot, &o_rf.per_slot) {
            (Some(nv), Some(rf)) => per_expert(&r_rf, nv, rf, hsz, ly.config.n_routed_experts),
            _ => vec![],
        };
        let judged: Vec<(usize, ExpertVerdict)> =
            experts.iter().map(|x| (x.expert, check.judge(x))).collect();
        // what the scales did to a failing expert's inputs (saturated, flushed), named in its
        // line as layertest names it; the checkpoint's input scales judged whatever the gs in
        // use (an engine takes them), for the layer's row, as layertest does
        let failing = judged
            .iter()
            .any(|(_, v)| matches!(v, ExpertVerdict::Fail(_)));
        let findings = match ScaleFindings::wanted(&ly, failing) {
            true => Some(ScaleFindings::of(
                &ly,
                &amax,
                &scales,
                source,
                args.gs.input_scale_reduce,
            )?),
            false => None,
        };
        let gate_up = match failing {
            true => expert_input_blocks(&r_rf, &x_rf, hsz, ly.config.n_routed_experts, &scales),
            false => vec![],
        };
        let why = |e: usize| {
            findings.as_ref().map_or(String::new(), |s| {
                s.cause(
                    e,
                    &block_summary(&gate_up.get(e).copied().unwrap_or_default()),
                )
            })
        };
        // the experts that make NaN/Inf first (a NaN layer named no expert), then the rest
        let expert_failures: Vec<String> = experts
            .iter()
            .filter_map(|x| {
                // its own weights' NaN, where they hold it, as layertest names it
                let why = nonfinite_weights(&ly, x.expert).unwrap_or_default();
                ExpertCheck::nonfinite(x).map(|line| line + &why)
            })
            // under global-max, the expert whose input_scale flushes every expert's inputs
            .chain(
                findings
                    .iter()
                    .filter(|_| failing)
                    .flat_map(|s| s.layer_max_lines()),
            )
            .chain(judged.iter().filter_map(|(e, v)| match v {
                ExpertVerdict::Fail(m) => Some(m.clone() + &why(*e)),
                _ => None,
            }))
            .chain(unreached_nonfinite_experts(&ly, &[&r_nv, &r_rf]))
            .collect();
        let experts_too_few_slots: Vec<usize> = judged
            .iter()
            .filter(|(_, v)| *v == ExpertVerdict::TooFewSlots)
            .map(|(e, _)| *e)
            .collect();
        let local_out = match &plugin {
            Some((p, g)) => kernel::plugin_layer(p, g, &ly, &x_rf, &r_rf, &scales, ep)?,
            None => o_local.out.clone(),
        };
        let ep_agreement = if args.ep.sharded() {
            Some(check_unsharded(
                &devices,
                &ly,
                &x_rf,
                &r_rf,
                &scales,
                &o_local.out,
            )?)
        } else {
            None
        };
        let local = compare(&local_out, &o_rf.out);
        let local_err = l2_diff(&local_out, &o_rf.out);
        let prev_err = l2_diff(&h_nv, &h_rf);
        for (h, o) in h_nv.iter_mut().zip(&o_nv.out) {
            *h += o;
        }
        for (h, o) in h_rf.iter_mut().zip(&o_rf.out) {
            *h += o;
        }
        let residual = compare(&h_nv, &h_rf);
        let moe_out = compare(&o_nv.out, &o_rf.out);
        let new_err = l2_diff(&h_nv, &h_rf);
        let quad = (prev_err * prev_err + local_err * local_err).sqrt();
        let amplification = (quad > 0.0 && new_err.is_finite()).then(|| new_err / quad);
        let growth = rows.last().and_then(|p: &LayerRow| {
            (p.residual.rel_l2 > 0.0 && residual.nan_count + residual.inf_count == 0)
                .then(|| residual.rel_l2 / p.residual.rel_l2)
        });
        if first_bad.is_none() && residual.nan_count + residual.inf_count > 0 {
            first_bad = Some((l, residual.clone()));
        }
        let st: BlockStats = o_nv.act_stats;
        let bs = block_summary(&st);
        rows.push(LayerRow {
            layer: l,
            residual,
            moe_out,
            local,
            amplification,
            growth,
            routing_agreement: agreement(&r_nv, &r_rf),
            act_saturated_pct: bs.saturated_pct,
            act_flushed_pct: bs.flushed_pct,
            unit_norm_weight: norm.is_none(),
            ep_agreement,
            expert_failures,
            experts_too_few_slots,
            input_scale_flush: findings.as_ref().and_then(|s| s.flush_json()),
            input_scale_saturate: findings.as_ref().and_then(|s| s.saturate_json()),
        });
        pb.inc(1);
    }
    pb.finish_and_clear();

    // ---- verdict ----
    let (in_bad, in_json) = input_nonfinite(&batch.hidden, hsz);
    // per-layer problems in layer order, so the first failure (the headline) names the first
    // bad layer; a NaN stream from layer k on does not hide a broken layer before it, and each
    // layer alone still runs on the BF16 model's finite input after it (unless the input itself
    // is not finite: then the reference is too, and the input is the problem)
    let judge_layers = in_bad.is_none();
    // (layer, rank within the layer, line): a layer's broken expert leads its lines, the
    // most pointed answer; then the NaN stream, the layer alone, amplification, EP
    let mut by_layer: Vec<(usize, u8, String)> = vec![];
    if let Some((l, m)) = &first_bad {
        let (kind, idx) = if m.nan_count > 0 {
            ("NaN", m.first_nan)
        } else {
            ("Inf", m.first_inf)
        };
        by_layer.push((
            *l,
            1,
            format!(
                "{kind} in the NVFP4 residual stream from layer {l} on ({} NaN, {} Inf after layer {l}, first at {})",
                m.nan_count,
                m.inf_count,
                at(idx, hsz)
            ),
        ));
    }
    for r in rows
        .iter()
        .filter(|r| judge_layers && below(r.local.cosine, args.min_layer_cosine))
    {
        by_layer.push((
            r.layer,
            2,
            format!(
                "layer {} alone (NVFP4 vs BF16 on the same input): cosine {} < --min-layer-cosine {}",
                r.layer,
                f(r.local.cosine, 4),
                args.min_layer_cosine
            ),
        ));
    }
    for r in rows.iter().filter(|_| judge_layers) {
        by_layer.extend(
            r.expert_failures
                .iter()
                .map(|m| (r.layer, 0, format!("layer {}: {m}", r.layer))),
        );
    }
    for r in rows
        .iter()
        .filter(|r| judge_layers && r.amplification.is_some_and(|g| g > args.max_amplification))
    {
        by_layer.push((
            r.layer,
            3,
            format!(
                "layer {} amplifies the incoming error {}x (> --max-amplification {}); residual rel-L2 grows {}x",
                r.layer,
                f(r.amplification.unwrap_or(f64::NAN), 2),
                args.max_amplification,
                r.growth.map_or("-".into(), |g| f(g, 2))
            ),
        ));
    }
    for r in &rows {
        if let Some(m) = r
            .ep_agreement
            .as_ref()
            .and_then(|a| ep_disagreement(&args.ep, a, hsz, &format!("layer {} alone", r.layer)))
        {
            by_layer.push((r.layer, 4, m));
        }
    }
    by_layer.sort_by_key(|(l, rank, _)| (*l, *rank));
    // the layers the failures name, first bad layer first (the stack's residual cosine after
    // the last layer names none, and a non-finite input none at all: no one layer's doing)
    let mut failing_layers: Vec<usize> = match judge_layers {
        true => by_layer.iter().map(|(l, _, _)| *l).collect(),
        false => vec![],
    };
    failing_layers.dedup();
    let mut failures: Vec<String> = in_bad.into_iter().collect();
    failures.extend(by_layer.into_iter().map(|(_, _, m)| m));
    let last = rows.last();
    // the whole stack's cosine after the last layer: the consequence of the layers above
    if first_bad.is_none() {
        if let Some(r) = last.filter(|r| below(r.residual.cosine, args.min_cosine)) {
            failures.push(format!(
                "residual-stream cosine {} after layer {} < --min-cosine {} (rel-L2 {})",
                f(r.residual.cosine, 4),
                r.layer,
                args.min_cosine,
                f(r.residual.rel_l2, 3)
            ));
        }
    }
    let pass = failures.is_empty();
    let mean_growth = {
        let g: Vec<f64> = rows.iter().filter_map(|r| r.growth).collect();
        if g.is_empty() {
            None
        } else {
            Some((g.iter().map(|x| x.ln()).sum::<f64>() / g.len() as f64).exp())
        }
    };
    let headline = if pass {
        format!(
            "{} MoE layer{} ({}): residual-stream cosine {} after the last, {}",
            rows.len(),
            if rows.len() == 1 { "" } else { "s" },
            ranges(&layers),
            last.map_or("-".into(), |r| f(r.residual.cosine, 4)),
            match (mean_growth, rows.len()) {
                (Some(g), _) => format!("mean growth {}x per layer", f(g, 2)),
                (None, 1) => "no growth factor (one MoE layer: growth needs two or more)".into(),
                // a growth is a ratio of errors: none where they are all zero
                (None, _) => "no growth factor (the residual stream's error is zero: nothing \
                              to grow)"
                    .into(),
            }
        )
    } else if failures.len() == 1 {
        failures[0].clone()
    } else {
        format!("{} (and {} more problems)", failures[0], failures.len() - 1)
    };

    let mut table = Section::new(
        "Per layer (NVFP4 model vs BF16 model, each on its own hidden state)",
        &[
            "layer",
            "residual cosine",
            "residual rel_l2",
            "growth",
            "amplification",
            "layer-alone cosine",
            "MoE-out cosine",
            "routing agree",
            "saturated %",
            "NaN",
        ],
    );
    for r in &rows {
        table.row(vec![
            r.layer.to_string(),
            f(r.residual.cosine, 5),
            f(r.residual.rel_l2, 4),
            r.growth.map_or("-".into(), |g| f(g, 2)),
            r.amplification.map_or("-".into(), |g| f(g, 2)),
            f(r.local.cosine, 4),
            f(r.moe_out.cosine, 4),
            format!("{:.1}%", 100.0 * r.routing_agreement),
            format!("{:.2}", r.act_saturated_pct),
            r.residual.nan_count.to_string(),
        ]);
    }
    let mut setup = Section::kv(
        "multilayer",
        &[
            ("model", model.describe()),
            ("layers", ranges(&layers)),
            (
                "input",
                format!(
                    "{} (residual stream before layer {})",
                    batch.origin, layers[0]
                ),
            ),
            ("activation gs", gs_label(source)),
            ("device", backend.name()),
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
    if !unit_norm_layers.is_empty() {
        setup.row(vec![
            "note".into(),
            format!(
                "no RMSNorm weight in the checkpoint for layers {}: unit weights used",
                ranges(&unit_norm_layers)
            ),
        ]);
    }
    let plot = Plot {
        title: "error through the residual stream".into(),
        x_label: "layer".into(),
        y_label: "rel-L2 vs BF16".into(),
        log_x: false,
        series: vec![
            Series {
                name: "residual".into(),
                points: rows
                    .iter()
                    .map(|r| (r.layer as f64, r.residual.rel_l2))
                    .collect(),
            },
            Series {
                name: "MoE output".into(),
                points: rows
                    .iter()
                    .map(|r| (r.layer as f64, r.moe_out.rel_l2))
                    .collect(),
            },
        ],
        markers: vec![],
    };
    let summary = json!({
        "kernel": plugin.as_ref().map_or("builtin".to_string(), |(p, _)| p.path.display().to_string()),
        "layers": layers,
        "tokens": batch.tokens,
        "gs": source.to_string(),
        "cosine": last.map(|r| r.residual.cosine),
        "rel_l2": last.map(|r| r.residual.rel_l2),
        "nan_count": last.map_or(0, |r| r.residual.nan_count),
        "inf_count": last.map_or(0, |r| r.residual.inf_count),
        "first_nonfinite_layer": first_bad.as_ref().map(|b| b.0),
        "first_failing_layer": failing_layers.first(),
        "failing_layers": failing_layers,
        "max_growth": rows.iter().filter_map(|r| r.growth).fold(None, |m: Option<f64>, g| Some(m.map_or(g, |m| m.max(g)))),
        "mean_growth": mean_growth,
        "min_cosine": args.min_cosine,
        "max_amplification": rows.iter().filter_map(|r| r.amplification).fold(None, |m: Option<f64>, g| Some(m.map_or(g, |m| m.max(g)))),
        "max_amplification_allowed": args.max_amplification,
        "min_layer_cosine": args.min_layer_cosine,
        "min_expert_cosine": args.min_expert_cosine,
        "min_expert_slots": args.min_expert_slots,
        "unit_norm_weight_layers": unit_norm_layers,
        "ep": args.ep.ep,
        "ep_within_bound": args.ep.sharded().then(|| rows.iter().all(|r| r.ep_agreement.as_ref().is_some_and(|a| a.within_bound))),
        "device": backend.name(),
        "model": model.describe(),
    });
    let mut report = Report::new("multilayer", Verdict::from_pass(pass), headline)
        .summary(summary)
        .with("per_layer", &rows)
        .with("input_nonfinite", &in_json)
        .with("failures", &failures)
        .with(
            "ep",
            args.ep.sharded().then(|| {
                let mut j = ep_json_with(&args.ep, &devices, reduce_info.as_ref());
                j["tolerance"] = json!(tolerance_text(first_k));
                j
            }),
        )
        .section(setup)
        .section(table)
        .plot("multilayer.svg", plot.render());
    let too_few: Vec<String> = rows
        .iter()
        .filter(|r| !r.experts_too_few_slots.is_empty())
        .map(|r| {
            format!(
                "layer {}: experts {} miss --min-expert-cosine on fewer than --min-expert-slots {} slots: too few tokens to judge",
                r.layer,
                ranges(&r.experts_too_few_slots),
                args.min_expert_slots
            )
        })
        .collect();
    if !too_few.is_empty() {
        let mut s = Section::new("Experts too few tokens reached to judge", &["note"]);
        for x in &too_few {
            s.row(vec![x.clone()]);
        }
        report = report.section(s);
    }
    if !failures.is_empty() {
        let mut s = Section::new("Failures", &["problem"]);
        for x in &failures {
            s.row(vec![x.clone()]);
        }
        report = report.section(s);
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_parse() {
        assert_eq!(parse_range("1..4").unwrap(), vec![1, 2, 3]);
        assert_eq!(parse_range("1..=4").unwrap(), vec![1, 2, 3, 4]);
        assert_eq!(parse_range("5").unwrap(), vec![5]);
        assert!(parse_range("4..1").is_err());
        assert!(parse_range("a..b").is_err());
        let msg = |r: &str| parse_range(r).unwrap_err().to_string();
        assert!(msg("1..1").contains("empty range"), "{}", msg("1..1"));
        // a range no model has is refused before it is walked (it was collected: OOM)
        assert!(msg("0..18446744073709551615").contains("more than any model"));
        assert!(msg("0..=18446744073709551615").contains("more than any model"));
    }
}
