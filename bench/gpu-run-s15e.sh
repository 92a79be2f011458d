#!/usr/bin/env bash
# Session 15, fifth lease: the gate/up epilogue's SwiGLU 16 values at a time (swiglu16,
# RS_SWIGLU16, the new default): (1) the exhaustive checks (gpu_checks: expf_cr, whose fast
# path lost its branches, the E4M3 encoder, and swiglu16 against swiglu on every gate), then
# gpu_gemm and gpu_moe, bit-exact against the CPU; (2) the prefill GEMMs and the 4096-token
# layer: default, one value at a time (-DRS_SWIGLU16=0), and what SwiGLU still costs
# (-DRS_DIAG=1: g * u, wrong outputs, timing only), alternating.
set -uo pipefail
L=${LABEL:-s15e}
source bench/gpu-lib.sh
run_tests gpu_checks gpu_gemm gpu_moe
grep -E "mismatches" $R/gpu_checks.txt
D=NVFP4DBG_NVRTC_DEFINES
ab_rounds ${ROUNDS:-3} ${ONLY:-gemm_prefill,layer_4096} \
    "default| sw1|$D=-DRS_SWIGLU16=0 diag1|$D=-DRS_DIAG=1"
stamp total
