#!/usr/bin/env bash
# Session 15, seventh lease: the register-A token ring one stage deeper (-DR_STAGES=5, 201 KB
# of shared memory; the gate/up epilogue's tile already took it to 167.5 KB): gpu_gemm and
# gpu_moe under it, then the prefill GEMMs and the 4096-token layer against the 4 stages as
# built, alternating.
set -uo pipefail
L=${LABEL:-s15g}
source bench/gpu-lib.sh
D=NVFP4DBG_NVRTC_DEFINES
export $D=-DR_STAGES=5
run_tests ${TESTS:-gpu_gemm gpu_moe}
unset $D
ab_rounds ${ROUNDS:-3} ${ONLY:-gemm_prefill,layer_4096} "default| st5|$D=-DR_STAGES=5"
stamp total
