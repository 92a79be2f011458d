#!/usr/bin/env bash
# session 11, first device call: the quantizer read as one row (QUANT_FLAT) with its
# transposition at fixed offsets: (1) gpu_quant (new shapes whose groups span rows) and the
# layer tests; (2) the quantizer sweep, the default against the row-by-row view (noflat), the
# bulk kernel and session 9's grid kernel, alternating, with ncu on the default.
set -uo pipefail
L=${LABEL:-s11a}
source bench/gpu-lib.sh
run_tests ${TESTS:-gpu_quant gpu_moe}
OUT=$R/quant SWEEP_BUDGET_S=${SWEEP_BUDGET_S:-170} timeout 240 bash bench/gpu-sweep-quant.sh ${SWEEP:-} > $R/quant-sweep.txt 2>&1
stamp "quant sweep rc=$?"
tail -25 $R/quant/summary.txt 2>/dev/null
pack
stamp total
