#!/usr/bin/env bash
# Ran in session 15 (BENCHMARKS.md, Session 15). RS_EPI_SMEM 0 (the old gate/up epilogue) and
# RS_MB were removed after it: those defines now do nothing.
# Session 15, third lease: the register-A epilogues through shared memory (RS_EPI_SMEM, the
# new default): (1) gpu_gemm and gpu_moe, bit-exact against the CPU; (2) the prefill GEMMs and
# the 4096-token layer: the new epilogues, the old ones (-DRS_EPI_SMEM=0), and the new ones
# under RS_MB=1 with one MMA group in flight, alternating.
set -uo pipefail
L=${LABEL:-s15c}
source bench/gpu-lib.sh
D=NVFP4DBG_NVRTC_DEFINES
run_tests gpu_gemm gpu_moe
ab_rounds ${ROUNDS:-3} ${ONLY:-gemm_prefill,layer_4096} \
    "default| epi0|$D=-DRS_EPI_SMEM=0 mb1i1|$D=-DRS_MB=1~-DRS_INFLIGHT=1"
stamp total
