#!/usr/bin/env bash
# Session 11, run in s12a (RS_WIDE since removed: wide 7.09 ms against the default's 6.02 for
# the prefill GEMMs, 9.05 against 8.51 for the 4096-token layer). The register-A prefill GEMMs with
# one m-block per warpgroup and tiles of up to 256 tokens (kernels/moe_gemm_sm90.cu RS_WIDE).
# (1) gpu_gemm and gpu_moe compiled with -DRS_WIDE=1 (the CPU reference and the mma.sync
# kernels per expert, experts of 161 / 250 / 288 / 300 rows); (2) the prefill GEMMs and both
# layers, the default against RS_WIDE, alternating (bench/ab_summary.py). bench/tile_model.py
# predicts 0.89x the K loops' cost at the 4096-token layer's routing.
set -uo pipefail
L=${LABEL:-s12w}
source bench/gpu-lib.sh
NVFP4DBG_NVRTC_DEFINES="-DRS_WIDE=1" run_tests ${TESTS:-gpu_gemm gpu_moe}
ab_rounds ${ROUNDS:-2} ${ONLY:-gemm_prefill,layer} "${VARIANTS:-default| wide|NVFP4DBG_NVRTC_DEFINES=-DRS_WIDE=1}"
stamp total
