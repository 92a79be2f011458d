//! Launch wrappers for kernels/moe_decode.cu: the weight-streaming grouped NVFP4 GEMMs used
//! when an expert gets few rows (decode). Same operands, outputs and numerics as the tiled
//! `mma.sync` kernels of kernels/moe.cu; which one runs is [`choose`]'s call.

use super::device::{Gpu, KArg};
use super::nvrtc::MOE_DECODE;
use crate::error::Result;
use cudarc::driver::LaunchConfig;

/// kernels/moe_decode.cu: warps per CTA, warps splitting K per tile, output rows per CTA,
/// token rows per pass, K per warp step.
const WARPS: u32 = 8;
const KSPLIT: usize = 2;
const ROWS_PER_CTA: usize = (WARPS as usize / KSPLIT) * 16;
const MAX_G: usize = 8;
const CHUNK_K: usize = 128;

/// Up to this many tokens the decode kernels run (measured on an H200 at DeepSeek-V3 dims:
/// see BENCHMARKS.md); above, the tiled kernels. An expert with more rows than a pass holds
/// (8) takes several passes over its weights, which is still right, only slower.
pub const MAX_TOKENS: usize = 64;

/// Which grouped GEMM a forward uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmKind {
    /// kernels/moe.cu: 128-row tiles, dequantized weights in shared memory.
    Tiled,
    /// kernels/moe_decode.cu with `g_rows` token rows per pass.
    Decode { g_rows: u32 },
}

/// `NVFP4DBG_MOE_GEMM=tiled` keeps every forward on the tiled kernels (to measure one against
/// the other on the same build).
fn forced_tiled() -> bool {
    static FORCED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *FORCED.get_or_init(|| std::env::var("NVFP4DBG_MOE_GEMM").is_ok_and(|v| v == "tiled"))
}

/// `NVFP4DBG_MOE_DECODE=v1` runs the first decode kernels (`*_v1`: addresses rebuilt per
/// chunk, 5 instructions per FP16 pair) instead of the lean loop, to measure one against the
/// other on the same build; both give bit-identical sums.
fn kernel_name(lean: &'static str, v1: &'static str) -> &'static str {
    static V1: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if *V1.get_or_init(|| std::env::var("NVFP4DBG_MOE_DECODE").is_ok_and(|v| v == "v1")) {
        v1
    } else {
        lean
    }
}

/// The decode kernels need NVFP4 weights (E4M3 scales), K a multiple of 128 and the output
/// widths multiples of 16, in both GEMMs of the layer.
pub fn choose(tokens: usize, wblock: u32, hidden: usize, inter: usize) -> GemmKind {
    if forced_tiled() {
        return GemmKind::Tiled;
    }
    let dims_ok = hidden.is_multiple_of(CHUNK_K)
        && inter.is_multiple_of(CHUNK_K)
        && hidden.is_multiple_of(16)
        && inter.is_multiple_of(16);
    if tokens == 0 || tokens > MAX_TOKENS || wblock != 16 || !dims_ok {
        return GemmKind::Tiled;
    }
    GemmKind::Decode {
        g_rows: tokens.min(MAX_G) as u32,
    }
}

impl GemmKind {
    /// Rows per pass of the decode GEMM with `k` columns (0 for the tiled kernels).
    pub fn rows_per_pass(self, k: usize) -> u32 {
        match self {
            GemmKind::Tiled => 0,
            GemmKind::Decode { g_rows } => rows_per_pass(g_rows as usize, k),
        }
    }
}

/// Shared memory for the activation rows of a pass, at most: two CTAs (each 8 warps of up to
/// 128 registers) share an SM, one streaming weights while the other stages its rows.
const ACT_SMEM: usize = 64 * 1024;

/// Token rows per pass of a GEMM with `k` columns: up to 8 (the MMA's N), fewer when K is long
/// (DeepSeek-V3 gate/up, K = 7168: 4; an expert with more rows takes more passes).
pub fn rows_per_pass(tokens: usize, k: usize) -> u32 {
    tokens.min(MAX_G).min((ACT_SMEM / (2 * k.max(1))).max(1)) as u32
}

fn config(nout: usize, experts: usize, g_rows: u32, k: usize, nb: usize) -> LaunchConfig {
    let red = nb * KSPLIT * (WARPS as usize / KSPLIT) * 32 * 16;
    let stage = if nb == 2 {
        (WARPS as usize / KSPLIT) * MAX_G * 16 * 4
    } else {
        0
    };
    LaunchConfig {
        grid_dim: (nout.div_ceil(ROWS_PER_CTA) as u32, experts as u32, 1),
        block_dim: (WARPS * 32, 1, 1),
        shared_mem_bytes: (g_rows as usize * k * 2 + red + stage) as u32,
    }
}

