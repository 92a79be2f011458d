//! NVFP4 / MXFP4 numerics, exact to the bit (DESIGN.md §2). Never prints, never touches the CLI.

pub mod e2m1;
pub mod e4m3;
pub mod global_scale;
pub mod layout;
pub mod quant;
pub mod ue8m0;

pub use global_scale::ScaleProblem;
pub use layout::{LayoutGuess, ScaleLayout};
pub use quant::{
    dequantize_row, fake_quant_nvfp4, max_finite_out_scale_gs, out_scale_finite, quantize_mxfp4,
    quantize_nvfp4, quantize_weight_nvfp4, rcp, weight_global_scale, BlockStats, Format, Fp4Tensor,
    DEFAULT_GS, GS_DENOM,
};

/// Which reciprocal the quantizer uses. The CPU computes `Reference` only; the GPU computes
/// both, `CudaFast` being what vLLM / TRT-LLM kernels do (`rcp.approx.ftz`), which flips a
/// few codes at rounding ties.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Flavor {
    Reference,
    CudaFast,
}
