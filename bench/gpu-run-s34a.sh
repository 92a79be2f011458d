#!/usr/bin/env bash
# Session 34, first lease (on commit a936aa1: its RS_SCATTER_MIN_BLOCKS_BF16 knob was removed after,
# in 0e870c9, so on a later tree the scat3 variant is the default): the prologue with one kernel and two memsets fewer (the register-A
# per-expert tensor maps written by the sort's scatter, the block statistics and amax words
# zeroed by its counts) against the build before (BIN=nvfp4dbg-old: commit 746388a's stripped
# target/release/nvfp4dbg, copied into .dev/gpu by hand), and the expert-input rows scatter at
# 3 CTAs an SM (-DRS_SCATTER_MIN_BLOCKS_BF16=3) against 2. The prefill GPU tests (the scatter
# variant's too), `layertest` outputs byte for byte across the three, then alternating bench
# rounds of the 4096-token layer.
set -uo pipefail
L=${LABEL:-s34a}
source bench/gpu-lib.sh
SCAT3=NVFP4DBG_NVRTC_DEFINES=-DRS_SCATTER_MIN_BLOCKS_BF16=3
run_tests gpu_moe gpu_gemm gpu_graph
variant_tests scat3 $SCAT3 gpu_moe
for gs in dynamic calibrated; do
    for v in new old scat3; do
        bin=nvfp4dbg e=NVFP4DBG_NVRTC_DEFINES=
        [ $v = old ] && bin=nvfp4dbg-old
        [ $v = scat3 ] && e=$SCAT3
        env $e timeout 120 .dev/gpu/$bin layertest --device cuda --tokens 512 --gs $gs \
            --save-outputs $R/lt-$v-$gs.safetensors > $R/lt-$v-$gs.txt 2>&1
        stamp "layertest $v gs=$gs rc=$?: $(grep -E '^(PASS|FAIL)' $R/lt-$v-$gs.txt | head -1)"
    done
    for v in old scat3; do
        cmp $R/lt-new-$gs.safetensors $R/lt-$v-$gs.safetensors &&
            stamp "layertest gs=$gs: new and $v bit for bit the same"
    done
done
pack
ab_rounds ${ROUNDS:-6} layer_4096 "new|NVFP4DBG_NVRTC_DEFINES= old|BIN=nvfp4dbg-old scat3|$SCAT3"
stamp done
pack
