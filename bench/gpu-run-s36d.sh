#!/usr/bin/env bash
# Session 36, fourth lease: the flat BF16 quantizer's head as well as its tail (s36c: the last
# 7 CTAs per SM at 2 of their 4 warps' runs, 0.0396-0.0399 ms against 0.0399-0.0401). The
# first QUANT_HEAD CTAs per SM at 2 warps too: they encode sooner, so the next CTAs' loads
# follow the first burst with less of a gap. The quantize tests under each, then rounds.
set -uo pipefail
L=${LABEL:-s36d}
source bench/gpu-lib.sh
T7=NVFP4DBG_NVRTC_DEFINES=-DQUANT_TAIL=7
T5=NVFP4DBG_NVRTC_DEFINES=-DQUANT_TAIL=5
H7=NVFP4DBG_NVRTC_DEFINES=-DQUANT_HEAD=7
H7T7=NVFP4DBG_NVRTC_DEFINES=-DQUANT_HEAD=7~-DQUANT_TAIL=7
H14T7=NVFP4DBG_NVRTC_DEFINES=-DQUANT_HEAD=14~-DQUANT_TAIL=7
run_tests gpu_quant
for v in "t7 $T7" "t5 $T5" "h7 $H7" "h7t7 $H7T7" "h14t7 $H14T7"; do variant_tests $v gpu_quant; done
ab_rounds ${ROUNDS:-8} copy_d2d,quantize_bf16_reference,quantize_bf16_cuda_fast \
    "def|NVFP4DBG_NVRTC_DEFINES= t7|$T7 t5|$T5 h7|$H7 h7t7|$H7T7 h14t7|$H14T7"
quant_rounds def t7 t5 h7 h7t7 h14t7
stamp done
pack
