// Grouped NVFP4 GEMMs for decode (few rows per expert): weight-streaming kernels. The rows
// of an expert are few, so the weights are the bytes that matter: each warp streams a 16-row
// slice of an expert's FP4 codes with 16-byte loads, dequantizes them exactly in registers and
// feeds them as the A operand of FP16 mma.sync m16n8k16 (weights as M, up to 8 token rows as
// N), FP32 accumulation, alpha in the FP32 epilogue. The weights are read from decode tiles
// (decode_tiles: a copy made once at upload, in which each warp's 16 rows are one contiguous
// stream), or from the checkpoint's row-major layout (the `_rows` kernels).
//
// Numerics (docs/moe-forward.md): y = alpha * sum_k (e2m1(qa) * sa) * (e2m1(qw) * sw). Both
// factors are integers times 2^-10 below 2688, so both are exact in FP16 once scaled by 2^-14
// (an E2M1 nibble placed in the FP16 bits *is* its value times 2^-14, subnormal 0.5 included);
// their product is exact in FP32, and scaling every term by 2^-28 scales every FP32 partial sum
// exactly (all stay normal), so (acc * 2^28) * alpha is the FP32 sum of the exact products,
// up to summation order. The K dimension is split over the warps of a CTA and the partial
// sums are added in a fixed order: deterministic, no float atomics.
// SwiGLU's exp by CUDA's double exp here (nvfp4dbg_common.cuh EXPF_CR_FAST, the same results):
// the decode epilogue runs it a few times per thread, and the fast path's registers made the
// gate/up kernel spill.
#ifndef EXPF_CR_FAST
#define EXPF_CR_FAST 0
#endif
#include "nvfp4dbg_common.cuh"

#define DEC_WARPS 8
#define DEC_THREADS (DEC_WARPS * 32)
#define DEC_KSPLIT 2                       // warps per output tile, splitting K
#define DEC_TILES (DEC_WARPS / DEC_KSPLIT)  // 16-row output tiles per CTA
#define DEC_ROWS_PER_CTA (DEC_TILES * 16)
#define DEC_G 8                            // token rows per pass (the MMA's N)
#define DEC_CHUNK_K 128                    // K per warp step: 16 rows x 64 bytes
#define SCALE_2P28 268435456.0f            // 2^28: undoes the 2^-14 of both operands

