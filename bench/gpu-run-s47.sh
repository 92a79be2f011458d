#!/usr/bin/env bash
# Session 47, the final build (quantize's gate/up option and refusals, gs-sweep's expert check,
# bisect's step pairing and call alignment, audit's new findings): the nightly and the e2e
# walkthrough, then the whole bench and the PyTorch peers, on whatever card the lease brings
# (the ratios are taken within the run). Writes $OUT/$LABEL.tgz after each step.
set -uo pipefail
L=${LABEL:-s47b}
source bench/gpu-lib.sh
nvidia-smi -L | tee $R/gpus.txt
NIGHTLY_S=250 run_nightly
timeout 100 bash tools/e2e/run_e2e.sh .dev/gpu/nvfp4dbg > $R/e2e.txt 2>&1
stamp "e2e rc=$?: $(grep -E 'STEPS' $R/e2e.txt | tail -1)"
grep -E "UNEXPECTED" $R/e2e.txt | head -12
pack
bench_and_peers
