#!/usr/bin/env bash
# (Measured and dropped: the knob and its code were removed after this lease; the lease ran on commit e7ca007.)
# Session 35, first lease: the BF16 quantizer's codes stored warp-wide (QUANT_STORE_WARP=1, the
# new default: 512 contiguous bytes a store instruction through the transposition's slots)
# against each lane storing its own 32 bytes (QUANT_STORE_WARP=0, the code before). The GPU
# quantize and MoE tests on the new default, the old path's quantize tests, then alternating
# bench rounds of the quantize figures (and the copy they are divided by).
set -uo pipefail
L=${LABEL:-s35a}
source bench/gpu-lib.sh
OLD=NVFP4DBG_NVRTC_DEFINES=-DQUANT_STORE_WARP=0
run_tests gpu_quant gpu_moe
variant_tests old $OLD gpu_quant
ab_rounds ${ROUNDS:-8} copy_d2d,quantize_bf16_reference,quantize_bf16_cuda_fast \
    "new|NVFP4DBG_NVRTC_DEFINES= old|$OLD"
stamp done
pack
