#!/usr/bin/env bash
# Session 14, lease f: how far ahead the narrow tiles (<= 64 tokens) prefetch their weights
# (RS_L2_AHEAD_NARROW: 4 since s14c) - 6 and 8 chunks against 4, on the 4096-token layer,
# alternating.
set -uo pipefail
L=${LABEL:-s14f}
source bench/gpu-lib.sh
D=NVFP4DBG_NVRTC_DEFINES
ab_rounds ${ROUNDS:-4} ${ONLY:-layer_4096} \
    "default| narrow6|$D=-DRS_L2_AHEAD_NARROW=6 narrow8|$D=-DRS_L2_AHEAD_NARROW=8"
stamp total
