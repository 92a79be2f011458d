#!/usr/bin/env bash
# Session 23, fourth lease: the GPU tests of the layer forward, its graph and the bench
# command on the last host-side change (set_hidden's single pass; the graph refuses an inexact
# input before writing it).
set -uo pipefail
L=${LABEL:-s23d}
source bench/gpu-lib.sh
run_tests gpu_moe gpu_bench gpu_graph gpu_gemm
grep -E "^router BF16 logits|^router FP32" $R/gpu_moe.txt | head -6
