#!/usr/bin/env bash
# Session 36, second lease: the BF16 quantizer at 2 blocks a lane (2 KB a warp: half a warp's
# compute after its loads land, so a shorter drain; s36a put the quantizer's per-launch cost
# at ~6 us against the driver copy's ~4) at 8, 9 and 10 CTAs of 128 threads an SM (64, 56, 48
# registers), against the default (4 blocks, 7 CTAs). The quantize tests under each, then
# alternating bench rounds (the longer run at 4x the rows in each).
set -uo pipefail
L=${LABEL:-s36b}
source bench/gpu-lib.sh
Q8=NVFP4DBG_NVRTC_DEFINES=-DQUANT_BLOCKS=2~-DQUANT_MIN_BLOCKS=8
Q9=NVFP4DBG_NVRTC_DEFINES=-DQUANT_BLOCKS=2~-DQUANT_MIN_BLOCKS=9
Q10=NVFP4DBG_NVRTC_DEFINES=-DQUANT_BLOCKS=2~-DQUANT_MIN_BLOCKS=10
run_tests gpu_quant
for v in "qb2m8 $Q8" "qb2m9 $Q9" "qb2m10 $Q10"; do variant_tests $v gpu_quant; done
ab_rounds ${ROUNDS:-8} copy_d2d,quantize_bf16_reference,quantize_bf16_cuda_fast \
    "def|NVFP4DBG_NVRTC_DEFINES= qb2m8|$Q8 qb2m9|$Q9 qb2m10|$Q10"
quant_rounds def qb2m8 qb2m9 qb2m10
stamp done
pack
