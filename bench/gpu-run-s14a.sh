#!/usr/bin/env bash
# Ran in session 14 (BENCHMARKS.md: RS_SPLIT not faster, removed; the define now does nothing).
# Prepared in session 13 for the next lease: gpu_gemm as built (its ragged test's new experts),
# then the register-A kernels' last two tiles of an expert split by width (RS_SPLIT):
# (1) gpu_gemm (its ragged test has experts of 170, 200 and 330 rows for this) and gpu_moe
# under -DRS_SPLIT=1, bit-exact against the CPU; (2) the prefill GEMMs (uniform load: few
# expert splits) and the 4096-token layer (its router's uneven load: predicted -4.1% gate/up
# and -2.9% down MMA width, ~0.2 ms of the layer), default against split, alternating.
set -uo pipefail
L=${LABEL:-s14a}
source bench/gpu-lib.sh
D=NVFP4DBG_NVRTC_DEFINES
run_tests gpu_gemm
mv $R/gpu_gemm.txt $R/gpu_gemm-default.txt
export $D=-DRS_SPLIT=1
run_tests ${TESTS:-gpu_gemm gpu_moe}
unset $D
ab_rounds ${ROUNDS:-3} ${ONLY:-gemm_prefill,layer_4096} "default| split|$D=-DRS_SPLIT=1"
python3 bench/tile_split.py $R/default-1.json | tee $R/tile_split.txt
stamp total
