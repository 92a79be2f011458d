// Shared device helpers for nvfp4dbg kernels: the exact NVFP4 / MXFP4 codecs of
// src/nvfp4 (DESIGN.md §2), written so that every float step is one IEEE f32 operation
// (the modules are compiled with --fmad=false --ftz=false --prec-div=true, and the steps
// that define the numbers use the explicit _rn intrinsics on top of that).
#pragma once

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

#define NVFP4_R6 __int_as_float(0x3E2AAAAB) /* f32(1/6), as the reference multiplies by it */
#define E4M3_MAX 448.0f
#define E4M3_MAX_CODE 0x7E
#define E4M3_NAN 0x7F
#define UE8M0_NAN 0xFF
#define NONE_IDX 0xFFFFFFFFFFFFFFFFull

// Blackwell's family-specific targets (sm_100a, ...) have the FP4 conversion instruction;
// the same gate as cuda_fp8.h's __CUDA_FP8_INTERNAL_CAN_RELY_ON_PTX_FOR_SHORTTYPESCVT__.
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 1000) && defined(__CUDA_ARCH_FAMILY_SPECIFIC__)
#define NVFP4DBG_HW_E2M1 1
#else
#define NVFP4DBG_HW_E2M1 0
#endif

__device__ __forceinline__ float f32_nan() { return __int_as_float(0x7fffffff); }

// rcp(v) = 1/v with rcp(0) = 0, IEEE division (the reference's get_reciprocal).
__device__ __forceinline__ float rcp_ref(float v) { return v == 0.0f ? 0.0f : __fdiv_rn(1.0f, v); }

__device__ __forceinline__ float rcp_approx_ftz(float v) {
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(v));
    return r;
}

// NaN-propagating min(v, hi) (torch.clamp; fminf would drop the NaN).
__device__ __forceinline__ float clamp_max(float v, float hi) { return v > hi ? hi : v; }
__device__ __forceinline__ float clamp6(float v) { return v > 6.0f ? 6.0f : (v < -6.0f ? -6.0f : v); }

// ---- E2M1 ----
// Round half to even on [0, .5, 1, 1.5, 2, 3, 4, 6]; the sign bit is the sign of x, also
// when the magnitude rounds to 0 (as PTX cvt.rn does). NaN maps to magnitude 7.
__device__ __forceinline__ u32 e2m1_encode_sw(float x) {
    float a = fabsf(x);
    u32 mag = a <= 0.25f ? 0u
            : a < 0.75f  ? 1u
            : a <= 1.25f ? 2u
            : a < 1.75f  ? 3u
            : a <= 2.5f  ? 4u
            : a < 3.5f   ? 5u
            : a <= 5.0f  ? 6u
                         : 7u;
    if (a != a) mag = 7u;
    return mag | ((__float_as_uint(x) >> 31) << 3);
}

// Two values (already clamped to [-6, 6]) to one byte, `lo` in the low nibble.
__device__ __forceinline__ u32 e2m1_pack2(float lo, float hi) {
#if NVFP4DBG_HW_E2M1
    u16 r;
    asm("{ .reg .b8 t;\n cvt.rn.satfinite.e2m1x2.f32 t, %2, %1;\n mov.b16 %0, {t, 0};\n}"
        : "=h"(r)
        : "f"(lo), "f"(hi));
    return (u32)(r & 0xFF);
#else
    return e2m1_encode_sw(lo) | (e2m1_encode_sw(hi) << 4);
#endif
}

__device__ __forceinline__ float e2m1_decode(u32 code) {
    // 0, .5, 1, 1.5, 2, 3, 4, 6 without a table: magnitude m -> value
    u32 m = code & 7u;
    // m < 4: 0.5 m; m >= 4: 2^(m/2 - 1) * (1 + (m & 1) / 2) -> 2, 3, 4, 6 (all exact)
    float v = m < 4u ? 0.5f * (float)m : (float)(1u << ((m >> 1) - 1u)) * (1.0f + 0.5f * (float)(m & 1u));
    return (code & 8u) ? -v : v;
}

// ---- E4M3 (float8_e4m3fn) ----
__device__ __forceinline__ float e4m3_decode(u32 c) {
    c &= 0xFFu;
    if ((c & 0x7Fu) == 0x7Fu) return f32_nan();
    u32 e = (c >> 3) & 0xFu, m = c & 7u;
    float v = e == 0u ? __fmul_rn((float)m, 0.001953125f) /* m * 2^-9, exact */
                      : __uint_as_float(((e + 120u) << 23) | (m << 20));
    return (c & 0x80u) ? -v : v;
}

// Round to nearest even, saturate at 448 (the reference's encode_saturating).
__device__ __forceinline__ u32 e4m3_encode_sat(float x) {
    if (x != x) return E4M3_NAN;
    u32 sign = (__float_as_uint(x) >> 31) << 7;
    float a = fabsf(x);
    float r;
    if (a < 0.015625f) {
        r = __fmul_rn(rintf(__fmul_rn(a, 512.0f)), 0.001953125f);
    } else {
        int ex = (int)((__float_as_uint(a) >> 23) & 0xFFu) - 127;  // 128 for inf
        float inv_quantum = __uint_as_float((u32)(127 - (ex - 3)) << 23);
        float quantum = __uint_as_float((u32)(ex - 3 + 127) << 23);
        r = __fmul_rn(rintf(__fmul_rn(a, inv_quantum)), quantum);
    }
    if (r > E4M3_MAX) return sign | E4M3_MAX_CODE;
    u32 code;
    if (r < 0.015625f) {
        code = (u32)__fmul_rn(r, 512.0f);
    } else {
        u32 b = __float_as_uint(r);
        int ex = (int)((b >> 23) & 0xFFu) - 127;
        code = ((u32)(ex + 7) << 3) | ((b >> 20) & 7u);
    }
    return sign | code;
}

// Hardware conversion, as vLLM / TRT-LLM kernels do (`__nv_fp8_e4m3(v)`): cvt.rn.satfinite.
__device__ __forceinline__ u32 e4m3_encode_hw(float x) {
    u16 r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.0f), "f"(x));
    return (u32)(r & 0xFF);
}

// ---- UE8M0 ----
__device__ __forceinline__ float ue8m0_decode(u32 c) {
    c &= 0xFFu;
    if (c == UE8M0_NAN) return f32_nan();
    return c == 0u ? __uint_as_float(0x00400000u) : __uint_as_float(c << 23);
}

