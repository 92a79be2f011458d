#!/usr/bin/env python3
"""How many rows of MMA width the register-A prefill kernels run for a routing's expert loads.

    python3 bench/tile_split.py bench.json     # the layer figures' details.expert_rows
    python3 bench/tile_split.py counts.txt     # or a list of rows per expert, e.g. [205, 211, ...]

The kernels (kernels/moe_gemm_sm90.cu) cut an expert's n rows into k tiles (128 rows each, the
last up to 160: k = 1 for n <= 160, else ceil((n - 32) / 128)) and run each tile at the
narrowest width that holds it: 32, 64, 128, 144 (gate/up only: RS_N144_GATE_UP), 160 tokens.
Printed per GEMM: the tiles by width and the widths' sum over the rows, for RS_SPLIT 0 (as
above), RS_SPLIT 1 (the last two tiles share their rows by the split whose widths sum to the
least; rs_split_rows) and the best partition into at most k tiles (a search). The rule is also
checked against a search over every split of 129..288 rows.
"""
import functools
import json
import sys


def widths(n144):
    return (32, 64, 128, 144, 160) if n144 else (32, 64, 128, 160)


def width(t, ws):
    return next(w for w in ws if t <= w)


def tiles(n):
    return 0 if n == 0 else 1 if n <= 160 else (n - 32 + 127) // 128


def split_rows(rest, ws):
    """rs_split_rows: the first of the last two tiles' rows."""
    lo, hi = max(1, rest - 160), min(160, rest - 1)
    best, cost = 128, width(128, ws) + width(rest - 128, ws)
    for w in ws:
        for a in (w, rest - w):
            if lo <= a <= hi and width(a, ws) + width(rest - a, ws) < cost:
                best, cost = a, width(a, ws) + width(rest - a, ws)
    return best


def partition(n, ws, split):
    k = tiles(n)
    if k < 2:
        return [n] if k else []
    rest = n - 128 * (k - 2)
    a = split_rows(rest, ws) if split else 128
    return [128] * (k - 2) + [a, rest - a]


@functools.lru_cache(None)
def best(n, ws, k):
    if n <= 0:
        return 0
    if k == 0:
        return 1 << 30
    return min(w + best(n - w, ws, k - 1) for w in ws)


def main(path):
    text = open(path).read()
    try:
        doc = json.loads(text)
    except ValueError:
        doc = None
    if isinstance(doc, dict):
        counts = next(r["details"]["expert_rows"] for r in doc["results"]
                      if r["name"].startswith("layer_4096") and "expert_rows" in r.get("details", {}))
    else:
        counts = json.loads(text[text.index("["):text.rindex("]") + 1])
    rows = sum(counts)
    print(f"{len(counts)} experts, {rows} rows, {sum(1 for c in counts if c)} touched")
    for name, n144 in (("gate/up", True), ("down", False)):
        ws = widths(n144)
        for rest in range(129, 289):
            lo, hi = max(1, rest - 160), min(160, rest - 1)
            a = split_rows(rest, ws)
            searched = min(width(b, ws) + width(rest - b, ws) for b in range(lo, hi + 1))
            assert width(a, ws) + width(rest - a, ws) == searched, (name, rest)
        for label, split in (("RS_SPLIT 0", False), ("RS_SPLIT 1", True)):
            ts = [t for n in counts for t in partition(n, ws, split)]
            assert sum(ts) == rows
            by = {w: sum(1 for t in ts if width(t, ws) == w) for w in ws}
            total = sum(width(t, ws) for t in ts)
            print(f"{name:8} {label}: {len(ts)} tiles {by}, width sum {total} = {total / rows:.3f}x rows")
        total = sum(best(n, ws, tiles(n)) for n in counts if n)
        print(f"{name:8} best in as many tiles: width sum {total} = {total / rows:.3f}x rows")


if __name__ == "__main__":
    main(sys.argv[1])
