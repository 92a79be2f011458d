#!/usr/bin/env bash
# Session 21, last lease: s21d's per-instruction reading put 7-9% of the gate/up kernel's stall
# samples on the loop head's first use of the weight chunk loaded one chunk ahead (the 128-token
# path, every second chunk), and a third chunk in registers there spills 300+ bytes; so the
# gate/up's L2 prefetch of the weights (RS_L2_AHEAD_GATE_UP, 0 since s9c measured 4 slower on an
# older kernel) again, 3 and 4 chunks ahead, alternating with the default.
set -uo pipefail
L=${LABEL:-s21f}
source bench/gpu-lib.sh
D=NVFP4DBG_NVRTC_DEFINES
ab_rounds ${ROUNDS:-3} ${ONLY:-gemm_prefill_4096_gate_up,layer_4096} \
    "default| gu3|$D=-DRS_L2_AHEAD_GATE_UP=3 gu4|$D=-DRS_L2_AHEAD_GATE_UP=4"
stamp total
pack
