// The prefill grouped NVFP4 GEMM for Hopper (sm_90a): warpgroup MMA (wgmma.mma_async, BF16
// m64n256k16, FP32 accumulators) on operands that are dequantized exactly to BF16 in shared
// memory. The numbers are those of kernels/moe.cu's mma.sync kernels (docs/moe-forward.md):
// e2m1 x e4m3 is exact in BF16, the sum is FP32, alpha goes in the FP32 epilogue; only the
// FP32 summation order differs. Same arguments as moe_gemm_nvfp4 / moe_gemm_gate_up_nvfp4,
// for NVFP4 weights (16-blocks, E4M3 scales) and K a multiple of 64; other archs, MXFP4
// weights and other shapes keep the mma.sync kernels (src/backend/cuda/moe.rs dispatches).
//
// A block: 128 sorted rows (tokens) of one expert x 256 weight rows (plain: 256 output
// columns; fused gate/up: 128 columns of w1 then the same 128 of w3, so that g and u of one
// output land in the same thread). Two warpgroups, each 64 rows x 256 columns (128 FP32
// accumulators per thread). Per 64-wide K slice:
//   cp.async brings the packed FP4 codes + E4M3 scales of A and W into a raw stage
//   (H_STAGES deep, so global latency hides behind H_STAGES-1 slices of work);
//   all 256 threads dequantize one raw stage into one of two BF16 buffers, laid out K-major
//   with the 128-byte swizzle that the wgmma matrix descriptors describe;
//   each warpgroup issues 4 wgmma k16 steps on that buffer asynchronously, and the next
//   slice's dequantization runs while the tensor cores work on this one.
// A tile with <= 64 valid rows runs only the first warpgroup's MMAs (ragged last tiles).
#include "nvfp4dbg_common.cuh"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define NVFP4DBG_WGMMA 1
#else
#define NVFP4DBG_WGMMA 0
#endif

#define H_BM 128
#define H_BN 256
#define H_BK 64
#define H_STAGES 4
#define H_THREADS 256
#define H_FUSED_BN 128

// Shared memory, byte offsets from a 1024-aligned base (the 128-byte swizzle repeats every
// 8 rows x 128 bytes, and the descriptors assume atoms start at 1024-byte boundaries).
#define H_SA_BYTES (H_BM * H_BK * 2)
#define H_SB_BYTES (H_BN * H_BK * 2)
#define H_OFF_SB (2 * H_SA_BYTES)
#define H_OFF_RAW (H_OFF_SB + 2 * H_SB_BYTES)
#define H_RAW_AQ 0
#define H_RAW_BQ (H_BM * 32)
#define H_RAW_AS (H_RAW_BQ + H_BN * 32)
#define H_RAW_BS (H_RAW_AS + H_BM * 4)
#define H_RAW_BYTES (H_RAW_BS + H_BN * 4)
// + 1024 to align the base: the launch's dynamic shared memory (SM90_SMEM_BYTES in moe.rs)
#define H_SMEM_BYTES (H_OFF_RAW + H_STAGES * H_RAW_BYTES + 1024)
// the fused epilogue's f32 tile of `a` (rows of H_FUSED_BN + 4) reuses the BF16 buffers
#define H_SA_F32_ROW (H_FUSED_BN + 4)
static_assert(H_BM * H_SA_F32_ROW * 4 <= H_OFF_RAW, "the f32 tile of a must fit the operand buffers");

#if NVFP4DBG_WGMMA

