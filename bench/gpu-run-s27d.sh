#!/usr/bin/env bash
# Session 27, last lease, on the session's final kernels (nvfp4_rows_scatter_* and the parallel
# moe_offsets): the nightly, the whole bench and the peers (bench/gpu-run-final.sh), then 3
# alternating rounds of the layer against the expert inputs through their codes (the path
# before this session) and ncu's time of the sort's kernels.
set -uo pipefail
L=${LABEL:-s27d}
LABEL=$L NIGHTLY_S=240 bash bench/gpu-run-final.sh
source bench/gpu-lib.sh
ab_rounds 3 layer_4096 "default| codes|NVFP4DBG_RS_ROWS=codes"
ncu="$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)"
timeout 100 "$ncu" --metrics gpu__time_duration.sum -k regex:'moe_offsets|moe_chunk_counts|moe_scatter|router_topk' -c 8 \
    .dev/gpu/nvfp4dbg bench --device cuda --quick --only layer_4096 --no-report-dir -q > $R/ncu-sort.txt 2>&1
stamp "ncu sort rc=$?"
grep -E "^  [a-z_0-9]+ \(|gpu__time_duration" $R/ncu-sort.txt | head -16
stamp done
pack
