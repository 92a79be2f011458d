#!/usr/bin/env bash
# Session 36, fifth lease: the flat BF16 quantizer with the tail as default (the last 7 CTAs an
# SM at 2 warps), against no tail (QUANT_TAIL=0) once more, and its first QUANT_PREFETCH CTAs
# per SM bringing the runs of the CTAs that many on into the L2 (prefetch.global.L2, a line a
# lane behind the warp's own loads): 3, 7 (the second wave) and 14. The quantize tests under
# each, then alternating rounds.
set -uo pipefail
L=${LABEL:-s36e}
source bench/gpu-lib.sh
T0=NVFP4DBG_NVRTC_DEFINES=-DQUANT_TAIL=0
P3=NVFP4DBG_NVRTC_DEFINES=-DQUANT_PREFETCH=3
P7=NVFP4DBG_NVRTC_DEFINES=-DQUANT_PREFETCH=7
P14=NVFP4DBG_NVRTC_DEFINES=-DQUANT_PREFETCH=14
run_tests gpu_quant
for v in "t0 $T0" "p3 $P3" "p7 $P7" "p14 $P14"; do variant_tests $v gpu_quant; done
ab_rounds ${ROUNDS:-8} copy_d2d,quantize_bf16_reference,quantize_bf16_cuda_fast \
    "def|NVFP4DBG_NVRTC_DEFINES= t0|$T0 p3|$P3 p7|$P7 p14|$P14"
quant_rounds def t0 p3 p7 p14
stamp done
pack