// 16 bytes global -> shared, zero-filled past src_bytes (0 for rows outside the problem).
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, u32 src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async4(u32 dst, const void* src, u32 src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// Ordinary shared-memory stores that wgmma (the async proxy) reads next need this fence in
// each writing thread before the barrier.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory"); }

// Keeps the compiler from moving accumulator reads/writes across the asynchronous MMAs.
__device__ __forceinline__ void acc_fence(float (&d)[128]) {
#pragma unroll
    for (int i = 0; i < 128; i++) asm volatile("" : "+f"(d[i])::"memory");
}

// Matrix descriptor of a K-major BF16 tile with 128-byte rows in the 128-byte swizzle:
// start address >> 4 (bits 0-13), leading byte offset 16 (unused inside one swizzle atom,
// bits 16-29), stride byte offset 1024 = 8 rows x 128 bytes (bits 32-45), swizzle mode 1 =
// 128 bytes (bits 62-63). Advancing K by 16 elements adds 32 bytes (2 in the start field).
__device__ __forceinline__ u64 smem_desc(u32 addr) {
    return (u64)((addr & 0x3FFFFu) >> 4) | ((u64)(16 >> 4) << 16) | ((u64)(1024 >> 4) << 32) | (1ull << 62);
}

// Both operands are dequantized with a factor 2^-9 each (exact, see dequant8); the
// epilogues multiply the FP32 sum by 2^18 (exact) before alpha, so the outputs are those of
// the unscaled product. Every product is a multiple of 2^-38, far from FP32 underflow.
#define H_UNSCALE 262144.0f

// Eight E2M1 codes (one word, element 2i in the low nibble of byte i) times their block
// scale, as 8 BF16 values in the order n0 n4 n1 n5 n2 n6 n3 n7 (A and W use the same order,
// so the dot product is the same sum). A code's 3 magnitude bits placed at BF16 bits 6-8 with
// its sign at bit 15 read as e2m1 * 2^-126 exactly (0.5 is the subnormal 2^-127); times
// s2 = scale * 2^117 that is e2m1 * scale * 2^-9, exact (at least 2^-19, a normal BF16).
__device__ __forceinline__ uint4 dequant8(u32 q, u32 s2) {
    const u32 MAG = 0x01C001C0u, SGN = 0x80008000u, neg0 = 0x80008000u;
    u32 w0 = ((q << 6) & MAG) | ((q << 12) & SGN);
    u32 w1 = ((q << 2) & MAG) | ((q << 8) & SGN);
    u32 w2 = ((q >> 2) & MAG) | ((q << 4) & SGN);
    u32 w3 = ((q >> 6) & MAG) | (q & SGN);
    return make_uint4(bf16x2_fma(w0, s2, neg0), bf16x2_fma(w1, s2, neg0), bf16x2_fma(w2, s2, neg0),
                      bf16x2_fma(w3, s2, neg0));
}

// d[128] += A(64x16, smem desc) * B(256x16, smem desc)^T, both K-major with the 128-byte swizzle.
__device__ __forceinline__ void wgmma_m64n256k16_bf16(float (&d)[128], u64 da, u64 db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
        "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
        "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
        "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
        "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,"
        "%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,"
        "%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,"
        "%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,"
        "%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127"
        "}, %128, %129, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
          "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
          "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
          "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "l"(da), "l"(db), "r"(1));
}

// One block's operands. W tile row n < split comes from matrix 0 (row n0 + n), the rest from
// matrix 1 (row n0 + n - split).
struct HOps {
    const u8* aq;
    const u8* as;
    u32 K;
    u32 r0, r1, a_rows;  // a_rows: A rows staged (64 when the tile has <= 64 valid rows)
    const u8* wq0;
    const u8* ws0;
    const u8* wq1;
    const u8* ws1;
    u32 nout, n0, split;
};

// Keep a value in a register: the compiler cannot recompute what went through an opaque asm,
// so the per-slice loop does not redo the plan's address arithmetic.
__device__ __forceinline__ void pin(u32& v) { asm volatile("" : "+r"(v)); }
__device__ __forceinline__ void pin(const u8*& v) { asm volatile("" : "+l"(v)); }

// What one thread copies and dequantizes in every K slice, fixed for the whole block.
// Code units (16 bytes = 32 codes of one row): unit 0 is A row tid/2, units 1 and 2 are W
// rows (tid + 256)/2 - 128 and (tid + 512)/2 - 128; each takes half c = tid % 2 of the row's
// 64 codes. Scale units (4 bytes = the row's 4 block scales): unit 0 is row tid of A (tid
// < 128) or W row tid - 128, unit 1 is W row tid + 128 (tid < 128).
struct HPlan {
    const u8* src[3];  // row start + c * 16, advanced by 32 bytes per slice
    u32 bytes[3];      // 16, or 0 (zero fill) for rows outside the problem
    const u8* ssrc[2];
    u32 sbytes[2];
    bool a_on, s0_on, s1_on;  // warp-uniform
    u32 dst[3], sdst[2];      // offsets inside a raw stage
    u32 sel[3];               // __byte_perm selector of the unit's two scales
    u32 doff[3][4];           // swizzled offsets of the unit's four 16-byte chunks
};

__device__ __forceinline__ void h_plan(const HOps& o, HPlan& p) {
    u32 tid = threadIdx.x, c = tid & 1u;
    size_t qrow = o.K / 2, srow = o.K / 16;
    auto wsrc = [&](u32 n, bool scales, u32& bytes) -> const u8* {
        bool m1 = n >= o.split;
        u32 wrow = o.n0 + (m1 ? n - o.split : n);
        bool ok = wrow < o.nout;
        bytes = ok ? (scales ? 4u : 16u) : 0u;
        const u8* base = scales ? (m1 ? o.ws1 : o.ws0) : (m1 ? o.wq1 : o.wq0);
        return base + (size_t)(ok ? wrow : 0u) * (scales ? srow : qrow);
    };
#pragma unroll
    for (int t = 0; t < 3; t++) {
        u32 r = (tid + t * H_THREADS) >> 1;
        if (t == 0) {
            u32 row = o.r0 + r;
            bool ok = row < o.r1;
            p.bytes[0] = ok ? 16u : 0u;
            p.src[0] = o.aq + (size_t)(ok ? row : o.r0) * qrow + c * 16;
            p.dst[0] = H_RAW_AQ + r * 32 + c * 16;
        } else {
            u32 n = r - H_BM;
            p.src[t] = wsrc(n, false, p.bytes[t]) + c * 16;
            p.dst[t] = H_RAW_BQ + n * 32 + c * 16;
        }
        u32 rr = t == 0 ? r : r - H_BM;
        p.sel[t] = 0x4140u + c * 0x0202u;
#pragma unroll
        for (int w = 0; w < 4; w++) p.doff[t][w] = rr * 128 + ((((c * 4) + w) ^ (rr & 7u)) << 4);
    }
    p.a_on = (tid >> 1) < o.a_rows;
    if (tid < H_BM) {
        u32 row = o.r0 + tid;
        bool ok = row < o.r1;
        p.sbytes[0] = ok ? 4u : 0u;
        p.ssrc[0] = o.as + (size_t)(ok ? row : o.r0) * srow;
        p.sdst[0] = H_RAW_AS + tid * 4;
        p.s0_on = tid < o.a_rows;
        p.ssrc[1] = wsrc(tid + H_BM, true, p.sbytes[1]);
        p.sdst[1] = H_RAW_BS + (tid + H_BM) * 4;
        p.s1_on = true;
    } else {
        p.ssrc[0] = wsrc(tid - H_BM, true, p.sbytes[0]);
        p.sdst[0] = H_RAW_BS + (tid - H_BM) * 4;
        p.s0_on = true;
        p.ssrc[1] = p.ssrc[0];
        p.sbytes[1] = 0;
        p.sdst[1] = 0;
        p.s1_on = false;
    }
#pragma unroll
    for (int t = 0; t < 3; t++) {
        pin(p.src[t]);
        pin(p.bytes[t]);
        pin(p.dst[t]);
        pin(p.sel[t]);
#pragma unroll
        for (int w = 0; w < 4; w++) pin(p.doff[t][w]);
    }
#pragma unroll
    for (int t = 0; t < 2; t++) {
        pin(p.ssrc[t]);
        pin(p.sbytes[t]);
        pin(p.sdst[t]);
    }
}

// Fill raw stage `stage` (a shared address) with K slice kb.
__device__ __forceinline__ void h_load_raw(const HPlan& p, u32 kb, u32 stage) {
    if (p.a_on) cp_async16(stage + p.dst[0], p.src[0] + kb * 32, p.bytes[0]);
    cp_async16(stage + p.dst[1], p.src[1] + kb * 32, p.bytes[1]);
    cp_async16(stage + p.dst[2], p.src[2] + kb * 32, p.bytes[2]);
    if (p.s0_on) cp_async4(stage + p.sdst[0], p.ssrc[0] + kb * 4, p.sbytes[0]);
    if (p.s1_on) cp_async4(stage + p.sdst[1], p.ssrc[1] + kb * 4, p.sbytes[1]);
}

// One code unit of a raw stage -> four swizzled 16-byte chunks of BF16 (chunk kc of row r
// sits at chunk kc ^ (r % 8), the 128-byte swizzle; a warp's 8-lane store phases hit 8
// distinct chunks, so no bank conflicts).
__device__ __forceinline__ void h_dequant_unit(const HPlan& p, int t, const u8* raw, u32 soff, u8* buf) {
    uint4 q = *reinterpret_cast<const uint4*>(raw + p.dst[t]);
    u32 sc = *reinterpret_cast<const u32*>(raw + soff);
    u32 sv = e4m3x2_scaled(__byte_perm(sc, 0u, p.sel[t]));
    u32 s0 = __byte_perm(sv, sv, 0x1010u), s1 = __byte_perm(sv, sv, 0x3232u);
    *reinterpret_cast<uint4*>(buf + p.doff[t][0]) = dequant8(q.x, s0);
    *reinterpret_cast<uint4*>(buf + p.doff[t][1]) = dequant8(q.y, s0);
    *reinterpret_cast<uint4*>(buf + p.doff[t][2]) = dequant8(q.z, s1);
    *reinterpret_cast<uint4*>(buf + p.doff[t][3]) = dequant8(q.w, s1);
}

// acc[j*4 + q] of warpgroup wg holds (row, col) = (wg*64 + warp*16 + lane/4 + 8*(q/2),
// j*8 + (lane%4)*2 + q%2) of the 128 x 256 tile, times 2^-18 (H_UNSCALE).
// split (timing experiments only; the outputs are then wrong): bit 0 leaves the MMAs out,
// bit 1 the dequantization (the operand buffers are zeroed once instead), bit 2 the global
// loads (cp.async).
__device__ __forceinline__ void h_mainloop(const HOps& o, u8* base, float (&acc)[128], u32 split) {
    u32 tid = threadIdx.x, wg = tid / 128;
    HPlan p;
    h_plan(o, p);
    // scale offsets of the code units inside a raw stage (rows: A tid/2, W (tid+256)/2 - 128, ...)
    u32 soff0 = H_RAW_AS + (tid >> 1) * 4;
    u32 soff1 = H_RAW_BS + (((tid + H_THREADS) >> 1) - H_BM) * 4;
    u32 soff2 = H_RAW_BS + (((tid + 2 * H_THREADS) >> 1) - H_BM) * 4;
    pin(soff0);
    pin(soff1);
    pin(soff2);
    u32 raw0 = smem_addr(base + H_OFF_RAW);
#pragma unroll
    for (int i = 0; i < 128; i++) acc[i] = 0.0f;
    u32 nk = o.K / H_BK;
#pragma unroll
    for (u32 s = 0; s < H_STAGES - 1; s++) {
        if (s < nk && !(split & 4u)) h_load_raw(p, s, raw0 + s * H_RAW_BYTES);
        cp_async_commit();
    }
    // a tile of <= 64 rows leaves the second warpgroup's MMAs out; the shuffle makes the
    // flag visibly warp-uniform to the compiler (else it serializes the wgmma, C7518)
    bool mma = __shfl_sync(0xFFFFFFFFu, ((wg == 0 || o.a_rows > 64) && !(split & 1u)) ? 1 : 0, 0) != 0;
    bool deq = (split & 2u) == 0;
    if (!deq) {
        for (u32 i = tid; i < H_OFF_RAW / 16; i += H_THREADS)
            reinterpret_cast<uint4*>(base)[i] = make_uint4(0, 0, 0, 0);
    }
    u32 descA0 = smem_addr(base + wg * 64 * 128), descB0 = smem_addr(base + H_OFF_SB);
    for (u32 kb = 0; kb < nk; kb++) {
        cp_async_wait<H_STAGES - 2>();
        // raw stage kb is in; every warpgroup is past the MMAs that read buffer kb % 2 last
        __syncthreads();
        u32 nx = kb + H_STAGES - 1;
        if (nx < nk && !(split & 4u)) h_load_raw(p, nx, raw0 + (nx % H_STAGES) * H_RAW_BYTES);
        cp_async_commit();
        u32 b = kb & 1u;
        const u8* raw = base + H_OFF_RAW + (kb % H_STAGES) * H_RAW_BYTES;
        u8* bufA = base + b * H_SA_BYTES;
        u8* bufB = base + H_OFF_SB + b * H_SB_BYTES;
        if (deq) {
            if (p.a_on) h_dequant_unit(p, 0, raw, soff0, bufA);
            h_dequant_unit(p, 1, raw, soff1, bufB);
            h_dequant_unit(p, 2, raw, soff2, bufB);
        }
        fence_proxy_async();
        __syncthreads();
        if (mma) {
            u64 da = smem_desc(descA0 + b * H_SA_BYTES);
            u64 db = smem_desc(descB0 + b * H_SB_BYTES);
            wgmma_fence();
#pragma unroll
            for (u32 kk = 0; kk < H_BK / 16; kk++) wgmma_m64n256k16_bf16(acc, da + 2 * kk, db + 2 * kk);
            wgmma_commit();
            // the MMAs of slice kb-1 are done: buffer (kb+1) % 2 is free for the next slice
            wgmma_wait<1>();
        }
    }
    if (mma) wgmma_wait<0>();
    acc_fence(acc);
    cp_async_wait<0>();
    __syncthreads();
}

__device__ __forceinline__ u8* h_smem_base() {
    extern __shared__ __align__(1024) u8 h_smem[];
    u32 a = smem_addr(h_smem);
    return h_smem + ((1024u - (a & 1023u)) & 1023u);
}

#endif  // NVFP4DBG_WGMMA

// Down projection: out[p, n] = bf16(f32(acc) * alpha_e), alpha_e = rcp(gs[e]) * ws2[e] (BF16
// rows: moe.cu moe_combine). Grid: (ceil(nout / 256), M-tile bound), 256 threads,
// H_SMEM_BYTES of dynamic shared memory.
extern "C" __global__ void __launch_bounds__(H_THREADS, 1)
moe_gemm_nvfp4_sm90(const u8* __restrict__ aq, const u8* __restrict__ as, u32 K,
                    const u8* __restrict__ wq, const u8* __restrict__ ws, u32 nout, u32 wblock,
                    const float* __restrict__ gs, const float* __restrict__ ws2,
                    const u32* __restrict__ tile_offsets, const u32* __restrict__ expert_offsets, u32 E,
                    u16* __restrict__ out, u32 split) {
#if NVFP4DBG_WGMMA
    u32 e, r0, r1;
    if (!find_row_tile(tile_offsets, expert_offsets, E, blockIdx.y, H_BM, e, r0, r1)) return;
    u8* base = h_smem_base();
    HOps o;
    o.aq = aq; o.as = as; o.K = K; o.r0 = r0; o.r1 = r1; o.a_rows = r1 - r0 <= 64 ? 64 : H_BM;
    size_t wstride = (size_t)nout * (K / 2), sstride = (size_t)nout * (K / 16);
    o.wq0 = wq + e * wstride; o.ws0 = ws + e * sstride;
    o.wq1 = o.wq0; o.ws1 = o.ws0;
    o.nout = nout; o.n0 = blockIdx.x * H_BN; o.split = H_BN;
    float acc[128];
    h_mainloop(o, base, acc, split);
    float alpha = __fmul_rn(rcp_ref(gs[e]), ws2[e]);
    u32 wg = threadIdx.x / 128, warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
#pragma unroll
    for (int j = 0; j < 32; j++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            u32 row = r0 + wg * 64 + warp * 16 + lane / 4 + 8 * h;
            u32 col = o.n0 + j * 8 + (lane % 4) * 2;
            if (row >= r1) continue;
            float v0 = __fmul_rn(__fmul_rn(acc[j * 4 + 2 * h], H_UNSCALE), alpha);
            float v1 = __fmul_rn(__fmul_rn(acc[j * 4 + 2 * h + 1], H_UNSCALE), alpha);
            u16* dst = out + (size_t)row * nout + col;
            if (col + 1 < nout)
                *reinterpret_cast<u32*>(dst) = bf16x2_rn(v0, v1);
            else if (col < nout)
                dst[0] = bf16_rn(v0);
        }
#else
    __trap();
#endif
}

// Gate/up projection with SwiGLU fused, as moe_gemm_gate_up_nvfp4: g = acc_g * alpha_g,
// u = acc_u * alpha_u, a = swiglu(g, u); then (fixed gs2) `a` quantized to NVFP4 here, or
// (dynamic) written in f32 with |a| folded into amax_bits[e]. Grid: (ceil(nout / 128),
// M-tile bound), 256 threads, H_SMEM_BYTES of dynamic shared memory.
extern "C" __global__ void __launch_bounds__(H_THREADS, 1)
moe_gemm_gate_up_nvfp4_sm90(const u8* __restrict__ aq, const u8* __restrict__ as, u32 K,
                            const u8* __restrict__ w1q, const u8* __restrict__ w1s,
                            const u8* __restrict__ w3q, const u8* __restrict__ w3s, u32 nout, u32 wblock,
                            const float* __restrict__ gs1, const float* __restrict__ ws2_1,
                            const float* __restrict__ ws2_3, float limit, u32 has_limit,
                            const u32* __restrict__ tile_offsets, const u32* __restrict__ expert_offsets,
                            u32 E, const float* __restrict__ gs2, u32 flavor, u8* __restrict__ outq,
                            u8* __restrict__ outs, u64* __restrict__ stats, float* __restrict__ out_f32,
                            u32* __restrict__ amax_bits, u32 split) {
#if NVFP4DBG_WGMMA
    u32 e, r0, r1;
    if (!find_row_tile(tile_offsets, expert_offsets, E, blockIdx.y, H_BM, e, r0, r1)) return;
    u8* base = h_smem_base();
    HOps o;
    o.aq = aq; o.as = as; o.K = K; o.r0 = r0; o.r1 = r1; o.a_rows = r1 - r0 <= 64 ? 64 : H_BM;
    size_t wstride = (size_t)nout * (K / 2), sstride = (size_t)nout * (K / 16);
    o.wq0 = w1q + e * wstride; o.ws0 = w1s + e * sstride;
    o.wq1 = w3q + e * wstride; o.ws1 = w3s + e * sstride;
    u32 n0 = blockIdx.x * H_FUSED_BN;
    o.nout = nout; o.n0 = n0; o.split = H_FUSED_BN;
    float acc[128];
    h_mainloop(o, base, acc, split);
    float g_in = rcp_ref(gs1[e]);
    float alpha_g = __fmul_rn(g_in, ws2_1[e]), alpha_u = __fmul_rn(g_in, ws2_3[e]);
    float* sa = reinterpret_cast<float*>(base);
    const int SA = H_SA_F32_ROW;
    {
        u32 wg = threadIdx.x / 128, warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
#pragma unroll
        for (int j = 0; j < 16; j++)
#pragma unroll
            for (int q = 0; q < 4; q++) {
                u32 lr = wg * 64 + warp * 16 + lane / 4 + 8 * (q / 2);
                u32 lc = j * 8 + (lane % 4) * 2 + (q % 2);
                float g = __fmul_rn(__fmul_rn(acc[j * 4 + q], H_UNSCALE), alpha_g);
                float u = __fmul_rn(__fmul_rn(acc[(j + 16) * 4 + q], H_UNSCALE), alpha_u);
                sa[lr * SA + lc] = swiglu(g, u, limit, has_limit);
            }
    }
    __syncthreads();
    gate_up_tile_epilogue<H_BM, H_FUSED_BN, H_THREADS>(sa, SA, r0, r1, n0, nout, e, gs2, flavor, outq, outs, stats,
                                                       out_f32, amax_bits);
#else
    __trap();
#endif
}

// ---- register-A kernels: the weights as the wgmma A operand (moe.rs launches these on sm_90a
// when H and I are multiples of 128; the kernels above otherwise) ----
//
// The product is computed transposed: D[weight row][token] = W x X^T, weights as M (64 rows
// per m-block, two m-blocks per warpgroup), the tokens of one expert tile as N (128, or 96 /
// 64 / 32 for the small last tiles of ragged experts, 144 / 160 for the wide ones: rs_tile).
// Per 128-wide K chunk:
//   the weights come straight from the decode tiles (moe_decode.cu, decode_tiles: each warp's
//   16 rows are one contiguous 1 KB + 128 B piece per chunk) into registers, one chunk ahead,
//   and each thread dequantizes its own A fragments (rows g and g + 8 of its warp's 16) right
//   before the MMAs that read them: no shared-memory round trip, no proxy fence, and the
//   dequantization of step s + 1 runs while the tensor cores work on step s;
//   the tokens come dequantized once per forward (moe_rows_bf16_rs) as a BF16 matrix, by TMA
//   into an R_STAGES-deep ring of shared-memory stages (128-byte swizzle, mbarriers: one
//   elected thread refills a stage once every warp has released it; no CTA barrier in the loop).
// K order: inside a chunk, token element 16 s + 2 t + e (and + 8) of wgmma step s holds the K
// index that lane t's A fragment holds there (see rs_pair below and moe_rows_bf16_rs), so the
// dot products are the same sums as in K order. The numbers are those of the kernels above
// (both operands carry 2^-9, undone with alpha in the FP32 epilogue), up to FP32 summation order.
#define R_BN 160                          // most token rows per tile: BM = 128, the last tile of an
                                          // expert up to BM + R_SLACK (moe_offsets' wide tiles)
#define R_SLACK 32
#define R_BK 128                          // K per chunk (the decode tiles' chunk)
// Token stages in the ring (moe.rs reads a -DR_STAGES for the launch's shared memory). 5
// (201 KB) against 4, s15g (3 alternating rounds): the layer's gate/up stage 4.427 ms against
// 4.463 in every round, its down stage 2.295 against 2.277, the uniform gate/up 3.84 against
// 3.91: kept at 4. 3 against 4, s20a and s20b (3 alternating rounds each): the layer ahead in
// all 6 rounds, eager 7.79-7.87 ms against 7.84-7.98, graph 7.78-7.89 against 7.87-7.97, the
// uniform gate/up 3.65-3.73 against 3.75-3.79; 2 behind 4 (8.02-8.09): now 3.
// Warpgroups per CTA (moe.rs reads a -DRS_WG for the launch): 2 (default) share one token ring
// and take 256 weight rows (the gate/up: 128 outputs of w1 and w3), one CTA of 255 registers a
// thread per SM; 1 takes 128 weight rows (64 outputs) with its own ring of 2 stages, two CTAs
// per SM, so that one CTA's epilogue could run while the other's MMAs do (for twice the token
// traffic from L2). Measured (s16a, 3 alternating rounds, the layer at 4096 tokens): gate/up
// stage 4.712 ms against 4.532, down 2.352 against 2.315; its K loops alone (RS_DIAG=7) 4.201
// against 4.129: L2 serves the traffic, but the two CTAs' epilogues coincide or take the issue
// slots the other's dequantization needs. Kept at 2.
// A third, producer warpgroup that dequantizes the weights into shared memory for the two
// (RS_PRODUCER, commit 8f6fb49, s24b) was 1.43x slower: the consumers keep their MMAs in flight
// only with 216 registers, which leaves the producer 72 and one warp a scheduler for ~940 SASS
// instructions a chunk (BENCHMARKS.md, session 24).
#ifndef RS_WG
#define RS_WG 2
#endif
static_assert(RS_WG == 1 || RS_WG == 2, "RS_WG: 1 or 2");
#define R_THREADS (RS_WG * 128)
#define R_GU_BN (RS_WG * 64)  // gate/up outputs per CTA (of each of w1, w3)
#define R_DOWN_BN (RS_WG * 128)
#ifndef R_STAGES
#if RS_WG == 2
#define R_STAGES 3
#else
#define R_STAGES 2
#endif
#endif
#define R_BOX_ROWS 32                     // the small TMA box: 32 rows x 64 K of BF16 (4 KB); the
#define R_BOX_BYTES (R_BOX_ROWS * 64 * 2) // big one is 128 rows (rs_fill)
#define R_HALF_BYTES (R_BN * 64 * 2)      // one half chunk (K 64) of R_BN token rows
#define R_STAGE_BYTES (2 * R_HALF_BYTES)
// The gate/up epilogue's f32 tile, over the stages once the K loop is done: R_BN token rows of
// R_EPI_ROW floats (g, then u, of the CTA's R_GU_BN outputs, + 4 so that a warp's accumulator
// stores hit 32 banks: 2 t R_EPI_ROW = 8 t mod 32). The barriers follow the larger of the two.
#define R_EPI_ROW (2 * R_GU_BN + 4)
#define R_EPI_BYTES (R_BN * R_EPI_ROW * 4)
#define R_RING_BYTES (R_STAGES * R_STAGE_BYTES)
#define R_OFF_BARS (R_EPI_BYTES > R_RING_BYTES ? R_EPI_BYTES : R_RING_BYTES)
// The expert's scalars (rs_scalars: 4 floats) after the barriers, in the base's alignment
// slack (at least 16 of its 1024 bytes are left: the dynamic shared memory starts 16-aligned).
#define R_OFF_SCALARS (R_OFF_BARS + 2 * R_STAGES * 8)
// + 1024 to align the base: moe.rs SM90_RS_SMEM_BYTES
#define R_SMEM_BYTES (R_OFF_BARS + 2 * R_STAGES * 8 + 1024)
static_assert(R_BN == H_BM + R_SLACK, "a tile is at most BM + R_SLACK tokens");
static_assert(R_EPI_ROW >= 2 * R_GU_BN && R_EPI_ROW % 16 == 4, "the epilogue tile's rows");
static_assert(R_HALF_BYTES % 1024 == 0 && R_BOX_BYTES % 1024 == 0, "boxes start at swizzle atoms");
#define R_TILE_Q (16 * R_BK / 2)          // a 16-row decode tile's codes per chunk: 1 KB
#define R_TILE_S (16 * R_BK / 16)         // and scales: 128 B

// Tuning knobs (#ifndef: NVFP4DBG_NVRTC_DEFINES="-DRS_F16=0 ..." overrides them for an A/B on
// one build; every setting gives the same numbers up to FP32 summation order).
// MMA groups (one k16 step: both m-blocks) a warp keeps in flight while it dequantizes the
// next step's A fragments: 1 or 2 (2 holds one more set of A registers).
#ifndef RS_INFLIGHT
#define RS_INFLIGHT 2
#endif
static_assert(RS_INFLIGHT == 1 || RS_INFLIGHT == 2, "RS_INFLIGHT: 1 or 2");
// The weights of chunk c + L2_AHEAD are prefetched into L2 while chunk c runs (2 or less:
// none). The registers hold only one chunk ahead (about 2000 cycles at N = 128, less than a
// DRAM round trip under load: ncu put a fifth of the stall cycles on those loads, session 7).
// Measured per kernel once each expert's weights streamed from DRAM once (s9c, 4096 tokens):
// the down projection gains from 4 chunks ahead (1.797 ms against 1.861 without), the gate/up
// loses (4.357 ms against 4.197 without: its two matrices double the prefetches).
#ifndef RS_L2_AHEAD_DOWN
#define RS_L2_AHEAD_DOWN 4
#endif
#ifndef RS_L2_AHEAD_GATE_UP
#define RS_L2_AHEAD_GATE_UP 0
#endif
// The same for the tiles of 64 tokens or fewer, in both kernels (-1: each kernel's own setting
// above). They stream a whole weight slice for few MMAs, and a real router's uneven load makes
// many of them (the layer figure's: 104 of 349 tiles). Measured (s14c, 4 alternating rounds):
// the layer's gate/up stage 4.670 ms against 4.701 with the kernel's own 0, the uniform
// figure unchanged (4.066 against 4.052: it has next to no narrow tiles).
#ifndef RS_L2_AHEAD_NARROW
#define RS_L2_AHEAD_NARROW 4
#endif
// A 144-token width between 128 and 160, per kernel (0: tiles of 129-160 tokens all run at
// 160). Measured (s9e, s9f): the gate/up gains from it (4.10 ms against 4.19), the down loses
// (1.87 against 1.79).
#ifndef RS_N144_DOWN
#define RS_N144_DOWN 0
#endif
#ifndef RS_N144_GATE_UP
#define RS_N144_GATE_UP 1
#endif
#if RS_F16
#define RS_AB "f16.f16"
#define RS_UNSCALE 268435456.0f  // 2^28: undoes the 2^-14 of both operands
#else
#define RS_AB "bf16.bf16"
#define RS_UNSCALE H_UNSCALE
#endif
// Time split only (the outputs are then WRONG; never a default): the sum of 1 (the gate/up's
// SwiGLU replaced by g * u), 2 (no NVFP4 epilogue after it: the down GEMM reads what the
// last forward left), 4 (the down GEMM stores nothing), 8 (the K loops' A fragments without
// their scale multiply, RS_F16 only), 16 (nib_bytes' words as the A fragments, RS_F16 only: 6
// dequantization instructions a word pair instead of 14). The bench skips its output checks
// under it. (32, the down's stores into 128 L2-resident token rows, ran in s22e: commit 1d208eb.)
// Measured (s15b, the layer at 4096 tokens, before RS_SWIGLU16): 1 took 0.46 ms off the
// gate/up stage's 4.54, 3 0.61; 4 0.40 ms off the down stage's 2.25. s22d (BENCHMARKS.md): 6
// took 0.42 ms off the gate/up stage and 0.46 off the down; 14 another 0.32 and 0.11; 22 no more.
#ifndef RS_DIAG
#define RS_DIAG 0
#endif
// The gate/up epilogue's SwiGLU, on g and u that the accumulators left in the f32 tile
// (R_EPI_ROW), inside the NVFP4 epilogue's loop: 1 (default) 16 values at a time (swiglu16:
// exp's fast path without branches, the rare rest after), 0 one at a time (swiglu).
#ifndef RS_SWIGLU16
#define RS_SWIGLU16 1
#endif
// With a fixed gs2: 1 (default) the SwiGLU and the NVFP4 block together (swiglu_nvfp4_16:
// fast values, the exact ones only where a scale or code could differ), 0 the exact SwiGLU of
// every value (RS_SWIGLU16's) then the block. The same bits (s26a: layertest outputs byte for
// byte, tools/checks/swiglu_nvfp4.cu); 4 alternating rounds (s26a): the layer at 4096 tokens
// 7.07-7.11 ms against 7.15-7.23 (graph), its gate/up stage 4.03 against 4.15.
#ifndef RS_SWIGLU_NVFP4
#define RS_SWIGLU_NVFP4 1
#endif
// Tile widths between the powers of two, for both kernels: 96 tokens (tiles of 65-96 ran at
// 128) and 48 (33-48 ran at 64). On the 4096-token layer's routing both cut the MMA width
// summed over the tiles from 1.166x the rows to 1.084x (bench/tile_split.py; 96 alone 1.103x),
// but the time follows it only a little: a tile's weight dequantization is the same at every
// width. 4 alternating rounds (s26d), the layer at 4096 tokens (graph): neither 7.045-7.126 ms,
// both 7.014-7.066, 96 alone 7.008-7.022; its down stage 2.057-2.065, 2.056-2.061 and
// 2.032-2.037. So 96 (1) and not 48 (0).
#ifndef RS_N96
#define RS_N96 1
#endif
#ifndef RS_N48
#define RS_N48 0
#endif

#if NVFP4DBG_WGMMA

// An arrival where `pred` holds, predicated inside the asm (no branch: see mbar_wait).
__device__ __forceinline__ void mbar_arrive_if(u32 bar, bool pred) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.u32 p, %1, 0;\n"
        "@p mbarrier.arrive.shared::cta.b64 _, [%0];\n}\n" ::"r"(bar),
        "r"((u32)pred)
        : "memory");
}
// TMA: the box at (c0 = column, c1 = row) of the 2-D tensor map at `tmap` (global memory)
// into shared `dst`, its bytes completing on mbarrier `bar`.
__device__ __forceinline__ void tma_load_2d(u32 dst, const void* tmap, int c0, int c1, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(dst),
        "l"(tmap), "r"(c0), "r"(c1), "r"(bar)
        : "memory");
}

