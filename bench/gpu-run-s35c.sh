#!/usr/bin/env bash
# Session 35, third lease: the flat BF16 tensor on a path of its own (QUANT_FLAT_PATH=1, the new
# default: its warp-wide loads issued ~30 instructions into the thread instead of ~90) against
# the general path for it (QUANT_FLAT_PATH=0: s35b's new kernel) and the build before session
# 35's quantizer changes (BIN=nvfp4dbg-old: commit fde5d5b, copied into .dev/gpu by hand). The
# GPU quantize and MoE tests on the new default and on QUANT_FLAT_PATH=0, then alternating
# bench rounds of the quantize figures.
set -uo pipefail
L=${LABEL:-s35c}
source bench/gpu-lib.sh
FP0=NVFP4DBG_NVRTC_DEFINES=-DQUANT_FLAT_PATH=0
run_tests gpu_quant gpu_moe
variant_tests fp0 $FP0 gpu_quant
ab_rounds ${ROUNDS:-10} copy_d2d,quantize_bf16_reference,quantize_bf16_cuda_fast \
    "new|NVFP4DBG_NVRTC_DEFINES= fp0|$FP0 old|BIN=nvfp4dbg-old"
stamp done
pack
