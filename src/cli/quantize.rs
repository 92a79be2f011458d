//! `quantize IN OUT`: BF16/F16/F32 safetensors weights → ModelOpt NVFP4 (or MXFP4) tensors.
//! IN is a file or an HF directory (then OUT is a directory mirroring its shards, index and
//! config.json with `quantization_config` added).

use super::common::{progress, OutArgs};
use crate::checkpoint::names::up_sibling;
use crate::checkpoint::quantize::{QuantizeOptions, QuantizePlan, QuantizedTensor};
use crate::error::Result;
use crate::nvfp4::{max_finite_out_scale_gs, out_scale_finite, Format};
use crate::report::{e, Report, Section, Verdict};
use serde_json::json;
use std::path::PathBuf;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum FormatArg {
    Nvfp4,
    Mxfp4,
}

#[derive(clap::Args, Debug)]
#[command(
    after_help = "Weights only: no input_scale is written (that needs activations: a calibration \
run). Commands reading the output take activation scales from --gs (calibrated, dynamic, a value); \
`--gs checkpoint` needs input_scale tensors the output does not have."
)]
pub struct Args {
    /// Input: a .safetensors file or an HF checkpoint directory
    #[arg(value_name = "IN")]
    pub input: PathBuf,
    /// Output: a .safetensors file (IN is a file) or a directory (IN is a directory)
    #[arg(value_name = "OUT")]
    pub output: PathBuf,
    /// Global scale (quant direction) for every tensor: weight_scale_2 = 1/VALUE.
    /// Default: each tensor's own 2688/amax
    #[arg(long, value_name = "VALUE", value_parser = weight_gs, allow_negative_numbers = true)]
    pub gs: Option<f32>,
    #[arg(long, value_enum, default_value = "nvfp4")]
    pub format: FormatArg,
    /// Copy tensors whose name contains SUBSTR instead of quantizing them (repeatable),
    /// e.g. `--exclude self_attn.`. Always copied: what engines never quantize (embeddings,
    /// lm_head, the MoE router's gate, MTP's eh_proj) and the modules the input's own exclude
    /// list names. The output's exclude_modules (config.json, hf_quant_config.json) lists the
    /// exact module names of every float weight matrix left unquantized, plus the input's list.
    /// An empty SUBSTR (an unset shell variable) would match every tensor: it is refused
    #[arg(long, value_name = "SUBSTR", value_parser = clap::builder::NonEmptyStringValueParser::new())]
    pub exclude: Vec<String>,
    /// Give the gate and up projections of each MLP (gate_proj/up_proj, w1/w3) one
    /// weight_scale_2, from the larger of their amaxes, as ModelOpt exports them: vLLM fuses
    /// them into one w13 with the gate's scale. Default: each tensor its own (NVFP4 only)
    #[arg(long, conflicts_with = "gs")]
    pub shared_gate_up_scale: bool,
    #[command(flatten)]
    pub out_args: OutArgs,
}

/// `--gs`: a positive normal f32 whose reciprocal (weight_scale_2) is normal too, and small
/// enough that no block's `out_scale` overflows (`nvfp4::out_scale_finite`), quoted as typed
/// when it is not (1e39 parses to inf).
fn weight_gs(v: &str) -> std::result::Result<f32, String> {
    match v.trim().parse::<f32>() {
        Ok(g) if g > 0.0 && g.is_normal() && (1.0 / g).is_normal() && out_scale_finite(g) => Ok(g),
        _ => Err(format!(
            "`{v}`: a global scale must be a positive f32 whose reciprocal (weight_scale_2) is a \
             normal f32 too, and small enough that a block's out_scale = 1/(s/gs) cannot \
             overflow: within [{:e}, {:e}]",
            f32::MIN_POSITIVE,
            max_finite_out_scale_gs()
        )),
    }
}

/// Rows of the per-tensor table on the terminal; the JSON report has them all.
const TABLE_ROWS: usize = 30;

