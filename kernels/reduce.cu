// Comparison metrics (src/metrics.rs Accum) with a deterministic two-pass reduction: pass 1
// gives each block a fixed slice and reduces it in a fixed tree order; pass 2 reduces the
// per-block partials in one block the same way. No float atomics anywhere.
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

// `b` follows `a` in index order, so ties in max_abs keep a's (lower) index.
__device__ __forceinline__ void acc_merge(Acc& a, const Acc& b) {
    a.dot += b.dot;
    a.nt += b.nt;
    a.nr += b.nr;
    a.err += b.err;
    if (b.max_idx != NONE_IDX && (a.max_idx == NONE_IDX || b.max_abs > a.max_abs)) {
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

// Tree-reduce one Acc per thread into thread 0, in a fixed order (thread i absorbs i + s).
__device__ void block_reduce(Acc& mine, Acc* sh) {
    sh[threadIdx.x] = mine;
    __syncthreads();
    for (int s = REDUCE_THREADS / 2; s > 0; s >>= 1) {
        if ((int)threadIdx.x < s) {
            Acc a = sh[threadIdx.x];
            acc_merge(a, sh[threadIdx.x + s]);
            sh[threadIdx.x] = a;
        }
        __syncthreads();
    }
    mine = sh[0];
}

// Pass 1: block b covers [b * chunk, (b + 1) * chunk); thread t takes a contiguous sub-slice,
// so merging thread accumulators in thread order keeps index order.
extern "C" __global__ void __launch_bounds__(REDUCE_THREADS)
compare_partial(const float* __restrict__ test, const float* __restrict__ ref, u64 n, u64 chunk,
                Acc* __restrict__ partials) {
    __shared__ Acc sh[REDUCE_THREADS];
    u64 lo = (u64)blockIdx.x * chunk;
    u64 hi = lo + chunk < n ? lo + chunk : n;
    u64 per = (chunk + REDUCE_THREADS - 1) / REDUCE_THREADS;
    u64 a0 = lo + per * threadIdx.x;
    u64 a1 = a0 + per < hi ? a0 + per : hi;
    Acc a;
    acc_zero(a);
    for (u64 i = a0; i < a1; i++) {
        float t = test[i], r = ref[i];
        a.len++;
        if (t != t) {
            a.nan++;
            if (a.first_nan == NONE_IDX) a.first_nan = i;
            continue;
        }
        if (isinf(t)) {
            a.inf++;
            if (a.first_inf == NONE_IDX) a.first_inf = i;
            continue;
        }
        double td = (double)t, rd = (double)r;
        a.dot = __fma_rn(td, rd, a.dot);
        a.nt = __fma_rn(td, td, a.nt);
        a.nr = __fma_rn(rd, rd, a.nr);
        double d = td - rd;
        a.err = __fma_rn(d, d, a.err);
        double ad = fabs(d);
        if (a.max_idx == NONE_IDX || ad > a.max_abs) {
            a.max_abs = ad;
            a.max_idx = i;
        }
    }
    block_reduce(a, sh);
    if (threadIdx.x == 0) partials[blockIdx.x] = a;
}

// Pass 2: one block over `count` partials, each thread a contiguous run of them.
extern "C" __global__ void __launch_bounds__(REDUCE_THREADS)
compare_final(const Acc* __restrict__ partials, u64 count, Acc* __restrict__ out) {
    __shared__ Acc sh[REDUCE_THREADS];
    u64 per = (count + REDUCE_THREADS - 1) / REDUCE_THREADS;
    u64 a0 = per * threadIdx.x;
    u64 a1 = a0 + per < count ? a0 + per : count;
    Acc a;
    acc_zero(a);
    for (u64 i = a0; i < a1; i++) acc_merge(a, partials[i]);
    block_reduce(a, sh);
    if (threadIdx.x == 0) *out = a;
}

// amax over a tensor, NaN-propagating, as a u32 bit pattern max (exact and order-free:
// max is associative, so atomics on it are deterministic). NaN is recorded as 0x7FC00000
// which is above every finite and infinite magnitude.
extern "C" __global__ void amax_f32(const float* __restrict__ x, u64 n, u32* __restrict__ out) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    u64 stride = (u64)gridDim.x * blockDim.x;
    u32 m = 0;
    for (; i < n; i += stride) {
        float a = fabsf(x[i]);
        u32 b = a != a ? 0x7FC00000u : __float_as_uint(a);
        m = b > m ? b : m;
    }
    m = __reduce_max_sync(0xFFFFFFFFu, m);
    if ((threadIdx.x & 31) == 0 && m) atomicMax(out, m);
}
