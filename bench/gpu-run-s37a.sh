#!/usr/bin/env bash
# Session 37, first lease: the nightly on the merged build (audit against originals, dense
# layers refused, wrong-slot weights, the per-expert slot rule: CPU-side changes), then the
# flat BF16 quantizer's warp-wide loads through the non-coherent path without an L1 line
# (QUANT_LD=1) and with L2::256B as well (QUANT_LD=2) against plain ld.global: the quantize
# tests under each, then alternating rounds.
set -uo pipefail
L=${LABEL:-s37a}
source bench/gpu-lib.sh
NVFP4DBG_REPORTS=$R/nightly timeout ${NIGHTLY_S:-300} bash .ci/gpu-nightly .dev/gpu > $R/nightly.txt 2>&1
stamp "nightly rc=$?"
grep -E "GPU tests:|cases:" $R/nightly.txt | tail -3
grep -E "^(FAIL|fail)|FAILED|panicked" $R/nightly.txt | head -10
pack
L1=NVFP4DBG_NVRTC_DEFINES=-DQUANT_LD=1
L2=NVFP4DBG_NVRTC_DEFINES=-DQUANT_LD=2
for v in "ld1 $L1" "ld2 $L2"; do variant_tests $v gpu_quant; done
ab_rounds ${ROUNDS:-6} copy_d2d,quantize_bf16_reference,quantize_bf16_cuda_fast \
    "def|NVFP4DBG_NVRTC_DEFINES= ld1|$L1 ld2|$L2"
quant_rounds def ld1 ld2
stamp done
pack
