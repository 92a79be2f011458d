// The routed experts on the GPU: a deterministic counting sort of (token, slot) entries by
// expert, the grouped NVFP4 GEMM (FP4 x E4M3 dequantized exactly to BF16 in shared memory,
// BF16 mma.sync m16n8k16 with FP32 accumulation, alpha in the FP32 epilogue), SwiGLU fused
// with the re-quantization of the intermediate, and the weighted combine in slot order.
// No order-dependent float atomics: the only atomics are integer counts and max-of-bits.
#include "nvfp4dbg_common.cuh"

// ---------------------------------------------------------------------------------------
// Counting sort. Entries i = t*K + slot in [0, N); chunk c = entries [c*256, c*256 + 256).

#define SORT_CHUNK 256

// chunk_counts[c * E + e] = entries of chunk c routed to e. Block 0 also zeroes the forward's
// counters before anything after the sort adds to them: the 4 block statistics and n_amax
// max-of-bits words (their memsets until session 34).
extern "C" __global__ void __launch_bounds__(SORT_CHUNK)
moe_chunk_counts(const int* __restrict__ ids, u32 N, u32 E, u32* __restrict__ chunk_counts,
                 u64* __restrict__ stats, u32* __restrict__ amax_bits, u32 n_amax) {
    if (blockIdx.x == 0) {
        if (threadIdx.x < 4) stats[threadIdx.x] = 0;
        for (u32 j = threadIdx.x; j < n_amax; j += blockDim.x) amax_bits[j] = 0;
    }
    extern __shared__ u32 cnt[];
    for (u32 e = threadIdx.x; e < E; e += blockDim.x) cnt[e] = 0;
    __syncthreads();
    u32 i = blockIdx.x * SORT_CHUNK + threadIdx.x;
    if (i < N) atomicAdd(&cnt[ids[i]], 1u);
    __syncthreads();
    for (u32 e = threadIdx.x; e < E; e += blockDim.x) chunk_counts[(size_t)blockIdx.x * E + e] = cnt[e];
}

// Exclusive prefix sum of one value per thread over the block (blockDim.x a multiple of 32):
// returns carry + the sum of the values of the lower threads, and adds the block's total to
// carry (the same in every thread). `sums`: 32 words of shared memory, free on return.
__device__ __forceinline__ u32 block_scan_excl(u32 v, u32& carry, u32* sums) {
    u32 lane = threadIdx.x % 32, warp = threadIdx.x / 32, nw = blockDim.x / 32;
    u32 x = v;
#pragma unroll
    for (u32 d = 1; d < 32; d <<= 1) {
        u32 y = __shfl_up_sync(0xFFFFFFFFu, x, d);
        if (lane >= d) x += y;
    }
    if (lane == 31) sums[warp] = x;
    __syncthreads();
    if (warp == 0) {
        u32 w = lane < nw ? sums[lane] : 0u;
#pragma unroll
        for (u32 d = 1; d < 32; d <<= 1) {
            u32 y = __shfl_up_sync(0xFFFFFFFFu, w, d);
            if (lane >= d) w += y;
        }
        if (lane < nw) sums[lane] = w;
    }
    __syncthreads();
    u32 r = carry + (warp ? sums[warp - 1] : 0u) + x - v;
    carry += sums[nw - 1];
    __syncthreads();
    return r;
}

// An expert's row tiles when its last tile may hold up to bm + slack rows: every tile bm rows
// but the last, which takes the rest (slack 0: ceil(n / bm)).
__device__ __forceinline__ u32 row_tiles(u32 n, u32 bm, u32 slack) {
    return n == 0 ? 0u : n <= bm + slack ? 1u : (n - slack + bm - 1) / bm;
}

