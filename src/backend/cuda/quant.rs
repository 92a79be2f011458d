//! Launch wrappers for kernels/quant.cu: NVFP4 (both flavors) and MXFP4 quantization, scale
//! swizzling, and flipped-code counts. Device-level functions take and return device buffers;
//! the host-level ones mirror `crate::nvfp4` so tests compare them bit for bit.

use super::device::{grid_1d, Gpu, KArg};
use super::nvrtc::{define_value, QUANT};
use crate::error::{Error, Result};
use crate::nvfp4::layout::{swizzled_len, ScaleLayout};
use crate::nvfp4::{BlockStats, Flavor, Format, Fp4Tensor};
use cudarc::driver::CudaSlice;

const THREADS: u32 = 256;

/// Activations on the GPU: f32, or BF16 as raw bits.
#[derive(Clone, Copy)]
pub enum DevRows<'a> {
    F32(&'a CudaSlice<f32>),
    Bf16(&'a CudaSlice<u16>),
}

impl DevRows<'_> {
    fn len(&self) -> usize {
        match self {
            DevRows::F32(s) => s.len(),
            DevRows::Bf16(s) => s.len(),
        }
    }
    fn ptr(&self, gpu: &Gpu) -> u64 {
        match self {
            DevRows::F32(s) => gpu.ptr(*s),
            DevRows::Bf16(s) => gpu.ptr(*s),
        }
    }
}

/// A quantized tensor on the GPU.
pub struct DevFp4 {
    pub format: Format,
    pub rows: usize,
    pub cols: usize,
    /// `[rows, cols/2]`
    pub packed: CudaSlice<u8>,
    /// `[rows, cols/block]` (linear) or the padded 128x4 swizzle.
    pub scales: CudaSlice<u8>,
    pub layout: ScaleLayout,
    /// blocks, saturated, flushed, nan_scales
    pub stats: CudaSlice<u64>,
    pub scale_2: f32,
}

pub(crate) fn flavor_code(f: Flavor) -> u32 {
    match f {
        Flavor::Reference => 0,
        Flavor::CudaFast => 1,
    }
}

fn check_shape(len: usize, rows: usize, cols: usize, block: usize, what: &str) -> Result<()> {
    if cols == 0 || !cols.is_multiple_of(block) {
        return Err(Error::usage(format!(
            "{what}: {cols} columns is not a positive multiple of the block size {block}"
        )));
    }
    if rows.checked_mul(cols) != Some(len) {
        return Err(Error::usage(format!(
            "{what}: {len} values do not form [{rows}, {cols}]"
        )));
    }
    Ok(())
}

fn scale_len(rows: usize, kb: usize, layout: ScaleLayout) -> usize {
    match layout {
        ScaleLayout::Linear => rows * kb,
        ScaleLayout::Swizzled => swizzled_len(rows, kb),
    }
}

fn grid_for(rows: usize, kb: usize, layout: ScaleLayout) -> Result<cudarc::driver::LaunchConfig> {
    let n = scale_len(rows, kb, layout) as u64;
    grid_1d(n, THREADS)
}

/// Blocks of a row per thread of the NVFP4 quantizer (kernels/quant.cu QUANT_BLOCKS).
const QUANT_BLOCKS: usize = 4;
/// The BF16 grid kernel's CTA size (kernels/quant.cu QUANT_BF16_THREADS).
const BF16_THREADS: u32 = 128;

/// The quantizer's compile-time knobs that set its grid (kernels/quant.cu, "Tuning knobs"):
/// QUANT_BLOCKS (blocks of a row per thread), and for the BF16 kernel QUANT_PIPE (units per
/// thread) and QUANT_COALESCED (a warp's chunk of 32 x QUANT_BLOCKS blocks across rows).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct QuantKnobs {
    blocks: usize,
    pipe: usize,
    coalesced: bool,
    /// QUANT_TRANSPOSE: the grid kernel's warps load their groups warp-wide where they can.
    transpose: bool,
    /// The bulk kernel's blocks per lane per tile and tiles in flight per warp.
    bulk_qb: usize,
    bulk_stages: usize,
    /// Whether the bulk kernel's tiles are sized to fill the last round (`-DBULK_BALANCE=0`:
    /// always 32 BULK_QB blocks; read here only, for an A/B).
    bulk_balance: bool,
    /// QUANT_BF16_THREADS: the BF16 grid kernel's CTA size.
    bf16_threads: u32,
    /// QUANT_FLAT and QUANT_FLAT_PATH: linear BF16 tensors take the flat path.
    flat_path: bool,
    /// The flat path's tail: QUANT_TAIL CTAs per SM (read here only; 0: none) of
    /// QUANT_TAIL_WARPS working warps each, last in the grid. 7, one wave of the kernel's 7
    /// CTAs an SM (QUANT_MIN_BLOCKS), since session 36 (kernels/quant.cu, QUANT_TAIL_WARPS).
    tail_per_sm: u32,
    tail_warps: u32,
}

impl QuantKnobs {
    const DEFAULT: QuantKnobs = QuantKnobs {
        blocks: QUANT_BLOCKS,
        pipe: 1,
        coalesced: false,
        transpose: true,
        bulk_qb: 4,
        bulk_stages: 2,
        bulk_balance: true,
        bf16_threads: BF16_THREADS,
        flat_path: true,
        tail_per_sm: 7,
        tail_warps: 2,
    };

