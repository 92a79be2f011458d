#!/usr/bin/env bash
# Ran in session 15 (BENCHMARKS.md, Session 15). RS_DOWN_BULK was removed after it (slower).
# Session 15, fourth lease: the down GEMM's stores by bulk copies from the f32 tile
# (-DRS_DOWN_BULK=1): (1) gpu_gemm and gpu_moe under it, bit-exact against the CPU; (2) the
# prefill GEMMs and the 4096-token layer: default, bulk, and what SwiGLU still costs in the
# new gate/up epilogue (-DRS_DIAG=1: g * u, wrong outputs, timing only), alternating.
set -uo pipefail
L=${LABEL:-s15d}
source bench/gpu-lib.sh
D=NVFP4DBG_NVRTC_DEFINES
export $D=-DRS_DOWN_BULK=1
run_tests ${TESTS:-gpu_gemm gpu_moe}
unset $D
ab_rounds ${ROUNDS:-3} ${ONLY:-gemm_prefill,layer_4096} \
    "default| bulk|$D=-DRS_DOWN_BULK=1 diag1|$D=-DRS_DIAG=1"
stamp total
