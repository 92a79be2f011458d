#!/usr/bin/env bash
# (Measured and dropped: the loop and QUANT_FLAT_PERSIST were removed after this lease; the lease ran on fa89ab7 plus that uncommitted change.)
# Session 35, fourth lease: the flat BF16 path walking whole runs grid-stride, on a persistent
# grid (QUANT_FLAT_PERSIST=1: as many CTAs as fit at once, no CTA launches after the first
# wave) and on the grid of one warp a run (the default, QUANT_FLAT_PERSIST=0), against s35c's
# kernel (BIN=nvfp4dbg-old: the build of commit fa89ab7, copied into .dev/gpu by
# hand). The GPU quantize tests under both grids, then alternating bench rounds.
set -uo pipefail
L=${LABEL:-s35d}
source bench/gpu-lib.sh
PERS=NVFP4DBG_NVRTC_DEFINES=-DQUANT_FLAT_PERSIST=1
run_tests gpu_quant
variant_tests persist $PERS gpu_quant gpu_moe
ab_rounds ${ROUNDS:-10} copy_d2d,quantize_bf16_reference,quantize_bf16_cuda_fast \
    "persist|$PERS loop|NVFP4DBG_NVRTC_DEFINES= s35c|BIN=nvfp4dbg-old"
stamp done
pack