    fn from_defines(d: &str) -> QuantKnobs {
        let k = QuantKnobs::DEFAULT;
        QuantKnobs {
            blocks: define_value(d, "QUANT_BLOCKS").map_or(k.blocks, |b| (b as usize).max(1)),
            pipe: define_value(d, "QUANT_PIPE").map_or(k.pipe, |n| (n as usize).max(1)),
            coalesced: define_value(d, "QUANT_COALESCED").map_or(k.coalesced, |c| c != 0),
            transpose: define_value(d, "QUANT_TRANSPOSE").map_or(k.transpose, |t| t != 0),
            bulk_qb: define_value(d, "BULK_QB").map_or(k.bulk_qb, |b| (b as usize).max(1)),
            bulk_stages: define_value(d, "BULK_STAGES")
                .map_or(k.bulk_stages, |b| (b as usize).max(1)),
            bulk_balance: define_value(d, "BULK_BALANCE").map_or(k.bulk_balance, |b| b != 0),
            bf16_threads: define_value(d, "QUANT_BF16_THREADS")
                .map_or(k.bf16_threads, |t| (t as u32).clamp(32, 1024)),
            flat_path: define_value(d, "QUANT_FLAT").is_none_or(|f| f != 0)
                && define_value(d, "QUANT_FLAT_PATH").is_none_or(|f| f != 0),
            tail_per_sm: define_value(d, "QUANT_TAIL").map_or(k.tail_per_sm, |t| t as u32),
            tail_warps: define_value(d, "QUANT_TAIL_WARPS")
                .map_or(k.tail_warps, |t| (t as u32).max(1)),
        }
    }

    /// The bulk kernel's dynamic shared memory (kernels/quant.cu: the barriers, then each of
    /// the 8 warps' BULK_STAGES tiles of 32 BULK_QB blocks of 32 bytes).
    fn bulk_smem(&self) -> u32 {
        (1024 + 8 * self.bulk_stages * 32 * self.bulk_qb * 32) as u32
    }
}

/// The knobs the quantizer was compiled with: the defaults, which a sweep may override
/// through NVFP4DBG_NVRTC_DEFINES (bench/gpu-sweep-quant.sh); read once, as the module is
/// compiled once per process.
fn quant_knobs() -> QuantKnobs {
    static KNOBS: std::sync::OnceLock<QuantKnobs> = std::sync::OnceLock::new();
    *KNOBS.get_or_init(|| {
        QuantKnobs::from_defines(&std::env::var("NVFP4DBG_NVRTC_DEFINES").unwrap_or_default())
    })
}

/// The f32 NVFP4 quantizer's grid: one thread per QUANT_BLOCKS blocks of a row
/// (kernels/quant.cu `nvfp4_quantize`, QUANT_THREADS threads).
pub(crate) fn nvfp4_grid(
    rows: usize,
    kb: usize,
    layout: ScaleLayout,
) -> Result<cudarc::driver::LaunchConfig> {
    nvfp4_grid_for(rows, kb, layout, quant_knobs().blocks)
}

/// `nvfp4_rows_scatter_*` (kernels/quant.cu) runs: it needs QUANT_BLOCKS 4 (a group is two
/// 32-code units of the register-A rows), the default, which a `-DQUANT_BLOCKS` may change.
pub(crate) fn rows_scatter_fits() -> bool {
    quant_knobs().blocks == 4
}

/// `nvfp4_rows_scatter_*`'s dynamic shared memory: RS_SCATTER_WARP_BYTES for each warp.
pub(crate) const ROWS_SCATTER_SMEM: u32 = THREADS / 32 * 544 * 16;

fn padded(rows: usize, kb: usize, layout: ScaleLayout) -> (usize, usize) {
    match layout {
        ScaleLayout::Linear => (rows, kb),
        ScaleLayout::Swizzled => (rows.div_ceil(128) * 128, kb.div_ceil(4) * 4),
    }
}

fn nvfp4_grid_for(
    rows: usize,
    kb: usize,
    layout: ScaleLayout,
    blocks: usize,
) -> Result<cudarc::driver::LaunchConfig> {
    let (rows_g, kb_g) = padded(rows, kb, layout);
    grid_1d((rows_g * kb_g.div_ceil(blocks)) as u64, THREADS)
}

/// The BF16 NVFP4 quantizer's grid: its virtual threads (one per group of QUANT_BLOCKS
/// blocks of a row; with QUANT_COALESCED 32 per chunk of 32 x QUANT_BLOCKS blocks of the
/// flat, padded where swizzled, scale matrix), QUANT_PIPE of them per thread.
fn nvfp4_grid_bf16(
    rows: usize,
    kb: usize,
    layout: ScaleLayout,
) -> Result<cudarc::driver::LaunchConfig> {
    nvfp4_grid_bf16_for(rows, kb, layout, quant_knobs())
}

fn nvfp4_grid_bf16_for(
    rows: usize,
    kb: usize,
    layout: ScaleLayout,
    k: QuantKnobs,
) -> Result<cudarc::driver::LaunchConfig> {
    let (rows_g, kb_g) = padded(rows, kb, layout);
    let virt = if k.coalesced {
        32 * (rows_g * kb_g).div_ceil(32 * k.blocks)
    } else {
        rows_g * kb_g.div_ceil(k.blocks)
    };
    grid_1d(virt.div_ceil(k.pipe) as u64, k.bf16_threads)
}

