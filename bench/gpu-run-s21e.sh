#!/usr/bin/env bash
# Session 21, fifth lease: the next CTA's first weight chunks (and token stages) into L2 before
# this CTA's epilogue (RS_NEXT_L2 chunks; 0, the default, none). s21d's ncu put 7-9% of the
# gate/up kernel's stall samples on a CTA's first use of its first chunk's weights. gpu_gemm and
# gpu_moe under it, the A/B against the default, then the nightly under RS_NEXT_L2=2 (the
# candidate default), all in one lease.
set -uo pipefail
L=${LABEL:-s21e}
source bench/gpu-lib.sh
D=NVFP4DBG_NVRTC_DEFINES
export $D=-DRS_NEXT_L2=2
run_tests gpu_gemm gpu_moe
unset $D
ab_rounds ${ROUNDS:-3} ${ONLY:-gemm_prefill,layer_4096} \
    "default| nl2|$D=-DRS_NEXT_L2=2 nl4|$D=-DRS_NEXT_L2=4"
if [ "${NIGHTLY:-1}" = 1 ]; then
    export $D=-DRS_NEXT_L2=2
    NVFP4DBG_REPORTS=$R/nightly timeout ${NIGHTLY_S:-200} bash .ci/gpu-nightly .dev/gpu > $R/nightly.txt 2>&1
    stamp "nightly under RS_NEXT_L2=2 rc=$?: $(grep -E 'GPU tests:' $R/nightly.txt | tail -1)"
    grep -E "^(FAIL|fail)|FAILED|panicked" $R/nightly.txt | head -10
fi
stamp total
pack
