// The DeepSeek router after the FP32 logits (cuBLAS): scoring, bias, group-limited top-k or
// hash ids, unbiased weights — docs/moe-forward.md, in the CPU reference's order of f32 ops.
// One warp per token; ranking: NaN first (as torch.topk), then larger value, then lower index.
#include "nvfp4dbg_common.cuh"

#define SCORE_SIGMOID 0u
#define SCORE_SOFTMAX 1u
#define SCORE_SQRTSOFTPLUS 2u
#define ROUTER_WARPS 4

__device__ __forceinline__ bool ranks_before(float av, int ai, float bv, int bi) {
    bool an = av != av, bn = bv != bv;
    if (an != bn) return an;
    if (!an && av != bv) return av > bv;
    return ai < bi;
}

// Warp-wide best (value, index) by ranks_before; every lane gets the result. idx < 0 = none.
__device__ __forceinline__ void warp_best(float& v, int& i) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xFFFFFFFFu, v, o);
        int oi = __shfl_xor_sync(0xFFFFFFFFu, i, o);
        bool take = oi >= 0 && (i < 0 || ranks_before(ov, oi, v, i));
        if (take) {
            v = ov;
            i = oi;
        }
    }
}

// ranks_before as one unsigned key (larger ranks first; 0 is below every real key): NaN
// highest, then the value's order (+0 and -0 equal), then the lower index.
__device__ __forceinline__ u64 rank_key(float v, u32 e) {
    u32 b = __float_as_uint(v);
    u32 k = v != v ? 0xFFFFFFFFu : v == 0.0f ? 0x80000000u : (b >> 31) ? ~b : (b | 0x80000000u);
    return ((u64)k << 32) | (0xFFFFFFFFu - e);
}

#define ROUTER_MAX_J 16
// 0: every top-K round scans sel and flags in shared memory (the path for other shapes), and
// lane 0 computes the weights from the ids it stored. A/B only.
#ifndef ROUTER_KEYS
#define ROUTER_KEYS 1
#endif

// The largest of the warp's keys (every lane passes one; 0 where none), in every lane: two
// 32-bit reductions.
__device__ __forceinline__ u64 warp_max_key(u64 k) {
    u32 hi = __reduce_max_sync(0xFFFFFFFFu, (u32)(k >> 32));
    u32 lo = __reduce_max_sync(0xFFFFFFFFu, (u32)(k >> 32) == hi ? (u32)k : 0u);
    return ((u64)hi << 32) | lo;
}

// The top-K of a warp's keys, lane l holding key[j] of expert l + 32 j (0: not allowed or
// past E): round r's winner is the warp's largest key (warp_max_key), and only its lane
// rescans its keys. Lane r (< K) gets the id of slot r (-1 where no allowed expert is left,
// as the scan below).
template <int J>
__device__ __forceinline__ int topk_by_keys(u64 (&key)[J], u32 K, u32 lane) {
    auto best_of = [&]() {
        u64 b = 0;
#pragma unroll
        for (int j = 0; j < J; j++) b = key[j] > b ? key[j] : b;
        return b;
    };
    u64 best = best_of();
    int mine = -1;
    for (u32 r = 0; r < K; r++) {
        u64 win = warp_max_key(best);
        if (lane == r) mine = win == 0 ? -1 : (int)(0xFFFFFFFFu - (u32)win);
        if (win != 0 && best == win) {
#pragma unroll
            for (int j = 0; j < J; j++)
                if (key[j] == win) key[j] = 0;
            best = best_of();
        }
    }
    return mine;
}

