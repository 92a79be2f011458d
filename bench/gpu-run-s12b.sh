#!/usr/bin/env bash
# session 12, second device call: (1) ncu on the register-A prefill GEMMs, the default against
# RS_WIDE (s12a: wide 7.09 against 6.02 ms, tile_model.py had predicted 0.89x); (2) the whole
# bench and the PyTorch peers (bench/gpu-run-final.sh PART=bench).
set -uo pipefail
L=${LABEL:-s12b}
source bench/gpu-lib.sh
NCU="$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)"
for v in "default|" "wide|-DRS_WIDE=1"; do
    n=${v%%|*}
    NVFP4DBG_NVRTC_DEFINES="${v#*|}" timeout 100 "$NCU" --clock-control none --set full -k regex:sm90rs -c 2 -f \
        -o $R/ncu-$n .dev/gpu/nvfp4dbg bench --device cuda --quick --only gemm_prefill_4096_down \
        --no-report-dir -q > $R/ncu-$n-run.txt 2>&1
    stamp "ncu $n rc=$?"
    "$NCU" --import $R/ncu-$n.ncu-rep --page details > $R/ncu-$n-details.txt 2>&1
    "$NCU" --import $R/ncu-$n.ncu-rep --page raw --csv > $R/ncu-$n-raw.csv 2>&1
    pack
done
for n in default wide; do echo "== $n"; grep -E "^  [a-z_]|Duration|Throughput|Registers|Occupancy|No Eligible|Issued Warp|Warp Cycles|Shared Memory Config|Block Limit|Bank" $R/ncu-$n-details.txt | head -60; done
PART=bench LABEL=$L-bench bash bench/gpu-run-final.sh
cp $OUT/$L-bench.tgz $R/ 2>/dev/null; pack
stamp total
