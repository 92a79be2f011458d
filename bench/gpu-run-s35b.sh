#!/usr/bin/env bash
# Session 35, second lease: the BF16 quantizer's global scale read before the group's loads
# (QUANT_GS_EARLY=1, the new default; one instantiation of group_quantize_fl for the warp-wide
# and the per-thread paths) against the same kernel reading it after them (QUANT_GS_EARLY=0)
# and the build before (BIN=nvfp4dbg-old: commit fde5d5b's stripped target/release/nvfp4dbg,
# copied into .dev/gpu by hand). The GPU quantize and MoE tests on the new default and on
# QUANT_GS_EARLY=0, then alternating bench rounds of the quantize figures.
set -uo pipefail
L=${LABEL:-s35b}
source bench/gpu-lib.sh
GS0=NVFP4DBG_NVRTC_DEFINES=-DQUANT_GS_EARLY=0
run_tests gpu_quant gpu_moe
variant_tests gs0 $GS0 gpu_quant
ab_rounds ${ROUNDS:-10} copy_d2d,quantize_bf16_reference,quantize_bf16_cuda_fast \
    "new|NVFP4DBG_NVRTC_DEFINES= gs0|$GS0 old|BIN=nvfp4dbg-old"
stamp done
pack