// Steps 5 and 6 on keys in registers (E a multiple of 32, E <= 32 J, K <= 32): lane l holds
// the key of expert l + 32 j in key[j]. With `flags` (the scan's group limit done) the allowed
// experts are those flagged 1. Without, groups of 32 experts (n_group = E / 32) or none: group
// g's experts are key[g] of the 32 lanes, its score (the sum of its top-2 sel in rank order)
// two warp_max_key, and the kept groups the topk_group largest keys of (score, g). Then the
// top-K of the allowed experts; ids and weights as the scan below.
template <int J>
__device__ __forceinline__ void route_by_keys(const float* score, const float* sel, const u8* flags, u32 E, u32 K,
                                              u32 n_group, u32 topk_group, u32 norm_topk_prob,
                                              float routed_scaling_factor, u32 lane, int* ids_out, float* w_out) {
    u64 key[J];
#pragma unroll
    for (int j = 0; j < J; j++) {
        u32 e = lane + 32 * j;
        key[j] = (u32)j < E / 32 && (flags == nullptr || flags[e] == 1) ? rank_key(sel[e], e) : 0;
    }
    if (flags == nullptr && n_group > 1) {
        u64 gkey = 0;  // lane g: group g's (score, g)
#pragma unroll
        for (int j = 0; j < J; j++) {
            if ((u32)j >= n_group) break;
            u64 w1 = warp_max_key(key[j]);
            u64 w2 = warp_max_key(key[j] == w1 ? 0 : key[j]);
            float gsc = __fadd_rn(0.0f, sel[0xFFFFFFFFu - (u32)w1]);
            if (w2 != 0) gsc = __fadd_rn(gsc, sel[0xFFFFFFFFu - (u32)w2]);
            if (lane == (u32)j) gkey = rank_key(gsc, j);
        }
        u32 kept = 0;
        for (u32 r = 0; r < topk_group; r++) {
            u64 w = warp_max_key(gkey);
            if (w == 0) break;
            u32 g = 0xFFFFFFFFu - (u32)w;
            kept |= 1u << g;
            if (lane == g) gkey = 0;
        }
#pragma unroll
        for (int j = 0; j < J; j++)
            if (!((kept >> j) & 1u)) key[j] = 0;
    }
    int id = topk_by_keys(key, K, lane);
    if (lane < K) ids_out[lane] = id;  // before the division: its slow path is a call
    // 6. weights: unbiased scores of the chosen experts, normalized in slot order
    float w = id >= 0 ? score[id] : f32_nan(), sum = 0.0f;
    for (u32 j = 0; j < K; j++) sum = __fadd_rn(sum, __shfl_sync(0xFFFFFFFFu, w, (int)j));
    sum = __fadd_rn(sum, 1e-20f);
    if (norm_topk_prob) w = __fdiv_rn(w, sum);
    if (lane < K) w_out[lane] = __fmul_rn(w, routed_scaling_factor);
}

// Steps 1 and 2 for token row `l` (one warp): score[e] and sel[e] = score[e] + bias[e] in
// shared memory, visible to the whole warp on return.
__device__ __forceinline__ void router_scores(const float* __restrict__ l, u32 E, u32 scoring,
                                              const float* __restrict__ bias, u32 lane, float* score, float* sel) {
    // 1. scores
    if (scoring == SCORE_SOFTMAX) {
        if (lane == 0) {
            float m = -__int_as_float(0x7f800000);
            for (u32 e = 0; e < E; e++) {
                float v = l[e];
                if (v > m || v != v) m = v;
                if (m != m) break;
            }
            double sum = 0.0;
            for (u32 e = 0; e < E; e++) {
                float ex = expf_cr(__fsub_rn(l[e], m));
                score[e] = ex;
                sum += (double)ex;
            }
            float s = (float)sum;
            for (u32 e = 0; e < E; e++) score[e] = __fdiv_rn(score[e], s);
        }
    } else {
        for (u32 e = lane; e < E; e += 32) {
            float v = l[e];
            float s;
            if (scoring == SCORE_SIGMOID) {
                s = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf_cr(-v)));
            } else {
                float sp = v > 20.0f ? v : (float)log1p((double)expf_cr(v));
                s = __fsqrt_rn(sp);
            }
            score[e] = s;
        }
    }
    __syncwarp();
    // 2. selection scores
    for (u32 e = lane; e < E; e += 32) sel[e] = bias ? __fadd_rn(score[e], bias[e]) : score[e];
    __syncwarp();
}

