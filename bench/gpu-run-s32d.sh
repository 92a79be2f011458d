#!/usr/bin/env bash
# Session 32, fourth lease: the shared expert's gate/up (cuBLAS held to B multiprocessors)
# beside the routed combine (C whole-SM blocks), its down projection then added onto the
# combined output (NVFP4DBG_SHARED_OVERLAP=B,C) against the shared expert beside everything:
# `layertest` outputs byte for byte, then alternating bench rounds of the layer.
# The knob was measured and removed: run this on a build of commit e64e14f (BENCHMARKS.md, Session 32).
set -uo pipefail
L=${LABEL:-s32d}
source bench/gpu-lib.sh
same_outputs o100 NVFP4DBG_SHARED_OVERLAP=100,32
variant_tests o100 NVFP4DBG_SHARED_OVERLAP=100,32 gpu_moe gpu_graph
ab_rounds ${ROUNDS:-4} layer_4096 "beside| o112|NVFP4DBG_SHARED_OVERLAP=112,20 o100|NVFP4DBG_SHARED_OVERLAP=100,32 o88|NVFP4DBG_SHARED_OVERLAP=88,44"
stamp done
pack
