// Check of kernels/quant.cu's QUANT_ENCODER 1 path (`quant_block_bf16_fast`, the default BF16
// block encoder) against the general one it replaces (kernels/nvfp4dbg_common.cuh
// `nvfp4_block_scale` + `nvfp4_word` + `classify_nvfp4`, DESIGN.md §2), with the device
// formulas copied here in C with IEEE f32 operations (x86-64 SSE, no FTZ, fmaf single-rounded,
// as the kernels are compiled with --fmad=false --ftz=false):
//
//  1. e2m1_code_min3 on every f32 a in [0, 7): the code bits minus 2^23 equal the reference
//     E2M1 magnitude of clamp6(a) (ties included);
//  2. rcp_fast_ok accepts exactly the exponent fields 1..252, the range where ptxas expands
//     rcp.rn.f32 (= __frcp_rn = __fdiv_rn(1, v), both IEEE) into MUFU.RCP and one Newton step,
//     the same instructions rcp_rn_inrange compiles to (SASS: MUFU.RCP; FFMA v*r - 1; FFMA
//     r*-e + r; ptxas writes the negation as FADD.FTZ, exact as e is 0 or far above the
//     subnormals). Their correctness rests on MUFU.RCP's accuracy, which C cannot model (a seed
//     1 ulp off can give a wrong last bit), so here the seed is the correctly rounded 1/v and
//     the GPU tests (bit-exact against the CPU reference) cover the hardware;
//  3. whole blocks, reference flavor (IEEE reciprocals) and cuda-fast flavor (rcp.approx modelled
//     as the correctly rounded value moved by up to 2 ulps, flushing subnormals as .ftz does):
//     wherever the fast path takes a block, its E4M3 code and 8 code bytes equal the general
//     path's and the block's class is 0; random BF16 blocks (random bits: NaN, Inf, subnormals;
//     magnitudes over 30 binades; zeros and -0; planted E2M1 ties and their BF16 neighbours at
//     the block's own out_scale) at global scales 1/2688 (flushed), 1e4 (saturated), 384, 448,
//     896, 2688, powers of two (exact ties), random ones and edge cases (0, -1, +-inf, NaN,
//     denormal, 2^127, 2^-126). Where it does not take the block, the kernel runs the general
//     code itself, so nothing is compared there; the counts show how many of each it took.
//
// The E4M3 conversion of the kernels (cvt.rn.satfinite) is e4m3_encode_sat here, as
// tools/checks/e4m3_hw_encode.cu checks on the GPU for every non-NaN input <= 448 (and NaN gives
// 0x7F); the E4M3 decode by cvt.f16x2.e4m3x2 is exact, i.e. e4m3_decode.
//
//   cc -O2 -o /tmp/quant_block_fast tools/checks/quant_block_fast.c -lm && /tmp/quant_block_fast
//
// Prints "mismatches 0" for each part (a minute or two); exits 1 on any mismatch.
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

typedef uint32_t u32;
static float f32(u32 b) { float x; memcpy(&x, &b, 4); return x; }
static u32 bits(float x) { u32 b; memcpy(&b, &x, 4); return b; }

// ---- the general path (nvfp4dbg_common.cuh) ----
#define R6 f32(0x3E2AAAABu)
static float clamp_max(float v, float hi) { return v > hi ? hi : v; }
static float clamp6(float v) { return v > 6.0f ? 6.0f : (v < -6.0f ? -6.0f : v); }
static float rcp_ref(float v) { return v == 0.0f ? 0.0f : 1.0f / v; }

static u32 e2m1_encode_sw(float x) {
    float a = fabsf(x);
    u32 mag = a <= 0.25f ? 0u : a < 0.75f ? 1u : a <= 1.25f ? 2u : a < 1.75f ? 3u
            : a <= 2.5f ? 4u : a < 3.5f ? 5u : a <= 5.0f ? 6u : 7u;
    if (a != a) mag = 7u;
    return mag | ((bits(x) >> 31) << 3);
}

static float e4m3_decode(u32 c) {
    c &= 0xFFu;
    if ((c & 0x7Fu) == 0x7Fu) return f32(0x7fffffffu);
    u32 e = (c >> 3) & 0xFu, m = c & 7u;
    float v = e == 0u ? (float)m * 0.001953125f : f32(((e + 120u) << 23) | (m << 20));
    return (c & 0x80u) ? -v : v;
}