/// NVFP4-quantize `[rows, cols]` on the GPU with quant-direction global scale `gs`.
pub fn quantize_nvfp4_dev(
    gpu: &Gpu,
    x: DevRows<'_>,
    rows: usize,
    cols: usize,
    gs: f32,
    flavor: Flavor,
    layout: ScaleLayout,
) -> Result<DevFp4> {
    check_shape(x.len(), rows, cols, 16, "nvfp4 quantize")?;
    let gs_dev = gpu.upload(&[gs], "the global scale")?;
    let mut out = DevFp4::alloc_nvfp4(gpu, rows, cols, layout)?;
    out.scale_2 = 1.0 / gs;
    enqueue_quantize_nvfp4(gpu, x, &gs_dev, flavor, &out)?;
    // dropping gs_dev frees it in stream order, after the kernel
    drop(gs_dev);
    Ok(out)
}

impl DevFp4 {
    /// Outputs of an NVFP4 quantization of `[rows, cols]` (codes and scales poisoned with
    /// 0xFF, statistics zeroed); `scale_2` is the caller's to set.
    pub fn alloc_nvfp4(gpu: &Gpu, rows: usize, cols: usize, layout: ScaleLayout) -> Result<Self> {
        check_shape(rows * cols, rows, cols, 16, "nvfp4 quantize")?;
        let kb = cols / 16;
        Ok(DevFp4 {
            format: Format::Nvfp4,
            rows,
            cols,
            packed: gpu.alloc::<u8>(rows * cols / 2, "packed FP4 codes")?,
            scales: gpu.alloc::<u8>(scale_len(rows, kb, layout), "block scales")?,
            layout,
            stats: gpu.zeros::<u64>(4, "block statistics")?,
            scale_2: 1.0,
        })
    }
}

/// The two BF16 NVFP4 quantizers (the same codes, scales and statistics): one thread per
/// group of a row's blocks (any layout, gather, per-row global scales; where a warp's groups
/// are one contiguous run, the warp loads them 512 bytes a load), or the persistent one
/// streaming the tensor as flat blocks through bulk copies (sm_90 and newer, linear scales).
/// kernels/quant.cu says why each is faster where it is chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bf16Kernel {
    Grid,
    Bulk,
}

/// The kernel for `x` into `out`: the grid one where its warps load warp-wide (linear scales,
/// rows of whole groups: the fastest), else the bulk one where it applies, else the grid one.
/// `NVFP4DBG_QUANT=grid|bulk` picks one wherever it applies (an A/B on one build).
fn bf16_kernel(gpu: &Gpu, x: DevRows<'_>, out: &DevFp4) -> Bf16Kernel {
    static FORCED: std::sync::OnceLock<Option<Bf16Kernel>> = std::sync::OnceLock::new();
    let forced = *FORCED.get_or_init(|| match std::env::var("NVFP4DBG_QUANT").as_deref() {
        Ok("grid") => Some(Bf16Kernel::Grid),
        Ok("bulk") => Some(Bf16Kernel::Bulk),
        _ => None,
    });
    let bulk = bulk_applies(gpu, x, out);
    match forced {
        Some(Bf16Kernel::Bulk) if bulk => Bf16Kernel::Bulk,
        Some(_) => Bf16Kernel::Grid,
        None if bulk && !warp_wide(gpu, x, out) => Bf16Kernel::Bulk,
        None => Bf16Kernel::Grid,
    }
}

/// Whether the grid kernel's warps load their groups warp-wide (kernels/quant.cu,
/// QUANT_TRANSPOSE: linear scales, no gather, rows of whole groups; the last warp of a tensor
/// whose group count is not a multiple of 32 loads per thread).
fn warp_wide(gpu: &Gpu, x: DevRows<'_>, out: &DevFp4) -> bool {
    let k = quant_knobs();
    k.transpose
        && k.pipe == 1
        && !k.coalesced
        && out.layout == ScaleLayout::Linear
        && x.ptr(gpu).is_multiple_of(16)
        && out.cols.is_multiple_of(16 * k.blocks)
}

/// The bulk kernel's tile in blocks for `n` blocks over `warps` warps, tiles of at most `max`
/// (a multiple of 32) dealt in turn: a multiple of 4 (128-byte aligned copies: 125-block tiles
/// measured 3% slower than 128-block ones), at least 32 (a small tensor leaves warps idle rather
/// than lanes), and of the first few round counts (a round: a tile for every warp) the one
/// whose busiest warp has the fewest blocks, so that the last round is nearly full (at 8192 x
/// 7168 on 2112 warps: 116-block tiles, 1740 blocks for the busiest warp where 128-block tiles
/// give 1792; 1737.7 is the mean).
fn bulk_tile(n: u64, warps: u64, max: u64) -> u64 {
    let warps = warps.max(1);
    let r0 = n.div_ceil(warps * max).max(1);
    (r0..r0 + 4)
        .map(|r| (4 * n.div_ceil(4 * warps * r)).max(32))
        .filter(|&t| t <= max)
        .min_by_key(|&t| n.div_ceil(t * warps) * t)
        .unwrap_or(max)
}

const BULK_NEEDS: &str =
    "the bulk BF16 quantizer needs sm_90 or newer, linear scales and a 16-byte aligned input";

fn bulk_applies(gpu: &Gpu, x: DevRows<'_>, out: &DevFp4) -> bool {
    gpu.compute_capability.0 >= 9
        && out.layout == ScaleLayout::Linear
        && x.ptr(gpu).is_multiple_of(16)
        && gpu.ptr(&out.packed).is_multiple_of(8)
}

