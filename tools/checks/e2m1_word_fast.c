// Exhaustive check of kernels/nvfp4dbg_common.cuh `e2m1_word_fast`: (1) its per-value
// magnitude (a rounded to its binade's E2M1 step by an IEEE add and subtract of 2^22 x the
// step, then a x 2^-126, whose f32 bits are the E2M1 magnitude code << 22) against the
// reference ties on every non-NaN f32; (2) the word assembly (codes placed by multiply-high /
// multiply-low adds, the 8 signs gathered from the values' top bytes by byte permutes) against
// nibble-by-nibble packing on random words with random signs, zeros and ties. The formulas are
// copied here in C with IEEE f32 operations (x86-64 SSE, no FTZ, as the kernels are compiled
// with --ftz=false).
//
//   cc -O2 -o /tmp/e2m1_word tools/checks/e2m1_word_fast.c -lm && /tmp/e2m1_word
//
// Prints "mismatches 0" twice (about a minute); exits 1 on any mismatch.
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

// e2m1_mag_bits: the magnitude code << 22
static uint32_t mag_bits(float v) {
    float a = fminf(fabsf(v), 6.0f);
    uint32_t eb = bits(a) & 0x7F800000u;
    if (eb < 0x3F800000u) eb = 0x3F800000u;
    volatile float m = f32(eb + 0x0B000000u);  // volatile: IEEE ops one by one, not folded
    volatile float s = a + m;
    volatile float r = s - m;
    volatile float y = r * 0x1p-126f;
    return bits(y);
}

static uint32_t byte_perm(uint32_t x, uint32_t y, uint32_t s) {
    uint64_t v = ((uint64_t)y << 32) | x;
    uint32_t r = 0;
    for (int n = 0; n < 4; n++) r |= (uint32_t)((v >> (8 * ((s >> (4 * n)) & 7))) & 0xFF) << (8 * n);
    return r;
}

static uint32_t word_fast(const float *p) {
    uint32_t mag = 0;
    for (int i = 0; i < 8; i++) {
        uint32_t c = mag_bits(p[i]);
        if (i <= 5)
            mag += (uint32_t)(((uint64_t)c << (10 + 4 * i)) >> 32);  // mad.hi
        else
            mag += c << (4 * i - 22);  // mad.lo
    }
    uint32_t e = byte_perm(byte_perm(bits(p[0]), bits(p[2]), 0x0073), byte_perm(bits(p[4]), bits(p[6]), 0x0073), 0x5410);
    uint32_t o = byte_perm(byte_perm(bits(p[1]), bits(p[3]), 0x0073), byte_perm(bits(p[5]), bits(p[7]), 0x0073), 0x5410);
    uint32_t sg = ((e >> 4) & 0x0F0F0F0Fu) | (o & 0xF0F0F0F0u);
    return mag | (sg & 0x88888888u);
}

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static uint32_t next(void) {
    rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
    return (uint32_t)(rng >> 16);
}

int main(void) {
    uint64_t bad = 0;
    for (uint64_t b = 0; b <= 0xFFFFFFFFull; b++) {
        uint32_t u = (uint32_t)b;
        if ((u & 0x7F800000u) == 0x7F800000u && (u & 0x7FFFFFu)) continue;  // NaN
        float x = f32(u);
        uint32_t want = reference(x) & 7u, got = mag_bits(x) >> 22;
        if (want != got || (mag_bits(x) & 0x3FFFFFu)) {
            if (bad < 10) printf("%08x %g: reference %u fast %u\n", u, x, want, got);
            bad++;
        }
    }
    printf("mismatches %llu\n", (unsigned long long)bad);
    uint64_t bad2 = 0;
    const float ties[] = {0.0f, 0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f, 6.0f, 7.0f, 1e30f};
    for (int n = 0; n < 20000000; n++) {
        float p[8];
        for (int i = 0; i < 8; i++) {
            uint32_t r = next();
            float v = (r & 3) == 0 ? ties[next() % 11] : (float)(next() % 100000) * 1e-4f;
            p[i] = (r & 4) ? -v : v;
        }
        uint32_t want = 0;
        for (int i = 0; i < 8; i++) want |= reference(p[i]) << (4 * i);
        uint32_t got = word_fast(p);
        if (want != got) {
            if (bad2 < 10) printf("word: want %08x got %08x\n", want, got);
            bad2++;
        }
    }
    printf("mismatches %llu\n", (unsigned long long)bad2);
    return bad || bad2;
}
