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
for tool in memcheck racecheck; do
    timeout ${SAN_S:-150} compute-sanitizer --tool $tool --print-limit 20 .dev/gpu/gpu_gemm --ignored --nocapture \
        --test-threads 1 wgmma_prefill_gemm_matches_mma_sync_and_the_cpu_on_ragged_experts > $R/$tool.txt 2>&1
    stamp "compute-sanitizer $tool rc=$?: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|^test result' $R/$tool.txt | tr '\n' ' ')"
    pack
done
stamp total
