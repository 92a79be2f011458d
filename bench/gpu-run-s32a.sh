#!/usr/bin/env bash
# Session 32, first lease: the register-A GEMMs' token tiles shared by 2-CTA clusters (TMA
# multicast, -DRS_CLUSTER=2) against one CTA each: the prefill GPU tests under the variant,
# `layertest` outputs byte for byte, then alternating bench rounds.
# The knob was measured and removed: run this on a build of commit f5dafcf (BENCHMARKS.md, Session 32).
set -uo pipefail
L=${LABEL:-s32a}
source bench/gpu-lib.sh
C=NVFP4DBG_NVRTC_DEFINES=-DRS_CLUSTER=2
variant_tests cluster $C gpu_moe gpu_gemm gpu_graph
same_outputs cluster $C
ab_rounds ${ROUNDS:-4} layer_4096,gemm_prefill "one| cluster|$C"
stamp done
pack
