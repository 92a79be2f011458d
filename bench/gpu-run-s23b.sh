#!/usr/bin/env bash
# Session 23, second lease: the BF16 router as committed (set_hidden uploads the BF16 copy of
# an exact input; no gather kernel in the forward). The GPU tests of the layer and the bench
# command, alternating rounds against the pedantic FP32 router and against the shared expert on
# the main stream, then the whole bench, the peers and the nightly (bench/gpu-run-final.sh).
set -uo pipefail
L=${LABEL:-s23b}
source bench/gpu-lib.sh
run_tests gpu_moe gpu_bench
ab_rounds ${ROUNDS:-3} ${ONLY:-layer_4096,layer_16} "default| fp32|NVFP4DBG_ROUTER_FP32=1 one|NVFP4DBG_SHARED_STREAM=0"
stamp "A/B done"
pack
LABEL=$L-final PART=bench bash bench/gpu-run-final.sh
LABEL=$L-nightly PART=nightly NIGHTLY_S=200 bash bench/gpu-run-final.sh
