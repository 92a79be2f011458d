#!/usr/bin/env bash
# Session 24, second lease: the register-A GEMMs with a producer warpgroup (-DRS_PRODUCER=1: a
# third warpgroup dequantizes the weights into a shared-memory ring, the two consumer warpgroups
# only load their fragments and issue the MMAs). Its GPU tests first (short limits: a protocol
# fault would hang), then 3 alternating rounds against the default and against the default
# without wide tiles (the producer variant has none: NVFP4DBG_RS_SLACK=0).
set -uo pipefail
L=${LABEL:-s24b}
source bench/gpu-lib.sh
P="NVFP4DBG_NVRTC_DEFINES=-DRS_PRODUCER=1"
if variant_tests prod "$P" gpu_gemm gpu_moe; then
    ab_rounds 3 gemm_prefill,layer_4096 "default| prod|$P noslack|NVFP4DBG_RS_SLACK=0"
fi
stamp done
pack