pub fn run(args: &Args) -> Result<Report> {
    let format = match args.format {
        FormatArg::Nvfp4 => Format::Nvfp4,
        FormatArg::Mxfp4 => Format::Mxfp4,
    };
    let opts = QuantizeOptions {
        format,
        gs: args.gs,
        exclude: args.exclude.clone(),
        shared_gate_up: args.shared_gate_up_scale,
    };
    if args.shared_gate_up_scale && format == Format::Mxfp4 {
        return Err(crate::error::Error::usage(
            "--shared-gate-up-scale applies to NVFP4 only (MXFP4 has no global scale)",
        ));
    }
    let plan = QuantizePlan::new(&args.input, &args.output, opts)?;
    let pb = progress(plan.tensor_count() as u64, "quantize", args.out_args.quiet);
    let sum = plan.run(&|_| pb.inc(1))?;
    pb.finish_and_clear();

    let b = &sum.blocks;
    let pct = |n: u64| {
        if b.blocks == 0 {
            0.0
        } else {
            100.0 * n as f64 / b.blocks as f64
        }
    };
    let gs = match (format, args.gs) {
        (Format::Mxfp4, _) => "none (MXFP4)".to_string(),
        (_, Some(g)) => format!("{g} for every tensor"),
        (_, None) if args.shared_gate_up_scale => {
            "per tensor: 2688 / amax (a gate/up pair's larger amax)".to_string()
        }
        (_, None) => "per tensor: 2688 / amax".to_string(),
    };
    let split = split_gate_up_pairs(&sum.tensors);
    let mut headline = format!(
        "quantized {} tensors to {}, copied {} → {}",
        sum.quantized,
        format.name().to_uppercase(),
        sum.copied,
        sum.output.display()
    );
    if !sum.never_quantized.is_empty() {
        headline += &format!(
            "; {} float weight(s) engines never quantize kept as they are (embeddings, output heads, router gates; first: `{}`)",
            sum.never_quantized.len(),
            sum.never_quantized[0]
        );
    }
    if !sum.excluded_by_input_config.is_empty() {
        headline += &format!(
            "; {} float weight(s) kept unquantized as the input's quantization_config excludes them",
            sum.excluded_by_input_config.len()
        );
    }
    if !sum.not_quantized.is_empty() {
        headline += &format!(
            "; {} float weight(s) left unquantized for their shape (first: `{}`, {})",
            sum.not_quantized.len(),
            sum.not_quantized[0].name,
            sum.not_quantized[0].reason
        );
    }
    if let Some(first) = split.first() {
        headline += &format!(
            "; {} gate/up pair(s) got different weight_scale_2, each from its own amax (first: `{first}`): \
             vLLM's fused w13 uses the gate's for both and `audit` flags them; \
             --shared-gate-up-scale gives each pair one, as ModelOpt exports",
            split.len()
        );
    }
    let overview = Section::kv(
        "quantize",
        &[
            ("input", sum.input.display().to_string()),
            ("output", sum.output.display().to_string()),
            ("format", format.name().to_string()),
            ("gs", gs),
            ("files written", sum.files_written.to_string()),
            ("tensors quantized", sum.quantized.to_string()),
            ("tensors copied", sum.copied.to_string()),
            (
                "kept unquantized (input's exclude list)",
                sum.excluded_by_input_config.len().to_string(),
            ),
            (
                "kept unquantized (engines never quantize)",
                sum.never_quantized.len().to_string(),
            ),
            (
                "bytes in → out",
                format!("{} → {}", sum.bytes_in, sum.bytes_out),
            ),
            ("blocks", b.blocks.to_string()),
            (
                "block scales saturated",
                format!("{} ({:.3}%)", b.saturated, pct(b.saturated)),
            ),
            (
                "blocks flushed to zero",
                format!("{} ({:.3}%)", b.flushed, pct(b.flushed)),
            ),
        ],
    );
    let mut table = Section::new(
        "quantized tensors",
        &[
            "tensor",
            "shape",
            "amax",
            "weight_scale_2",
            "saturated",
            "flushed",
        ],
    );
    for t in sum.tensors.iter().take(TABLE_ROWS) {
        table.row(vec![
            t.name.clone(),
            format!("{}x{}", t.shape[0], t.shape[1]),
            e(t.amax as f64),
            t.weight_scale_2.map_or("-".into(), |v| e(v as f64)),
            t.stats.saturated.to_string(),
            t.stats.flushed.to_string(),
        ]);
    }
    if let Some(row) = more_row(sum.tensors.len(), 6) {
        table.row(row);
    }
    let mut report = Report::new("quantize", Verdict::Pass, headline)
        .summary(json!({
            "format": format.name(),
            "gs": args.gs,
            "files_written": sum.files_written,
            "quantized": sum.quantized,
            "copied": sum.copied,
            "bytes_in": sum.bytes_in,
            "bytes_out": sum.bytes_out,
            "blocks": b.blocks,
            "saturated": b.saturated,
            "flushed": b.flushed,
            "not_quantized": sum.not_quantized.len(),
            "excluded_by_input_config": sum.excluded_by_input_config.len(),
            "never_quantized": sum.never_quantized.len(),
            "gate_up_pairs_split": split.len(),
        }))
        .with("input", &sum.input)
        .with("output", &sum.output)
        .with("tensors", &sum.tensors)
        .with("not_quantized", &sum.not_quantized)
        .with("excluded_by_input_config", &sum.excluded_by_input_config)
        .with("never_quantized", &sum.never_quantized)
        .section(overview);
    if !sum.tensors.is_empty() {
        report = report.section(table);
    }
    if !sum.not_quantized.is_empty() {
        let mut s = Section::new(
            "float weights left unquantized (copied as they are)",
            &["tensor", "shape", "why"],
        );
        for t in sum.not_quantized.iter().take(TABLE_ROWS) {
            s.row(vec![
                t.name.clone(),
                format!("{:?}", t.shape),
                t.reason.clone(),
            ]);
        }
        if let Some(row) = more_row(sum.not_quantized.len(), 3) {
            s.row(row);
        }
        report = report.section(s);
    }
    Ok(report)
}

/// The gate projections (module names) whose up sibling was quantized with another
/// weight_scale_2.
fn split_gate_up_pairs(tensors: &[QuantizedTensor]) -> Vec<String> {
    let ws2: std::collections::HashMap<&str, Option<f32>> = tensors
        .iter()
        .map(|t| (t.name.as_str(), t.weight_scale_2))
        .collect();
    tensors
        .iter()
        .filter_map(|t| {
            let gate = t.name.strip_suffix(".weight")?;
            let up = format!("{}.weight", up_sibling(gate)?);
            let (Some(a), Some(Some(b))) = (t.weight_scale_2, ws2.get(up.as_str())) else {
                return None;
            };
            (a != *b).then(|| gate.to_string())
        })
        .collect()
}

/// The last row of a table cut at TABLE_ROWS of `total` rows, `cols` wide.
fn more_row(total: usize, cols: usize) -> Option<Vec<String>> {
    (total > TABLE_ROWS).then(|| {
        let mut row = vec![String::new(); cols];
        row[0] = format!("… {} more in the JSON report", total - TABLE_ROWS);
        row
    })
}
