#!/usr/bin/env bash
# Session 31, third lease: per-expert tensor maps for the register-A GEMMs' tokens (the rows
# past a tile's expert arrive as zeros: rs_expert_maps), checked and timed against the one map
# pair for all (NVFP4DBG_RS_EXPERT_MAPS=0): the prefill GPU tests, `layertest` outputs byte for
# byte, then alternating bench rounds.
set -uo pipefail
L=${LABEL:-s31c}
source bench/gpu-lib.sh
run_tests gpu_moe gpu_gemm gpu_graph
same_outputs global NVFP4DBG_RS_EXPERT_MAPS=0
ab_rounds ${ROUNDS:-4} layer_4096,gemm_prefill "maps| global|NVFP4DBG_RS_EXPERT_MAPS=0"
stamp done
pack
