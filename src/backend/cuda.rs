//! CUDA backend (placeholder until the kernels land): probing reports no GPU cleanly.

use super::Backend;
use crate::error::{Error, Result};
use crate::metrics::Metrics;
use crate::moe::{MoeLayer, MoeOutput, Path, Routing};
use crate::nvfp4::{BlockStats, Flavor, Fp4Tensor};

pub struct CudaBackend;

impl CudaBackend {
    /// Is a usable GPU there? Never panics.
    pub fn probe() -> Result<()> {
        Err(Error::NoGpu("the CUDA backend is not built yet".into()))
    }
    pub fn open(_ordinal: usize) -> Result<Self> {
        Self::probe().map(|_| CudaBackend)
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> String {
        "cuda".into()
    }
    fn route(&self, _: &MoeLayer, _: &[f32], _: Option<&[i64]>) -> Result<Routing> {
        unreachable!("CudaBackend cannot be opened yet")
    }
    fn moe_forward(
        &self,
        _: &MoeLayer,
        _: &[f32],
        _: &Routing,
        _: &Path,
        _: bool,
    ) -> Result<MoeOutput> {
        unreachable!("CudaBackend cannot be opened yet")
    }
    fn quantize(
        &self,
        _: &[f32],
        _: usize,
        _: usize,
        _: f32,
        _: Flavor,
    ) -> Result<(Fp4Tensor, BlockStats)> {
        unreachable!("CudaBackend cannot be opened yet")
    }
    fn compare(&self, _: &[f32], _: &[f32]) -> Result<Metrics> {
        unreachable!("CudaBackend cannot be opened yet")
    }
}
