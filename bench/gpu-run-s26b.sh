#!/usr/bin/env bash
# Session 26, second lease: the down projection's CTA over 2, 4 or 7 column blocks of one token
# tile (RS_COLS_DOWN; the ring and the weight registers run on across the blocks). The GPU
# tests and the bit-for-bit layertest check under 2, then 4 alternating rounds of the layer and
# the prefill GEMMs against the default (1). Needs commit 3708b53 checked out (the knob was
# removed in 0a78e80: slower, BENCHMARKS.md session 26).
set -uo pipefail
L=${LABEL:-s26b}
source bench/gpu-lib.sh
V="NVFP4DBG_NVRTC_DEFINES=-DRS_COLS_DOWN"
variant_tests cols2 "$V=2" gpu_gemm gpu_moe
ok=$?
same_outputs cols2 "$V=2"
if [ $ok = 0 ]; then
    ab_rounds 4 gemm_prefill,layer_4096 "default| cols2|$V=2 cols4|$V=4 cols7|$V=7"
fi
stamp done
pack