static u32 e4m3_encode_sat(float x) {
    if (x != x) return 0x7F;
    u32 sign = (bits(x) >> 31) << 7;
    float a = fabsf(x), r;
    if (a < 0.015625f) {
        r = rintf(a * 512.0f) * 0.001953125f;
    } else {
        int ex = (int)((bits(a) >> 23) & 0xFFu) - 127;
        float inv_quantum = f32((u32)(127 - (ex - 3)) << 23);
        float quantum = f32((u32)(ex - 3 + 127) << 23);
        r = rintf(a * inv_quantum) * quantum;
    }
    if (r > 448.0f) return sign | 0x7E;
    u32 code;
    if (r < 0.015625f) {
        code = (u32)(r * 512.0f);
    } else {
        u32 b = bits(r);
        int ex = (int)((b >> 23) & 0xFFu) - 127;
        code = ((u32)(ex + 7) << 3) | ((b >> 20) & 7u);
    }
    return sign | code;
}

static u32 classify(u32 s, int nonzero) {
    if ((s & 0x7Fu) == 0x7Fu) return 4u;
    if ((s & 0x7Fu) == 0x7Eu) return 1u;
    if ((s & 0x7Fu) == 0u && nonzero) return 2u;
    return 0u;
}

// ---- rcp.approx.ftz model: the correctly rounded value moved by `ulps`, .ftz on both sides ----
static float ftz(float v) { return fabsf(v) < 0x1p-126f ? copysignf(0.0f, v) : v; }
static float rcp_approx(float v, int ulps) {
    v = ftz(v);
    float r = 1.0f / v;
    if (isfinite(r) && r != 0.0f) r = f32(bits(r) + (u32)ulps);
    return ftz(r);
}

// ---- the fast path (kernels/quant.cu QUANT_ENCODER 1) ----
static u32 code_min3(float a) {
    const float M = 8388608.0f;
    u32 c1 = bits(fmaf(a, 2.0f, M)), c2 = bits(a + (M + 2.0f)), c3 = bits(fmaf(a, 0.5f, M + 4.0f));
    u32 m = c1 < c2 ? c1 : c2;
    return m < c3 ? m : c3;
}

static float rcp_rn_inrange(float v, int ulps) {
    float r = rcp_approx(v, ulps);
    float e = fmaf(v, r, -1.0f);
    return fmaf(r, -e, r);
}
static int rcp_fast_ok(float v) { return ((bits(v) + 0x01800000u) & 0x7F800000u) > 0x01FFFFFFu; }

// prmt.b32, default mode: selector bit 3 replicates the chosen byte's sign bit
static u32 prmt(u32 a, u32 b, u32 sel) {
    uint64_t v = ((uint64_t)b << 32) | a;
    u32 r = 0;
    for (int n = 0; n < 4; n++) {
        u32 s = (sel >> (4 * n)) & 0xF;
        u32 byte = (u32)(v >> (8 * (s & 7))) & 0xFF;
        if (s & 8) byte = (byte & 0x80) ? 0xFF : 0x00;
        r |= byte << (8 * n);
    }
    return r;
}
static u32 byte_perm(u32 a, u32 b, u32 sel) { return prmt(a, b, sel & 0x7777u); }

static u32 word_bf16(const u32* w, float os) {
    u32 pair[4];
    for (int j = 0; j < 4; j++) {
        u32 wa = w[j] & 0x7FFF7FFFu;
        u32 lo = code_min3(f32(wa << 16) * os);
        u32 hi = code_min3(f32(wa & 0xFFFF0000u) * os);
        pair[j] = hi * 16u + lo;
    }
    u32 acc = byte_perm(byte_perm(pair[0], pair[1], 0x0040u), byte_perm(pair[2], pair[3], 0x0040u), 0x5410u);
    u32 ra = prmt(w[0], w[1], 0xFBD9u), rb = prmt(w[2], w[3], 0xFBD9u);
    u32 e = byte_perm(ra, rb, 0x5410u), o = byte_perm(ra, rb, 0x7632u);
    u32 sg = (e & 0x0F0F0F0Fu) | (o & 0xF0F0F0F0u);
    return acc | (sg & 0x88888888u);
}

static u32 amax_raw(const u32* w) {
    u32 lo = 0, hi = 0;
    for (int j = 0; j < 8; j++) {
        u32 a = w[j] & 0x7FFF7FFFu;
        if ((a & 0xFFFF) > lo) lo = a & 0xFFFF;
        if ((a >> 16) > hi) hi = a >> 16;
    }
    return (lo > hi ? lo : hi) << 16;
}

