//! The MoE block on the GPU (docs/moe-forward.md): the NVFP4 path through kernels/moe.cu
//! and the BF16 reference through cuBLAS, with the same sort and combine kernels.
//!
//! A forward is prepared once ([`Nvfp4Forward::new`]: weights streamed to the GPU, every
//! buffer allocated), then [`Nvfp4Forward::enqueue`] only launches work on the one stream:
//! no allocation, no host sync. That is what makes [`Nvfp4Forward::capture`] (a CUDA graph of
//! the whole layer, for `layertest --cuda-graph`) possible.

use super::blas;
use super::device::{grid_1d, Gpu, KArg};
use super::moe_decode::{self, DecodeArgs, DecodeLayout, DecodeTiles, GemmKind, RowMajor};
use super::nvrtc::{KernelModule, MOE, MOE_GEMM_SM90, QUANT};
use super::quant::{flavor_code, stats_from};
use super::router::{self, DevRouter, RouteBufs};
use super::tma;
use crate::error::{Error, Result};
use crate::moe::{ActScales, DenseMlp, MoeLayer, MoeOutput, Path, Routing};
use crate::nvfp4::layout::ScaleLayout;
use crate::nvfp4::{BlockStats, Flavor, Format};
use cudarc::driver::{sys as drv_sys, CudaGraph, CudaSlice, LaunchConfig};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Tile sizes of kernels/moe.cu: BM rows per tile; output columns per tile of the plain GEMM
/// (down projection) and of the fused gate/up GEMM (per matrix).
const BM: usize = 128;
const PLAIN_BN: usize = 128;
const FUSED_BN: usize = 64;
const SORT_CHUNK: usize = 256;
/// kernels/moe_gemm_sm90.cu: K slice, output columns per tile (plain; fused per matrix),
/// dynamic shared memory (H_SMEM_BYTES).
const SM90_BK: usize = 64;
const SM90_BN: usize = 256;
const SM90_FUSED_BN: usize = 128;
const SM90_STAGES: u32 = 4;
const SM90_SMEM_BYTES: u32 = 98_304 + SM90_STAGES * 13_824 + 1024;
/// The register-A kernels (kernels/moe_gemm_sm90.cu `..._sm90rs`): K chunk (the decode
/// tiles' chunk), the rows an expert's last tile may take past BM (R_SLACK), warpgroups per
/// CTA (RS_WG) and token stages of BM + slack rows x 128 K in BF16 (R_STAGES, by warpgroups),
/// the gate/up epilogue's f32 tile over them (BM + slack rows of R_EPI_ROW floats, by
/// warpgroups), their shared memory (R_SMEM_BYTES: the larger of the two, the ring's barriers,
/// 1024 to align the base) and the rows of the small TMA box (R_BOX_ROWS; the big one is BM
/// rows).
const SM90_RS_BK: usize = 128;
const SM90_RS_SLACK: usize = 32;
const SM90_RS_WG: u32 = 2;
/// R_STAGES for RS_WG warpgroups.
const fn sm90_rs_stages_for(wg: u32) -> u32 {
    if wg == 2 {
        3
    } else {
        2
    }
}
/// R_EPI_ROW for RS_WG warpgroups: g and u of the CTA's 64 outputs per warpgroup, + 4.
const fn sm90_rs_epi_row_for(wg: u32) -> usize {
    2 * 64 * wg as usize + 4
}
const SM90_RS_SMEM_BYTES: u32 = sm90_rs_smem_for(sm90_rs_stages_for(SM90_RS_WG), SM90_RS_WG);
/// R_SMEM_BYTES for a ring of `stages` and `wg` warpgroups: the larger of the ring and the
/// epilogue's tile, two barriers a stage, 1024 to align the base.
const fn sm90_rs_smem_for(stages: u32, wg: u32) -> u32 {
    let ring = stages * ((BM + SM90_RS_SLACK) * SM90_RS_BK * 2) as u32;
    let epi = ((BM + SM90_RS_SLACK) * sm90_rs_epi_row_for(wg) * 4) as u32;
    (if ring > epi { ring } else { epi }) + 2 * stages * 8 + 1024
}
const SM90_RS_BOX_ROWS: u32 = 32;
const _: () = assert!(
    SM90_RS_SMEM_BYTES <= 227 * 1024,
    "more shared memory than a Hopper block gets"
);
const _: () = assert!(
    2 * (sm90_rs_smem_for(sm90_rs_stages_for(1), 1) + 1024) <= 228 * 1024,
    "two one-warpgroup CTAs do not fit an SM's shared memory"
);
const _: () = assert!(
    SM90_SMEM_BYTES <= 227 * 1024,
    "more shared memory than a Hopper block gets"
);

#[cfg(test)]
mod sm90_tests {
    /// The launch's shared memory is the kernel's H_SMEM_BYTES: same stage count.
    #[test]
    fn stage_count_matches_the_kernel() {
        let src = include_str!("../../../kernels/moe_gemm_sm90.cu");
        let line = format!("#define H_STAGES {}", super::SM90_STAGES);
        let wg = super::SM90_RS_WG;
        let stages = [2, 1].map(super::sm90_rs_stages_for);
        assert!(
            src.contains(&format!(
                "#if RS_WG == 2\n#define R_STAGES {}\n#else\n#define R_STAGES {}\n#endif",
                stages[0], stages[1]
            )),
            "R_STAGES differs from sm90_rs_stages_for"
        );
        assert!(src.contains(&format!("#define RS_WG {wg}")));
        assert!(src.contains("#define R_EPI_ROW (2 * R_GU_BN + 4)"));
        assert!(src.contains("#define R_GU_BN (RS_WG * 64)"));
        assert_eq!(super::sm90_rs_epi_row_for(2), 260);
        assert!(src.contains(&format!("#define R_BK {}", super::SM90_RS_BK)));
        assert!(src.contains(&format!("#define R_SLACK {}", super::SM90_RS_SLACK)));
        assert!(src.contains(&format!("#define R_BOX_ROWS {}", super::SM90_RS_BOX_ROWS)));
        assert!(
            src.lines().any(|l| l.trim() == line),
            "{line} not in moe_gemm_sm90.cu"
        );
    }
}

/// The wgmma kernels' last argument: 0, or (timing splits only, wrong outputs)
/// `NVFP4DBG_SM90_SPLIT`, a sum of 1 (leave the MMAs out), 2 (the dequantization), 4 (the
/// global loads): what `nvfp4dbg bench` then times splits the kernel's time by stage.
fn sm90_split_arg(module: &KernelModule) -> Option<KArg> {
    std::ptr::eq(module, &MOE_GEMM_SM90).then(|| {
        KArg::U32(
            std::env::var("NVFP4DBG_SM90_SPLIT")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(0),
        )
    })
}

/// The grouped GEMM kernels of the NVFP4 forward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefillGemm {
    /// Warpgroup MMA where it applies (sm_90a, NVFP4 experts, K a multiple of 64): the
    /// register-A kernels where H and I are multiples of 128 (unless `NVFP4DBG_SM90=v1`),
    /// else the shared-memory ones; mma.sync elsewhere.
    Auto,
    /// The mma.sync kernels of kernels/moe.cu (every arch).
    MmaSync,
    /// The warpgroup-MMA kernels with both operands in shared memory (sm_90a only).
    Wgmma,
    /// The warpgroup-MMA kernels with the weights as the register A operand, read from the
    /// decode tiles (sm_90a; H and I multiples of 128).
    WgmmaRs,
}

/// `NVFP4DBG_SHARED_STREAM=0`: the shared expert after the routed ones, on the one stream.
fn shared_beside_default() -> bool {
    !std::env::var("NVFP4DBG_SHARED_STREAM").is_ok_and(|v| v == "0")
}

/// Where the expert inputs are scattered token by token and the register-A gate/up runs, how
/// its 16-bit token rows are made. The same rows, so the same outputs, every way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RsRows {
    /// Straight from the layer input (`nvfp4_rows_scatter_*`), read from its BF16 copy where
    /// that holds the same values (half the bytes), else in f32.
    Auto,
    /// Straight from the f32 layer input.
    F32,
    /// Through the NVFP4 codes in memory, then `moe_rows_bf16_rs` (before session 27).
    Codes,
}

impl RsRows {
    /// `NVFP4DBG_RS_ROWS=f32` or `=codes`, otherwise [`RsRows::Auto`] (A/B runs of the bench).
    fn from_env() -> Self {
        match std::env::var("NVFP4DBG_RS_ROWS").as_deref() {
            Ok("f32") => RsRows::F32,
            Ok("codes") => RsRows::Codes,
            _ => RsRows::Auto,
        }
    }
}

/// Where the register-A down GEMM's 16-bit token rows are made. The same rows, so the same
/// outputs, either way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DownRows {
    /// By the register-A gate/up's epilogue from the blocks it quantizes, where gs2 is fixed
    /// (else as [`DownRows::Prepass`]).
    Auto,
    /// By `moe_rows_bf16_rs` from the NVFP4 codes in memory (before session 28).
    Prepass,
}

impl DownRows {
    /// `NVFP4DBG_DOWN_ROWS=prepass`, otherwise [`DownRows::Auto`] (A/B runs of the bench).
    fn from_env() -> Self {
        match std::env::var("NVFP4DBG_DOWN_ROWS").as_deref() {
            Ok("prepass") => DownRows::Prepass,
            _ => DownRows::Auto,
        }
    }
}

/// How the prologue quantizes the expert inputs (the same codes, scales and statistics).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InputQuantize {
    /// Token by token (`nvfp4_quantize_f32_scatter_*`): each hidden row read once and written
    /// to its k sorted rows.
    Scatter,
    /// Sorted row by sorted row through a row gather: each hidden row read k times.
    Gather,
    /// Scatter from [`SCATTER_FROM_BYTES`] of hidden states on, else gather.
    Auto,
}

/// The hidden-state size (f32) from which [`InputQuantize::Auto`] scatters: 16 MiB, 585
/// DeepSeek-V3 tokens.
pub const SCATTER_FROM_BYTES: usize = 16 << 20;

impl InputQuantize {
    /// `NVFP4DBG_QUANT_SCATTER=0` gathers, `=1` scatters, otherwise [`InputQuantize::Auto`].
    fn from_env() -> Self {
        match std::env::var("NVFP4DBG_QUANT_SCATTER").as_deref() {
            Ok("0") => InputQuantize::Gather,
            Ok("1") => InputQuantize::Scatter,
            _ => InputQuantize::Auto,
        }
    }
}

/// `NVFP4DBG_SM90=v1`: Auto keeps the first wgmma kernels (A/B runs of the bench).
fn sm90_rs_disabled() -> bool {
    std::env::var("NVFP4DBG_SM90").is_ok_and(|v| v == "v1")
}

/// The rows an expert's last register-A tile may take past BM: `SM90_RS_SLACK`, or 0 with
/// `NVFP4DBG_RS_SLACK=0` (A/B runs of the bench: every tile at most BM rows, as before the
/// wide tiles).
fn sm90_rs_slack() -> u32 {
    if std::env::var("NVFP4DBG_RS_SLACK").is_ok_and(|v| v == "0") {
        0
    } else {
        SM90_RS_SLACK as u32
    }
}

