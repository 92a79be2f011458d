#!/usr/bin/env bash
# Session 37, third lease: the bench's compute ceiling and its cuBLAS expert peer now write BF16
# (they wrote FP32, which held the ceiling ~4% under torch's in s37b). The bench's own GPU tests,
# then the whole bench and the peers (bench/gpu-run-final.sh PART=bench). Writes $OUT/$LABEL.tgz.
set -uo pipefail
L=${LABEL:-s37c}
source bench/gpu-lib.sh
run_tests gpu_bench_cmd
PART=bench LABEL=$L-final bash bench/gpu-run-final.sh
stamp done
pack
