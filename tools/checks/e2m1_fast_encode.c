// Exhaustive check of kernels/nvfp4dbg_common.cuh `e2m1_encode_fast` against the reference
// `e2m1_encode_sw(clamp6(v))` on every non-NaN f32 (NaN blocks take the reference path in the
// kernels). The formula is copied here in C with IEEE f32 adds (x86-64 SSE, no FTZ, as the
// kernels are compiled with --ftz=false).
//
//   cc -O2 -o /tmp/e2m1_check tools/checks/e2m1_fast_encode.c -lm && /tmp/e2m1_check
//
// Prints "mismatches 0" (about 30 s); exits 1 on any mismatch.
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

static float f32(uint32_t b) { float x; memcpy(&x, &b, 4); return x; }
static uint32_t bits(float x) { uint32_t b; memcpy(&b, &x, 4); return b; }

static uint32_t reference(float x) {
    float v = x > 6.0f ? 6.0f : (x < -6.0f ? -6.0f : x);
    float a = fabsf(v);
    uint32_t mag = a <= 0.25f ? 0u : a < 0.75f ? 1u : a <= 1.25f ? 2u : a < 1.75f ? 3u
                 : a <= 2.5f ? 4u : a < 3.5f ? 5u : a <= 5.0f ? 6u : 7u;
    return mag | ((bits(v) >> 31) << 3);
}

static uint32_t fast(float v) {
    float a = fminf(fabsf(v), 6.0f);
    uint32_t eb = bits(a) & 0x7F800000u;
    if (eb < 0x3F800000u) eb = 0x3F800000u;
    volatile float magic = f32(eb + 0x0B000000u);  // volatile: one IEEE add, not folded
    float s = a + magic;
    uint32_t code = bits(s) - eb + (eb >> 22) - (0x0B000000u + 0xFEu);
    return code | ((bits(v) >> 28) & 8u);
}

int main(void) {
    uint64_t bad = 0;
    for (uint64_t b = 0; b <= 0xFFFFFFFFull; b++) {
        uint32_t u = (uint32_t)b;
        if ((u & 0x7F800000u) == 0x7F800000u && (u & 0x7FFFFFu)) continue;  // NaN
        float x = f32(u);
        if (reference(x) != fast(x)) {
            if (bad < 10) printf("%08x %g: reference %u fast %u\n", u, x, reference(x), fast(x));
            bad++;
        }
    }
    printf("mismatches %llu\n", (unsigned long long)bad);
    return bad != 0;
}