// floor(log2 v) for finite v > 0, subnormals included.
__device__ __forceinline__ int floor_log2(float v) {
    u32 b = __float_as_uint(v);
    int e = (int)((b >> 23) & 0xFFu);
    if (e == 0) return -149 + (31 - __clz((int)(b & 0x7FFFFFu)));
    return e - 127;
}

// ---- BF16 (bit level, so no header is needed for the type) ----
__device__ __forceinline__ float bf16_to_f32(u16 h) { return __uint_as_float(((u32)h) << 16); }
__device__ __forceinline__ u16 f32_to_bf16_rn(float f) {
    u32 b = __float_as_uint(f);
    if ((b & 0x7FFFFFFFu) > 0x7F800000u) return (u16)((b >> 16) | 0x40u);  // quiet NaN
    b += 0x7FFFu + ((b >> 16) & 1u);
    return (u16)(b >> 16);
}

// The same rounding in one instruction (sm_80+; a NaN becomes the canonical 0x7FFF): the
// down GEMMs' BF16 rows. bf16x2_rn puts bf16(lo) in the low half, bf16(hi) in the high one.
__device__ __forceinline__ u16 bf16_rn(float f) {
    u16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
}
__device__ __forceinline__ u32 bf16x2_rn(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// NaN-propagating max|x| accumulation.
__device__ __forceinline__ float amax_step(float m, float x) {
    float a = fabsf(x);
    if (a != a || m != m) return f32_nan();
    return a > m ? a : m;
}

// Block statistics, in the order of src/nvfp4 BlockStats: blocks, saturated, flushed, nan.
struct BlockStats4 {
    u64 v[4];
};

// Byte offset of scale (m, k) in the 128x4 swizzled layout (src/nvfp4/layout.rs).
__device__ __forceinline__ u64 swizzle_offset(u64 m, u64 k, u64 kb) {
    u64 k_tiles = (kb + 3) / 4;
    return (m / 128 * k_tiles + k / 4) * 512 + (m % 32) * 16 + ((m / 32) % 4) * 4 + k % 4;
}

// Flavors of the NVFP4 quantizer (src/nvfp4 Flavor).
#define FLAVOR_REFERENCE 0u
#define FLAVOR_CUDA_FAST 1u

// max|x| over a block as the bits of a non-negative float: |x| bit patterns order as
// unsigned integers, NaN above infinity, so any NaN gives a NaN pattern (what amax_step
// gives, up to the NaN payload, which nothing downstream looks at).
__device__ __forceinline__ u32 amax_bits16(const float (&x)[16]) {
    u32 m = 0;
#pragma unroll
    for (int i = 0; i < 16; i++) m = max(m, __float_as_uint(x[i]) & 0x7FFFFFFFu);
    return m;
}

// The E2M1 magnitude code of min(|v|, 6) for v not NaN, shifted left by 22 (the other bits 0).
// With a = min(|v|, 6) and the step of its binade q = 2^(max(e, 0) - 1), (a + q 2^23) - q 2^23
// is a rounded to a multiple of q, half to even (IEEE add, then an exact subtract); times
// 2^-126 that value's f32 bits are the E2M1 encoding moved up by 22: the binades line up
// (E2M1's 1.0 is f32's smallest normal there, 0.5 its subnormal 2^-127). Floating-point work
// where the previous encoder used integer ops (29% fewer integer-pipe instructions; measured
// within noise on the quantizer, which is not integer-bound after all: BENCHMARKS.md).
__device__ __forceinline__ u32 e2m1_mag_bits(float v) {
    float a = fminf(fabsf(v), 6.0f);
    u32 eb = max(__float_as_uint(a) & 0x7F800000u, 0x3F800000u);
    float m = __uint_as_float(eb + 0x0B000000u);
    float r = __fsub_rn(__fadd_rn(a, m), m);
    return __float_as_uint(__fmul_rn(r, 0x1p-126f));
}

__device__ __forceinline__ u32 mad_hi(u32 a, u32 b, u32 c) {
    u32 d;
    asm("mad.hi.u32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// The sign bits of 8 codes (bit 3 of nibble i) from the f32 bit patterns p[0..7]: each sign
// taken from its top byte by byte permutes.
__device__ __forceinline__ u32 e2m1_signs(const u32* p) {
    // sign of p[2k] at bit 8k + 7 of `even`, wanted at 8k + 3; of p[2k + 1] at 8k + 7 of `odd`
    u32 even = __byte_perm(__byte_perm(p[0], p[2], 0x0073), __byte_perm(p[4], p[6], 0x0073), 0x5410);
    u32 odd = __byte_perm(__byte_perm(p[1], p[3], 0x0073), __byte_perm(p[5], p[7], 0x0073), 0x5410);
    u32 signs = ((even >> 4) & 0x0F0F0F0Fu) | (odd & 0xF0F0F0F0u);
    return signs & 0x88888888u;
}

// The E2M1 codes of 8 products p[i] = x[i] * scale, none NaN, as one word (value i in nibble
// i): e2m1_encode_sw(clamp6(p[i])) each. The codes are put in place by shift-adds (the
// nibbles never overlap), the 8 signs gathered from the products' top bytes by byte permutes.
// Checked exhaustively (magnitudes) and on random words by tools/checks/e2m1_word_fast.c.
__device__ __forceinline__ u32 e2m1_word_fast(const float* x, float scale) {
    u32 p[8];
#pragma unroll
    for (int i = 0; i < 8; i++) p[i] = __float_as_uint(__fmul_rn(x[i], scale));
    u32 mag = 0;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        u32 c = e2m1_mag_bits(__uint_as_float(p[i]));
        mag = i <= 5 ? mad_hi(c, 1u << (10 + 4 * i), mag) : c * (1u << (4 * i - 22)) + mag;
    }
    return mag | e2m1_signs(p);
}

// One NVFP4 block of 16 values with quant-direction global scale `gs`.
// Writes 8 packed bytes as two words (element 2i in the low nibble of byte i) and returns the
// E4M3 scale code; `vmax` gets max|x| (NaN when the block holds one). Reference:
// s = e4m3(min(gs * (vmax * R6), 448)), out_scale = rcp(f32(s) * rcp(gs)),
// q = e2m1(clamp(x * out_scale, -6, 6)).
// CudaFast: vLLM/TRT-LLM's cvt_warp_fp16_to_fp4 with rcp.approx.ftz reciprocals.
// The flavor's reciprocal of the global scale (the same for every block of a row: the
// quantize kernel computes it once per thread).
__device__ __forceinline__ float nvfp4_rgs(float gs, u32 flavor) {
    return flavor == FLAVOR_CUDA_FAST ? rcp_approx_ftz(gs) : rcp_ref(gs);
}

// The E4M3 scale code of a block with max|x| given as bits (amax_bits16) and rgs =
// nvfp4_rgs(gs), and the factor its values are multiplied by before the E2M1 encoding.
__device__ __forceinline__ u32 nvfp4_block_scale(u32 mbits, float gs, float rgs, u32 flavor, float& out_scale) {
    float vmax = __uint_as_float(mbits);
    u32 s_code;
    if (flavor == FLAVOR_CUDA_FAST) {
        float sf = __fmul_rn(gs, __fmul_rn(vmax, rcp_approx_ftz(6.0f)));
        s_code = e4m3_encode_hw(sf);
        float s = e4m3_decode(s_code);
        out_scale = s != 0.0f ? rcp_approx_ftz(__fmul_rn(s, rgs)) : 0.0f;
    } else {
        float t = clamp_max(__fmul_rn(gs, __fmul_rn(vmax, NVFP4_R6)), E4M3_MAX);
        // the hardware conversion rounds to nearest even and saturates at 448 as
        // e4m3_encode_sat does (t is already <= 448); only NaN needs the reference's code
        s_code = t != t ? E4M3_NAN : e4m3_encode_hw(t);
        float s = e4m3_decode(s_code);
        out_scale = rcp_ref(__fmul_rn(s, rgs));
    }
    return s_code;
}

// Finite x times a finite out_scale is never NaN (at worst +-inf, which clamps to 6): the
// fast encoder is exact there; anything else takes the general path. (Blackwell converts two
// values in one instruction: it always takes that path.)
__device__ __forceinline__ bool nvfp4_fast_path(u32 mbits, float out_scale) {
    return !NVFP4DBG_HW_E2M1 && mbits < 0x7F800000u && fabsf(out_scale) <= 3.402823466e38f;
}

// 8 values of a block (element 2i in the low nibble of byte i) with the block's out_scale.
__device__ __forceinline__ u32 nvfp4_word(const float* x, float out_scale, bool fast) {
    if (fast) return e2m1_word_fast(x, out_scale);
    u32 word = 0;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        float lo = clamp6(__fmul_rn(x[2 * i], out_scale));
        float hi = clamp6(__fmul_rn(x[2 * i + 1], out_scale));
        word |= e2m1_pack2(lo, hi) << (8 * i);
    }
    return word;
}

// quant_block_nvfp4_vmax with max|x| given as bits (amax_bits16) and rgs = nvfp4_rgs(gs).
__device__ __forceinline__ u32 quant_block_nvfp4_core(const float (&x)[16], u32 mbits, float gs, float rgs,
                                                      u32 flavor, u32 (&packed)[2]) {
    float out_scale;
    u32 s_code = nvfp4_block_scale(mbits, gs, rgs, flavor, out_scale);
    bool fast = nvfp4_fast_path(mbits, out_scale);
    packed[0] = nvfp4_word(x, out_scale, fast);
    packed[1] = nvfp4_word(x + 8, out_scale, fast);
    return s_code;
}

// The same, and whether any value is nonzero (BlockStats' flush test; false for a NaN block).
__device__ __forceinline__ u32 quant_block_nvfp4_nz(const float (&x)[16], float gs, float rgs, u32 flavor,
                                                    u32 (&packed)[2], bool& nonzero) {
    u32 mbits = amax_bits16(x);
    nonzero = __uint_as_float(mbits) > 0.0f;
    return quant_block_nvfp4_core(x, mbits, gs, rgs, flavor, packed);
}

__device__ __forceinline__ u32 quant_block_nvfp4_vmax(const float (&x)[16], float gs, u32 flavor,
                                                      u32 (&packed)[2], float& vmax_out) {
    u32 mbits = amax_bits16(x);
    vmax_out = __uint_as_float(mbits);
    return quant_block_nvfp4_core(x, mbits, gs, nvfp4_rgs(gs, flavor), flavor, packed);
}

__device__ __forceinline__ u32 quant_block_nvfp4(const float (&x)[16], float gs, u32 flavor,
                                                 u32 (&packed)[2]) {
    float vmax;
    return quant_block_nvfp4_vmax(x, gs, flavor, packed, vmax);
}

// Classify a block for BlockStats: returns bit 0 saturated, bit 1 flushed, bit 2 nan.
__device__ __forceinline__ u32 classify_nvfp4(u32 s_code, bool nonzero) {
    if ((s_code & 0x7Fu) == 0x7Fu) return 4u;
    if ((s_code & 0x7Fu) == E4M3_MAX_CODE) return 1u;
    if ((s_code & 0x7Fu) == 0u && nonzero) return 2u;
    return 0u;
}

// Add per-thread counts (blocks, saturated, flushed, nan) into `stats` with one atomic per
// warp and field (integer atomics: the totals do not depend on the order).
__device__ __forceinline__ void add_stats4(u64* stats, const u32 (&c)[4]) {
    u32 mask = __activemask();
    int leader = __ffs(mask) - 1;
#pragma unroll
    for (int f = 0; f < 4; f++) {
        u32 n = __reduce_add_sync(mask, c[f]);
        if ((int)(threadIdx.x & 31) == leader && stats != nullptr && n) atomicAdd(&stats[f], (u64)n);
    }
}

// The same for one block of class `cls` (classify_nvfp4) or none (blocks = 0).
__device__ __forceinline__ void add_stats(u64* stats, u32 blocks, u32 cls) {
    u32 c[4] = {blocks, cls & 1u, (cls >> 1) & 1u, (cls >> 2) & 1u};
    add_stats4(stats, c);
}

// expf_cr(x) is (float)exp((double)x): it matches a correctly rounded f32 exp (the CPU's expf)
// in all but vanishingly rare double-rounding cases, where CUDA's expf is off by up to 2 ulp.
// EXPF_CR_FAST 1 (default) computes most of them without CUDA's double exp (~28 DFMA and a
// special-case branch; the SwiGLU of the register-A gate/up epilogue calls it 64-80 times per
// thread and tile, unrolled): 2^(k/64) from a table times exp(r) - 1 to r^6 / 720 (|r| <=
// ln2 / 128), a few double ulps from exp(x), rounded to f32 only where no f32 rounding boundary
// lies within 2^12 double ulps of it; the rest (2^-16 of the inputs, |x| > 87, NaN) go to
// CUDA's exp. So the result is that of (float)exp((double)x) on every f32, which
// tools/checks/expf_cr_fast.cu checks on all 2^32 of them (tests/gpu_checks.rs, nightly). 0: CUDA's exp always, for an A/B.
#ifndef EXPF_CR_FAST
#define EXPF_CR_FAST 1
#endif
#if EXPF_CR_FAST
// 2^(j/64), j = 0..63, correctly rounded
__device__ const double EXP2_J64[64] = {
    0x1.0000000000000p+0, 0x1.02c9a3e778061p+0, 0x1.059b0d3158574p+0, 0x1.0874518759bc8p+0,
    0x1.0b5586cf9890fp+0, 0x1.0e3ec32d3d1a2p+0, 0x1.11301d0125b51p+0, 0x1.1429aaea92de0p+0,
    0x1.172b83c7d517bp+0, 0x1.1a35beb6fcb75p+0, 0x1.1d4873168b9aap+0, 0x1.2063b88628cd6p+0,
    0x1.2387a6e756238p+0, 0x1.26b4565e27cddp+0, 0x1.29e9df51fdee1p+0, 0x1.2d285a6e4030bp+0,
    0x1.306fe0a31b715p+0, 0x1.33c08b26416ffp+0, 0x1.371a7373aa9cbp+0, 0x1.3a7db34e59ff7p+0,
    0x1.3dea64c123422p+0, 0x1.4160a21f72e2ap+0, 0x1.44e086061892dp+0, 0x1.486a2b5c13cd0p+0,
    0x1.4bfdad5362a27p+0, 0x1.4f9b2769d2ca7p+0, 0x1.5342b569d4f82p+0, 0x1.56f4736b527dap+0,
    0x1.5ab07dd485429p+0, 0x1.5e76f15ad2148p+0, 0x1.6247eb03a5585p+0, 0x1.6623882552225p+0,
    0x1.6a09e667f3bcdp+0, 0x1.6dfb23c651a2fp+0, 0x1.71f75e8ec5f74p+0, 0x1.75feb564267c9p+0,
    0x1.7a11473eb0187p+0, 0x1.7e2f336cf4e62p+0, 0x1.82589994cce13p+0, 0x1.868d99b4492edp+0,
    0x1.8ace5422aa0dbp+0, 0x1.8f1ae99157736p+0, 0x1.93737b0cdc5e5p+0, 0x1.97d829fde4e50p+0,
    0x1.9c49182a3f090p+0, 0x1.a0c667b5de565p+0, 0x1.a5503b23e255dp+0, 0x1.a9e6b5579fdbfp+0,
    0x1.ae89f995ad3adp+0, 0x1.b33a2b84f15fbp+0, 0x1.b7f76f2fb5e47p+0, 0x1.bcc1e904bc1d2p+0,
    0x1.c199bdd85529cp+0, 0x1.c67f12e57d14bp+0, 0x1.cb720dcef9069p+0, 0x1.d072d4a07897cp+0,
    0x1.d5818dcfba487p+0, 0x1.da9e603db3285p+0, 0x1.dfc97337b9b5fp+0, 0x1.e502ee78b3ff6p+0,
    0x1.ea4afa2a490dap+0, 0x1.efa1bee615a27p+0, 0x1.f50765b6e4540p+0, 0x1.fa7c1819e90d8p+0,
};
#define EXPF_CR_MARGIN (1u << 12)  // double ulps (the 29 bits a float rounds off)

// exp(x) rounded to f32 in `out`, where that is certainly the rounding of the exact exp(x);
// false (out then holds some other value) where it may not be: |x| > 87 (beyond, the result is
// not a normal f32), NaN, or a double within EXPF_CR_MARGIN ulps of the midpoint of two floats.
// No branch: the other x are computed as 0, so that callers may run it on many values and
// take the rare ones to expf_cr_slow afterwards (swiglu16).
// EXPF_CR_BITS 1 (the default) takes x to double, k to an integer and the result to f32 by
// integer and FMA operations on their bits instead of F2F, FRND and F2I (conversions, 16 a clock
// an SM on sm_90 against 64 DFMA; SwiGLU's exps cost 0.29 ms of the 4096-token layer,
// BENCHMARKS.md session 15). On an H200 (s21, bench/gpu-run-s20e.sh) it agreed with
// (float)exp((double)x) on all 2^32 inputs, declining the same 8265 as 0 does, and swiglu16 agreed with
// swiglu on every f32 gate, with and without swiglu_limit (gpu_checks); the gate/up GEMM was 0.4%
// faster in 3 of 3 alternating rounds. 0 keeps the conversions.
#ifndef EXPF_CR_BITS
#define EXPF_CR_BITS 1
#endif
__device__ __forceinline__ bool expf_cr_fast(float x, float& out) {
#if EXPF_CR_BITS
    const u32 xb = __float_as_uint(x), ax = xb & 0x7FFFFFFFu;
    const bool in_range = ax <= 0x42AE0000u;  // |x| <= 87, not NaN
    // x as a double, exactly for normal x; zero and subnormal x as 0 (exp rounds to 1 either way)
    const u32 hi = (xb & 0x80000000u) | (((ax >> 23) + (1023u - 127u)) << 20) | ((ax & 0x7FFFFFu) >> 3);
    const double xd = in_range && ax >= 0x00800000u ? __hiloint2double((int)hi, (int)(ax << 29)) : 0.0;
    // x / (ln2 / 64) to an integer, rounded once (1.5 2^52 has an ulp of 1): k in the low bits
    const double t52 = fma(xd, 0x1.71547652b82fep+6, 0x1.8p52);
    const double kd = t52 - 0x1.8p52;
    const int k = __double2loint(t52);  // |k| <= 8034
#else
    const bool in_range = fabsf(x) <= 87.0f;
    const double xd = in_range ? x : 0.0f;
    const double kd = rint(xd * 0x1.71547652b82fep+6);  // x / (ln2 / 64), to the nearest integer
    const int k = (int)kd;                              // |k| <= 8034
#endif
    double r = fma(kd, -0x1.62e42fefa39efp-7, xd);      // x - k ln2 / 64 (Cody-Waite, hi ...
    r = fma(kd, -0x1.abc9e3b39803fp-62, r);             // ... and lo parts of ln2 / 64)
    double p = fma(r, 1.0 / 720.0, 1.0 / 120.0);
    p = fma(p, r, 1.0 / 24.0);
    p = fma(p, r, 1.0 / 6.0);
    p = fma(p, r, 0.5);
    const double q = fma(p, r * r, r);                  // exp(r) - 1
    const double t = __ldg(&EXP2_J64[k & 63]);
    const long long bits =                              // 2^(k >> 6) * 2^((k & 63) / 64) * exp(r)
        __double_as_longlong(fma(t, q, t)) + (long long)(k >> 6) * (1ll << 52);
#if EXPF_CR_BITS
    // to f32, rounding half up: exact where the test below accepts (no f32 rounding boundary
    // near), and a normal f32 for |x| <= 87
    out = __uint_as_float((u32)((bits + (1ll << 28)) >> 29) - ((1023u - 127u) << 23));
#else
    out = (float)__longlong_as_double(bits);
#endif
    return in_range && (u32)(bits & 0x1FFFFFFF) - (0x10000000u - EXPF_CR_MARGIN) > 2 * EXPF_CR_MARGIN;
}
#endif

#if EXPF_CR_FAST
// The rare rest, called (not inlined: one copy of CUDA's exp instead of one per call site).
__device__ __noinline__ float expf_cr_slow(float x) { return (float)exp((double)x); }
#endif

__device__ __forceinline__ float expf_cr(float x) {
#if EXPF_CR_FAST
    float y;
    return expf_cr_fast(x, y) ? y : expf_cr_slow(x);
#else
    return (float)exp((double)x);
#endif
}

// silu(g) * u with V4's swiglu_limit (gate clamped to <= L, up to [-L, L]; NaN kept), in
// the CPU's order: (g / (1 + exp(-g))) * u.
__device__ __forceinline__ void swiglu_clamp(float& g, float& u, float limit) {
    g = clamp_max(g, limit);
    u = u > limit ? limit : (u < -limit ? -limit : u);
}
__device__ __forceinline__ float silu_times(float g, float e, float u) {
    return __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, e)), u);
}
__device__ __forceinline__ float swiglu(float g, float u, float limit, u32 has_limit) {
    if (has_limit) swiglu_clamp(g, u, limit);
    return silu_times(g, expf_cr(-g), u);
}

