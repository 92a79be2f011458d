//! `synth-trace` (hidden): write a trace of a tiny transformer with vLLM module names, optionally
//! with a planted NaN/Inf or a perturbation in one module. Test material for `nan-locate` and
//! `bisect` (cases/*.toml run it in `setup`), so neither needs Python or a GPU.

use super::common::OutArgs;
use crate::error::{Error, Result};
use crate::report::{Report, Section, Verdict};
use crate::trace::synthetic::{module_calls, write_trace, Fault, FaultKind, SynthTraceConfig};
use safetensors::Dtype;
use serde_json::json;
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Trace directory to write
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    #[arg(long, default_value_t = 8)]
    pub tokens: usize,
    #[arg(long, default_value_t = 64)]
    pub hidden: usize,
    #[arg(long, default_value_t = 4)]
    pub heads: usize,
    #[arg(long, default_value_t = 128)]
    pub intermediate: usize,
    #[arg(long, default_value_t = 2)]
    pub layers: usize,
    #[arg(long, default_value_t = 97)]
    pub vocab: usize,
    /// Seed of weights and token ids: equal seeds give the same model
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Storage dtype: bf16, f16 or f32
    #[arg(long, default_value = "bf16")]
    pub dtype: String,
    /// Record outputs only
    #[arg(long)]
    pub no_inputs: bool,
    /// `rank` metadata
    #[arg(long)]
    pub rank: Option<u64>,
    /// `step` metadata of the first forward pass
    #[arg(long)]
    pub step: Option<u64>,
    /// Forward passes recorded, numbered from --step (or 0)
    #[arg(long, default_value_t = 1)]
    pub steps: usize,
    /// First execution counter
    #[arg(long, default_value_t = 0)]
    pub counter_start: u64,
    /// Relative noise on every output (a different but healthy kernel)
    #[arg(long, default_value_t = 0.0)]
    pub jitter: f32,
    /// Plant a NaN in this module's output (repeatable)
    #[arg(long, value_name = "MODULE")]
    pub nan_at: Vec<String>,
    /// Plant a +Inf in this module's output (repeatable)
    #[arg(long, value_name = "MODULE")]
    pub inf_at: Vec<String>,
    /// Perturb this module's output by --perturb-scale × its RMS (repeatable)
    #[arg(long, value_name = "MODULE")]
    pub perturb: Vec<String>,
    #[arg(long, default_value_t = 0.5)]
    pub perturb_scale: f32,
    /// Token of a planted NaN/Inf (default: the middle token)
    #[arg(long)]
    pub fault_token: Option<usize>,
    /// Channel of a planted NaN/Inf
    #[arg(long, default_value_t = 0)]
    pub fault_channel: usize,
    #[command(flatten)]
    pub out_args: OutArgs,
}

pub fn run(args: &Args) -> Result<Report> {
    let dtype = match args.dtype.to_ascii_lowercase().as_str() {
        "bf16" => Dtype::BF16,
        "f16" => Dtype::F16,
        "f32" => Dtype::F32,
        other => {
            return Err(Error::usage(format!(
                "--dtype {other}: expected bf16, f16 or f32"
            )))
        }
    };
    let token = args.fault_token.unwrap_or(args.tokens / 2);
    let fault = |module: &String, kind| Fault {
        module: module.clone(),
        kind,
        token,
        channel: args.fault_channel,
    };
    let faults: Vec<Fault> = args
        .nan_at
        .iter()
        .map(|m| fault(m, FaultKind::Nan))
        .chain(args.inf_at.iter().map(|m| fault(m, FaultKind::Inf)))
        .chain(
            args.perturb
                .iter()
                .map(|m| fault(m, FaultKind::Perturb(args.perturb_scale))),
        )
        .collect();
    let cfg = SynthTraceConfig {
        tokens: args.tokens,
        hidden: args.hidden,
        heads: args.heads,
        intermediate: args.intermediate,
        layers: args.layers,
        vocab: args.vocab,
        seed: args.seed,
        dtype,
        inputs: !args.no_inputs,
        rank: args.rank,
        step: args.step,
        steps: args.steps,
        counter_start: args.counter_start,
        jitter: args.jitter,
        faults: faults.clone(),
    };
    let files = write_trace(&args.out, &cfg)?;
    let mut s = Section::new("Planted faults", &["module", "fault", "token", "channel"]);
    for f in &faults {
        let kind = match f.kind {
            FaultKind::Nan => "NaN".to_string(),
            FaultKind::Inf => "+Inf".to_string(),
            FaultKind::Perturb(x) => format!("noise {x} × RMS"),
        };
        s.row(vec![
            f.module.clone(),
            kind,
            f.token.to_string(),
            f.channel.to_string(),
        ]);
    }
    Ok(Report::new(
        "synth-trace",
        Verdict::Pass,
        format!(
            "wrote {} trace files to {}",
            files.len(),
            args.out.display()
        ),
    )
    .summary(json!({ "out": args.out, "files": files.len(), "faults": faults.len() }))
    .with("modules", module_calls(&cfg)?)
    .section(s))
}
