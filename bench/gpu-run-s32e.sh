#!/usr/bin/env bash
# Session 32, fifth lease: s32d's bench rounds again (its variants' `B,C` values broke
# ab_rounds' comma-separated list: `B:C` now).
# The knob was measured and removed: run this on a build of commit e64e14f (BENCHMARKS.md, Session 32).
set -uo pipefail
L=${LABEL:-s32e}
source bench/gpu-lib.sh
ab_rounds ${ROUNDS:-4} layer_4096 "beside| o112|NVFP4DBG_SHARED_OVERLAP=112:20 o100|NVFP4DBG_SHARED_OVERLAP=100:32 o88|NVFP4DBG_SHARED_OVERLAP=88:44"
stamp done
pack
