#!/usr/bin/env bash
# Session 22, first lease: the down projection's stores through shared memory (RS_DOWN_SMEM 1,
# 16-byte stores of whole lines; 2 the same with streaming stores) against the accumulators'
# 4-byte stores (0, the old path). The GPU tests of the register-A kernels first (the new
# default's outputs against the CPU and the mma.sync kernels), then alternating rounds, then
# ncu --set full on one launch of the down kernel in the layer (where its time goes now).
set -uo pipefail
L=${LABEL:-s22a}
source bench/gpu-lib.sh
D=NVFP4DBG_NVRTC_DEFINES
run_tests gpu_gemm gpu_moe
ab_rounds ${ROUNDS:-3} ${ONLY:-gemm_prefill,layer_4096} \
    "default| reg|$D=-DRS_DOWN_SMEM=0 cs|$D=-DRS_DOWN_SMEM=2"
ncu_full down moe_gemm_nvfp4_sm90rs layer_4096_eager
stamp total
pack
