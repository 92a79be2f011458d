#!/usr/bin/env bash
# Session 16, final lease: the nightly, the bench and the peers on the final build
# (bench/gpu-run-final.sh, LABEL s16f), then where s16b's hang was: the build of b2f8762
# (.dev/gpu/nvfp4dbg-h; its register-A K loop was a template over the register ring's depth,
# the same semantics as the final kernel, other register allocation), whose bench did not
# finish in 120 s in 3 of 3 runs, timed figure by figure with a short limit.
set -uo pipefail
LABEL=${LABEL:-s16f} bash bench/gpu-run-final.sh
L=s16h
source bench/gpu-lib.sh
for only in gemm_prefill layer_4096; do
    timeout ${HANG_S:-45} .dev/gpu/nvfp4dbg-h bench --device cuda --no-report-dir -q --quick \
        --only $only --json $R/h-$only.json > $R/h-$only.txt 2>&1
    stamp "b2f8762 bench --only $only rc=$?"
    pack
done
stamp total