__device__ __forceinline__ void wgmma_m64n128k16_rs(float (&d)[64], const u32 (&a)[4], u64 db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32." RS_AB " {"
        "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
        "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
        "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
        "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"
        "}, {%64,%65,%66,%67}, %68, p, 1, 1, 0;\n}\n"
        :"+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "n"(1));
}

__device__ __forceinline__ void wgmma_m64n144k16_rs(float (&d)[72], const u32 (&a)[4], u64 db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %77, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n144k16.f32." RS_AB " {"
        "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
        "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
        "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
        "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,"
        "%64,%65,%66,%67,%68,%69,%70,%71"
        "}, {%72,%73,%74,%75}, %76, p, 1, 1, 0;\n}\n"
        :"+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "n"(1));
}

__device__ __forceinline__ void wgmma_m64n160k16_rs(float (&d)[80], const u32 (&a)[4], u64 db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %85, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n160k16.f32." RS_AB " {"
        "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
        "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
        "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
        "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,"
        "%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79"
        "}, {%80,%81,%82,%83}, %84, p, 1, 1, 0;\n}\n"
        :"+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "n"(1));
}

__device__ __forceinline__ void wgmma_m64n96k16_rs(float (&d)[48], const u32 (&a)[4], u64 db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %53, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n96k16.f32." RS_AB " {"
        "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
        "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
        "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47"
        "}, {%48,%49,%50,%51}, %52, p, 1, 1, 0;\n}\n"
        :"+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "n"(1));
}

__device__ __forceinline__ void wgmma_m64n48k16_rs(float (&d)[24], const u32 (&a)[4], u64 db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %29, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n48k16.f32." RS_AB " {"
        "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
        "%16,%17,%18,%19,%20,%21,%22,%23"
        "}, {%24,%25,%26,%27}, %28, p, 1, 1, 0;\n}\n"
        :"+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "n"(1));
}

__device__ __forceinline__ void wgmma_m64n64k16_rs(float (&d)[32], const u32 (&a)[4], u64 db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32." RS_AB " {"
        "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
        "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31"
        "}, {%32,%33,%34,%35}, %36, p, 1, 1, 0;\n}\n"
        :"+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "n"(1));
}

__device__ __forceinline__ void wgmma_m64n32k16_rs(float (&d)[16], const u32 (&a)[4], u64 db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32." RS_AB " {"
        "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15"
        "}, {%16,%17,%18,%19}, %20, p, 1, 1, 0;\n}\n"
        :"+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "n"(1));
}


// One lane's weights of one K chunk, for its warp's two m-blocks: rows g and g + 8 (16 bytes
// of codes each: K 32 t .. 32 t + 31 of the chunk) and their two scales (blocks 2 t, 2 t + 1).
struct RChunk {
    uint4 w[2][2];
    u32 s[2][2];
};

// Where a lane's weights lie: its 16-byte piece of row g of each m-block's decode tile at
// chunk 0 (row g + 8 is 512 bytes on, its scales 64), or null for a tile past the matrix.
struct RWeights {
    const u8* q[2];
    const u8* s[2];
};

__device__ __forceinline__ void rs_load(const RWeights& wr, u32 c, RChunk& st) {
#pragma unroll
    for (int b = 0; b < 2; b++) {
        if (wr.q[b] != nullptr) {
            const u8* q = wr.q[b] + (size_t)c * R_TILE_Q;
            const u8* s = wr.s[b] + (size_t)c * R_TILE_S;
            st.w[b][0] = ldg_stream(q);
            st.w[b][1] = ldg_stream(q + 512);
            st.s[b][0] = __ldg(reinterpret_cast<const unsigned short*>(s));
            st.s[b][1] = __ldg(reinterpret_cast<const unsigned short*>(s + 64));
        } else {
            st.w[b][0] = st.w[b][1] = make_uint4(0, 0, 0, 0);
            st.s[b][0] = st.s[b][1] = 0;
        }
    }
}

// Chunk c's weight lines into L2 (the lane's 16-byte pieces of rows g and g + 8, and its scales).
__device__ __forceinline__ void rs_prefetch_l2(const RWeights& wr, u32 c) {
#pragma unroll
    for (int b = 0; b < 2; b++) {
        if (wr.q[b] != nullptr) {
            const u8* q = wr.q[b] + (size_t)c * R_TILE_Q;
            asm volatile("prefetch.global.L2 [%0];" ::"l"(q));
            asm volatile("prefetch.global.L2 [%0];" ::"l"(q + 512));
            asm volatile("prefetch.global.L2 [%0];" ::"l"(wr.s[b] + (size_t)c * R_TILE_S));
        }
    }
}

template <int N> struct RsMma;
template <> struct RsMma<144> {
    static __device__ __forceinline__ void mma(float (&d)[72], const u32 (&a)[4], u64 db) { wgmma_m64n144k16_rs(d, a, db); }
};
template <> struct RsMma<160> {
    static __device__ __forceinline__ void mma(float (&d)[80], const u32 (&a)[4], u64 db) { wgmma_m64n160k16_rs(d, a, db); }
};
template <> struct RsMma<128> {
    static __device__ __forceinline__ void mma(float (&d)[64], const u32 (&a)[4], u64 db) { wgmma_m64n128k16_rs(d, a, db); }
};
template <> struct RsMma<96> {
    static __device__ __forceinline__ void mma(float (&d)[48], const u32 (&a)[4], u64 db) { wgmma_m64n96k16_rs(d, a, db); }
};
template <> struct RsMma<48> {
    static __device__ __forceinline__ void mma(float (&d)[24], const u32 (&a)[4], u64 db) { wgmma_m64n48k16_rs(d, a, db); }
};
template <> struct RsMma<64> {
    static __device__ __forceinline__ void mma(float (&d)[32], const u32 (&a)[4], u64 db) { wgmma_m64n64k16_rs(d, a, db); }
};
template <> struct RsMma<32> {
    static __device__ __forceinline__ void mma(float (&d)[16], const u32 (&a)[4], u64 db) { wgmma_m64n32k16_rs(d, a, db); }
};

template <int N>
__device__ __forceinline__ void rs_acc_fence(float (&d)[2][N / 2]) {
#pragma unroll
    for (int b = 0; b < 2; b++)
#pragma unroll
        for (int i = 0; i < N / 2; i++) asm volatile("" : "+f"(d[b][i])::"memory");
}

// The ring: full[s] (the TMA's bytes; one arrival, thread 0's expect_tx) and empty[s] (one
// arrival per warp once its MMAs on the stage are complete), R_STAGES each.
struct RBars {
    u32 base;
    __device__ __forceinline__ u32 full(u32 s) const { return base + 8 * s; }
    __device__ __forceinline__ u32 empty(u32 s) const { return base + 8 * (R_STAGES + s); }
};

// Thread 0: chunk c of the tile's tokens (rows r0 .. r0 + N - 1) into its stage. `tmap` holds
// two tensor maps of the same tokens: boxes of 128 rows, then (128 bytes on) boxes of 32 rows;
// each 64-wide half of the chunk takes N / 128 big boxes and then ceil((N % 128) / 32) small
// ones (R_BN rows of 128 bytes a half, so N = 144 loads 16 rows it does not use; boxes start
// at 1024-byte steps, so the swizzle composes).
// Small boxes only (8 for 128 rows) measured 3-4% slower than one big box (s9a).
template <int N>
__device__ __forceinline__ void rs_fill(const void* tmap, u32 stages, RBars bars, u32 c, u32 r0) {
    constexpr int BIG = N / 128, SMALL = (N % 128 + R_BOX_ROWS - 1) / R_BOX_ROWS;
    static_assert(BIG * 128 + SMALL * R_BOX_ROWS <= R_BN, "the boxes fit a stage");
    const void* tmap_small = reinterpret_cast<const u8*>(tmap) + 128;
    u32 s = c % R_STAGES, dst = stages + s * R_STAGE_BYTES;
    mbar_arrive_expect_tx(bars.full(s), 2 * (BIG * 128 + SMALL * R_BOX_ROWS) * 128);
#pragma unroll
    for (int h = 0; h < 2; h++) {
        int k = (int)(c * R_BK + 64 * h);
        u32 half = dst + h * R_HALF_BYTES;
#pragma unroll
        for (int b = 0; b < BIG; b++) tma_load_2d(half + b * 128 * 128, tmap, k, (int)(r0 + b * 128), bars.full(s));
#pragma unroll
        for (int b = 0; b < SMALL; b++)
            tma_load_2d(half + BIG * 128 * 128 + b * R_BOX_BYTES, tmap_small, k, (int)(r0 + BIG * 128 + b * R_BOX_ROWS),
                        bars.full(s));
    }
}

// The 8 k16 steps of chunk c on lane data `st`. Step s takes word s / 2 of rows g and g + 8,
// pairs 2 (s % 2) and 2 (s % 2) + 1 (A fragment: a0 row g, a1 row g + 8 at columns 2 t, 2 t + 1;
// a2, a3 the same rows at 2 t + 8, 2 t + 9), scaled by the block of K 32 t + 8 (s / 2):
// block 2 t for s < 4, 2 t + 1 after. In chunk c > 0 every warp releases the previous chunk's
// stage once its MMAs are complete (after step RS_INFLIGHT - 1), and thread 0 refills it at
// step 4 with chunk c - 1 + R_STAGES.
template <int N>
__device__ __forceinline__ void rs_chunk(const RChunk& st, u32 c, u32 nk, u32 stages, RBars bars,
                                         const void* tmap, u32 r0, float (&acc)[2][N / 2]) {
    // tiles wider than 128 tokens keep one group in flight: their accumulators leave no room
    // for another set of A fragments
    constexpr int INFLIGHT = N > 128 ? 1 : RS_INFLIGHT;
    u32 tid = threadIdx.x, slot = c % R_STAGES;
    // the scales as operand pairs, broadcast: [m-block][row g / g+8][block 2t / 2t + 1]
    u32 sc[2][2][2];
#pragma unroll
    for (int b = 0; b < 2; b++) {
#if RS_F16
#pragma unroll
        for (int r = 0; r < 2; r++) {
            u32 f = e4m3x2_to_f16x2(st.s[b][r]);
            sc[b][r][0] = __byte_perm(f, f, 0x1010u);
            sc[b][r][1] = __byte_perm(f, f, 0x3232u);
        }
#else
        // BF16 times 2^117 (e4m3x2_scaled)
        u32 both = st.s[b][0] | (st.s[b][1] << 16);
        u32 lo = e4m3x2_scaled(__byte_perm(both, 0u, 0x4240u));
        u32 hi = e4m3x2_scaled(__byte_perm(both, 0u, 0x4341u));
        sc[b][0][0] = __byte_perm(lo, lo, 0x1010u);
        sc[b][1][0] = __byte_perm(lo, lo, 0x3232u);
        sc[b][0][1] = __byte_perm(hi, hi, 0x1010u);
        sc[b][1][1] = __byte_perm(hi, hi, 0x3232u);
#endif
    }
    mbar_wait(bars.full(slot), (c / R_STAGES) & 1u);
    u32 sb = stages + slot * R_STAGE_BYTES;
    __syncwarp();  // every lane left the wait's spin loop: the MMAs below are `.aligned`
#pragma unroll
    for (int s = 0; s < 8; s++) {
        int q = s / 2, h = s % 2, blk = s / 4;
        u32 a[2][4];
#pragma unroll
        for (int b = 0; b < 2; b++) {
            u32 wg = rs_word(st.w[b][0], q), w8 = rs_word(st.w[b][1], q);
#if RS_F16
            u32 glo, ghi, elo, ehi;  // the same for both steps of a word: computed once
            nib_bytes(wg, glo, ghi);
            nib_bytes(w8, elo, ehi);
            a[b][0] = mul_f16x2(nib_pair_from_bytes(glo, ghi, 2 * h), sc[b][0][blk]);
            a[b][1] = mul_f16x2(nib_pair_from_bytes(elo, ehi, 2 * h), sc[b][1][blk]);
            a[b][2] = mul_f16x2(nib_pair_from_bytes(glo, ghi, 2 * h + 1), sc[b][0][blk]);
            a[b][3] = mul_f16x2(nib_pair_from_bytes(elo, ehi, 2 * h + 1), sc[b][1][blk]);
            if (RS_DIAG & 8) {  // time split: no scale multiply
                a[b][0] = nib_pair_from_bytes(glo, ghi, 2 * h);
                a[b][1] = nib_pair_from_bytes(elo, ehi, 2 * h);
                a[b][2] = nib_pair_from_bytes(glo, ghi, 2 * h + 1);
                a[b][3] = nib_pair_from_bytes(elo, ehi, 2 * h + 1);
            }
            if (RS_DIAG & 16) {  // time split: nib_bytes' words as the operands (no byte
                // permutes, no scale multiply: 6 instructions a word pair instead of 14; the
                // words themselves, or masked, made ptxas serialize the MMAs)
                a[b][0] = glo;
                a[b][1] = elo;
                a[b][2] = ghi;
                a[b][3] = ehi;
            }
#else
            const u32 neg0 = 0x80008000u;
            a[b][0] = bf16x2_fma(rs_pair(wg, 2 * h), sc[b][0][blk], neg0);
            a[b][1] = bf16x2_fma(rs_pair(w8, 2 * h), sc[b][1][blk], neg0);
            a[b][2] = bf16x2_fma(rs_pair(wg, 2 * h + 1), sc[b][0][blk], neg0);
            a[b][3] = bf16x2_fma(rs_pair(w8, 2 * h + 1), sc[b][1][blk], neg0);
#endif
        }
        u64 db = smem_desc(sb + (s / 4) * R_HALF_BYTES) + 2 * (s % 4);
        wgmma_fence();
        RsMma<N>::mma(acc[0], a[0], db);
        RsMma<N>::mma(acc[1], a[1], db);
        wgmma_commit();
        wgmma_wait<INFLIGHT>();
        // the groups still in flight are this chunk's: the previous chunk's stage is free
        if (s == INFLIGHT - 1)
            mbar_arrive_if(bars.empty((c + R_STAGES - 1) % R_STAGES), c > 0 && (tid & 31u) == 0);
        if (s == 4 && tid == 0 && c > 0 && c - 1 + R_STAGES < nk) {
            u32 prev = (c - 1) % R_STAGES;
            mbar_wait(bars.empty(prev), ((c - 1) / R_STAGES) & 1u);
            rs_fill<N>(tmap, stages, bars, c - 1 + R_STAGES, r0);
        }
        // Thread 0 reconverges with its warp before the next warpgroup MMA (`.aligned`: every
        // lane of the warp must issue it together). ptxas left this implicit in session 16's
        // b2f8762 build (a BSSY / BSYNC pair opened before the chunk's MMAs), and there the
        // down GEMM hung: cuda-gdb found thread 0's warp, all lanes active, waiting at the
        // HGMMA after its refill while the other seven warps sat at the loop's final barrier
        // (s17a). With this __syncwarp (a WARPSYNC) the same build ran; kernels_compile
        // checks the SASS for it.
        __syncwarp();
    }
}

// The K loop of one tile: acc[b] holds m-block b's 64 weight rows x N tokens (times 2^-18),
// acc[b][j * 4 + q] at row warp * 16 + g + 8 (q / 2), token j * 8 + 2 t + q % 2. Ends with
// every MMA complete and every warp past the loop (the stages may then be reused).
template <int N, int L2_AHEAD>
__device__ __forceinline__ void rs_mainloop(const RWeights& wr, const void* tmap, u32 r0, u32 nk, u8* base,
                                            float (&acc)[2][N / 2]) {
    u32 tid = threadIdx.x;
    u32 stages = smem_addr(base);
    RBars bars{stages + R_OFF_BARS};
    RChunk st[2];
    rs_load(wr, 0, st[0]);
    if (nk > 1) rs_load(wr, 1, st[1]);
    // thread 0 sets the ring up and starts the first copies; the barrier publishes the ring
    if (tid == 0) {
        for (u32 s = 0; s < R_STAGES; s++) {
            mbar_init(bars.full(s), 1);
            mbar_init(bars.empty(s), R_THREADS / 32);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        for (u32 c = 0; c < R_STAGES && c < nk; c++) rs_fill<N>(tmap, stages, bars, c, r0);
    }
    __syncthreads();
#pragma unroll
    for (int b = 0; b < 2; b++)
#pragma unroll
        for (int i = 0; i < N / 2; i++) acc[b][i] = 0.0f;
    if (L2_AHEAD > 2)
        for (u32 c = 2; c < L2_AHEAD && c < nk; c++) rs_prefetch_l2(wr, c);
    for (u32 c = 0; c < nk; c += 2) {
        if (L2_AHEAD > 2 && c + L2_AHEAD < nk) rs_prefetch_l2(wr, c + L2_AHEAD);
        rs_chunk<N>(st[0], c, nk, stages, bars, tmap, r0, acc);
        if (c + 2 < nk) rs_load(wr, c + 2, st[0]);
        if (c + 1 < nk) {
            if (L2_AHEAD > 2 && c + 1 + L2_AHEAD < nk) rs_prefetch_l2(wr, c + 1 + L2_AHEAD);
            rs_chunk<N>(st[1], c + 1, nk, stages, bars, tmap, r0, acc);
            if (c + 3 < nk) rs_load(wr, c + 3, st[1]);
        }
    }
    wgmma_wait<0>();
    rs_acc_fence<N>(acc);
    // rs_scalars' copies (their threads' own), published by the barrier
    asm volatile("cp.async.wait_all;" ::: "memory");
    __syncthreads();
}

// The two tensor maps at `pair` (boxes of 128 rows, then of 32) into the TMA unit's cache.
__device__ __forceinline__ void prefetch_map_pair(const void* pair) {
    asm volatile("prefetch.tensormap [%0];" ::"l"(pair) : "memory");
    asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<const u8*>(pair) + 128) : "memory");
}

// What a register-A CTA (one an SM) waits for before its first MMA and after its last, with the
// tensor cores idle, takes fewer round trips to memory than it did (s29a, s29b: the 4096-token
// layer 0.02-0.06 ms faster, its down stage 0.01-0.04, its gate/up 0.02-0.04): its row tile
// comes from moe_offsets' table in one load (load_row_tile; find_row_tile's search waits on
// four), thread 0 fetches the tile's two tensor maps as soon as it knows them, and the expert's
// scalars come by rs_scalars. rs_row_tile: the first two; false past the real tiles.
// The tensor maps: with map_stride 0 the two at `tmap` (the whole token matrix); with 256,
// expert e's two at tmap + 256 e (kernels/moe.cu rs_expert_maps: their row count ends at the expert's last
// row, so that a tile's rows past its expert arrive as zeros), acquired here as the CUDA
// programming guide asks of tensor maps that another kernel wrote.
__device__ __forceinline__ bool rs_row_tile(const void*& tmap, u32 map_stride, const uint4* __restrict__ wide_tiles,
                                            u32& e, u32& r0, u32& r1) {
    if (threadIdx.x == 0 && map_stride == 0) prefetch_map_pair(tmap);
    if (!load_row_tile(wide_tiles, blockIdx.y, e, r0, r1)) return false;
    if (map_stride != 0) {
        tmap = reinterpret_cast<const u8*>(tmap) + (size_t)e * map_stride;
        if (threadIdx.x == 0) {
            asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;" ::"l"(tmap) : "memory");
            asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;" ::"l"(
                             reinterpret_cast<const u8*>(tmap) + 128)
                         : "memory");
            prefetch_map_pair(tmap);
        }
    }
    return true;
}

// The expert's scalars src[i] (null: none) into shared memory at base + R_OFF_SCALARS by
// cp.async from threads 32 .. 35, so that the epilogue finds them there after the K loop
// (rs_mainloop waits for the copies and publishes them) instead of loading them then with the
// tensor cores idle. Returns where they land.
__device__ __forceinline__ const float* rs_scalars(u8* base, const float* s0, const float* s1, const float* s2,
                                                   const float* s3) {
    const u32 i = threadIdx.x - 32;
    const float* src = i == 0 ? s0 : i == 1 ? s1 : i == 2 ? s2 : s3;
    if (i < 4 && src != nullptr)
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(smem_addr(base + R_OFF_SCALARS) + 4 * i),
                     "l"(src)
                     : "memory");
    return reinterpret_cast<const float*>(base + R_OFF_SCALARS);
}

// Lane's weights: m-block b of the warp starts at row row0[b] of the [E * nout] matrix (wq,
// ws[b]); rows past nout (within the expert) are left out (zeros).
__device__ __forceinline__ RWeights rs_weights(const u8* const (&wq)[2], const u8* const (&ws)[2],
                                               const u32 (&row0)[2], u32 e, u32 nout, u32 K) {
    RWeights r;
    u32 lane = threadIdx.x % 32;
#pragma unroll
    for (int b = 0; b < 2; b++) {
        bool live = row0[b] < nout;
        size_t row = (size_t)e * nout + row0[b];
        r.q[b] = live ? wq[b] + row * (K / 2) + 16 * lane : nullptr;
        r.s[b] = live ? ws[b] + row * (K / 16) + 2 * lane : nullptr;
    }
    return r;
}

// One tile's K loop at the narrowest width N (160, 144, 128, 96, 64, 48 or 32 tokens) that
// holds its ntok tokens, then epi(acc) with the accumulators as rs_mainloop leaves them. The
// widths past 128 serve the wide last tiles: at 4096 tokens an expert gets 128 +- 11 rows; 96
// and 48 (RS_N96, RS_N48) the narrow ones of a router's uneven load.
template <int L2_AHEAD, bool N144, typename Epi>
__device__ __forceinline__ void rs_tile(const RWeights& wr, const void* tmap, u32 r0, u32 ntok, u32 nk, u8* base,
                                        Epi epi) {
    constexpr int L2_NARROW = RS_L2_AHEAD_NARROW < 0 ? L2_AHEAD : RS_L2_AHEAD_NARROW;
    if (ntok > (N144 ? 144u : 128u)) {
        float acc[2][80];
        rs_mainloop<160, L2_AHEAD>(wr, tmap, r0, nk, base, acc);
        epi(acc);
    } else if (N144 && ntok > 128) {
        float acc[2][72];
        rs_mainloop<144, L2_AHEAD>(wr, tmap, r0, nk, base, acc);
        epi(acc);
    } else if (ntok > (RS_N96 ? 96u : 64u)) {
        float acc[2][64];
        rs_mainloop<128, L2_AHEAD>(wr, tmap, r0, nk, base, acc);
        epi(acc);
    } else if (RS_N96 && ntok > 64) {
        float acc[2][48];
        rs_mainloop<96, L2_AHEAD>(wr, tmap, r0, nk, base, acc);
        epi(acc);
    } else if (ntok > (RS_N48 ? 48u : 32u)) {
        float acc[2][32];
        rs_mainloop<64, L2_NARROW>(wr, tmap, r0, nk, base, acc);
        epi(acc);
    } else if (RS_N48 && ntok > 32) {
        float acc[2][24];
        rs_mainloop<48, L2_NARROW>(wr, tmap, r0, nk, base, acc);
        epi(acc);
    } else {
        float acc[2][16];
        rs_mainloop<32, L2_NARROW>(wr, tmap, r0, nk, base, acc);
        epi(acc);
    }
}

#endif  // NVFP4DBG_WGMMA

#if NVFP4DBG_WGMMA
// A 4-byte global store where `pred` holds, predicated inside the asm (no branch).
__device__ __forceinline__ void st_global_b32_if(void* p, u32 v, bool pred) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.u32 p, %2, 0;\n@p st.global.b32 [%0], %1;\n}\n" ::"l"(p), "r"(v),
                 "r"((u32)pred)
                 : "memory");
}