/// Enqueue the NVFP4 quantization of `x` into `out` (shape and layout from `out`) with the
/// global scale `gs[0]` on the device: no allocation, no copy, so it can be timed alone or
/// captured. Block statistics add up into `out.stats`.
pub fn enqueue_quantize_nvfp4(
    gpu: &Gpu,
    x: DevRows<'_>,
    gs: &CudaSlice<f32>,
    flavor: Flavor,
    out: &DevFp4,
) -> Result<()> {
    let kernel = match x {
        DevRows::Bf16(_) => Some(bf16_kernel(gpu, x, out)),
        DevRows::F32(_) => None,
    };
    enqueue_nvfp4(gpu, x, gs, flavor, out, kernel)
}

/// [`enqueue_quantize_nvfp4`] of BF16 rows with the kernel named (the GPU tests hold one
/// against the other); the bulk kernel where it does not apply is an error.
pub fn enqueue_quantize_nvfp4_bf16_with(
    gpu: &Gpu,
    x: &CudaSlice<u16>,
    gs: &CudaSlice<f32>,
    flavor: Flavor,
    out: &DevFp4,
    kernel: Bf16Kernel,
) -> Result<()> {
    let x = DevRows::Bf16(x);
    if kernel == Bf16Kernel::Bulk && !bulk_applies(gpu, x, out) {
        return Err(Error::usage(BULK_NEEDS));
    }
    enqueue_nvfp4(gpu, x, gs, flavor, out, Some(kernel))
}

fn enqueue_nvfp4(
    gpu: &Gpu,
    x: DevRows<'_>,
    gs: &CudaSlice<f32>,
    flavor: Flavor,
    out: &DevFp4,
    bf16: Option<Bf16Kernel>,
) -> Result<()> {
    let (rows, cols, layout) = (out.rows, out.cols, out.layout);
    check_shape(x.len(), rows, cols, 16, "nvfp4 quantize")?;
    if out.format != Format::Nvfp4 || gs.is_empty() {
        return Err(Error::usage(
            "nvfp4 quantize: the output is not NVFP4, or no global scale was given",
        ));
    }
    if bf16 == Some(Bf16Kernel::Bulk) {
        const KERNEL: &str = "nvfp4_quantize_bf16_bulk";
        let k = quant_knobs();
        let grid = gpu.persistent_grid(&QUANT, KERNEL, THREADS, k.bulk_smem())?;
        let n = (rows * cols / 16) as u64;
        let warps = grid.grid_dim.0 as u64 * (THREADS / 32) as u64;
        return gpu.launch(
            &QUANT,
            KERNEL,
            grid,
            &[
                KArg::U64(x.ptr(gpu)),
                KArg::U64(n),
                KArg::U64(if k.bulk_balance {
                    bulk_tile(n, warps, 32 * k.bulk_qb as u64)
                } else {
                    32 * k.bulk_qb as u64
                }),
                KArg::U64(gpu.ptr(gs)),
                KArg::U64(gpu.ptr(&out.packed)),
                KArg::U64(gpu.ptr(&out.scales)),
                KArg::U64(gpu.ptr(&out.stats)),
                KArg::U32(flavor_code(flavor)),
            ],
        );
    }
    let (kernel, grid, tail0) = match x {
        DevRows::F32(_) => (
            "nvfp4_quantize_f32",
            nvfp4_grid(rows, cols / 16, layout)?,
            None,
        ),
        DevRows::Bf16(_) => {
            let k = quant_knobs();
            let flat = layout == ScaleLayout::Linear
                && k.flat_path
                && k.transpose
                && k.pipe == 1
                && !k.coalesced;
            let (grid, tail0) = if flat && k.tail_per_sm > 0 {
                let runs = ((rows * (cols / 16)).div_ceil(k.blocks) as u64).div_ceil(32);
                let tail = k.tail_per_sm as u64 * gpu.multiprocessors()? as u64;
                let (ctas, tail0) = flat_tail_grid(
                    runs,
                    (k.bf16_threads / 32) as u64,
                    k.tail_warps as u64,
                    tail,
                );
                let grid = cudarc::driver::LaunchConfig {
                    grid_dim: (ctas as u32, 1, 1),
                    block_dim: (k.bf16_threads, 1, 1),
                    shared_mem_bytes: 0,
                };
                (grid, tail0 as u32)
            } else {
                (nvfp4_grid_bf16(rows, cols / 16, layout)?, u32::MAX)
            };
            ("nvfp4_quantize_bf16", grid, Some(tail0))
        }
    };
    let mut args = vec![
        KArg::U64(x.ptr(gpu)),
        KArg::U64(rows as u64),
        KArg::U32(cols as u32),
        KArg::U64(0),
        KArg::U64(gpu.ptr(gs)),
        KArg::U64(0),
        KArg::U64(gpu.ptr(&out.packed)),
        KArg::U64(gpu.ptr(&out.scales)),
        KArg::U32((layout == ScaleLayout::Swizzled) as u32),
        KArg::U64(gpu.ptr(&out.stats)),
        KArg::U32(flavor_code(flavor)),
    ];
    args.extend(tail0.map(KArg::U32));
    gpu.launch(&QUANT, kernel, grid, &args)
}

