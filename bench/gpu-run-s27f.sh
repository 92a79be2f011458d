#!/usr/bin/env bash
# Session 27, last lease: the gate/up's and the down's token rows in two buffers (s27e's bench
# repeated the gate/up GEMM alone on the down's rows: its prefill figures are void). The GPU
# tests (gpu_moe has the stage-repetition test that finds it), then 2 alternating rounds of the
# prefill GEMMs and the layer, against the expert inputs through their codes.
set -uo pipefail
L=${LABEL:-s27f}
source bench/gpu-lib.sh
run_tests gpu_moe gpu_gemm
ab_rounds 2 gemm_prefill,layer_4096 "default| codes|NVFP4DBG_RS_ROWS=codes"
stamp done
pack
