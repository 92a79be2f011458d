#!/usr/bin/env bash
# Session 29, after the final lease: the register-A GEMMs' L2 prefetch distances again on this
# session's kernels (RS_L2_AHEAD_GATE_UP 0 -> 4, RS_L2_AHEAD_DOWN 4 -> 6 or 0, RS_L2_AHEAD_NARROW
# 4 -> 0), alternating rounds of the layer and the prefill GEMMs.
set -uo pipefail
L=${LABEL:-s29e}
source bench/gpu-lib.sh
D=NVFP4DBG_NVRTC_DEFINES
ab_rounds 3 layer_4096,gemm_prefill "default| gu4|$D=-DRS_L2_AHEAD_GATE_UP=4 down6|$D=-DRS_L2_AHEAD_DOWN=6 down0|$D=-DRS_L2_AHEAD_DOWN=0 narrow0|$D=-DRS_L2_AHEAD_NARROW=0"
stamp done
pack
