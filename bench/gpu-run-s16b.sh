#!/usr/bin/env bash
# Session 16, second lease: the narrow tiles (64 tokens or fewer) of the register-A GEMMs with
# their weights more chunks ahead in registers (-DRS_NARROW_DEPTH=3, 4; 2 as built) and, at depth 4,
# further ahead in L2 (-DRS_L2_AHEAD_NARROW=8; 4 as built). gpu_gemm and gpu_moe under depth 4, then
# the prefill GEMMs and the 4096-token layer (whose router makes a third of the tiles narrow),
# alternating; and the wide gate/up tiles with their weights 4 chunks ahead in L2 (0 as built:
# measured in session 9, before the wide tiles and the new epilogue).
set -uo pipefail
L=${LABEL:-s16b}
source bench/gpu-lib.sh
D=NVFP4DBG_NVRTC_DEFINES
export $D=-DRS_NARROW_DEPTH=4
run_tests ${TESTS:-gpu_gemm gpu_moe}
unset $D
ab_rounds ${ROUNDS:-3} ${ONLY:-gemm_prefill,layer_4096} \
    "default| nd3|$D=-DRS_NARROW_DEPTH=3 nd4|$D=-DRS_NARROW_DEPTH=4 nd4l8|$D=-DRS_NARROW_DEPTH=4~-DRS_L2_AHEAD_NARROW=8 gul2|$D=-DRS_L2_AHEAD_GATE_UP=4"
stamp total
