#!/usr/bin/env bash
# Session 22, third lease: the last-releaser refill with a relaxed add (RS_LAST_REFILL 2: no
# MEMBAR before it, which in s22b's acq_rel form waited for each warp's weight loads in flight)
# against the default (thread 0 waits on the `empty` mbarrier). Its GPU tests and racecheck
# first, then alternating rounds.
set -uo pipefail
L=${LABEL:-s22c}
source bench/gpu-lib.sh
D=NVFP4DBG_NVRTC_DEFINES
(
    export NVFP4DBG_NVRTC_DEFINES=-DRS_LAST_REFILL=2 SAN_S=${SAN_S:-120}
    run_tests gpu_gemm gpu_moe
    sanitize racecheck
)
ab_rounds ${ROUNDS:-3} ${ONLY:-gemm_prefill,layer_4096} "default| rel|$D=-DRS_LAST_REFILL=2"
stamp total
pack
