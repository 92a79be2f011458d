// Comparison metrics (src/metrics.rs Accum) with a deterministic two-pass reduction: pass 1
// streams both tensors once with 16-byte loads, each thread keeping its sums in registers
// (f64), and reduces a fixed slice per block in a fixed shuffle-tree order; pass 2 reduces
// the per-block partials in one block the same way. No float atomics anywhere.
#include "nvfp4dbg_common.cuh"

struct Acc {
    double dot, nt, nr, err, max_abs;
    u64 max_idx, nan, inf, first_nan, first_inf, len;
};

__device__ __forceinline__ void acc_zero(Acc& a) {
    a.dot = a.nt = a.nr = a.err = a.max_abs = 0.0;
    a.max_idx = NONE_IDX;
    a.nan = a.inf = 0;
    a.first_nan = a.first_inf = NONE_IDX;
    a.len = 0;
}

// Whether |difference| d at index i takes the maximum a holds (src/metrics.rs
// Accum::takes): a NaN difference (a NaN reference value) ranks above every number, and of
// equal values the lower index wins, so the result is the same whatever the merge order.
__device__ __forceinline__ bool acc_takes(const Acc& a, double d, u64 i) {
    if (a.max_idx == NONE_IDX) return true;
    bool n = d != d, held_n = a.max_abs != a.max_abs;
    if (n != held_n) return n;
    return d > a.max_abs || ((n || d == a.max_abs) && i < a.max_idx);
}

__device__ __forceinline__ void acc_merge(Acc& a, const Acc& b) {
    a.dot += b.dot;
    a.nt += b.nt;
    a.nr += b.nr;
    a.err += b.err;
    if (b.max_idx != NONE_IDX && acc_takes(a, b.max_abs, b.max_idx)) {
        a.max_abs = b.max_abs;
        a.max_idx = b.max_idx;
    }
    a.nan += b.nan;
    a.inf += b.inf;
    a.first_nan = b.first_nan < a.first_nan ? b.first_nan : a.first_nan;
    a.first_inf = b.first_inf < a.first_inf ? b.first_inf : a.first_inf;
    a.len += b.len;
}

#define REDUCE_THREADS 256
#define REDUCE_WARPS (REDUCE_THREADS / 32)
// Pass 1: block b covers elements [b * CHUNK, (b + 1) * CHUNK); in step j thread t takes the
// four elements at b * CHUNK + j * 1024 + 4t (one 16-byte load of each tensor), eight steps
// loaded before any is used. CHUNK is fixed (src/backend/cuda/reduce.rs), so the partition
// and every summation order do not depend on the device.
#define COMPARE_CHUNK 32768
#define COMPARE_STEP (REDUCE_THREADS * 4)
#define COMPARE_BATCH 8

// A finite test value's terms of the sums; returns |t - r| (exact in f64).
__device__ __forceinline__ double acc_sums(Acc& a, float t, float r) {
    double td = (double)t, rd = (double)r;
    a.dot = __fma_rn(td, rd, a.dot);
    a.nt = __fma_rn(td, td, a.nt);
    a.nr = __fma_rn(rd, rd, a.nr);
    double d = td - rd;
    a.err = __fma_rn(d, d, a.err);
    return fabs(d);
}

__device__ __forceinline__ void acc_one(Acc& a, float t, float r, u64 i) {
    a.len++;
    if (!(fabsf(t) <= 3.402823466e38f)) {  // NaN or infinite: counted, left out of the sums
        if (t != t) {
            a.nan++;
            a.first_nan = i < a.first_nan ? i : a.first_nan;
        } else {
            a.inf++;
            a.first_inf = i < a.first_inf ? i : a.first_inf;
        }
        return;
    }
    double ad = acc_sums(a, t, r);
    // acc_takes where indices only grow (as in each thread's pass): a tie keeps the held,
    // lower index, so the difference takes the maximum iff it is not at or below it (a NaN
    // is neither) and the maximum held is not already NaN
    bool takes = a.max_idx == NONE_IDX || (!(ad <= a.max_abs) && a.max_abs == a.max_abs);
    if (takes) {
        a.max_abs = ad;
        a.max_idx = i;
    }
}