__device__ __forceinline__ void mma_f16(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The activation rows of a pass live in shared memory as FP16 (value * 2^-14), K per row, in
// 16-byte units of 8 k; inside a unit the order is (0,4,1,5,2,6,3,7) so that u32 j holds the
// pair (j, j+4), matching nib_pair_f16. Units are XOR-swizzled so that the B-fragment loads of
// a warp (8 lanes per phase: 2 rows x 4 k-quarters) hit 8 distinct 16-byte bank groups.
__device__ __forceinline__ u32 act_unit(u32 c, u32 row) {
    return c ^ ((c >> 2) & 3u) ^ ((row & 1u) << 2);
}

// Fill rows [0, mg) of the activation buffer from sorted rows p0.. of an NVFP4 [N, K] tensor.
__device__ __forceinline__ void fill_acts(const u8* __restrict__ aq, const u8* __restrict__ as,
                                          u32 K, u32 p0, u32 mg, uint4* act) {
    u32 units = K / 8;
    for (u32 u = threadIdx.x; u < mg * units; u += DEC_THREADS) {
        u32 j = u / units, c = u % units;
        size_t row = (size_t)(p0 + j);
        u32 w = *reinterpret_cast<const u32*>(aq + row * (K / 2) + c * 4);
        u32 sb = as[row * (K / 16) + c / 2];
        u32 s2 = e4m3x2_to_f16x2(sb | (sb << 8));
        uint4 v;
        v.x = mul_f16x2(nib_pair_f16(w, 0), s2);
        v.y = mul_f16x2(nib_pair_f16(w, 1), s2);
        v.z = mul_f16x2(nib_pair_f16(w, 2), s2);
        v.w = mul_f16x2(nib_pair_f16(w, 3), s2);
        act[(size_t)j * units + act_unit(c, j)] = v;
    }
}

// One K-chunk of NB weight matrices for one lane: rows n0+g and n0+g+8, 16 bytes each, and
// the two E4M3 scales of each row's 32 codes.
template <int NB>
struct WChunk {
    uint4 w[NB][2];
    u32 s[NB][2];
};

// Programmatic dependent launch (sm_90 and newer). The down GEMM is launched so that its CTAs
// may start while the gate/up GEMM before it still runs (Gpu::launch_early): they read their
// expert, issue their first weight loads, then pdl_wait() until the gate/up
// GEMM has completed and its writes (the activations, gs2 in the dynamic mode) are visible.
// The weights, the routing offsets and the active-expert list were written before the gate/up
// GEMM started. For a plain launch pdl_wait() returns at once.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Let the kernel launched after this one start once every CTA of this grid has started (they
// then fill the SMs this grid's last CTAs leave idle).
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Where a warp's weights lie. Rows: the checkpoint's row-major [E * nout, K / 2] codes and
// [E * nout, K / 16] scales, so a warp's K-chunk is 64 bytes of each of its 16 rows, 3.5 KB
// apart at K = 7168. Tiles (decode_tiles below, built once when the weights are uploaded):
// each 16-row tile of a matrix holds its K-chunks one after the other, and a chunk holds the
// 16 rows' 64 code bytes (1 KB) or 8 scale bytes (128 B) row after row, so a warp streams one
// contiguous range and lane l's 16-byte piece of rows g / g + 8 is bytes 16 l / 512 + 16 l.
template <bool TILES>
struct WLayout {
    static constexpr u32 QSTEP = TILES ? 16 * (DEC_CHUNK_K / 2) : DEC_CHUNK_K / 2;    // codes, chunk to chunk
    static constexpr u32 SSTEP = TILES ? 16 * (DEC_CHUNK_K / 16) : DEC_CHUNK_K / 16;  // scales, chunk to chunk
};

// A lane's view of its warp's NB weight matrices at chunk 0: per-lane pointers computed once
// per kernel, so that a load in the loop is a register plus an immediate.
template <int NB>
struct WarpRows {
    const u8* q[NB];  // codes of row n0 + g, this lane's 16-byte piece
    const u8* s[NB];  // the two scales of that piece
    size_t q8, s8;    // from row n0 + g to row n0 + g + 8, codes / scales
};

// The rows n0 .. n0 + 15 of expert e in matrices wq / ws ([E * nout] rows of K) for lane
// (g, t). nout is a multiple of 16, so a 16-row tile never spans two experts.
template <int NB, bool TILES>
__device__ __forceinline__ WarpRows<NB> warp_rows(const u8* const (&wq)[NB], const u8* const (&ws)[NB], u32 e,
                                                  u32 nout, u32 n0, u32 K, u32 lane) {
    WarpRows<NB> r;
    u32 g = lane / 4, t = lane % 4;
    size_t row = (size_t)e * nout + n0;
#pragma unroll
    for (int b = 0; b < NB; b++) {
        if constexpr (TILES) {
            const u8* tq = wq[b] + row * (K / 2);  // a tile's codes start where its rows did
            r.q[b] = tq + 16 * lane;
            r.s[b] = ws[b] + row * (K / 16) + 2 * lane;
        } else {
            const u8* rq = wq[b] + (row + g) * (K / 2);
            r.q[b] = rq + 16 * t;
            r.s[b] = ws[b] + (row + g) * (K / 16) + 2 * t;
        }
    }
    r.q8 = TILES ? 8 * (DEC_CHUNK_K / 2) : (size_t)8 * (K / 2);
    r.s8 = TILES ? 8 * (DEC_CHUNK_K / 16) : (size_t)8 * (K / 16);
    return r;
}

// Loop-carried cursors at chunk c + 2 (the next load), row n0 + g; row n0 + g + 8 is
// WarpRows' q8 / s8 further on (a constant in tiles, so no cursor of its own).
template <int NB>
struct Cursor {
    const u8* qg[NB];  // codes
    const u8* sg[NB];  // scales
};

// Chunk `cursor + ahead` (ahead = 0 or 1).
template <int NB, bool TILES>
__device__ __forceinline__ void load_chunk(const WarpRows<NB>& r, const Cursor<NB>& cur, int ahead, WChunk<NB>& c) {
    using L = WLayout<TILES>;
#pragma unroll
    for (int b = 0; b < NB; b++) {
        c.w[b][0] = ldg_stream(cur.qg[b] + ahead * L::QSTEP);
        c.w[b][1] = ldg_stream(cur.qg[b] + r.q8 + ahead * L::QSTEP);
        c.s[b][0] = __ldg(reinterpret_cast<const u16*>(cur.sg[b] + ahead * L::SSTEP));
        c.s[b][1] = __ldg(reinterpret_cast<const u16*>(cur.sg[b] + r.s8 + ahead * L::SSTEP));
    }
}

template <int NB, bool TILES>
__device__ __forceinline__ void cursor_at(const WarpRows<NB>& r, u32 chunk, Cursor<NB>& cur) {
    using L = WLayout<TILES>;
#pragma unroll
    for (int b = 0; b < NB; b++) {
        cur.qg[b] = r.q[b] + (size_t)chunk * L::QSTEP;
        cur.sg[b] = r.s[b] + (size_t)chunk * L::SSTEP;
    }
}

// The dequantization through nib_bytes (3.75 instructions per FP16 pair) and the chunk's 8
// MMAs per matrix. act[q]: this lane's activation unit for step q of chunk 0 (act_unit with
// the chunk's 16 units added: (chunk * 16 + 4t + q) ^ t ^ ((brow & 1) << 2) = chunk * 16 +
// act[q]).
template <int NB>
__device__ __forceinline__ void mma_chunk(const WChunk<NB>& c, const uint4* const (&act)[4], int ahead,
                                               float (&acc)[NB][4]) {
    u32 sc[NB][2][2];  // [matrix][row g / g+8][scale of words 0-1 / 2-3] as FP16 pairs
#pragma unroll
    for (int b = 0; b < NB; b++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            u32 s2 = e4m3x2_to_f16x2(c.s[b][h]);
            sc[b][h][0] = __byte_perm(s2, 0, 0x1010);
            sc[b][h][1] = __byte_perm(s2, 0, 0x3232);
        }
#pragma unroll
    for (int q = 0; q < 4; q++) {
        uint4 bq = act[q][ahead * (DEC_CHUNK_K / 8)];
#pragma unroll
        for (int b = 0; b < NB; b++) {
            u32 wg = q == 0 ? c.w[b][0].x : q == 1 ? c.w[b][0].y : q == 2 ? c.w[b][0].z : c.w[b][0].w;
            u32 w8 = q == 0 ? c.w[b][1].x : q == 1 ? c.w[b][1].y : q == 2 ? c.w[b][1].z : c.w[b][1].w;
            u32 sg = sc[b][0][q / 2], s8 = sc[b][1][q / 2];
            u32 glo, ghi, elo, ehi;
            nib_bytes(wg, glo, ghi);
            nib_bytes(w8, elo, ehi);
            mma_f16(acc[b], mul_f16x2(nib_pair_from_bytes(glo, ghi, 0), sg),
                    mul_f16x2(nib_pair_from_bytes(elo, ehi, 0), s8),
                    mul_f16x2(nib_pair_from_bytes(glo, ghi, 1), sg),
                    mul_f16x2(nib_pair_from_bytes(elo, ehi, 1), s8), bq.x, bq.y);
            mma_f16(acc[b], mul_f16x2(nib_pair_from_bytes(glo, ghi, 2), sg),
                    mul_f16x2(nib_pair_from_bytes(elo, ehi, 2), s8),
                    mul_f16x2(nib_pair_from_bytes(glo, ghi, 3), sg),
                    mul_f16x2(nib_pair_from_bytes(elo, ehi, 3), s8), bq.z, bq.w);
        }
    }
}

// The chunks [c0, c1) of this warp's K range, two in flight.
template <int NB, bool TILES>
__device__ __forceinline__ void stream_k(const WarpRows<NB>& r, u32 c0, u32 c1, WChunk<NB> (&st)[2],
                                              const uint4* const (&act)[4], float (&acc)[NB][4]) {
    using L = WLayout<TILES>;
    Cursor<NB> cur;
    cursor_at<NB, TILES>(r, c0 + 2, cur);
    const uint4* ap[4];
#pragma unroll
    for (int q = 0; q < 4; q++) ap[q] = act[q] + c0 * (DEC_CHUNK_K / 8);
    for (u32 c = c0; c < c1; c += 2) {
        mma_chunk<NB>(st[0], ap, 0, acc);
        if (c + 2 < c1) load_chunk<NB, TILES>(r, cur, 0, st[0]);
        if (c + 1 < c1) {
            mma_chunk<NB>(st[1], ap, 1, acc);
            if (c + 3 < c1) load_chunk<NB, TILES>(r, cur, 1, st[1]);
        }
#pragma unroll
        for (int b = 0; b < NB; b++) {
            cur.qg[b] += 2 * L::QSTEP;
            cur.sg[b] += 2 * L::SSTEP;
        }
#pragma unroll
        for (int q = 0; q < 4; q++) ap[q] += 2 * (DEC_CHUNK_K / 8);
    }
}

// Shared memory: activations [DEC_G or fewer rows][K] FP16, then the K-split partial sums
// [NB][DEC_KSPLIT][DEC_TILES][32 lanes] float4, then the epilogue staging [DEC_TILES][8][16].
__host__ __device__ constexpr u32 dec_red_bytes(int nb) { return nb * DEC_KSPLIT * DEC_TILES * 32 * 16; }
#define DEC_STAGE_BYTES (DEC_TILES * DEC_G * 16 * 4)

// Everything a CTA does for one pass of up to `g_rows` token rows: stream the warp's K range
// of its tile and add the K-split partials in fixed order; returns true for the warps that
// hold a finished tile (ks == 0), with the sums in acc.
template <int NB, bool TILES>
__device__ __forceinline__ bool decode_pass(const WarpRows<NB>& wr, u32 K, const u8* __restrict__ aq,
                                            const u8* __restrict__ as, u32 p0, u32 mg, u32 g_rows,
                                            bool tile_live, u8* smem, float (&acc)[NB][4]) {
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    u32 g = lane / 4, t = lane % 4;
    u32 tile = warp % DEC_TILES, ks = warp / DEC_TILES;
    u32 nch = K / DEC_CHUNK_K;
    u32 c0 = ks * nch / DEC_KSPLIT, c1 = (ks + 1) * nch / DEC_KSPLIT;
    uint4* act = reinterpret_cast<uint4*>(smem);
    float4* red = reinterpret_cast<float4*>(smem + (size_t)g_rows * K * 2);
#pragma unroll
    for (int b = 0; b < NB; b++)
#pragma unroll
        for (int i = 0; i < 4; i++) acc[b][i] = 0.0f;
    WChunk<NB> st[2];
    bool work = tile_live && c0 < c1;
    // the first weight chunks are in flight while the activations are staged
    Cursor<NB> cur;
    cursor_at<NB, TILES>(wr, c0, cur);
    if (work) load_chunk<NB, TILES>(wr, cur, 0, st[0]);
    if (work && c0 + 1 < c1) load_chunk<NB, TILES>(wr, cur, 1, st[1]);
    pdl_wait();       // the activations were written by the kernel before this one
    __syncthreads();  // the previous pass is done with the buffers
    fill_acts(aq, as, K, p0, mg, act);
    __syncthreads();
    // token column g reads activation row g; columns past the pass's rows read row 0 (their
    // outputs are never used: MMA columns are independent)
    u32 brow = g < mg ? g : 0u;
    const uint4* act_row = act + (size_t)brow * (K / 8);
    u32 u0 = (4 * t) ^ ((brow & 1u) << 2);
    const uint4* const ap[4] = {act_row + u0 + (0u ^ t), act_row + u0 + (1u ^ t), act_row + u0 + (2u ^ t),
                                act_row + u0 + (3u ^ t)};
    if (work) stream_k<NB, TILES>(wr, c0, c1, st, ap, acc);
#pragma unroll
    for (int b = 0; b < NB; b++)
        red[((b * DEC_KSPLIT + ks) * DEC_TILES + tile) * 32 + lane] =
            make_float4(acc[b][0], acc[b][1], acc[b][2], acc[b][3]);
    __syncthreads();
    if (ks != 0) return false;
#pragma unroll
    for (int b = 0; b < NB; b++) {
        float4 v = red[((b * DEC_KSPLIT + 0) * DEC_TILES + tile) * 32 + lane];
        float s[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int k = 1; k < DEC_KSPLIT; k++) {
            float4 o = red[((b * DEC_KSPLIT + k) * DEC_TILES + tile) * 32 + lane];
            s[0] = __fadd_rn(s[0], o.x);
            s[1] = __fadd_rn(s[1], o.y);
            s[2] = __fadd_rn(s[2], o.z);
            s[3] = __fadd_rn(s[3], o.w);
        }
#pragma unroll
        for (int i = 0; i < 4; i++) acc[b][i] = __fmul_rn(s[i], SCALE_2P28);
    }
    return tile_live;
}

// Accumulator element i of lane (g, t): output row n0 + g (+8 for i >= 2), token column 2t + i%2.
#define ACC_ROW(i) (g + ((i) / 2) * 8)
#define ACC_TOK(i) (2 * t + ((i) % 2))

// Down projection: out[p, n] = bf16(f32(acc) * alpha_e), alpha_e = rcp(gs[e]) * ws2[e]. Grid:
// (ceil(nout / 64), up to min(E, rows)): blockIdx.y is a slot of `active` (moe_offsets: the
// count, then the experts with rows), so no CTA is launched for an expert without rows. Needs K % 128 == 0, nout % 16 == 0, E4M3 weight scales.
template <bool TILES>
__device__ __forceinline__ void decode_down(const u8* __restrict__ aq, const u8* __restrict__ as, u32 K, const u8* __restrict__ wq,
                 const u8* __restrict__ ws, u32 nout, const float* __restrict__ gs,
                 const float* __restrict__ ws2, const u32* __restrict__ expert_offsets,
                 const u32* __restrict__ active, u32 g_rows, u16* __restrict__ out) {
    extern __shared__ __align__(16) u8 dsmem[];
    if (blockIdx.y >= active[0]) return;
    u32 e = active[1 + blockIdx.y];
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    u32 g = lane / 4, t = lane % 4;
    u32 n0 = blockIdx.x * DEC_ROWS_PER_CTA + (warp % DEC_TILES) * 16;
    bool live = n0 < nout;
    u32 nl = live ? n0 : 0u;
    const u8* const q[1] = {wq};
    const u8* const s[1] = {ws};
    WarpRows<1> r = warp_rows<1, TILES>(q, s, e, nout, nl, K, lane);
    u32 r0 = expert_offsets[e], r1 = expert_offsets[e + 1];
    for (u32 p0 = r0; p0 < r1; p0 += g_rows) {
        u32 mg = r1 - p0 < g_rows ? r1 - p0 : g_rows;
        float acc[1][4];
        if (!decode_pass<1, TILES>(r, K, aq, as, p0, mg, g_rows, live, dsmem, acc)) continue;
        float alpha = __fmul_rn(rcp_ref(gs[e]), ws2[e]);  // gs: after pdl_wait (dynamic gs2)
#pragma unroll
        for (int i = 0; i < 4; i++)
            if (ACC_TOK(i) < mg)
                out[(size_t)(p0 + ACC_TOK(i)) * nout + n0 + ACC_ROW(i)] = bf16_rn(__fmul_rn(acc[0][i], alpha));
    }
}

// Gate/up projection with SwiGLU and the re-quantization fused, as moe_gemm_gate_up_nvfp4:
// a = swiglu(acc_g * alpha_g, acc_u * alpha_u); fixed gs2: quantize each (row, 16 columns) of
// `a` (the 16 rows of a warp tile are one block); dynamic: write `a` and fold |a| into
// amax_bits[e]. Grid: as decode_down.
template <bool TILES>
__device__ __forceinline__ void decode_gate_up(const u8* __restrict__ aq, const u8* __restrict__ as, u32 K,
                         const u8* __restrict__ w1q, const u8* __restrict__ w1s,
                         const u8* __restrict__ w3q, const u8* __restrict__ w3s, u32 nout,
                         const float* __restrict__ gs1, const float* __restrict__ ws2_1,
                         const float* __restrict__ ws2_3, float limit, u32 has_limit,
                         const u32* __restrict__ expert_offsets, const u32* __restrict__ active,
                         u32 g_rows, const float* __restrict__ gs2, u32 flavor, u8* __restrict__ outq,
                         u8* __restrict__ outs, u64* __restrict__ stats, float* __restrict__ out_f32,
                         u32* __restrict__ amax_bits) {
    extern __shared__ __align__(16) u8 dsmem[];
    pdl_launch_dependents();
    if (blockIdx.y >= active[0]) return;
    u32 e = active[1 + blockIdx.y];
    u32 r0 = expert_offsets[e], r1 = expert_offsets[e + 1];
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    u32 g = lane / 4, t = lane % 4;
    u32 tile = warp % DEC_TILES;
    u32 n0 = blockIdx.x * DEC_ROWS_PER_CTA + tile * 16;
    bool live = n0 < nout;
    u32 nl = live ? n0 : 0u;
    const u8* const q[2] = {w1q, w3q};
    const u8* const s[2] = {w1s, w3s};
    WarpRows<2> r = warp_rows<2, TILES>(q, s, e, nout, nl, K, lane);
    float* stage = reinterpret_cast<float*>(dsmem + (size_t)g_rows * K * 2 + dec_red_bytes(2)) +
                   tile * (DEC_G * 16);
    // Everything the epilogue needs is read after the pass and its statistics are flushed per
    // pass: nothing of it stays live across the weight stream, which needs the registers.
    for (u32 p0 = r0; p0 < r1; p0 += g_rows) {
        u32 mg = r1 - p0 < g_rows ? r1 - p0 : g_rows;
        float acc[2][4];
        if (!decode_pass<2, TILES>(r, K, aq, as, p0, mg, g_rows, live, dsmem, acc)) continue;
        float g_in = rcp_ref(gs1[e]);
        float alpha_g = __fmul_rn(g_in, ws2_1[e]), alpha_u = __fmul_rn(g_in, ws2_3[e]);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            float gv = __fmul_rn(acc[0][i], alpha_g);
            float uv = __fmul_rn(acc[1][i], alpha_u);
            stage[ACC_TOK(i) * 16 + ACC_ROW(i)] = swiglu(gv, uv, limit, has_limit);
        }
        __syncwarp();
        if (gs2 != nullptr) {
            u32 counts[4] = {0, 0, 0, 0};
            if ((u32)lane < mg) {
                float v[16];
#pragma unroll
                for (int x = 0; x < 16; x++) v[x] = stage[lane * 16 + x];
                u32 pk[2];
                u32 s = quant_block_nvfp4(v, gs2[e], flavor, pk);
                size_t row = (size_t)(p0 + lane);
                *reinterpret_cast<uint2*>(outq + row * (nout / 2) + n0 / 2) = make_uint2(pk[0], pk[1]);
                outs[row * (nout / 16) + n0 / 16] = (u8)s;
                float vmax = 0.0f;
#pragma unroll
                for (int x = 0; x < 16; x++) vmax = amax_step(vmax, v[x]);
                u32 c = classify_nvfp4(s, vmax > 0.0f);
                counts[0] = 1;
                counts[1] = c & 1u;
                counts[2] = (c >> 1) & 1u;
                counts[3] = (c >> 2) & 1u;
            }
            add_stats4(stats, counts);
        } else {
            // lane (row, 2 tokens x 8 rows): 16 rows x mg tokens, 4 values per lane
            u32 amax = 0;
            for (u32 idx = lane; idx < mg * 16; idx += 32) {
                u32 tok = idx / 16, n = idx % 16;
                float v = stage[tok * 16 + n];
                out_f32[(size_t)(p0 + tok) * nout + n0 + n] = v;
                float a = fabsf(v);
                u32 bits = a != a ? 0x7FC00000u : __float_as_uint(a);
                amax = bits > amax ? bits : amax;
            }
            amax = __reduce_max_sync(0xFFFFFFFFu, amax);
            if (lane == 0 && amax) atomicMax(&amax_bits[e], amax);
        }
        __syncwarp();
    }
}

