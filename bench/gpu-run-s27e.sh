#!/usr/bin/env bash
# Session 27, fifth lease: router_topk's top-K on keys in registers (ROUTER_KEYS, default 1;
# 0 the shared-memory scan) and moe_offsets' unrolled loops. The nightly, the whole bench and
# the peers (bench/gpu-run-final.sh), then 3 alternating rounds of the layers against
# -DROUTER_KEYS=0 and ncu's time of the router's and the sort's kernels.
set -uo pipefail
L=${LABEL:-s27e}
LABEL=$L NIGHTLY_S=240 bash bench/gpu-run-final.sh
source bench/gpu-lib.sh
ab_rounds 3 layer_4096,layer_16 "default| scan|NVFP4DBG_NVRTC_DEFINES=-DROUTER_KEYS=0"
ncu="$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)"
for v in "default|NVFP4DBG_NVRTC_DEFINES=" "scan|NVFP4DBG_NVRTC_DEFINES=-DROUTER_KEYS=0"; do
    n=${v%%|*}
    env "${v#*|}" timeout 100 "$ncu" --metrics gpu__time_duration.sum -k regex:'moe_offsets|router_topk' -c 4 \
        .dev/gpu/nvfp4dbg bench --device cuda --quick --only layer_4096 --no-report-dir -q > $R/ncu-$n.txt 2>&1
    stamp "ncu $n rc=$?"
    grep -E "^  [a-z_0-9]+ \(|gpu__time_duration" $R/ncu-$n.txt | head -8
done
stamp done
pack
