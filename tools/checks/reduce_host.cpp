// Host emulation of kernels/reduce.cu's compare reduction, for tests/reduce_merge_host.rs: the
// kernel's own Acc functions (acc_zero, acc_takes, acc_merge, acc_sums, acc_one, acc_batch), cut from
// reduce.cu by the test into reduce_acc.inc, run in the kernels' partition and merge order:
// each block's 256 threads over their strided elements (a whole block's in batches through
// acc_batch, the tail block's through acc_one), the shuffle-down tree in each warp, warps in
// order, then pass 2 over the partials the same way.
//
// stdin: cases, each `n` (u64) then n f32 test values and n f32 reference values.
// stdout: two lines a case, the kernels' order and then every element through acc_one: the
// Acc's fields (f64 as bits, hex): max_abs max_idx nan first_nan inf first_inf len dot nt nr err.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>
typedef unsigned long long u64;
#define NONE_IDX 0xFFFFFFFFFFFFFFFFull
#define __device__
#define __forceinline__ inline
static inline double __fma_rn(double a, double b, double c) { return std::fma(a, b, c); }
#define REDUCE_THREADS 256
#define COMPARE_CHUNK 32768
#define COMPARE_STEP (REDUCE_THREADS * 4)
#define COMPARE_BATCH 8
struct float4 {
    float x, y, z, w;
};
#include "reduce_acc.inc"

// 256 accumulators as one block merges them: the shuffle-down tree in each warp (a lane past
// the warp reads its own value, as __shfl_down_sync gives), then the warps in order.
static Acc block_merge(const std::vector<Acc>& th) {
    Acc out;
    for (int w = 0; w < REDUCE_THREADS / 32; w++) {
        Acc lane[32];
        for (int l = 0; l < 32; l++) lane[l] = th[w * 32 + l];
        for (int s = 16; s > 0; s >>= 1) {
            Acc next[32];
            for (int l = 0; l < 32; l++) {
                next[l] = lane[l];
                acc_merge(next[l], l + s < 32 ? lane[l + s] : lane[l]);
            }
            for (int l = 0; l < 32; l++) lane[l] = next[l];
        }
        if (w == 0) out = lane[0];
        else acc_merge(out, lane[0]);
    }
    return out;
}

// Pass 1 and pass 2 over n values; `batches`: whole blocks through acc_batch, as the kernel
// runs them (aligned inputs), else every element through acc_one.
static Acc reduce(const std::vector<float>& t, const std::vector<float>& r, u64 n, bool batches) {
    std::vector<Acc> partials;
    for (u64 lo = 0; lo < n; lo += COMPARE_CHUNK) {
        std::vector<Acc> th(REDUCE_THREADS);
        for (int x = 0; x < REDUCE_THREADS; x++) {
            acc_zero(th[x]);
            if (batches && lo + COMPARE_CHUNK <= n) {
                for (int j0 = 0; j0 < COMPARE_CHUNK / COMPARE_STEP; j0 += COMPARE_BATCH) {
                    float4 tv[COMPARE_BATCH], rv[COMPARE_BATCH];
                    u64 i0 = lo + (u64)j0 * COMPARE_STEP + 4 * x;
                    for (int j = 0; j < COMPARE_BATCH; j++) {
                        memcpy(&tv[j], &t[i0 + (u64)j * COMPARE_STEP], 16);
                        memcpy(&rv[j], &r[i0 + (u64)j * COMPARE_STEP], 16);
                    }
                    acc_batch(th[x], tv, rv, i0);
                }
                continue;
            }
            for (int j = 0; j < COMPARE_CHUNK / COMPARE_STEP; j++) {
                u64 i = lo + (u64)j * COMPARE_STEP + 4 * x;
                for (int c = 0; c < 4; c++)
                    if (i + c < n) acc_one(th[x], t[i + c], r[i + c], i + c);
            }
        }
        partials.push_back(block_merge(th));
    }
    std::vector<Acc> th(REDUCE_THREADS);
    for (int x = 0; x < REDUCE_THREADS; x++) {
        acc_zero(th[x]);
        for (u64 i = x; i < partials.size(); i += REDUCE_THREADS) acc_merge(th[x], partials[i]);
    }
    return block_merge(th);
}

static unsigned long long bits(double v) {
    unsigned long long b;
    memcpy(&b, &v, 8);
    return b;
}

static void print(const Acc& a) {
    printf("%llx %lld %llu %lld %llu %lld %llu %llx %llx %llx %llx\n", bits(a.max_abs),
           a.max_idx == NONE_IDX ? -1LL : (long long)a.max_idx, a.nan,
           a.first_nan == NONE_IDX ? -1LL : (long long)a.first_nan, a.inf,
           a.first_inf == NONE_IDX ? -1LL : (long long)a.first_inf, a.len, bits(a.dot), bits(a.nt),
           bits(a.nr), bits(a.err));
}

int main() {
    u64 n;
    while (fread(&n, 8, 1, stdin) == 1) {
        std::vector<float> t(n), r(n);
        if (fread(t.data(), 4, n, stdin) != n || fread(r.data(), 4, n, stdin) != n) return 2;
        print(reduce(t, r, n, true));
        print(reduce(t, r, n, false));
    }
    return 0;
}
