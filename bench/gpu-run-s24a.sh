#!/usr/bin/env bash
# Session 24, first lease: the nightly and gpu_bench on the final commit of session 23
# (7aaefe8: set_hidden's BF16 scan and copy only where the buffer exists), which no GPU had run.
set -uo pipefail
L=${LABEL:-s24a}
source bench/gpu-lib.sh
run_tests gpu_bench
NIGHTLY_S=300 run_nightly
stamp done
