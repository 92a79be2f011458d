// Dequantization to f32 for compare-weights' GPU diff: packed FP4 (NVFP4 / MXFP4) with linear
// block scales, and the float dtypes of safetensors files. Every value is the one the CPU
// path computes (src/nvfp4 dequantize_row, src/checkpoint/file.rs decode_row) bit for bit:
// `(e2m1(q) * s) * scale_2` as two IEEE f32 products (the first is exact), and exact or
// correctly rounded (F64) conversions for the floats.
#include "nvfp4dbg_common.cuh"

#define FP4_NVFP4 0u
#define FP4_MXFP4 1u

// One thread per packed byte (two elements along K). `packed` is [rows, cols/2], `scales`
// [rows, cols/block] linear; out[r * cols + c] for the rows of this chunk.
extern "C" __global__ void dequant_fp4(const u8* __restrict__ packed, const u8* __restrict__ scales,
                                       u64 rows, u64 cols, u32 block, u32 format, float scale_2,
                                       float* __restrict__ out) {
    u64 half_cols = cols / 2, kb = cols / block;
    u64 n = rows * half_cols;
    u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        u64 r = i / half_cols, c = (i % half_cols) * 2;
        u32 code = scales[r * kb + c / block];
        float s = format == FP4_MXFP4 ? ue8m0_decode(code) : e4m3_decode(code);
        u32 byte = packed[i];
        out[r * cols + c] = __fmul_rn(__fmul_rn(e2m1_decode(byte & 0xFu), s), scale_2);
        out[r * cols + c + 1] = __fmul_rn(__fmul_rn(e2m1_decode(byte >> 4), s), scale_2);
    }
}

// Dtype codes of src/backend/cuda/dequant.rs FloatDtype.
#define DT_BF16 0u
#define DT_F16 1u
#define DT_F32 2u
#define DT_F64 3u
#define DT_F8_E4M3 4u
#define DT_F8_E5M2 5u

// IEEE half to float, exact (subnormals included; NaN stays NaN).
__device__ __forceinline__ float f16_to_f32(u32 h) {
    u32 sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    float v;
    if (e == 0u) {
        v = __fmul_rn((float)m, 5.9604644775390625e-8f);  // m * 2^-24, exact
        return sign ? -v : v;
    }
    if (e == 31u) return __uint_as_float(sign | 0x7F800000u | (m << 13));
    return __uint_as_float(sign | ((e + 112u) << 23) | (m << 13));
}

// `n` elements of `dtype` at `raw` (little-endian, element-aligned) to f32.
extern "C" __global__ void decode_f32(const u8* __restrict__ raw, u64 n, u32 dtype,
                                      float* __restrict__ out) {
    u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float v;
        switch (dtype) {
            case DT_BF16: v = bf16_to_f32(((const u16*)raw)[i]); break;
            case DT_F16: v = f16_to_f32(((const u16*)raw)[i]); break;
            case DT_F32: v = ((const float*)raw)[i]; break;
            case DT_F64: v = __double2float_rn(((const double*)raw)[i]); break;
            case DT_F8_E4M3: v = e4m3_decode(raw[i]); break;
            case DT_F8_E5M2: v = f16_to_f32((u32)raw[i] << 8); break;
            default: v = f32_nan(); break;
        }
        out[i] = v;
    }
}

// The lowest index i with a finite test[i] and |test[i] - ref[i]| (in f64, as the CPU's Accum)
// equal to that at `hint` (an index the reduction found at the maximum), atomicMin'd into
// `out` (set to all ones first). reduce.cu's tree merges interleaved slices, so among equal
// errors it may keep a later index; the CPU keeps the first. Integer min: order-free.
extern "C" __global__ void first_index_at_max(const float* __restrict__ test,
                                              const float* __restrict__ ref, u64 n, u64 hint,
                                              u64* __restrict__ out) {
    double target = fabs((double)test[hint] - (double)ref[hint]);
    u64 mine = NONE_IDX;
    u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n && mine == NONE_IDX; i += stride) {
        float t = test[i];
        if (t != t || isinf(t)) continue;
        if (fabs((double)t - (double)ref[i]) == target) mine = i;
    }
    if (mine != NONE_IDX) atomicMin(out, mine);
}