/// Device pointers of one decode GEMM (0 for the unused ones).
pub struct DecodeArgs {
    pub aq: u64,
    pub a_scales: u64,
    pub k: usize,
    pub nout: usize,
    pub experts: usize,
    pub expert_offsets: u64,
    pub g_rows: u32,
}

/// Down projection: `out[p, n] = acc * rcp(gs[e]) * ws2[e]`.
pub fn enqueue_down(
    gpu: &Gpu,
    a: &DecodeArgs,
    wq: u64,
    ws: u64,
    gs: u64,
    ws2: u64,
    out: u64,
) -> Result<()> {
    gpu.launch(
        &MOE_DECODE,
        kernel_name("moe_decode_nvfp4", "moe_decode_nvfp4_v1"),
        config(a.nout, a.experts, a.g_rows, a.k, 1),
        &[
            KArg::U64(a.aq),
            KArg::U64(a.a_scales),
            KArg::U32(a.k as u32),
            KArg::U64(wq),
            KArg::U64(ws),
            KArg::U32(a.nout as u32),
            KArg::U64(gs),
            KArg::U64(ws2),
            KArg::U64(a.expert_offsets),
            KArg::U32(a.g_rows),
            KArg::U64(out),
        ],
    )
}

/// Gate/up projection with SwiGLU and the re-quantization fused; `args` are those of
/// `moe_gemm_gate_up_nvfp4` after its weights (see kernels/moe_decode.cu).
pub fn enqueue_gate_up(gpu: &Gpu, a: &DecodeArgs, weights: [u64; 4], rest: &[KArg]) -> Result<()> {
    let mut args = vec![
        KArg::U64(a.aq),
        KArg::U64(a.a_scales),
        KArg::U32(a.k as u32),
    ];
    args.extend(weights.iter().map(|&p| KArg::U64(p)));
    args.push(KArg::U32(a.nout as u32));
    args.extend_from_slice(rest);
    gpu.launch(
        &MOE_DECODE,
        kernel_name("moe_decode_gate_up_nvfp4", "moe_decode_gate_up_nvfp4_v1"),
        config(a.nout, a.experts, a.g_rows, a.k, 2),
        &args,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_only_for_few_tokens_nvfp4_and_aligned_dims() {
        assert_eq!(choose(1, 16, 7168, 2048), GemmKind::Decode { g_rows: 1 });
        assert_eq!(choose(16, 16, 7168, 2048), GemmKind::Decode { g_rows: 8 });
        assert_eq!(
            choose(MAX_TOKENS, 16, 256, 128),
            GemmKind::Decode { g_rows: 8 }
        );
        assert_eq!(choose(MAX_TOKENS + 1, 16, 7168, 2048), GemmKind::Tiled);
        assert_eq!(choose(0, 16, 7168, 2048), GemmKind::Tiled);
        // MXFP4 (UE8M0 scales) and dims off the 128-k chunk stay on the tiled kernels
        assert_eq!(choose(4, 32, 7168, 2048), GemmKind::Tiled);
        assert_eq!(choose(4, 16, 208, 80), GemmKind::Tiled);
        assert_eq!(choose(4, 16, 7168, 2000), GemmKind::Tiled);
    }

    #[test]
    fn two_ctas_share_an_sm90() {
        // DeepSeek-V3 gate/up (K = 7168): 4 rows per pass; down (K = 2048): 8
        assert_eq!(rows_per_pass(16, 7168), 4);
        assert_eq!(rows_per_pass(16, 2048), 8);
        assert_eq!(rows_per_pass(3, 2048), 3);
        assert_eq!(rows_per_pass(8, 1 << 20), 1);
        for (k, nout, nb) in [
            (7168, 2048, 2),
            (2048, 7168, 1),
            (7168, 3072, 2),
            (3072, 7168, 1),
        ] {
            let c = config(nout, 256, rows_per_pass(64, k), k, nb);
            assert!(
                2 * c.shared_mem_bytes <= 227 * 1024,
                "{k}: {}",
                c.shared_mem_bytes
            );
        }
        assert_eq!(config(2048, 256, 4, 7168, 2).grid_dim, (32, 256, 1));
    }
}
