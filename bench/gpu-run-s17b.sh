#!/usr/bin/env bash
# Session 17, final lease: the nightly, the bench and the peers on the final build
# (bench/gpu-run-final.sh, LABEL s17f: the register-A K loop with its explicit reconvergence),
# then compute-sanitizer's synccheck and racecheck on gpu_gemm's ragged-experts test (the
# register-A kernels at tile widths 32 to 160 tokens), each under a time limit.
set -uo pipefail
LABEL=${LABEL:-s17f} bash bench/gpu-run-final.sh
L=s17s
source bench/gpu-lib.sh
for tool in synccheck racecheck; do
    timeout ${SAN_S:-150} compute-sanitizer --tool $tool --print-limit 20 .dev/gpu/gpu_gemm --ignored --nocapture \
        --test-threads 1 wgmma_prefill_gemm_matches_mma_sync_and_the_cpu_on_ragged_experts > $R/$tool.txt 2>&1
    stamp "compute-sanitizer $tool rc=$?: $(grep -E 'ERROR SUMMARY|^test result' $R/$tool.txt | tr '\n' ' ')"
    pack
done
stamp total
