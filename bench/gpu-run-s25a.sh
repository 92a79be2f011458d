#!/usr/bin/env bash
# Session 25, first lease: the gate/up's SwiGLU + NVFP4 epilogue in a kernel of its own
# (-DRS_GU_SPLIT=1: the GEMM stores g and u in f32, moe_gate_up_epilogue_rs runs the epilogue at
# full occupancy). Its GPU tests, then the layer's outputs bit for bit against the default
# (layertest --save-outputs, prefill tiles: 512 tokens), then alternating rounds of the bench.
set -uo pipefail
L=${LABEL:-s25a}
source bench/gpu-lib.sh
S="NVFP4DBG_NVRTC_DEFINES=-DRS_GU_SPLIT=1"
for t in gpu_gemm gpu_moe; do
    env $S timeout 150 .dev/gpu/$t --ignored --nocapture --test-threads 1 > $R/split-$t.txt 2>&1
    stamp "split $t rc=$?: $(grep -E '^test result' $R/split-$t.txt | tail -1)"
    grep -E "panicked" -A3 $R/split-$t.txt | head -10
    pack
done
for gs in calibrated dynamic; do
    for v in default split; do
        e=$([ $v = split ] && echo "$S" || echo "NVFP4DBG_NVRTC_DEFINES=")
        env $e timeout 120 .dev/gpu/nvfp4dbg layertest --device cuda --tokens 512 --gs $gs \
            --save-outputs $R/lt-$v-$gs.safetensors > $R/lt-$v-$gs.txt 2>&1
        stamp "layertest $v $gs rc=$?"
    done
    cmp $R/lt-default-$gs.safetensors $R/lt-split-$gs.safetensors && stamp "layertest $gs: split and default outputs bit for bit the same"
done
pack
if grep -q "test result: ok" $R/split-gpu_gemm.txt && grep -q "test result: ok" $R/split-gpu_moe.txt; then
    ab_rounds 4 gemm_prefill,layer_4096 "default| split|$S split3|$S~-DGU_EPI_MIN_BLOCKS=3"
fi
stamp done
pack
