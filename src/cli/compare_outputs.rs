//! `compare-outputs DIR OUTPUT.safetensors`: the other half of `layertest --dump-inputs DIR`,
//! for kernels that cannot be wrapped in a plugin. The user ran their kernel on the dumped
//! inputs and hands its output back; it is judged like a `--kernel` plugin: against the BF16
//! reference, against our NVFP4 path, and against the known engine bugs recomputed on the CPU.

use super::common::OutArgs;
use super::kernel;
use super::layertest::{DEFAULT_MIN_COSINE, KERNEL_CHECK_MAX_MACS};
use crate::checkpoint::file::TensorFile;
use crate::error::{Error, Result};
use crate::moe::byok::{self, dump, Feeding, Outputs};
use crate::report::{f, Report, Section, Verdict};
use safetensors::Dtype;
use serde_json::json;
use std::path::{Path, PathBuf};

#[derive(clap::Args, Debug)]
#[command(
    after_help = "The output is the routed experts' weighted sum [tokens, hidden] (what the kernel \
of kernels/include/nvfp4dbg_moe.h writes; F32, BF16 or F16). Pass: cosine >= --min-cosine of the \
layer (output + the dumped shared experts) against the BF16 reference, and cosine >= 0.99999 of the \
routed output against ours (the same function up to FP32 summation order). On a failure the known \
engine bugs (gate/up reversed, block scales read in the other layout or transposed, routing weights not applied or applied twice, \
routing weights applied to the wrong slots of a token: shifted by one slot, topk_ids sorted but not \
topk_weights or the reverse; shared experts included once or twice; the output written transposed; \
the activation gs taken as input_scale (1/a1_gscale quantizes), alpha built from gs instead of 1/gs, or the handed gs ignored \
for the default 2688; the weights' E2M1 \
nibbles read high first; w3 scaled with w1's weight_scale_2; swiglu_limit ignored, applied to the gate or up only, or \
applied by a model that has none) are recomputed on the CPU and the one the output matches is named; an output \
off by a factor (cosine 1, wrong norm) fails as a scale error; rows each off by a factor of their own as per-token routing weights \
(top-k weights not renormalized); rows that are ours less one slot's expert output name the dropped expert per token; rows of \
other tokens as a permutation. An output that passes layer-wide is also judged expert by expert: an \
expert whose own rows (its tokens) are off by rel-L2 > 0.25 fails, named (a wrong expert serving one token of many). The dump is checked first (the digests layertest recorded, our routed output \
recomputed from the inputs): an edited dump, or one mixing two layertest runs, is exit 2 naming the tensor."
)]
pub struct Args {
    /// Directory written by `layertest --dump-inputs DIR`
    #[arg(value_name = "DIR")]
    pub dir: PathBuf,
    /// safetensors file holding the kernel's output
    #[arg(value_name = "OUTPUT")]
    pub output: PathBuf,
    /// Name of the output tensor (default: `output`, or the file's only tensor)
    #[arg(long, value_name = "NAME")]
    pub tensor: Option<String>,
    /// Fail below this cosine of the layer against the BF16 reference
    #[arg(long, value_name = "C", default_value_t = DEFAULT_MIN_COSINE, value_parser = super::common::cosine, allow_negative_numbers = true)]
    pub min_cosine: f64,
    #[command(flatten)]
    pub out_args: OutArgs,
}

/// The user's output as f32 `[tokens, hidden]`.
fn read_output(path: &Path, name: Option<&str>, t: usize, h: usize) -> Result<(String, Vec<f32>)> {
    let file = TensorFile::open(path)?;
    let name = match name {
        Some(n) => n.to_string(),
        None if file.contains("output") => "output".to_string(),
        None if file.len() == 1 => file.names().next().unwrap_or_default().to_string(),
        None => {
            return Err(Error::bad_file(
                path,
                format!(
                    "{} tensors and none named `output`: pick one with --tensor ({})",
                    file.len(),
                    file.names().collect::<Vec<_>>().join(", ")
                ),
            ))
        }
    };
    let info = file.info(&name)?;
    let dims: Vec<usize> = info.shape.iter().copied().filter(|&d| d != 1).collect();
    // [hidden, tokens] is read flat like [T·H]: the diagnosis then names it written transposed
    let shape_ok = dims == [t, h] || dims == [h, t] || dims == [t * h] || (t == 1 && dims == [h]);
    if info.numel() != t * h || !shape_ok {
        return Err(Error::bad_tensor(
            path,
            &name,
            format!(
                "shape {:?}, expected [{t}, {h}] (tokens, hidden of the dumped inputs)",
                info.shape
            ),
        ));
    }
    // what a kernel writes: an FP8 output (or F64) is not one of them, so it is no bug to diagnose
    if !matches!(info.dtype, Dtype::F32 | Dtype::BF16 | Dtype::F16) {
        return Err(Error::bad_tensor(
            path,
            &name,
            format!("dtype {:?}, expected F32, BF16 or F16", info.dtype),
        ));
    }
    Ok((name.clone(), file.to_f32(&name)?))
}

