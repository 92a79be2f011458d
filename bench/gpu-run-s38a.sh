#!/usr/bin/env bash
# Session 38, one lease: the nightly, the whole `nvfp4dbg bench` and the PyTorch peers
# (bench/gpu-run-final.sh), then the end-to-end walkthrough (tools/e2e/run_e2e.sh), on the
# session's build after the CPU-side changes (compare-weights' pairing trial, audit across
# layers, bisect's one read, the helper's diagnoses). Writes $OUT/$LABEL.tgz and
# $OUT/$LABEL-e2e.tgz.
set -uo pipefail
LABEL=${LABEL:-s38a}
LABEL=$LABEL NIGHTLY_S=${NIGHTLY_S:-330} bash bench/gpu-run-final.sh
L=$LABEL-e2e
source bench/gpu-lib.sh
OUT=$OUT timeout 200 bash tools/e2e/run_e2e.sh .dev/gpu/nvfp4dbg > $R/e2e.txt 2>&1
stamp "e2e rc=$?: $(grep -E 'STEPS' $R/e2e.txt | tail -1)"
pack
