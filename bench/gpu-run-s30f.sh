#!/usr/bin/env bash
# Session 30, final lease: the nightly on the session's final build (its kernels and forward
# are session 29's, commit 2f38419), then the SM clock and the board power, sampled every 100
# ms by nvidia-smi, under the cuBLAS ceiling's load and under the 4096-token layer's.
set -uo pipefail
L=${LABEL:-s30f}
source bench/gpu-lib.sh
NIGHTLY_S=450 run_nightly
sleep 5
for fig in cublas_bf16_4096 layer_4096_graph; do
    nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,noheader,nounits -lms 100 > $R/clocks-$fig.csv &
    P=$!
    timeout 120 .dev/gpu/nvfp4dbg bench --device cuda --no-report-dir -q --quick --only $fig --json $R/clk-$fig.json > $R/clk-$fig.txt 2>&1
    stamp "bench $fig rc=$?"
    kill $P
    python3 - $R/clocks-$fig.csv <<'PY'
import sys, statistics as st
rows = [l.split(',') for l in open(sys.argv[1]) if l.count(',') == 3]
clk = [float(r[1]) for r in rows]; pw = [float(r[2]) for r in rows]
busy = [(c, p) for c, p in zip(clk, pw) if p > 200]
print(sys.argv[1].split('/')[-1], len(rows), 'samples;', len(busy), 'above 200 W: SM clock median',
      st.median([c for c, _ in busy]) if busy else '-', 'MHz, min', min([c for c, _ in busy], default='-'),
      '; power median', st.median([p for _, p in busy]) if busy else '-', 'W, max', max(pw, default='-'))
PY
done
stamp done
pack
