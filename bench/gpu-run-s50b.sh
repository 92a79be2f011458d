#!/usr/bin/env bash
# Session 50: the register-A GEMMs' compile-time knobs again, on an H100 (they were tuned on
# the H200 in sessions 9-26; the H100 has 70% of its copy bandwidth at the same tensor rate):
# 3 alternating rounds of `bench --quick --only layer_4096,gemm_prefill` per variant, medians by
# bench/ab_summary.py. Every knob gives the same numbers up to FP32 summation order.
set -uo pipefail
L=${LABEL:-s50b}
source bench/gpu-lib.sh
nvidia-smi -L | tee $R/gpus.txt
D=NVFP4DBG_NVRTC_DEFINES
ab_rounds 3 layer_4096,gemm_prefill "default|$D= \
  l2gu4|$D=-DRS_L2_AHEAD_GATE_UP=4 \
  l2down6|$D=-DRS_L2_AHEAD_DOWN=6 \
  l2down2|$D=-DRS_L2_AHEAD_DOWN=2 \
  n144down|$D=-DRS_N144_DOWN=1 \
  n48|$D=-DRS_N48=1 \
  narrow2|$D=-DRS_L2_AHEAD_NARROW=2"
pack
