#!/usr/bin/env bash
# Session 20, first lease: the register-A GEMMs with their weights through the token ring
# (-DRS_WSMEM=1: bulk copies by warp 0, R_STAGES - 1 chunks ahead, 3 stages of 58 KB) instead of
# global loads into registers one chunk ahead; with two MMA groups in flight on the wide tiles
# too (ws) and with one (ws1). gpu_gemm and gpu_moe under ws, then the prefill GEMMs and the
# 4096-token layer against the default, alternating; then the nightly on the default build.
set -uo pipefail
L=${LABEL:-s20a}
source bench/gpu-lib.sh
D=NVFP4DBG_NVRTC_DEFINES
WS="-DRS_WSMEM=1~-DR_STAGES=3~-DRS_INFLIGHT_WIDE=2"
export $D="${WS//\~/ }"
run_tests ${TESTS:-gpu_gemm gpu_moe}
unset $D
ab_rounds ${ROUNDS:-3} ${ONLY:-gemm_prefill,layer_4096} \
    "default| ws|$D=$WS ws1|$D=-DRS_WSMEM=1~-DR_STAGES=3 d3|$D=-DR_STAGES=3"
pack
if [ "${NIGHTLY:-1}" = 1 ]; then
    NVFP4DBG_REPORTS=$R/nightly timeout ${NIGHTLY_S:-300} bash .ci/gpu-nightly .dev/gpu > $R/nightly.txt 2>&1
    stamp "nightly rc=$?"
    grep -E "GPU tests:|cases:|not run" $R/nightly.txt | tail -3
    grep -E "^(FAIL|fail)|FAILED|panicked" $R/nightly.txt | head -10
fi
stamp total
pack
