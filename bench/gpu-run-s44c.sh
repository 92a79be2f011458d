#!/usr/bin/env bash
# Session 44, a short lease: the GPU tests the NaN rule touches (the reduction and the CUDA
# compare-weights engine against the CPU) first, then the quick bench's reductions, then the
# whole nightly as time allows. Writes $OUT/$LABEL.tgz after each step.
set -uo pipefail
L=${LABEL:-s44c}
source bench/gpu-lib.sh
nvidia-smi -L | tee $R/gpus.txt
run_tests gpu_quant gpu_compare_weights
timeout 60 .dev/gpu/nvfp4dbg bench --device cuda --quick --only copy_d2d,reduce \
    --no-report-dir -q > $R/bench-reduce.txt 2>&1
stamp "bench reductions rc=$?"
grep -E "│ [a-z_0-9]+ +│" $R/bench-reduce.txt | awk -F'│' '{print $2,$3,$5,$9}'
pack
NVFP4DBG_REPORTS=$R/nightly timeout ${NIGHTLY_S:-200} bash .ci/gpu-nightly .dev/gpu > $R/nightly.txt 2>&1
stamp "nightly rc=$?: $(grep -E 'GPU tests:|cases:' $R/nightly.txt | tail -2 | tr '\n' ' ')"
grep -E "FAILED|panicked" $R/nightly.txt | head -10
pack