// The kernels: weights in decode tiles (decode_tiles below) and, to measure one against the
// other on the same build (NVFP4DBG_MOE_DECODE=rows), in the checkpoint's row-major layout.
// Both run the same MMAs on the same operands in the same order: bit-identical sums.
#define DEC_DOWN_PARAMS                                                                              \
    const u8 *__restrict__ aq, const u8 *__restrict__ as, u32 K, const u8 *__restrict__ wq,          \
        const u8 *__restrict__ ws, u32 nout, const float *__restrict__ gs,                          \
        const float *__restrict__ ws2, const u32 *__restrict__ expert_offsets,                      \
        const u32 *__restrict__ active, u32 g_rows, u16 *__restrict__ out
#define DEC_DOWN_ARGS aq, as, K, wq, ws, nout, gs, ws2, expert_offsets, active, g_rows, out
#define DEC_GATE_UP_PARAMS                                                                           \
    const u8 *__restrict__ aq, const u8 *__restrict__ as, u32 K, const u8 *__restrict__ w1q,        \
        const u8 *__restrict__ w1s, const u8 *__restrict__ w3q, const u8 *__restrict__ w3s,         \
        u32 nout, const float *__restrict__ gs1, const float *__restrict__ ws2_1,                   \
        const float *__restrict__ ws2_3, float limit, u32 has_limit,                                \
        const u32 *__restrict__ expert_offsets, const u32 *__restrict__ active, u32 g_rows,         \
        const float *__restrict__ gs2,                                                              \
        u32 flavor, u8 *__restrict__ outq, u8 *__restrict__ outs, u64 *__restrict__ stats,          \
        float *__restrict__ out_f32, u32 *__restrict__ amax_bits
