#!/usr/bin/env bash
# Session 61 (on the build of commit 42bb1f3 only: the next commit made BF16 rows the default and
# removed this time split): what BF16 slot rows would buy the 4096-token layer (RS_DIAG 64: the
# down GEMM writes each (token, slot) row as BF16 and the combine reads BF16; 64 + 128: two
# rows of a token in one 4-byte store). 3 alternating rounds of `bench --quick --only
# layer_4096`, medians by bench/ab_summary.py; then `layertest --device cuda` (512 tokens)
# under each, to see what the rounding does to the layer's metrics.
set -uo pipefail
L=${LABEL:-s61a}
source bench/gpu-lib.sh
nvidia-smi -L | tee $R/gpus.txt
D=NVFP4DBG_NVRTC_DEFINES
ab_rounds 3 layer_4096 "default|$D= bf16|$D=-DRS_DIAG=64 bf16pair|$D=-DRS_DIAG=192" | tee $R/ab.txt
for v in "default|" "bf16pair|-DRS_DIAG=192"; do
    n=${v%%|*}
    env $D="${v#*|}" timeout 120 .dev/gpu/nvfp4dbg layertest --device cuda --tokens 512 --gs calibrated \
        --no-report-dir > $R/lt-$n.txt 2>&1
    stamp "layertest $n rc=$?"
    grep -iE "cosine|PASS|FAIL" $R/lt-$n.txt | head -8
done
pack
