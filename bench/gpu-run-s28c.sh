#!/usr/bin/env bash
# Session 28, third lease: the shared expert's gate_proj and up_proj as one cuBLAS GEMM of 2 I
# outputs (NVFP4DBG_SHARED_GATE_UP=split: two, as before). gpu_moe, then 3 alternating rounds
# of the layers against it and against all of the session's changes off ("old": the down's
# rows prepass, the general router kernel, the split shared gate/up).
set -uo pipefail
L=${LABEL:-s28c}
source bench/gpu-lib.sh
run_tests gpu_moe
ab_rounds 3 layer_4096,layer_16 "default| split|NVFP4DBG_SHARED_GATE_UP=split old|NVFP4DBG_DOWN_ROWS=prepass,NVFP4DBG_ROUTER_KERNEL=general,NVFP4DBG_SHARED_GATE_UP=split"
stamp done
pack
