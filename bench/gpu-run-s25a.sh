#!/usr/bin/env bash
# Session 25, first lease: the gate/up's SwiGLU + NVFP4 epilogue in a kernel of its own
# (-DRS_GU_SPLIT=1: the GEMM stores g and u in f32, moe_gate_up_epilogue_rs runs the epilogue at
# full occupancy). Its GPU tests, then the layer's outputs bit for bit against the default
# (layertest --save-outputs, prefill tiles: 512 tokens), then alternating rounds of the bench.
set -uo pipefail
L=${LABEL:-s25a}
source bench/gpu-lib.sh
S="NVFP4DBG_NVRTC_DEFINES=-DRS_GU_SPLIT=1"
variant_tests split "$S" gpu_gemm gpu_moe
ok=$?
same_outputs split "$S"
if [ $ok = 0 ]; then
    ab_rounds 4 gemm_prefill,layer_4096 "default| split|$S split3|$S~-DGU_EPI_MIN_BLOCKS=3"
fi
stamp done
pack
