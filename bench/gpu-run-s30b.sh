#!/usr/bin/env bash
# Session 30, second lease: each kernel of one 4096-token layer forward alone (ncu, kernels
# serialized: its duration, DRAM bytes and SM throughput), and the shared expert beside the
# routed experts against after them (NVFP4DBG_SHARED_STREAM=0).
set -uo pipefail
L=${LABEL:-s30b}
source bench/gpu-lib.sh
NCU="${NCU:-$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)}"
timeout 240 "$NCU" --clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size \
    -c 45 --csv .dev/gpu/nvfp4dbg bench --device cuda --quick --only layer_4096_eager --no-report-dir -q > $R/ncu-layer.csv 2> $R/ncu-layer.err
stamp "ncu rc=$?"
pack
ab_rounds 3 layer_4096 "default| sharedafter|NVFP4DBG_SHARED_STREAM=0"
stamp done
pack
