#!/usr/bin/env bash
# Session 30, third lease: the shared expert's cuBLAS GEMMs (side stream) held to fewer
# multiprocessors (cublasSetSmCountTarget; NVFP4DBG_SIDE_SMS, this lease's experiment), so that
# the memory-bound prologue beside them gets the rest, against the default (all of them).
# That build only: not kept (BENCHMARKS.md, session 30).
set -uo pipefail
L=${LABEL:-s30c}
source bench/gpu-lib.sh
NCU="${NCU:-$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)}"
NVFP4DBG_SIDE_SMS=100 timeout 120 "$NCU" --clock-control none --metrics gpu__time_duration.sum,launch__grid_size \
    -k regex:nvjet -c 6 --csv .dev/gpu/nvfp4dbg bench --device cuda --quick --only layer_4096_eager --no-report-dir -q > $R/ncu-nvjet.csv 2>&1
stamp "ncu rc=$?"
grep -E "grid_size|duration" $R/ncu-nvjet.csv | awk -F'","' '{print $5, $(NF-2), $NF}' | head -12
ab_rounds 3 layer_4096 "default| s112|NVFP4DBG_SIDE_SMS=112 s100|NVFP4DBG_SIDE_SMS=100 s88|NVFP4DBG_SIDE_SMS=88 s66|NVFP4DBG_SIDE_SMS=66"
stamp done
pack
