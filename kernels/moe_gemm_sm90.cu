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
// + 1024 to align the base: 154624 bytes, the launch's dynamic shared memory (moe.rs)
#define H_SMEM_BYTES (H_OFF_RAW + H_STAGES * H_RAW_BYTES + 1024)
// the fused epilogue's f32 tile of `a` (rows of H_FUSED_BN + 4) reuses the BF16 buffers
#define H_SA_F32_ROW (H_FUSED_BN + 4)
static_assert(H_BM * H_SA_F32_ROW * 4 <= H_OFF_RAW, "the f32 tile of a must fit the operand buffers");

#if NVFP4DBG_WGMMA

__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }

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

__device__ __forceinline__ u32 bf16x2_fma(u32 a, u32 b, u32 c) {
    u32 d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// Eight E2M1 codes (one word, element 2i in the low nibble of byte i) times their block
// scale (a BF16 pair), as 8 BF16 values in the order n0 n4 n1 n5 n2 n6 n3 n7: A and W use
// the same order, so the dot product is the same sum. Placing a code's 3 magnitude bits at
// BF16 bits 6-8 gives e2m1 * 2^-126 exactly (the codes 0 and 0.5 become zero and the
// subnormal 2^-127); times 2^126 is exact, and so is times the scale. The -0 addend keeps
// the sign of a zero product, as kernels/moe.cu does.
__device__ __forceinline__ uint4 dequant8(u32 q, u32 s2) {
    const u32 two126 = 0x7E807E80u, neg0 = 0x80008000u;
    u32 v = q & 0x77777777u, g = q & 0x88888888u;
    u32 w[4];
#pragma unroll
    for (int j = 0; j < 4; j++) {
        u32 bits = (((v >> (4 * j)) & 0x00070007u) << 6) | (((g >> (4 * j)) & 0x00080008u) << 12);
        w[j] = bf16x2_fma(bf16x2_fma(bits, two126, neg0), s2, neg0);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
}

__device__ __forceinline__ u32 e4m3_bf16x2(u32 code) {
    u32 h = __float_as_uint(e4m3_decode(code)) >> 16;  // exact: E4M3 values are BF16 values
    return h | (h << 16);
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

// Which expert and rows M-tile `bt` covers; false past the real tile count.
__device__ __forceinline__ bool h_find_tile(const u32* __restrict__ tile_offsets,
                                            const u32* __restrict__ expert_offsets, u32 E, u32 bt,
                                            u32& e, u32& r0, u32& r1) {
    if (bt >= tile_offsets[E]) return false;
    u32 lo = 0, hi = E;  // largest e with tile_offsets[e] <= bt
    while (hi - lo > 1) {
        u32 mid = (lo + hi) / 2;
        if (tile_offsets[mid] <= bt) lo = mid; else hi = mid;
    }
    e = lo;
    r0 = expert_offsets[e] + (bt - tile_offsets[e]) * H_BM;
    u32 end = expert_offsets[e + 1];
    r1 = r0 + H_BM < end ? r0 + H_BM : end;
    return true;
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

// Raw stage of K slice kb: A and W codes (32 bytes a row) and scales (4 bytes a row).
__device__ __forceinline__ void h_load_raw(const HOps& o, u32 kb, u32 raw) {
    u32 k0 = kb * H_BK;
    size_t qrow = o.K / 2, srow = o.K / 16;
#pragma unroll
    for (u32 t = 0; t < 3; t++) {
        u32 u = threadIdx.x + t * H_THREADS;
        u32 r = u >> 1, c = u & 1u;
        if (r < H_BM) {
            if (r >= o.a_rows) continue;
            u32 row = o.r0 + r;
            bool ok = row < o.r1;
            cp_async16(raw + H_RAW_AQ + r * 32 + c * 16, ok ? o.aq + row * qrow + k0 / 2 + c * 16 : o.aq,
                       ok ? 16u : 0u);
        } else {
            u32 n = r - H_BM;
            bool m1 = n >= o.split;
            u32 wrow = o.n0 + (m1 ? n - o.split : n);
            bool ok = wrow < o.nout;
            const u8* wq = m1 ? o.wq1 : o.wq0;
            cp_async16(raw + H_RAW_BQ + n * 32 + c * 16, ok ? wq + wrow * qrow + k0 / 2 + c * 16 : o.aq,
                       ok ? 16u : 0u);
        }
    }
#pragma unroll
    for (u32 t = 0; t < 2; t++) {
        u32 r = threadIdx.x + t * H_THREADS;
        if (r >= H_BM + H_BN) break;
        if (r < H_BM) {
            if (r >= o.a_rows) continue;
            u32 row = o.r0 + r;
            bool ok = row < o.r1;
            cp_async4(raw + H_RAW_AS + r * 4, ok ? o.as + row * srow + k0 / 16 : o.as, ok ? 4u : 0u);
        } else {
            u32 n = r - H_BM;
            bool m1 = n >= o.split;
            u32 wrow = o.n0 + (m1 ? n - o.split : n);
            bool ok = wrow < o.nout;
            const u8* ws = m1 ? o.ws1 : o.ws0;
            cp_async4(raw + H_RAW_BS + n * 4, ok ? ws + wrow * srow + k0 / 16 : o.as, ok ? 4u : 0u);
        }
    }
}

// Raw stage -> BF16 operand buffers. Thread unit: one row's 32 codes (two scale blocks) ->
// four 16-byte chunks; chunk kc of row r goes to chunk kc ^ (r % 8) (the 128-byte swizzle).
// A warp's 8-lane store phases hit 8 distinct chunks: no bank conflicts.
__device__ __forceinline__ void h_dequant(const HOps& o, const u8* raw, u8* sA, u8* sB) {
#pragma unroll
    for (u32 t = 0; t < 3; t++) {
        u32 u = threadIdx.x + t * H_THREADS;
        u32 r = u >> 1, c = u & 1u;
        if (r < H_BM && r >= o.a_rows) continue;
        bool is_a = r < H_BM;
        u32 rr = is_a ? r : r - H_BM;
        uint4 q = *reinterpret_cast<const uint4*>(raw + (is_a ? H_RAW_AQ : H_RAW_BQ) + rr * 32 + c * 16);
        u32 sc = *reinterpret_cast<const u32*>(raw + (is_a ? H_RAW_AS : H_RAW_BS) + rr * 4);
        u32 s0 = e4m3_bf16x2((sc >> (16 * c)) & 0xFFu), s1 = e4m3_bf16x2((sc >> (16 * c + 8)) & 0xFFu);
        u8* row = (is_a ? sA : sB) + rr * 128;
        u32 sw = rr & 7u;
        u32 kc = c * 4;
        *reinterpret_cast<uint4*>(row + (((kc + 0) ^ sw) << 4)) = dequant8(q.x, s0);
        *reinterpret_cast<uint4*>(row + (((kc + 1) ^ sw) << 4)) = dequant8(q.y, s0);
        *reinterpret_cast<uint4*>(row + (((kc + 2) ^ sw) << 4)) = dequant8(q.z, s1);
        *reinterpret_cast<uint4*>(row + (((kc + 3) ^ sw) << 4)) = dequant8(q.w, s1);
    }
}

// acc[j*4 + q] of warpgroup wg holds (row, col) = (wg*64 + warp*16 + lane/4 + 8*(q/2),
// j*8 + (lane%4)*2 + q%2) of the 128 x 256 tile.
__device__ __forceinline__ void h_mainloop(const HOps& o, u8* base, float (&acc)[128]) {
    u32 wg = threadIdx.x / 128;
    u8* sA = base;
    u8* sB = base + H_OFF_SB;
    u32 raw0 = smem_addr(base + H_OFF_RAW);
#pragma unroll
    for (int i = 0; i < 128; i++) acc[i] = 0.0f;
    u32 nk = o.K / H_BK;
#pragma unroll
    for (u32 s = 0; s < H_STAGES - 1; s++) {
        if (s < nk) h_load_raw(o, s, raw0 + s * H_RAW_BYTES);
        cp_async_commit();
    }
    // a tile of <= 64 rows leaves the second warpgroup's MMAs out; the shuffle makes the
    // flag visibly warp-uniform to the compiler (else it serializes the wgmma, C7518)
    bool mma = __shfl_sync(0xFFFFFFFFu, (wg == 0 || o.a_rows > 64) ? 1 : 0, 0) != 0;
    for (u32 kb = 0; kb < nk; kb++) {
        cp_async_wait<H_STAGES - 2>();
        // raw stage kb is in; every warpgroup is past the MMAs that read buffer kb % 2 last
        __syncthreads();
        u32 nx = kb + H_STAGES - 1;
        if (nx < nk) h_load_raw(o, nx, raw0 + (nx % H_STAGES) * H_RAW_BYTES);
        cp_async_commit();
        u32 b = kb & 1u;
        h_dequant(o, base + H_OFF_RAW + (kb % H_STAGES) * H_RAW_BYTES, sA + b * H_SA_BYTES, sB + b * H_SB_BYTES);
        fence_proxy_async();
        __syncthreads();
        if (mma) {
            u64 da = smem_desc(smem_addr(sA + b * H_SA_BYTES + wg * 64 * 128));
            u64 db = smem_desc(smem_addr(sB + b * H_SB_BYTES));
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

// Down projection (and any plain grouped GEMM): out[p, n] = f32(acc) * alpha_e,
// alpha_e = rcp(gs[e]) * ws2[e]. Grid: (ceil(nout / 256), M-tile bound), 256 threads,
// H_SMEM_BYTES of dynamic shared memory.
extern "C" __global__ void __launch_bounds__(H_THREADS, 1)
moe_gemm_nvfp4_sm90(const u8* __restrict__ aq, const u8* __restrict__ as, u32 K,
                    const u8* __restrict__ wq, const u8* __restrict__ ws, u32 nout, u32 wblock,
                    const float* __restrict__ gs, const float* __restrict__ ws2,
                    const u32* __restrict__ tile_offsets, const u32* __restrict__ expert_offsets, u32 E,
                    float* __restrict__ out) {
#if NVFP4DBG_WGMMA
    u32 e, r0, r1;
    if (!h_find_tile(tile_offsets, expert_offsets, E, blockIdx.y, e, r0, r1)) return;
    u8* base = h_smem_base();
    HOps o;
    o.aq = aq; o.as = as; o.K = K; o.r0 = r0; o.r1 = r1; o.a_rows = r1 - r0 <= 64 ? 64 : H_BM;
    size_t wstride = (size_t)nout * (K / 2), sstride = (size_t)nout * (K / 16);
    o.wq0 = wq + e * wstride; o.ws0 = ws + e * sstride;
    o.wq1 = o.wq0; o.ws1 = o.ws0;
    o.nout = nout; o.n0 = blockIdx.x * H_BN; o.split = H_BN;
    float acc[128];
    h_mainloop(o, base, acc);
    float alpha = __fmul_rn(rcp_ref(gs[e]), ws2[e]);
    u32 wg = threadIdx.x / 128, warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
#pragma unroll
    for (int j = 0; j < 32; j++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            u32 row = r0 + wg * 64 + warp * 16 + lane / 4 + 8 * h;
            u32 col = o.n0 + j * 8 + (lane % 4) * 2;
            if (row >= r1) continue;
            float v0 = __fmul_rn(acc[j * 4 + 2 * h], alpha), v1 = __fmul_rn(acc[j * 4 + 2 * h + 1], alpha);
            float* dst = out + (size_t)row * nout + col;
            if (col + 1 < nout) *reinterpret_cast<float2*>(dst) = make_float2(v0, v1);
            else if (col < nout) dst[0] = v0;
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
                            u32* __restrict__ amax_bits) {
#if NVFP4DBG_WGMMA
    u32 e, r0, r1;
    if (!h_find_tile(tile_offsets, expert_offsets, E, blockIdx.y, e, r0, r1)) return;
    u8* base = h_smem_base();
    HOps o;
    o.aq = aq; o.as = as; o.K = K; o.r0 = r0; o.r1 = r1; o.a_rows = r1 - r0 <= 64 ? 64 : H_BM;
    size_t wstride = (size_t)nout * (K / 2), sstride = (size_t)nout * (K / 16);
    o.wq0 = w1q + e * wstride; o.ws0 = w1s + e * sstride;
    o.wq1 = w3q + e * wstride; o.ws1 = w3s + e * sstride;
    u32 n0 = blockIdx.x * H_FUSED_BN;
    o.nout = nout; o.n0 = n0; o.split = H_FUSED_BN;
    float acc[128];
    h_mainloop(o, base, acc);
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
                float g = __fmul_rn(acc[j * 4 + q], alpha_g);
                float u = __fmul_rn(acc[(j + 16) * 4 + q], alpha_u);
                sa[lr * SA + lc] = swiglu(g, u, limit, has_limit);
            }
    }
    __syncthreads();
    if (gs2 != nullptr) {
        // fixed gs2: quantize each (row, 16-column group) of the tile
        float gsv = gs2[e];
        u32 kb = nout / 16;
        u32 counts[4] = {0, 0, 0, 0};
        for (u32 idx = threadIdx.x; idx < H_BM * (H_FUSED_BN / 16); idx += H_THREADS) {
            u32 r = idx / (H_FUSED_BN / 16), g = idx % (H_FUSED_BN / 16);
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
        for (u32 idx = threadIdx.x; idx < H_BM * H_FUSED_BN; idx += H_THREADS) {
            u32 r = idx / H_FUSED_BN, c = idx % H_FUSED_BN;
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
#else
    __trap();
#endif
}
