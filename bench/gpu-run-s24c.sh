#!/usr/bin/env bash
# Session 24, third lease: the 4096-token layer kernel by kernel on the final kernels (ncu's
# duration of each launch, clocks left alone; the first 300 launches of `bench --quick --only
# layer_4096`), to refresh session 18's table.
set -uo pipefail
L=${LABEL:-s24c}
source bench/gpu-lib.sh
export NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $NCU" | tee -a $R/log.txt
ncu_layer 400 --launch-count ${COUNT:-300}
tail -3 $R/ncu.err
pack
ncu_kernels > $R/kernels.txt
tail -40 $R/kernels.txt | cut -c1-150
pack
