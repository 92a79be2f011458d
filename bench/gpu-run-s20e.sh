#!/usr/bin/env bash
# Queued by session 20 (its device budget ran out first): -DEXPF_CR_BITS=1 checked on the GPU
# (gpu_checks: expf_cr and swiglu16 on all 2^32 inputs; gpu_moe: the layer bit-exact against the
# CPU), then the 4096-token layer and the prefill GEMMs against the conversions (0), alternating.
# (Run in session 21, which then made 1 the default; `conv` names 0 explicitly so that a rerun
# still compares the two.)
set -uo pipefail
L=${LABEL:-s20e}
source bench/gpu-lib.sh
D=NVFP4DBG_NVRTC_DEFINES
export $D=-DEXPF_CR_BITS=1
run_tests gpu_checks gpu_moe
unset $D
ab_rounds ${ROUNDS:-3} ${ONLY:-gemm_prefill,layer_4096} "conv|$D=-DEXPF_CR_BITS=0 bits|$D=-DEXPF_CR_BITS=1"
stamp total
pack
