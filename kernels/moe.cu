// The routed experts on the GPU: a deterministic counting sort of (token, slot) entries by
// expert, the grouped NVFP4 GEMM (FP4 x E4M3 dequantized exactly to BF16 in shared memory,
// BF16 mma.sync m16n8k16 with FP32 accumulation, alpha in the FP32 epilogue), SwiGLU fused
// with the re-quantization of the intermediate, and the weighted combine in slot order.
// No order-dependent float atomics: the only atomics are integer counts and max-of-bits.
#include "nvfp4dbg_common.cuh"

// ---------------------------------------------------------------------------------------
// Counting sort. Entries i = t*K + slot in [0, N); chunk c = entries [c*256, c*256 + 256).

#define SORT_CHUNK 256

// chunk_counts[c * E + e] = entries of chunk c routed to e.
extern "C" __global__ void __launch_bounds__(SORT_CHUNK)
moe_chunk_counts(const int* __restrict__ ids, u32 N, u32 E, u32* __restrict__ chunk_counts) {
    extern __shared__ u32 cnt[];
    for (u32 e = threadIdx.x; e < E; e += blockDim.x) cnt[e] = 0;
    __syncthreads();
    u32 i = blockIdx.x * SORT_CHUNK + threadIdx.x;
    if (i < N) atomicAdd(&cnt[ids[i]], 1u);
    __syncthreads();
    for (u32 e = threadIdx.x; e < E; e += blockDim.x) chunk_counts[(size_t)blockIdx.x * E + e] = cnt[e];
}

// One block. chunk_base[c*E + e] = first sorted position of chunk c's entries for expert e;
// expert_offsets[E+1]; tile_offsets[E+1] = prefix sum of ceil(count_e / bm).
extern "C" __global__ void moe_offsets(const u32* __restrict__ chunk_counts, u32 nchunks, u32 E,
                                       u32 bm, u32* __restrict__ chunk_base,
                                       u32* __restrict__ expert_offsets,
                                       u32* __restrict__ tile_offsets) {
    extern __shared__ u32 total[];
    for (u32 e = threadIdx.x; e < E; e += blockDim.x) {
        u32 run = 0;
        for (u32 c = 0; c < nchunks; c++) {
            chunk_base[(size_t)c * E + e] = run;
            run += chunk_counts[(size_t)c * E + e];
        }
        total[e] = run;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        u32 off = 0, tiles = 0;
        for (u32 e = 0; e < E; e++) {
            expert_offsets[e] = off;
            tile_offsets[e] = tiles;
            off += total[e];
            tiles += (total[e] + bm - 1) / bm;
            total[e] = expert_offsets[e];
        }
        expert_offsets[E] = off;
        tile_offsets[E] = tiles;
    }
    __syncthreads();
    for (u32 e = threadIdx.x; e < E; e += blockDim.x) {
        u32 base = total[e];
        for (u32 c = 0; c < nchunks; c++) chunk_base[(size_t)c * E + e] += base;
    }
}

// Stable scatter: within an expert, entries keep their index order. Warps of a chunk take
// turns, ranks inside a warp come from __match_any_sync.
extern "C" __global__ void __launch_bounds__(SORT_CHUNK)
moe_scatter(const int* __restrict__ ids, u32 N, u32 E, u32 K, const u32* __restrict__ chunk_base,
            int* __restrict__ sorted_token, int* __restrict__ sorted_expert,
            int* __restrict__ sorted_entry, int* __restrict__ entry_pos) {
    extern __shared__ u32 running[];
    for (u32 e = threadIdx.x; e < E; e += blockDim.x) running[e] = chunk_base[(size_t)blockIdx.x * E + e];
    __syncthreads();
    u32 i = blockIdx.x * SORT_CHUNK + threadIdx.x;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int id = i < N ? ids[i] : -1 - lane;  // distinct dummies never match a real id
    for (int w = 0; w < SORT_CHUNK / 32; w++) {
        if (warp == w) {
            u32 peers = __match_any_sync(0xFFFFFFFFu, id);
            u32 rank = __popc(peers & ((1u << lane) - 1u));
            if (id >= 0) {
                u32 pos = running[id] + rank;
                sorted_token[pos] = (int)(i / K);
                sorted_expert[pos] = id;
                sorted_entry[pos] = (int)i;
                entry_pos[i] = (int)pos;
            }
            __syncwarp();
            if (id >= 0 && rank == 0) running[id] += __popc(peers);
        }
        __syncthreads();
    }
}