// v[i] = swiglu(g[i], u[i], limit, has_limit) for 16 values: one branch on has_limit, exp's
// fast path on all 16 without a branch, then CUDA's exp for the rare ones it declined (a
// branch the whole warp skips on ordinary data), where swiglu branches around each value's
// exp (~100 SASS instructions a value in the register-A epilogue, sm_90a). Bit-identical to
// swiglu (tools/checks/swiglu16.cu, every f32 gate).
__device__ __forceinline__ void swiglu16(float (&g)[16], float (&u)[16], float limit, u32 has_limit,
                                         float (&v)[16]) {
    if (has_limit) {
#pragma unroll
        for (int i = 0; i < 16; i++) swiglu_clamp(g[i], u[i], limit);
    }
#if EXPF_CR_FAST
    u32 slow = 0;
#pragma unroll
    for (int i = 0; i < 16; i++) {
        float e;
        slow |= (u32)!expf_cr_fast(-g[i], e) << i;
        v[i] = silu_times(g[i], e, u[i]);
    }
    if (slow) {
#pragma unroll
        for (int i = 0; i < 16; i++)
            if (slow >> i & 1u) v[i] = silu_times(g[i], expf_cr_slow(-g[i]), u[i]);
    }
#else
#pragma unroll
    for (int i = 0; i < 16; i++) v[i] = silu_times(g[i], expf_cr(-g[i]), u[i]);
#endif
}

