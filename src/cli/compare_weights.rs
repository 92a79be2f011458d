//! `compare-weights` (H3): did the engine load what the checkpoint holds? A (the checkpoint)
//! against B (an engine's state-dict dump, possibly a TP / EP shard), tensor by tensor.

use super::common::{progress, DeviceArgs, OutArgs};
use super::routing::wrap;
use crate::error::{Error, Result};
use crate::moe::ep::Placement;
use crate::report::{self, Report, Section, Verdict};
use crate::weights::compare::UnitResult;
use crate::weights::engine;
use crate::weights::rules::Renames;
use crate::weights::{Comparison, Inputs, Options, Plan};
use serde::Serialize;
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
#[command(
    after_help = "Block-scale layouts: where a size fits both the linear and the 128x4-swizzled \
layout, each side's layout is decided by pairing the two sides (either may be the swizzled one, \
and exchanging A and B changes nothing); a side swizzled throughout (an engine's dump, swizzled \
for CUTLASS / FlashInfer) passes with a note, counted \"equal after reading X's block scales in \
the 128x4 swizzle\", never bitwise, while a side that mixes the two layouts within its routed \
experts' w13, their w2, or its other quantized linears fails (mixed_scale_layouts), naming the \
odd ones out."
)]
pub struct Args {
    /// Reference weights: a checkpoint directory or a safetensors file
    #[arg(value_name = "A")]
    pub a: PathBuf,
    /// Weights under test: a checkpoint directory or a safetensors file (an engine's state dict)
    #[arg(value_name = "B")]
    pub b: PathBuf,
    /// Strip this prefix from tensor names of both sides (repeatable)
    #[arg(long, value_name = "P")]
    pub strip_prefix: Vec<String>,
    /// Rename rules (TOML: [[rule]] pattern = regex, replace = '$1…', side = a|b|both)
    #[arg(long, value_name = "RULES.toml")]
    pub map: Option<PathBuf>,
    /// B is tensor-parallel rank R (with --tp-size)
    #[arg(long, value_name = "R")]
    pub tp_rank: Option<usize>,
    /// Tensor-parallel world size of B
    #[arg(long, value_name = "N")]
    pub tp_size: Option<usize>,
    /// B holds expert-parallel rank R's experts (with --ep-size)
    #[arg(long, value_name = "R")]
    pub ep_rank: Option<usize>,
    /// Expert-parallel world size of B
    #[arg(long, value_name = "N")]
    pub ep_size: Option<usize>,
    /// How experts are spread over EP ranks
    #[arg(long, value_enum, default_value = "linear")]
    pub placement: Placement,
    /// The cosine a quantized tensor must reach against a float one (an engine that dequantized
    /// at load). BF16 originals sit at NVFP4's own error (~0.995) and are named as the
    /// unquantized source (`audit` judges a checkpoint against them). Two sides in one encoding
    /// (one dtype, one global scale) must hold identical values: a copy changes none, so one
    /// changed code fails however high its cosine
    #[arg(long, value_name = "C", default_value_t = 0.9999, value_parser = super::common::cosine, allow_negative_numbers = true)]
    pub min_cosine: f64,
    #[command(flatten)]
    pub device: DeviceArgs,
    #[command(flatten)]
    pub out_args: OutArgs,
}

#[derive(Serialize)]
struct Summary<'a> {
    a: String,
    b: String,
    a_naming: &'a Option<String>,
    b_naming: &'a Option<String>,
    tensors_a: usize,
    tensors_b: usize,
    units: usize,
    equal: usize,
    equal_after_conversion: usize,
    close: usize,
    mismatched: usize,
    missing: usize,
    extra: usize,
    diagnoses: usize,
    skipped_ep: usize,
    bytes: u64,
    seconds: f64,
    gb_per_s: f64,
}

fn pair(name: &str, rank: Option<usize>, size: Option<usize>) -> Result<Option<(usize, usize)>> {
    match (rank, size) {
        (None, None) => Ok(None),
        (Some(r), Some(n)) if n >= 1 && r < n => Ok(Some((r, n))),
        (Some(r), Some(n)) => Err(Error::usage(format!(
            "--{name}-rank {r} is out of range for --{name}-size {n}"
        ))),
        (Some(_), None) => Err(Error::usage(format!("--{name}-rank needs --{name}-size"))),
        (_, Some(0)) => Err(Error::usage(format!("--{name}-size must be at least 1"))),
        (None, Some(1)) => Ok(None),
        (None, Some(_)) => Err(Error::usage(format!("--{name}-size needs --{name}-rank"))),
    }
}

