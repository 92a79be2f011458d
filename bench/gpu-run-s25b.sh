#!/usr/bin/env bash
# Session 25, second lease: under -DRS_GU_SPLIT=1, the layer's gate/up GEMM and the epilogue
# kernel of its own, each launch alone (ncu's duration, clocks left alone), as s24c timed the
# default's kernels.
set -uo pipefail
L=${LABEL:-s25b}
source bench/gpu-lib.sh
export NVFP4DBG_NVRTC_DEFINES=-DRS_GU_SPLIT=1
export NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $NCU" | tee -a $R/log.txt
ncu_layer 300 --launch-count ${COUNT:-120}
tail -3 $R/ncu.err
pack
ncu_kernels > $R/kernels.txt
grep -E "gate_up|epilogue_rs|rows_bf16" $R/kernels.txt | head -30 | cut -c1-150
pack
