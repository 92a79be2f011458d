//! Launch wrappers for kernels/moe_decode.cu: the weight-streaming grouped NVFP4 GEMMs used
//! when an expert gets few rows (decode). Same operands, outputs and numerics as the tiled
//! `mma.sync` kernels of kernels/moe.cu; which one runs is [`choose`]'s call.

use super::device::{grid_1d, Gpu, KArg};
use super::nvrtc::MOE_DECODE;
use crate::error::Result;
use cudarc::driver::{CudaSlice, LaunchConfig};

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

/// Where the decode kernels read the expert weights from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodeLayout {
    /// [`DecodeTiles`]: a copy made at upload in which each warp's 16 weight rows are one
    /// contiguous stream (the default).
    Tiles,
    /// The checkpoint's row-major codes and scales: a warp's K-chunk is 64 bytes of each of
    /// 16 rows, `K / 2` bytes apart (`NVFP4DBG_MOE_DECODE=rows`, to measure one against the
    /// other on the same build; both give bit-identical sums).
    Rows,
}

impl DecodeLayout {
    /// `NVFP4DBG_MOE_DECODE=rows` or the default.
    pub fn from_env() -> DecodeLayout {
        static ROWS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        if *ROWS.get_or_init(|| std::env::var("NVFP4DBG_MOE_DECODE").is_ok_and(|v| v == "rows")) {
            DecodeLayout::Rows
        } else {
            DecodeLayout::Tiles
        }
    }
}

/// The experts' NVFP4 weights in decode tiles (kernels/moe_decode.cu, `decode_tiles`): per
/// matrix, each 16-row tile holds its K-chunks of 128 one after the other, a chunk the 16 rows'
/// 64 code bytes (or 8 scale bytes) row after row. Same bytes as the row-major buffers, moved.
pub struct DecodeTiles {
    pub w1q: CudaSlice<u8>,
    pub w1s: CudaSlice<u8>,
    pub w3q: CudaSlice<u8>,
    pub w3s: CudaSlice<u8>,
    pub w2q: CudaSlice<u8>,
    pub w2s: CudaSlice<u8>,
}

/// Row-major weights of one projection: codes, scales, rows (all experts) and K.
pub struct RowMajor<'a> {
    pub codes: &'a CudaSlice<u8>,
    pub scales: &'a CudaSlice<u8>,
    pub rows: usize,
    pub k: usize,
}

impl DecodeTiles {
    /// Tile the gate (w1), up (w3) and down (w2) projections of every expert on the GPU.
    pub fn build(gpu: &Gpu, w1: RowMajor, w3: RowMajor, w2: RowMajor) -> Result<Self> {
        let (w1q, w1s) = tile(gpu, &w1, "gate_proj")?;
        let (w3q, w3s) = tile(gpu, &w3, "up_proj")?;
        let (w2q, w2s) = tile(gpu, &w2, "down_proj")?;
        Ok(DecodeTiles {
            w1q,
            w1s,
            w3q,
            w3s,
            w2q,
            w2s,
        })
    }
}

fn tile(gpu: &Gpu, m: &RowMajor, what: &str) -> Result<(CudaSlice<u8>, CudaSlice<u8>)> {
    let mut out = Vec::with_capacity(2);
    for (src, row_bytes, piece, part) in [
        (m.codes, m.k / 2, CHUNK_K / 2, "codes"),
        (m.scales, m.k / 16, CHUNK_K / 16, "scales"),
    ] {
        let what = format!("expert {what} {part} in decode tiles");
        let dst = gpu.alloc::<u8>(m.rows * row_bytes, &what)?;
        let n = (m.rows * row_bytes / 8) as u64;
        gpu.launch(
            &MOE_DECODE,
            "decode_tiles",
            grid_1d(n, 256)?,
            &[
                KArg::U64(gpu.ptr(src)),
                KArg::U64(m.rows as u64),
                KArg::U32(row_bytes as u32),
                KArg::U32(piece as u32),
                KArg::U64(gpu.ptr(&dst)),
            ],
        )?;
        out.push(dst);
    }
    let s = out.pop().expect("two parts");
    let q = out.pop().expect("two parts");
    Ok((q, s))
}

fn kernel_name(layout: DecodeLayout, tiles: &'static str, rows: &'static str) -> &'static str {
    match layout {
        DecodeLayout::Tiles => tiles,
        DecodeLayout::Rows => rows,
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

fn config(nout: usize, slots: usize, g_rows: u32, k: usize, nb: usize) -> LaunchConfig {
    let red = nb * KSPLIT * (WARPS as usize / KSPLIT) * 32 * 16;
    let stage = if nb == 2 {
        (WARPS as usize / KSPLIT) * MAX_G * 16 * 4
    } else {
        0
    };
    LaunchConfig {
        grid_dim: (nout.div_ceil(ROWS_PER_CTA) as u32, slots as u32, 1),
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
    /// Grid rows: at most min(experts, rows), one per expert with rows.
    pub slots: usize,
    pub expert_offsets: u64,
    /// `[1 + experts]`: the number of experts with rows, then those experts (moe_offsets).
    pub active: u64,
    pub g_rows: u32,
    /// Which layout the weight pointers given with these arguments are in.
    pub layout: DecodeLayout,
}

/// Down projection: `out[p, n] = acc * rcp(gs[e]) * ws2[e]`. Launched early
/// ([`Gpu::launch_early`]): its CTAs start streaming their weights while the kernel before it
/// (the gate/up GEMM, or the dynamic mode's quantize) finishes.
pub fn enqueue_down(
    gpu: &Gpu,
    a: &DecodeArgs,
    wq: u64,
    ws: u64,
    gs: u64,
    ws2: u64,
    out: u64,
) -> Result<()> {
    gpu.launch_early(
        &MOE_DECODE,
        kernel_name(a.layout, "moe_decode_nvfp4", "moe_decode_nvfp4_rows"),
        config(a.nout, a.slots, a.g_rows, a.k, 1),
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
            KArg::U64(a.active),
            KArg::U32(a.g_rows),
            KArg::U64(out),
        ],
    )
}

/// Gate/up projection with SwiGLU and the re-quantization fused; `rest` are the kernel's
/// arguments after `nout` (kernels/moe_decode.cu, `DEC_GATE_UP_PARAMS`).
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
        kernel_name(
            a.layout,
            "moe_decode_gate_up_nvfp4",
            "moe_decode_gate_up_nvfp4_rows",
        ),
        config(a.nout, a.slots, a.g_rows, a.k, 2),
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
