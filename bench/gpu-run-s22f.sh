#!/usr/bin/env bash
# Session 22, sixth lease: the register-A epilogues' stores without a branch around each
# (RS_LEAN_EPI 1: one address a token row, the thread's rows at immediate offsets, predicated
# stores; the down kernel's SASS 10744 -> 7064 instructions, the gate/up's 13576 -> 10704)
# against the old ones (0). s22e put 0.35 ms of the layer's down stage on its stores, ~0.03 of
# it on their DRAM traffic. The GPU tests of the register-A kernels first, then alternating
# rounds, then the whole bench and the PyTorch peers (bench/gpu-run-final.sh PART=bench).
# (Ran on commit d2d997d; the knob is gone since, so `lean0` builds the default there.)
set -uo pipefail
L=${LABEL:-s22f}
source bench/gpu-lib.sh
D=NVFP4DBG_NVRTC_DEFINES
run_tests gpu_gemm gpu_moe
ab_rounds ${ROUNDS:-3} ${ONLY:-gemm_prefill,layer_4096} "default| lean0|$D=-DRS_LEAN_EPI=0"
stamp "A/B done"
pack
LABEL=$L-final PART=bench bash bench/gpu-run-final.sh