#define DEC_GATE_UP_ARGS                                                                             \
    aq, as, K, w1q, w1s, w3q, w3s, nout, gs1, ws2_1, ws2_3, limit, has_limit, expert_offsets, active, \
        g_rows, gs2, flavor, outq, outs, stats, out_f32, amax_bits

// CTAs per SM the down GEMM is compiled for (registers per thread at most 64K / (256 x it)):
// 4 (64 registers, no spills) measured 3% faster than 3 at 1 and 8 tokens (BENCHMARKS.md).
#ifndef DEC_DOWN_MIN_BLOCKS
#define DEC_DOWN_MIN_BLOCKS 4
#endif
extern "C" __global__ void __launch_bounds__(DEC_THREADS, DEC_DOWN_MIN_BLOCKS)
moe_decode_nvfp4(DEC_DOWN_PARAMS) {
    decode_down<true>(DEC_DOWN_ARGS);
}
extern "C" __global__ void __launch_bounds__(DEC_THREADS, DEC_DOWN_MIN_BLOCKS)
moe_decode_nvfp4_rows(DEC_DOWN_PARAMS) {
    decode_down<false>(DEC_DOWN_ARGS);
}
extern "C" __global__ void __launch_bounds__(DEC_THREADS, 2)
moe_decode_gate_up_nvfp4(DEC_GATE_UP_PARAMS) {
    decode_gate_up<true>(DEC_GATE_UP_ARGS);
}
extern "C" __global__ void __launch_bounds__(DEC_THREADS, 2)
moe_decode_gate_up_nvfp4_rows(DEC_GATE_UP_PARAMS) {
    decode_gate_up<false>(DEC_GATE_UP_ARGS);
}

// Row-major [rows, row_bytes] (codes: row_bytes = K / 2, piece = 64; scales: K / 16, 8) to
// decode tiles: byte j of piece p of row r goes to ((r / 16) * (row_bytes / piece) + p) * 16 *
// piece + (r % 16) * piece + j. rows % 16 == 0, row_bytes % piece == 0, piece % 8 == 0. One
// thread per 8 bytes; a pure permutation (every output byte written once).
extern "C" __global__ void decode_tiles(const u8* __restrict__ src, u64 rows, u32 row_bytes, u32 piece,
                                        u8* __restrict__ dst) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    u32 per_row = row_bytes / 8;
    if (i >= rows * per_row) return;
    u64 r = i / per_row;
    u32 col = (u32)(i - r * per_row) * 8;
    u32 p = col / piece, j = col - p * piece;
    u64 to = ((r / 16) * (row_bytes / piece) + p) * 16 * piece + (r % 16) * piece + j;
    *reinterpret_cast<uint2*>(dst + to) = *reinterpret_cast<const uint2*>(src + r * row_bytes + col);
}
