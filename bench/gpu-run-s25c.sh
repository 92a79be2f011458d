#!/usr/bin/env bash
# Session 25, third lease: RS_GU_SPLIT with the epilogue kernel's loads as cp.async copies into
# shared memory one 16-block ahead (s25b: the first form took 342 us against a ~133 us floor of
# its bytes). GPU tests and the bit-for-bit layertest check under it, 4 alternating rounds
# against the default, then each kernel's time alone (ncu).
set -uo pipefail
L=${LABEL:-s25c}
source bench/gpu-lib.sh
S="NVFP4DBG_NVRTC_DEFINES=-DRS_GU_SPLIT=1"
variant_tests split "$S" gpu_gemm gpu_moe
ok=$?
same_outputs split "$S"
if [ $ok = 0 ]; then
    ab_rounds 4 gemm_prefill,layer_4096 "default| split|$S split3|$S~-DGU_EPI_MIN_BLOCKS=3"
    export NVFP4DBG_NVRTC_DEFINES=-DRS_GU_SPLIT=1
    export NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
    ncu_layer 200 --launch-count 60
    ncu_kernels > $R/kernels.txt
    grep -E "gate_up|epilogue_rs" $R/kernels.txt | tail -6 | cut -c1-150
fi
stamp done
pack
