#!/usr/bin/env bash
# Session 18, second final lease: the scatter quantizer encoding once per distinct gs1 (gpu_moe
# checks it bit for bit against the gather, gs1 all different / shared three ways / one), its
# duration under ncu, then the nightly, the bench and the peers on this build (LABEL s18g).
set -uo pipefail
L=s18h; source bench/gpu-lib.sh
run_tests gpu_moe
timeout 120 /usr/local/cuda/bin/ncu --clock-control none --metrics gpu__time_duration.sum --kernel-name regex:"quantize_f32_scatter" \
    --launch-count 3 --csv .dev/gpu/nvfp4dbg bench --device cuda --no-report-dir -q --quick --only layer_4096 > $R/ncu.csv 2> $R/ncu.err
stamp "ncu rc=$?"
grep -E "scatter" $R/ncu.csv | awk -F'","' '{print $5, $(NF)}' | head -4
pack
LABEL=s18g bash bench/gpu-run-final.sh
