#!/usr/bin/env bash
# Session 30, fifth lease: the shared experts' down projection added onto the combined output
# by cuBLAS (beta = 1) instead of written alone and read back by moe_combine. The nightly on
# it, layertest's outputs byte for byte against session 29's build (.dev/gpu/nvfp4dbg-old,
# commit 2f38419) at 512 tokens (prefill kernels) and 16 (decode kernels), then alternating
# rounds of the layer against that build. That build only: not kept (BENCHMARKS.md, session 30).
set -uo pipefail
L=${LABEL:-s30e}
source bench/gpu-lib.sh
NIGHTLY_S=240 run_nightly
for tok in 512 16; do
    for gs in calibrated dynamic; do
        for b in nvfp4dbg nvfp4dbg-old; do
            timeout 120 .dev/gpu/$b layertest --device cuda --tokens $tok --gs $gs \
                --save-outputs $R/lt-$b-$tok-$gs.safetensors > $R/lt-$b-$tok-$gs.txt 2>&1
            stamp "layertest $b $tok $gs rc=$?"
        done
        cmp $R/lt-nvfp4dbg-$tok-$gs.safetensors $R/lt-nvfp4dbg-old-$tok-$gs.safetensors &&
            stamp "layertest $tok $gs: outputs bit for bit the same as the old build's"
    done
done
pack
ab_rounds 3 layer_4096,layer_16 "default| old|BIN=nvfp4dbg-old"
stamp done
pack