// router_topk where its top-K runs on keys alone (route_by_keys without flags): E a multiple
// of 32 up to 32 J, K <= 32, groups of 32 experts (n_group = E / 32) or no group limit, no
// hash (the host checks). The same arguments and shared memory as router_topk; kernels of
// their own (router_topk_keys8 for E <= 256, router_topk_keys16), so that neither the general
// kernel's registers and calls nor the other J weigh on them.
template <int J>
__device__ __forceinline__ void router_topk_keys(const float* __restrict__ logits, u32 T, u32 E, u32 K, u32 scoring,
                                                 const float* __restrict__ bias, u32 n_group, u32 topk_group,
                                                 u32 norm_topk_prob, float routed_scaling_factor,
                                                 int* __restrict__ topk_ids, float* __restrict__ topk_weights) {
    extern __shared__ float smem[];
    u32 warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    u32 t = blockIdx.x * ROUTER_WARPS + warp;
    float* score = smem + (size_t)warp * 2 * E;
    float* sel = score + E;
    if (t >= T) return;  // whole warps only: T is per warp
    router_scores(logits + (size_t)t * E, E, scoring, bias, lane, score, sel);
    route_by_keys<J>(score, sel, nullptr, E, K, n_group, topk_group, norm_topk_prob, routed_scaling_factor, lane,
                     topk_ids + (size_t)t * K, topk_weights + (size_t)t * K);
}
extern "C" __global__ void __launch_bounds__(ROUTER_WARPS * 32)
router_topk_keys8(const float* __restrict__ logits, u32 T, u32 E, u32 K, u32 scoring, const float* __restrict__ bias,
                  u32 n_group, u32 topk_group, u32 norm_topk_prob, float routed_scaling_factor,
                  const i64* __restrict__ tid2eid, const i64* __restrict__ input_ids, int* __restrict__ topk_ids,
                  float* __restrict__ topk_weights) {
    router_topk_keys<8>(logits, T, E, K, scoring, bias, n_group, topk_group, norm_topk_prob, routed_scaling_factor,
                        topk_ids, topk_weights);
}
extern "C" __global__ void __launch_bounds__(ROUTER_WARPS * 32)
router_topk_keys16(const float* __restrict__ logits, u32 T, u32 E, u32 K, u32 scoring, const float* __restrict__ bias,
                   u32 n_group, u32 topk_group, u32 norm_topk_prob, float routed_scaling_factor,
                   const i64* __restrict__ tid2eid, const i64* __restrict__ input_ids, int* __restrict__ topk_ids,
                   float* __restrict__ topk_weights) {
    router_topk_keys<16>(logits, T, E, K, scoring, bias, n_group, topk_group, norm_topk_prob, routed_scaling_factor,
                         topk_ids, topk_weights);
}

