#!/usr/bin/env bash
# Session 32, third lease: the down GEMM's tile stored by TMA from shared memory
# (-DRS_DOWN_TMA_STORE=1) against each thread's stores: the prefill GPU tests under it,
# `layertest` outputs byte for byte, alternating bench rounds, then compute-sanitizer on the
# ragged-experts GEMM test under it.
# The knob was measured and removed: run this on a build of commit 90ec24b (BENCHMARKS.md, Session 32).
set -uo pipefail
L=${LABEL:-s32c}
source bench/gpu-lib.sh
T=NVFP4DBG_NVRTC_DEFINES=-DRS_DOWN_TMA_STORE=1
variant_tests tma $T gpu_moe gpu_gemm gpu_graph
same_outputs tma $T
ab_rounds ${ROUNDS:-4} layer_4096,gemm_prefill "threads| tma|$T"
export NVFP4DBG_NVRTC_DEFINES=-DRS_DOWN_TMA_STORE=1
SAN_S=100 sanitize memcheck racecheck
stamp done
pack
