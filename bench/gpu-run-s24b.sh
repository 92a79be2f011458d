#!/usr/bin/env bash
# Session 24, second lease: the register-A GEMMs with a producer warpgroup (-DRS_PRODUCER=1: a
# third warpgroup dequantizes the weights into a shared-memory ring, the two consumer warpgroups
# only load their fragments and issue the MMAs). Its GPU tests first (short limits: a protocol
# fault would hang), then 3 alternating rounds against the default and against the default
# without wide tiles (the producer variant has none: NVFP4DBG_RS_SLACK=0).
set -uo pipefail
L=${LABEL:-s24b}
source bench/gpu-lib.sh
P="NVFP4DBG_NVRTC_DEFINES=-DRS_PRODUCER=1"
for t in gpu_gemm gpu_moe; do
    env $P timeout 120 .dev/gpu/$t --ignored --nocapture --test-threads 1 > $R/prod-$t.txt 2>&1
    stamp "producer $t rc=$?: $(grep -E '^test result' $R/prod-$t.txt | tail -1)"
    grep -E "panicked" -A3 $R/prod-$t.txt | head -10
    pack
done
if grep -q "test result: ok" $R/prod-gpu_gemm.txt && grep -q "test result: ok" $R/prod-gpu_moe.txt; then
    ab_rounds 3 gemm_prefill,layer_4096 "default| prod|$P noslack|NVFP4DBG_RS_SLACK=0"
fi
stamp done
pack
