#!/usr/bin/env bash
# session 13, after s13d (five identical `--quick --only quantize` processes read 0.0426-0.0427 ms,
# no spread): does the figure before it shift it? Full-mode (not --quick) processes alternating
# `--only quantize` (copy and the 4096^3 GEMM first) with `--only floors,quantize` (also the
# 8192^3 GEMM, as in the whole bench).
set -uo pipefail
L=${LABEL:-s13e}
source bench/gpu-lib.sh
for i in 1 2 3; do
    for only in quantize floors,quantize; do
        n=${only//,/-}-$i
        timeout 60 .dev/gpu/nvfp4dbg bench --device cuda --no-report-dir -q --only $only --json $R/$n.json > $R/$n.txt 2>&1
        stamp "$n rc=$?: $(python3 -c "
import json; d = json.load(open('$R/$n.json'))
print(' '.join('%s %.4f' % (r['name'], r['median_ms']) for r in d['results']))")"
    done
    pack
done
stamp total