/// Warpgroups per register-A CTA: SM90_RS_WG, or `-DRS_WG=1` in NVFP4DBG_NVRTC_DEFINES (an A/B:
/// 128-thread CTAs of half the weight rows, two per SM).
fn sm90_rs_wg() -> u32 {
    super::nvrtc::tuning_define("RS_WG").map_or(SM90_RS_WG, |n| n as u32)
}

/// The register-A kernels' shared memory: SM90_RS_SMEM_BYTES, or what `-DR_STAGES=N` and
/// `-DRS_WG=N` in NVFP4DBG_NVRTC_DEFINES (A/Bs) ask for.
fn sm90_rs_smem_bytes() -> u32 {
    let wg = sm90_rs_wg();
    let stages =
        super::nvrtc::tuning_define("R_STAGES").map_or(sm90_rs_stages_for(wg), |n| n as u32);
    sm90_rs_smem_for(stages, wg)
}

/// Can the register-A kernels run this layer: sm_90a, NVFP4 16-blocks, H and I multiples of
/// 128 (the decode tiles' chunk; their 16-row tiles then never span two experts).
fn sm90_rs_fits(arch: &str, wblock: usize, c: &crate::moe::MoeConfig) -> bool {
    arch == "sm_90a"
        && wblock == 16
        && [c.hidden_size, c.moe_intermediate_size]
            .iter()
            .all(|&k| k > 0 && k.is_multiple_of(SM90_RS_BK))
}

/// The register-A kernels' tokens: the expert inputs dequantized exactly to 16-bit floats
/// (FP16 by default, BF16 with `-DRS_F16=0`) in the kernels' K order, `[N, H]` for the gate/up
/// (`nvfp4_rows_scatter_*` or `moe_rows_bf16_rs`) and `[N, I]` for the down (`moe_rows_bf16_rs`),
/// and the TMA tensor maps that read them; a tile copy moves bits, so the maps' BF16 element
/// type serves both. Two buffers, so that each stage finds its own input again when it is
/// repeated alone (the bench's GEMM figures): the gate/up's rows come from the prologue.
struct RsTokens {
    gate_up: CudaSlice<u16>,
    down: CudaSlice<u16>,
    /// four tensor maps of 16 words: gate/up in boxes of BM rows and of SM90_RS_BOX_ROWS
    /// rows, then down in the same two
    maps: CudaSlice<u64>,
    /// The same per expert, each ending at the expert's last row (the sort's scatter writes
    /// them: kernels/moe.cu `rs_expert_maps`): the gate/up's E pairs, then the down's. None with
    /// `NVFP4DBG_RS_EXPERT_MAPS=0` (the kernels then read the four above).
    expert_maps: Option<CudaSlice<u64>>,
}

impl RsTokens {
    fn new(gpu: &Gpu, n: usize, h: usize, i: usize, experts: usize) -> Result<Self> {
        let rows = n.max(1);
        let what = "the 16-bit expert inputs (register-A prefill)";
        let (gate_up, down) = (
            gpu.alloc::<u16>(rows * h, what)?,
            gpu.alloc::<u16>(rows * i, what)?,
        );
        // per GEMM (gate/up K = H, then down K = I): boxes of BM rows, then of SM90_RS_BOX_ROWS
        let mut maps = Vec::with_capacity(4 * 16);
        for (buf, k) in [(&gate_up, h), (&down, i)] {
            for box_rows in [BM as u32, SM90_RS_BOX_ROWS] {
                maps.extend(tma::bf16_rows_swizzle128(gpu.ptr(buf), rows, k, box_rows)?);
            }
        }
        let per_expert = !std::env::var("NVFP4DBG_RS_EXPERT_MAPS").is_ok_and(|v| v == "0");
        Ok(RsTokens {
            gate_up,
            down,
            maps: gpu.upload(&maps, "TMA tensor maps")?,
            expert_maps: match per_expert {
                true => Some(gpu.alloc::<u64>(4 * experts * 16, "per-expert TMA tensor maps")?),
                false => None,
            },
        })
    }

    /// The tensor maps a register-A GEMM reads its tokens through (device address) and their
    /// stride per expert (0: one pair for all).
    fn maps_of(&self, gpu: &Gpu, down: bool, experts: usize) -> (u64, u32) {
        const PAIR: usize = 2 * 128; // two tensor maps of 128 bytes
        match &self.expert_maps {
            Some(m) => (
                gpu.ptr(m) + if down { (experts * PAIR) as u64 } else { 0 },
                PAIR as u32,
            ),
            None => (gpu.ptr(&self.maps) + if down { PAIR as u64 } else { 0 }, 0),
        }
    }
}

/// Which kernel a prefill GEMM launches.
enum PrefillLaunch {
    /// The kernels of kernels/moe.cu or the shared-memory wgmma ones: the same arguments.
    Plain(&'static KernelModule, &'static str, LaunchConfig),
    /// A register-A kernel: its tokens come from the prologue's `nvfp4_rows_scatter_*` or
    /// through `moe_rows_bf16_rs` first.
    Rs(&'static str, LaunchConfig),
}

impl PrefillLaunch {
    /// The row tiles the kernel walks: the tile offsets that it searches, or (the register-A
    /// kernels, whose last tile of an expert is wide) moe_offsets' table of them.
    fn tile_args(&self, gpu: &Gpu, ws: &Workspace, experts: usize) -> Vec<KArg> {
        match self {
            PrefillLaunch::Plain(..) => vec![
                KArg::U64(gpu.ptr(&ws.tile_offsets)),
                KArg::U64(gpu.ptr(&ws.expert_offsets)),
                KArg::U32(experts as u32),
            ],
            PrefillLaunch::Rs(..) => vec![KArg::U64(gpu.ptr(&ws.wide_tiles))],
        }
    }
}

/// An upper bound on the row tiles of `n` sorted rows over `e` experts (each expert's tiles
/// are BM rows but its last): the grouped GEMMs' grid (blocks past the real count exit).
fn row_tile_bound(n: usize, e: usize) -> usize {
    (n.div_ceil(BM) + e.min(n)).max(1)
}

const GEMM_THREADS: u32 = 256;
/// `moe_offsets`' block (one block: the chunk counts' sums and the experts' prefix sums).
const OFFSETS_THREADS: u32 = 1024;
const ELEM_THREADS: u32 = 256;
/// Columns a thread of `moe_combine` and `gather_rows_bf16` takes (kernels/moe.cu
/// `cols_per_thread`, the same rule): 4 where the row width allows, else 1.
fn cols_per_thread(cols: usize) -> usize {
    if cols.is_multiple_of(4) {
        4
    } else {
        1
    }
}

/// `moe_rows_bf16_rs`'s block: its shared memory holds ROWS_RS_THREADS / 32 warps' slices.
const ROWS_RS_THREADS: u32 = 256;

fn bf16_bits(v: &[f32]) -> Vec<u16> {
    v.iter()
        .map(|x| half::bf16::from_f32(*x).to_bits())
        .collect()
}

/// Shapes and formats the GPU path relies on; a bad layer is bad input, never a panic.
/// Returns the experts' weight format (the kernels take one per layer).
pub(crate) fn check_layer(layer: &MoeLayer) -> Result<Format> {
    layer.validate()?;
    router::check_router(layer)?;
    let format = layer
        .experts
        .first()
        .map_or(Format::Nvfp4, |x| x.w1.weight.format);
    for (x, ex) in layer.experts.iter().enumerate() {
        for (name, q) in [
            ("gate_proj (w1)", &ex.w1),
            ("up_proj (w3)", &ex.w3),
            ("down_proj (w2)", &ex.w2),
        ] {
            if q.weight.format != format {
                return Err(Error::usage(format!(
                    "MoE layer {}: expert {x} {name} is {}, expert 0 is {}",
                    layer.index,
                    q.weight.format.name(),
                    format.name()
                )));
            }
        }
    }
    Ok(format)
}

use crate::moe::forward::check_routing;

/// A BF16 MLP on the GPU (shared experts).
struct DevDense {
    inter: usize,
    w1: CudaSlice<u16>,
    w3: CudaSlice<u16>,
    w2: CudaSlice<u16>,
}

impl DevDense {
    fn upload(gpu: &Gpu, m: &DenseMlp) -> Result<Self> {
        Ok(DevDense {
            inter: m.intermediate,
            w1: gpu.upload(&bf16_bits(&m.w1), "shared expert gate_proj")?,
            w3: gpu.upload(&bf16_bits(&m.w3), "shared expert up_proj")?,
            w2: gpu.upload(&bf16_bits(&m.w2), "shared expert down_proj")?,
        })
    }
}

/// NVFP4 expert weights of a layer, all experts concatenated: `[E][out][in/2]` codes,
/// `[E][out][in/block]` scales, `weight_scale_2` per expert.
struct DevExperts {
    wblock: u32,
    w1q: CudaSlice<u8>,
    w1s: CudaSlice<u8>,
    w3q: CudaSlice<u8>,
    w3s: CudaSlice<u8>,
    w2q: CudaSlice<u8>,
    w2s: CudaSlice<u8>,
    ws2_1: CudaSlice<f32>,
    ws2_3: CudaSlice<f32>,
    ws2_2: CudaSlice<f32>,
    /// The same weights in decode tiles, for forwards that take the decode GEMMs.
    tiles: Option<DecodeTiles>,
}

impl DevExperts {
    fn upload(gpu: &Gpu, layer: &MoeLayer, format: Format) -> Result<Self> {
        let c = &layer.config;
        let (h, i, e) = (c.hidden_size, c.moe_intermediate_size, c.n_routed_experts);
        let block = format.block();
        // one projection of every expert, `out` rows of `inn` values each; one expert at a
        // time: the host never holds a second copy of the layer
        let upload = |name: &str, w: fn(&crate::moe::Expert) -> &crate::moe::QLinear, out, inn| {
            let (codes, scales) = (
                format!("expert {name} codes"),
                format!("expert {name} scales"),
            );
            let (nq, ns) = (out * inn / 2, out * (inn / block));
            let mut q = gpu.alloc::<u8>(e * nq, &codes)?;
            let mut s = gpu.alloc::<u8>(e * ns, &scales)?;
            for (x, ex) in layer.experts.iter().enumerate() {
                gpu.upload_into(&w(ex).weight.packed, &mut q, x * nq, &codes)?;
                gpu.upload_into(&w(ex).weight.scales, &mut s, x * ns, &scales)?;
            }
            Ok::<_, Error>((q, s))
        };
        let (w1q, w1s) = upload("gate_proj", |x| &x.w1, i, h)?;
        let (w3q, w3s) = upload("up_proj", |x| &x.w3, i, h)?;
        let (w2q, w2s) = upload("down_proj", |x| &x.w2, h, i)?;
        let ws2 = |f: &dyn Fn(&crate::moe::Expert) -> f32| {
            layer.experts.iter().map(f).collect::<Vec<f32>>()
        };
        Ok(DevExperts {
            wblock: block as u32,
            w1q,
            w1s,
            w3q,
            w3s,
            w2q,
            w2s,
            ws2_1: gpu.upload(&ws2(&|x| x.w1.weight_scale_2()), "gate_proj weight_scale_2")?,
            ws2_3: gpu.upload(&ws2(&|x| x.w3.weight_scale_2()), "up_proj weight_scale_2")?,
            ws2_2: gpu.upload(&ws2(&|x| x.w2.weight_scale_2()), "down_proj weight_scale_2")?,
            tiles: None,
        })
    }

