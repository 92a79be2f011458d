#!/usr/bin/env bash
# Session 23, fifth lease: the down GEMM's CTAs taking 2 or 4 row blocks of their token tile
# one after another (RS_DOWN_PASSES), the next block's weights and first token chunks started
# before the current block's stores. Predicted: part of the per-CTA start (first weight loads
# and TMA copies, ~1-2 us of a ~30 us down tile) hidden behind the stores. The GPU tests of the
# register-A kernels as built (the default's SASS changed: 7064 -> 7216 instructions, set-up
# only) and under 2 and 4, then alternating rounds.
set -uo pipefail
L=${LABEL:-s23e}
source bench/gpu-lib.sh
D=NVFP4DBG_NVRTC_DEFINES
run_tests gpu_gemm gpu_moe
for p in 2 4; do
    for t in gpu_gemm gpu_moe; do
        env $D=-DRS_DOWN_PASSES=$p timeout 150 .dev/gpu/$t --ignored --nocapture --test-threads 1 > $R/$t-p$p.txt 2>&1
        stamp "$t passes $p rc=$?: $(grep -E '^test result' $R/$t-p$p.txt | tail -1)"
        grep -E "panicked" -A3 $R/$t-p$p.txt | head -10
    done
done
pack
ab_rounds ${ROUNDS:-3} ${ONLY:-gemm_prefill,layer_4096} "default| p2|$D=-DRS_DOWN_PASSES=2 p4|$D=-DRS_DOWN_PASSES=4"
stamp "A/B done"
pack
