// Benchmark helpers (`nvfp4dbg bench`): synthetic data generated on the GPU (22 GB of BF16
// expert weights in milliseconds instead of minutes on the host), and a one-pass non-finite
// scan, the GPU counterpart of what nan-locate does to every tensor (the bench also reads
// through it to flush the L2 between repeats).
#include "nvfp4dbg_common.cuh"

// SplitMix64 finalizer of (seed, index): counter-based, so the bytes do not depend on the grid.
__device__ __forceinline__ u64 mix64(u64 seed, u64 i) {
    u64 z = seed + (i + 1ull) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// Uniform in [-amp, amp), from 24 random bits.
__device__ __forceinline__ float uniform_pm(u64 r, float amp) {
    float u = (float)(u32)(r >> 40) * (1.0f / 16777216.0f);
    return (2.0f * u - 1.0f) * amp;
}

// Random bytes, 8 per thread-step (every byte is two valid E2M1 codes: E2M1 has no NaN).
// `n` is in bytes; a tail shorter than 8 bytes is written byte by byte.
extern "C" __global__ void bench_fill_bytes(u8* __restrict__ out, u64 n, u64 seed) {
    u64 words = n / 8;
    u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 w = (u64)blockIdx.x * blockDim.x + threadIdx.x; w < words; w += stride)
        reinterpret_cast<u64*>(out)[w] = mix64(seed, w);
    u64 t = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (t < n - words * 8) out[words * 8 + t] = (u8)mix64(seed ^ 0xA5A5A5A5ull, t);
}

// BF16 values uniform in [-amp, amp) (round to nearest even from f32).
extern "C" __global__ void bench_fill_bf16(u16* __restrict__ out, u64 n, u64 seed, float amp) {
    u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        out[i] = f32_to_bf16_rn(uniform_pm(mix64(seed, i), amp));
}

// f32 values uniform in [-amp, amp).
extern "C" __global__ void bench_fill_f32(float* __restrict__ out, u64 n, u64 seed, float amp) {
    u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        out[i] = uniform_pm(mix64(seed, i), amp);
}

// The NVFP4 quantizer's memory traffic without its arithmetic (the bench's floor for the
// quantize figure at its own size): `groups` groups of 4 blocks of 16 BF16 (128 bytes) read,
// 32 bytes of "codes" and 4 of "scales" written per group, one group per thread (the grid
// quantizer's mapping and grid). What it writes is the XOR of what it reads, so no load can
// be dropped.
extern "C" __global__ void __launch_bounds__(256)
bench_quantize_traffic(const uint4* __restrict__ x, u64 groups, uint4* __restrict__ codes, u32* __restrict__ scales) {
    u64 g = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= groups) return;
    uint4 v[8];
#pragma unroll
    for (int i = 0; i < 8; i++) v[i] = x[8 * g + i];
    uint4 a, b;
    a.x = v[0].x ^ v[1].x; a.y = v[0].y ^ v[1].y; a.z = v[0].z ^ v[1].z; a.w = v[0].w ^ v[1].w;
    b.x = v[2].x ^ v[3].x; b.y = v[2].y ^ v[3].y; b.z = v[2].z ^ v[3].z; b.w = v[2].w ^ v[3].w;
    uint4 c, d;
    c.x = v[4].x ^ v[5].x; c.y = v[4].y ^ v[5].y; c.z = v[4].z ^ v[5].z; c.w = v[4].w ^ v[5].w;
    d.x = v[6].x ^ v[7].x; d.y = v[6].y ^ v[7].y; d.z = v[6].z ^ v[7].z; d.w = v[6].w ^ v[7].w;
    codes[2 * g] = a;
    codes[2 * g + 1] = c;
    scales[g] = b.x ^ b.y ^ b.z ^ b.w ^ d.x ^ d.y ^ d.z ^ d.w;
}

// Non-finite scan of x[0..n): out = {nan count, inf count, first NaN index, first Inf index}.
// The caller sets out to {0, 0, ~0, ~0} first. 16-byte loads, grid-stride; integer atomics
// only (counts add, first indices take the min), so the result does not depend on the grid.
// x must be 16-byte aligned (a cudaMalloc'd buffer is).
__device__ __forceinline__ void scan_one(float v, u64 i, u64& nan, u64& inf, u64& fnan, u64& finf) {
    if (v != v) {
        nan++;
        fnan = i < fnan ? i : fnan;
    } else if (isinf(v)) {
        inf++;
        finf = i < finf ? i : finf;
    }
}

extern "C" __global__ void __launch_bounds__(256)
bench_nonfinite_scan_f32(const float* __restrict__ x, u64 n, u64* __restrict__ out) {
    u64 nan = 0, inf = 0, fnan = NONE_IDX, finf = NONE_IDX;
    u64 quads = n / 4;
    u64 stride = (u64)gridDim.x * blockDim.x;
    const float4* x4 = reinterpret_cast<const float4*>(x);
    u64 q = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    // two independent 16-byte loads in flight per step
    for (; q + stride < quads; q += 2 * stride) {
        float4 a = x4[q], b = x4[q + stride];
        scan_one(a.x, 4 * q, nan, inf, fnan, finf);
        scan_one(a.y, 4 * q + 1, nan, inf, fnan, finf);
        scan_one(a.z, 4 * q + 2, nan, inf, fnan, finf);
        scan_one(a.w, 4 * q + 3, nan, inf, fnan, finf);
        u64 qb = q + stride;
        scan_one(b.x, 4 * qb, nan, inf, fnan, finf);
        scan_one(b.y, 4 * qb + 1, nan, inf, fnan, finf);
        scan_one(b.z, 4 * qb + 2, nan, inf, fnan, finf);
        scan_one(b.w, 4 * qb + 3, nan, inf, fnan, finf);
    }
    if (q < quads) {
        float4 a = x4[q];
        scan_one(a.x, 4 * q, nan, inf, fnan, finf);
        scan_one(a.y, 4 * q + 1, nan, inf, fnan, finf);
        scan_one(a.z, 4 * q + 2, nan, inf, fnan, finf);
        scan_one(a.w, 4 * q + 3, nan, inf, fnan, finf);
    }
    u64 t = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (t < n - quads * 4) scan_one(x[quads * 4 + t], quads * 4 + t, nan, inf, fnan, finf);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        nan += __shfl_xor_sync(0xFFFFFFFFu, nan, o);
        inf += __shfl_xor_sync(0xFFFFFFFFu, inf, o);
        u64 a = __shfl_xor_sync(0xFFFFFFFFu, fnan, o);
        u64 b = __shfl_xor_sync(0xFFFFFFFFu, finf, o);
        fnan = a < fnan ? a : fnan;
        finf = b < finf ? b : finf;
    }
    if ((threadIdx.x & 31) == 0) {
        if (nan) atomicAdd(&out[0], nan);
        if (inf) atomicAdd(&out[1], inf);
        if (fnan != NONE_IDX) atomicMin(&out[2], fnan);
        if (finf != NONE_IDX) atomicMin(&out[3], finf);
    }
}
