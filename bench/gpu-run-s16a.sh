#!/usr/bin/env bash
# Session 16, first lease: the register-A GEMMs in CTAs of one warpgroup, two per SM (-DRS_WG=1:
# 128 weight rows a CTA, its own 2-stage token ring, 85.5 KB of shared memory), so that one
# CTA's epilogue overlaps the other's MMAs, for twice the token traffic from L2. gpu_gemm and
# gpu_moe under it, then the prefill GEMMs and the 4096-token layer against the default,
# alternating, each also with its epilogues cut (-DRS_DIAG=7: the K loops alone).
set -uo pipefail
L=${LABEL:-s16a}
source bench/gpu-lib.sh
D=NVFP4DBG_NVRTC_DEFINES
export $D=-DRS_WG=1
run_tests ${TESTS:-gpu_gemm gpu_moe}
unset $D
ab_rounds ${ROUNDS:-3} ${ONLY:-gemm_prefill,layer_4096} \
    "default| wg1|$D=-DRS_WG=1 d7|$D=-DRS_DIAG=7 wg1d7|$D=-DRS_WG=1~-DRS_DIAG=7"
stamp total
