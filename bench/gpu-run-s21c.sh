#!/usr/bin/env bash
# Session 21, third lease: the narrow tiles' weight chunks held further ahead in registers
# (RS_REG_AHEAD chunks for tiles of at most RS_DEEP_N tokens; 2, the default, is the old ring).
# gpu_gemm (ragged experts: every tile width) and gpu_moe under 3 and 4 chunks (3 leaves a
# remainder of the 56 and 16 chunks), then the A/B against the default, alternating.
set -uo pipefail
L=${LABEL:-s21c}
source bench/gpu-lib.sh
D=NVFP4DBG_NVRTC_DEFINES
for ra in 3 4; do
    export $D=-DRS_REG_AHEAD=$ra
    mkdir -p $R/ra$ra; RR=$R; R=$R/ra$ra; run_tests gpu_gemm gpu_moe; R=$RR
done
unset $D
ab_rounds ${ROUNDS:-3} ${ONLY:-gemm_prefill,layer_4096} \
    "default| ra3|$D=-DRS_REG_AHEAD=3 ra4|$D=-DRS_REG_AHEAD=4 ra4n32|$D=-DRS_REG_AHEAD=4~-DRS_DEEP_N=32"
stamp total
pack
