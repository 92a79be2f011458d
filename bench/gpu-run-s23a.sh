#!/usr/bin/env bash
# Session 23, first lease: the router's logits as a BF16 tensor-core GEMM with FP32
# accumulation where the router weight and the input are BF16-exact (products exact; before:
# cuBLAS pedantic FP32 on the FMA pipes, 0.31 ms of the 4096-token layer's 0.455 ms prologue).
# gpu_moe first (the router test now runs each case on both paths; the graph test checks which
# path ran and that a BF16 graph refuses an FP32 input), then alternating rounds against
# NVFP4DBG_ROUTER_FP32=1 (the old path).
set -uo pipefail
L=${LABEL:-s23a}
source bench/gpu-lib.sh
run_tests gpu_moe
ab_rounds ${ROUNDS:-3} ${ONLY:-layer_4096,layer_16} "default| fp32|NVFP4DBG_ROUTER_FP32=1"
stamp "A/B done"
pack
