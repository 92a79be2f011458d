// Block quantization kernels: NVFP4 (reference and cuda-fast flavors), MXFP4, scale
// swizzling, and the flipped-code count between two quantizations.
#include "nvfp4dbg_common.cuh"

template <typename T> __device__ __forceinline__ void load16(const T* p, float (&x)[16]);
template <> __device__ __forceinline__ void load16<float>(const float* p, float (&x)[16]) {
    const float4* q = reinterpret_cast<const float4*>(p);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        float4 v = q[i];
        x[4 * i] = v.x; x[4 * i + 1] = v.y; x[4 * i + 2] = v.z; x[4 * i + 3] = v.w;
    }
}
template <> __device__ __forceinline__ void load16<u16>(const u16* p, float (&x)[16]) {
    const uint4* q = reinterpret_cast<const uint4*>(p);
#pragma unroll
    for (int i = 0; i < 2; i++) {
        uint4 v = q[i];
        u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int j = 0; j < 4; j++) {
            x[8 * i + 2 * j] = bf16_to_f32((u16)(w[j] & 0xFFFFu));
            x[8 * i + 2 * j + 1] = bf16_to_f32((u16)(w[j] >> 16));
        }
    }
}

// Block statistics of a CTA: warp sums, then one integer atomic per CTA and field (atomics
// from every warp on the same four counters serialize in L2 and cost more than the kernel).
#define QUANT_THREADS 256
__device__ __forceinline__ void add_stats_cta(u64* stats, const u32 (&c)[4]) {
    __shared__ u32 part[QUANT_THREADS / 32][4];
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
    for (int f = 0; f < 4; f++) {
        u32 n = __reduce_add_sync(0xFFFFFFFFu, c[f]);
        if (lane == 0) part[warp][f] = n;
    }
    __syncthreads();
    if (threadIdx.x < 4 && stats != nullptr) {
        u64 n = 0;
        for (int w = 0; w < (int)(blockDim.x / 32); w++) n += part[w][threadIdx.x];
        if (n) atomicAdd(&stats[threadIdx.x], n);
    }
}

// Raw 16-byte loads of one block (BF16: two, F32: four), converted only after every load of
// the thread is in flight.
template <typename T> struct RawBlock;
template <> struct RawBlock<float> { uint4 q[4]; };
template <> struct RawBlock<u16> { uint4 q[2]; };

template <typename T>
__device__ __forceinline__ void load_raw(const T* p, RawBlock<T>& r) {
    const uint4* q = reinterpret_cast<const uint4*>(p);
#pragma unroll
    for (int i = 0; i < (int)(sizeof(r.q) / 16); i++) r.q[i] = q[i];
}

// The block as floats and max|x| as bits (amax_bits16). BF16: the maximum is taken on the
// 16-bit halves (|x| bit patterns order as unsigned integers, as in f32, NaN above inf), so the
// bits are those amax_bits16 gives on the converted values.
__device__ __forceinline__ u32 unpack_raw(const RawBlock<float>& r, float (&x)[16]) {
#pragma unroll
    for (int i = 0; i < 4; i++) {
        x[4 * i] = __uint_as_float(r.q[i].x);
        x[4 * i + 1] = __uint_as_float(r.q[i].y);
        x[4 * i + 2] = __uint_as_float(r.q[i].z);
        x[4 * i + 3] = __uint_as_float(r.q[i].w);
    }
    return amax_bits16(x);
}
__device__ __forceinline__ u32 unpack_raw(const RawBlock<u16>& r, float (&x)[16]) {
    u32 m = 0;
#pragma unroll
    for (int i = 0; i < 2; i++) {
        u32 w[4] = {r.q[i].x, r.q[i].y, r.q[i].z, r.q[i].w};
#pragma unroll
        for (int j = 0; j < 4; j++) {
            x[8 * i + 2 * j] = __uint_as_float(w[j] << 16);
            x[8 * i + 2 * j + 1] = __uint_as_float(w[j] & 0xFFFF0000u);
            u32 a = w[j] & 0x7FFF7FFFu;
            asm("max.u16x2 %0, %0, %1;" : "+r"(m) : "r"(a));
        }
    }
    return max(m & 0xFFFFu, m >> 16) << 16;
}

// Blocks per thread: all their loads are issued before any is quantized.
#define QUANT_BLOCKS 4

