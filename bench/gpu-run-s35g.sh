#!/usr/bin/env bash
# Session 35, last lease: compute-sanitizer (memcheck, racecheck, synccheck) on the BF16
# quantizer's bit-exactness test (gpu_quant: the flat path's whole and part-full warps, the
# general path's swizzled scales), on session 35's final kernel.
set -uo pipefail
L=${LABEL:-s35g}
source bench/gpu-lib.sh
for tool in memcheck racecheck synccheck; do
    timeout 150 compute-sanitizer --tool $tool --print-limit 20 .dev/gpu/gpu_quant --ignored --nocapture \
        --test-threads 1 nvfp4_bf16_input_and_swizzled_scales_are_bit_exact > $R/$tool.txt 2>&1
    stamp "compute-sanitizer $tool rc=$?: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|^test result' $R/$tool.txt | tr '\n' ' ')"
    pack
done
stamp done
