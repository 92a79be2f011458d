#!/usr/bin/env bash
# Session 17, final lease: the nightly, the bench and the peers on the final build
# (bench/gpu-run-final.sh, LABEL s17f: the register-A K loop with its explicit reconvergence),
# then compute-sanitizer's synccheck and racecheck on gpu_gemm's ragged-experts test (the
# register-A kernels at tile widths 32 to 160 tokens), each under a time limit.
set -uo pipefail
LABEL=${LABEL:-s17f} bash bench/gpu-run-final.sh
L=s17s
source bench/gpu-lib.sh
sanitize synccheck racecheck
stamp total
