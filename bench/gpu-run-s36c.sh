#!/usr/bin/env bash
# Session 36, third lease: the flat BF16 quantizer's tail. s36a/s36b put its per-launch cost at
# ~6.4 us against ~4.1 for the driver's copy of its bytes, its marginal rate at 1.06 of
# copy_d2d: the drain, an SM's loaded-but-not-yet-encoded runs when the last loads land. The
# last QUANT_TAIL CTAs per SM run QUANT_TAIL_WARPS of their 4 warps' runs (host-side grid,
# src/backend/cuda/quant.rs): 7 and 14 a SM at 2 warps, 7 at 1. The quantize tests under each
# (bit-exact against the CPU at [8192, 7168] and part-full shapes), then alternating rounds.
set -uo pipefail
L=${LABEL:-s36c}
source bench/gpu-lib.sh
A=NVFP4DBG_NVRTC_DEFINES=-DQUANT_TAIL=7
B=NVFP4DBG_NVRTC_DEFINES=-DQUANT_TAIL=14
C=NVFP4DBG_NVRTC_DEFINES=-DQUANT_TAIL=7~-DQUANT_TAIL_WARPS=1
run_tests gpu_quant
for v in "t7w2 $A" "t14w2 $B" "t7w1 $C"; do variant_tests $v gpu_quant; done
ab_rounds ${ROUNDS:-8} copy_d2d,quantize_bf16_reference,quantize_bf16_cuda_fast \
    "def|NVFP4DBG_NVRTC_DEFINES= t7w2|$A t14w2|$B t7w1|$C"
quant_rounds def t7w2 t14w2 t7w1
stamp done
pack