// logits [T, E] (f32) -> topk_ids [T, K] (i32), topk_weights [T, K] (f32).
// Dynamic shared memory: ROUTER_WARPS * (2 * E floats + E bytes).
// Hash layers pass tid2eid [vocab, K] and input_ids [T] (both checked on the host).
extern "C" __global__ void __launch_bounds__(ROUTER_WARPS * 32)
router_topk(const float* __restrict__ logits, u32 T, u32 E, u32 K, u32 scoring,
            const float* __restrict__ bias, u32 n_group, u32 topk_group, u32 norm_topk_prob,
            float routed_scaling_factor, const i64* __restrict__ tid2eid,
            const i64* __restrict__ input_ids, int* __restrict__ topk_ids,
            float* __restrict__ topk_weights) {
    extern __shared__ float smem[];
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    u32 t = blockIdx.x * ROUTER_WARPS + warp;
    float* score = smem + (size_t)warp * 2 * E;
    float* sel = score + E;
    u8* flags = reinterpret_cast<u8*>(smem + (size_t)ROUTER_WARPS * 2 * E) + (size_t)warp * E;
    if (t >= T) return;  // whole warps only: T is per warp
    router_scores(logits + (size_t)t * E, E, scoring, bias, lane, score, sel);
    for (u32 e = lane; e < E; e += 32) flags[e] = 1;  // allowed, not taken
    __syncwarp();

    int* ids_out = topk_ids + (size_t)t * K;
    float* w_out = topk_weights + (size_t)t * K;
    if (tid2eid != nullptr) {
        // 4. hash layer: ids straight from the table
        if (lane == 0) {
            i64 row = input_ids[t];
            for (u32 j = 0; j < K; j++) ids_out[j] = (int)tid2eid[row * K + j];
        }
    } else {
        // 5. group limit: score of a group = sum of its top-2 sel; keep topk_group groups
        if (n_group > 1 && n_group <= 32) {
            // the group scores do not change while groups are kept: lane g computes group g's
            // once, then every lane runs the same greedy pick over them (shuffles), in the
            // order and with the ties of the serial scan below
            u32 gsz = E / n_group;
            float gsc = 0.0f;
            if ((u32)lane < n_group) {
                float v1 = 0.0f, v2 = 0.0f;
                int i1 = -1, i2 = -1;
                for (u32 e = lane * gsz; e < (lane + 1) * gsz; e++) {
                    float v = sel[e];
                    if (i1 < 0 || ranks_before(v, (int)e, v1, i1)) {
                        v2 = v1; i2 = i1; v1 = v; i1 = (int)e;
                    } else if (i2 < 0 || ranks_before(v, (int)e, v2, i2)) {
                        v2 = v; i2 = (int)e;
                    }
                }
                gsc = __fadd_rn(0.0f, v1);
                if (i2 >= 0) gsc = __fadd_rn(gsc, v2);
            }
            for (u32 e = lane; e < E; e += 32) flags[e] = 0;
            u32 kept_mask = 0;
            for (u32 kept = 0; kept < topk_group; kept++) {
                float best_v = 0.0f;
                int best_g = -1;
                for (u32 g = 0; g < n_group; g++) {
                    float v = __shfl_sync(0xFFFFFFFFu, gsc, (int)g);
                    if ((kept_mask >> g) & 1u) continue;
                    if (best_g < 0 || ranks_before(v, (int)g, best_v, best_g)) {
                        best_v = v;
                        best_g = (int)g;
                    }
                }
                if (best_g < 0) break;
                kept_mask |= 1u << best_g;
            }
            __syncwarp();
            for (u32 e = lane; e < E; e += 32) {
                u32 g = e / gsz;
                if (g < n_group && ((kept_mask >> g) & 1u)) flags[e] = 1;
            }
            __syncwarp();
        } else if (n_group > 1) {
            u32 gsz = E / n_group;
            if (lane == 0) {
                // group scores into the tail of `score`? no: keep them in registers of lane 0
                // by re-scanning (n_group is small); flags[] marks kept experts.
                for (u32 e = 0; e < E; e++) flags[e] = 0;
                for (u32 kept = 0; kept < topk_group; kept++) {
                    float best_v = 0.0f;
                    int best_g = -1;
                    for (u32 g = 0; g < n_group; g++) {
                        if (flags[g * gsz] != 0) continue;  // already kept
                        float v1 = 0.0f, v2 = 0.0f;
                        int i1 = -1, i2 = -1;
                        for (u32 e = g * gsz; e < (g + 1) * gsz; e++) {
                            float v = sel[e];
                            if (i1 < 0 || ranks_before(v, (int)e, v1, i1)) {
                                v2 = v1; i2 = i1; v1 = v; i1 = (int)e;
                            } else if (i2 < 0 || ranks_before(v, (int)e, v2, i2)) {
                                v2 = v; i2 = (int)e;
                            }
                        }
                        float gsc = __fadd_rn(0.0f, v1);
                        if (i2 >= 0) gsc = __fadd_rn(gsc, v2);
                        if (best_g < 0 || ranks_before(gsc, (int)g, best_v, best_g)) {
                            best_v = gsc;
                            best_g = (int)g;
                        }
                    }
                    for (u32 e = best_g * gsz; e < (best_g + 1) * gsz; e++) flags[e] = 1;
                }
            }
            __syncwarp();
        }
        // top-K of sel among allowed experts, descending
        if (ROUTER_KEYS && E % 32 == 0 && E <= 32 * ROUTER_MAX_J && K <= 32) {
            // the keys in registers, the ids and weights in lanes (slot r in lane r)
            route_by_keys<ROUTER_MAX_J>(score, sel, flags, E, K, 0, 0, norm_topk_prob, routed_scaling_factor, lane,
                                        ids_out, w_out);
            return;
        }
        for (u32 j = 0; j < K; j++) {
            float bv = 0.0f;
            int bi = -1;
            for (u32 e = lane; e < E; e += 32) {
                if (flags[e] != 1) continue;
                if (bi < 0 || ranks_before(sel[e], (int)e, bv, bi)) {
                    bv = sel[e];
                    bi = (int)e;
                }
            }
            warp_best(bv, bi);
            if (lane == 0) {
                ids_out[j] = bi;
                if (bi >= 0) flags[bi] = 2;
            }
            __syncwarp();
        }
    }
    __syncwarp();
    // 6. weights: unbiased scores of the chosen experts, normalized in slot order
    if (lane == 0) {
        float sum = 0.0f;
        for (u32 j = 0; j < K; j++) {
            int id = ids_out[j];
            float w = id >= 0 ? score[id] : f32_nan();
            w_out[j] = w;
            sum = __fadd_rn(sum, w);
        }
        sum = __fadd_rn(sum, 1e-20f);
        for (u32 j = 0; j < K; j++) {
            float w = w_out[j];
            if (norm_topk_prob) w = __fdiv_rn(w, sum);
            w_out[j] = __fmul_rn(w, routed_scaling_factor);
        }
    }
}
