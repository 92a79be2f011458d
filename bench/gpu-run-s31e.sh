#!/usr/bin/env bash
# Session 31, fifth lease: the register-A down chained to the gate/up (launched early, each CTA
# waiting for its own row tile's gate/up CTAs: rs_wait_rows / rs_publish_rows). PART=ab: the
# prefill GPU tests, `layertest` outputs byte for byte against NVFP4DBG_RS_CHAIN=0, then
# alternating layer rounds; PART=final: the nightly and the layer figures of the bench. (The
# chain and NVFP4DBG_RS_CHAIN are in commit 7f6ea52 only.)
set -uo pipefail
L=${LABEL:-s31e}-${PART:-ab}
source bench/gpu-lib.sh
case ${PART:-ab} in
ab)
    run_tests gpu_moe gpu_gemm gpu_graph
    same_outputs unchained NVFP4DBG_RS_CHAIN=0
    ab_rounds ${ROUNDS:-4} layer_4096 "chain| unchained|NVFP4DBG_RS_CHAIN=0"
    ;;
final)
    NIGHTLY_S=${NIGHTLY_S:-400} run_nightly
    timeout 120 .dev/gpu/nvfp4dbg bench --device cuda --no-report-dir -q --only floors,layer_4096_eager,layer_4096_graph \
        --json $R/bench.json > $R/bench.txt 2>&1
    stamp "bench rc=$?"
    grep -E "│ [a-z_0-9]+ +│" $R/bench.txt | awk -F'│' '{print $2,$3,$5,$9}'
    ;;
esac
stamp done
pack
