#!/usr/bin/env bash
# session 13, last device call, on the final build (the register-A kernels as s12f's):
# (1) the nightly (with gpu_checks); (2) the quantize spread: the same `bench --quick --only
# quantize` in 5 processes back to back (does an identical process shift by itself?); (3) the
# 4096-token layer with its router's per-expert rows (details.expert_rows_min_p10_median_p90_max).
set -uo pipefail
L=${LABEL:-s13d}
PART=nightly NIGHTLY_S=${NIGHTLY_S:-300} LABEL=$L-nightly bash bench/gpu-run-final.sh
source bench/gpu-lib.sh
for i in 1 2 3 4 5; do
    timeout 40 .dev/gpu/nvfp4dbg bench --device cuda --no-report-dir -q --quick --only quantize \
        --json $R/quant-$i.json > $R/quant-$i.txt 2>&1
    stamp "quantize process $i rc=$?: $(python3 -c "
import json; d = json.load(open('$R/quant-$i.json'))
print(' '.join('%s %.4f' % (r['name'], r['median_ms']) for r in d['results'] if 'quant' in r['name']))")"
done
pack
timeout 60 .dev/gpu/nvfp4dbg bench --device cuda --no-report-dir -q --quick --only layer_4096 --json $R/layer.json > $R/layer.txt 2>&1
stamp "layer rc=$?: $(python3 -c "
import json; d = json.load(open('$R/layer.json'))
print(' '.join('%s %.3f %s' % (r['name'], r['median_ms'], r['details'].get('expert_rows_min_p10_median_p90_max')) for r in d['results'] if 'layer' in r['name']))")"
pack
stamp total
