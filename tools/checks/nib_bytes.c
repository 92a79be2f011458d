// Exhaustive check of kernels/moe_decode.cu `nib_bytes` + `nib_pair_from_bytes` (lop3 and
// byte-permute form) against `nib_pair_f16` on every u32 word and all four pairs: the lean
// decode loop must feed the MMAs bit-identical FP16 operands.
//
//   cc -O2 -o /tmp/nib_check tools/checks/nib_bytes.c && /tmp/nib_check
//
// Prints "mismatches 0" (about 20 s); exits 1 on any mismatch.
#include <stdint.h>
#include <stdio.h>

typedef uint32_t u32;

static u32 nib_pair_f16(u32 w, int j) {
    u32 x = w >> (4 * j);
    return ((x & 0x00070007u) << 9) | ((x << 12) & 0x80008000u);
}

static u32 lop3_sel(u32 a, u32 b, u32 c) { return (a & c) | (b & ~c); }

// PTX prmt.b32 (default mode) / __byte_perm: bytes {b, a}, selector nibbles (bit 3 replicates
// the sign of the chosen byte; unused here, kept for fidelity)
static u32 byte_perm(u32 a, u32 b, u32 s) {
    unsigned long long t = ((unsigned long long)b << 32) | a;
    u32 r = 0;
    for (int k = 0; k < 4; k++) {
        u32 sel = (s >> (4 * k)) & 0xF;
        u32 byte = (u32)(t >> (8 * (sel & 7))) & 0xFF;
        if (sel & 8) byte = (byte & 0x80) ? 0xFF : 0;
        r |= byte << (8 * k);
    }
    return r;
}

static void nib_bytes(u32 w, u32 *lo, u32 *hi) {
    u32 s = w & 0x88888888u;
    *hi = lop3_sel(w >> 3, s, 0x0E0E0E0Eu);
    *lo = lop3_sel(w << 1, s << 4, 0x0E0E0E0Eu);
}

static u32 nib_pair_from_bytes(u32 lo, u32 hi, int j) {
    return byte_perm((j & 1) ? hi : lo, 0u, j < 2 ? 0x2404u : 0x3414u);
}

int main(void) {
    unsigned long long bad = 0;
    u32 w = 0;
    do {
        u32 lo, hi;
        nib_bytes(w, &lo, &hi);
        for (int j = 0; j < 4; j++)
            if (nib_pair_from_bytes(lo, hi, j) != nib_pair_f16(w, j)) {
                if (bad < 5) printf("w %08x pair %d: %08x != %08x\n", w, j, nib_pair_from_bytes(lo, hi, j), nib_pair_f16(w, j));
                bad++;
            }
        w++;
    } while (w != 0);
    printf("mismatches %llu\n", bad);
    return bad != 0;
}
