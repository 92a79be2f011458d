#!/usr/bin/env bash
# Session 21, fourth lease: where the register-A gate/up GEMM's time goes under the router's
# uneven load (the layer: 349 tiles, a third of them 64 tokens or fewer) against the uniform
# figure (256 tiles of 128): ncu --set full on one launch of each, the warp-state stalls and the
# pipe utilizations side by side.
set -uo pipefail
L=${LABEL:-s21d}
source bench/gpu-lib.sh
NCU="$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)"
for v in "uniform|gemm_prefill_4096_gate_up" "layer|layer_4096_eager"; do
    n=${v%%|*}
    timeout 150 "$NCU" --clock-control none --set full -k regex:gate_up_nvfp4_sm90rs -s 1 -c 1 -f \
        -o $R/ncu-$n .dev/gpu/nvfp4dbg bench --device cuda --quick --only ${v#*|} \
        --no-report-dir -q > $R/ncu-$n-run.txt 2>&1
    stamp "ncu $n rc=$?"
    "$NCU" --import $R/ncu-$n.ncu-rep --page details > $R/ncu-$n-details.txt 2>&1
    "$NCU" --import $R/ncu-$n.ncu-rep --page raw --csv > $R/ncu-$n-raw.csv 2>&1
    pack
done
for n in uniform layer; do echo "== $n"; grep -E "Duration|Throughput|Registers|Achieved Occupancy|No Eligible|Issued Warp|Warp Cycles Per Issued|Issue Slots Busy|Executed Ipc" $R/ncu-$n-details.txt | head -30; done
stamp total
pack