/// The flat BF16 path's grid with its tail (kernels/quant.cu QUANT_TAIL_WARPS): `runs` warp
/// runs of 32 groups, `warps` a CTA up to its `tail_ctas` last CTAs (fewer where the runs
/// are few), which take `tail_warps` each; every CTA has work. (CTAs, the first tail CTA.)
fn flat_tail_grid(runs: u64, warps: u64, tail_warps: u64, tail_ctas: u64) -> (u64, u64) {
    let tail = tail_ctas.min(runs.div_ceil(tail_warps));
    let head = runs.saturating_sub(tail * tail_warps).div_ceil(warps);
    // what the head's last CTA takes past its share, the tail need not
    let tail = runs.saturating_sub(head * warps).div_ceil(tail_warps);
    ((head + tail).max(1), head)
}

/// MXFP4-quantize `[rows, cols]` on the GPU.
pub fn quantize_mxfp4_dev(
    gpu: &Gpu,
    x: DevRows<'_>,
    rows: usize,
    cols: usize,
    layout: ScaleLayout,
) -> Result<DevFp4> {
    check_shape(x.len(), rows, cols, 32, "mxfp4 quantize")?;
    let kb = cols / 32;
    let packed = gpu.alloc::<u8>(rows * cols / 2, "packed FP4 codes")?;
    let scales = gpu.alloc::<u8>(scale_len(rows, kb, layout), "block scales")?;
    let stats = gpu.zeros::<u64>(4, "block statistics")?;
    let kernel = match x {
        DevRows::F32(_) => "mxfp4_quantize_f32",
        DevRows::Bf16(_) => "mxfp4_quantize_bf16",
    };
    gpu.launch(
        &QUANT,
        kernel,
        grid_for(rows, kb, layout)?,
        &[
            KArg::U64(x.ptr(gpu)),
            KArg::U64(rows as u64),
            KArg::U32(cols as u32),
            KArg::U64(gpu.ptr(&packed)),
            KArg::U64(gpu.ptr(&scales)),
            KArg::U32((layout == ScaleLayout::Swizzled) as u32),
            KArg::U64(gpu.ptr(&stats)),
        ],
    )?;
    Ok(DevFp4 {
        format: Format::Mxfp4,
        rows,
        cols,
        packed,
        scales,
        layout,
        stats,
        scale_2: 1.0,
    })
}

pub(crate) fn stats_from(v: &[u64]) -> BlockStats {
    BlockStats {
        blocks: v.first().copied().unwrap_or(0),
        saturated: v.get(1).copied().unwrap_or(0),
        flushed: v.get(2).copied().unwrap_or(0),
        nan_scales: v.get(3).copied().unwrap_or(0),
    }
}

impl DevFp4 {
    pub fn block_stats(&self, gpu: &Gpu) -> Result<BlockStats> {
        Ok(stats_from(&gpu.download(
            &self.stats,
            4,
            "block statistics",
        )?))
    }

    /// Bring the tensor back as an [`Fp4Tensor`] (linear scales; swizzled ones are undone
    /// on the GPU first).
    pub fn to_host(&self, gpu: &Gpu) -> Result<Fp4Tensor> {
        let kb = self.cols / self.format.block();
        let packed = gpu.download(&self.packed, self.rows * self.cols / 2, "packed FP4 codes")?;
        let scales = match self.layout {
            ScaleLayout::Linear => gpu.download(&self.scales, self.rows * kb, "block scales")?,
            ScaleLayout::Swizzled => {
                let lin = unswizzle_dev(gpu, &self.scales, self.rows, kb)?;
                gpu.download(&lin, self.rows * kb, "block scales")?
            }
        };
        Ok(Fp4Tensor {
            format: self.format,
            rows: self.rows,
            cols: self.cols,
            packed,
            scales,
            scale_2: self.scale_2,
        })
    }

    /// The scale bytes exactly as they are on the GPU (swizzled ones with their padding).
    pub fn raw_scales(&self, gpu: &Gpu) -> Result<Vec<u8>> {
        let kb = self.cols / self.format.block();
        gpu.download(
            &self.scales,
            scale_len(self.rows, kb, self.layout),
            "block scales",
        )
    }
}

/// Linear `[rows, kb]` scales → the 128x4 swizzle (zero padding), on the GPU.
pub fn swizzle_dev(
    gpu: &Gpu,
    linear: &CudaSlice<u8>,
    rows: usize,
    kb: usize,
) -> Result<CudaSlice<u8>> {
    if linear.len() < rows * kb {
        return Err(Error::usage(format!(
            "swizzle: {} scale bytes do not hold [{rows}, {kb}]",
            linear.len()
        )));
    }
    let out = gpu.alloc::<u8>(swizzled_len(rows, kb), "swizzled scales")?;
    gpu.launch(
        &QUANT,
        "scales_swizzle",
        grid_1d(swizzled_len(rows, kb) as u64, THREADS)?,
        &[
            KArg::U64(gpu.ptr(linear)),
            KArg::U64(rows as u64),
            KArg::U64(kb as u64),
            KArg::U64(gpu.ptr(&out)),
        ],
    )?;
    Ok(out)
}

