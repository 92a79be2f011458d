#!/usr/bin/env bash
# Session 30, fourth lease: the register-A GEMMs' row tiles ordered by their rows, most first
# (moe_offsets' longest_first), so that each grid ends on its shortest CTAs, against the order
# by expert (NVFP4DBG_TILE_ORDER=expert): the GPU tests, the outputs byte for byte, A/B rounds.
# That build only: not kept (BENCHMARKS.md, session 30).
set -uo pipefail
L=${LABEL:-s30d}
source bench/gpu-lib.sh
run_tests gpu_moe gpu_gemm gpu_graph
same_outputs expert NVFP4DBG_TILE_ORDER=expert
ab_rounds 4 layer_4096,gemm_prefill "default| expert|NVFP4DBG_TILE_ORDER=expert"
stamp done
pack