pub fn run(args: &Args) -> Result<Report> {
    let d = dump::read(&args.dir)?;
    let c = &d.layer.config;
    let (t, h) = (d.routing.tokens, c.hidden_size);
    let (name, theirs) = read_output(&args.output, args.tensor.as_deref(), t, h)?;
    let x = &d.expected;
    let o = Outputs {
        theirs_routed: &theirs,
        ours_routed: &x.nvfp4_routed,
        ours_layer: &x.nvfp4_out,
        reference_layer: &x.reference_out,
        shared: &x.shared_out,
    };
    let mut j = byok::judge(&o, args.min_cosine, &[]);
    let macs = byok::routed_macs(c, &d.routing);
    let mut note = None;
    if !j.agree {
        if macs > KERNEL_CHECK_MAX_MACS {
            note = Some(format!(
                "diagnosis skipped: {macs:.1e} multiply-adds per CPU variant (limit {KERNEL_CHECK_MAX_MACS:.0e})"
            ));
        } else {
            let feeding = Feeding {
                layout: None,
                ep: None,
            };
            let v = byok::bug_variants(&d.layer, &d.hidden, &d.routing, &d.scales, feeding)?;
            j = byok::judge(&o, args.min_cosine, &v);
        }
    }
    // an error of one expert serving one or two of many tokens stays under the layer's bar:
    // each expert's own rows are judged too
    let experts = if j.pass() {
        byok::deviating_experts(&theirs, &x.nvfp4_routed, &d.routing, h, c.n_routed_experts)
    } else {
        vec![]
    };
    let pass = j.pass() && experts.is_empty();
    // a scale error is said by the blame; localizing it would list every token
    let mut local = (!j.agree && !j.theirs_vs_ours.passes(byok::AGREE_MIN_COSINE))
        .then(|| byok::localize(&theirs, &x.nvfp4_routed, &d.routing, h))
        .flatten();
    // rows that are ours less one slot's expert output: name the dropped experts exactly, also
    // one that served a single token, or several (the localization's one-expert rule needs one
    // expert shared by two or more deviating tokens, and can pick another expert they share)
    if let Some(l) = local.as_mut().filter(|l| {
        j.diagnosis.is_none()
            && l.permuted.is_empty()
            && l.token_factors.is_none()
            && macs <= KERNEL_CHECK_MAX_MACS
    }) {
        let ps = byok::expert_outputs(&d.layer, &d.hidden, &d.routing, &d.scales)?;
        byok::name_dropped_slots(l, &theirs, &x.nvfp4_routed, &ps, &d.routing, h);
    }
    let headline = match j.blame() {
        None if !experts.is_empty() => format!(
            "{}: {}",
            args.output.display(),
            byok::deviating_experts_text(&experts, j.theirs_vs_ours.cosine)
        ),
        Some(b) if j.diagnosis.is_none() && local.is_some() => format!(
            "{}: {b}; {}",
            args.output.display(),
            local.as_ref().map(|l| l.text.as_str()).unwrap_or_default()
        ),
        None => format!(
            "{}: the kernel output matches the BF16 reference (layer cosine {}) and our NVFP4 path (routed cosine {})",
            args.output.display(),
            f(j.theirs_vs_reference.cosine, 4),
            f(j.theirs_vs_ours.cosine, 6)
        ),
        Some(b) => format!("{}: {b}", args.output.display()),
    };
    let mut report = Report::new("compare-outputs", Verdict::from_pass(pass), headline)
        .summary(json!({
            "cosine": j.theirs_vs_reference.cosine,
            "rel_l2": j.theirs_vs_reference.rel_l2,
            "sqnr_db": j.theirs_vs_reference.sqnr_db,
            "max_abs_err": j.theirs_vs_reference.max_abs_err,
            "nan_count": j.theirs_vs_reference.nan_count,
            "inf_count": j.theirs_vs_reference.inf_count,
            "vs_ours_cosine": j.theirs_vs_ours.cosine,
            "min_cosine": args.min_cosine,
            "diagnosis": j.diagnosis,
            "inputs": args.dir.display().to_string(),
            "output": args.output.display().to_string(),
            "tensor": name,
        }))
        .with("kernel", kernel::json(None, &j, note.as_deref()))
        .with("localization", &local)
        .with("deviating_experts", &experts)
        .with("dump_check", &d.check)
        .section(Section::kv(
            "compare-outputs",
            &[
                ("inputs", args.dir.display().to_string()),
                (
                    "output",
                    format!("{} (tensor `{name}`)", args.output.display()),
                ),
                (
                    "layer",
                    format!(
                        "{t} tokens, hidden {h}, {} experts top-{}, moe_intermediate {}",
                        c.n_routed_experts, d.routing.top_k, c.moe_intermediate_size
                    ),
                ),
                ("dump check", d.check.text()),
            ],
        ));
    for s in kernel::sections(&j, &args.output.display().to_string(), note.as_deref(), h) {
        report = report.section(s);
    }
    Ok(report)
}