// ---- SwiGLU and its NVFP4 block together, the exact values only where they can matter ----
// The gate/up epilogue needs a = swiglu(g, u) only through its NVFP4 block: the E4M3 scale of
// max|a| and each value's E2M1 code (with a fixed gs2; the dynamic flavor writes `a` itself
// and keeps swiglu16). Both are monotone in |a|: the scale through rounded multiplies by
// constants and one E4M3 rounding, a code through |a| * out_scale and one E2M1 rounding. So
// swiglu_nvfp4_16 computes `a` fast (exp by ex2.approx, 1 / (1 + e) by rcp.approx and a
// Newton step: ~10 instructions where the correctly rounded exp and the IEEE division take
// ~50), and takes it as exact where every value within SWQ_BRACKET of it (relative) gives
// the same scale or code; elsewhere it computes that value exactly (swiglu's own code) and
// uses it. The bracket holds the exact `a`: silu_fast is within 2^-17 of the reference chain
// g / (1 + expf_cr(-g)) on every f32 gate with 2^-60 <= |g| <= 64 (tools/checks/
// swiglu_nvfp4.cu measures it on the GPU it runs on), the product by u adds two roundings
// (2^-23), and the bracket is 2^-15. A block with a value outside that domain (|g| > 64, |u| >
// 2^100, |a| outside [2^-100, 2^100] unless g or u is 0, NaN, infinities), or whose scale the
// bracket leaves in doubt, is computed exactly, every value. A code is
// taken only where |a| * out_scale is at least 2^-15 (relative) from every E2M1 rounding
// boundary (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5: at most two fraction bits, so one test on
// the low 21 fraction bits finds them all, with the representable values between as harmless
// extra hits), or below 0.125 (code 0 either way). Bit for bit swiglu16 then
// quant_block_nvfp4 (tools/checks/swiglu_nvfp4.cu, every f32 gate in blocks).
#define SWQ_BRACKET 0x1p-15f
#define SWQ_NEAR 512u  // ulps of |a| * out_scale: 512 2^-24 relative at the least = 2^-15

