//! Launch wrappers for kernels/reduce.cu: comparison metrics with a deterministic two-pass
//! reduction (the same `metrics::Accum` the CPU builds, finished by the same code), and amax.

use super::device::{Gpu, KArg};
use super::nvrtc::REDUCE;
use crate::error::{Error, Result};
use crate::metrics::{Accum, Metrics};
use cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig, ValidAsZeroBits};

const THREADS: u32 = 256;
/// Elements per block in pass 1 (kernels/reduce.cu COMPARE_CHUNK): a fixed split, so the
/// sums do not depend on the device.
const CHUNK: u64 = 32768;

/// kernels/reduce.cu `struct Acc`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct AccRaw {
    dot: f64,
    nt: f64,
    nr: f64,
    err: f64,
    max_abs: f64,
    max_idx: u64,
    nan: u64,
    inf: u64,
    first_nan: u64,
    first_inf: u64,
    len: u64,
}
unsafe impl DeviceRepr for AccRaw {}
unsafe impl ValidAsZeroBits for AccRaw {}

fn idx(v: u64) -> Option<usize> {
    (v != u64::MAX).then_some(v as usize)
}

impl AccRaw {
    fn accum(&self) -> Accum {
        Accum {
            dot: self.dot,
            nt: self.nt,
            nr: self.nr,
            err: self.err,
            max_abs: self.max_abs,
            max_idx: idx(self.max_idx),
            nan: self.nan,
            inf: self.inf,
            first_nan: idx(self.first_nan),
            first_inf: idx(self.first_inf),
            len: self.len as usize,
        }
    }
}

/// Metrics of the first `n` elements of `test` against `reference`, both on the GPU.
pub fn compare_dev(
    gpu: &Gpu,
    test: &CudaSlice<f32>,
    reference: &CudaSlice<f32>,
    n: usize,
) -> Result<Metrics> {
    let scratch = CompareScratch::new(gpu, n)?;
    scratch.enqueue(gpu, test, reference)?;
    scratch.metrics(gpu)
}

/// The partial sums of a comparison of `n` elements, allocated once so the two reduction
/// passes can be enqueued many times (benchmarks) without allocating or syncing.
pub struct CompareScratch {
    n: usize,
    blocks: u64,
    partials: CudaSlice<AccRaw>,
    out: CudaSlice<AccRaw>,
}

impl CompareScratch {
    pub fn new(gpu: &Gpu, n: usize) -> Result<Self> {
        let blocks = (n as u64).div_ceil(CHUNK).max(1);
        if blocks > i32::MAX as u64 {
            return Err(Error::usage(format!("compare: {n} elements is too many")));
        }
        Ok(CompareScratch {
            n,
            blocks,
            partials: gpu.alloc::<AccRaw>(blocks as usize, "comparison partial sums")?,
            out: gpu.alloc::<AccRaw>(1, "comparison sums")?,
        })
    }

    /// Enqueue both passes over the first `n` elements of `test` and `reference`.
    pub fn enqueue(
        &self,
        gpu: &Gpu,
        test: &CudaSlice<f32>,
        reference: &CudaSlice<f32>,
    ) -> Result<()> {
        let n = self.n;
        if test.len() < n || reference.len() < n {
            return Err(Error::usage(format!(
                "compare: {n} elements asked, the buffers hold {} and {}",
                test.len(),
                reference.len()
            )));
        }
        gpu.launch(
            &REDUCE,
            "compare_partial",
            LaunchConfig {
                grid_dim: (self.blocks as u32, 1, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: 0,
            },
            &[
                KArg::U64(gpu.ptr(test)),
                KArg::U64(gpu.ptr(reference)),
                KArg::U64(n as u64),
                KArg::U64(gpu.ptr(&self.partials)),
            ],
        )?;
        gpu.launch(
            &REDUCE,
            "compare_final",
            LaunchConfig {
                grid_dim: (1, 1, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: 0,
            },
            &[
                KArg::U64(gpu.ptr(&self.partials)),
                KArg::U64(self.blocks),
                KArg::U64(gpu.ptr(&self.out)),
            ],
        )
    }

    /// The metrics of the last enqueued comparison (waits for the stream).
    pub fn metrics(&self, gpu: &Gpu) -> Result<Metrics> {
        let acc = gpu.download(&self.out, 1, "comparison sums")?;
        Ok(acc[0].accum().finish())
    }
}

/// Upload both and compare.
pub fn compare(gpu: &Gpu, test: &[f32], reference: &[f32]) -> Result<Metrics> {
    if test.len() != reference.len() {
        return Err(Error::usage(format!(
            "compare: test has {} values, reference {}",
            test.len(),
            reference.len()
        )));
    }
    let t = gpu.upload(test, "the test tensor")?;
    let r = gpu.upload(reference, "the reference tensor")?;
    compare_dev(gpu, &t, &r, test.len())
}

/// Enqueue `out = max(out, amax(x[..n]))` as f32 bits (NaN recorded as a quiet NaN that
/// compares above everything). `out` must be zeroed by the caller before the first call.
pub(crate) fn amax_into(gpu: &Gpu, x: u64, n: u64, out: u64) -> Result<()> {
    let blocks = n.div_ceil(THREADS as u64 * 8).clamp(1, 4096);
    gpu.launch(
        &REDUCE,
        "amax_f32",
        LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        },
        &[KArg::U64(x), KArg::U64(n), KArg::U64(out)],
    )
}
