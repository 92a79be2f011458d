//! The CUDA backend: real kernels (kernels/*.cu) compiled at run time by NVRTC for the
//! device's architecture, cuBLAS for the BF16 reference, all on one stream.

pub mod blas;
pub mod budget;
mod cubin_cache;
pub mod dequant;
pub mod device;
pub mod fault;
pub mod moe;
pub mod moe_decode;
pub mod nccl;
pub mod nvrtc;
pub mod plugin;
pub mod quant;
pub mod reduce;
pub mod router;
pub mod tma;
mod watchdog;

pub use device::{probe, Gpu};

use super::Backend;
use crate::error::Result;
use crate::metrics::Metrics;
use crate::moe::{MoeLayer, MoeOutput, Path, Routing};
use crate::nvfp4::{BlockStats, Flavor, Fp4Tensor};
use std::sync::Arc;

pub struct CudaBackend {
    gpu: Arc<Gpu>,
}

impl CudaBackend {
    /// Is a usable GPU there (cuda:0)? Never panics.
    pub fn probe() -> Result<()> {
        device::probe(0).map(|_| ())
    }

    pub fn open(ordinal: usize) -> Result<Self> {
        Ok(CudaBackend {
            gpu: Gpu::open(ordinal)?,
        })
    }

    /// The device, for the device-level functions of the submodules.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> String {
        self.gpu.describe()
    }

    fn route(
        &self,
        layer: &MoeLayer,
        hidden: &[f32],
        input_ids: Option<&[i64]>,
    ) -> Result<Routing> {
        router::route(&self.gpu, layer, hidden, input_ids)
    }

    fn moe_forward(
        &self,
        layer: &MoeLayer,
        hidden: &[f32],
        routing: &Routing,
        path: &Path,
        per_slot: bool,
    ) -> Result<MoeOutput> {
        moe::moe_forward(&self.gpu, layer, hidden, routing, path, per_slot)
    }

    fn quantize(
        &self,
        x: &[f32],
        rows: usize,
        cols: usize,
        gs: f32,
        flavor: Flavor,
    ) -> Result<(Fp4Tensor, BlockStats)> {
        quant::quantize_nvfp4(&self.gpu, x, rows, cols, gs, flavor)
    }

    fn compare(&self, test: &[f32], reference: &[f32]) -> Result<Metrics> {
        reduce::compare(&self.gpu, test, reference)
    }
}
