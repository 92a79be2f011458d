//! The command line: one file per subcommand, each reading like the hypothesis it tests:
//! load → run (backend) → compare (metrics) → verdict → report.

pub mod common;

pub mod audit;
pub mod bench;
pub mod bisect;
pub mod compare_outputs;
pub mod compare_weights;
pub mod expert_check;
pub mod gs_sweep;
pub mod kernel;
pub mod layertest;
pub mod multilayer;
pub mod nan_locate;
pub mod quantize;
pub mod routing;
pub mod run_case;
pub mod synth;
pub mod synth_trace;

use crate::error::{Error, Result};
use crate::report::{Outputs, Report};
use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(
    name = "nvfp4dbg",
    version,
    about = "Find out why an NVFP4 MoE model returns NaN or garbage",
    long_about = "Find out why an NVFP4 Mixture-of-Experts model returns NaN or garbage in an \
inference engine while its one-layer kernel test passes. Each subcommand tests one hypothesis \
against a higher-precision reference and ends in a verdict: exit 0 pass, 1 fail, 2 bad input."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Write a small HF-style DeepSeek checkpoint: BF16 originals + ModelOpt NVFP4 experts
    Synth(synth::Args),
    /// Quantize BF16/F32 safetensors weights to ModelOpt NVFP4 (or MXFP4) tensors
    Quantize(quantize::Args),
    /// Is the checkpoint itself sane? Static scan of every NVFP4 tensor triple
    ///
    /// Block scales are judged with the codes they scale: a zero block scale (MXFP4: E8M0 code
    /// 0, 2^-127) over a block whose FP4 codes are not all ±0 is a finding (those weights
    /// dequantize to 0; quantizers write scale 0 only over all-zero blocks, which pass), and so
    /// is a block whose code × block scale × weight_scale_2 overflows f32 (it dequantizes to
    /// Inf).
    ///
    /// A checkpoint directory holding quantized linears but no config.json is a finding: engines
    /// build the model from it, and the checks against it are skipped. A single .safetensors file
    /// given as PATH needs no config.
    Audit(audit::Args),
    /// Is the MoE kernel math right on this layer? NVFP4 layer vs BF16 reference
    Layertest(layertest::Args),
    /// Is the activation global scale wrong? The layer under every gs source and a sweep
    GsSweep(gs_sweep::Args),
    /// Did the engine load what the checkpoint holds? Diff two weight sets
    CompareWeights(compare_weights::Args),
    /// Is the user's MoE kernel output right? Judge it on `layertest --dump-inputs` inputs
    CompareOutputs(compare_outputs::Args),
    /// Do tokens reach the right experts? Check a routing dump
    Routing(routing::Args),
    /// Does error grow through the residual stream? N MoE layers, NVFP4 vs BF16
    Multilayer(multilayer::Args),
    /// Where does the first NaN/Inf appear? Scan a trace in completion order
    ///
    /// Calls are scanned in the order of the counter in their file names: the order the
    /// recorder's forward hooks fired, on each module's exit (completion order), so a module's
    /// submodules come before the module itself.
    NanLocate(nan_locate::Args),
    /// Where do two runs first diverge? Compare two traces module by module
    ///
    /// Calls are paired within each step (`__metadata__` `step`, when both traces record it) by
    /// aligning the two sequences of module paths as `diff` aligns lines: a call only one trace
    /// made (an extra expert call, a module one engine does not have) is listed as only in REF
    /// or only in TEST, and the calls after it still pair with their counterparts. A module
    /// called a different number of times in the two traces is named in the result. The same
    /// NaN/±Inf at the same places in both (a -inf mask, masked attention scores) count as
    /// equal, and the finite rest is compared. Traces of
    /// different inputs (the first recorded calls hold different numbers of tokens) are not
    /// comparable: exit 2.
    Bisect(bisect::Args),
    /// Run a named scenario from cases/*.toml
    Run(run_case::Args),
    /// How fast is the GPU path? Timed figures against the copy and BF16 GEMM floors
    Bench(bench::Args),
    /// Write a synthetic trace (tiny transformer, planted faults): test material for cases
    #[command(hide = true)]
    SynthTrace(synth_trace::Args),
}

/// Run a parsed command line: the report is printed and written; the verdict is the exit code.
pub fn run(cli: Cli) -> Result<u8> {
    // commands whose GPU work the CPU reference backend also does
    let cpu_path = matches!(
        cli.command,
        Command::Layertest(_)
            | Command::GsSweep(_)
            | Command::Multilayer(_)
            | Command::Routing(_)
            | Command::CompareWeights(_)
    );
    let (report, outputs) = execute(cli.command).map_err(|e| match e {
        Error::Cuda { step, kernel, what } if cpu_path => Error::Cuda {
            step,
            kernel,
            what: format!(
                "{what}\n(--device cpu runs the same computation on the CPU reference backend)"
            ),
        },
        e => e,
    })?;
    crate::report::emit(&report, &outputs)?;
    Ok(report.verdict.exit_code())
}

/// Run a command and return its report and where it would go, without printing or writing it
/// (`run CASE.toml` runs commands in-process this way).
pub fn execute(command: Command) -> Result<(Report, Outputs)> {
    let outputs = command.out_args().outputs();
    let report = match &command {
        Command::Synth(a) => synth::run(a)?,
        Command::Quantize(a) => quantize::run(a)?,
        Command::Audit(a) => audit::run(a)?,
        Command::Layertest(a) => layertest::run(a)?,
        Command::GsSweep(a) => gs_sweep::run(a)?,
        Command::CompareWeights(a) => compare_weights::run(a)?,
        Command::CompareOutputs(a) => compare_outputs::run(a)?,
        Command::Routing(a) => routing::run(a)?,
        Command::Multilayer(a) => multilayer::run(a)?,
        Command::NanLocate(a) => nan_locate::run(a)?,
        Command::Bisect(a) => bisect::run(a)?,
        Command::Run(a) => run_case::run(a)?,
        Command::Bench(a) => bench::run(a)?,
        Command::SynthTrace(a) => synth_trace::run(a)?,
    };
    Ok((report, outputs))
}

impl Command {
    fn out_args(&self) -> &common::OutArgs {
        match self {
            Command::Synth(a) => &a.out_args,
            Command::Quantize(a) => &a.out_args,
            Command::Audit(a) => &a.out_args,
            Command::Layertest(a) => &a.out_args,
            Command::GsSweep(a) => &a.out_args,
            Command::CompareWeights(a) => &a.out_args,
            Command::CompareOutputs(a) => &a.out_args,
            Command::Routing(a) => &a.out_args,
            Command::Multilayer(a) => &a.out_args,
            Command::NanLocate(a) => &a.out_args,
            Command::Bisect(a) => &a.out_args,
            Command::Run(a) => &a.out_args,
            Command::Bench(a) => &a.out_args,
            Command::SynthTrace(a) => &a.out_args,
        }
    }

    /// The files and directories the command writes, its `--json` included (not its report
    /// directory): `run` keeps a case's inside its ${WORK}.
    pub fn written_paths(&self) -> Vec<&std::path::Path> {
        let mut v: Vec<&std::path::Path> =
            self.out_args().json.iter().map(|p| p.as_path()).collect();
        match self {
            Command::Synth(a) => v.push(&a.out),
            Command::SynthTrace(a) => v.push(&a.out),
            Command::Quantize(a) => v.push(&a.output),
            Command::Layertest(a) => v.extend(
                [&a.save_outputs, &a.save_routing, &a.dump_inputs]
                    .into_iter()
                    .flatten()
                    .map(|p| p.as_path()),
            ),
            _ => {}
        }
        v
    }
}
