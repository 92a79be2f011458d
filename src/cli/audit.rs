//! `audit PATH`: is the checkpoint itself sane? A static scan of every NVFP4 triple and every
//! float tensor, and — when the checkpoint ships BF16 originals (`DIR/bf16/`) — every quantized
//! linear dequantized against its original (see `checkpoint::audit` for what counts as a hazard
//! and why). Exit 1 names every hazardous tensor.
//!
//! Block scales are judged with the codes they scale: a zero block scale (MXFP4: E8M0 code 0,
//! 2^-127) over a block whose FP4 codes are not all ±0 is a finding (those weights dequantize
//! to 0; quantizers write scale 0 only over all-zero blocks, which pass), and so is a block
//! whose code × scale × weight_scale_2 overflows to Inf.

use super::common::{progress, OutArgs};
use crate::checkpoint::audit::{audit, AuditOptions, FindingKind, LinearStats, Severity};
use crate::checkpoint::originals;
use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};
use crate::nvfp4::Format;
use crate::report::{e, f, Report, Section, Verdict};
use serde_json::json;
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Checkpoint directory or .safetensors file
    #[arg(value_name = "PATH")]
    pub path: PathBuf,
    /// Flag a tensor when more than this fraction of its block scales sit at 448, and more than
    /// 8 of them do (an auto-scaled tensor puts the few blocks next to its amax at 448, whatever
    /// its size; 0 flags any tensor with more than 8). NVFP4 only: E8M0 scales do not saturate
    #[arg(long, value_name = "FRACTION", default_value_t = 0.01)]
    pub saturation_limit: f64,
    /// Flag an expert whose input_scale is more than this multiple of the layer's median, or less
    /// than the median over it
    #[arg(long, value_name = "FACTOR", default_value_t = 10.0)]
    pub input_scale_outlier: f32,
    /// Flag an expert whose weight_scale_2 is more than this multiple of the layer's median for
    /// the same projection, or less than the median over it (weight amaxes differ by a few x)
    #[arg(long, value_name = "FACTOR", default_value_t = 100.0)]
    pub weight_scale_outlier: f32,
    /// Flag a quantized linear whose dequantized weight has a cosine below this with its BF16
    /// original (DIR/bf16/), or a rel-L2 above what noise reaches at this cosine (0.33 at
    /// 0.95: the wrong magnitude). NVFP4 keeps ~0.99 (0.9955-0.9961, rel-L2 <= 0.095 on synth
    /// checkpoints); another matrix under the weight's name (gate/up swapped, experts
    /// permuted) gives ~0, a global scale 64x too small ~0.74
    #[arg(long, value_name = "C", default_value_t = originals::MIN_COSINE, value_parser = super::common::cosine, allow_negative_numbers = true)]
    pub min_original_cosine: f64,
    /// Do not compare the quantized weights with the BF16 originals under DIR/bf16/ (4x the
    /// bytes of the NVFP4 weights; only the structure and scale checks run)
    #[arg(long)]
    pub no_originals: bool,
    #[command(flatten)]
    pub out_args: OutArgs,
}

