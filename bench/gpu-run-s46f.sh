#!/usr/bin/env bash
# Session 46, only on an H200 (every other lease of the session was an H100): the reductions
# (the amax's first H200 figure), the whole bench and the peers, then the nightly, on the
# session's final build. On any other card it says so and stops.
set -uo pipefail
L=${LABEL:-s46f}
source bench/gpu-lib.sh
nvidia-smi -L | tee $R/gpus.txt
grep -q H200 $R/gpus.txt || { echo "not an H200: nothing run"; pack; exit 0; }
reduce_rounds 3
bench_and_peers
NIGHTLY_S=250 run_nightly
