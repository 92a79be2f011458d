#!/usr/bin/env bash
# Session 22, fifth lease: what the register-A epilogues cost, split further by time-split builds
# (RS_DIAG): 4 the down GEMM stores nothing; 32 it stores the same values with the same
# instructions into 128 token rows that stay in L2 (no DRAM write traffic: the cost of its 939 MB
# of writes against that of issuing the stores); 1 the gate/up's SwiGLU replaced by g * u; 2
# no NVFP4 epilogue after it (its quantization and stores). Alternating with the default.
set -uo pipefail
L=${LABEL:-s22e}
source bench/gpu-lib.sh
D=NVFP4DBG_NVRTC_DEFINES
ab_rounds ${ROUNDS:-3} ${ONLY:-gemm_prefill,layer_4096} \
    "default| d4|$D=-DRS_DIAG=4 d32|$D=-DRS_DIAG=32 d1|$D=-DRS_DIAG=1 d2|$D=-DRS_DIAG=2"
stamp total
pack
