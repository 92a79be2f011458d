#!/usr/bin/env bash
# Session 21, first A/B lease: the register-A GEMMs' older knobs measured again on the current
# build (3-stage ring, EXPF_CR_BITS on), each against the default in alternating rounds. Each was
# last decided sessions ago on a different kernel: the 144-token width per kernel (s9e/s9f), the
# down's L2 prefetch (s9c), the narrow tiles' prefetch (s14c), two MMA groups in flight.
set -uo pipefail
L=${LABEL:-s21a}
source bench/gpu-lib.sh
D=NVFP4DBG_NVRTC_DEFINES
ab_rounds ${ROUNDS:-3} ${ONLY:-gemm_prefill,layer_4096} \
    "default| n144d|$D=-DRS_N144_DOWN=1 n144g0|$D=-DRS_N144_GATE_UP=0 l2d0|$D=-DRS_L2_AHEAD_DOWN=0 nar|$D=-DRS_L2_AHEAD_NARROW=-1 inf1|$D=-DRS_INFLIGHT=1"
stamp total
pack
