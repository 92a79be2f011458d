#!/usr/bin/env bash
# session 13, final lease: the bench measuring the cuBLAS ceilings after the memory-bound
# figures (src/bench/mod.rs). (1) `--only floors,quantize` 3 times (s13e, old order: the
# reference quantizer 0.0438-0.0443 ms after the 8192^3 GEMM, 0.0428-0.0430 without);
# (2) the whole bench and the PyTorch peers (bench/gpu-run-final.sh PART=bench).
set -uo pipefail
L=${LABEL:-s13f}
source bench/gpu-lib.sh
for i in 1 2 3; do
    timeout 60 .dev/gpu/nvfp4dbg bench --device cuda --no-report-dir -q --only floors,quantize --json $R/fq-$i.json > $R/fq-$i.txt 2>&1
    stamp "floors,quantize $i rc=$?: $(python3 -c "
import json; d = json.load(open('$R/fq-$i.json'))
print(' '.join('%s %.4f' % (r['name'], r['median_ms']) for r in d['results']))")"
done
pack
PART=bench LABEL=$L-bench bash bench/gpu-run-final.sh
stamp total
