#!/usr/bin/env bash
# Session 18, second final lease: the scatter quantizer encoding once per distinct gs1 (gpu_moe
# checks it bit for bit against the gather, gs1 all different / shared three ways / one), its
# duration under ncu, then the nightly, the bench and the peers on this build (LABEL s18g).
set -uo pipefail
L=s18h; source bench/gpu-lib.sh
run_tests gpu_moe
ncu_layer 120 --kernel-name regex:"quantize_f32_scatter" --launch-count 3
grep -E "scatter" $R/ncu.csv | awk -F'","' '{print $5, $(NF)}' | head -4
pack
LABEL=s18g bash bench/gpu-run-final.sh
