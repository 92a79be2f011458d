#!/usr/bin/env bash
# session 12, last device call: the cuBLAS ceilings back to the short warm-up (s12e: 643 / 661
# TFLOP/s after 100 ms of it, torch 782 / 785 in the same lease); the whole bench and the peers
# (bench/gpu-run-final.sh PART=bench), then a second whole bench for the spread.
set -uo pipefail
L=${LABEL:-s12f}
source bench/gpu-lib.sh
PART=bench LABEL=$L-bench bash bench/gpu-run-final.sh
timeout 90 .dev/gpu/nvfp4dbg bench --device cuda --no-report-dir -q --json $R/bench-2.json > $R/bench-2.txt 2>&1
stamp "bench 2 rc=$?"
grep -E "│ [a-z_0-9]+ +│" $R/bench-2.txt | awk -F'│' '{print $2,$3,$5,$9}'
pack
stamp total
