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
    /// Where does the first NaN/Inf appear? Scan a trace in execution order
    NanLocate(nan_locate::Args),
    /// Where do two runs first diverge? Compare two traces module by module
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
    Ok(match command {
        Command::Synth(a) => (synth::run(&a)?, a.out_args.outputs()),
        Command::Quantize(a) => (quantize::run(&a)?, a.out_args.outputs()),
        Command::Audit(a) => (audit::run(&a)?, a.out_args.outputs()),
        Command::Layertest(a) => (layertest::run(&a)?, a.out_args.outputs()),
        Command::GsSweep(a) => (gs_sweep::run(&a)?, a.out_args.outputs()),
        Command::CompareWeights(a) => (compare_weights::run(&a)?, a.out_args.outputs()),
        Command::CompareOutputs(a) => (compare_outputs::run(&a)?, a.out_args.outputs()),
        Command::Routing(a) => (routing::run(&a)?, a.out_args.outputs()),
        Command::Multilayer(a) => (multilayer::run(&a)?, a.out_args.outputs()),
        Command::NanLocate(a) => (nan_locate::run(&a)?, a.out_args.outputs()),
        Command::Bisect(a) => (bisect::run(&a)?, a.out_args.outputs()),
        Command::Run(a) => (run_case::run(&a)?, a.out_args.outputs()),
        Command::Bench(a) => (bench::run(&a)?, a.out_args.outputs()),
        Command::SynthTrace(a) => (synth_trace::run(&a)?, a.out_args.outputs()),
    })
}
