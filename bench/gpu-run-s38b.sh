#!/usr/bin/env bash
# Session 38, last lease: the nightly and the end-to-end walkthrough on the session's final
# build (the three helpers' diagnoses merged after s38a). Writes $OUT/$LABEL.tgz and
# $OUT/$LABEL-e2e.tgz. PART=all adds the whole bench and the PyTorch peers before the e2e
# (bench/gpu-run-final.sh; nightly, bench, peers and e2e ~330 s).
set -uo pipefail
LABEL=${LABEL:-s38b}
PART=${PART:-nightly} LABEL=$LABEL NIGHTLY_S=${NIGHTLY_S:-330} bash bench/gpu-run-final.sh
L=$LABEL-e2e
source bench/gpu-lib.sh
OUT=$OUT timeout 200 bash tools/e2e/run_e2e.sh .dev/gpu/nvfp4dbg > $R/e2e.txt 2>&1
stamp "e2e rc=$?: $(grep -E 'STEPS' $R/e2e.txt | tail -1)"
pack
