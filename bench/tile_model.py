#!/usr/bin/env python3
"""Row tiles of the prefill GEMMs under the 4096-token layer's routing, and their cost by the
tile cost model of session 8's ncu samples (BENCHMARKS.md, "Session 8" and "Session 11").

  python3 bench/tile_model.py

LOADS are the rows per expert that the CPU router (src/moe/router.rs, route_with) gives the
bench's 4096-token layer: the DeepSeek-V3 preset, layer 3, bench::SEED, the router of
src/bench/synth.rs::layer and the hidden states of synth::hidden (session 11, from a throwaway
test that built that router alone and counted topk_ids; the GPU router gives the same ids).

The model: a CTA tile of 256 weight rows and N tokens (padded to the kernel's widths) costs
A + B N, in units of a 128-token tile; A = 0.547 and B = 0.00354 fit session 8's split (the
32-token tiles, 31% of the tiles, took 23% of the K-loop samples). A is the weights'
dequantization and its latency, paid once per tile and weight row whatever N is; so two CTAs of
128 weight rows cost what one of 256 does, and the gain of wider tiles is the tiles that an
expert no longer needs.

Measured against it (s12a, session 12): RS_WIDE, which the model put at 0.89x, ran 1.18x the
default (prefill GEMMs 7.09 against 6.02 ms, the 4096-token layer 9.05 against 8.51), and was
removed. The model misses what ncu showed there: with one m-block per warpgroup a warp has half
the weight loads in flight per k-step, and long-scoreboard stalls (the weights' global loads)
doubled (gate/up: 123k against 57k samples; +20% instructions). A per tile is not fixed: it
grows when a warp has less independent work to hide it behind.
"""
A, B = 0.547, 0.00354
LOADS = [205, 211, 21, 223, 146, 58, 58, 95, 251, 202, 260, 94, 30, 155, 223, 75, 239, 57, 215, 92, 19, 72, 41, 29, 53, 41, 54, 113, 47, 23, 209, 25, 31, 261, 101, 256, 109, 305, 50, 159, 166, 190, 49, 292, 197, 121, 150, 23, 194, 77, 214, 60, 103, 91, 203, 168, 38, 87, 275, 141, 238, 245, 216, 46, 25, 70, 22, 192, 69, 22, 189, 189, 161, 222, 175, 170, 269, 215, 146, 59, 63, 197, 110, 209, 144, 271, 136, 102, 118, 125, 296, 98, 131, 21, 97, 76, 44, 122, 61, 144, 41, 127, 35, 23, 97, 36, 156, 57, 132, 157, 63, 229, 139, 138, 106, 191, 183, 150, 155, 70, 30, 126, 214, 198, 169, 34, 76, 213, 216, 228, 52, 128, 29, 245, 31, 138, 230, 91, 21, 59, 166, 57, 137, 144, 260, 26, 122, 248, 180, 204, 22, 128, 33, 29, 202, 258, 75, 298, 185, 116, 54, 188, 189, 106, 45, 111, 178, 50, 104, 137, 158, 239, 55, 123, 37, 56, 35, 196, 156, 28, 220, 143, 42, 86, 164, 122, 220, 195, 74, 72, 183, 68, 47, 68, 148, 195, 61, 100, 39, 84, 47, 178, 107, 155, 210, 94, 51, 16, 60, 164, 79, 168, 192, 32, 115, 28, 69, 34, 78, 134, 141, 174, 49, 74, 219, 96, 62, 71, 281, 34, 209, 85, 182, 48, 151, 211, 264, 154, 258, 129, 145, 235, 279, 126, 95, 220, 111, 208, 24, 40, 102, 112, 188, 38, 209, 202]


def pad(n, widths):
    return next(w for w in widths if n <= w)


def current(rows, widths):
    """session 9's wide tiles: 128-row tiles, the last one up to 160 rows"""
    tiles = []
    while rows > 160:
        tiles.append(128)
        rows -= 128
    return tiles + ([pad(rows, widths)] if rows else [])


def one_mblock(rows, most, widths):
    """one 64-row m-block per warpgroup (128 accumulators at N = 256): tiles up to `most` rows"""
    tiles = []
    while rows > most:
        tiles.append(most)
        rows -= most
    return tiles + ([pad(rows, [w for w in widths if w <= most])] if rows else [])


def rs_wide(rows, widths=(32, 64, 128, 192, 256)):
    """as built (kernels/moe_gemm_sm90.cu RS_WIDE): 128-row tiles, the last one up to 256 rows"""
    tiles = []
    while rows > 256:
        tiles.append(128)
        rows -= 128
    return tiles + ([pad(rows, widths)] if rows else [])


def report(name, tiling):
    tiles = [tiling(r) for r in LOADS]
    n = sum(len(t) for t in tiles)
    cost = sum(A + B * w for t in tiles for w in t)
    padded = sum(sum(t) for t in tiles)
    return name, n, cost, padded


if __name__ == "__main__":
    w32 = (32, 64, 96, 128, 160, 192, 224, 256)
    rows = [
        report("session 9, gate/up (widths 32 64 128 144 160)", lambda r: current(r, (32, 64, 128, 144, 160))),
        report("session 9, down (32 64 128 160)", lambda r: current(r, (32, 64, 128, 160))),
        report("session 9 + a 96-token width", lambda r: current(r, (32, 64, 96, 128, 144, 160))),
        report("one m-block, tiles up to 192", lambda r: one_mblock(r, 192, w32)),
        report("one m-block, tiles up to 256", lambda r: one_mblock(r, 256, w32)),
        report("RS_WIDE as built (widths 32 64 128 192 256)", rs_wide),
        report("RS_WIDE with every width of 32", lambda r: rs_wide(r, w32)),
    ]
    s = sorted(LOADS)
    print(f"{len(LOADS)} experts, {sum(LOADS)} rows: min {s[0]}, median {s[len(s) // 2]}, max {s[-1]}, "
          f"{sum(r > 160 for r in LOADS)} past 160")
    base = rows[0][2]
    for name, n, cost, padded in rows:
        print(f"{name:48s} {n:4d} tiles  cost {cost:6.1f} ({cost / base:.2f}x)  padded rows {padded}")