// The down projection's stores: out[token, row] = bf16(f32(acc) * RS_UNSCALE * alpha) for the
// tile's tokens and the rows below nout; m-block 0 holds rows n0 .., m-block 1 rows n0 + 64 ...
// A thread holds rows g (+ 8, 64, 72) of tokens 2 t and 2 t + 1 (+ 8 j); lanes g and g ^ 1
// trade one value of each such pair, so that the even lane holds rows g, g + 1 of token 2 t and
// the odd lane rows g - 1, g of token 2 t + 1: one 4-byte store of two BF16 values each (16-byte
// runs of 8 rows per store phase; nout is even, a multiple of 16).
// One address a token row, the thread's rows at immediate offsets from it, each store
// predicated in the asm. (A plain `if` around each store made ptxas branch around every one and
// compute each address whole, ~14 instructions a value; s22f, 3 alternating rounds, with
// rs_stage_gate_up's the same way against its branches: the layer at 4096 tokens 7.61-7.64 ms against 7.80-7.88
// (graph), its down stage 2.08-2.10 against 2.23-2.24, its gate/up 4.21 against 4.27. That code,
// RS_LEAN_EPI=0, is in commit d2d997d.) The FP32 rows, one 4-byte store a value, are in commit
// 42bb1f3; against them (s62a, H100) the combine ran 0.14 ms faster, this store phase no faster.
template <int HALF_N>
__device__ __forceinline__ void rs_store_rows(const float (&acc)[2][HALF_N], u32 n0, u32 r0, u32 r1, u32 nout,
                                              float alpha, u16* __restrict__ out) {
    constexpr int N = 2 * HALF_N;
    u32 lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, odd = g & 1;
    bool live[2][2];
#pragma unroll
    for (int b = 0; b < 2; b++)
#pragma unroll
        for (int qh = 0; qh < 2; qh++) live[b][qh] = n0 + g + 64 * b + 8 * qh < nout;
    const int left = (int)(r1 - r0) - (int)(2 * t + odd);  // tokens of the tile from the thread's
    u16* base = out + (size_t)(r0 + 2 * t + odd) * nout + n0 + (g - odd);
#pragma unroll
    for (int j = 0; j < N / 8; j++) {
        u16* p = base + (size_t)(8 * j) * nout;
        bool tv = 8 * j < left;
#pragma unroll
        for (int b = 0; b < 2; b++)
#pragma unroll
            for (int qh = 0; qh < 2; qh++) {
                float v0 = __fmul_rn(__fmul_rn(acc[b][j * 4 + 2 * qh], RS_UNSCALE), alpha);
                float v1 = __fmul_rn(__fmul_rn(acc[b][j * 4 + 2 * qh + 1], RS_UNSCALE), alpha);
                float recv = __shfl_xor_sync(0xffffffffu, odd ? v0 : v1, 4);
                st_global_b32_if(p + 64 * b + 8 * qh, odd ? bf16x2_rn(recv, v1) : bf16x2_rn(v0, recv),
                                 tv && live[b][qh]);
            }
    }
}

