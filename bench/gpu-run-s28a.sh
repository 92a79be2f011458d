#!/usr/bin/env bash
# Session 28, first lease: session 27's unverified fix (the gate/up's and the down's token rows in
# two buffers) under the GPU tests, then 2 alternating rounds of the prefill GEMMs and the layer
# against the expert inputs through their codes, then ncu's full set on the router (~42 us in
# the layer, its top-K not the cause) and the down's rows prepass.
set -uo pipefail
L=${LABEL:-s28a}
source bench/gpu-lib.sh
run_tests gpu_moe gpu_gemm
ab_rounds 2 gemm_prefill,layer_4096 "default| codes|NVFP4DBG_RS_ROWS=codes"
ncu_full router router_topk layer_4096
ncu_full rowsrs moe_rows_bf16_rs layer_4096
stamp done
pack
