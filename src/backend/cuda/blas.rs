//! cuBLAS GEMMs on raw device pointers: `y[m, n] = x[m, k] · w[n, k]ᵀ` (row-major, weights
//! `[out, in]` as checkpoints hold them), FP32 accumulation, FP32 or BF16 out.

use super::device::{cublas_err, Gpu};
use crate::error::{Error, Result};
use cudarc::cublas::sys::{
    cublasComputeType_t, cublasGemmAlgo_t, cublasGemmEx, cublasOperation_t, cudaDataType_t,
};
use std::ffi::c_void;

fn dim(v: usize, what: &str) -> Result<i32> {
    i32::try_from(v)
        .map_err(|_| Error::usage(format!("{what} = {v} is too large for one cuBLAS GEMM")))
}

#[allow(clippy::too_many_arguments)]
fn gemm_nt(
    gpu: &Gpu,
    m: usize,
    n: usize,
    k: usize,
    x: u64,
    w: u64,
    y: u64,
    in_type: cudaDataType_t,
    out_type: cudaDataType_t,
    compute: cublasComputeType_t,
    what: &str,
) -> Result<()> {
    if m == 0 || n == 0 {
        return Ok(());
    }
    let blas = gpu.blas()?;
    let (mi, ni, ki) = (
        dim(m, "rows")?,
        dim(n, "out features")?,
        dim(k, "in features")?,
    );
    let (alpha, beta) = (1.0f32, 0.0f32);
    // column-major view: C (n x m) = op(W) (n x k) · X (k x m), W stored k x n → transposed
    unsafe {
        cublasGemmEx(
            *blas.blas.handle(),
            cublasOperation_t::CUBLAS_OP_T,
            cublasOperation_t::CUBLAS_OP_N,
            ni,
            mi,
            ki,
            &alpha as *const f32 as *const c_void,
            w as *const c_void,
            in_type,
            ki,
            x as *const c_void,
            in_type,
            ki,
            &beta as *const f32 as *const c_void,
            y as *mut c_void,
            out_type,
            ni,
            compute,
            cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
        .result()
        .map_err(|e| cublas_err(what, "cublasGemmEx", e))
    }
}

/// What a BF16 GEMM writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Out {
    /// f32: the reference path and the shared experts.
    F32,
    /// BF16: what engines run, and the bench's compute ceiling (an FP32 output adds its bytes:
    /// ~4% at 4096³).
    Bf16,
}

/// BF16 × BF16 → `out` with FP32 accumulation.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_bf16(
    gpu: &Gpu,
    m: usize,
    n: usize,
    k: usize,
    x: u64,
    w: u64,
    y: u64,
    out: Out,
    what: &str,
) -> Result<()> {
    let out_type = match out {
        Out::F32 => cudaDataType_t::CUDA_R_32F,
        Out::Bf16 => cudaDataType_t::CUDA_R_16BF,
    };
    gemm_nt(
        gpu,
        m,
        n,
        k,
        x,
        w,
        y,
        cudaDataType_t::CUDA_R_16BF,
        out_type,
        cublasComputeType_t::CUBLAS_COMPUTE_32F,
        what,
    )
}

/// f32 × f32 → f32 in plain FP32 (no TF32: the router's logits).
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_f32(
    gpu: &Gpu,
    m: usize,
    n: usize,
    k: usize,
    x: u64,
    w: u64,
    y: u64,
    what: &str,
) -> Result<()> {
    gemm_nt(
        gpu,
        m,
        n,
        k,
        x,
        w,
        y,
        cudaDataType_t::CUDA_R_32F,
        cudaDataType_t::CUDA_R_32F,
        cublasComputeType_t::CUBLAS_COMPUTE_32F_PEDANTIC,
        what,
    )
}
