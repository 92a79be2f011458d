#!/usr/bin/env bash
# Session 36, final lease: bench/gpu-run-final.sh (the nightly, the whole bench, the peers), then
# compute-sanitizer (memcheck, racecheck) on the BF16 quantizer's bit-exactness test, whose
# shapes now take the flat path's tail CTAs (2 warps' runs) and, at [1100, 4096], the CTAs of
# 4 warps' runs before them. Writes $OUT/$LABEL.tgz and $OUT/$LABEL-san.tgz.
set -uo pipefail
LABEL=${LABEL:-s36f} NIGHTLY_S=${NIGHTLY_S:-400} bash bench/gpu-run-final.sh
L=${LABEL:-s36f}-san
source bench/gpu-lib.sh
for tool in memcheck racecheck; do
    timeout 120 compute-sanitizer --tool $tool --print-limit 20 .dev/gpu/gpu_quant --ignored --nocapture \
        --test-threads 1 nvfp4_bf16_input_and_swizzled_scales_are_bit_exact > $R/$tool.txt 2>&1
    stamp "compute-sanitizer $tool rc=$?: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|^test result' $R/$tool.txt | tr '\n' ' ')"
    pack
done
stamp done