/// Swizzled scales → linear `[rows, kb]`, on the GPU.
pub fn unswizzle_dev(
    gpu: &Gpu,
    swizzled: &CudaSlice<u8>,
    rows: usize,
    kb: usize,
) -> Result<CudaSlice<u8>> {
    if swizzled.len() < swizzled_len(rows, kb) {
        return Err(Error::usage(format!(
            "unswizzle: {} scale bytes do not hold a swizzled [{rows}, {kb}]",
            swizzled.len()
        )));
    }
    let out = gpu.alloc::<u8>(rows * kb, "linear scales")?;
    gpu.launch(
        &QUANT,
        "scales_unswizzle",
        grid_1d((rows * kb) as u64, THREADS)?,
        &[
            KArg::U64(gpu.ptr(swizzled)),
            KArg::U64(rows as u64),
            KArg::U64(kb as u64),
            KArg::U64(gpu.ptr(&out)),
        ],
    )?;
    Ok(out)
}

/// How two quantizations of the same tensor differ.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Flips {
    /// E2M1 codes that differ.
    pub codes: u64,
    /// Block scales that differ.
    pub scales: u64,
    /// Codes compared.
    pub total_codes: u64,
    pub total_scales: u64,
}

/// Count differing codes and scales between two quantizations with equal shapes/layouts.
pub fn count_flips_dev(gpu: &Gpu, a: &DevFp4, b: &DevFp4) -> Result<Flips> {
    if (a.rows, a.cols, a.format, a.layout) != (b.rows, b.cols, b.format, b.layout) {
        return Err(Error::usage(
            "count_flips: the two quantizations differ in shape, format or layout",
        ));
    }
    let n_packed = a.rows * a.cols / 2;
    let n_scales = scale_len(a.rows, a.cols / a.format.block(), a.layout);
    let counts = gpu.zeros::<u64>(2, "flip counts")?;
    gpu.launch(
        &QUANT,
        "count_flips",
        grid_1d(n_packed.max(n_scales) as u64, THREADS)?,
        &[
            KArg::U64(gpu.ptr(&a.packed)),
            KArg::U64(gpu.ptr(&b.packed)),
            KArg::U64(n_packed as u64),
            KArg::U64(gpu.ptr(&a.scales)),
            KArg::U64(gpu.ptr(&b.scales)),
            KArg::U64(n_scales as u64),
            KArg::U64(gpu.ptr(&counts)),
        ],
    )?;
    let c = gpu.download(&counts, 2, "flip counts")?;
    Ok(Flips {
        codes: c[0],
        scales: c[1],
        total_codes: (a.rows * a.cols) as u64,
        total_scales: (a.rows * (a.cols / a.format.block())) as u64,
    })
}

// ---- host-level conveniences (upload, run, download) ----

/// NVFP4-quantize f32 rows on the GPU; the result mirrors `nvfp4::quantize_nvfp4`.
pub fn quantize_nvfp4(
    gpu: &Gpu,
    x: &[f32],
    rows: usize,
    cols: usize,
    gs: f32,
    flavor: Flavor,
) -> Result<(Fp4Tensor, BlockStats)> {
    check_shape(x.len(), rows, cols, 16, "nvfp4 quantize")?;
    let d = gpu.upload(x, "the input rows")?;
    let q = quantize_nvfp4_dev(
        gpu,
        DevRows::F32(&d),
        rows,
        cols,
        gs,
        flavor,
        ScaleLayout::Linear,
    )?;
    Ok((q.to_host(gpu)?, q.block_stats(gpu)?))
}

/// The same from BF16 rows (raw bits).
pub fn quantize_nvfp4_bf16(
    gpu: &Gpu,
    x: &[u16],
    rows: usize,
    cols: usize,
    gs: f32,
    flavor: Flavor,
    layout: ScaleLayout,
) -> Result<(DevFp4, BlockStats)> {
    check_shape(x.len(), rows, cols, 16, "nvfp4 quantize")?;
    let d = gpu.upload(x, "the input rows")?;
    let q = quantize_nvfp4_dev(gpu, DevRows::Bf16(&d), rows, cols, gs, flavor, layout)?;
    let st = q.block_stats(gpu)?;
    Ok((q, st))
}

/// MXFP4-quantize f32 rows on the GPU; mirrors `nvfp4::quantize_mxfp4`.
pub fn quantize_mxfp4(
    gpu: &Gpu,
    x: &[f32],
    rows: usize,
    cols: usize,
) -> Result<(Fp4Tensor, BlockStats)> {
    check_shape(x.len(), rows, cols, 32, "mxfp4 quantize")?;
    let d = gpu.upload(x, "the input rows")?;
    let q = quantize_mxfp4_dev(gpu, DevRows::F32(&d), rows, cols, ScaleLayout::Linear)?;
    Ok((q.to_host(gpu)?, q.block_stats(gpu)?))
}

/// Quantize the same rows with both flavors and count the codes that flip.
pub fn flavor_flips(gpu: &Gpu, x: &[f32], rows: usize, cols: usize, gs: f32) -> Result<Flips> {
    check_shape(x.len(), rows, cols, 16, "nvfp4 quantize")?;
    let d = gpu.upload(x, "the input rows")?;
    let a = quantize_nvfp4_dev(
        gpu,
        DevRows::F32(&d),
        rows,
        cols,
        gs,
        Flavor::Reference,
        ScaleLayout::Linear,
    )?;
    let b = quantize_nvfp4_dev(
        gpu,
        DevRows::F32(&d),
        rows,
        cols,
        gs,
        Flavor::CudaFast,
        ScaleLayout::Linear,
    )?;
    count_flips_dev(gpu, &a, &b)
}

