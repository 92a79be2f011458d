#!/usr/bin/env bash
# Ran in session 15 (BENCHMARKS.md, Session 15; RS_MB was removed after s15c: that define now
# does nothing, RS_DIAG stays).
# Session 15, second lease: (1) gpu_gemm and gpu_moe as built and under -DRS_MB=1 (its SwiGLU
# loop mended after s15a); (2) the prefill GEMMs and the 4096-token layer: default, RS_MB=1
# with one and two MMA groups in flight, and the time split of the register-A epilogues
# (RS_DIAG: 1 SwiGLU as g * u, 3 and no NVFP4 epilogue, 4 no down-projection stores; wrong
# outputs, timing only), alternating.
set -uo pipefail
L=${LABEL:-s15b}
source bench/gpu-lib.sh
D=NVFP4DBG_NVRTC_DEFINES
run_tests gpu_gemm gpu_moe
for t in gpu_gemm gpu_moe; do mv $R/$t.txt $R/$t-default.txt; done
export $D=-DRS_MB=1
run_tests gpu_gemm gpu_moe
unset $D
ab_rounds ${ROUNDS:-3} ${ONLY:-gemm_prefill,layer_4096} \
    "default| mb1|$D=-DRS_MB=1 mb1i1|$D=-DRS_MB=1~-DRS_INFLIGHT=1 diag1|$D=-DRS_DIAG=1 diag3|$D=-DRS_DIAG=3 diag4|$D=-DRS_DIAG=4"
stamp total
