#!/usr/bin/env bash
# Session 23, third lease: the fix of s23b's gpu_bench failure (the BF16 input copy on a layer
# without shared expert and with an FP32 router), then the nightly, the whole bench and the
# peers on this build (bench/gpu-run-final.sh).
set -uo pipefail
L=${LABEL:-s23c}
source bench/gpu-lib.sh
run_tests gpu_bench gpu_moe
LABEL=$L-final NIGHTLY_S=240 bash bench/gpu-run-final.sh
