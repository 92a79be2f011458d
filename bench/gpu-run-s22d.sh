#!/usr/bin/env bash
# Session 22, fourth lease: what the weights' dequantization costs the register-A K loops, by
# time-split builds (RS_DIAG, wrong outputs on purpose, the bench's checks off): 6 the K loops
# with the gate/up's staging but no NVFP4 epilogue and no down stores; 14 the same without the
# scale multiply (4 of the 14 dequantization instructions a word pair); 22 without the byte
# permutes and the multiply (8 of 14). The default beside them, alternating. Then the nightly on
# the final build (the default build's kernels are session 21's).
set -uo pipefail
L=${LABEL:-s22d}
source bench/gpu-lib.sh
D=NVFP4DBG_NVRTC_DEFINES
ab_rounds ${ROUNDS:-3} ${ONLY:-gemm_prefill,layer_4096} \
    "default| d6|$D=-DRS_DIAG=6 d14|$D=-DRS_DIAG=14 d22|$D=-DRS_DIAG=22"
run_nightly
stamp total
pack
