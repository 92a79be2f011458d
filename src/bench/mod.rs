//! `nvfp4dbg bench`: how fast the GPU path is, against what the device can do.
//!
//! Figures (METHOD): each region is timed with CUDA events after a warm-up, many repeats,
//! median and min; inputs rotate through sets larger than the L2 (or the L2 is flushed by a
//! read between repeats). Every figure carries its work (FLOPs, bytes: each input read once,
//! each output written once) and the floor that work implies here: the larger of FLOPs over
//! the measured cuBLAS BF16 rate and bytes over the measured copy bandwidth.
//!
//! The figures (DeepSeek-V3: H 7168, I 2048, E 256, top-8, one shared expert; N = tokens·8
//! rows, X = experts touched; FP4 bytes of `[r, c]` = r·c/2 codes + r·c/16 E4M3 scales):
//!
//! | figure | rate | work (floor = max(FLOPs / BF16 rate, bytes / copy bandwidth)) |
//! |---|---|---|
//! | `copy_d2d` | GB/s | bytes = 2 · buffer (read + write); defines the copy bandwidth |
//! | `cublas_bf16_{4096,8192}` | TFLOP/s | 2m³ FLOPs, 2·2m² + 4m² bytes; the best defines the BF16 rate |
//! | `quantize_bf16_{reference,cuda_fast}` | GB/s | bytes = 2RC (BF16 in) + RC/2 + RC/16 (out), R×C = 8192×7168; `details.over_copy_same_bytes`: against a `cuMemcpyDtoDAsync` moving the same 150 MB (a kernel this short pays its ramp-up and tail: that copy runs at ~0.9 of `copy_d2d`'s 2 GiB one); the reference flavor's `details.longer_*`: the same at 4x the rows (602 MB), and `marginal_over_copy`, the extra bytes over the extra time against `copy_d2d` (no per-launch cost in it) |
//! | `gemm_prefill_4096_gate_up` | TFLOP/s | 4NIH FLOPs; X·FP4(2I×H) + N·FP4(H) in + N·FP4(I) out |
//! | `gemm_prefill_4096_down` | TFLOP/s | 2NHI FLOPs; X·FP4(H×I) + N·FP4(I) in + 4NH out |
//! | `gemm_prefill_4096`, `gemm_decode_{1,8,64}` | TFLOP/s, GB/s | both GEMMs; decode rate = FP4 weight bytes touched / time |
//! | `cublas_bf16_experts_{4096,64,8,1}` | TFLOP/s, GB/s | 6NHI FLOPs; X·6IH BF16 weights + 2NH + 8NI + 2NI + 4NH |
//! | `reduce_compare` | GB/s | 2 · 4n bytes (two f32 tensors read), n = 64M |
//! | `reduce_nan_scan`, `reduce_amax` | GB/s | 4n bytes |
//! | `layer_{16,4096}_{eager,graph}` | GB/s, TFLOP/s | 2THE + 6NHI + 6THI_s FLOPs; 8TH + 4EH + FP4 weights touched + 6I_sH bytes |
//!
//! Layout: `plan` (catalogue, `--only`, problem sizes, work formulas), `figure` (floors,
//! ratios), `stats` (median, rotation), `synth` (host data) are plain CPU code with unit
//! tests; `timer`, `gpu` and `moe_figs` drive the device.

pub mod figure;
mod gpu;
mod moe_figs;
pub mod plan;
pub mod stats;
pub mod synth;
mod timer;

pub use figure::{Bound, Figure, Floors, Unit};
pub use gpu::DeviceInfo;

use crate::backend::cuda::Gpu;
use crate::error::Result;
use serde::Serialize;

/// What `nvfp4dbg bench` was asked for.
#[derive(Clone, Debug)]
pub struct Options {
    pub ordinal: usize,
    pub quick: bool,
    pub only: Option<Vec<String>>,
}

/// The seed of every synthetic tensor: fixed, so that two runs time the same data.
pub const SEED: u64 = 0x5EED_B3C4;

/// How the figures were timed (JSON `settings`).
#[derive(Clone, Debug, Serialize)]
pub struct Settings {
    pub quick: bool,
    pub warmup: usize,
    pub warmup_ms: f64,
    pub min_reps: usize,
    pub max_reps: usize,
    pub budget_ms_per_figure: f64,
    pub seed: u64,
    pub selected: Vec<String>,
}

/// Everything a bench run produced.
#[derive(Clone, Debug)]
pub struct Outcome {
    pub device: DeviceInfo,
    /// `None` when a floor figure failed.
    pub floors: Option<Floors>,
    /// In catalogue order.
    pub figures: Vec<Figure>,
    pub settings: Settings,
    pub seconds: f64,
}

/// Run the selected figures on `cuda:{ordinal}`. Out of memory or an unusable GPU is an
/// error (exit 2); a figure that fails otherwise is reported in its row.
pub fn run(opts: &Options, progress: &mut dyn FnMut(&str)) -> Result<Outcome> {
    let sel = plan::Selection::new(opts.only.as_deref(), opts.quick)?;
    let gpu = Gpu::open(opts.ordinal)?;
    let t0 = std::time::Instant::now();
    let mut r = gpu::Runner::new(gpu, opts.quick, SEED, &sel, progress)?;
    let cfg = *r.cfg();
    // Each ceiling right before the figures it bounds (the ratios are taken at the end): the
    // copy, then the memory-bound quantizers and reductions, then the cuBLAS GEMMs and the MoE
    // figures. After the 8192^3 GEMM the quantizer read ~3% slower for seconds (s13e: 0.0438-
    // 0.0443 ms against 0.0428-0.0430 without it), in whole-run shifts earlier sessions saw.
    r.copy()?;
    r.quantize()?;
    r.reductions()?;
    for m in plan::CUBLAS_SIZES {
        r.cublas_square(m)?;
    }
    r.moe()?;
    let device = r.info().clone();
    let mut measured = std::mem::take(&mut r.measured);
    let order = plan::catalog(opts.quick);
    measured.sort_by_key(|m| {
        order
            .iter()
            .position(|(n, _)| *n == m.spec.name)
            .unwrap_or(usize::MAX)
    });
    let floors = figure::floors_from(&measured);
    let figures = figure::assemble(&measured, floors.as_ref());
    Ok(Outcome {
        device,
        floors,
        figures,
        settings: Settings {
            quick: opts.quick,
            warmup: cfg.warmup,
            warmup_ms: cfg.warmup_ms,
            min_reps: cfg.min_reps,
            max_reps: cfg.max_reps,
            budget_ms_per_figure: cfg.budget_ms,
            seed: SEED,
            selected: sel.names().to_vec(),
        },
        seconds: t0.elapsed().as_secs_f64(),
    })
}
