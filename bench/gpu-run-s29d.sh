#!/usr/bin/env bash
# Session 29, final lease: the nightly, the whole bench and the peers (bench/gpu-run-final.sh) on
# the session's final kernels (a register-A CTA's row tile from moe_offsets' table, its tensor
# maps prefetched, its expert's scalars by cp.async), then alternating rounds of the layer and
# the prefill GEMMs against session 28's build (.dev/gpu/nvfp4dbg-old, commit 0fe5302).
set -uo pipefail
L=${LABEL:-s29d}
LABEL=$L NIGHTLY_S=240 bash bench/gpu-run-final.sh
source bench/gpu-lib.sh
ab_rounds 4 layer_4096,gemm_prefill "default| old|BIN=nvfp4dbg-old"
stamp done
pack
