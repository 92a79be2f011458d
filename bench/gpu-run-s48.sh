#!/usr/bin/env bash
# Session 48, the final build (audit of vLLM-fused dumps, layertest's refusals, compare-outputs' dump check,
# compare-weights' layouts): the nightly and the e2e walkthrough, the CUDA dumps under the dump check,
# then the whole bench and the PyTorch peers, on whatever card the lease brings
# (the ratios are taken within the run). Writes $OUT/$LABEL.tgz after each step.
set -uo pipefail
L=${LABEL:-s48a}
source bench/gpu-lib.sh
nvidia-smi -L | tee $R/gpus.txt
NIGHTLY_S=250 run_nightly
timeout 100 bash tools/e2e/run_e2e.sh .dev/gpu/nvfp4dbg > $R/e2e.txt 2>&1
stamp "e2e rc=$?: $(grep -E 'STEPS' $R/e2e.txt | tail -1)"
grep -E "UNEXPECTED" $R/e2e.txt | head -12
pack
timeout 150 bash bench/dump-check-gpu.sh /tmp/dumpcheck $PWD/.dev/gpu/nvfp4dbg > $R/dump-check.txt 2>&1
stamp "dump check rc=$?"
grep -E "rc=[1-9]|compare-outputs .* rc=|worst row" $R/dump-check.txt | cut -c1-220 | head -30
pack
bench_and_peers
