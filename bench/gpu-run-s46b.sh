#!/usr/bin/env bash
# Session 46: everything of s46a in one call, only on an H200 (session 45's kernels have had
# their nightly only on H100s): the nightly, three rounds of the reductions, the whole bench,
# the peers, the e2e. On any other card it says so and stops.
set -uo pipefail
L=${LABEL:-s46b}
source bench/gpu-lib.sh
nvidia-smi -L | tee $R/gpus.txt
grep -q H200 $R/gpus.txt || { echo "not an H200: nothing run"; pack; exit 0; }
NIGHTLY_S=250 run_nightly
reduce_rounds 3
bench_and_peers
timeout 100 bash tools/e2e/run_e2e.sh .dev/gpu/nvfp4dbg > $R/e2e.txt 2>&1
stamp "e2e rc=$?: $(grep -E 'STEPS' $R/e2e.txt | tail -1)"
grep -E "FAIL" $R/e2e.txt | head
pack
