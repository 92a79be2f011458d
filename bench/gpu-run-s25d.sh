#!/usr/bin/env bash
# Session 25, last lease: the nightly on the session's final commit (kernels as session 24's).
set -uo pipefail
L=${LABEL:-s25d}
source bench/gpu-lib.sh
run_nightly
stamp done
