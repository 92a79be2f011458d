//! Launch wrappers for kernels/dequant.cu: packed FP4 and the float dtypes of safetensors
//! files to f32 on the GPU, bit-identical to the CPU's decoders (compare-weights' GPU diff).

use super::device::{grid_1d, Gpu, KArg};
use super::nvrtc::DEQUANT;
use crate::error::Result;
use crate::nvfp4::Format;
use cudarc::driver::{CudaSlice, LaunchConfig};
use safetensors::Dtype;

const THREADS: u32 = 256;
/// Grid-stride loops: enough blocks to fill any current GPU, no more.
const MAX_BLOCKS: u64 = 8192;

fn grid(n: u64) -> Result<LaunchConfig> {
    let mut cfg = grid_1d(n.min(MAX_BLOCKS * THREADS as u64), THREADS)?;
    cfg.grid_dim.0 = cfg.grid_dim.0.max(1);
    Ok(cfg)
}

/// The kernel's code for a float dtype it decodes (the CPU's `checkpoint::file::is_float`).
pub fn float_code(d: Dtype) -> Option<u32> {
    Some(match d {
        Dtype::BF16 => 0,
        Dtype::F16 => 1,
        Dtype::F32 => 2,
        Dtype::F64 => 3,
        Dtype::F8_E4M3 => 4,
        Dtype::F8_E5M2 => 5,
        _ => return None,
    })
}

/// Enqueue: `rows` rows of a packed FP4 matrix (`packed` `[rows, cols/2]`, `scales`
/// `[rows, cols/block]` linear, device addresses) dequantized into `out` `[rows, cols]` f32.
#[allow(clippy::too_many_arguments)]
pub(crate) fn dequant_fp4_into(
    gpu: &Gpu,
    packed: u64,
    scales: u64,
    rows: usize,
    cols: usize,
    format: Format,
    scale_2: f32,
    out: u64,
) -> Result<()> {
    let n = (rows * cols / 2) as u64;
    if n == 0 {
        return Ok(());
    }
    gpu.launch(
        &DEQUANT,
        "dequant_fp4",
        grid(n)?,
        &[
            KArg::U64(packed),
            KArg::U64(scales),
            KArg::U64(rows as u64),
            KArg::U64(cols as u64),
            KArg::U32(format.block() as u32),
            KArg::U32(match format {
                Format::Nvfp4 => 0,
                Format::Mxfp4 => 1,
            }),
            KArg::F32(scale_2),
            KArg::U64(out),
        ],
    )
}

/// Enqueue: `n` elements of float dtype `code` ([`float_code`]) at `raw` decoded into `out`.
pub(crate) fn decode_into(gpu: &Gpu, raw: u64, n: usize, code: u32, out: u64) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    gpu.launch(
        &DEQUANT,
        "decode_f32",
        grid(n as u64)?,
        &[
            KArg::U64(raw),
            KArg::U64(n as u64),
            KArg::U32(code),
            KArg::U64(out),
        ],
    )
}

/// The first index where `|test - reference|` equals its value at `hint` (an index of the
/// maximum), finite test values only; `hint` itself when none matches (a NaN reference
/// there). `out` is a one-element scratch buffer.
pub(crate) fn first_index_at_max(
    gpu: &Gpu,
    test: u64,
    reference: u64,
    n: usize,
    hint: usize,
    out: &mut CudaSlice<u64>,
) -> Result<usize> {
    if hint >= n {
        return Ok(hint);
    }
    gpu.fill(out, 0xFF, "the first index at the maximum")?;
    gpu.launch(
        &DEQUANT,
        "first_index_at_max",
        grid(n as u64)?,
        &[
            KArg::U64(test),
            KArg::U64(reference),
            KArg::U64(n as u64),
            KArg::U64(hint as u64),
            KArg::U64(gpu.ptr(out)),
        ],
    )?;
    let v = gpu.download(out, 1, "the first index at the maximum")?[0];
    Ok(if v == u64::MAX { hint } else { v as usize })
}
