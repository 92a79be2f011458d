#!/usr/bin/env bash
# Session 26, fourth lease: the register-A tile widths 96 and 48 (RS_N96, RS_N48, the new
# defaults: tiles of 65-96 tokens ran at 128, of 33-48 at 64). The GPU tests on them, the
# bit-for-bit layertest check against the powers of two alone, then 4 alternating rounds of the
# layer and the prefill GEMMs: both widths, neither, 96 alone.
set -uo pipefail
L=${LABEL:-s26d}
source bench/gpu-lib.sh
P="NVFP4DBG_NVRTC_DEFINES=-DRS_N96=0~-DRS_N48=0"
run_tests gpu_gemm gpu_moe
same_outputs pow2 "$P"
ab_rounds 4 gemm_prefill,layer_4096 "default| pow2|$P n96|NVFP4DBG_NVRTC_DEFINES=-DRS_N48=0"
stamp done
pack
