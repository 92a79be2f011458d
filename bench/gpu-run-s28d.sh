#!/usr/bin/env bash
# Session 28, final lease: the nightly, the whole bench and the peers (bench/gpu-run-final.sh) on
# the session's final kernels (the down's 16-bit rows from the gate/up epilogue, the router's
# keys kernels), then 2 alternating rounds of the layer and the prefill GEMMs against both off.
set -uo pipefail
L=${LABEL:-s28d}
LABEL=$L NIGHTLY_S=240 bash bench/gpu-run-final.sh
source bench/gpu-lib.sh
ab_rounds 2 layer_4096,gemm_prefill "default| old|NVFP4DBG_DOWN_ROWS=prepass,NVFP4DBG_ROUTER_KERNEL=general"
stamp done
pack
