#!/usr/bin/env bash
# Session 26, last lease: on the session's final kernels (RS_SWIGLU_NVFP4 and RS_N96 the
# defaults), the nightly, the whole bench and the peers (bench/gpu-run-final.sh).
set -uo pipefail
L=${LABEL:-s26e}
LABEL=$L NIGHTLY_S=240 bash bench/gpu-run-final.sh
