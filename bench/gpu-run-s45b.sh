#!/usr/bin/env bash
# Session 45, an H200 lease for the figures of session 44's build (s45a ran it on an H100):
# three quick rounds of the reductions (reduce.cu's acc_takes), then the whole bench and the
# PyTorch peers. Writes $OUT/$LABEL.tgz after each step.
set -uo pipefail
L=${LABEL:-s45b}
source bench/gpu-lib.sh
nvidia-smi -L | tee $R/gpus.txt
reduce_rounds 3
timeout 120 .dev/gpu/nvfp4dbg bench --device cuda --no-report-dir -q --json $R/bench.json > $R/bench.txt 2>&1
stamp "bench rc=$?"
grep -E "│ [a-z_0-9]+ +│" $R/bench.txt | awk -F'│' '{print $2,$3,$5,$9}'
pack
timeout 70 python3 bench/peers.py --quick --json $R/peers.json > $R/peers.txt 2>&1
stamp "peers rc=$?"
grep -E "^(floor|moe|quantize|scan) " $R/peers.txt
pack