// One block. chunk_base[c*E + e] = first sorted position of chunk c's entries for expert e;
// expert_offsets[E+1]; tile_offsets[E+1] = prefix sum of ceil(count_e / bm); active[0] = the
// number of experts with rows, active[1..] = those experts in order (the decode GEMMs' grid);
// wide_tiles[bt] = (expert, first row, end row, 0) of tile bt when an expert's last tile takes
// up to bm + slack rows (the register-A prefill's), then (RS_NO_TILE, 0, 0, 0) up to
// tile_bound (their grid's bound): one load tells a CTA its tile, where find_row_tile's search
// over tile_offsets waits on four. The chunks of an expert are split into P = max(1,
// blockDim.x / E) runs summed by P threads at once (each thread's loads independent, coalesced
// across experts): one thread walking all 128 chunks of 4096 DeepSeek-V3 tokens twice took 18 us.
// Dynamic shared memory: (P + 1) * E words (moe.rs).
extern "C" __global__ void moe_offsets(const u32* __restrict__ chunk_counts, u32 nchunks, u32 E,
                                       u32 bm, u32 slack, u32* __restrict__ chunk_base,
                                       u32* __restrict__ expert_offsets,
                                       u32* __restrict__ tile_offsets, uint4* __restrict__ wide_tiles,
                                       u32 tile_bound,
                                       u32* __restrict__ active) {
    extern __shared__ u32 total[];  // [E] totals, then offsets; [P][E] the runs' sums, then bases
    const u32 P = blockDim.x / E > 1 ? blockDim.x / E : 1u, span = (nchunks + P - 1) / P;
    u32* runs = total + E;
    for (u32 x = threadIdx.x; x < P * E; x += blockDim.x) {
        u32 e = x % E, c0 = x / E * span, c1 = min(c0 + span, nchunks), sum = 0;
#pragma unroll 8
        for (u32 c = c0; c < c1; c++) sum += chunk_counts[(size_t)c * E + e];
        runs[x] = sum;
    }
    __syncthreads();
    for (u32 e = threadIdx.x; e < E; e += blockDim.x) {
        u32 run = 0;
        for (u32 p = 0; p < P; p++) {
            u32 v = runs[p * E + e];
            runs[p * E + e] = run;
            run += v;
        }
        total[e] = run;
    }
    __syncthreads();
    // the prefix sums over the experts, blockDim.x experts at a time
    __shared__ u32 sums[32];
    u32 off = 0, tiles = 0, wide = 0, live = 0;
    for (u32 e0 = 0; e0 < E; e0 += blockDim.x) {
        u32 e = e0 + threadIdx.x;
        u32 n = e < E ? total[e] : 0u;
        u32 o = block_scan_excl(n, off, sums);
        u32 t = block_scan_excl(row_tiles(n, bm, 0), tiles, sums);
        u32 w = block_scan_excl(row_tiles(n, bm, slack), wide, sums);
        u32 l = block_scan_excl(n ? 1u : 0u, live, sums);
        if (e < E) {
            expert_offsets[e] = o;
            tile_offsets[e] = t;
            if (n) active[1 + l] = e;
            total[e] = o;
            // every tile bm rows but the last, which takes the rest (find_row_tile's r1)
            const u32 nt = row_tiles(n, bm, slack);
            for (u32 j = 0; j < nt; j++)
                wide_tiles[w + j] = make_uint4(e, o + j * bm, j + 1 == nt ? o + n : o + (j + 1) * bm, 0u);
        }
    }
    if (threadIdx.x == 0) {
        expert_offsets[E] = off;
        tile_offsets[E] = tiles;
        active[0] = live;
    }
    for (u32 bt = wide + threadIdx.x; bt < tile_bound; bt += blockDim.x)
        wide_tiles[bt] = make_uint4(RS_NO_TILE, 0u, 0u, 0u);
    __syncthreads();
    for (u32 x = threadIdx.x; x < P * E; x += blockDim.x) {
        u32 e = x % E, c0 = x / E * span, c1 = min(c0 + span, nchunks), base = total[e] + runs[x];
#pragma unroll 8
        for (u32 c = c0; c < c1; c++) {
            chunk_base[(size_t)c * E + e] = base;
            base += chunk_counts[(size_t)c * E + e];
        }
    }
}

