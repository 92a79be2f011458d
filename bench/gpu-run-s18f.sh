#!/usr/bin/env bash
# Session 18, final lease: the nightly, the bench and the peers on the final build
# (bench/gpu-run-final.sh, LABEL s18f: the memory-bound kernels of the layer rewritten), then
# compute-sanitizer's memcheck and racecheck on gpu_gemm's ragged-experts test (which runs
# moe_rows_bf16_rs, now staging each warp's chunks in shared memory, before the register-A
# kernels), each under a time limit.
set -uo pipefail
LABEL=${LABEL:-s18f} bash bench/gpu-run-final.sh
L=s18s
source bench/gpu-lib.sh
sanitize memcheck racecheck
stamp total