__device__ __forceinline__ float ex2_approx_ftz(float y) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(y));
    return r;
}

// silu(g) = g / (1 + exp(-g)) within 2^-17 of the reference chain for 2^-60 <= |g| <= 64.
__device__ __forceinline__ float silu_fast(float g) {
    float d = __fadd_rn(1.0f, ex2_approx_ftz(__fmul_rn(g, -1.44269504088896341f)));
    float r = rcp_approx_ftz(d);
    r = __fmaf_rn(r, __fmaf_rn(-d, r, 1.0f), r);
    return __fmul_rn(g, r);
}

// A fast value that the bracket covers: its gate and up in silu_fast's domain, and `a`
// either an exact zero (g or u zero: the sign is that of g * u both ways) or normal and far
// from overflow.
__device__ __forceinline__ bool swq_in_domain(float g, float u, float a) {
    float ag = fabsf(g), au = fabsf(u), aa = fabsf(a);
    bool zero = ag == 0.0f || au == 0.0f;
    return ag <= 64.0f && au <= 0x1p100f && (zero || (ag >= 0x1p-60f && aa >= 0x1p-100f && aa <= 0x1p100f));
}

// |x| * out_scale within SWQ_NEAR ulps of a value with at most two fraction bits (and at
// least 0.125): an E2M1 rounding boundary may lie between the fast and the exact value.
__device__ __forceinline__ bool swq_near_boundary(float x, float out_scale) {
    u32 pb = __float_as_uint(__fmul_rn(x, out_scale)) & 0x7FFFFFFFu;
    return pb >= 0x3E000000u && ((pb + SWQ_NEAR) & 0x1FFFFFu) < 2 * SWQ_NEAR;
}