    /// Copy the weights into decode tiles (kernels/moe_decode.cu `decode_tiles`).
    fn add_decode_tiles(&mut self, gpu: &Gpu, c: &crate::moe::MoeConfig) -> Result<()> {
        let (h, i, e) = (c.hidden_size, c.moe_intermediate_size, c.n_routed_experts);
        let m = |codes, scales, rows, k| RowMajor {
            codes,
            scales,
            rows,
            k,
        };
        self.tiles = Some(DecodeTiles::build(
            gpu,
            m(&self.w1q, &self.w1s, e * i, h),
            m(&self.w3q, &self.w3s, e * i, h),
            m(&self.w2q, &self.w2s, e * h, i),
        )?);
        Ok(())
    }

    /// The decode GEMMs' weight pointers w1q, w1s, w3q, w3s, w2q, w2s in `want`'s layout
    /// (rows when there are no tiles).
    fn decode_weights(&self, gpu: &Gpu, want: DecodeLayout) -> (DecodeLayout, [u64; 6]) {
        let p = |s: &CudaSlice<u8>| gpu.ptr(s);
        match (&self.tiles, want) {
            (Some(t), DecodeLayout::Tiles) => (
                DecodeLayout::Tiles,
                [
                    p(&t.w1q),
                    p(&t.w1s),
                    p(&t.w3q),
                    p(&t.w3s),
                    p(&t.w2q),
                    p(&t.w2s),
                ],
            ),
            _ => (
                DecodeLayout::Rows,
                [
                    p(&self.w1q),
                    p(&self.w1s),
                    p(&self.w3q),
                    p(&self.w3s),
                    p(&self.w2q),
                    p(&self.w2s),
                ],
            ),
        }
    }
}

/// The reference weights of a layer in BF16: `bf16(original)` or `bf16(dequantize(w))`.
struct DevRefExperts {
    w1: CudaSlice<u16>,
    w3: CudaSlice<u16>,
    w2: CudaSlice<u16>,
}

impl DevRefExperts {
    fn upload(gpu: &Gpu, layer: &MoeLayer) -> Result<Self> {
        let c = &layer.config;
        let (h, i, e) = (c.hidden_size, c.moe_intermediate_size, c.n_routed_experts);
        let mut w1 = gpu.alloc::<u16>(e * i * h, "reference gate_proj")?;
        let mut w3 = gpu.alloc::<u16>(e * i * h, "reference up_proj")?;
        let mut w2 = gpu.alloc::<u16>(e * h * i, "reference down_proj")?;
        for (x, ex) in layer.experts.iter().enumerate() {
            gpu.upload_into(
                &bf16_bits(&ex.w1.reference_weight()),
                &mut w1,
                x * i * h,
                "reference gate_proj",
            )?;
            gpu.upload_into(
                &bf16_bits(&ex.w3.reference_weight()),
                &mut w3,
                x * i * h,
                "reference up_proj",
            )?;
            gpu.upload_into(
                &bf16_bits(&ex.w2.reference_weight()),
                &mut w2,
                x * h * i,
                "reference down_proj",
            )?;
        }
        Ok(DevRefExperts { w1, w3, w2 })
    }
}

/// Which weights a forward needs on the GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Want {
    Nvfp4,
    Reference,
}

/// A layer on the GPU.
pub struct DevLayer {
    gpu: Arc<Gpu>,
    index: usize,
    config: crate::moe::MoeConfig,
    router: DevRouter,
    nvfp4: Option<DevExperts>,
    reference: Option<DevRefExperts>,
    shared: Option<DevDense>,
}

impl DevLayer {
    fn upload(gpu: &Arc<Gpu>, layer: &MoeLayer, want: Want) -> Result<Self> {
        let format = check_layer(layer)?;
        Ok(DevLayer {
            gpu: gpu.clone(),
            index: layer.index,
            config: layer.config.clone(),
            router: DevRouter::upload(gpu, layer)?,
            nvfp4: match want {
                Want::Nvfp4 => Some(DevExperts::upload(gpu, layer, format)?),
                Want::Reference => None,
            },
            reference: match want {
                Want::Reference => Some(DevRefExperts::upload(gpu, layer)?),
                Want::Nvfp4 => None,
            },
            shared: match &layer.shared {
                Some(m) => Some(DevDense::upload(gpu, m)?),
                None => None,
            },
        })
    }
}

/// Every buffer one forward touches, allocated up front.
struct Workspace {
    tokens: usize,
    k: usize,
    hidden: CudaSlice<f32>,
    /// `bf16(hidden)`: the shared expert's input and, where exact, the router's (None when
    /// the layer has no shared expert and its router weight is not BF16-exact).
    hidden_bf16: Option<CudaSlice<u16>>,
    input_ids: Option<CudaSlice<i64>>,
    logits: CudaSlice<f32>,
    topk_ids: CudaSlice<i32>,
    topk_w: CudaSlice<f32>,
    chunk_counts: CudaSlice<u32>,
    chunk_base: CudaSlice<u32>,
    expert_offsets: CudaSlice<u32>,
    tile_offsets: CudaSlice<u32>,
    /// The register-A kernels' row tiles, where an expert's last tile takes up to
    /// `SM90_RS_SLACK` rows more: `[row_tile_bound]` of (expert, first row, end row, 0), then
    /// `RS_NO_TILE` up to the bound (moe_offsets), so that a CTA finds its tile in one load.
    wide_tiles: CudaSlice<u32>,
    /// `[1 + E]`: how many experts got rows, then which (moe_offsets).
    active_experts: CudaSlice<u32>,
    sorted_token: CudaSlice<i32>,
    sorted_expert: CudaSlice<i32>,
    sorted_entry: CudaSlice<i32>,
    entry_pos: CudaSlice<i32>,
    gs1: CudaSlice<f32>,
    gs2: CudaSlice<f32>,
    /// `[E]` amax of each expert's SwiGLU output, then `[E]` the batch amax of `hidden`.
    amax_bits: CudaSlice<u32>,
    stats: CudaSlice<u64>,
    /// NVFP4: quantized GEMM inputs. Reference: unused (one byte).
    a1q: CudaSlice<u8>,
    a1s: CudaSlice<u8>,
    a2q: CudaSlice<u8>,
    a2s: CudaSlice<u8>,
    /// The SwiGLU output in f32 (dynamic gs2 / reference g), and u (reference).
    a_f32: CudaSlice<f32>,
    u_f32: CudaSlice<f32>,
    /// Reference: gathered BF16 rows `[N, H]` and the BF16 intermediate `[N, I]`.
    xg_bf16: CudaSlice<u16>,
    a_bf16: CudaSlice<u16>,
    /// The expert outputs of every (token, slot) `[N, H]`: BF16 from the NVFP4 down GEMMs (the
    /// first half of the allocation), f32 from the reference's cuBLAS GEMMs.
    y: CudaSlice<f32>,
    shared: Option<SharedWs>,
    out: CudaSlice<f32>,
    per_slot: Option<CudaSlice<f32>>,
}

struct SharedWs {
    g: CudaSlice<f32>,
    u: CudaSlice<f32>,
    a: CudaSlice<u16>,
    y: CudaSlice<f32>,
}

impl Workspace {
    fn new(
        gpu: &Gpu,
        layer: &DevLayer,
        tokens: usize,
        k: usize,
        want: Want,
        dynamic: bool,
        per_slot: bool,
    ) -> Result<Self> {
        let c = &layer.config;
        let (h, i, e) = (c.hidden_size, c.moe_intermediate_size, c.n_routed_experts);
        let n = tokens * k;
        let nchunks = n.div_ceil(SORT_CHUNK).max(1);
        let nv = want == Want::Nvfp4;
        let a = |len: usize| if nv { len } else { 0 };
        let r = |len: usize| if nv { 0 } else { len };
        Ok(Workspace {
            tokens,
            k,
            hidden: gpu.alloc(tokens * h, "the hidden states")?,
            hidden_bf16: if layer.shared.is_some() || layer.router.weight_bf16.is_some() {
                Some(gpu.alloc(tokens * h, "the hidden states as BF16")?)
            } else {
                None
            },
            input_ids: if layer.router.hash {
                Some(gpu.alloc(tokens, "input_ids")?)
            } else {
                None
            },
            logits: gpu.alloc(tokens * e, "router logits")?,
            topk_ids: gpu.alloc(n, "topk_ids")?,
            topk_w: gpu.alloc(n, "topk_weights")?,
            chunk_counts: gpu.alloc(nchunks * e, "sort counts")?,
            chunk_base: gpu.alloc(nchunks * e, "sort offsets")?,
            expert_offsets: gpu.alloc(e + 1, "expert offsets")?,
            tile_offsets: gpu.alloc(e + 1, "tile offsets")?,
            wide_tiles: gpu.alloc(4 * row_tile_bound(n, e), "wide row tiles")?,
            active_experts: gpu.alloc(e + 1, "active experts")?,
            sorted_token: gpu.alloc(n, "sorted tokens")?,
            sorted_expert: gpu.alloc(n, "sorted experts")?,
            sorted_entry: gpu.alloc(n, "sorted entries")?,
            entry_pos: gpu.alloc(n, "entry positions")?,
            gs1: gpu.alloc(e, "gs1")?,
            gs2: gpu.alloc(e, "gs2")?,
            amax_bits: gpu.alloc(2 * e, "amax")?,
            stats: gpu.alloc(4, "activation block statistics")?,
            a1q: gpu.alloc(a(n * h / 2), "quantized expert inputs")?,
            a1s: gpu.alloc(a(n * h / 16), "expert input scales")?,
            a2q: gpu.alloc(a(n * i / 2), "quantized intermediate")?,
            a2s: gpu.alloc(a(n * i / 16), "intermediate scales")?,
            a_f32: gpu.alloc(if dynamic || !nv { n * i } else { 0 }, "the SwiGLU output")?,
            u_f32: gpu.alloc(r(n * i), "the up projection")?,
            xg_bf16: gpu.alloc(r(n * h), "gathered BF16 rows")?,
            a_bf16: gpu.alloc(r(n * i), "the BF16 intermediate")?,
            y: gpu.alloc(n * h, "expert outputs")?,
            shared: match &layer.shared {
                Some(s) => Some(SharedWs {
                    g: gpu.alloc(tokens * s.inter, "shared expert gate")?,
                    u: gpu.alloc(tokens * s.inter, "shared expert up")?,
                    a: gpu.alloc(tokens * s.inter, "shared expert intermediate")?,
                    y: gpu.alloc(tokens * h, "shared expert output")?,
                }),
                None => None,
            },
            out: gpu.alloc(tokens * h, "the MoE output")?,
            per_slot: if per_slot {
                Some(gpu.alloc(n * h, "per-slot outputs")?)
            } else {
                None
            },
        })
    }
}

/// The parts of the NVFP4 forward, in launch order ([`Nvfp4Forward::enqueue_stage`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// Router (when routing on the GPU), counting sort by expert, NVFP4 quantization of the
    /// expert inputs (and the dynamic gs1).
    Prologue,
    /// The grouped gate/up GEMM with SwiGLU and the requantization fused (and, with dynamic
    /// scales, the gs2 pass and the separate quantization).
    GateUp,
    /// The grouped down GEMM.
    Down,
    /// Shared experts and the weighted combine.
    Epilogue,
}