// One batch of pass 1 (thread t's COMPARE_BATCH float4 of each tensor; element c of vector j
// is index i0 + j * COMPARE_STEP + c, ascending). Where all its values are finite there is
// no NaN or Inf to count and no NaN difference, so the batch needs only the sums and a
// strictly greater maximum (a tie keeps the held, lower index; nothing beats a held NaN),
// with no branch between elements; else it goes element by element through acc_one.
__device__ __forceinline__ void acc_batch(Acc& a, const float4* tv, const float4* rv, u64 i0) {
    const float big = 3.402823466e38f;
    bool bad = false;
#pragma unroll
    for (int j = 0; j < COMPARE_BATCH; j++) {
        const float t[4] = {tv[j].x, tv[j].y, tv[j].z, tv[j].w};
        const float r[4] = {rv[j].x, rv[j].y, rv[j].z, rv[j].w};
#pragma unroll
        for (int c = 0; c < 4; c++) bad |= !(fabsf(t[c]) <= big) | !(fabsf(r[c]) <= big);
    }
    if (bad) {
#pragma unroll
        for (int j = 0; j < COMPARE_BATCH; j++) {
            u64 i = i0 + (u64)j * COMPARE_STEP;
            acc_one(a, tv[j].x, rv[j].x, i);
            acc_one(a, tv[j].y, rv[j].y, i + 1);
            acc_one(a, tv[j].z, rv[j].z, i + 2);
            acc_one(a, tv[j].w, rv[j].w, i + 3);
        }
        return;
    }
    double m = a.max_idx == NONE_IDX ? -1.0 : a.max_abs;
    int best = -1;
#pragma unroll
    for (int j = 0; j < COMPARE_BATCH; j++) {
        const float t[4] = {tv[j].x, tv[j].y, tv[j].z, tv[j].w};
        const float r[4] = {rv[j].x, rv[j].y, rv[j].z, rv[j].w};
#pragma unroll
        for (int c = 0; c < 4; c++) {
            double ad = acc_sums(a, t[c], r[c]);
            bool takes = ad > m;
            m = takes ? ad : m;
            best = takes ? 4 * j + c : best;
        }
    }
    if (best >= 0) {
        a.max_abs = m;
        a.max_idx = i0 + (u64)(best / 4) * COMPARE_STEP + best % 4;
    }
    a.len += 4 * COMPARE_BATCH;
}

__device__ __forceinline__ double shfl_d(double v, int src) { return __shfl_down_sync(0xFFFFFFFFu, v, src); }
__device__ __forceinline__ u64 shfl_u(u64 v, int src) { return __shfl_down_sync(0xFFFFFFFFu, v, src); }

// Lane 0 gets the merge of the warp's accumulators (a fixed shuffle tree).
__device__ __forceinline__ void warp_reduce(Acc& a) {
#pragma unroll
    for (int s = 16; s > 0; s >>= 1) {
        Acc b;
        b.dot = shfl_d(a.dot, s);
        b.nt = shfl_d(a.nt, s);
        b.nr = shfl_d(a.nr, s);
        b.err = shfl_d(a.err, s);
        b.max_abs = shfl_d(a.max_abs, s);
        b.max_idx = shfl_u(a.max_idx, s);
        b.nan = shfl_u(a.nan, s);
        b.inf = shfl_u(a.inf, s);
        b.first_nan = shfl_u(a.first_nan, s);
        b.first_inf = shfl_u(a.first_inf, s);
        b.len = shfl_u(a.len, s);
        acc_merge(a, b);
    }
}

// Thread 0 gets the merge of the block (warps merged in warp order).
__device__ __forceinline__ void block_reduce(Acc& a, Acc* sh) {
    warp_reduce(a);
    int warp = threadIdx.x / 32;
    if ((threadIdx.x & 31) == 0) sh[warp] = a;
    __syncthreads();
    if (threadIdx.x == 0) {
        a = sh[0];
        for (int w = 1; w < REDUCE_WARPS; w++) acc_merge(a, sh[w]);
    }
}

