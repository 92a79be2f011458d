#!/usr/bin/env bash
# Session 28, second lease: the down GEMM's 16-bit token rows written by the register-A gate/up
# epilogue (NVFP4DBG_DOWN_ROWS=prepass: moe_rows_bf16_rs from the codes, as before) and the
# router's top-K with its group limit on keys (router_topk_keys8/16; NVFP4DBG_ROUTER_KERNEL=general:
# router_topk as before). The GPU tests (gpu_moe has both new checks), outputs bit for bit
# against each A/B variant, alternating bench rounds, ncu of the router.
set -uo pipefail
L=${LABEL:-s28b}
source bench/gpu-lib.sh
run_tests gpu_moe gpu_gemm gpu_graph
same_outputs prepass NVFP4DBG_DOWN_ROWS=prepass
same_outputs general NVFP4DBG_ROUTER_KERNEL=general
ab_rounds 3 gemm_prefill,layer_4096,layer_16 "default| prepass|NVFP4DBG_DOWN_ROWS=prepass general|NVFP4DBG_ROUTER_KERNEL=general"
ncu_full router router_topk layer_4096
stamp done
pack
