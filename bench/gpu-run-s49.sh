#!/usr/bin/env bash
# Session 49: the nightly, the e2e walkthrough, the CUDA dumps under the dump check, compare-weights
# on a float side against a swizzled quantized dump at 1024x7168 (.dev/cw49, made by bench/cw-swizzled-gen.py),
# then the whole bench and the PyTorch peers, on whatever card the lease brings
# (the ratios are taken within the run; SKIP_BENCH=1 leaves those out). Writes $OUT/$LABEL.tgz
# after each step.
set -uo pipefail
L=${LABEL:-s49a}
source bench/gpu-lib.sh
nvidia-smi -L | tee $R/gpus.txt
NIGHTLY_S=250 run_nightly
timeout 100 bash tools/e2e/run_e2e.sh .dev/gpu/nvfp4dbg > $R/e2e.txt 2>&1
stamp "e2e rc=$?: $(grep -E 'STEPS' $R/e2e.txt | tail -1)"
grep -E "UNEXPECTED" $R/e2e.txt | head -12
pack
timeout 150 bash bench/dump-check-gpu.sh /tmp/dumpcheck $PWD/.dev/gpu/nvfp4dbg > $R/dump-check.txt 2>&1
stamp "dump check rc=$?"
grep -E "rc=[1-9]|compare-outputs .* rc=|worst row" $R/dump-check.txt | cut -c1-220 | head -30
pack
for f in deq other; do
    .dev/gpu/nvfp4dbg compare-weights .dev/cw49/$f.safetensors .dev/cw49/q_swz.safetensors --device cuda \
        --no-report-dir --json $R/cw-$f.json > $R/cw-$f.txt 2>&1
    stamp "compare-weights $f vs swizzled dump on cuda rc=$? (want $([ $f = deq ] && echo 0 || echo 1)): $(tail -1 $R/cw-$f.txt)"
done
grep -o 'read in the 128x4 swizzle[^"]*' $R/cw-deq.json | head -2
pack
[ "${SKIP_BENCH:-0}" = 1 ] || bench_and_peers
