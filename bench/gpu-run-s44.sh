#!/usr/bin/env bash
# Session 44's last lease: the nightly, the whole `nvfp4dbg bench` and the PyTorch peers
# (bench/gpu-run-final.sh), then the end-to-end walkthrough, on the build of
# `bash .ci/gpu-nightly --package .dev/gpu`. Writes $OUT/$LABEL.tgz and $OUT/$LABEL-e2e.tgz.
set -uo pipefail
LABEL=${LABEL:-s44b}
PART=all LABEL=$LABEL NIGHTLY_S=${NIGHTLY_S:-300} bash bench/gpu-run-final.sh
L=$LABEL-e2e
source bench/gpu-lib.sh
OUT=$OUT timeout 200 bash tools/e2e/run_e2e.sh .dev/gpu/nvfp4dbg > $R/e2e.txt 2>&1
stamp "e2e rc=$?: $(grep -E 'STEPS' $R/e2e.txt | tail -1)"
pack
