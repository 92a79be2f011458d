#!/usr/bin/env bash
# Session 33, third lease (the build of 28647f4's kernels, which are session 31's): the weights'
# L2 prefetch distances of the register-A GEMMs re-measured on today's kernels (last tuned in
# s9c and s14c): alternating `bench --quick --only layer_4096` rounds, the gate/up prefetching
# 4 chunks ahead, the down 6, the narrow tiles at each kernel's own distance, against the
# defaults. Every setting gives the same numbers (only prefetch.global.L2 changes).
set -uo pipefail
L=${LABEL:-s33c}
source bench/gpu-lib.sh
D=NVFP4DBG_NVRTC_DEFINES
ab_rounds ${ROUNDS:-3} layer_4096 "default|$D= gu4|$D=-DRS_L2_AHEAD_GATE_UP=4 dn6|$D=-DRS_L2_AHEAD_DOWN=6 narrow|$D=-DRS_L2_AHEAD_NARROW=-1"
stamp done
pack