// flavor 0 reference, 1 cuda-fast; ulps: the rcp.approx error model. Returns whether the fast
// path took the block; on a mismatch prints it and sets *bad.
static int check_block(const u32* w, float gs, int flavor, int ulps_g, int ulps_s, unsigned long long* bad) {
    u32 mbits = amax_raw(w);
    float vmax = f32(mbits);
    float rgs = flavor ? rcp_approx(gs, ulps_g) : rcp_ref(gs);
    // general path
    u32 s_ref;
    float os_ref;
    if (flavor) {
        float sf = gs * (vmax * rcp_approx(6.0f, 0));
        s_ref = e4m3_encode_sat(clamp_max(sf, 448.0f));  // satfinite: > 448 -> 0x7E, NaN -> 0x7F
        if (sf != sf) s_ref = 0x7F;
        float s = e4m3_decode(s_ref);
        os_ref = s != 0.0f ? rcp_approx(s * rgs, ulps_s) : 0.0f;
    } else {
        float t = clamp_max(gs * (vmax * R6), 448.0f);
        s_ref = t != t ? 0x7F : e4m3_encode_sat(t);
        os_ref = rcp_ref(e4m3_decode(s_ref) * rgs);
    }
    u32 want[2] = {0, 0};
    for (int k = 0; k < 2; k++)
        for (int i = 0; i < 8; i++) {
            u32 h = w[4 * k + i / 2];
            float x = f32((i & 1) ? (h & 0xFFFF0000u) : (h << 16));
            want[k] |= e2m1_encode_sw(clamp6(x * os_ref)) << (4 * i);
        }
    // fast path
    u32 s_code;
    float v, os;
    if (flavor) {
        float sf = gs * (vmax * rcp_approx(6.0f, 0));
        s_code = sf != sf ? 0x7F : e4m3_encode_sat(clamp_max(sf, 448.0f));
        v = e4m3_decode(s_code) * rgs;
        os = rcp_approx(v, ulps_s);
    } else {
        float t = clamp_max(gs * (vmax * R6), 448.0f);
        s_code = t != t ? 0x7F : e4m3_encode_sat(t);
        v = e4m3_decode(s_code) * rgs;
        os = rcp_rn_inrange(v, ulps_s);
    }
    if (!((s_code - 8u < 0x76u) && rcp_fast_ok(v))) return 0;
    u32 got[2] = {word_bf16(w, os), word_bf16(w + 4, os)};
    u32 cls = classify(s_ref, vmax > 0.0f);
    if (got[0] != want[0] || got[1] != want[1] || s_code != s_ref || cls != 0) {
        if (*bad < 10) {
            printf("flavor %d gs %a (%08x): scale %02x/%02x class %u words %08x %08x / %08x %08x; x:", flavor, gs,
                   bits(gs), s_code, s_ref, cls, got[0], got[1], want[0], want[1]);
            for (int j = 0; j < 8; j++) printf(" %08x", w[j]);
            printf("\n");
        }
        (*bad)++;
    }
    return 1;
}

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static u32 next(void) {
    rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
    return (u32)(rng >> 16);
}
static double unif(void) { return next() / 4294967296.0; }

static u32 bf16_rn(float f) {
    u32 b = bits(f);
    if ((b & 0x7FFFFFFFu) > 0x7F800000u) return (b >> 16) | 0x40u;
    b += 0x7FFFu + ((b >> 16) & 1u);
    return b >> 16;
}

static u32 random_bf16(int e_lo, int e_hi) {
    u32 r = next() % 64;
    if (r == 0) return next() & 0xFFFF;               // any bits: NaN, Inf, subnormal
    if (r == 1) return (next() & 1) ? 0x8000 : 0x0000;  // +-0
    if (r == 2) return next() & 0x807F;              // subnormal
    int e = e_lo + (int)(next() % (u32)(e_hi - e_lo + 1));
    float m = 1.0f + (float)(next() % 128) / 128.0f;
    u32 b = bf16_rn(ldexpf(m, e));
    return b | ((next() & 1) << 15);
}

