#!/usr/bin/env bash
# Session 31, second lease (diagnostic build): how much the GEMM stages, power-capped, depend
# on their token data: the gate/up's token rows all zero after the prologue
# (NVFP4DBG_DIAG_ZERO_ROWS=1, whence the down's rows zero too; the knob, a fill of the rows
# after the prologue's rows scatter, lived only in that lease's build and was never committed)
# against the real rows; the stages are read (the layer figure then carries a 470 MB fill),
# with the clocks sampled.
set -uo pipefail
L=${LABEL:-s31b}
source bench/gpu-lib.sh
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_event_reasons.active --format=csv,noheader,nounits -lms 20 > $R/clocks.csv &
P=$!
ab_rounds ${ROUNDS:-3} layer_4096_eager,gemm_prefill "real| zero|NVFP4DBG_DIAG_ZERO_ROWS=1"
kill $P
python3 - $R <<'PY'
import sys, json, glob, statistics as st
R = sys.argv[1]
rows = [[x.strip() for x in l.split(',')] for l in open(R + '/clocks.csv') if l.count(',') == 3]
print(len(rows), 'clock samples; busy median MHz', st.median([float(r[1]) for r in rows if float(r[2]) > 200] or [0]))
PY
stamp done
pack
