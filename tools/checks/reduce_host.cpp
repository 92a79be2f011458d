// Host emulation of kernels/reduce.cu's compare reduction, for tests/reduce_merge_host.rs: the
// kernel's own Acc functions (acc_zero, acc_takes, acc_merge, acc_one), cut from reduce.cu by
// the test into reduce_acc.inc, run in the kernels' partition and merge order: each block's
// 256 threads over their strided elements, the shuffle-down tree in each warp, warps in
// order, then pass 2 over the partials the same way.
//
// stdin: cases, each `n` (u64) then n f32 test values and n f32 reference values.
// stdout: a line a case: max_abs as f64 bits (hex), max_idx, nan, first_nan.
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

int main() {
    u64 n;
    while (fread(&n, 8, 1, stdin) == 1) {
        std::vector<float> t(n), r(n);
        if (fread(t.data(), 4, n, stdin) != n || fread(r.data(), 4, n, stdin) != n) return 2;
        std::vector<Acc> partials;
        for (u64 lo = 0; lo < n; lo += COMPARE_CHUNK) {
            std::vector<Acc> th(REDUCE_THREADS);
            for (int x = 0; x < REDUCE_THREADS; x++) {
                acc_zero(th[x]);
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
        Acc a = block_merge(th);
        uint64_t bits;
        memcpy(&bits, &a.max_abs, 8);
        printf("%llx %lld %llu %lld\n", (unsigned long long)bits,
               a.max_idx == NONE_IDX ? -1LL : (long long)a.max_idx, a.nan,
               a.first_nan == NONE_IDX ? -1LL : (long long)a.first_nan);
    }
    return 0;
}