pub fn run(args: &Args) -> Result<Report> {
    let tp = pair("tp", args.tp_rank, args.tp_size)?.filter(|&(_, n)| n > 1);
    let ep = pair("ep", args.ep_rank, args.ep_size)?
        .filter(|&(_, n)| n > 1)
        .map(|(r, n)| (r, n, args.placement));
    let opts = Options {
        renames: Renames::load(&args.strip_prefix, args.map.as_deref())?,
        tp,
        ep,
        min_cosine: args.min_cosine,
    };
    let engine = engine::open(&args.device.device)?;
    let t0 = std::time::Instant::now();
    let inputs = Inputs::open(&args.a, &args.b)?;
    let plan = Plan::new(&inputs, &opts)?;
    let (tensors_a, tensors_b) = plan.tensor_counts();
    let pb = progress(plan.len() as u64, "comparing", args.out_args.quiet);
    let c = plan.run(engine.as_ref(), &|| pb.inc(1)).map_err(|e| {
        e.advise_oom(
            "compare-weights holds one tensor pair at a time on the GPU, both sides in f32 \
             (8 bytes per element): free GPU memory (other processes) or run with --device cpu",
        )
    });
    pb.finish_and_clear();
    let mut c = c?;
    let seconds = t0.elapsed().as_secs_f64();
    c.notes.push(format!(
        "byte comparisons on the CPU (memory-mapped, in parallel); values that differ dequantized and diffed on {}",
        engine.name()
    ));
    Ok(build_report(args, &c, tensors_a, tensors_b, seconds))
}

fn short(v: &[String], n: usize) -> String {
    let mut s = v.iter().take(n).cloned().collect::<Vec<_>>().join(", ");
    if v.len() > n {
        s.push_str(&format!(", … ({} in all)", v.len()));
    }
    s
}

/// `U8 (nvfp4, scales F8_E4M3)` → `nvfp4`; plain dtypes as they are.
fn brief(dtype: &str) -> &str {
    dtype.split_once(" (").map_or(dtype, |(_, rest)| {
        rest.split([',', ')']).next().unwrap_or(dtype)
    })
}

