#!/usr/bin/env bash
# Session 23, sixth lease: the nightly on the final build (kernels as in s23c, RS_DOWN_PASSES
# removed; route()'s input check made lazy).
set -uo pipefail
LABEL=${LABEL:-s23f} PART=nightly NIGHTLY_S=240 bash bench/gpu-run-final.sh