// The gate/up epilogue: where output c's g lies in a row of the tile (its u is R_GU_BN on).
// The 4-float pieces of each 16-output group are permuted by the group's index / 2, so that the
// 8 lanes of a 16-byte load phase (8 groups of one row, RsGateUpA::quant16) hit 32 banks.
__device__ __forceinline__ u32 rs_gu_col(u32 c) {
    return (c & ~15u) | (((c >> 2) & 3u) ^ ((c >> 5) & 3u)) << 2 | (c & 3u);
}

// The gate/up tile's g and u (times 2^28 * alpha) into `sgu`, every token row of the tile
// (rows past its tokens included: gate_up_tile_epilogue_of never reads past r1), each store at
// an immediate offset from one address, no branch: m-block 0 holds g, m-block 1 u of the
// warp's outputs col0 .. col0 + 15.
template <int HALF_N>
__device__ __forceinline__ void rs_stage_gate_up(const float (&acc)[2][HALF_N], u32 col0, float alpha_g,
                                                 float alpha_u, float* sgu) {
    constexpr int N = 2 * HALF_N;
    u32 lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    float* base = sgu + 2 * t * R_EPI_ROW;
    const u32 lc[2] = {rs_gu_col(col0 + g), rs_gu_col(col0 + g + 8)};
#pragma unroll
    for (int j = 0; j < N / 8; j++)
#pragma unroll
        for (int q = 0; q < 4; q++) {
            float* p = base + (j * 8 + (q % 2)) * R_EPI_ROW + lc[q / 2];
            p[0] = __fmul_rn(__fmul_rn(acc[0][j * 4 + q], RS_UNSCALE), alpha_g);
            p[R_GU_BN] = __fmul_rn(__fmul_rn(acc[1][j * 4 + q], RS_UNSCALE), alpha_u);
        }
}

