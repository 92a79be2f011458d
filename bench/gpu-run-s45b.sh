#!/usr/bin/env bash
# Session 45, an H200 lease for the figures of session 44's build (s45a ran it on an H100):
# three quick rounds of the reductions (reduce.cu's acc_takes), then the whole bench and the
# PyTorch peers. Writes $OUT/$LABEL.tgz after each step.
set -uo pipefail
L=${LABEL:-s45b}
source bench/gpu-lib.sh
nvidia-smi -L | tee $R/gpus.txt
reduce_rounds 3
bench_and_peers
