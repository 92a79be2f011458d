#!/usr/bin/env python3
"""The tiles the register-A prefill kernels make of a routing's expert loads.

    python3 bench/tile_split.py bench.json     # the layer figures' details.expert_rows
    python3 bench/tile_split.py counts.txt     # or a list of rows per expert, e.g. [205, 211, ...]

The kernels (kernels/moe_gemm_sm90.cu) cut an expert's n rows into k tiles (128 rows each, the
last up to 160: k = 1 for n <= 160, else ceil((n - 32) / 128)) and run each tile at the
narrowest width that holds it: 32, 64, 96 (RS_N96, session 26), 128, 144 (gate/up only:
RS_N144_GATE_UP), 160 tokens.
Printed per GEMM: the tiles by width and the widths' sum over the rows. The width sum is not
the time: session 14 (BENCHMARKS.md) cut it by 4.1% with wider tiles and the GEMM got slower.
"""
import json
import sys


def widths(n144):
    return (32, 64, 96, 128, 144, 160) if n144 else (32, 64, 96, 128, 160)


def width(t, ws):
    return next(w for w in ws if t <= w)


def partition(n):
    k = 0 if n == 0 else 1 if n <= 160 else (n - 32 + 127) // 128
    return [n] if k == 1 else [128] * (k - 1) + [n - 128 * (k - 1)] if k else []


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
    ts = [t for n in counts for t in partition(n)]
    assert sum(ts) == rows
    for name, n144 in (("gate/up", True), ("down", False)):
        ws = widths(n144)
        by = {w: sum(1 for t in ts if width(t, ws) == w) for w in ws}
        total = sum(width(t, ws) for t in ts)
        print(f"{name:8} {len(ts)} tiles {by}, width sum {total} = {total / rows:.3f}x rows")


if __name__ == "__main__":
    main(sys.argv[1])
