#!/usr/bin/env bash
# Session 45: amax_f32 with one atomic a block (not a warp) and the magnitudes' bits maxed
# with NaN named once a thread. gpu_moe (the dynamic global scales against the CPU), then
# alternating quick rounds of the reductions, this build against 9df65ab's
# (.dev/gpu/nvfp4dbg-9df: the amax before). Writes $OUT/$LABEL.tgz after each step.
set -uo pipefail
L=${LABEL:-s45f}
source bench/gpu-lib.sh
nvidia-smi -L | tee $R/gpus.txt
run_tests gpu_moe
ab_rounds 3 copy_d2d,reduce "new|NVFP4DBG_NVRTC_DEFINES= before|BIN=nvfp4dbg-9df"
