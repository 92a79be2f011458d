//! The CPU backend: the reference. f64 accumulation, the exact numerics of `nvfp4`.

use super::Backend;
use crate::error::{Error, Result};
use crate::metrics::Metrics;
use crate::moe::{MoeLayer, MoeOutput, Path, Routing};
use crate::nvfp4::{BlockStats, Flavor, Fp4Tensor};

#[derive(Default)]
pub struct CpuBackend;

impl CpuBackend {
    pub fn new() -> Self {
        CpuBackend
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> String {
        "cpu".into()
    }

    fn route(
        &self,
        layer: &MoeLayer,
        hidden: &[f32],
        input_ids: Option<&[i64]>,
    ) -> Result<Routing> {
        crate::moe::route(layer, hidden, input_ids)
    }

    fn moe_forward(
        &self,
        layer: &MoeLayer,
        hidden: &[f32],
        routing: &Routing,
        path: &Path,
        per_slot: bool,
    ) -> Result<MoeOutput> {
        crate::moe::moe_forward(layer, hidden, routing, path, per_slot)
    }

    fn quantize(
        &self,
        x: &[f32],
        rows: usize,
        cols: usize,
        gs: f32,
        flavor: Flavor,
    ) -> Result<(Fp4Tensor, BlockStats)> {
        if flavor != Flavor::Reference {
            return Err(Error::usage(
                "the cuda-fast flavor (rcp.approx.ftz) exists on the GPU only; use --device cuda",
            ));
        }
        Ok(crate::nvfp4::quantize_nvfp4(x, rows, cols, gs))
    }

    fn compare(&self, test: &[f32], reference: &[f32]) -> Result<Metrics> {
        Ok(crate::metrics::compare(test, reference))
    }
}
