#!/usr/bin/env bash
# Ran in session 15 (BENCHMARKS.md, Session 15; RS_MB was removed after s15c: these defines
# now do nothing). Its gate/up under RS_MB=1 had a wrong SwiGLU loop bound (mended for s15b).
# Session 15: the register-A kernels with one m-block per warp in CTAs of four warpgroups
# (-DRS_MB=1: 512 threads, 16 warps a CTA instead of 8, half the dequantization chain a warp):
# (1) gpu_gemm and gpu_moe under it, bit-exact against the CPU; (2) the prefill GEMMs and the
# 4096-token layer, default against RS_MB=1 (and with one MMA group in flight), alternating.
set -uo pipefail
L=${LABEL:-s15a}
source bench/gpu-lib.sh
D=NVFP4DBG_NVRTC_DEFINES
export $D=-DRS_MB=1
run_tests ${TESTS:-gpu_gemm gpu_moe}
unset $D
ab_rounds ${ROUNDS:-3} ${ONLY:-gemm_prefill,layer_4096} \
    "default| mb1|$D=-DRS_MB=1 mb1i1|$D=-DRS_MB=1~-DRS_INFLIGHT=1"
stamp total
