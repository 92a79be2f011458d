#!/usr/bin/env bash
# Session 14, lease b: the register-A kernels' knobs were tuned on the GEMM figures' uniform
# routing (s9c, s9e/f); the layer figure routes with its router's uneven load (many tiles of
# 32/64 tokens that stream a whole weight slice for few MMAs). Alternating A/B of the knobs the
# uneven load could flip: L2 prefetch of the gate/up weights 4 chunks ahead, the down GEMM at
# width 144, and the down GEMM without its prefetch (control), on the 4096-token layer and the
# prefill GEMMs.
# (bench/ab_summary.py prints the layer's stage medians since; the script printed them itself.)
set -uo pipefail
L=${LABEL:-s14b}
source bench/gpu-lib.sh
D=NVFP4DBG_NVRTC_DEFINES
ab_rounds ${ROUNDS:-3} ${ONLY:-gemm_prefill,layer_4096} \
    "default| l2gu4|$D=-DRS_L2_AHEAD_GATE_UP=4 n144d|$D=-DRS_N144_DOWN=1 l2d0|$D=-DRS_L2_AHEAD_DOWN=0"
stamp total
