#!/usr/bin/env bash
# Session 14, lease c: s14b found the gate/up weights' L2 prefetch (4 chunks ahead) 1.2% faster
# on the layer's gate/up stage in all three rounds and 5% slower on the uniform GEMM figure.
# The uneven load's extra tiles are narrow (32/64 tokens: a whole weight slice for few MMAs),
# so: the prefetch on the narrow tiles only (RS_L2_AHEAD_NARROW=4), against the default and
# against the prefetch everywhere, alternating.
# (bench/ab_summary.py prints the layer's stage medians since; the script printed them itself.)
set -uo pipefail
L=${LABEL:-s14c}
source bench/gpu-lib.sh
D=NVFP4DBG_NVRTC_DEFINES
ab_rounds ${ROUNDS:-4} ${ONLY:-gemm_prefill,layer_4096} \
    "default| narrow4|$D=-DRS_L2_AHEAD_NARROW=4 l2gu4|$D=-DRS_L2_AHEAD_GATE_UP=4"
stamp total
