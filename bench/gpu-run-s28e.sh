#!/usr/bin/env bash
# Session 28, last lease: compute-sanitizer memcheck on the GPU tests that run this session's
# new device code: the gate/up epilogue writing the down's 16-bit rows (gpu_moe's expert-input
# test, fixed and dynamic gs, decode and prefill batches) and the router's keys kernels
# (gpu_moe's exact-logits router test, every router_topk path).
set -uo pipefail
L=${LABEL:-s28e}
source bench/gpu-lib.sh
for t in router_decides_ties_and_nan_like_the_cpu_on_exact_logits expert_inputs_scattered_token_by_token_equal_the_gather; do
    timeout ${SAN_S:-230} compute-sanitizer --tool memcheck --print-limit 20 .dev/gpu/gpu_moe --ignored --nocapture \
        --test-threads 1 --exact $t > $R/memcheck-$t.txt 2>&1
    stamp "memcheck $t rc=$?: $(grep -E 'ERROR SUMMARY|^test result' $R/memcheck-$t.txt | tr '\n' ' ')"
    pack
done
