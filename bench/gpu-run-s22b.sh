#!/usr/bin/env bash
# Session 22, second lease: the register-A ring's stage refilled by the last warp to release it
# (RS_LAST_REFILL 1: a shared-memory counter a stage, no warp waits for another) against thread 0
# waiting on the stage's `empty` mbarrier at step 4 (0, the old path). s22a's ncu of the down
# kernel put 7% of its stall samples on barriers. GPU tests of the register-A kernels and
# compute-sanitizer's racecheck on the ragged experts first, then alternating rounds (and a
# 4-stage ring under the new refill: no warp waits for a refill any more).
set -uo pipefail
L=${LABEL:-s22b}
source bench/gpu-lib.sh
D=NVFP4DBG_NVRTC_DEFINES
run_tests gpu_gemm gpu_moe
SAN_S=${SAN_S:-120} sanitize racecheck
ab_rounds ${ROUNDS:-3} ${ONLY:-gemm_prefill,layer_4096} "default| old|$D=-DRS_LAST_REFILL=0 st4|$D=-DR_STAGES=4"
stamp total
pack
