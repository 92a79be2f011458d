#!/usr/bin/env bash
# Session 61: the NVFP4 down GEMMs write BF16 (token, slot) rows, as the engines do, and the
# combine reads them. The nightly on the new build; then an A/B against the build before (FP32
# rows: .dev/gpu/nvfp4dbg-f32, commit 42bb1f3): ROUNDS (2) alternating rounds of `bench --quick
# --only layer_4096,layer_16`, medians by bench/ab_summary.py.
set -uo pipefail
L=${LABEL:-s61b}
source bench/gpu-lib.sh
nvidia-smi -L | tee $R/gpus.txt
D=NVFP4DBG_NVRTC_DEFINES
NIGHTLY_S=${NIGHTLY_S:-170} run_nightly
tail -1 $R/nightly.txt
ab_rounds ${ROUNDS:-2} layer_4096,layer_16 "f32|BIN=nvfp4dbg-f32 bf16|$D=" | tee $R/ab.txt
pack
