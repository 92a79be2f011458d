#!/usr/bin/env bash
# (Ran on an uncommitted tree after 67eaac9 with RS_PREFETCH_NEXT; removed as slower: BENCHMARKS.md,
# Session 29.)
# Session 29, third lease: once its K loop is done, a register-A CTA prefetches into L2 the first
# two chunks of weights and tokens of the block the hardware hands out about when it ends
# (RS_PREFETCH_NEXT; 0: not). The GPU tests, outputs bit for bit, then alternating rounds against
# it off and against session 28's build (.dev/gpu/nvfp4dbg-old, commit 0fe5302).
set -uo pipefail
L=${LABEL:-s29c}
source bench/gpu-lib.sh
NOPF="NVFP4DBG_NVRTC_DEFINES=-DRS_PREFETCH_NEXT=0"
run_tests gpu_moe gpu_gemm
same_outputs nopf "$NOPF"
ab_rounds 4 layer_4096,gemm_prefill "default| nopf|$NOPF old|BIN=nvfp4dbg-old"
stamp done
pack
