#!/usr/bin/env bash
# Session 37, final lease: bench/gpu-run-final.sh (the nightly, the whole bench, the peers) on
# the session's final build, then the flat BF16 quantizer's tail at 3 of its 4 warps
# (QUANT_TAIL_WARPS=3, never measured: s36c measured 1 and 2) and at 2 warps over the last 10
# CTAs an SM (QUANT_TAIL=10) against the default (7 CTAs an SM at 2 warps): the quantize tests
# under each, then alternating rounds. Writes $OUT/$LABEL.tgz and $OUT/$LABEL-ab.tgz.
set -uo pipefail
LABEL=${LABEL:-s37b} NIGHTLY_S=${NIGHTLY_S:-400} bash bench/gpu-run-final.sh
L=${LABEL:-s37b}-ab
source bench/gpu-lib.sh
W3=NVFP4DBG_NVRTC_DEFINES=-DQUANT_TAIL_WARPS=3
T10=NVFP4DBG_NVRTC_DEFINES=-DQUANT_TAIL=10
for v in "w3 $W3" "t10 $T10"; do variant_tests $v gpu_quant; done
ab_rounds ${ROUNDS:-6} copy_d2d,quantize_bf16_reference,quantize_bf16_cuda_fast \
    "def|NVFP4DBG_NVRTC_DEFINES= w3|$W3 t10|$T10"
quant_rounds def w3 t10
stamp done
pack