// QUANT_BLOCKS consecutive 16-blocks of a row per thread (the first a multiple of
// QUANT_BLOCKS), codes stored 16 bytes and scales 4 bytes at a time where aligned.
// `row_src` (nullable) gathers: output row r reads input row row_src[r]. `gs_idx` (nullable)
// picks gs[gs_idx[r]] per row, else gs[0]. With `swizzled`, the grid covers the padded scale
// matrix and padding is written as zero. Launched with QUANT_THREADS threads.
template <typename T>
__device__ void nvfp4_quantize(const T* __restrict__ x, u64 rows, u32 cols,
                               const int* __restrict__ row_src, const float* __restrict__ gs,
                               const int* __restrict__ gs_idx, u8* __restrict__ packed,
                               u8* __restrict__ scales, u32 swizzled, u64* __restrict__ stats,
                               u32 flavor) {
    u64 kb = cols / 16;
    u64 rows_g = swizzled ? (rows + 127) / 128 * 128 : rows;
    u64 kb_g = swizzled ? (kb + 3) / 4 * 4 : kb;
    u64 groups = (kb_g + QUANT_BLOCKS - 1) / QUANT_BLOCKS;
    u64 total = rows_g * groups;
    u64 idx = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    u32 c[4] = {0, 0, 0, 0};
    if (idx < total) {
        u64 r, b0;
        if (total <= 0xFFFFFFFFull) {  // 32-bit division: a 64-bit one costs ~5 ops per value
            u32 r32 = (u32)idx / (u32)groups;
            r = r32;
            b0 = QUANT_BLOCKS * ((u32)idx - r32 * (u32)groups);
        } else {
            r = idx / groups;
            b0 = QUANT_BLOCKS * (idx % groups);
        }
        bool in_row = r < rows;
        u64 src = in_row ? (row_src ? (u64)row_src[r] : r) : 0;
        RawBlock<T> raw[QUANT_BLOCKS];
#pragma unroll
        for (int h = 0; h < QUANT_BLOCKS; h++)
            if (in_row && b0 + h < kb) load_raw<T>(x + src * cols + (b0 + h) * 16, raw[h]);
        float g = in_row ? gs[gs_idx ? gs_idx[r] : 0] : 0.0f;
        float rg = nvfp4_rgs(g, flavor);
        u32 p[QUANT_BLOCKS][2];
        u32 sc[QUANT_BLOCKS];
#pragma unroll
        for (int h = 0; h < QUANT_BLOCKS; h++) {
            p[h][0] = p[h][1] = 0;
            sc[h] = 0;
            if (in_row && b0 + h < kb) {
                float v[16];
                u32 mbits = unpack_raw(raw[h], v);
                u32 s = quant_block_nvfp4_core(v, mbits, g, rg, flavor, p[h]);
                sc[h] = s;
                u32 cls = classify_nvfp4(s, __uint_as_float(mbits) > 0.0f);
                c[0] += 1;
                c[1] += cls & 1u;
                c[2] += (cls >> 1) & 1u;
                c[3] += (cls >> 2) & 1u;
            }
        }
        bool whole = in_row && b0 + QUANT_BLOCKS <= kb;
        if (in_row) {
            u8* dst = packed + r * (cols / 2) + b0 * 8;
            if (whole && ((size_t)dst & 15u) == 0) {
                uint4* d = reinterpret_cast<uint4*>(dst);
                d[0] = make_uint4(p[0][0], p[0][1], p[1][0], p[1][1]);
                d[1] = make_uint4(p[2][0], p[2][1], p[3][0], p[3][1]);
            } else {
#pragma unroll
                for (int h = 0; h < QUANT_BLOCKS; h++)
                    if (b0 + h < kb) *reinterpret_cast<uint2*>(dst + h * 8) = make_uint2(p[h][0], p[h][1]);
            }
        }
        u32 word = sc[0] | (sc[1] << 8) | (sc[2] << 16) | (sc[3] << 24);
        if (swizzled) {
            // the 4 scales of a group are 4 consecutive bytes of the 128x4 tile (padding 0)
            u8* dst = scales + swizzle_offset(r, b0, kb);
            if (((size_t)dst & 3u) == 0) {
                *reinterpret_cast<u32*>(dst) = word;
            } else {
#pragma unroll
                for (int h = 0; h < QUANT_BLOCKS; h++) dst[h] = (u8)sc[h];
            }
        } else {
            u8* dst = scales + r * kb + b0;
            if (whole && ((size_t)dst & 3u) == 0) {
                *reinterpret_cast<u32*>(dst) = word;
            } else {
#pragma unroll
                for (int h = 0; h < QUANT_BLOCKS; h++)
                    if (b0 + h < kb) dst[h] = (u8)sc[h];
            }
        }
    }
    add_stats_cta(stats, c);
}

extern "C" __global__ void nvfp4_quantize_f32(const float* x, u64 rows, u32 cols, const int* row_src,
                                              const float* gs, const int* gs_idx, u8* packed,
                                              u8* scales, u32 swizzled, u64* stats, u32 flavor) {
    nvfp4_quantize<float>(x, rows, cols, row_src, gs, gs_idx, packed, scales, swizzled, stats, flavor);
}

extern "C" __global__ void nvfp4_quantize_bf16(const u16* x, u64 rows, u32 cols, const int* row_src,
                                               const float* gs, const int* gs_idx, u8* packed,
                                               u8* scales, u32 swizzled, u64* stats, u32 flavor) {
    nvfp4_quantize<u16>(x, rows, cols, row_src, gs, gs_idx, packed, scales, swizzled, stats, flavor);
}