impl Stage {
    pub const ALL: [Stage; 4] = [Stage::Prologue, Stage::GateUp, Stage::Down, Stage::Epilogue];
}

/// Where the routing of a forward comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RouteSource {
    /// Uploaded from a host [`Routing`] (the `Backend::moe_forward` contract).
    Given,
    /// Computed by the router kernels inside the forward (what an engine's graph does).
    Gpu,
}

/// One MoE layer forward, prepared on the GPU.
pub struct Nvfp4Forward {
    layer: DevLayer,
    ws: Workspace,
    want: Want,
    flavor: Flavor,
    dynamic: bool,
    route: RouteSource,
    prefill: PrefillGemm,
    decode_layout: DecodeLayout,
    /// The register-A prefill kernels' tokens (sm_90a, where they fit).
    rs: Option<RsTokens>,
    /// [`Nvfp4Forward::set_shared_beside`].
    shared_beside: bool,
    input_quantize: InputQuantize,
    /// [`Nvfp4Forward::set_rs_rows`].
    rs_rows: RsRows,
    /// [`Nvfp4Forward::set_down_rows`].
    down_rows: DownRows,
    /// The last [`Nvfp4Forward::set_hidden`] held BF16-exact values only and uploaded them to
    /// `ws.hidden_bf16` (which exists where a shared expert or a BF16 router reads it).
    hidden_bf16_set: AtomicBool,
}

impl Nvfp4Forward {
    /// Stream `layer`'s NVFP4 experts (and router, shared experts) to the GPU and allocate a
    /// forward of `tokens` rows with top-`k` routing.
    pub fn new(
        gpu: &Arc<Gpu>,
        layer: &MoeLayer,
        tokens: usize,
        scales: &ActScales,
        flavor: Flavor,
        per_slot: bool,
    ) -> Result<Self> {
        Self::prepare(
            gpu,
            layer,
            tokens,
            layer.config.num_experts_per_tok,
            Some((scales, flavor)),
            per_slot,
        )
    }

    /// The BF16 reference path of the same layer (cuBLAS GEMMs; not capturable, it reads the
    /// expert counts back to size them).
    pub fn new_reference(
        gpu: &Arc<Gpu>,
        layer: &MoeLayer,
        tokens: usize,
        per_slot: bool,
    ) -> Result<Self> {
        Self::prepare(
            gpu,
            layer,
            tokens,
            layer.config.num_experts_per_tok,
            None,
            per_slot,
        )
    }

    fn prepare(
        gpu: &Arc<Gpu>,
        layer: &MoeLayer,
        tokens: usize,
        k: usize,
        nvfp4: Option<(&ActScales, Flavor)>,
        per_slot: bool,
    ) -> Result<Self> {
        let want = if nvfp4.is_some() {
            Want::Nvfp4
        } else {
            Want::Reference
        };
        let mut dev = DevLayer::upload(gpu, layer, want)?;
        let c = &layer.config;
        // the register-A prefill kernels read the decode tiles too
        let rs_fits = dev
            .nvfp4
            .as_ref()
            .is_some_and(|ex| sm90_rs_fits(&gpu.arch, ex.wblock as usize, c));
        if let Some(ex) = dev.nvfp4.as_mut() {
            let kind =
                moe_decode::choose(tokens, ex.wblock, c.hidden_size, c.moe_intermediate_size);
            if rs_fits || matches!(kind, GemmKind::Decode { .. }) {
                ex.add_decode_tiles(gpu, c)?;
            }
        }
        let rs = if rs_fits {
            Some(RsTokens::new(
                gpu,
                tokens * k,
                c.hidden_size,
                c.moe_intermediate_size,
                c.n_routed_experts,
            )?)
        } else {
            None
        };
        let e = layer.config.n_routed_experts;
        let dynamic = matches!(nvfp4, Some((ActScales::Dynamic, _)));
        let mut ws = Workspace::new(gpu, &dev, tokens, k, want, dynamic, per_slot)?;
        if let Some((ActScales::Fixed { gs1, gs2 }, _)) = nvfp4 {
            if gs1.len() != e || gs2.len() != e {
                return Err(Error::usage(format!(
                    "MoE layer {}: {} gs1 and {} gs2 values for {e} experts",
                    layer.index,
                    gs1.len(),
                    gs2.len()
                )));
            }
            gpu.upload_into(gs1, &mut ws.gs1, 0, "gs1")?;
            gpu.upload_into(gs2, &mut ws.gs2, 0, "gs2")?;
        }
        Ok(Nvfp4Forward {
            layer: dev,
            ws,
            want,
            flavor: nvfp4.map_or(Flavor::Reference, |n| n.1),
            dynamic,
            route: RouteSource::Given,
            prefill: PrefillGemm::Auto,
            decode_layout: DecodeLayout::from_env(),
            rs,
            shared_beside: shared_beside_default(),
            input_quantize: InputQuantize::from_env(),
            rs_rows: RsRows::from_env(),
            down_rows: DownRows::from_env(),
            hidden_bf16_set: AtomicBool::new(false),
        })
    }

    fn gpu(&self) -> &Gpu {
        &self.layer.gpu
    }

    pub fn tokens(&self) -> usize {
        self.ws.tokens
    }

    /// Copy the layer input `[tokens, hidden]` (BF16-exact values) to the GPU. Takes `&self`
    /// so a captured graph ([`LayerGraph`]) can be fed new inputs between replays.
    pub fn set_hidden(&self, hidden: &[f32]) -> Result<()> {
        self.upload_hidden(hidden, false)
    }

    /// [`Nvfp4Forward::set_hidden`]; with `need_exact`, an input that is not BF16-exact is
    /// refused before anything is written.
    fn upload_hidden(&self, hidden: &[f32], need_exact: bool) -> Result<()> {
        let want = self.ws.tokens * self.layer.config.hidden_size;
        if hidden.len() != want {
            return Err(Error::usage(format!(
                "MoE layer {}: {} hidden values, this forward was prepared for {} tokens x {}",
                self.layer.index,
                hidden.len(),
                self.ws.tokens,
                self.layer.config.hidden_size
            )));
        }
        // The layer input is BF16 (as an engine passes it): where the values say so, its BF16
        // copy (the router's and the shared expert's input) comes up with it.
        let bits = self
            .ws
            .hidden_bf16
            .as_ref()
            .and_then(|_| router::bf16_exact(hidden));
        if need_exact && bits.is_none() {
            return Err(Error::usage(format!(
                "MoE layer {}: this graph was captured on BF16-exact hidden states, and the \
                 new ones are not BF16-exact; capture the forward again",
                self.layer.index
            )));
        }
        let gpu = self.gpu();
        gpu.upload_raw(
            hidden,
            gpu.ptr(&self.ws.hidden),
            self.ws.hidden.len(),
            "the hidden states",
        )?;
        if let (Some(bits), Some(dst)) = (&bits, &self.ws.hidden_bf16) {
            gpu.upload_raw(bits, gpu.ptr(dst), dst.len(), "the hidden states as BF16")?;
        }
        self.hidden_bf16_set
            .store(bits.is_some(), Ordering::Relaxed);
        Ok(())
    }

    /// Use a given routing (not computed inside the forward).
    pub fn set_routing(&mut self, layer: &MoeLayer, routing: &Routing) -> Result<()> {
        check_routing(layer, routing, self.ws.tokens)?;
        if routing.top_k != self.ws.k {
            return Err(Error::usage(format!(
                "MoE layer {}: routing is top-{}, this forward was prepared for top-{}",
                layer.index, routing.top_k, self.ws.k
            )));
        }
        let gpu = self.layer.gpu.clone();
        gpu.upload_into(&routing.topk_ids, &mut self.ws.topk_ids, 0, "topk_ids")?;
        gpu.upload_into(
            &routing.topk_weights,
            &mut self.ws.topk_w,
            0,
            "topk_weights",
        )?;
        self.route = RouteSource::Given;
        Ok(())
    }

    /// Route inside the forward with the layer's router (hash layers need `input_ids`).
    pub fn route_on_gpu(&mut self, input_ids: Option<&[i64]>) -> Result<()> {
        if self.ws.k != self.layer.config.num_experts_per_tok {
            return Err(Error::usage(
                "routing on the GPU uses the config's num_experts_per_tok",
            ));
        }
        self.layer
            .router
            .check_input_ids(self.layer.index, self.ws.tokens, input_ids)?;
        if let (Some(ids), Some(dst)) = (input_ids, self.ws.input_ids.as_mut()) {
            self.layer.gpu.upload_into(ids, dst, 0, "input_ids")?;
        }
        self.route = RouteSource::Gpu;
        Ok(())
    }

    /// Launch the whole forward on the stream: no allocation, no host sync (NVFP4 path).
    pub fn enqueue(&self) -> Result<()> {
        match self.want {
            Want::Nvfp4 => self.enqueue_nvfp4(),
            Want::Reference => Err(Error::usage(
                "the reference forward reads expert counts back; use run() instead of enqueue()",
            )),
        }
    }

    /// Run the forward and bring the output back.
    pub fn run(&self) -> Result<MoeOutput> {
        match self.want {
            Want::Nvfp4 => self.enqueue_nvfp4()?,
            Want::Reference => self.run_reference()?,
        }
        self.output()
    }

    /// The output of the last forward (waits for the stream).
    pub fn output(&self) -> Result<MoeOutput> {
        let gpu = self.gpu();
        let h = self.layer.config.hidden_size;
        let (t, n) = (self.ws.tokens, self.ws.tokens * self.ws.k);
        let out = gpu.download(&self.ws.out, t * h, "the MoE output")?;
        let act_stats = match self.want {
            Want::Nvfp4 => {
                stats_from(&gpu.download(&self.ws.stats, 4, "activation block statistics")?)
            }
            Want::Reference => BlockStats::default(),
        };
        let per_slot = match &self.ws.per_slot {
            Some(p) => Some(gpu.download(p, n * h, "per-slot outputs")?),
            None => None,
        };
        Ok(MoeOutput {
            out,
            act_stats,
            per_slot,
        })
    }

    /// The routing the last forward used.
    pub fn routing(&self) -> Result<Routing> {
        let gpu = self.gpu();
        let n = self.ws.tokens * self.ws.k;
        Ok(Routing {
            tokens: self.ws.tokens,
            top_k: self.ws.k,
            topk_ids: gpu.download(&self.ws.topk_ids, n, "topk_ids")?,
            topk_weights: gpu.download(&self.ws.topk_w, n, "topk_weights")?,
        })
    }

    fn enqueue_route(&self) -> Result<()> {
        if self.route != RouteSource::Gpu {
            return Ok(());
        }
        let gpu = self.gpu();
        router::enqueue_route(
            gpu,
            &self.layer.config,
            &self.layer.router,
            gpu.ptr(&self.ws.hidden),
            self.ws
                .hidden_bf16
                .as_ref()
                .filter(|_| self.router_reads_bf16())
                .map(|d| gpu.ptr(d)),
            self.ws.tokens,
            self.ws.input_ids.as_ref().map(|d| gpu.ptr(d)),
            &RouteBufs {
                logits: gpu.ptr(&self.ws.logits),
                topk_ids: gpu.ptr(&self.ws.topk_ids),
                topk_weights: gpu.ptr(&self.ws.topk_w),
            },
        )
    }

