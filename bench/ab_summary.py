#!/usr/bin/env python3
"""Median of each bench figure per variant over the rounds of an A/B device script.

    python3 bench/ab_summary.py DIR VARIANT...

reads DIR/VARIANT-ROUND.json (`nvfp4dbg bench --json`) and prints one line per figure:
the median over rounds of each variant's median time, with its achieved/floor ratio; and one
per stage of the layer figures (FIGURE/STAGE, from details.stage_median_ms).
"""
import glob
import json
import os
import statistics
import sys

root, variants = sys.argv[1], sys.argv[2:]
rows = {}
for f in sorted(glob.glob(os.path.join(root, "*-[0-9].json"))):
    v = os.path.basename(f).rsplit("-", 1)[0]
    try:
        res = json.load(open(f))["results"]
    except Exception as e:  # a run that died leaves no JSON: say so, keep the others
        print(f, "unreadable", e)
        continue
    for r in res:
        if r.get("median_ms") is not None:
            rows.setdefault((r["name"], v), []).append((r["median_ms"], r.get("ratio")))
        for stage, ms in (r.get("details") or {}).get("stage_median_ms", {}).items():
            if isinstance(ms, (int, float)):
                rows.setdefault((f"{r['name']}/{stage}", v), []).append((ms, None))
for name in sorted({k[0] for k in rows}):
    cells = []
    for v in variants:
        if (name, v) not in rows:
            continue
        got = rows[(name, v)]
        cell = f"{v}: {statistics.median(m for m, _ in got):.4f} ms"
        ratios = [x for _, x in got if x is not None]
        if ratios:
            cell += f" ({statistics.median(ratios):.3f})"
        cells.append(cell)
    print(name, "  ".join(cells))
