#!/usr/bin/env bash
# Session 37, last lease: the nightly and the end-to-end walkthrough (tools/e2e/run_e2e.sh) on
# the session's final build (the helpers' probe-c and probe-d fixes merged). Writes
# $OUT/$LABEL.tgz and $OUT/e2e-logs.tar.gz.
set -uo pipefail
LABEL=${LABEL:-s37d}
PART=nightly LABEL=$LABEL NIGHTLY_S=${NIGHTLY_S:-330} bash bench/gpu-run-final.sh
L=$LABEL-e2e
source bench/gpu-lib.sh
OUT=$OUT timeout 240 bash tools/e2e/run_e2e.sh .dev/gpu/nvfp4dbg > $R/e2e.txt 2>&1
stamp "e2e rc=$?: $(grep -E 'STEPS' $R/e2e.txt | tail -1)"
pack