// Expert e's tensor maps for the register-A kernels (map_stride 256): maps[(g E + e) 2 + b] is
// template g b (g: the gate/up's token matrix, then the down's; b: boxes of 128 rows, then of
// 32) with its row count set to the expert's end row, expert_offsets[e + 1]. A tile's last
// boxes then read the rows past its expert as zeros (TMA's out-of-bounds fill) instead of the
// next expert's rows: the MMAs' columns past a tile's tokens are never stored either way, but
// on zeros the tensor cores draw less power, and the GPU runs the GEMMs under its power cap
// (s31b). One thread a map, over moe_scatter's grid (a kernel of its own until session 34).
__device__ __forceinline__ void rs_expert_maps(const u64* __restrict__ templates,
                                               const u32* __restrict__ expert_offsets, u32 E,
                                               u64* __restrict__ maps) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < 4 * E; i += gridDim.x * blockDim.x) {
        const u32 b = i % 2, e = (i / 2) % E, g = i / (2 * E);
        const u64* src = templates + (g * 2 + b) * 16;
        u64* dst = maps + (size_t)i * 16;
#pragma unroll
        for (int w = 0; w < 16; w++) dst[w] = src[w];
        const u32 rows = max(expert_offsets[e + 1], 1u);  // a tensor map's dimensions are not 0
        asm volatile("tensormap.replace.tile.global_dim.global.b1024.b32 [%0], 1, %1;" ::"l"(dst), "r"(rows)
                     : "memory");
        asm volatile("fence.proxy.tensormap::generic.release.gpu;" ::: "memory");
    }
#else
    __trap();  // the register-A kernels are sm_90a's (moe.rs passes no maps elsewhere)
#endif
}

