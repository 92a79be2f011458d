#!/usr/bin/env bash
# Session 20, second lease: the token ring's depth (R_STAGES 4, the default, against 3 and 2;
# s20a had 3 ahead of 4 in every round), gpu_gemm and gpu_moe under 3 and 2 stages; and why
# the weights through the ring (RS_WSMEM) ran a third slower in s20a: the same ring with the
# weights' bytes in one bulk copy a chunk instead of 32 (-DRS_DIAG=8, wrong weights: timing only).
set -uo pipefail
L=${LABEL:-s20b}
source bench/gpu-lib.sh
D=NVFP4DBG_NVRTC_DEFINES
for st in 3 2; do
    export $D=-DR_STAGES=$st
    mkdir -p $R/st$st; RR=$R; R=$R/st$st; run_tests gpu_gemm gpu_moe; R=$RR
done
unset $D
ab_rounds ${ROUNDS:-3} ${ONLY:-gemm_prefill,layer_4096} \
    "default| d3|$D=-DR_STAGES=3 d2|$D=-DR_STAGES=2 wsd8|$D=-DRS_WSMEM=1~-DR_STAGES=3~-DRS_INFLIGHT_WIDE=2~-DRS_DIAG=8"
stamp total
pack