int main(void) {
    // 1. the E2M1 code on every f32 in [0, 7)
    unsigned long long bad1 = 0;
    for (u32 u = 0; u < 0x40E00000u; u++) {
        float a = f32(u);
        u32 want = e2m1_encode_sw(clamp6(a)), got = code_min3(a) - 0x4B000000u;
        if (want != got) {
            if (bad1 < 10) printf("code %08x %g: reference %u fast %u\n", u, a, want, got);
            bad1++;
        }
    }
    printf("1. e2m1_code_min3 on [0, 7): mismatches %llu\n", bad1);

    // 2. the reciprocal's range test and the sequence with an exact seed
    unsigned long long bad2 = 0, n2 = 0;
    for (u32 e = 0; e < 256; e++)
        for (u32 m = 0; m < (1u << 23); m += 4097u)
            for (u32 sgn = 0; sgn < 2; sgn++) {
                float v = f32((sgn << 31) | (e << 23) | m);
                n2++;
                if (rcp_fast_ok(v) != (e >= 1 && e <= 252)) bad2++;
                if (e >= 1 && e <= 252 && bits(rcp_rn_inrange(v, 0)) != bits(1.0f / v)) bad2++;
            }
    printf("2. rcp_fast_ok / rcp_rn_inrange, %llu cases: mismatches %llu\n", n2, bad2);

    // 3. whole blocks
    const float gs_fixed[] = {1.0f / 2688.0f, 1e4f, 384.0f, 448.0f, 896.0f, 2688.0f, 1.0f, 0.5f, 64.0f, 4096.0f,
                              0x1p-20f, 0x1p20f, 0.0f, -1.0f, -2688.0f, INFINITY, -INFINITY, NAN, 0x1p-140f,
                              0x1p127f, 0x1p-126f, 3.0f, 6.0f, 1.0f / 6.0f, 0x1.fffffep127f};
    const int n_fixed = sizeof(gs_fixed) / sizeof(gs_fixed[0]);
    const float ties[] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f, 6.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f};
    unsigned long long bad3 = 0, taken[2] = {0, 0}, total[2] = {0, 0};
    for (long n = 0; n < 12000000; n++) {
        int flavor = n & 1;
        float gs;
        u32 pick = next() % 8;
        if (pick < 3) gs = gs_fixed[next() % n_fixed];
        else if (pick < 5) gs = ldexpf(1.0f, (int)(next() % 60) - 30);       // exact ties
        else gs = (float)ldexp(1.0 + unif(), (int)(next() % 80) - 40);      // anything
        u32 w[8];
        // block magnitude: 2^e around what this gs maps to the E4M3 range, sometimes anywhere
        int e0 = (next() % 4 == 0) ? (int)(next() % 240) - 120
                                   : (int)lrint(log2(2688.0 / (isfinite(gs) && gs > 0 ? gs : 1.0))) + (int)(next() % 24) - 16;
        if (e0 < -133) e0 = -133;
        if (e0 > 126) e0 = 126;
        int spread = 1 + (int)(next() % 12);
        for (int j = 0; j < 8; j++)
            w[j] = random_bf16(e0 - spread, e0 + 1) | (random_bf16(e0 - spread, e0 + 1) << 16);
        // plant ties at the block's own out_scale (reference flavor's; below vmax so it stays)
        if (next() % 2) {
            u32 mbits = amax_raw(w);
            float vmax = f32(mbits);
            float t = clamp_max(gs * (vmax * R6), 448.0f);
            float os = rcp_ref(e4m3_decode(t != t ? 0x7F : e4m3_encode_sat(t)) * rcp_ref(gs));
            if (os > 0.0f && isfinite(os)) {
                int k = 1 + (int)(next() % 10);
                for (int q = 0; q < k; q++) {
                    float tie = ties[next() % 14];
                    u32 b = bf16_rn(tie / os);
                    b += (u32)((int)(next() % 3) - 1);  // the tie's BF16 neighbours too
                    if ((b & 0x7FFF) >= (mbits >> 16)) continue;
                    b |= (next() & 1) << 15;
                    int pos = (int)(next() % 16);
                    w[pos / 2] = (pos & 1) ? ((w[pos / 2] & 0xFFFF) | (b << 16)) : ((w[pos / 2] & 0xFFFF0000u) | b);
                }
            }
        }
        int ug = flavor ? (int)(next() % 5) - 2 : 0, us = flavor ? (int)(next() % 5) - 2 : 0;
        total[flavor]++;
        taken[flavor] += (unsigned long long)check_block(w, gs, flavor, ug, us, &bad3);
    }
    printf("3. blocks: reference %llu of %llu on the fast path, cuda-fast %llu of %llu: mismatches %llu\n",
           taken[0], total[0], taken[1], total[1], bad3);
    return bad1 || bad2 || bad3;
}