// a = swiglu(g, u) of the staged tile `sgu` (gate_up_tile_epilogue_of's reader): one value,
// or the NVFP4 block of 16 of a row, from 16-byte loads.
struct RsGateUpA {
    const float* sgu;
    float limit;
    u32 has_limit;
    __device__ __forceinline__ float act(float g, float u) const {
        return (RS_DIAG & 1) ? __fmul_rn(g, u) : swiglu(g, u, limit, has_limit);
    }
    __device__ __forceinline__ float operator()(u32 r, u32 c) const {
        const float* p = sgu + r * R_EPI_ROW + rs_gu_col(c);
        return act(p[0], p[R_GU_BN]);
    }
    __device__ __forceinline__ u32 quant16(u32 r, u32 c0, float gs, float rgs, u32 flavor, u32 (&packed)[2],
                                           bool& nonzero) const {
        float g[16], u[16], v[16];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const float* p = sgu + r * R_EPI_ROW + rs_gu_col(c0 + 4 * i);
            float4 g4 = *reinterpret_cast<const float4*>(p), u4 = *reinterpret_cast<const float4*>(p + R_GU_BN);
            g[4 * i] = g4.x, g[4 * i + 1] = g4.y, g[4 * i + 2] = g4.z, g[4 * i + 3] = g4.w;
            u[4 * i] = u4.x, u[4 * i + 1] = u4.y, u[4 * i + 2] = u4.z, u[4 * i + 3] = u4.w;
        }
        if (RS_SWIGLU_NVFP4 && !(RS_DIAG & 1))
            return swiglu_nvfp4_16(g, u, limit, has_limit, gs, rgs, flavor, packed, nonzero);
        if (RS_SWIGLU16 && !(RS_DIAG & 1)) {
            swiglu16(g, u, limit, has_limit, v);
        } else {
#pragma unroll
            for (int i = 0; i < 16; i++) v[i] = act(g[i], u[i]);
        }
        return quant_block_nvfp4_nz(v, gs, rgs, flavor, packed, nonzero);
    }
};