// The NVFP4 block of a = swiglu(g, u) for 16 values with a fixed global scale: the E4M3
// scale code (returned), the packed codes (element 2i in the low nibble of byte i) and
// whether any value is nonzero (BlockStats' flush test). g and u are clamped in place where
// has_limit. The same bits as swiglu16 then quant_block_nvfp4_vmax (above).
__device__ __forceinline__ u32 swiglu_nvfp4_16(float (&g)[16], float (&u)[16], float limit, u32 has_limit, float gs,
                                               float rgs, u32 flavor, u32 (&packed)[2], bool& nonzero) {
    if (has_limit) {
#pragma unroll
        for (int i = 0; i < 16; i++) swiglu_clamp(g[i], u[i], limit);
    }
    float v[16];
    bool outside = false;  // a value outside the fast domain
#pragma unroll
    for (int i = 0; i < 16; i++) {
        v[i] = __fmul_rn(silu_fast(g[i]), u[i]);
        outside |= !swq_in_domain(g[i], u[i], v[i]);
    }
    // the scale, from both ends of max|a|'s bracket; in doubt (or outside), every value exactly
    u32 mbits = amax_bits16(v), s = 0, redo = 0xFFFFu;
    float vmax = __uint_as_float(mbits), os = 0.0f;
    if (!outside) {
        float os_lo;
        u32 s_lo = nvfp4_block_scale(__float_as_uint(__fmul_rd(vmax, 1.0f - SWQ_BRACKET)), gs, rgs, flavor, os_lo);
        s = nvfp4_block_scale(__float_as_uint(__fmul_ru(vmax, 1.0f + SWQ_BRACKET)), gs, rgs, flavor, os);
        if (s == s_lo && fabsf(os) <= 3.402823466e38f) {
            // the values whose code is in doubt
            redo = 0;
#pragma unroll
            for (int i = 0; i < 16; i++) redo |= (u32)swq_near_boundary(v[i], os) << i;
        }
    }
    if (redo) {
#pragma unroll
        for (int i = 0; i < 16; i++)
            if (redo >> i & 1u) v[i] = silu_times(g[i], expf_cr(-g[i]), u[i]);
        if (redo == 0xFFFFu) {
            mbits = amax_bits16(v);
            s = nvfp4_block_scale(mbits, gs, rgs, flavor, os);
        }
    }
    bool fast = nvfp4_fast_path(mbits, os);
    packed[0] = nvfp4_word(v, os, fast);
    packed[1] = nvfp4_word(v + 8, os, fast);
    nonzero = __uint_as_float(mbits) > 0.0f;
    return s;
}