// ---------------------------------------------------------------------------------------
// Grouped GEMM: out[p, n] = alpha_e * sum_k deq(A)[p, k] * deq_nog(W_e)[n, k] for sorted rows p
// of expert e. A: NVFP4 [N, K/2] + E4M3 [N, K/16] (linear). W: [E][Nout][K/2] + scales
// [E][Nout][K/wblock] (E4M3 for wblock 16, UE8M0 for 32).

#define BM 64
#define BN 64
#define BK 64
#define GEMM_THREADS 128
#define SROW (BK + 8)  // bf16 per smem row: +16 bytes against bank conflicts

__device__ __forceinline__ u32 pack_bf16x2_exact(float lo, float hi) {
    // lo/hi are e2m1 * scale: exactly representable in BF16, so truncation is exact
    return (__float_as_uint(lo) >> 16) | (__float_as_uint(hi) & 0xFFFF0000u);
}

// Dequantize one 16-group (8 packed bytes, scale value s) to 16 BF16 in smem (32 bytes).
__device__ __forceinline__ void deq16_to_smem(uint2 q, float s, u16* dst) {
    u32 w[8];
    u32 b[2] = {q.x, q.y};
#pragma unroll
    for (int h = 0; h < 2; h++) {
#pragma unroll
        for (int j = 0; j < 4; j++) {
            u32 byte = (b[h] >> (8 * j)) & 0xFFu;
            float lo = __fmul_rn(e2m1_decode(byte & 0xFu), s);
            float hi = __fmul_rn(e2m1_decode(byte >> 4), s);
            w[h * 4 + j] = pack_bf16x2_exact(lo, hi);
        }
    }
    uint4* d = reinterpret_cast<uint4*>(dst);
    d[0] = make_uint4(w[0], w[1], w[2], w[3]);
    d[1] = make_uint4(w[4], w[5], w[6], w[7]);
}