extern "C" __global__ void __launch_bounds__(REDUCE_THREADS)
compare_partial(const float* __restrict__ test, const float* __restrict__ ref, u64 n,
                Acc* __restrict__ partials) {
    __shared__ Acc sh[REDUCE_WARPS];
    u64 lo = (u64)blockIdx.x * COMPARE_CHUNK;
    Acc a;
    acc_zero(a);
    bool aligned = ((reinterpret_cast<u64>(test) | reinterpret_cast<u64>(ref)) & 15u) == 0;
    if (aligned && lo + COMPARE_CHUNK <= n) {
        const float4* t4 = reinterpret_cast<const float4*>(test + lo) + threadIdx.x;
        const float4* r4 = reinterpret_cast<const float4*>(ref + lo) + threadIdx.x;
#pragma unroll 1
        for (int j0 = 0; j0 < COMPARE_CHUNK / COMPARE_STEP; j0 += COMPARE_BATCH) {
            float4 tv[COMPARE_BATCH], rv[COMPARE_BATCH];
#pragma unroll
            for (int j = 0; j < COMPARE_BATCH; j++) {
                tv[j] = __ldcs(t4 + (j0 + j) * REDUCE_THREADS);
                rv[j] = __ldcs(r4 + (j0 + j) * REDUCE_THREADS);
            }
            acc_batch(a, tv, rv, lo + (u64)j0 * COMPARE_STEP + 4 * threadIdx.x);
        }
    } else {
        // the tail block (or unaligned inputs): the same elements in the same order, scalar
        for (int j = 0; j < COMPARE_CHUNK / COMPARE_STEP; j++) {
            u64 i = lo + (u64)j * COMPARE_STEP + 4 * threadIdx.x;
#pragma unroll
            for (int c = 0; c < 4; c++)
                if (i + c < n) acc_one(a, test[i + c], ref[i + c], i + c);
        }
    }
    block_reduce(a, sh);
    if (threadIdx.x == 0) partials[blockIdx.x] = a;
}

// Pass 2: one block over `count` partials, thread t merging partials t, t + 256, ... in
// order, then the block merge.
extern "C" __global__ void __launch_bounds__(REDUCE_THREADS)
compare_final(const Acc* __restrict__ partials, u64 count, Acc* __restrict__ out) {
    __shared__ Acc sh[REDUCE_WARPS];
    Acc a;
    acc_zero(a);
    for (u64 i = threadIdx.x; i < count; i += REDUCE_THREADS) acc_merge(a, partials[i]);
    block_reduce(a, sh);
    if (threadIdx.x == 0) *out = a;
}

// amax over a tensor, NaN-propagating, as a u32 bit pattern max (exact and order-free:
// max is associative, so atomics on it are deterministic). NaN is recorded as 0x7FC00000
// which is above every finite and infinite magnitude. Each thread takes the max of the
// magnitudes' bits (every NaN's above +Inf's 0x7F800000) and names a NaN once, at the end.
__device__ __forceinline__ u32 abs_bits(float v) { return __float_as_uint(v) & 0x7FFFFFFFu; }

extern "C" __global__ void amax_f32(const float* __restrict__ x, u64 n, u32* __restrict__ out) {
    u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    u64 stride = (u64)gridDim.x * blockDim.x;
    u32 m = 0;
    u64 i = tid;
    if ((reinterpret_cast<u64>(x) & 15u) == 0) {
        // 16-byte loads, four in flight per thread; the tail (n % 4) below
        const float4* x4 = reinterpret_cast<const float4*>(x);
        u64 n4 = n / 4;
        for (; i + 3 * stride < n4; i += 4 * stride) {
            float4 v[4];
#pragma unroll
            for (int j = 0; j < 4; j++) v[j] = __ldcs(x4 + i + j * stride);
#pragma unroll
            for (int j = 0; j < 4; j++)
                m = max(max(m, max(abs_bits(v[j].x), abs_bits(v[j].y))), max(abs_bits(v[j].z), abs_bits(v[j].w)));
        }
        for (; i < n4; i += stride) {
            float4 v = __ldcs(x4 + i);
            m = max(max(m, max(abs_bits(v.x), abs_bits(v.y))), max(abs_bits(v.z), abs_bits(v.w)));
        }
        i = n4 * 4 + tid;
    }
    for (; i < n; i += stride) m = max(m, abs_bits(x[i]));
    m = m > 0x7F800000u ? 0x7FC00000u : m;
    // one atomic a block, not a warp: same-address atomics serialize in the L2 (a warp's
    // each, 32768 over 64M values, cost ~7.5 us on an H100: s45f in BENCHMARKS.md)
    __shared__ u32 warp_max[32];
    m = __reduce_max_sync(0xFFFFFFFFu, m);
    if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x / 32] = m;
    __syncthreads();
    if (threadIdx.x < 32) {
        m = threadIdx.x < (blockDim.x + 31) / 32 ? warp_max[threadIdx.x] : 0;
        m = __reduce_max_sync(0xFFFFFFFFu, m);
        if (threadIdx.x == 0 && m) atomicMax(out, m);
    }
}
