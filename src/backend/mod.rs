//! One `Backend` trait, two implementations: the CPU (the reference, f64 accumulation) and
//! CUDA (the real kernels). Commands hold a `Box<dyn Backend>` and never know which.

pub mod cpu;
pub mod cuda;

use crate::error::Result;
use crate::metrics::Metrics;
use crate::moe::{MoeLayer, MoeOutput, Path, Routing};
use crate::nvfp4::{BlockStats, Flavor, Fp4Tensor};

pub trait Backend {
    /// "cpu" or "cuda:0 (NVIDIA H200, sm_90a)".
    fn name(&self) -> String;

    /// Router: FP32 logits, scoring, (group-limited / hash) top-k, weights. `input_ids` is
    /// needed by hash layers only.
    fn route(&self, layer: &MoeLayer, hidden: &[f32], input_ids: Option<&[i64]>)
        -> Result<Routing>;

    /// The MoE block on `hidden` `[tokens, hidden_size]` (BF16-exact values) with a given
    /// routing, through the NVFP4 path or the BF16 reference. With `per_slot`, also return the
    /// unweighted output of every (token, slot).
    fn moe_forward(
        &self,
        layer: &MoeLayer,
        hidden: &[f32],
        routing: &Routing,
        path: &Path,
        per_slot: bool,
    ) -> Result<MoeOutput>;

    /// NVFP4-quantize `[rows, cols]` with quant-direction global scale `gs`.
    fn quantize(
        &self,
        x: &[f32],
        rows: usize,
        cols: usize,
        gs: f32,
        flavor: Flavor,
    ) -> Result<(Fp4Tensor, BlockStats)>;

    /// Metrics of `test` against `reference`.
    fn compare(&self, test: &[f32], reference: &[f32]) -> Result<Metrics>;
}

/// What `--device` asked for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeviceRequest {
    /// Not given: CUDA device 0 when one is usable, else the CPU.
    Auto,
    Cpu,
    Cuda(usize),
}

impl std::str::FromStr for DeviceRequest {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(DeviceRequest::Auto),
            "cpu" => Ok(DeviceRequest::Cpu),
            "cuda" => Ok(DeviceRequest::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(DeviceRequest::Cuda)
                .ok_or_else(|| format!("`{s}`: expected cpu, cuda or cuda:N")),
        }
    }
}

/// Open the backend `--device` asked for. `Auto` falls back to the CPU (saying so on stderr is
/// the caller's business); an explicit `cuda` without a usable GPU is an error (exit 2).
pub fn open(req: &DeviceRequest) -> Result<Box<dyn Backend>> {
    match req {
        DeviceRequest::Cpu => Ok(Box::new(cpu::CpuBackend::new())),
        DeviceRequest::Cuda(n) => Ok(Box::new(cuda::CudaBackend::open(*n)?)),
        DeviceRequest::Auto => match cuda::CudaBackend::probe() {
            Ok(()) => Ok(Box::new(cuda::CudaBackend::open(0)?)),
            Err(_) => Ok(Box::new(cpu::CpuBackend::new())),
        },
    }
}