// MXFP4 (OCP MX v1.0): blocks of 32, UE8M0 scale 2^(floor(log2 amax) - 2), elements
// e2m1(clamp(x / scale, -6, 6)); a NaN block gets scale 0xFF and zero codes.
template <typename T>
__device__ void mxfp4_quantize(const T* __restrict__ x, u64 rows, u32 cols, u8* __restrict__ packed,
                               u8* __restrict__ scales, u32 swizzled, u64* __restrict__ stats) {
    u64 kb = cols / 32;
    u64 rows_g = swizzled ? (rows + 127) / 128 * 128 : rows;
    u64 kb_g = swizzled ? (kb + 3) / 4 * 4 : kb;
    u64 idx = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= rows_g * kb_g) return;
    u64 r = idx / kb_g, b = idx % kb_g;
    u32 blocks = 0, cls = 0;
    if (r < rows && b < kb) {
        float v[2][16];
        load16<T>(x + r * cols + b * 32, v[0]);
        load16<T>(x + r * cols + b * 32 + 16, v[1]);
        float vmax = 0.0f;
#pragma unroll
        for (int h = 0; h < 2; h++)
#pragma unroll
            for (int i = 0; i < 16; i++) vmax = amax_step(vmax, v[h][i]);
        u32 code;
        u32 words[4] = {0, 0, 0, 0};
        blocks = 1;
        if (vmax != vmax) {
            code = UE8M0_NAN;
            cls = 4u;
        } else {
            int ex = vmax == 0.0f ? -127 : (isinf(vmax) ? 127 : floor_log2(vmax) - 2);
            ex = ex < -127 ? -127 : (ex > 127 ? 127 : ex);
            code = (u32)(ex + 127);
            if (code == 254u) cls = 1u;
            float scale = ue8m0_decode(code);
#pragma unroll
            for (int w = 0; w < 4; w++) {
                u32 word = 0;
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    float lo = clamp6(__fdiv_rn(v[w / 2][(w % 2) * 8 + 2 * i], scale));
                    float hi = clamp6(__fdiv_rn(v[w / 2][(w % 2) * 8 + 2 * i + 1], scale));
                    word |= e2m1_pack2(lo, hi) << (8 * i);
                }
                words[w] = word;
            }
        }
        *reinterpret_cast<uint4*>(packed + r * (cols / 2) + b * 16) =
            make_uint4(words[0], words[1], words[2], words[3]);
        scales[swizzled ? swizzle_offset(r, b, kb) : r * kb + b] = (u8)code;
    } else {
        scales[swizzle_offset(r, b, kb)] = 0;
    }
    add_stats(stats, blocks, cls);
}

extern "C" __global__ void mxfp4_quantize_f32(const float* x, u64 rows, u32 cols, u8* packed,
                                              u8* scales, u32 swizzled, u64* stats) {
    mxfp4_quantize<float>(x, rows, cols, packed, scales, swizzled, stats);
}

extern "C" __global__ void mxfp4_quantize_bf16(const u16* x, u64 rows, u32 cols, u8* packed,
                                               u8* scales, u32 swizzled, u64* stats) {
    mxfp4_quantize<u16>(x, rows, cols, packed, scales, swizzled, stats);
}

// Linear [rows, kb] -> 128x4 swizzled (padding zero). One thread per padded entry.
extern "C" __global__ void scales_swizzle(const u8* __restrict__ linear, u64 rows, u64 kb,
                                          u8* __restrict__ out) {
    u64 kb_p = (kb + 3) / 4 * 4;
    u64 rows_p = (rows + 127) / 128 * 128;
    u64 idx = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= rows_p * kb_p) return;
    u64 m = idx / kb_p, k = idx % kb_p;
    out[swizzle_offset(m, k, kb)] = (m < rows && k < kb) ? linear[m * kb + k] : (u8)0;
}

// Swizzled -> linear [rows, kb] (padding dropped).
extern "C" __global__ void scales_unswizzle(const u8* __restrict__ swz, u64 rows, u64 kb,
                                            u8* __restrict__ out) {
    u64 idx = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= rows * kb) return;
    u64 m = idx / kb, k = idx % kb;
    out[idx] = swz[swizzle_offset(m, k, kb)];
}

// Codes that differ between two quantizations of the same tensor: counts[0] = differing
// E2M1 codes (nibbles), counts[1] = differing scale bytes.
extern "C" __global__ void count_flips(const u8* __restrict__ a, const u8* __restrict__ b,
                                       u64 n_packed, const u8* __restrict__ sa,
                                       const u8* __restrict__ sb, u64 n_scales,
                                       u64* __restrict__ counts) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    u32 codes = 0, sc = 0;
    if (i < n_packed) {
        u32 d = (u32)(a[i] ^ b[i]);
        codes = ((d & 0xFu) != 0u) + ((d >> 4) != 0u);
    }
    if (i < n_scales) sc = sa[i] != sb[i];
    u32 mask = __activemask();
    u32 c = __reduce_add_sync(mask, codes);
    u32 s = __reduce_add_sync(mask, sc);
    if ((int)(threadIdx.x & 31) == __ffs(mask) - 1) {
        if (c) atomicAdd(&counts[0], (u64)c);
        if (s) atomicAdd(&counts[1], (u64)s);
    }
}