/// Linear → swizzled scales through the GPU kernel.
pub fn swizzle_scales(gpu: &Gpu, linear: &[u8], rows: usize, kb: usize) -> Result<Vec<u8>> {
    let d = gpu.upload(linear, "linear scales")?;
    let s = swizzle_dev(gpu, &d, rows, kb)?;
    gpu.download(&s, swizzled_len(rows, kb), "swizzled scales")
}

/// Swizzled → linear scales through the GPU kernel.
pub fn unswizzle_scales(gpu: &Gpu, swizzled: &[u8], rows: usize, kb: usize) -> Result<Vec<u8>> {
    let d = gpu.upload(swizzled, "swizzled scales")?;
    let s = unswizzle_dev(gpu, &d, rows, kb)?;
    gpu.download(&s, rows * kb, "linear scales")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defines_are_read_as_nvrtc_gets_them() {
        let d = "-DQUANT_BLOCKS=8 -DQUANT_MIN_BLOCKS=6  -DQUANT_ENCODER=0 -DX -D";
        assert_eq!(define_value(d, "QUANT_BLOCKS"), Some(8));
        assert_eq!(define_value(d, "QUANT_MIN_BLOCKS"), Some(6));
        assert_eq!(define_value(d, "QUANT_ENCODER"), Some(0));
        assert_eq!(define_value(d, "QUANT"), None);
        assert_eq!(define_value(d, "X"), None);
        assert_eq!(
            define_value("-DQUANT_BLOCKS=2 -DQUANT_BLOCKS=4", "QUANT_BLOCKS"),
            Some(4)
        );
        assert_eq!(define_value("", "QUANT_BLOCKS"), None);
    }

    #[test]
    fn the_grid_covers_every_group() {
        // 8192 x 7168: 448 blocks a row, 112 groups of 4 (56 of 8) -> 3584 (1792) CTAs
        let g =
            |rows, kb, layout, blocks| nvfp4_grid_for(rows, kb, layout, blocks).unwrap().grid_dim.0;
        assert_eq!(g(8192, 448, ScaleLayout::Linear, 4), 3584);
        assert_eq!(g(8192, 448, ScaleLayout::Linear, 8), 1792);
        assert_eq!(g(8192, 448, ScaleLayout::Linear, 2), 7168);
        // swizzled: 130 rows -> 256, kb 3 -> 4: one group of 8 (or 4) per padded row
        assert_eq!(g(130, 3, ScaleLayout::Swizzled, 8), 1);
        assert_eq!(g(130, 3, ScaleLayout::Swizzled, 2), 2);
    }

    #[test]
    fn knobs_are_read_from_the_defines() {
        assert_eq!(QuantKnobs::from_defines(""), QuantKnobs::DEFAULT);
        let k = QuantKnobs::from_defines("-DQUANT_PIPE=4 -DQUANT_COALESCED=1 -DQUANT_BLOCKS=2");
        assert_eq!(
            k,
            QuantKnobs {
                blocks: 2,
                pipe: 4,
                coalesced: true,
                ..QuantKnobs::DEFAULT
            }
        );
        let b = QuantKnobs::from_defines("-DBULK_QB=1 -DBULK_STAGES=8");
        assert_eq!((b.bulk_qb, b.bulk_stages), (1, 8));
        // the kernel's layout: 1 KiB of barriers, 8 warps x 2 stages x 128 blocks x 32 bytes
        assert_eq!(QuantKnobs::DEFAULT.bulk_smem(), 1024 + 65536);
        assert_eq!(b.bulk_smem(), 1024 + 65536);
        assert!(!QuantKnobs::from_defines("-DQUANT_COALESCED=0").coalesced);
        assert_eq!(QuantKnobs::from_defines("-DQUANT_PIPE=0").pipe, 1);
        assert_eq!(QuantKnobs::DEFAULT.bf16_threads, 128);
        let t = QuantKnobs::from_defines("-DQUANT_BF16_THREADS=64 -DQUANT_MIN_BLOCKS=16");
        assert_eq!(t.bf16_threads, 64);
        // the grid covers the groups with CTAs of that size
        for k in [QuantKnobs::DEFAULT, t] {
            let cfg = nvfp4_grid_bf16_for(8192, 448, ScaleLayout::Linear, k).unwrap();
            let n = k.bf16_threads;
            assert_eq!((cfg.grid_dim.0, cfg.block_dim.0), (8192 * 112 / n, n));
        }
    }

    #[test]
    fn the_flat_tail_covers_every_run_once() {
        let k = QuantKnobs::from_defines("-DQUANT_TAIL=7 -DQUANT_TAIL_WARPS=1");
        assert_eq!((k.tail_per_sm, k.tail_warps), (7, 1));
        assert!(!QuantKnobs::from_defines("-DQUANT_FLAT_PATH=0").flat_path);
        // 8192 x 7168: 28672 runs; 924 tail CTAs of 2 warps, 6706 of 4 before them
        assert_eq!(flat_tail_grid(28672, 4, 2, 924), (6706 + 924, 6706));
        for runs in [1u64, 2, 3, 31, 1000, 28672, 28673] {
            for (warps, tw) in [(4u64, 1u64), (4, 2), (4, 4), (2, 1), (8, 3)] {
                for tail in [0u64, 1, 924, 1848, 100_000] {
                    let (ctas, head) = flat_tail_grid(runs, warps, tw, tail);
                    // the kernel's mapping: run = head * warps + (cta - head) * tw + warp
                    let mut seen = vec![0u32; (ctas * warps.max(tw)) as usize];
                    for cta in 0..ctas {
                        let (n, base) = if cta < head {
                            (warps, cta * warps)
                        } else {
                            (tw, head * warps + (cta - head) * tw)
                        };
                        for w in 0..n {
                            seen[(base + w) as usize] += 1;
                        }
                    }
                    assert!(
                        seen[..runs as usize].iter().all(|&c| c == 1),
                        "{runs} {warps} {tw} {tail}"
                    );
                    // no CTA past the runs: the last one has work
                    let last = if ctas > head {
                        head * warps + (ctas - 1 - head) * tw
                    } else {
                        (ctas - 1) * warps
                    };
                    assert!(last < runs, "{runs} {warps} {tw} {tail}");
                }
            }
        }
    }

    #[test]
    fn bulk_tiles_cover_the_tensor_and_fill_the_last_round() {
        for max in [32u64, 64, 96, 128, 256] {
            for n in [0u64, 1, 9, 390, 32896, 461824, 3670016, 1 << 26] {
                for warps in [1u64, 8, 1056, 2112, 3168] {
                    let t = bulk_tile(n, warps, max);
                    assert!(
                        t.is_multiple_of(4) && (32..=max).contains(&t),
                        "{n} {warps} {max}: {t}"
                    );
                    // warp w takes tiles w, w + warps, ...: together every block once
                    let tiles = n.div_ceil(t);
                    let busiest = tiles.div_ceil(warps) * t;
                    let covered: u64 = (0..tiles).map(|k| t.min(n - k * t)).sum();
                    assert_eq!(covered, n);
                    // never worse than whole tiles of `max`
                    assert!(
                        busiest <= n.div_ceil(max * warps) * max,
                        "{n} {warps} {max}: {t}"
                    );
                }
            }
        }
        // the bench's tensor on an H200 (132 SMs x 2 CTAs x 8 warps)
        assert_eq!(bulk_tile(8192 * 448, 2112, 128), 116);
    }

    #[test]
    fn the_bf16_grid_covers_every_virtual_thread() {
        let g = |rows, kb, layout, k| {
            nvfp4_grid_bf16_for(rows, kb, layout, k).unwrap().grid_dim.0 as usize
        };
        // the pipelined and coalesced mappings in CTAs of 256 (the numbers below)
        let k = |blocks, pipe, coalesced| QuantKnobs {
            blocks,
            pipe,
            coalesced,
            bf16_threads: 256,
            ..QuantKnobs::DEFAULT
        };
        // the default: the f32 kernel's threads (one per group) in CTAs of 128
        for (rows, kb, layout) in [
            (8192, 448, ScaleLayout::Linear),
            (130, 3, ScaleLayout::Swizzled),
            (1, 1, ScaleLayout::Linear),
        ] {
            let (rows_g, kb_g) = padded(rows, kb, layout);
            assert_eq!(
                g(rows, kb, layout, QuantKnobs::DEFAULT),
                (rows_g * kb_g.div_ceil(QUANT_BLOCKS)).div_ceil(128)
            );
        }
        assert_eq!(g(8192, 448, ScaleLayout::Linear, QuantKnobs::DEFAULT), 7168);
        // 8192 x 7168: 917504 groups of 4 -> 3584 CTAs, 1792 with 2 per thread, 896 with 4;
        // coalesced: 28672 chunks of 128 blocks, 32 threads each: 3584 CTAs again
        assert_eq!(g(8192, 448, ScaleLayout::Linear, k(4, 2, false)), 1792);
        assert_eq!(g(8192, 448, ScaleLayout::Linear, k(4, 4, false)), 896);
        assert_eq!(g(8192, 448, ScaleLayout::Linear, k(4, 1, true)), 3584);
        assert_eq!(g(8192, 448, ScaleLayout::Linear, k(4, 2, true)), 1792);
        // coalesced, swizzled 130 x 3: the padded 256 x 4 = 1024 blocks, 8 chunks of 128
        // (256 threads: 1 CTA); ragged linear 37 x 10 = 370 blocks: 3 chunks (1 CTA)
        assert_eq!(g(130, 3, ScaleLayout::Swizzled, k(4, 1, true)), 1);
        assert_eq!(g(37, 10, ScaleLayout::Linear, k(4, 1, true)), 1);
        // every virtual thread is reached: CTAs x 256 x pipe >= virtual threads
        for (rows, kb) in [
            (1, 1),
            (37, 10),
            (130, 3),
            (257, 128),
            (300, 64),
            (129, 448),
        ] {
            for layout in [ScaleLayout::Linear, ScaleLayout::Swizzled] {
                for kn in [k(4, 1, false), k(2, 3, false), k(8, 4, true), k(4, 2, true)] {
                    let (rows_g, kb_g) = padded(rows, kb, layout);
                    let virt = if kn.coalesced {
                        32 * (rows_g * kb_g).div_ceil(32 * kn.blocks)
                    } else {
                        rows_g * kb_g.div_ceil(kn.blocks)
                    };
                    let ctas = g(rows, kb, layout, kn);
                    assert!(
                        ctas * 256 * kn.pipe >= virt,
                        "{rows}x{kb} {layout:?} {kn:?}"
                    );
                    assert!(
                        (ctas - 1) * 256 * kn.pipe < virt,
                        "{rows}x{kb} {layout:?} {kn:?}"
                    );
                }
            }
        }
    }
}