    /// Counting sort of the (token, slot) entries by expert; its scatter also writes each
    /// expert's tensor maps where a register-A GEMM runs ([`Self::expert_maps`]).
    fn enqueue_sort(&self) -> Result<()> {
        let gpu = self.gpu();
        let maps = self.expert_maps();
        let ws = &self.ws;
        let e = self.layer.config.n_routed_experts as u32;
        let n = (ws.tokens * ws.k) as u32;
        let nchunks = (n as usize).div_ceil(SORT_CHUNK).max(1) as u32;
        let smem = 4 * e;
        let chunks = LaunchConfig {
            grid_dim: (nchunks, 1, 1),
            block_dim: (SORT_CHUNK as u32, 1, 1),
            shared_mem_bytes: smem,
        };
        gpu.launch(
            &MOE,
            "moe_chunk_counts",
            chunks,
            &[
                KArg::U64(gpu.ptr(&ws.topk_ids)),
                KArg::U32(n),
                KArg::U32(e),
                KArg::U64(gpu.ptr(&ws.chunk_counts)),
                KArg::U64(gpu.ptr(&ws.stats)),
                KArg::U64(gpu.ptr(&ws.amax_bits)),
                KArg::U32(2 * e),
            ],
        )?;
        // moe_offsets: P = max(1, threads / E) runs of chunks per expert, (P + 1) E words
        let runs = (OFFSETS_THREADS / e.max(1)).max(1);
        gpu.launch(
            &MOE,
            "moe_offsets",
            LaunchConfig {
                grid_dim: (1, 1, 1),
                block_dim: (OFFSETS_THREADS, 1, 1),
                shared_mem_bytes: 4 * (runs + 1) * e,
            },
            &[
                KArg::U64(gpu.ptr(&ws.chunk_counts)),
                KArg::U32(nchunks),
                KArg::U32(e),
                KArg::U32(BM as u32),
                KArg::U32(sm90_rs_slack()),
                KArg::U64(gpu.ptr(&ws.chunk_base)),
                KArg::U64(gpu.ptr(&ws.expert_offsets)),
                KArg::U64(gpu.ptr(&ws.tile_offsets)),
                KArg::U64(gpu.ptr(&ws.wide_tiles)),
                KArg::U32(row_tile_bound(n as usize, e as usize) as u32),
                KArg::U64(gpu.ptr(&ws.active_experts)),
            ],
        )?;
        gpu.launch(
            &MOE,
            "moe_scatter",
            chunks,
            &[
                KArg::U64(gpu.ptr(&ws.topk_ids)),
                KArg::U32(n),
                KArg::U32(e),
                KArg::U32(ws.k as u32),
                KArg::U64(gpu.ptr(&ws.chunk_base)),
                KArg::U64(gpu.ptr(&ws.sorted_token)),
                KArg::U64(gpu.ptr(&ws.sorted_expert)),
                KArg::U64(gpu.ptr(&ws.sorted_entry)),
                KArg::U64(gpu.ptr(&ws.entry_pos)),
                KArg::U64(maps.map_or(0, |m| m.0)),
                KArg::U64(gpu.ptr(&ws.expert_offsets)),
                KArg::U64(maps.map_or(0, |m| m.1)),
            ],
        )
    }