// Weight codes are read once: no L1 allocation. No L2 prefetch and no 256-byte L2 fetch hint
// either: with them the decode GEMMs were 10-15% slower on an H200 (BENCHMARKS.md, session 5).
__device__ __forceinline__ uint4 ldg_stream(const u8* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// ---- exact FP16 dequantization of E2M1 x E4M3 (the decode GEMMs and the register-A prefill) ----
// An E2M1 nibble placed in the FP16 bits reads as its value times 2^-14 (0.5 is a subnormal);
// times the block scale in FP16 (every E4M3 value is exact in FP16) that is e2m1 * scale * 2^-14,
// exact (a multiple of 2^-24 below 0.17).

// E2M1 nibbles j and j+4 of a word as an FP16 pair, each equal to its value times 2^-14.
__device__ __forceinline__ u32 nib_pair_f16(u32 w, int j) {
    u32 x = w >> (4 * j);
    return ((x & 0x00070007u) << 9) | ((x << 12) & 0x80008000u);
}

// The FP16 high bytes (sign << 7 | magnitude << 1) of a word's 8 nibbles: byte b of `lo`
// for nibble 2b, of `hi` for nibble 2b + 1 (6 integer ops for the word's 4 pairs). The pair
// (j, j + 4) of nib_pair_f16 is then one byte permute with zero low bytes: bit-identical
// (checked on all 2^32 words by tools/checks/nib_bytes.c).
__device__ __forceinline__ u32 lop3_sel(u32 a, u32 b, u32 c) {  // (a & c) | (b & ~c)
    u32 d;
    asm("lop3.b32 %0, %1, %2, %3, 0xE4;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

__device__ __forceinline__ void nib_bytes(u32 w, u32& lo, u32& hi) {
    // the signs (bits 3 and 7 of each byte) land on bit 7 where the magnitude mask is 0: the
    // other sign of the pair falls on bit 3 (hi) or 11 (lo), inside the mask, and is dropped
    u32 s = w & 0x88888888u;
    hi = lop3_sel(w >> 3, s, 0x0E0E0E0Eu);
    lo = lop3_sel(w << 1, s << 4, 0x0E0E0E0Eu);
}

// nib_pair_f16(w, j) from nib_bytes(w): j = 0, 1 from bytes 0 and 2, j = 2, 3 from 1 and 3.
__device__ __forceinline__ u32 nib_pair_from_bytes(u32 lo, u32 hi, int j) {
    return __byte_perm((j & 1) ? hi : lo, 0u, j < 2 ? 0x2404u : 0x3414u);
}

__device__ __forceinline__ u32 mul_f16x2(u32 a, u32 b) {
    u32 d;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

// Two E4M3 bytes (low byte -> low half) to FP16 (exact; NaN stays NaN).
__device__ __forceinline__ u32 e4m3x2_to_f16x2(u32 two) {
    u32 d;
    asm("{ .reg .b16 t;\n cvt.u16.u32 t, %1;\n cvt.rn.f16x2.e4m3x2 %0, t;\n}" : "=r"(d) : "r"(two));
    return d;
}

// ---- the register-A prefill's 16-bit token rows (kernels/moe_gemm_sm90.cu) ----

// Operand type: 1 FP16 (codes and scales placed as in the decode GEMMs: value * 2^-14, about
// 3.5 instructions per A register), 0 BF16 (value * 2^-9 through rs_pair: 5 per register).
#ifndef RS_F16
#define RS_F16 1
#endif

__device__ __forceinline__ u32 bf16x2_fma(u32 a, u32 b, u32 c) {
    u32 d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// Two E4M3 codes (bytes 0 and 2 of t; bytes 1 and 3 zero) -> the BF16 pair code * 2^117,
// exact: the code's 7 low bits at BF16 bits 4-10 read as e4m3 * 2^-120 (subnormal codes
// included), then * 2^120 * 2^117. The NaN codes 0x7F / 0xFF stay NaN.
__device__ __forceinline__ u32 e4m3x2_scaled(u32 t) {
    const u32 neg0 = 0x80008000u;
    u32 bits = ((t & 0x007F007Fu) << 4) | ((t & 0x00800080u) << 8);
    u32 v = bf16x2_fma(bf16x2_fma(bits, 0x7B807B80u, neg0), 0x7A007A00u, neg0);
    u32 nan = (((t & 0x007F007Fu) + 0x00010001u) & 0x00800080u) >> 7;
    return v | (nan * 0x7FC0u);
}

// Pair j (0..3) of a word of 8 E2M1 codes (code i in nibble i) as BF16 bits reading
// e2m1 * 2^-126: code j in the low half, code j + 4 in the high half (dequant8's pairs).
__device__ __forceinline__ u32 rs_pair(u32 q, int j) {
    const u32 MAG = 0x01C001C0u, SGN = 0x80008000u;
    switch (j) {
        case 0: return ((q << 6) & MAG) | ((q << 12) & SGN);
        case 1: return ((q << 2) & MAG) | ((q << 8) & SGN);
        case 2: return ((q >> 2) & MAG) | ((q << 4) & SGN);
        default: return ((q >> 6) & MAG) | (q & SGN);
    }
}

__device__ __forceinline__ u32 rs_word(const uint4& v, int q) { return q == 0 ? v.x : q == 1 ? v.y : q == 2 ? v.z : v.w; }

// One block's E4M3 scale (the low byte of sc) as the 16-bit pair the block's words are
// multiplied by (RS_F16: e4m3 * 2^-14 in FP16; else e4m3 * 2^117 in BF16, see rs_unit_words).
__device__ __forceinline__ u32 rs_scale_pair(u32 sc) {
#if RS_F16
    u32 sv = e4m3x2_to_f16x2(sc & 0xFFu);
#else
    u32 sv = e4m3x2_scaled(sc & 0xFFu);
#endif
    return __byte_perm(sv, sv, 0x1010u);
}

// Block b (0, 1) of a unit of the register-A kernels' token rows (rs_unit_words): its 16
// E2M1 codes in w0 (K 16 b .. + 7 of the unit) and w1 (the next 8), its scale pair sl
// (rs_scale_pair), to steps s = 4 b .. 4 b + 3 of the chunk's 64 words at `o`.
__device__ __forceinline__ void rs_block_words(u32 w0, u32 w1, u32 sl, u32 b, u32 t, u32* o) {
#pragma unroll
    for (int q = 0; q < 2; q++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            u32 w = q ? w1 : w0, s = 4 * b + 2 * q + h;
#if RS_F16
            o[8 * s + t] = mul_f16x2(nib_pair_f16(w, 2 * h), sl);
            o[8 * s + 4 + t] = mul_f16x2(nib_pair_f16(w, 2 * h + 1), sl);
#else
            const u32 neg0 = 0x80008000u;
            o[8 * s + t] = bf16x2_fma(rs_pair(w, 2 * h), sl, neg0);
            o[8 * s + 4 + t] = bf16x2_fma(rs_pair(w, 2 * h + 1), sl, neg0);
#endif
        }
}

// One unit of the register-A kernels' token rows: the 32 E2M1 codes of K 32 t .. 32 t + 31 of
// a 128-wide chunk (word q of q4: K 32 t + 8 q .. + 7) with the E4M3 scales of their two blocks
// (the low and the high byte of sc16), dequantized exactly (RS_F16: e2m1 * e4m3 * 2^-14 in
// FP16; else * 2^-9 in BF16), in the K order of the kernels' A fragments: step s = 2 q + h
// takes pair 2 h of word q to word 8 s + t of the chunk's 64 words at `o`, pair 2 h + 1 to
// word 8 s + 4 + t.
__device__ __forceinline__ void rs_unit_words(const uint4& q4, u32 sc16, u32 t, u32* o) {
    rs_block_words(q4.x, q4.y, rs_scale_pair(sc16), 0, t, o);
    rs_block_words(q4.z, q4.w, rs_scale_pair(sc16 >> 8), 1, t, o);
}

// The fused gate/up GEMMs' epilogue (kernels/moe.cu, kernels/moe_gemm_sm90.cu), once the
// block's BM_ x BN_ tile of a = swiglu(g, u) can be read (shared memory, after a barrier) as
// a(r, c), r < BM_ a token row of the tile and c < BN_ an output column, and 16 of a row at a
// time quantized as a.quant16(r, c0, gs, rgs, flavor, packed, nonzero) (TileA's): with a fixed
// gs2 (gs2e points at expert e's), each (row, 16 columns) of the tile quantized to NVFP4 with
// it and its block statistics counted; with dynamic gs2 (nullptr), `a` written in f32 and |a|
// folded into amax_bits[e]. Rows past r1 and columns past nout are skipped. ROWS16 (the register-A
// kernels, nout a multiple of 128): each block also dequantized into `rows16`, the down
// GEMM's 16-bit token rows (rs_unit_words' order, rows of nout / 2 words), where not null;
// outq and outs may then be null (nothing else reads the codes).
template <int BM_, int BN_, int THREADS_, bool ROWS16 = false, typename A>
__device__ __forceinline__ void gate_up_tile_epilogue_of(A a, u32 r0, u32 r1, u32 n0, u32 nout, u32 e,
                                                         const float* __restrict__ gs2e, u32 flavor,
                                                         u8* __restrict__ outq, u8* __restrict__ outs,
                                                         u64* __restrict__ stats, float* __restrict__ out_f32,
                                                         u32* __restrict__ amax_bits,
                                                         u32* __restrict__ rows16 = nullptr) {
    if (gs2e != nullptr) {
        // fixed gs2 (gs2e: expert e's): quantize each (row, 16-column group) of the tile
        float gsv = *gs2e, rgs = nvfp4_rgs(gsv, flavor);
        u32 kb = nout / 16;
        u32 counts[4] = {0, 0, 0, 0};
        for (u32 idx = threadIdx.x; idx < BM_ * (BN_ / 16); idx += THREADS_) {
            u32 r = idx / (BN_ / 16), g = idx % (BN_ / 16);
            u32 row = r0 + r, col = n0 + g * 16;
            if (row < r1 && col < nout) {
                u32 p[2];
                bool nonzero;
                u32 s = a.quant16(r, g * 16, gsv, rgs, flavor, p, nonzero);
                if (outq != nullptr) {
                    *reinterpret_cast<uint2*>(outq + (size_t)row * (nout / 2) + col / 2) = make_uint2(p[0], p[1]);
                    outs[(size_t)row * kb + col / 16] = (u8)s;
                }
                if constexpr (ROWS16) {
                    // block (col / 16) % 2 of unit (col / 32) % 4 of chunk col / 128
                    if (rows16 != nullptr)
                        rs_block_words(p[0], p[1], rs_scale_pair(s), (col / 16) % 2, (col / 32) % 4,
                                       rows16 + (size_t)row * (nout / 2) + (col / 128) * 64);
                }
                u32 c = classify_nvfp4(s, nonzero);
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
        for (u32 idx = threadIdx.x; idx < BM_ * BN_; idx += THREADS_) {
            u32 r = idx / BN_, c = idx % BN_;
            u32 row = r0 + r, col = n0 + c;
            if (row < r1 && col < nout) {
                float v = a(r, c);
                out_f32[(size_t)row * nout + col] = v;
                float av = fabsf(v);
                u32 bits = av != av ? 0x7FC00000u : __float_as_uint(av);
                m = bits > m ? bits : m;
            }
        }
        m = __reduce_max_sync(0xFFFFFFFFu, m);
        if ((threadIdx.x & 31) == 0 && m) atomicMax(&amax_bits[e], m);
    }
}

// a in the f32 tile `sa` (rows of SA floats).
struct TileA {
    const float* sa;
    int SA;
    __device__ __forceinline__ float operator()(u32 r, u32 c) const { return sa[r * SA + c]; }
    // The NVFP4 block of a(r, c0 .. c0 + 15): E4M3 scale code, packed codes, any value nonzero.
    __device__ __forceinline__ u32 quant16(u32 r, u32 c0, float gs, float rgs, u32 flavor, u32 (&packed)[2],
                                           bool& nonzero) const {
        float v[16];
#pragma unroll
        for (int x = 0; x < 16; x++) v[x] = sa[r * SA + c0 + x];
        return quant_block_nvfp4_nz(v, gs, rgs, flavor, packed, nonzero);
    }
};
template <int BM_, int BN_, int THREADS_>
__device__ __forceinline__ void gate_up_tile_epilogue(const float* sa, int SA, u32 r0, u32 r1, u32 n0, u32 nout,
                                                      u32 e, const float* __restrict__ gs2, u32 flavor,
                                                      u8* __restrict__ outq, u8* __restrict__ outs,
                                                      u64* __restrict__ stats, float* __restrict__ out_f32,
                                                      u32* __restrict__ amax_bits) {
    gate_up_tile_epilogue_of<BM_, BN_, THREADS_>(TileA{sa, SA}, r0, r1, n0, nout, e, gs2 ? gs2 + e : nullptr, flavor,
                                                 outq, outs, stats, out_f32, amax_bits);
}

// Which expert and sorted rows row tile `bt` covers (tiles of `bm` rows; tile_offsets[E + 1]
// is moe_offsets' prefix sum of each expert's tile count); false past the real tile count.
// The expert is the largest e with tile_offsets[e] <= bt, searched by the whole warp 32
// entries at a time: two rounds of dependent loads for 256 experts where a binary search
// takes eight (a block's first MMA waits for them). Every lane of the warp must call it.
__device__ __forceinline__ bool find_row_tile(const u32* __restrict__ tile_offsets,
                                              const u32* __restrict__ expert_offsets, u32 E, u32 bt, u32 bm,
                                              u32& e, u32& r0, u32& r1) {
    if (bt >= tile_offsets[E]) return false;
    u32 lane = threadIdx.x & 31u;
    u32 lo = 0, hi = E;  // tile_offsets[lo] <= bt < tile_offsets[hi]
    while (hi - lo > 1) {
        u32 step = (hi - lo + 31) / 32, idx = lo + lane * step;
        u32 le = __ballot_sync(0xFFFFFFFFu, idx < hi && tile_offsets[idx] <= bt);
        u32 nlo = lo + (31u - __clz(le)) * step;  // lane 0 (idx = lo) always holds
        hi = nlo + step < hi ? nlo + step : hi;
        lo = nlo;
    }
    e = lo;
    r0 = expert_offsets[e] + (bt - tile_offsets[e]) * bm;
    // an expert's last tile takes the rest: at most bm rows, or bm + slack with moe_offsets'
    // wide tiles
    r1 = bt + 1 == tile_offsets[e + 1] ? expert_offsets[e + 1] : r0 + bm;
    return true;
}

// The expert of a row tile past the real ones in moe_offsets' wide_tiles.
#define RS_NO_TILE 0xFFFFFFFFu

// Row tile bt from moe_offsets' table (wide tiles): its expert e and rows [r0, r1); false past
// the real tile count. One 16-byte load, where find_row_tile waits on four in a row.
__device__ __forceinline__ bool load_row_tile(const uint4* __restrict__ wide_tiles, u32 bt, u32& e, u32& r0,
                                              u32& r1) {
    const uint4 t = wide_tiles[bt];
    e = t.x, r0 = t.y, r1 = t.z;
    return t.x != RS_NO_TILE;
}

// ---- mbarriers and bulk copies (sm_90 and newer) ----
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define NVFP4DBG_BULK 1
__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
// An arrival that also announces `bytes` of asynchronous (TMA) writes for the phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
// Until the phase of parity `parity` of the barrier has completed. The loop is inside the asm
// (labels are local to the braces): a C++ loop around try_wait is a branch that ptxas sees
// while MMAs are in flight, and it may then serialize the wgmma.
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    asm volatile(
        "{\n.reg .pred p;\nWAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
        "@!p bra WAIT;\n}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}
// A bulk copy (TMA, no tensor map) of `bytes` (a multiple of 16; both addresses 16-byte aligned)
// from global `src` into shared `dst`, its bytes completing on mbarrier `bar`.
__device__ __forceinline__ void bulk_load(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}
#else
#define NVFP4DBG_BULK 0
#endif
