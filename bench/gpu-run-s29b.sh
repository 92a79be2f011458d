#!/usr/bin/env bash
# (Ran on an uncommitted tree after 0fe5302 that had these knobs; the winners are unconditional
# since the next commit, the losers gone: BENCHMARKS.md, Session 29.)
# Session 29, second lease: the down GEMM's outputs through shared memory and one bulk copy a
# token row (RS_DOWN_BULK; 0: the 4-byte stores from the accumulators), beside s29a's start
# and end of a register-A CTA (RS_TILE_TABLE, RS_EARLY_SCALARS, RS_TMAP_PREFETCH). The GPU
# tests, outputs bit for bit, then alternating rounds against the 4-byte stores and against the
# previous commit's build (.dev/gpu/nvfp4dbg-old).
set -uo pipefail
L=${LABEL:-s29b}
source bench/gpu-lib.sh
NOBULK="NVFP4DBG_NVRTC_DEFINES=-DRS_DOWN_BULK=0"
run_tests gpu_moe gpu_gemm
same_outputs nobulk "$NOBULK"
ab_rounds 4 layer_4096,gemm_prefill "default| nobulk|$NOBULK old|BIN=nvfp4dbg-old"
stamp done
pack