    /// Grid of a grouped GEMM: an upper bound on the row tiles over all experts (blocks past
    /// the real count exit), times the output column tiles.
    fn gemm_grid(&self, nout: usize, bn: usize) -> LaunchConfig {
        let e = self.layer.config.n_routed_experts;
        let tiles = row_tile_bound(self.ws.tokens * self.ws.k, e);
        LaunchConfig {
            grid_dim: (tiles as u32, nout.div_ceil(bn) as u32, 1),
            block_dim: (GEMM_THREADS, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    // ---- prefill GEMM dispatch (kernels/moe_gemm_sm90.cu) ----

    /// Pick the grouped GEMM kernel of the gate/up (`fused`) or down projection: on sm_90a the
    /// register-A warpgroup-MMA kernels (weights from the decode tiles) where they apply, else
    /// the shared-memory ones (NVFP4 16-blocks, K a multiple of 64), else the mma.sync kernels
    /// of kernels/moe.cu. All compute the same numbers up to FP32 summation order.
    fn prefill_gemm(&self, fused: bool, k_dim: usize, nout: usize, wblock: u32) -> PrefillLaunch {
        let fits = self.gpu().arch == "sm_90a" && wblock == 16 && k_dim.is_multiple_of(SM90_BK);
        let rs = self.rs.is_some();
        let rs_wg = sm90_rs_wg() as usize;
        let bn = if fused { SM90_FUSED_BN } else { SM90_BN };
        let e = self.layer.config.n_routed_experts;
        let n = self.ws.tokens * self.ws.k;
        // the same row-tile bound as gemm_grid, N tiles first so that the blocks sharing a row
        // tile run together and share its tokens in L2
        let m_tiles = row_tile_bound(n, e);
        let grid = |shared_mem_bytes| LaunchConfig {
            grid_dim: (nout.div_ceil(bn) as u32, m_tiles as u32, 1),
            block_dim: (GEMM_THREADS, 1, 1),
            shared_mem_bytes,
        };
        // the register-A kernels: 64 (gate/up) or 128 (down) weight rows per warpgroup
        let rs_grid = LaunchConfig {
            grid_dim: (nout.div_ceil(bn / 2 * rs_wg) as u32, m_tiles as u32, 1),
            block_dim: (128 * rs_wg as u32, 1, 1),
            shared_mem_bytes: sm90_rs_smem_bytes(),
        };
        let which = match self.prefill {
            PrefillGemm::Auto if rs && !sm90_rs_disabled() => PrefillGemm::WgmmaRs,
            PrefillGemm::Auto | PrefillGemm::Wgmma if fits => PrefillGemm::Wgmma,
            PrefillGemm::WgmmaRs if rs => PrefillGemm::WgmmaRs,
            _ => PrefillGemm::MmaSync,
        };
        match (which, fused) {
            (PrefillGemm::WgmmaRs, true) => {
                PrefillLaunch::Rs("moe_gemm_gate_up_nvfp4_sm90rs", rs_grid)
            }
            (PrefillGemm::WgmmaRs, false) => PrefillLaunch::Rs("moe_gemm_nvfp4_sm90rs", rs_grid),
            (PrefillGemm::Wgmma, true) => PrefillLaunch::Plain(
                &MOE_GEMM_SM90,
                "moe_gemm_gate_up_nvfp4_sm90",
                grid(SM90_SMEM_BYTES),
            ),
            (PrefillGemm::Wgmma, false) => {
                PrefillLaunch::Plain(&MOE_GEMM_SM90, "moe_gemm_nvfp4_sm90", grid(SM90_SMEM_BYTES))
            }
            (_, true) => PrefillLaunch::Plain(
                &MOE,
                "moe_gemm_gate_up_nvfp4",
                self.gemm_grid(nout, FUSED_BN),
            ),
            (_, false) => {
                PrefillLaunch::Plain(&MOE, "moe_gemm_nvfp4", self.gemm_grid(nout, PLAIN_BN))
            }
        }
    }

    /// The register-A kernels' tokens: the NVFP4 rows (`aq`, `as_`) to 16-bit values in their
    /// K order, for the down GEMM (K = I) or the gate/up (K = H); returns the tensor maps that
    /// read them ([`Self::rs_maps`]).
    fn enqueue_rs_tokens(&self, aq: u64, as_: u64, down: bool) -> Result<(u64, u32)> {
        let gpu = self.gpu();
        let rs = self.rs_tokens()?;
        let n = self.ws.tokens * self.ws.k;
        let c = &self.layer.config;
        let k = if down {
            c.moe_intermediate_size
        } else {
            c.hidden_size
        };
        gpu.launch(
            &MOE_GEMM_SM90,
            "moe_rows_bf16_rs",
            grid_1d((n * k / 32) as u64, ROWS_RS_THREADS)?,
            &[
                KArg::U64(aq),
                KArg::U64(as_),
                KArg::U32(k as u32),
                KArg::U32(n as u32),
                KArg::U64(gpu.ptr(if down { &rs.down } else { &rs.gate_up })),
            ],
        )?;
        self.rs_maps(down)
    }

    /// The tensor maps (device address, stride per expert) of the register-A gate/up's or
    /// down's token rows.
    fn rs_maps(&self, down: bool) -> Result<(u64, u32)> {
        let e = self.layer.config.n_routed_experts;
        Ok(self.rs_tokens()?.maps_of(self.gpu(), down, e))
    }

    /// The register-A GEMMs' per-expert tensor maps, ending at each expert's last row, that the
    /// sort's scatter writes (kernels/moe.cu `rs_expert_maps`): (templates, destination), or
    /// None where no register-A GEMM runs or the maps are off.
    fn expert_maps(&self) -> Option<(u64, u64)> {
        let rs = self.rs.as_ref()?;
        let out = rs.expert_maps.as_ref()?;
        let gpu = self.gpu();
        (self.runs_rs(false) || self.runs_rs(true)).then(|| (gpu.ptr(&rs.maps), gpu.ptr(out)))
    }

    fn rs_tokens(&self) -> Result<&RsTokens> {
        self.rs
            .as_ref()
            .ok_or_else(|| Error::usage("the register-A prefill buffers were not allocated"))
    }

    /// Which prefill GEMM kernels this forward launches (tests compare them).
    pub fn set_prefill_gemm(&mut self, which: PrefillGemm) -> Result<()> {
        let nvfp4_16 = self.layer.nvfp4.as_ref().is_some_and(|x| x.wblock == 16);
        let c = &self.layer.config;
        let fits = self.gpu().arch == "sm_90a"
            && nvfp4_16
            && c.hidden_size.is_multiple_of(SM90_BK)
            && c.moe_intermediate_size.is_multiple_of(SM90_BK);
        if which == PrefillGemm::Wgmma && !fits {
            return Err(Error::usage(format!(
                "the wgmma prefill GEMM needs sm_90a (this is {}), NVFP4 experts and hidden / \
                 intermediate sizes that are multiples of {SM90_BK}",
                self.gpu().arch
            )));
        }
        if which == PrefillGemm::WgmmaRs && self.rs.is_none() {
            return Err(Error::usage(format!(
                "the register-A wgmma prefill GEMM needs sm_90a (this is {}), NVFP4 experts \
                 and hidden / intermediate sizes that are multiples of {SM90_RS_BK}",
                self.gpu().arch
            )));
        }
        self.prefill = which;
        Ok(())
    }

    // ---- end of prefill GEMM dispatch ----

    #[allow(clippy::too_many_arguments)]
    fn enqueue_quantize(
        &self,
        x: u64,
        rows: usize,
        cols: usize,
        row_src: u64,
        gs: u64,
        gs_idx: u64,
        q: u64,
        s: u64,
    ) -> Result<()> {
        let gpu = self.gpu();
        gpu.launch(
            &QUANT,
            "nvfp4_quantize_f32",
            super::quant::nvfp4_grid(rows, cols / 16, ScaleLayout::Linear)?,
            &[
                KArg::U64(x),
                KArg::U64(rows as u64),
                KArg::U32(cols as u32),
                KArg::U64(row_src),
                KArg::U64(gs),
                KArg::U64(gs_idx),
                KArg::U64(q),
                KArg::U64(s),
                KArg::U32(0),
                KArg::U64(gpu.ptr(&self.ws.stats)),
                KArg::U32(flavor_code(self.flavor)),
            ],
        )
    }

    fn scatters_inputs(&self) -> bool {
        match self.input_quantize {
            InputQuantize::Scatter => true,
            InputQuantize::Gather => false,
            // the gather's k re-reads of a hidden row come from L2 while the hidden states
            // are small next to it (H200 50 MB, B200 126 MB); past that, from memory
            InputQuantize::Auto => {
                self.ws.tokens * self.layer.config.hidden_size * 4 >= SCATTER_FROM_BYTES
            }
        }
    }

    fn shared_runs_beside(&self) -> bool {
        self.shared_beside && self.layer.shared.is_some() && self.ws.tokens > 0
    }

    /// The router's logits come from the BF16 copy of the input (src/backend/cuda/router.rs):
    /// routing on the GPU, a BF16-exact router weight and BF16-exact hidden states.
    fn router_reads_bf16(&self) -> bool {
        self.route == RouteSource::Gpu
            && self.layer.router.weight_bf16.is_some()
            && self.hidden_bf16_set.load(Ordering::Relaxed)
    }

    /// How this forward is laid out where a choice changes no number (for bench reports).
    pub fn schedule(&self) -> String {
        format!(
            "router logits {}; expert inputs {}; shared expert {}{}",
            match (self.route, self.router_reads_bf16()) {
                (RouteSource::Given, _) => "given (routing uploaded)",
                (RouteSource::Gpu, true) => "BF16 tensor cores, FP32 accumulation",
                (RouteSource::Gpu, false) => "FP32 (SIMT)",
            },
            match (
                self.scatters_inputs(),
                self.rs_rows_in_prologue().is_some(),
                self.rs_rows_input_bf16().is_some(),
            ) {
                (true, true, true) => {
                    "quantized token by token straight into the GEMM's 16-bit rows, from BF16"
                }
                (true, true, false) => {
                    "quantized token by token straight into the GEMM's 16-bit rows, from f32"
                }
                (true, false, _) => "quantized token by token (scatter)",
                (false, _, _) => "quantized through the row gather",
            },
            match (self.layer.shared.is_some(), self.shared_runs_beside()) {
                (false, _) => "none",
                (true, true) => "beside the routed experts on a second stream",
                (true, false) => "after the routed experts",
            },
            if self.down_rows_in_epilogue().is_some() {
                "; the down's 16-bit rows from the gate/up epilogue"
            } else {
                ""
            }
        )
    }

    /// The expert inputs: sorted row p is hidden[sorted_token[p]], quantized with
    /// gs1[sorted_expert[p]], see [`InputQuantize`].
    fn enqueue_quantize_expert_inputs(&self) -> Result<()> {
        let (gpu, ws) = (self.gpu(), &self.ws);
        let h = self.layer.config.hidden_size;
        let n = ws.tokens * ws.k;
        let (q, s) = (gpu.ptr(&ws.a1q), gpu.ptr(&ws.a1s));
        if !self.scatters_inputs() {
            return self.enqueue_quantize(
                gpu.ptr(&ws.hidden),
                n,
                h,
                gpu.ptr(&ws.sorted_token),
                gpu.ptr(&ws.gs1),
                gpu.ptr(&ws.sorted_expert),
                q,
                s,
            );
        }
        let mut args = vec![
            KArg::U64(gpu.ptr(&ws.hidden)),
            KArg::U64(ws.tokens as u64),
            KArg::U32(h as u32),
            KArg::U32(ws.k as u32),
            KArg::U64(gpu.ptr(&ws.entry_pos)),
            KArg::U64(n as u64),
            KArg::U64(gpu.ptr(&ws.gs1)),
            KArg::U64(gpu.ptr(&ws.sorted_expert)),
            KArg::U64(q),
            KArg::U64(s),
            KArg::U64(gpu.ptr(&ws.stats)),
            KArg::U32(flavor_code(self.flavor)),
        ];
        let mut grid = super::quant::nvfp4_grid(ws.tokens, h / 16, ScaleLayout::Linear)?;
        let kernel = match (self.rs_rows_in_prologue(), self.flavor) {
            (Some(rows), flavor) => {
                // straight into the gate/up's token rows; nothing reads the codes then
                let bf16 = self.rs_rows_input_bf16();
                if let Some(xb) = bf16 {
                    args[0] = KArg::U64(gpu.ptr(xb));
                }
                args[8] = KArg::U64(0);
                args.push(KArg::U64(rows));
                grid.shared_mem_bytes = super::quant::ROWS_SCATTER_SMEM;
                match (flavor, bf16.is_some()) {
                    (Flavor::Reference, false) => "nvfp4_rows_scatter_reference",
                    (Flavor::CudaFast, false) => "nvfp4_rows_scatter_cuda_fast",
                    (Flavor::Reference, true) => "nvfp4_rows_scatter_bf16_reference",
                    (Flavor::CudaFast, true) => "nvfp4_rows_scatter_bf16_cuda_fast",
                }
            }
            (None, Flavor::Reference) => "nvfp4_quantize_f32_scatter_reference",
            (None, Flavor::CudaFast) => "nvfp4_quantize_f32_scatter_cuda_fast",
        };
        gpu.launch(&QUANT, kernel, grid, &args)
    }

    /// The BF16 copy of the layer input where `nvfp4_rows_scatter_*` reads it: it holds the
    /// same values (half the bytes of the f32 input).
    fn rs_rows_input_bf16(&self) -> Option<&CudaSlice<u16>> {
        let exact = self.hidden_bf16_set.load(Ordering::Relaxed);
        self.ws
            .hidden_bf16
            .as_ref()
            .filter(|_| exact && self.rs_rows == RsRows::Auto)
    }

    /// Where the prologue quantizes the expert inputs token by token straight into the
    /// register-A gate/up's token rows (`nvfp4_rows_scatter_*`), those rows; `None` where the
    /// codes go through memory (the gather, the other GEMMs, [`RsRows::Codes`]).
    fn rs_rows_in_prologue(&self) -> Option<u64> {
        let fused = self.rs_rows != RsRows::Codes
            && super::quant::rows_scatter_fits()
            && self.scatters_inputs()
            && self.runs_rs(false);
        let rs = self.rs.as_ref().filter(|_| fused)?;
        Some(self.gpu().ptr(&rs.gate_up))
    }

    /// Where the register-A gate/up's epilogue writes the down's 16-bit token rows (both GEMMs
    /// register-A, a fixed gs2, [`DownRows::Auto`]), those rows; `None` where
    /// `moe_rows_bf16_rs` makes them from the codes.
    fn down_rows_in_epilogue(&self) -> Option<u64> {
        let fused = self.down_rows == DownRows::Auto
            && !self.dynamic
            && self.runs_rs(false)
            && self.runs_rs(true);
        let rs = self.rs.as_ref().filter(|_| fused)?;
        Some(self.gpu().ptr(&rs.down))
    }

    /// A register-A kernel runs this forward's gate/up GEMM (`down` false) or its down GEMM.
    fn runs_rs(&self, down: bool) -> bool {
        let c = &self.layer.config;
        let (h, i) = (c.hidden_size, c.moe_intermediate_size);
        let Some(wblock) = self.layer.nvfp4.as_ref().map(|x| x.wblock) else {
            return false;
        };
        let (k, nout) = if down { (i, h) } else { (h, i) };
        self.ws.tokens * self.ws.k > 0
            && matches!(self.choose_gemm(), GemmKind::Tiled)
            && matches!(
                self.prefill_gemm(!down, k, nout, wblock),
                PrefillLaunch::Rs(..)
            )
    }

    fn enqueue_nvfp4(&self) -> Result<()> {
        // The shared expert reads only the layer input: it runs on the side stream beside
        // the routed experts, on the multiprocessors their kernels leave idle (the router's
        // small FP32 GEMM, the sort, the GEMMs' last waves), and the combine waits for it.
        // Stage by stage (the bench's split) it stays in the epilogue. (Forked after the
        // prologue instead: the same time, s10b.)
        let beside = self.shared_runs_beside();
        if beside {
            self.gpu().fork_side(|| self.enqueue_shared())?;
        }
        for stage in [Stage::Prologue, Stage::GateUp, Stage::Down] {
            self.enqueue_nvfp4_stage(stage)?;
        }
        if beside {
            self.gpu().join_side()?;
            self.enqueue_combine(false)
        } else {
            self.enqueue_nvfp4_stage(Stage::Epilogue)
        }
    }

    /// Run the shared expert on a second stream beside the routed experts (the default;
    /// `NVFP4DBG_SHARED_STREAM=0` turns it off) or after them on the one stream. The same
    /// outputs either way.
    pub fn set_shared_beside(&mut self, beside: bool) {
        self.shared_beside = beside;
    }

    /// How the expert inputs are quantized ([`InputQuantize`]).
    pub fn set_input_quantize(&mut self, how: InputQuantize) {
        self.input_quantize = how;
    }

    /// How the register-A gate/up's token rows are made ([`RsRows`]).
    pub fn set_rs_rows(&mut self, how: RsRows) {
        self.rs_rows = how;
    }

    /// Where the register-A down's token rows are made ([`DownRows`]).
    pub fn set_down_rows(&mut self, how: DownRows) {
        self.down_rows = how;
    }

    /// Launch one part of the NVFP4 forward (no allocation, no host sync). A stage reads what
    /// the earlier ones left in the workspace, so repeating a lone stage recomputes the same
    /// outputs (what `nvfp4dbg bench` times; only the activation block statistics add up).
    pub fn enqueue_stage(&self, stage: Stage) -> Result<()> {
        match self.want {
            Want::Nvfp4 => self.enqueue_nvfp4_stage(stage),
            Want::Reference => Err(Error::usage(
                "the reference forward has no NVFP4 stages; use run() instead",
            )),
        }
    }

    fn enqueue_nvfp4_stage(&self, stage: Stage) -> Result<()> {
        let gpu = self.gpu();
        let ws = &self.ws;
        let c = &self.layer.config;
        let (h, i, e) = (c.hidden_size, c.moe_intermediate_size, c.n_routed_experts);
        let n = ws.tokens * ws.k;
        let ex = self
            .layer
            .nvfp4
            .as_ref()
            .ok_or_else(|| Error::usage("NVFP4 weights were not uploaded"))?;
        let p = |s: &CudaSlice<u8>| gpu.ptr(s);
        match stage {
            Stage::Prologue => {
                self.enqueue_route()?;
                // also zeroes the block statistics and the amax words
                self.enqueue_sort()?;
                if self.dynamic {
                    // gs1 = 2688 / amax(hidden over the batch), the same for every expert
                    let batch_amax = gpu.ptr(&ws.amax_bits) + (e * 4) as u64;
                    super::reduce::amax_into(
                        gpu,
                        gpu.ptr(&ws.hidden),
                        (ws.tokens * h) as u64,
                        batch_amax,
                    )?;
                    gpu.launch(
                        &MOE,
                        "dynamic_gs_from_amax",
                        grid_1d(1, 32)?,
                        &[
                            KArg::U64(batch_amax),
                            KArg::U32(1),
                            KArg::U64(gpu.ptr(&ws.gs2)),
                        ],
                    )?;
                    gpu.launch(
                        &MOE,
                        "broadcast_f32",
                        grid_1d(e as u64, ELEM_THREADS)?,
                        &[
                            KArg::U64(gpu.ptr(&ws.gs2)),
                            KArg::U32(e as u32),
                            KArg::U64(gpu.ptr(&ws.gs1)),
                        ],
                    )?;
                }
                if n > 0 {
                    self.enqueue_quantize_expert_inputs()?;
                }
                Ok(())
            }
            Stage::GateUp if n > 0 => {
                let (limit, has_limit) = match c.swiglu_limit {
                    Some(l) => (l, 1u32),
                    None => (0.0, 0u32),
                };
                // decode GEMMs (kernels/moe_decode.cu) when experts get few rows
                let kind = self.choose_gemm();
                if let GemmKind::Decode { .. } = kind {
                    let g_rows = kind.rows_per_pass(h);
                    let (layout, w) = ex.decode_weights(gpu, self.decode_layout);
                    moe_decode::enqueue_gate_up(
                        gpu,
                        &self.decode_args(p(&ws.a1q), p(&ws.a1s), h, i, g_rows, layout),
                        [w[0], w[1], w[2], w[3]],
                        &[
                            KArg::U64(gpu.ptr(&ws.gs1)),
                            KArg::U64(gpu.ptr(&ex.ws2_1)),
                            KArg::U64(gpu.ptr(&ex.ws2_3)),
                            KArg::F32(limit),
                            KArg::U32(has_limit),
                            KArg::U64(gpu.ptr(&ws.expert_offsets)),
                            KArg::U64(gpu.ptr(&ws.active_experts)),
                            KArg::U32(g_rows),
                            KArg::U64(if self.dynamic { 0 } else { gpu.ptr(&ws.gs2) }),
                            KArg::U32(flavor_code(self.flavor)),
                            KArg::U64(p(&ws.a2q)),
                            KArg::U64(p(&ws.a2s)),
                            KArg::U64(gpu.ptr(&ws.stats)),
                            KArg::U64(gpu.ptr(&ws.a_f32)),
                            KArg::U64(gpu.ptr(&ws.amax_bits)),
                        ],
                    )?;
                } else {
                    let launch = self.prefill_gemm(true, h, i, ex.wblock);
                    // the down's token rows from the epilogue (register-A only) instead of the
                    // codes: nothing else reads those then
                    let down_rows = self.down_rows_in_epilogue();
                    let codes = |b| if down_rows.is_some() { 0 } else { p(b) };
                    let mut tail = vec![
                        KArg::U32(i as u32),
                        KArg::U64(gpu.ptr(&ws.gs1)),
                        KArg::U64(gpu.ptr(&ex.ws2_1)),
                        KArg::U64(gpu.ptr(&ex.ws2_3)),
                        KArg::F32(limit),
                        KArg::U32(has_limit),
                    ];
                    tail.extend(launch.tile_args(gpu, ws, e));
                    tail.extend([
                        KArg::U64(if self.dynamic { 0 } else { gpu.ptr(&ws.gs2) }),
                        KArg::U32(flavor_code(self.flavor)),
                        KArg::U64(codes(&ws.a2q)),
                        KArg::U64(codes(&ws.a2s)),
                        KArg::U64(gpu.ptr(&ws.stats)),
                        KArg::U64(gpu.ptr(&ws.a_f32)),
                        KArg::U64(gpu.ptr(&ws.amax_bits)),
                    ]);
                    match launch {
                        PrefillLaunch::Plain(module, kernel, grid) => {
                            let mut args = vec![
                                KArg::U64(p(&ws.a1q)),
                                KArg::U64(p(&ws.a1s)),
                                KArg::U32(h as u32),
                                KArg::U64(p(&ex.w1q)),
                                KArg::U64(p(&ex.w1s)),
                                KArg::U64(p(&ex.w3q)),
                                KArg::U64(p(&ex.w3s)),
                            ];
                            args.extend_from_slice(&tail[..1]);
                            args.push(KArg::U32(ex.wblock));
                            args.extend_from_slice(&tail[1..]);
                            args.extend(sm90_split_arg(module));
                            gpu.launch(module, kernel, grid, &args)?;
                        }
                        PrefillLaunch::Rs(kernel, grid) => {
                            let map = match self.rs_rows_in_prologue() {
                                Some(_) => self.rs_maps(false)?,
                                None => self.enqueue_rs_tokens(p(&ws.a1q), p(&ws.a1s), false)?,
                            };
                            let (_, w) = ex.decode_weights(gpu, DecodeLayout::Tiles);
                            let mut args =
                                vec![KArg::U64(map.0), KArg::U32(map.1), KArg::U32(h as u32)];
                            args.extend(w[..4].iter().map(|&x| KArg::U64(x)));
                            args.extend_from_slice(&tail);
                            args.push(KArg::U64(down_rows.unwrap_or(0)));
                            gpu.launch(&MOE_GEMM_SM90, kernel, grid, &args)?;
                        }
                    }
                }
                if self.dynamic {
                    // gs2[e] = 2688 / amax(a over the rows routed to e), then quantize a
                    gpu.launch(
                        &MOE,
                        "dynamic_gs_from_amax",
                        grid_1d(e as u64, ELEM_THREADS)?,
                        &[
                            KArg::U64(gpu.ptr(&ws.amax_bits)),
                            KArg::U32(e as u32),
                            KArg::U64(gpu.ptr(&ws.gs2)),
                        ],
                    )?;
                    self.enqueue_quantize(
                        gpu.ptr(&ws.a_f32),
                        n,
                        i,
                        0,
                        gpu.ptr(&ws.gs2),
                        gpu.ptr(&ws.sorted_expert),
                        p(&ws.a2q),
                        p(&ws.a2s),
                    )?;
                }
                Ok(())
            }
            Stage::Down if n > 0 => match self.choose_gemm() {
                kind @ GemmKind::Decode { .. } => {
                    let (layout, w) = ex.decode_weights(gpu, self.decode_layout);
                    moe_decode::enqueue_down(
                        gpu,
                        &self.decode_args(
                            p(&ws.a2q),
                            p(&ws.a2s),
                            i,
                            h,
                            kind.rows_per_pass(i),
                            layout,
                        ),
                        w[4],
                        w[5],
                        gpu.ptr(&ws.gs2),
                        gpu.ptr(&ex.ws2_2),
                        gpu.ptr(&ws.y),
                    )
                }
                GemmKind::Tiled => {
                    let launch = self.prefill_gemm(false, i, h, ex.wblock);
                    let mut tail = vec![
                        KArg::U32(h as u32),
                        KArg::U64(gpu.ptr(&ws.gs2)),
                        KArg::U64(gpu.ptr(&ex.ws2_2)),
                    ];
                    tail.extend(launch.tile_args(gpu, ws, e));
                    tail.push(KArg::U64(gpu.ptr(&ws.y)));
                    match launch {
                        PrefillLaunch::Plain(module, kernel, grid) => {
                            let mut args = vec![
                                KArg::U64(p(&ws.a2q)),
                                KArg::U64(p(&ws.a2s)),
                                KArg::U32(i as u32),
                                KArg::U64(p(&ex.w2q)),
                                KArg::U64(p(&ex.w2s)),
                            ];
                            args.extend_from_slice(&tail[..1]);
                            args.push(KArg::U32(ex.wblock));
                            args.extend_from_slice(&tail[1..]);
                            args.extend(sm90_split_arg(module));
                            gpu.launch(module, kernel, grid, &args)
                        }
                        PrefillLaunch::Rs(kernel, grid) => {
                            let map = match self.down_rows_in_epilogue() {
                                Some(_) => self.rs_maps(true)?,
                                None => self.enqueue_rs_tokens(p(&ws.a2q), p(&ws.a2s), true)?,
                            };
                            let (_, w) = ex.decode_weights(gpu, DecodeLayout::Tiles);
                            let mut args = vec![
                                KArg::U64(map.0),
                                KArg::U32(map.1),
                                KArg::U32(i as u32),
                                KArg::U64(w[4]),
                                KArg::U64(w[5]),
                            ];
                            args.extend_from_slice(&tail);
                            gpu.launch(&MOE_GEMM_SM90, kernel, grid, &args)
                        }
                    }
                }
            },
            Stage::GateUp | Stage::Down => Ok(()),
            Stage::Epilogue => {
                self.enqueue_shared()?;
                self.enqueue_combine(false)
            }
        }
    }

    // ---- decode GEMMs (kernels/moe_decode.cu, src/backend/cuda/moe_decode.rs) ----

    /// The grouped GEMM kernels this forward runs: decided from the shapes and the token
    /// count alone, so a captured graph and an eager run use the same ones.
    pub fn choose_gemm(&self) -> GemmKind {
        // a prefill kernel pinned by set_prefill_gemm runs at every batch size
        if self.prefill != PrefillGemm::Auto {
            return GemmKind::Tiled;
        }
        let c = &self.layer.config;
        let wblock = self.layer.nvfp4.as_ref().map_or(0, |x| x.wblock);
        moe_decode::choose(
            self.ws.tokens,
            wblock,
            c.hidden_size,
            c.moe_intermediate_size,
        )
    }

    fn decode_args(
        &self,
        aq: u64,
        a_scales: u64,
        k: usize,
        nout: usize,
        g_rows: u32,
        layout: DecodeLayout,
    ) -> DecodeArgs {
        DecodeArgs {
            aq,
            a_scales,
            k,
            nout,
            slots: self
                .layer
                .config
                .n_routed_experts
                .min(self.ws.tokens * self.ws.k),
            expert_offsets: self.gpu().ptr(&self.ws.expert_offsets),
            active: self.gpu().ptr(&self.ws.active_experts),
            g_rows,
            layout,
        }
    }

    /// Where the decode GEMMs read the weights from (tests and benchmarks compare the two;
    /// a forward that does not take the decode GEMMs has no tiles and reads rows).
    pub fn set_decode_layout(&mut self, layout: DecodeLayout) {
        self.decode_layout = layout;
    }

    // ---- end of the decode GEMMs ----

    /// Shared experts (BF16, identical in both paths): cuBLAS GEMMs around a BF16 SwiGLU.
    fn enqueue_shared(&self) -> Result<()> {
        let (Some(sh), Some(sw), Some(xb)) =
            (&self.layer.shared, &self.ws.shared, &self.ws.hidden_bf16)
        else {
            return Ok(());
        };
        let gpu = self.gpu();
        let c = &self.layer.config;
        let (t, h, si) = (self.ws.tokens, c.hidden_size, sh.inter);
        if t == 0 {
            return Ok(());
        }
        if !self.hidden_bf16_set.load(Ordering::Relaxed) {
            // set_hidden uploaded the BF16 copy only where it is exact
            self.enqueue_gather_bf16(0, t, gpu.ptr(xb))?;
        }
        blas::gemm_bf16(
            gpu,
            t,
            si,
            h,
            gpu.ptr(xb),
            gpu.ptr(&sh.w1),
            gpu.ptr(&sw.g),
            blas::Out::F32,
            "shared expert gate_proj",
        )?;
        blas::gemm_bf16(
            gpu,
            t,
            si,
            h,
            gpu.ptr(xb),
            gpu.ptr(&sh.w3),
            gpu.ptr(&sw.u),
            blas::Out::F32,
            "shared expert up_proj",
        )?;
        self.enqueue_swiglu_bf16(
            gpu.ptr(&sw.g),
            gpu.ptr(&sw.u),
            (t * si) as u64,
            gpu.ptr(&sw.a),
        )?;
        blas::gemm_bf16(
            gpu,
            t,
            h,
            si,
            gpu.ptr(&sw.a),
            gpu.ptr(&sh.w2),
            gpu.ptr(&sw.y),
            blas::Out::F32,
            "shared expert down_proj",
        )
    }

    /// `dst[p, :] = bf16(hidden[rows[p], :])` for p < n (`rows` 0: the identity).
    fn enqueue_gather_bf16(&self, rows: u64, n: usize, dst: u64) -> Result<()> {
        let gpu = self.gpu();
        let h = self.layer.config.hidden_size;
        gpu.launch(
            &MOE,
            "gather_rows_bf16",
            grid_1d((n * h / cols_per_thread(h)) as u64, ELEM_THREADS)?,
            &[
                KArg::U64(gpu.ptr(&self.ws.hidden)),
                KArg::U64(rows),
                KArg::U32(n as u32),
                KArg::U32(h as u32),
                KArg::U64(dst),
            ],
        )
    }

    fn enqueue_swiglu_bf16(&self, g: u64, u: u64, n: u64, a: u64) -> Result<()> {
        let (limit, has_limit) = match self.layer.config.swiglu_limit {
            Some(l) => (l, 1u32),
            None => (0.0, 0u32),
        };
        self.gpu().launch(
            &MOE,
            "swiglu_bf16",
            grid_1d(n.div_ceil(4), ELEM_THREADS)?,
            &[
                KArg::U64(g),
                KArg::U64(u),
                KArg::U64(n),
                KArg::F32(limit),
                KArg::U32(has_limit),
                KArg::U64(a),
            ],
        )
    }

    /// `Σ_slot w · y + shared` per token, in slot order: `ws.y` holds the NVFP4 down GEMMs'
    /// BF16 rows (`moe_combine`) or, `f32_rows`, the reference's cuBLAS f32 rows.
    fn enqueue_combine(&self, f32_rows: bool) -> Result<()> {
        let gpu = self.gpu();
        let ws = &self.ws;
        let h = self.layer.config.hidden_size;
        if ws.tokens == 0 {
            return Ok(());
        }
        gpu.launch(
            &MOE,
            if f32_rows {
                "moe_combine_f32"
            } else {
                "moe_combine"
            },
            LaunchConfig {
                grid_dim: (
                    ws.tokens as u32,
                    (h / cols_per_thread(h)).div_ceil(ELEM_THREADS as usize) as u32,
                    1,
                ),
                block_dim: (ELEM_THREADS, 1, 1),
                shared_mem_bytes: 0,
            },
            &[
                KArg::U64(gpu.ptr(&ws.y)),
                KArg::U64(gpu.ptr(&ws.entry_pos)),
                KArg::U64(gpu.ptr(&ws.topk_w)),
                KArg::U32(ws.tokens as u32),
                KArg::U32(ws.k as u32),
                KArg::U32(h as u32),
                KArg::U64(ws.shared.as_ref().map_or(0, |s| gpu.ptr(&s.y))),
                KArg::U64(gpu.ptr(&ws.out)),
                KArg::U64(ws.per_slot.as_ref().map_or(0, |s| gpu.ptr(s))),
            ],
        )
    }

    /// The BF16 reference: gathered BF16 rows, cuBLAS GEMMs per expert (FP32 accumulation),
    /// `bf16(swiglu)` in between, then the same combine.
    fn run_reference(&self) -> Result<()> {
        let gpu = self.gpu();
        let ws = &self.ws;
        let c = &self.layer.config;
        let (h, i, e) = (c.hidden_size, c.moe_intermediate_size, c.n_routed_experts);
        let n = ws.tokens * ws.k;
        let rf = self
            .layer
            .reference
            .as_ref()
            .ok_or_else(|| Error::usage("reference weights were not uploaded"))?;
        self.enqueue_route()?;
        self.enqueue_sort()?;
        if n > 0 {
            self.enqueue_gather_bf16(gpu.ptr(&ws.sorted_token), n, gpu.ptr(&ws.xg_bf16))?;
            let offs = gpu.download(&ws.expert_offsets, e + 1, "expert offsets")?;
            let (xg, g, u, a, y) = (
                gpu.ptr(&ws.xg_bf16),
                gpu.ptr(&ws.a_f32),
                gpu.ptr(&ws.u_f32),
                gpu.ptr(&ws.a_bf16),
                gpu.ptr(&ws.y),
            );
            let (w1, w3, w2) = (gpu.ptr(&rf.w1), gpu.ptr(&rf.w3), gpu.ptr(&rf.w2));
            for x in 0..e {
                let (r0, r1) = (offs[x] as usize, offs[x + 1] as usize);
                if r1 <= r0 {
                    continue;
                }
                let m = r1 - r0;
                let wo = (x * i * h * 2) as u64;
                blas::gemm_bf16(
                    gpu,
                    m,
                    i,
                    h,
                    xg + (r0 * h * 2) as u64,
                    w1 + wo,
                    g + (r0 * i * 4) as u64,
                    blas::Out::F32,
                    "reference gate_proj",
                )?;
                blas::gemm_bf16(
                    gpu,
                    m,
                    i,
                    h,
                    xg + (r0 * h * 2) as u64,
                    w3 + wo,
                    u + (r0 * i * 4) as u64,
                    blas::Out::F32,
                    "reference up_proj",
                )?;
            }
            self.enqueue_swiglu_bf16(g, u, (n * i) as u64, a)?;
            for x in 0..e {
                let (r0, r1) = (offs[x] as usize, offs[x + 1] as usize);
                if r1 <= r0 {
                    continue;
                }
                let wo = (x * h * i * 2) as u64;
                blas::gemm_bf16(
                    gpu,
                    r1 - r0,
                    h,
                    i,
                    a + (r0 * i * 2) as u64,
                    w2 + wo,
                    y + (r0 * h * 4) as u64,
                    blas::Out::F32,
                    "reference down_proj",
                )?;
            }
        }
        self.enqueue_shared()?;
        self.enqueue_combine(true)
    }

    /// Capture the NVFP4 forward in a CUDA graph (after one eager warm-up run, so modules
    /// and cuBLAS are loaded outside the capture). Replaying it recomputes from the current
    /// contents of the input buffers ([`Nvfp4Forward::set_hidden`] between replays).
    pub fn capture(&self) -> Result<LayerGraph<'_>> {
        if self.want != Want::Nvfp4 {
            return Err(Error::usage(
                "only the NVFP4 forward can be captured in a CUDA graph",
            ));
        }
        let gpu = self.gpu();
        self.enqueue_nvfp4()?;
        gpu.sync("the warm-up forward before graph capture")?;
        gpu.capturing.store(true, Ordering::Relaxed);
        let r = (|| {
            gpu.stream
                .begin_capture(drv_sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                .map_err(|e| super::device::driver_err("beginning stream capture", "-", e))?;
            let enq = self.enqueue_nvfp4();
            let graph = gpu
                .stream
                .end_capture(drv_sys::CUgraphInstantiate_flags(0))
                .map_err(|e| super::device::driver_err("ending stream capture", "moe forward", e));
            enq?;
            graph?.ok_or_else(|| Error::Cuda {
                step: "stream capture".into(),
                kernel: "moe forward".into(),
                what: "the capture produced no graph".into(),
            })
        })();
        gpu.capturing.store(false, Ordering::Relaxed);
        Ok(LayerGraph {
            graph: r?,
            fwd: self,
            input_exact: self.hidden_bf16_set.load(Ordering::Relaxed),
        })
    }
}

/// A captured layer forward.
pub struct LayerGraph<'a> {
    graph: CudaGraph,
    fwd: &'a Nvfp4Forward,
    /// Captured with the BF16 copy that set_hidden uploads (a BF16-exact input): the graph
    /// reads it instead of making it.
    input_exact: bool,
}

impl LayerGraph<'_> {
    /// Replay the captured forward on the stream (asynchronous).
    pub fn replay(&self) -> Result<()> {
        self.graph
            .launch()
            .map_err(|e| super::device::driver_err("replaying the layer graph", "moe forward", e))
    }

    /// Time `n` replays with CUDA events (after one untimed replay); returns each replay's
    /// milliseconds. Inputs stay as they are, so every replay computes the same thing.
    pub fn time_replays(&self, n: usize) -> Result<Vec<f32>> {
        let gpu = self.fwd.gpu();
        let ev = |what: &str| {
            gpu.stream
                .record_event(Some(drv_sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(|e| super::device::driver_err(what, "moe forward", e))
        };
        self.replay()?;
        let mut marks = vec![ev("recording a timing event")?];
        for _ in 0..n {
            self.replay()?;
            marks.push(ev("recording a timing event")?);
        }
        gpu.sync("timing graph replays")?;
        marks
            .windows(2)
            .map(|w| {
                w[0].elapsed_ms(&w[1]).map_err(|e| {
                    super::device::driver_err("reading a timing event", "moe forward", e)
                })
            })
            .collect()
    }

    /// New layer input for the next replay. A graph captured on a BF16-exact input reads the
    /// BF16 copy that set_hidden uploads (the router's BF16 logits, the shared expert) and
    /// refuses an input that is not BF16-exact (capture the forward again on it).
    pub fn set_hidden(&self, hidden: &[f32]) -> Result<()> {
        self.fwd.upload_hidden(hidden, self.input_exact)
    }

    /// Replay and bring the output back.
    pub fn run(&self) -> Result<MoeOutput> {
        self.replay()?;
        self.fwd.output()
    }
}

/// `Backend::moe_forward` on the GPU: stream the layer's weights, run, bring it back.
pub fn moe_forward(
    gpu: &Arc<Gpu>,
    layer: &MoeLayer,
    hidden: &[f32],
    routing: &Routing,
    path: &Path,
    per_slot: bool,
) -> Result<MoeOutput> {
    let h = layer.config.hidden_size;
    if h == 0 || !hidden.len().is_multiple_of(h) {
        return Err(Error::usage(format!(
            "MoE layer {}: hidden states of {} values are not [tokens, {h}]",
            layer.index,
            hidden.len()
        )));
    }
    let tokens = hidden.len() / h;
    check_routing(layer, routing, tokens)?;
    let mut f = match path {
        Path::Nvfp4 { scales, flavor } => Nvfp4Forward::prepare(
            gpu,
            layer,
            tokens,
            routing.top_k,
            Some((scales, *flavor)),
            per_slot,
        )?,
        Path::Reference => {
            Nvfp4Forward::prepare(gpu, layer, tokens, routing.top_k, None, per_slot)?
        }
    };
    f.set_hidden(hidden)?;
    f.set_routing(layer, routing)?;
    f.run()
}