#endif  // NVFP4DBG_WGMMA

// The expert inputs for the register-A kernels: out[r, .] = row r of the NVFP4 rows (aq, as; K
// a multiple of 128) dequantized exactly to 16 bits in the K order of the kernels' A fragments
// (rs_unit_words; the down GEMM's rows where the gate/up epilogue did not write them: dynamic
// gs2, NVFP4DBG_DOWN_ROWS=prepass; the gate/up's where the prologue did not make them with
// nvfp4_rows_scatter_*, kernels/quant.cu). One thread per 32 codes (unit), four per chunk: a
// thread's 16 words lie 4 words apart, so they go through the warp's shared-memory slice to
// the warp's 8 whole chunks (units per row K / 32 are a multiple of 4, so chunk g of the
// output is units 4 g .. 4 g + 3, contiguous: out + 128 g), written 512 bytes per store. Chunk
// cl of the slice has a pitch of 68 words, so a store phase of the 32 lanes (word 8 s + 4 b + t
// of chunk lane / 4) hits 32 banks and each 8-lane phase of the 16-byte reads 128 contiguous
// bytes. Launched with ROWS_RS_THREADS threads. (Each thread storing its own 16 words measured
// 0.333 ms at 4096 DeepSeek-V3 tokens, 470 MB written: 1.4 TB/s, session 18.)
#define ROWS_RS_THREADS 256
#define ROWS_RS_PITCH 68
extern "C" __global__ void __launch_bounds__(ROWS_RS_THREADS)
moe_rows_bf16_rs(const u8* __restrict__ aq, const u8* __restrict__ as, u32 K, u32 rows, u16* __restrict__ out) {
#if NVFP4DBG_WGMMA
    __shared__ __align__(16) u32 slice[ROWS_RS_THREADS / 32][8 * ROWS_RS_PITCH];
    const u32 units = K / 32, lane = threadIdx.x % 32;
    const u64 total = (u64)rows * units;
    const u64 idx = (u64)blockIdx.x * ROWS_RS_THREADS + threadIdx.x;
    u32* sl_w = slice[threadIdx.x / 32];
    if (idx < total) {
        u64 r = idx / units;
        u32 u = (u32)(idx - r * units), t = u % 4;
        uint4 q4 = *reinterpret_cast<const uint4*>(aq + r * (K / 2) + u * 16);
        u32 sc = *reinterpret_cast<const unsigned short*>(as + r * (K / 16) + u * 2);
        rs_unit_words(q4, sc, t, sl_w + (lane / 4) * ROWS_RS_PITCH);
    }
    __syncwarp();
    const u64 chunk0 = (idx - lane) / 4, chunks = total / 4;
    uint4* dst = reinterpret_cast<uint4*>(out) + chunk0 * 16;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        u32 v = 32 * i + lane, cl = v / 16;
        if (chunk0 + cl < chunks) dst[v] = *reinterpret_cast<const uint4*>(sl_w + cl * ROWS_RS_PITCH + (v % 16) * 4);
    }