__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], const u16* p) {
    u32 a = (u32)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

__device__ __forceinline__ void mma_bf16(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Load a BM x BK activation tile (rows [r0, r1) of the sorted A) into smem as BF16.
__device__ __forceinline__ void load_a_tile(const u8* __restrict__ aq, const u8* __restrict__ as,
                                            u32 K, u32 r0, u32 r1, u32 k0, u16* sA) {
    u32 kb = K / 16;
    for (u32 idx = threadIdx.x; idx < BM * (BK / 16); idx += GEMM_THREADS) {
        u32 r = idx / (BK / 16), g = idx % (BK / 16);
        u32 row = r0 + r, kg = k0 / 16 + g;
        u16* dst = sA + r * SROW + g * 16;
        if (row < r1 && kg < kb) {
            uint2 q = *reinterpret_cast<const uint2*>(aq + (size_t)row * (K / 2) + kg * 8);
            deq16_to_smem(q, e4m3_decode(as[(size_t)row * kb + kg]), dst);
        } else {
            uint4* d = reinterpret_cast<uint4*>(dst);
            d[0] = make_uint4(0, 0, 0, 0);
            d[1] = make_uint4(0, 0, 0, 0);
        }
    }
}

// Load a BN x BK weight tile (rows [n0, n0 + BN) of W_e, limited to nout) into smem as BF16.
__device__ __forceinline__ void load_w_tile(const u8* __restrict__ wq, const u8* __restrict__ ws,
                                            u32 K, u32 nout, u32 wblock, u32 n0, u32 k0, u16* sB) {
    u32 kg_n = K / 16, kb = K / wblock;
    for (u32 idx = threadIdx.x; idx < BN * (BK / 16); idx += GEMM_THREADS) {
        u32 r = idx / (BK / 16), g = idx % (BK / 16);
        u32 n = n0 + r, kg = k0 / 16 + g;
        u16* dst = sB + r * SROW + g * 16;
        if (n < nout && kg < kg_n) {
            uint2 q = *reinterpret_cast<const uint2*>(wq + (size_t)n * (K / 2) + kg * 8);
            u32 sc = ws[(size_t)n * kb + kg * 16 / wblock];
            float s = wblock == 16 ? e4m3_decode(sc) : ue8m0_decode(sc);
            deq16_to_smem(q, s, dst);
        } else {
            uint4* d = reinterpret_cast<uint4*>(dst);
            d[0] = make_uint4(0, 0, 0, 0);
            d[1] = make_uint4(0, 0, 0, 0);
        }
    }
}

// Which expert and rows a block works on; false when the block has no tile.
__device__ __forceinline__ bool find_tile(const u32* __restrict__ tile_offsets,
                                          const u32* __restrict__ expert_offsets, u32 E, u32& e,
                                          u32& r0, u32& r1) {
    u32 bx = blockIdx.x;
    if (bx >= tile_offsets[E]) return false;
    u32 lo = 0, hi = E;  // largest e with tile_offsets[e] <= bx
    while (hi - lo > 1) {
        u32 mid = (lo + hi) / 2;
        if (tile_offsets[mid] <= bx) lo = mid; else hi = mid;
    }
    e = lo;
    r0 = expert_offsets[e] + (bx - tile_offsets[e]) * BM;
    u32 end = expert_offsets[e + 1];
    r1 = r0 + BM < end ? r0 + BM : end;
    return true;
}

// The K loop for one (or two, fused gate/up) weight matrices. Warp (wm, wn) of a 2x2 grid
// owns rows wm*32 + [0,32) and cols wn*32 + [0,32): 2 m16 tiles x 4 n8 tiles.
template <int NB>
__device__ __forceinline__ void gemm_mainloop(const u8* aq, const u8* as, u32 K, u32 r0, u32 r1,
                                              const u8* const (&wq)[2], const u8* const (&ws)[2],
                                              u32 nout, u32 wblock, u32 n0, u16* sA, u16* sB,
                                              float (&acc)[NB][2][4][4]) {
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int wm = warp / 2, wn = warp % 2;
#pragma unroll
    for (int b = 0; b < NB; b++)
#pragma unroll
        for (int i = 0; i < 2; i++)
#pragma unroll
            for (int j = 0; j < 4; j++)
#pragma unroll
                for (int q = 0; q < 4; q++) acc[b][i][j][q] = 0.0f;
    for (u32 k0 = 0; k0 < K; k0 += BK) {
        load_a_tile(aq, as, K, r0, r1, k0, sA);
#pragma unroll
        for (int b = 0; b < NB; b++) load_w_tile(wq[b], ws[b], K, nout, wblock, n0, k0, sB + b * BN * SROW);
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
            u32 af[2][4];
#pragma unroll
            for (int i = 0; i < 2; i++)
                ldmatrix_x4(af[i], sA + (wm * 32 + i * 16 + (lane % 16)) * SROW + kk + (lane / 16) * 8);
#pragma unroll
            for (int b = 0; b < NB; b++) {
#pragma unroll
                for (int jj = 0; jj < 2; jj++) {
                    // two n8 tiles per ldmatrix.x4: regs {b0,b1} of tile 2jj, then of 2jj+1
                    u32 bf[4];
                    const u16* p = sB + b * BN * SROW +
                                   (wn * 32 + jj * 16 + (lane % 8) + (lane / 16) * 8) * SROW + kk +
                                   ((lane / 8) % 2) * 8;
                    ldmatrix_x4(bf, p);
#pragma unroll
                    for (int i = 0; i < 2; i++) {
                        mma_bf16(acc[b][i][2 * jj], af[i], bf[0], bf[1]);
                        mma_bf16(acc[b][i][2 * jj + 1], af[i], bf[2], bf[3]);
                    }
                }
            }
        }
        __syncthreads();
    }
}

// Visit each accumulator element with its (row, col) inside the block tile.
#define FOR_EACH_ACC(...)                                                         \
    {                                                                             \
        int warp_ = threadIdx.x / 32, lane_ = threadIdx.x % 32;                   \
        int wm_ = warp_ / 2, wn_ = warp_ % 2;                                     \
        _Pragma("unroll") for (int i = 0; i < 2; i++)                             \
        _Pragma("unroll") for (int j = 0; j < 4; j++)                             \
        _Pragma("unroll") for (int q = 0; q < 4; q++) {                           \
            int lr = wm_ * 32 + i * 16 + lane_ / 4 + (q / 2) * 8;                 \
            int lc = wn_ * 32 + j * 8 + (lane_ % 4) * 2 + (q % 2);                \
            __VA_ARGS__                                                           \
        }                                                                         \
    }

#define GEMM_SMEM_BYTES (3 * BN * SROW * 2)

// Down projection (and any plain grouped GEMM): out[p, n] = f32(acc) * alpha_e,
// alpha_e = rcp(gs[e]) * ws2[e].
extern "C" __global__ void __launch_bounds__(GEMM_THREADS)
moe_gemm_nvfp4(const u8* __restrict__ aq, const u8* __restrict__ as, u32 K,
               const u8* __restrict__ wq, const u8* __restrict__ ws, u32 nout, u32 wblock,
               const float* __restrict__ gs, const float* __restrict__ ws2,
               const u32* __restrict__ tile_offsets, const u32* __restrict__ expert_offsets, u32 E,
               float* __restrict__ out) {
    __shared__ __align__(16) u16 smem[GEMM_SMEM_BYTES / 2];
    u32 e, r0, r1;
    if (!find_tile(tile_offsets, expert_offsets, E, e, r0, r1)) return;
    u32 n0 = blockIdx.y * BN;
    size_t wstride = (size_t)nout * (K / 2), sstride = (size_t)nout * (K / wblock);
    const u8* const wqs[2] = {wq + e * wstride, nullptr};
    const u8* const wss[2] = {ws + e * sstride, nullptr};
    float acc[1][2][4][4];
    gemm_mainloop<1>(aq, as, K, r0, r1, wqs, wss, nout, wblock, n0, smem, smem + BM * SROW, acc);
    float alpha = __fmul_rn(rcp_ref(gs[e]), ws2[e]);
    FOR_EACH_ACC({
        u32 row = r0 + lr, col = n0 + lc;
        if (row < r1 && col < nout) out[(size_t)row * nout + col] = __fmul_rn(acc[0][i][j][q], alpha);
    })
}

// Gate/up projection with SwiGLU fused: g = acc_g * alpha_g, u = acc_u * alpha_u (alpha =
// rcp(gs1[e]) * ws2), a = swiglu(g, u). Then either (fixed gs2) quantize `a` to NVFP4 with
// gs2[e] right here, or (dynamic) write `a` in f32 and fold |a| into amax_bits[e].
extern "C" __global__ void __launch_bounds__(GEMM_THREADS)
moe_gemm_gate_up_nvfp4(const u8* __restrict__ aq, const u8* __restrict__ as, u32 K,
                       const u8* __restrict__ w1q, const u8* __restrict__ w1s,
                       const u8* __restrict__ w3q, const u8* __restrict__ w3s, u32 nout, u32 wblock,
                       const float* __restrict__ gs1, const float* __restrict__ ws2_1,
                       const float* __restrict__ ws2_3, float limit, u32 has_limit,
                       const u32* __restrict__ tile_offsets, const u32* __restrict__ expert_offsets,
                       u32 E, const float* __restrict__ gs2, u32 flavor, u8* __restrict__ outq,
                       u8* __restrict__ outs, u64* __restrict__ stats, float* __restrict__ out_f32,
                       u32* __restrict__ amax_bits) {
    __shared__ __align__(16) u16 smem[GEMM_SMEM_BYTES / 2];
    u32 e, r0, r1;
    if (!find_tile(tile_offsets, expert_offsets, E, e, r0, r1)) return;
    u32 n0 = blockIdx.y * BN;
    size_t wstride = (size_t)nout * (K / 2), sstride = (size_t)nout * (K / wblock);
    const u8* const wqs[2] = {w1q + e * wstride, w3q + e * wstride};
    const u8* const wss[2] = {w1s + e * sstride, w3s + e * sstride};
    float acc[2][2][4][4];
    gemm_mainloop<2>(aq, as, K, r0, r1, wqs, wss, nout, wblock, n0, smem, smem + BM * SROW, acc);
    float g_in = rcp_ref(gs1[e]);
    float alpha_g = __fmul_rn(g_in, ws2_1[e]), alpha_u = __fmul_rn(g_in, ws2_3[e]);
    // the tile of `a` in smem (f32, padded rows), reusing the operand buffers
    float* sa = reinterpret_cast<float*>(smem);
    const int SA = BN + 4;
    FOR_EACH_ACC({
        float g = __fmul_rn(acc[0][i][j][q], alpha_g);
        float u = __fmul_rn(acc[1][i][j][q], alpha_u);
        sa[lr * SA + lc] = swiglu(g, u, limit, has_limit);
    })
    __syncthreads();
    if (gs2 != nullptr) {
        // fixed gs2: quantize each (row, 16-column group) of the tile
        float gsv = gs2[e];
        u32 kb = nout / 16;
        u32 counts[4] = {0, 0, 0, 0};
        for (u32 idx = threadIdx.x; idx < BM * (BN / 16); idx += GEMM_THREADS) {
            u32 r = idx / (BN / 16), g = idx % (BN / 16);
            u32 row = r0 + r, col = n0 + g * 16;
            if (row < r1 && col < nout) {
                float v[16];
#pragma unroll
                for (int x = 0; x < 16; x++) v[x] = sa[r * SA + g * 16 + x];
                u32 p[2];
                u32 s = quant_block_nvfp4(v, gsv, flavor, p);
                *reinterpret_cast<uint2*>(outq + (size_t)row * (nout / 2) + col / 2) = make_uint2(p[0], p[1]);
                outs[(size_t)row * kb + col / 16] = (u8)s;
                float vmax = 0.0f;
#pragma unroll
                for (int x = 0; x < 16; x++) vmax = amax_step(vmax, v[x]);
                u32 c = classify_nvfp4(s, vmax > 0.0f);
                counts[0] += 1;
                counts[1] += c & 1u;
                counts[2] += (c >> 1) & 1u;
                counts[3] += (c >> 2) & 1u;
            }
        }
        add_stats4(stats, counts);
    } else {
        // dynamic gs2: write a, fold |a| into the expert's amax
        u32 m = 0;
        for (u32 idx = threadIdx.x; idx < BM * BN; idx += GEMM_THREADS) {
            u32 r = idx / BN, c = idx % BN;
            u32 row = r0 + r, col = n0 + c;
            if (row < r1 && col < nout) {
                float v = sa[r * SA + c];
                out_f32[(size_t)row * nout + col] = v;
                float a = fabsf(v);
                u32 bits = a != a ? 0x7FC00000u : __float_as_uint(a);
                m = bits > m ? bits : m;
            }
        }
        m = __reduce_max_sync(0xFFFFFFFFu, m);
        if ((threadIdx.x & 31) == 0 && m) atomicMax(&amax_bits[e], m);
    }
}

// gs = 2688 / amax (amax 0 -> 2688; NaN stays NaN), from amax bit patterns, for n entries.
extern "C" __global__ void dynamic_gs_from_amax(const u32* __restrict__ amax_bits, u32 n,
                                                float* __restrict__ gs) {
    u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float a = __uint_as_float(amax_bits[i]);
    gs[i] = a == 0.0f ? 2688.0f : __fdiv_rn(2688.0f, a);
}

// Broadcast one device value into n entries (the dynamic gs1 of every expert).
extern "C" __global__ void broadcast_f32(const float* __restrict__ src, u32 n, float* __restrict__ dst) {
    u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = src[0];
}

// out[t, h] = sum over slots in order of w[t, slot] * y[pos(t, slot), h], then + shared[t, h]
// (f32, the CPU's order). per_slot (nullable) gets the unweighted rows, row t*K + slot.
extern "C" __global__ void moe_combine(const float* __restrict__ y, const int* __restrict__ entry_pos,
                                       const float* __restrict__ topk_weights, u32 T, u32 K, u32 H,
                                       const float* __restrict__ shared, float* __restrict__ out,
                                       float* __restrict__ per_slot) {
    u32 t = blockIdx.x;
    u32 h = blockIdx.y * blockDim.x + threadIdx.x;
    if (t >= T || h >= H) return;
    float acc = 0.0f;
    for (u32 s = 0; s < K; s++) {
        u32 entry = t * K + s;
        float v = y[(size_t)entry_pos[entry] * H + h];
        acc = __fadd_rn(acc, __fmul_rn(topk_weights[entry], v));
        if (per_slot) per_slot[(size_t)entry * H + h] = v;
    }
    if (shared) acc = __fadd_rn(acc, shared[(size_t)t * H + h]);
    out[(size_t)t * H + h] = acc;
}

// ---------------------------------------------------------------------------------------
// Reference-path helpers (the GEMMs themselves are cuBLAS).

// dst[p, :] = bf16(src[rows[p], :]) (rows nullable: identity).
extern "C" __global__ void gather_rows_bf16(const float* __restrict__ src, const int* __restrict__ rows,
                                            u32 n_rows, u32 cols, u16* __restrict__ dst) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)n_rows * cols) return;
    size_t p = i / cols, c = i % cols;
    size_t r = rows ? (size_t)rows[p] : p;
    dst[i] = f32_to_bf16_rn(src[r * cols + c]);
}

// a = bf16(swiglu(g, u)) elementwise (the reference and shared-expert intermediate).
extern "C" __global__ void swiglu_bf16(const float* __restrict__ g, const float* __restrict__ u,
                                       u64 n, float limit, u32 has_limit, u16* __restrict__ a) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) a[i] = f32_to_bf16_rn(swiglu(g[i], u[i], limit, has_limit));
}
