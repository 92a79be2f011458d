#!/usr/bin/env bash
# Session 46: session 45's kernels (compare in batches, amax with one atomic a block) on an
# H200 for the first time. PART=1: the nightly (every GPU test, every case) and three quick
# rounds of the reductions; PART=2: the whole bench, the PyTorch peers and the e2e
# walkthrough. Two calls, each under the device's 600 s. Writes $OUT/$LABEL.tgz after each step.
set -uo pipefail
L=${LABEL:-s46a}
source bench/gpu-lib.sh
nvidia-smi -L | tee $R/gpus.txt
if [ "${PART:-1}" = 1 ]; then
    NIGHTLY_S=300 run_nightly
    reduce_rounds 3
else
    bench_and_peers
    timeout 100 bash tools/e2e/run_e2e.sh .dev/gpu/nvfp4dbg > $R/e2e.txt 2>&1
    stamp "e2e rc=$?: $(grep -E 'STEPS' $R/e2e.txt | tail -1)"
    grep -E "FAIL" $R/e2e.txt | head
    pack
fi