#else
    __trap();
#endif
}

// Down projection, as moe_gemm_nvfp4_sm90 with the tokens given as the tensor maps `tmap` (rs_fill) of
// moe_rows_bf16_rs's output (one pair, or expert e's at tmap + map_stride e: rs_row_tile) and the
// weights in decode tiles (wq_t, ws_t). Grid:
// (ceil(nout / R_DOWN_BN), M-tile bound), R_THREADS threads, R_SMEM_BYTES of dynamic shared memory.
extern "C" __global__ void __launch_bounds__(R_THREADS, 3 - RS_WG)
moe_gemm_nvfp4_sm90rs(const void* __restrict__ tmap, u32 map_stride, u32 K, const u8* __restrict__ wq_t,
                      const u8* __restrict__ ws_t, u32 nout, const float* __restrict__ gs, const float* __restrict__ ws2,
                      const uint4* __restrict__ wide_tiles, u16* __restrict__ out) {
#if NVFP4DBG_WGMMA
    u32 e, r0, r1;
    const void* map = tmap;  // rs_row_tile: the tile's own with a map_stride
    if (!rs_row_tile(map, map_stride, wide_tiles, e, r0, r1)) return;
    u8* base = h_smem_base();
    const float* sc = rs_scalars(base, gs + e, ws2 + e, nullptr, nullptr);
    u32 wg = threadIdx.x / 128, warp = (threadIdx.x % 128) / 32;
    u32 n0 = blockIdx.x * R_DOWN_BN + wg * 128 + warp * 16;
    const u32 row0[2] = {n0, n0 + 64};
    const u8* const wq[2] = {wq_t, wq_t};
    const u8* const ws[2] = {ws_t, ws_t};
    RWeights wr = rs_weights(wq, ws, row0, e, nout, K);
    // alpha is computed after the K loop (one register less across it), from rs_scalars' copies
    rs_tile<RS_L2_AHEAD_DOWN, RS_N144_DOWN>(wr, map, r0, r1 - r0, K / R_BK, base, [&](const auto& acc) {
        float alpha = __fmul_rn(rcp_ref(sc[0]), sc[1]);
        // RS_DIAG 4: stores only where alpha is NaN (never in a bench), so the MMAs stay live
        if (!(RS_DIAG & 4) || alpha != alpha) rs_store_rows(acc, n0, r0, r1, nout, alpha, out);
    });
#else
    __trap();
#endif
}

// Gate/up with SwiGLU fused, as moe_gemm_gate_up_nvfp4_sm90 with the tokens given as `tmap`
// and `map_stride` (as the down's) and the weights in decode tiles: warpgroup w takes outputs
// n0 + 64 w .. + 63, m-block 0 from w1, m-block 1 from w3. Grid: (ceil(nout / R_GU_BN), M-tile
// bound), R_THREADS threads, R_SMEM_BYTES.
// With a fixed gs2 and `down_rows` not null, the epilogue also writes the down GEMM's 16-bit
// token rows (what moe_rows_bf16_rs makes of outq and outs; those may then be null).
extern "C" __global__ void __launch_bounds__(R_THREADS, 3 - RS_WG)
moe_gemm_gate_up_nvfp4_sm90rs(const void* __restrict__ tmap, u32 map_stride, u32 K,
                              const u8* __restrict__ w1q_t, const u8* __restrict__ w1s_t, const u8* __restrict__ w3q_t,
                              const u8* __restrict__ w3s_t, u32 nout, const float* __restrict__ gs1,
                              const float* __restrict__ ws2_1, const float* __restrict__ ws2_3, float limit,
                              u32 has_limit, const uint4* __restrict__ wide_tiles,
                              const float* __restrict__ gs2, u32 flavor, u8* __restrict__ outq,
                              u8* __restrict__ outs, u64* __restrict__ stats, float* __restrict__ out_f32,
                              u32* __restrict__ amax_bits, u32* __restrict__ down_rows) {
#if NVFP4DBG_WGMMA
    u32 e, r0, r1;
    const void* map = tmap;  // rs_row_tile: the tile's own with a map_stride
    if (!rs_row_tile(map, map_stride, wide_tiles, e, r0, r1)) return;
    u8* base = h_smem_base();
    const float* sc = rs_scalars(base, gs1 + e, ws2_1 + e, ws2_3 + e, gs2 ? gs2 + e : nullptr);
    u32 wg = threadIdx.x / 128, warp = (threadIdx.x % 128) / 32;
    u32 n0 = blockIdx.x * R_GU_BN, col0 = wg * 64 + warp * 16;
    const u32 row0[2] = {n0 + col0, n0 + col0};
    const u8* const wq[2] = {w1q_t, w3q_t};
    const u8* const ws[2] = {w1s_t, w3s_t};
    RWeights wr = rs_weights(wq, ws, row0, e, nout, K);
    float* sgu = reinterpret_cast<float*>(base);
    // the alphas are computed after the K loop (fewer registers across it), from rs_scalars' copies
    rs_tile<RS_L2_AHEAD_GATE_UP, RS_N144_GATE_UP>(wr, map, r0, r1 - r0, K / R_BK, base, [&](const auto& acc) {
        float g_in = rcp_ref(sc[0]);
        rs_stage_gate_up(acc, col0, __fmul_rn(g_in, sc[1]), __fmul_rn(g_in, sc[2]), sgu);
    });
    __syncthreads();
    if (RS_DIAG & 2) return;
    const float* gs2e = gs2 == nullptr ? nullptr : sc + 3;
    gate_up_tile_epilogue_of<R_BN, R_GU_BN, R_THREADS, true>(RsGateUpA{sgu, limit, has_limit}, r0, r1, n0, nout, e,
                                                                gs2e, flavor, outq, outs, stats, out_f32, amax_bits,
                                                                down_rows);
#else
    __trap();
#endif
}
