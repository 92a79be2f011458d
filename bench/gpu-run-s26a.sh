#!/usr/bin/env bash
# Session 26, first lease: the gate/up epilogue's SwiGLU and NVFP4 block together
# (RS_SWIGLU_NVFP4, the new default: fast values, the exact ones only where a scale or code
# could differ). Its exhaustive check (tools/checks/swiglu_nvfp4.cu, in gpu_checks), the GPU
# tests, the bit-for-bit layertest check against the exact SwiGLU of every value
# (-DRS_SWIGLU_NVFP4=0), then 4 alternating rounds of the layer and the prefill GEMMs.
set -uo pipefail
L=${LABEL:-s26a}
source bench/gpu-lib.sh
X="NVFP4DBG_NVRTC_DEFINES=-DRS_SWIGLU_NVFP4=0"
run_tests gpu_checks
grep -E "^(swiglu|expf|e4m3)" $R/gpu_checks.txt | cut -c1-400
run_tests gpu_gemm gpu_moe
same_outputs exact "$X"
ab_rounds 4 gemm_prefill,layer_4096 "default| exact|$X"
stamp done
pack
