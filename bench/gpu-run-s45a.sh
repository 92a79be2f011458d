#!/usr/bin/env bash
# Session 45, one lease for everything: the GPU tests the NaN rule touched (s44c), the quick
# bench's reductions, the nightly, the whole bench and the PyTorch peers, then the e2e
# walkthrough. Writes $OUT/$LABEL.tgz after each step.
set -uo pipefail
L=${LABEL:-s45a}
source bench/gpu-lib.sh
nvidia-smi -L | tee $R/gpus.txt
run_tests gpu_quant gpu_compare_weights
reduce_rounds 3
NIGHTLY_S=220 run_nightly
bench_and_peers
timeout 100 bash tools/e2e/run_e2e.sh .dev/gpu/nvfp4dbg > $R/e2e.txt 2>&1
stamp "e2e rc=$?: $(grep -E 'STEPS' $R/e2e.txt | tail -1)"
grep -E "FAIL" $R/e2e.txt | head
pack
