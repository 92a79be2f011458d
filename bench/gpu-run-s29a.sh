#!/usr/bin/env bash
# (Ran on an uncommitted tree after 0fe5302 that had these knobs; the winners are unconditional
# since the next commit, the losers gone: BENCHMARKS.md, Session 29.)
# Session 29, first lease: a register-A CTA's start and end with fewer round trips to memory
# (its row tile from moe_offsets' table in one load, RS_TILE_TABLE; the expert's scalars by
# cp.async into shared memory at the start, RS_EARLY_SCALARS; the tensor maps prefetched,
# RS_TMAP_PREFETCH) and its epilogues' accumulators scaled in one multiply (RS_FOLD_UNSCALE).
# The GPU tests, outputs bit for bit with the knobs off, then alternating rounds against them
# off and against the previous commit's build (.dev/gpu/nvfp4dbg-old).
set -uo pipefail
L=${LABEL:-s29a}
source bench/gpu-lib.sh
OFF="NVFP4DBG_NVRTC_DEFINES=-DRS_TILE_TABLE=0~-DRS_EARLY_SCALARS=0~-DRS_TMAP_PREFETCH=0"
NOFOLD="NVFP4DBG_NVRTC_DEFINES=-DRS_FOLD_UNSCALE=0"
run_tests gpu_moe gpu_gemm gpu_graph
variant_tests off "$OFF" gpu_gemm
same_outputs off "$OFF"
same_outputs nofold "$NOFOLD"
ab_rounds 4 layer_4096,gemm_prefill "default| off|$OFF nofold|$NOFOLD old|BIN=nvfp4dbg-old"
stamp done
pack
