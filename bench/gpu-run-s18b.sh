#!/usr/bin/env bash
# Session 18: where the 4096-token layer's time goes kernel by kernel: ncu's duration of each
# kernel (clocks left alone), the first 700 launches of `bench --quick --only layer_4096`.
L=s18b; source bench/gpu-lib.sh
export NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $NCU" | tee -a $R/log.txt
ncu_layer 400 --launch-count ${COUNT:-700}
tail -5 $R/ncu.err
pack
ncu_kernels