fn kinds(u: &UnitResult) -> String {
    u.issues
        .iter()
        .map(|i| {
            serde_json::to_value(i.kind)
                .ok()
                .and_then(|v| v.as_str().map(String::from))
                .unwrap_or_default()
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// "96 equal after reading B's block scales in the 128x4 swizzle", one clause per reason;
/// None when every unit equal is bitwise so.
fn conversions(c: &Comparison) -> Option<String> {
    (!c.conversions.is_empty()).then(|| {
        c.conversions
            .iter()
            .map(|(why, n)| format!("{n} equal after {why}"))
            .collect::<Vec<_>>()
            .join(", ")
    })
}

fn build_report(
    args: &Args,
    c: &Comparison,
    tensors_a: usize,
    tensors_b: usize,
    seconds: f64,
) -> Report {
    let pass = c.passed();
    let gb_per_s = if seconds > 0.0 {
        c.bytes as f64 / 1e9 / seconds
    } else {
        0.0
    };
    let failing: Vec<&crate::weights::diagnose::Diagnosis> =
        c.diagnoses.iter().filter(|d| d.fails).collect();
    let headline = if pass {
        format!(
            "{} tensors agree ({} bitwise, {}{} after dequantization)",
            c.units,
            c.equal,
            conversions(c).map_or(String::new(), |s| format!("{s}, ")),
            c.close
        )
    } else {
        let mut parts = vec![];
        // the tensors a diagnosis filed as mismatches: the diagnosis says what they are
        let diagnosed = c.mismatches.iter().filter(|m| m.filed_by_diagnosis).count();
        if c.mismatched > diagnosed {
            parts.push(format!("{} mismatched", c.mismatched));
        }
        if !c.missing.is_empty() {
            parts.push(format!("{} missing in B", c.missing.len()));
        }
        if !c.extra.is_empty() {
            parts.push(format!("{} extra in B", c.extra.len()));
        }
        let mut h = parts.join(", ");
        if let Some(d) = failing.first() {
            let k = d.kind.name();
            let more = if failing.len() > 1 {
                format!(" (+{} more diagnoses)", failing.len() - 1)
            } else {
                String::new()
            };
            if h.is_empty() {
                // every tensor compared equal by itself: the diagnosis is the failure, said in full
                h = format!("{k}: {}{more}", d.message);
            } else {
                h.push_str(&format!("; {k}{more}"));
            }
        }
        h
    };
    let summary = Summary {
        a: args.a.display().to_string(),
        b: args.b.display().to_string(),
        a_naming: &c.a_naming,
        b_naming: &c.b_naming,
        tensors_a,
        tensors_b,
        units: c.units,
        equal: c.equal,
        equal_after_conversion: c.equal_after_conversion,
        close: c.close,
        mismatched: c.mismatched,
        missing: c.missing.len(),
        extra: c.extra.len(),
        diagnoses: failing.len(),
        skipped_ep: c.skipped_ep,
        bytes: c.bytes,
        seconds,
        gb_per_s,
    };
    let overview = Section::kv(
        "compare-weights",
        &[
            (
                "A",
                format!(
                    "{} — {}",
                    args.a.display(),
                    c.a_naming.as_deref().unwrap_or("no MoE naming")
                ),
            ),
            (
                "B",
                format!(
                    "{} — {}",
                    args.b.display(),
                    c.b_naming.as_deref().unwrap_or("no MoE naming")
                ),
            ),
            (
                "tensors",
                format!("A {tensors_a}, B {tensors_b}; {} compared", c.units),
            ),
            ("bitwise equal", c.equal.to_string()),
            (
                "equal after conversion",
                conversions(c).unwrap_or_else(|| "0".into()),
            ),
            ("close after dequant", c.close.to_string()),
            ("mismatched", c.mismatched.to_string()),
            (
                "missing in B / extra in B",
                format!("{} / {}", c.missing.len(), c.extra.len()),
            ),
            (
                "read",
                format!(
                    "{:.2} GB in {:.2} s ({:.2} GB/s)",
                    c.bytes as f64 / 1e9,
                    seconds,
                    gb_per_s
                ),
            ),
        ],
    );
    let mut r = Report::new("compare-weights", Verdict::from_pass(pass), headline)
        .summary(&summary)
        .with("mismatches", &c.mismatches)
        .with("missing", &c.missing)
        .with("extra", &c.extra)
        .with("diagnoses", &c.diagnoses)
        .with("close", &c.close_units)
        .with("notes", &c.notes)
        .section(overview);
    if !c.diagnoses.is_empty() {
        let mut s = Section::new("diagnoses", &["kind", "layer", "tensors", "what"]);
        for d in &c.diagnoses {
            s.row(vec![
                d.kind.name(),
                d.layer.map_or("-".into(), |l| l.to_string()),
                d.tensors.to_string(),
                wrap(&d.message, 80),
            ]);
        }
        r = r.section(s);
    }
    if !c.mismatches.is_empty() {
        const SHOW: usize = 40;
        let mut s = Section::new(
            format!(
                "mismatches{}",
                if c.mismatches.len() > SHOW {
                    format!(
                        " (first {SHOW} of {}; all in the JSON report)",
                        c.mismatches.len()
                    )
                } else {
                    String::new()
                }
            ),
            &["tensor", "issue", "A", "B", "cosine", "max abs err"],
        );
        for u in c.mismatches.iter().take(SHOW) {
            let (cos, mae) = u.metrics.as_ref().map_or(("-".into(), "-".into()), |m| {
                (report::f(m.cosine, 6), report::e(m.max_abs_err))
            });
            s.row(vec![
                u.name.clone(),
                wrap(
                    &format!(
                        "{}: {}",
                        kinds(u),
                        u.issues
                            .iter()
                            .map(|i| i.message.as_str())
                            .collect::<Vec<_>>()
                            .join("; ")
                    ),
                    60,
                ),
                format!("{:?} {}", u.a_shape, brief(&u.a_dtype)),
                format!("{:?} {}", u.b_shape, brief(&u.b_dtype)),
                cos,
                mae,
            ]);
        }
        r = r.section(s);
    }
    if !c.missing.is_empty() || !c.extra.is_empty() {
        r = r.section(Section::kv(
            "missing / extra",
            &[
                ("missing in B", wrap(&short(&c.missing, 20), 100)),
                ("extra in B", wrap(&short(&c.extra, 20), 100)),
            ],
        ));
    }
    if !c.notes.is_empty() {
        let mut s = Section::new("notes", &["note"]);
        for n in &c.notes {
            s.row(vec![wrap(n, 100)]);
        }
        r = r.section(s);
    }
    r
}
