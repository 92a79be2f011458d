//! The CPU backend: the reference. f64 accumulation, the exact numerics of `nvfp4`.

use super::Backend;
use crate::error::{Error, Result};
use crate::metrics::Metrics;
use crate::moe::{MoeLayer, MoeOutput, Path, Routing};
use crate::nvfp4::{BlockStats, Flavor, Fp4Tensor};

/// Host bytes of MoE layer `c` as loaded (a lower bound): the experts' E2M1 codes and block
/// scales, their BF16 originals as f32 when the checkpoint ships them (`originals`), the shared
/// experts and the router in f32. The CPU forward decodes weight rows as it goes: no dense copy.
pub fn layer_host_bytes(c: &crate::moe::MoeConfig, originals: bool) -> u64 {
    let (h, i, e) = (
        c.hidden_size as u64,
        c.moe_intermediate_size as u64,
        c.n_routed_experts as u64,
    );
    let shared = (c.n_shared_experts * c.moe_intermediate_size) as u64;
    let per_expert = 3 * i * h;
    // codes, and 1-byte scales of 32-blocks at the least (MXFP4; NVFP4's 16-blocks hold twice)
    let mut b = e * (per_expert / 2 + per_expert / 32) + 3 * shared * h * 4 + e * h * 4;
    if originals {
        b += e * per_expert * 4;
    }
    b
}

/// Host bytes a CPU forward of `tokens` tokens needs beyond the weights (a lower bound): the
/// input and both paths' outputs, one path's expert outputs, and with `per_slot` both paths'
/// per-slot outputs kept for the per-expert table.
pub fn forward_host_bytes(c: &crate::moe::MoeConfig, tokens: usize, per_slot: bool) -> u64 {
    let h = c.hidden_size as u64;
    let t = tokens as u64;
    let n = t * c.num_experts_per_tok as u64;
    3 * t * h * 4 + n * h * 4 + if per_slot { 2 * n * h * 4 } else { 0 }
}

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::moe::synthetic::Preset;

    #[test]
    fn a_layer_on_the_cpu_needs_its_codes_not_a_dense_copy() {
        // layertest refused a DeepSeek-V3 layer on a 24 GB machine: it held the CPU to the
        // GPU's budget (22.7 GB, the reference's BF16 copy of every expert), where the CPU
        // decodes weight rows as it goes and holds ~6.3 GB; and it let BF16 originals (45 GB
        // as f32) through
        let dsv3 = Preset::Dsv3.config();
        let tokens = 1 + rand::random::<u32>() as usize % 4096;
        let (h, i, e) = (7168u64, 2048u64, 256u64);
        let codes = 3 * e * i * h / 2;
        let weights = layer_host_bytes(&dsv3, false);
        assert!(weights >= codes && weights < codes * 5 / 4, "{weights}");
        assert_eq!(layer_host_bytes(&dsv3, true) - weights, 3 * e * i * h * 4);
        let per =
            forward_host_bytes(&dsv3, tokens + 1, true) - forward_host_bytes(&dsv3, tokens, true);
        // the input and two outputs, one path's expert outputs and both paths' per-slot ones
        assert_eq!(per, (3 + 3 * 8) * h * 4, "tokens {tokens}");
        assert!(forward_host_bytes(&dsv3, 64, true) < 1 << 30);
    }
}