pub fn run(args: &Args) -> Result<Report> {
    if !(args.saturation_limit >= 0.0 && args.saturation_limit <= 1.0) {
        return Err(Error::usage("--saturation-limit is a fraction in [0, 1]"));
    }
    for (flag, v) in [
        ("--input-scale-outlier", args.input_scale_outlier),
        ("--weight-scale-outlier", args.weight_scale_outlier),
    ] {
        if !(v.is_finite() && v > 1.0) {
            return Err(Error::usage(format!("{flag} must be a finite factor > 1")));
        }
    }
    let ck = if args.no_originals {
        Checkpoint::open_without_originals(&args.path)?
    } else {
        Checkpoint::open(&args.path)?
    };
    let opts = AuditOptions {
        saturation_limit: args.saturation_limit,
        input_scale_outlier: args.input_scale_outlier,
        weight_scale_outlier: args.weight_scale_outlier,
        originals: !args.no_originals,
        min_original_cosine: args.min_original_cosine,
    };
    let pb = progress(ck.names().count() as u64, "audit", args.out_args.quiet);
    let res = audit(&ck, &opts, &|n| pb.inc(n))?;
    pb.finish_and_clear();

    let hazardous = res.hazardous_tensors();
    let mut by_kind: BTreeMap<FindingKind, usize> = BTreeMap::new();
    for x in &res.findings {
        *by_kind.entry(x.kind).or_default() += 1;
    }
    // 448 is E4M3's maximum: MXFP4's E8M0 scales have no saturation of that kind
    let nvfp4 = || res.linears.iter().filter(|l| l.format == Format::Nvfp4);
    let sat_total: u64 = nvfp4().map(|l| l.saturated).sum();
    let blocks: u64 = nvfp4().map(|l| l.blocks).sum();
    let nan_total: u64 = res.linears.iter().map(|l| l.nan_scales).sum();
    let worst_sat = nvfp4().max_by(|a, b| a.saturated_fraction.total_cmp(&b.saturated_fraction));
    // scales counted in the block-scale tensors a finding of `kind` names (vLLM-fused tensors
    // are named per expert, their scales not counted)
    let flagged_scales = |kind: FindingKind, count: fn(&LinearStats) -> u64| {
        let tensors: BTreeSet<&str> = res
            .findings
            .iter()
            .filter(|x| x.kind == kind)
            .map(|x| x.tensor.as_str())
            .collect();
        let scales: u64 = res
            .linears
            .iter()
            .filter(|l| {
                [".weight_scale", ".scale"]
                    .iter()
                    .any(|m| tensors.contains(format!("{}{m}", l.base).as_str()))
            })
            .map(count)
            .sum();
        (scales, tensors.len())
    };
    let (nan_flagged, nan_tensors) = flagged_scales(FindingKind::NanBlockScales, |l| l.nan_scales);
    let (sat_flagged, sat_tensors) =
        flagged_scales(FindingKind::SaturatedBlockScales, |l| l.saturated);
    let errors = res.errors().count();
    let warnings = res.warnings().count();
    let pass = errors == 0;
    let warned = match warnings {
        0 => String::new(),
        1 => " (1 warning)".into(),
        w => format!(" ({w} warnings)"),
    };
    let headline = if pass {
        format!(
            "{} quantized linears{} and {} float tensors scanned, no hazards{warned}",
            res.linears.len(),
            match res.fused_tensors {
                0 => String::new(),
                n => format!(", {n} vLLM-fused expert tensors (per expert)"),
            },
            res.float_tensors
        )
    } else {
        let n =
            |n: usize, one: &str, many: &str| format!("{n} {}", if n == 1 { one } else { many });
        format!(
            "{} ({}{}) in {}",
            n(hazardous.len(), "hazardous tensor", "hazardous tensors"),
            n(errors, "finding", "findings"),
            if warnings > 0 {
                format!(", {}", n(warnings, "warning", "warnings"))
            } else {
                String::new()
            },
            res.path.display()
        )
    };
    let mut overview = vec![
        ("checkpoint", res.path.display().to_string()),
        ("tensors", res.tensors.to_string()),
        ("quantized linears", res.linears.len().to_string()),
        ("vLLM-fused expert tensors", res.fused_tensors.to_string()),
        ("float tensors scanned", res.float_tensors.to_string()),
        ("bytes scanned", res.bytes_scanned.to_string()),
    ];
    if blocks > 0 {
        overview.push((
            "block scales at 448",
            format!(
                "{sat_total} of {blocks} ({}%)",
                f(100.0 * sat_total as f64 / blocks as f64, 4)
            ),
        ));
    }
    if let Some(w) = worst_sat {
        overview.push((
            "most saturated",
            format!("{} ({}%)", w.base, f(100.0 * w.saturated_fraction, 3)),
        ));
    }
    let checked: Vec<_> = res
        .linears
        .iter()
        .filter_map(|l| l.original.as_ref().map(|c| (l, c)))
        .collect();
    // a NaN cosine (NaN/Inf in the dequantized weight) is the lowest of all
    let lowest = checked.iter().min_by(|a, b| {
        let key = |c: f64| if c.is_nan() { f64::NEG_INFINITY } else { c };
        key(a.1.metrics.cosine).total_cmp(&key(b.1.metrics.cosine))
    });
    overview.push((
        "BF16 originals",
        match (&res.originals, ck.originals()) {
            (Some(p), _) => format!("{} linears compared with {}", checked.len(), p.display()),
            // --no-originals does not open them
            (None, _) if args.no_originals => "not compared (--no-originals)".into(),
            (None, Some(_)) => "not compared".into(),
            (None, None) => "none shipped".into(),
        },
    ));
    if let Some((l, c)) = lowest {
        overview.push((
            "lowest cosine vs original",
            format!(
                "{} ({})",
                if c.metrics.cosine.is_nan() {
                    "NaN".to_string()
                } else {
                    f(c.metrics.cosine, 4)
                },
                l.base
            ),
        ));
    }
    let plural =
        |n: usize, one: &str, many: &str| format!("{n} {}", if n == 1 { one } else { many });
    for (k, n) in &by_kind {
        let count = match k {
            FindingKind::NanBlockScales => format!(
                "{} in {}",
                plural(nan_flagged as usize, "scale", "scales"),
                plural(nan_tensors, "tensor", "tensors")
            ),
            FindingKind::SaturatedBlockScales => format!(
                "{} in {}",
                plural(sat_flagged as usize, "scale", "scales"),
                plural(sat_tensors, "tensor", "tensors")
            ),
            _ => n.to_string(),
        };
        overview.push((k.label(), count));
    }
    // the file column only says something when there are shards
    let sharded = ck.shards().len() > 1;
    let mut headers = vec!["tensor", "problem", "detail"];
    if sharded {
        headers.push("file");
    }
    let mut table = Section::new(if pass { "warnings" } else { "hazards" }, &headers);
    for x in &res.findings {
        let problem = match x.severity() {
            Severity::Error => x.kind.label().to_string(),
            Severity::Warning => format!("warning: {}", x.kind.label()),
        };
        let mut row = vec![x.tensor.clone(), problem, x.detail.clone()];
        if sharded {
            row.push(x.file.file_name().map_or_else(
                || x.file.display().to_string(),
                |n| n.to_string_lossy().to_string(),
            ));
        }
        table.row(row);
    }
    let counts: BTreeMap<String, usize> = by_kind
        .iter()
        .map(|(k, n)| {
            (
                serde_json::to_value(k)
                    .ok()
                    .and_then(|v| v.as_str().map(String::from))
                    .unwrap_or_default(),
                *n,
            )
        })
        .collect();
    let mut report = Report::new("audit", Verdict::from_pass(pass), headline)
        .summary(json!({
            "tensors": res.tensors,
            "quantized_linears": res.linears.len(),
            "fused_expert_tensors": res.fused_tensors,
            "float_tensors": res.float_tensors,
            "findings": res.findings.len(),
            "warnings": warnings,
            "hazardous_tensors": hazardous.len(),
            "saturated_block_scales": sat_total,
            "saturated_block_scales_flagged": sat_flagged,
            "saturated_block_scale_tensors": sat_tensors,
            "nan_block_scales": nan_total,
            "nan_block_scale_tensors": nan_tensors,
            "block_scales": res.linears.iter().map(|l| l.blocks).sum::<u64>(),
            "bytes_scanned": res.bytes_scanned,
            "originals": res.originals,
            "originals_compared": checked.len(),
            "original_bytes": res.original_bytes,
            "lowest_original_cosine": lowest.map(|(_, c)| c.metrics.cosine),
            "lowest_original_cosine_linear": lowest.map(|(l, _)| &l.base),
            "by_kind": counts,
        }))
        .with("hazardous_tensors", &hazardous)
        .with("findings", &res.findings)
        .with("linears", &res.linears)
        .section(Section::kv("audit", &overview));
    if !res.findings.is_empty() {
        report = report.section(table);
    }
    // a per-linear table only for small checkpoints; the JSON always has them all
    if !res.linears.is_empty() && res.linears.len() <= 24 {
        let mut headers = vec![
            "tensor",
            "shape",
            "convention",
            "weight_scale_2",
            "input_scale",
            "at 448",
            "max scale",
        ];
        // E8M0 scales do not saturate at 448: no column for an MXFP4-only checkpoint
        let any_nvfp4 = nvfp4().next().is_some();
        if !any_nvfp4 {
            headers.retain(|h| *h != "at 448");
        }
        if !checked.is_empty() {
            headers.push("cosine vs BF16 original");
        }
        let mut t = Section::new("quantized linears", &headers);
        for l in &res.linears {
            let mut row = vec![
                l.base.clone(),
                format!("{}x{}", l.shape[0], l.shape[1]),
                serde_json::to_value(l.convention)
                    .ok()
                    .and_then(|v| v.as_str().map(String::from))
                    .unwrap_or_default(),
                l.weight_scale_2.map_or("-".into(), |v| e(v as f64)),
                l.input_scale.map_or("-".into(), |v| e(v as f64)),
                match l.format {
                    Format::Nvfp4 => format!("{}%", f(100.0 * l.saturated_fraction, 2)),
                    Format::Mxfp4 => "-".into(),
                },
                f(l.max_block_scale as f64, 4),
            ];
            if !any_nvfp4 {
                row.remove(5);
            }
            if !checked.is_empty() {
                row.push(
                    l.original
                        .as_ref()
                        .map_or("-".into(), |c| f(c.metrics.cosine, 4)),
                );
            }
            t.row(row);
        }
        report = report.section(t);
    }
    Ok(report)
}
