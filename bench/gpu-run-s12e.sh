#!/usr/bin/env bash
# session 12, fifth device call: the bench's warm-up now runs each figure's own repeats for at
# least 100 ms (src/bench/timer.rs warmup_ms), against the quantizer figure read slow right after
# the floors (s12b-s12d). (1) the bench's GPU tests; (2) the whole bench and the peers
# (bench/gpu-run-final.sh PART=bench), a second whole bench, and the quantize figures alone.
set -uo pipefail
L=${LABEL:-s12e}
source bench/gpu-lib.sh
run_tests ${TESTS:-gpu_bench_cmd gpu_bench}
PART=bench LABEL=$L-bench bash bench/gpu-run-final.sh
for n in 2 3; do
    only=$([ $n = 2 ] && echo all || echo quantize)
    timeout 90 .dev/gpu/nvfp4dbg bench --device cuda --no-report-dir -q $([ $only = all ] || echo "--only $only") \
        --json $R/bench-$n.json > $R/bench-$n.txt 2>&1
    stamp "bench $n ($only) rc=$?: $(grep -oE '(quantize_bf16_[a-z_]+|layer_4096_graph|gemm_prefill_4096) +│ [0-9.]+' $R/bench-$n.txt | tr -s ' │' ' ' | tr '\n' ' ')"
done
pack
stamp total
