#!/usr/bin/env bash
# session 12, first device call: (1) the wide register-A prefill (RS_WIDE, bench/gpu-run-s12-wide.sh:
# gpu_gemm and gpu_moe under -DRS_WIDE=1, then the prefill GEMMs and both layers, default
# against wide, alternating); (2) the quantizer variants session 11 could not run (qb2, qb2m10,
# dyn) and t64 against the default.
set -uo pipefail
L=${LABEL:-s12a}
LABEL=$L bash bench/gpu-run-s12-wide.sh
source bench/gpu-lib.sh
OUT=$R/quant SWEEP_BUDGET_S=${SWEEP_BUDGET_S:-120} timeout 170 bash bench/gpu-sweep-quant.sh ${SWEEP:-qb2 qb2m10 dyn t64} > $R/quant-sweep.txt 2>&1
stamp "quant sweep rc=$?"
tail -25 $R/quant/summary.txt 2>/dev/null
pack
