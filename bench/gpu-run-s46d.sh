#!/usr/bin/env bash
# Session 46, the final build (the audit fixes: compare-weights' one-encoding rule, nan-locate's
# NaN input, routing's declared rate): the nightly and the e2e walkthrough on any card; on an
# H200 also three rounds of the reductions, the whole bench and the peers (session 45's kernels
# there for the first time). Writes $OUT/$LABEL.tgz after each step.
set -uo pipefail
L=${LABEL:-s46d}
source bench/gpu-lib.sh
nvidia-smi -L | tee $R/gpus.txt
NIGHTLY_S=250 run_nightly
timeout 100 bash tools/e2e/run_e2e.sh .dev/gpu/nvfp4dbg > $R/e2e.txt 2>&1
stamp "e2e rc=$?: $(grep -E 'STEPS' $R/e2e.txt | tail -1)"
grep -E "FAIL|UNEXPECTED" $R/e2e.txt | head -12
pack
grep -q H200 $R/gpus.txt || exit 0
reduce_rounds 3
bench_and_peers
