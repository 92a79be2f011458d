#!/usr/bin/env bash
# Session 18: the scatter quantizer with its slots' rows and scales loaded up front (gpu_moe
# checks it bit for bit against the gather), its duration under ncu, then the shared expert
# beside the routed ones (default) against after them (NVFP4DBG_SHARED_STREAM=0), alternating.
L=${L:-s18d}; source bench/gpu-lib.sh
run_tests gpu_moe
ncu_layer 120 --kernel-name regex:"scatter|rows_bf16" --launch-count 6
grep -E "scatter|rows_bf16" $R/ncu.csv | awk -F'","' '{print $5, $(NF)}' | head -8
pack
ab_rounds 3 layer "beside|NVFP4DBG_SHARED_STREAM=1 serial|NVFP4DBG_SHARED_STREAM=0"
pack
