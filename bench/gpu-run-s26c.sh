#!/usr/bin/env bash
# Session 26, last lease: on the session's final kernels (RS_SWIGLU_NVFP4 the default), the
# nightly, the whole bench and the peers (bench/gpu-run-final.sh).
set -uo pipefail
L=${LABEL:-s26c}
LABEL=$L NIGHTLY_S=240 bash bench/gpu-run-final.sh
