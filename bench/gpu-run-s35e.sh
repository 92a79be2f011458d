#!/usr/bin/env bash
# Session 35, fifth lease: the CTA size and CTAs per SM of the BF16 quantizer re-swept on
# session 35's kernel (gs read early, the flat path of its own; commit of this script): 128
# threads at 8 CTAs an SM (64 registers, the default), 64 threads at 16, 256 at 4, and 128 at
# 7 (72 registers) and 6 (80). The quantize tests under each, then alternating bench rounds.
set -uo pipefail
L=${LABEL:-s35e}
source bench/gpu-lib.sh
T64=NVFP4DBG_NVRTC_DEFINES=-DQUANT_BF16_THREADS=64
T256=NVFP4DBG_NVRTC_DEFINES=-DQUANT_BF16_THREADS=256
MB7=NVFP4DBG_NVRTC_DEFINES=-DQUANT_MIN_BLOCKS=7
MB6=NVFP4DBG_NVRTC_DEFINES=-DQUANT_MIN_BLOCKS=6
run_tests gpu_quant
for v in "t64 $T64" "t256 $T256" "mb7 $MB7" "mb6 $MB6"; do variant_tests $v gpu_quant; done
ab_rounds ${ROUNDS:-8} copy_d2d,quantize_bf16_reference,quantize_bf16_cuda_fast \
    "def|NVFP4DBG_NVRTC_DEFINES= t64|$T64 t256|$T256 mb7|$MB7 mb6|$MB6"
stamp done
pack