// Stable scatter: within an expert, entries keep their index order. Warps of a chunk take
// turns, ranks inside a warp come from __match_any_sync. With `maps` (else null), also the
// register-A kernels' per-expert tensor maps (rs_expert_maps) from `map_templates`.
extern "C" __global__ void __launch_bounds__(SORT_CHUNK)
moe_scatter(const int* __restrict__ ids, u32 N, u32 E, u32 K, const u32* __restrict__ chunk_base,
            int* __restrict__ sorted_token, int* __restrict__ sorted_expert,
            int* __restrict__ sorted_entry, int* __restrict__ entry_pos,
            const u64* __restrict__ map_templates, const u32* __restrict__ expert_offsets,
            u64* __restrict__ maps) {
    if (maps != nullptr) rs_expert_maps(map_templates, expert_offsets, E, maps);
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
//
// A block computes a BM x (NB * BNB) tile: BM sorted rows of one expert against BNB output
// columns of NB weight matrices (NB = 2: gate and up together, for the fused SwiGLU). 8 warps
// in a 4 (rows) x 2 (columns) grid, each 32 rows x BNB/2 columns per matrix. Per BK slice the
// FP4 codes are dequantized into shared memory as BF16 (code -> BF16 pair from a 256-entry
// table, times the block scale with one exact bf16x2 FMA), then BF16 mma.sync m16n8k16 with
// FP32 accumulators. The next slice's codes are loaded into registers while the tensor cores
// work on the current one.

#define BM 128
#define BK 64
#define GEMM_THREADS 256
#define SROW (BK + 8)  // bf16 per smem row: +16 bytes against bank conflicts

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

// a * b exactly (the product e2m1 * scale is representable in BF16); -0 as addend keeps the
// sign of a zero product.
__device__ __forceinline__ u32 bf16x2_mul_exact(u32 a, u32 b) {
    u32 d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
    return d;
}

// BF16 bits of the 16 E2M1 codes.
__device__ __forceinline__ u32 e2m1_bf16_bits(u32 code) {
    const u32 mag[8] = {0x0000u, 0x3F00u, 0x3F80u, 0x3FC0u, 0x4000u, 0x4040u, 0x4080u, 0x40C0u};
    u32 v = 0;
#pragma unroll
    for (int m = 0; m < 8; m++) v = (code & 7u) == (u32)m ? mag[m] : v;
    return v | ((code & 8u) << 12);
}

// lut[byte] = the two codes of a packed byte as a BF16 pair (low nibble in the low half).
__device__ __forceinline__ void build_lut(u32* lut) {
    for (u32 b = threadIdx.x; b < 256; b += blockDim.x)
        lut[b] = e2m1_bf16_bits(b & 0xFu) | (e2m1_bf16_bits(b >> 4) << 16);
}

// One 16-group in flight: its 8 code bytes and its scale as a BF16 pair.
struct Group {
    uint2 q;
    u32 s2;
};

__device__ __forceinline__ u32 scale_bf16x2(float s) {
    u32 h = __float_as_uint(s) >> 16;  // exact: E4M3 and UE8M0 values are BF16 values
    return h | (h << 16);
}

__device__ __forceinline__ void store_group(const Group& g, const u32* lut, u16* dst) {
    u32 w[8];
    u32 b[2] = {g.q.x, g.q.y};
#pragma unroll
    for (int h = 0; h < 2; h++)
#pragma unroll
        for (int j = 0; j < 4; j++) w[h * 4 + j] = bf16x2_mul_exact(lut[(b[h] >> (8 * j)) & 0xFFu], g.s2);
    uint4* d = reinterpret_cast<uint4*>(dst);
    d[0] = make_uint4(w[0], w[1], w[2], w[3]);
    d[1] = make_uint4(w[4], w[5], w[6], w[7]);
}

// The operands of one grouped GEMM block.
template <int NB>
struct Operands {
    const u8* aq;
    const u8* as;
    u32 K;
    u32 r0, r1;
    const u8* wq[2];
    const u8* ws[2];
    u32 nout, wblock, n0;
};

// Groups per thread per BK slice: A has BM rows x BK/16 groups, W has NB*BNB rows x BK/16.
template <int NB, int BNB>
struct Slice {
    static constexpr int A_ITEMS = BM * (BK / 16) / GEMM_THREADS;
    static constexpr int W_ITEMS = NB * BNB * (BK / 16) / GEMM_THREADS;
    Group a[A_ITEMS];
    Group w[W_ITEMS];
};

template <int NB, int BNB>
__device__ __forceinline__ void load_slice(const Operands<NB>& o, u32 k0, Slice<NB, BNB>& sl) {
    u32 kgs = o.K / 16;
#pragma unroll
    for (int t = 0; t < Slice<NB, BNB>::A_ITEMS; t++) {
        u32 idx = threadIdx.x + t * GEMM_THREADS;
        u32 r = idx / (BK / 16), g = idx % (BK / 16);
        u32 row = o.r0 + r, kg = k0 / 16 + g;
        Group x = {make_uint2(0, 0), 0};
        if (row < o.r1 && kg < kgs) {
            x.q = *reinterpret_cast<const uint2*>(o.aq + (size_t)row * (o.K / 2) + kg * 8);
            x.s2 = scale_bf16x2(e4m3_decode(o.as[(size_t)row * kgs + kg]));
        }
        sl.a[t] = x;
    }
    u32 kb = o.K / o.wblock;
#pragma unroll
    for (int t = 0; t < Slice<NB, BNB>::W_ITEMS; t++) {
        u32 idx = threadIdx.x + t * GEMM_THREADS;
        u32 r = idx / (BK / 16), g = idx % (BK / 16);
        u32 b = r / BNB, n = o.n0 + r % BNB, kg = k0 / 16 + g;
        Group x = {make_uint2(0, 0), 0};
        // a select, not o.wq[b]: a run-time index would put the operands in local memory
        const u8* wq = (NB > 1 && b != 0) ? o.wq[1] : o.wq[0];
        const u8* ws = (NB > 1 && b != 0) ? o.ws[1] : o.ws[0];
        if (n < o.nout && kg < kgs) {
            x.q = *reinterpret_cast<const uint2*>(wq + (size_t)n * (o.K / 2) + kg * 8);
            u32 sc = ws[(size_t)n * kb + kg * 16 / o.wblock];
            x.s2 = scale_bf16x2(o.wblock == 16 ? e4m3_decode(sc) : ue8m0_decode(sc));
        }
        sl.w[t] = x;
    }
}

template <int NB, int BNB>
__device__ __forceinline__ void store_slice(const Slice<NB, BNB>& sl, const u32* lut, u16* sA, u16* sB) {
#pragma unroll
    for (int t = 0; t < Slice<NB, BNB>::A_ITEMS; t++) {
        u32 idx = threadIdx.x + t * GEMM_THREADS;
        store_group(sl.a[t], lut, sA + (idx / (BK / 16)) * SROW + (idx % (BK / 16)) * 16);
    }
#pragma unroll
    for (int t = 0; t < Slice<NB, BNB>::W_ITEMS; t++) {
        u32 idx = threadIdx.x + t * GEMM_THREADS;
        store_group(sl.w[t], lut, sB + (idx / (BK / 16)) * SROW + (idx % (BK / 16)) * 16);
    }
}

// Accumulators: [matrix][m16 tile][n8 tile][4]; a warp owns 32 rows x BNB/2 columns.
template <int NB, int BNB>
__device__ __forceinline__ void gemm_mainloop(const Operands<NB>& o, u16* sA, u16* sB, const u32* lut,
                                              float (&acc)[NB][2][BNB / 16][4]) {
    constexpr int NT = BNB / 16;  // n8 tiles per warp per matrix
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int wm = warp % 4, wn = warp / 4;
#pragma unroll
    for (int b = 0; b < NB; b++)
#pragma unroll
        for (int i = 0; i < 2; i++)
#pragma unroll
            for (int j = 0; j < NT; j++)
#pragma unroll
                for (int q = 0; q < 4; q++) acc[b][i][j][q] = 0.0f;
    Slice<NB, BNB> sl;
    load_slice<NB, BNB>(o, 0, sl);
    store_slice<NB, BNB>(sl, lut, sA, sB);
    __syncthreads();
    for (u32 k0 = 0; k0 < o.K; k0 += BK) {
        bool more = k0 + BK < o.K;
        if (more) load_slice<NB, BNB>(o, k0 + BK, sl);  // in flight during the MMAs
#pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
            u32 af[2][4];
#pragma unroll
            for (int i = 0; i < 2; i++)
                ldmatrix_x4(af[i], sA + (wm * 32 + i * 16 + (lane % 16)) * SROW + kk + (lane / 16) * 8);
#pragma unroll
            for (int b = 0; b < NB; b++) {
#pragma unroll
                for (int jj = 0; jj < NT / 2; jj++) {
                    // two n8 tiles per ldmatrix.x4: regs {b0,b1} of tile 2jj, then of 2jj+1
                    u32 bf[4];
                    const u16* p = sB + (b * BNB + wn * (BNB / 2) + jj * 16 + (lane % 8) + (lane / 16) * 8) * SROW +
                                   kk + ((lane / 8) % 2) * 8;
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
        if (more) {
            store_slice<NB, BNB>(sl, lut, sA, sB);
            __syncthreads();
        }
    }
}

// Visit each accumulator element with its (row, col) inside the block tile (per matrix).
#define FOR_EACH_ACC(NT_, WCOLS_, ...)                                             \
    {                                                                             \
        int warp_ = threadIdx.x / 32, lane_ = threadIdx.x % 32;                   \
        int wm_ = warp_ % 4, wn_ = warp_ / 4;                                     \
        _Pragma("unroll") for (int i = 0; i < 2; i++)                             \
        _Pragma("unroll") for (int j = 0; j < (NT_); j++)                         \
        _Pragma("unroll") for (int q = 0; q < 4; q++) {                           \
            int lr = wm_ * 32 + i * 16 + lane_ / 4 + (q / 2) * 8;                 \
            int lc = wn_ * (WCOLS_) + j * 8 + (lane_ % 4) * 2 + (q % 2);          \
            __VA_ARGS__                                                           \
        }                                                                         \
    }

#define PLAIN_BN 128
#define FUSED_BN 64
// operand tiles (A + NB*BNB rows of SROW bf16) + the code table
#define GEMM_SMEM_U16 ((BM + 128) * SROW)

// Down projection: out[p, n] = bf16(f32(acc) * alpha_e), alpha_e = rcp(gs[e]) * ws2[e] (each
// (token, slot) row in BF16, as the engines' down GEMMs write it; moe_combine sums them).
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 2)
moe_gemm_nvfp4(const u8* __restrict__ aq, const u8* __restrict__ as, u32 K,
               const u8* __restrict__ wq, const u8* __restrict__ ws, u32 nout, u32 wblock,
               const float* __restrict__ gs, const float* __restrict__ ws2,
               const u32* __restrict__ tile_offsets, const u32* __restrict__ expert_offsets, u32 E,
               u16* __restrict__ out) {
    __shared__ __align__(16) u16 smem[GEMM_SMEM_U16];
    __shared__ u32 lut[256];
    u32 e, r0, r1;
    if (!find_row_tile(tile_offsets, expert_offsets, E, blockIdx.x, BM, e, r0, r1)) return;
    build_lut(lut);
    Operands<1> o;
    o.aq = aq; o.as = as; o.K = K; o.r0 = r0; o.r1 = r1;
    size_t wstride = (size_t)nout * (K / 2), sstride = (size_t)nout * (K / wblock);
    o.wq[0] = wq + e * wstride; o.ws[0] = ws + e * sstride;
    o.wq[1] = nullptr; o.ws[1] = nullptr;
    o.nout = nout; o.wblock = wblock; o.n0 = blockIdx.y * PLAIN_BN;
    __syncthreads();
    float acc[1][2][PLAIN_BN / 16][4];
    gemm_mainloop<1, PLAIN_BN>(o, smem, smem + BM * SROW, lut, acc);
    float alpha = __fmul_rn(rcp_ref(gs[e]), ws2[e]);
    FOR_EACH_ACC(PLAIN_BN / 16, PLAIN_BN / 2, {
        u32 row = r0 + lr, col = o.n0 + lc;
        if (row < r1 && col < nout) out[(size_t)row * nout + col] = bf16_rn(__fmul_rn(acc[0][i][j][q], alpha));
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
    __shared__ __align__(16) u16 smem[GEMM_SMEM_U16];
    __shared__ u32 lut[256];
    u32 e, r0, r1;
    if (!find_row_tile(tile_offsets, expert_offsets, E, blockIdx.x, BM, e, r0, r1)) return;
    build_lut(lut);
    Operands<2> o;
    o.aq = aq; o.as = as; o.K = K; o.r0 = r0; o.r1 = r1;
    size_t wstride = (size_t)nout * (K / 2), sstride = (size_t)nout * (K / wblock);
    o.wq[0] = w1q + e * wstride; o.ws[0] = w1s + e * sstride;
    o.wq[1] = w3q + e * wstride; o.ws[1] = w3s + e * sstride;
    o.nout = nout; o.wblock = wblock; o.n0 = blockIdx.y * FUSED_BN;
    u32 n0 = o.n0;
    __syncthreads();
    float acc[2][2][FUSED_BN / 16][4];
    gemm_mainloop<2, FUSED_BN>(o, smem, smem + BM * SROW, lut, acc);
    float g_in = rcp_ref(gs1[e]);
    float alpha_g = __fmul_rn(g_in, ws2_1[e]), alpha_u = __fmul_rn(g_in, ws2_3[e]);
    // the tile of `a` in smem (f32, padded rows), reusing the operand buffers
    float* sa = reinterpret_cast<float*>(smem);
    const int SA = FUSED_BN + 4;
    FOR_EACH_ACC(FUSED_BN / 16, FUSED_BN / 2, {
        float g = __fmul_rn(acc[0][i][j][q], alpha_g);
        float u = __fmul_rn(acc[1][i][j][q], alpha_u);
        sa[lr * SA + lc] = swiglu(g, u, limit, has_limit);
    })
    __syncthreads();
    gate_up_tile_epilogue<BM, FUSED_BN, GEMM_THREADS>(sa, SA, r0, r1, n0, nout, e, gs2, flavor, outq, outs, stats,
                                                      out_f32, amax_bits);
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
// (f32, the CPU's order). per_slot (nullable) gets the unweighted rows in f32, row t*K + slot.
// Columns a thread of the combines and gather_rows_bf16 takes: 4 (16-byte loads of f32 rows)
// where the row width allows, else 1 (moe.rs cols_per_thread, which sizes their grids, is the
// same rule).
__device__ __forceinline__ u32 cols_per_thread(u32 cols) { return cols % 4 == 0 ? 4u : 1u; }

// Four consecutive values of a row of y: f32 rows (the reference's cuBLAS GEMMs) or BF16 rows
// (the NVFP4 down GEMMs).
__device__ __forceinline__ float4 load4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ float4 load4(const u16* p) {
    uint2 b = *reinterpret_cast<const uint2*>(p);
    return make_float4(bf16_to_f32((u16)b.x), bf16_to_f32((u16)(b.x >> 16)), bf16_to_f32((u16)b.y),
                       bf16_to_f32((u16)(b.y >> 16)));
}
__device__ __forceinline__ float load1(const float* p) { return *p; }
__device__ __forceinline__ float load1(const u16* p) { return bf16_to_f32(*p); }

// One thread per cols_per_thread(H) consecutive columns h of token t; each column's sum is the
// same either way.
template <typename Row>
__device__ __forceinline__ void combine(const Row* __restrict__ y, const int* __restrict__ entry_pos,
                                        const float* __restrict__ topk_weights, u32 T, u32 K, u32 H,
                                        const float* __restrict__ shared, float* __restrict__ out,
                                        float* __restrict__ per_slot) {
    u32 t = blockIdx.x;
    u32 h = (blockIdx.y * blockDim.x + threadIdx.x) * cols_per_thread(H);
    if (t >= T || h >= H) return;
    if (cols_per_thread(H) == 4) {
        float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        for (u32 s = 0; s < K; s++) {
            u32 entry = t * K + s;
            float w = topk_weights[entry];
            float4 v = load4(y + (size_t)entry_pos[entry] * H + h);
            acc.x = __fadd_rn(acc.x, __fmul_rn(w, v.x));
            acc.y = __fadd_rn(acc.y, __fmul_rn(w, v.y));
            acc.z = __fadd_rn(acc.z, __fmul_rn(w, v.z));
            acc.w = __fadd_rn(acc.w, __fmul_rn(w, v.w));
            if (per_slot) *reinterpret_cast<float4*>(per_slot + (size_t)entry * H + h) = v;
        }
        if (shared) {
            float4 sv = *reinterpret_cast<const float4*>(shared + (size_t)t * H + h);
            acc.x = __fadd_rn(acc.x, sv.x);
            acc.y = __fadd_rn(acc.y, sv.y);
            acc.z = __fadd_rn(acc.z, sv.z);
            acc.w = __fadd_rn(acc.w, sv.w);
        }
        *reinterpret_cast<float4*>(out + (size_t)t * H + h) = acc;
        return;
    }
    float acc = 0.0f;
    for (u32 s = 0; s < K; s++) {
        u32 entry = t * K + s;
        float v = load1(y + (size_t)entry_pos[entry] * H + h);
        acc = __fadd_rn(acc, __fmul_rn(topk_weights[entry], v));
        if (per_slot) per_slot[(size_t)entry * H + h] = v;
    }
    if (shared) acc = __fadd_rn(acc, shared[(size_t)t * H + h]);
    out[(size_t)t * H + h] = acc;
}

#define COMBINE_PARAMS(Row)                                                                                  \
    const Row *__restrict__ y, const int *__restrict__ entry_pos, const float *__restrict__ topk_weights, \
        u32 T, u32 K, u32 H, const float *__restrict__ shared, float *__restrict__ out,                   \
        float *__restrict__ per_slot
#define COMBINE_ARGS y, entry_pos, topk_weights, T, K, H, shared, out, per_slot
// The NVFP4 path's BF16 rows.
extern "C" __global__ void moe_combine(COMBINE_PARAMS(u16)) { combine(COMBINE_ARGS); }
// The reference path's f32 rows.
extern "C" __global__ void moe_combine_f32(COMBINE_PARAMS(float)) { combine(COMBINE_ARGS); }

// ---------------------------------------------------------------------------------------
// Reference-path helpers (the GEMMs themselves are cuBLAS).

// dst[p, :] = bf16(src[rows[p], :]) (rows nullable: identity), cols_per_thread(cols) columns a
// thread.
extern "C" __global__ void gather_rows_bf16(const float* __restrict__ src, const int* __restrict__ rows,
                                            u32 n_rows, u32 cols, u16* __restrict__ dst) {
    const u32 w = cols_per_thread(cols);
    size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * w;
    if (i >= (size_t)n_rows * cols) return;
    size_t p = i / cols, c = i % cols;
    size_t r = rows ? (size_t)rows[p] : p;
    if (w == 4) {
        float4 v = *reinterpret_cast<const float4*>(src + r * cols + c);
        uint2 o = make_uint2(f32_to_bf16_rn(v.x) | (u32)f32_to_bf16_rn(v.y) << 16,
                             f32_to_bf16_rn(v.z) | (u32)f32_to_bf16_rn(v.w) << 16);
        *reinterpret_cast<uint2*>(dst + i) = o;
    } else {
        dst[i] = f32_to_bf16_rn(src[r * cols + c]);
    }
}

// a = bf16(swiglu(g, u)) elementwise (the reference and shared-expert intermediate).
// A thread per 4 elements (16-byte loads: g, u and a are allocations, so aligned), the last
// thread's past n skipped.
extern "C" __global__ void swiglu_bf16(const float* __restrict__ g, const float* __restrict__ u,
                                       u64 n, float limit, u32 has_limit, u16* __restrict__ a) {
    u64 i = ((u64)blockIdx.x * blockDim.x + threadIdx.x) * 4;
    if (i + 4 <= n) {
        float4 gv = *reinterpret_cast<const float4*>(g + i), uv = *reinterpret_cast<const float4*>(u + i);
        uint2 o = make_uint2(f32_to_bf16_rn(swiglu(gv.x, uv.x, limit, has_limit)) |
                                 (u32)f32_to_bf16_rn(swiglu(gv.y, uv.y, limit, has_limit)) << 16,
                             f32_to_bf16_rn(swiglu(gv.z, uv.z, limit, has_limit)) |
                                 (u32)f32_to_bf16_rn(swiglu(gv.w, uv.w, limit, has_limit)) << 16);
        *reinterpret_cast<uint2*>(a + i) = o;
    } else {
        for (; i < n; i++) a[i] = f32_to_bf16_rn(swiglu(g[i], u[i], limit, has_limit));
    }
}
