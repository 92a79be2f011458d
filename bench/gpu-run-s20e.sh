#!/usr/bin/env bash
# Session 20, the short lease left: EXPF_CR_BITS 1 (the default) checked on the GPU (gpu_checks:
# expf_cr and swiglu16 on all 2^32 inputs; gpu_moe: the layer bit-exact against the CPU), then
# the 4096-token layer and the prefill GEMMs against -DEXPF_CR_BITS=0, alternating.
set -uo pipefail
L=${LABEL:-s20e}
source bench/gpu-lib.sh
run_tests gpu_checks gpu_moe
D=NVFP4DBG_NVRTC_DEFINES
ab_rounds ${ROUNDS:-2} ${ONLY:-gemm_prefill,layer_4096} "bits| conv|$D=-DEXPF_CR_BITS=0"
stamp total
pack
