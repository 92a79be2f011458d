#!/usr/bin/env bash
# Session 27, first lease: the expert inputs quantized straight into the register-A gate/up's
# 16-bit token rows (nvfp4_rows_scatter_*, NVFP4DBG_RS_ROWS_FUSED=0 the old path: codes in
# memory, then moe_rows_bf16_rs). The GPU tests, the bit-for-bit layertest check (both
# scattering), 4 alternating rounds of the layer, then ncu's time of the prologue's kernels.
set -uo pipefail
L=${LABEL:-s27a}
source bench/gpu-lib.sh
run_tests gpu_moe gpu_gemm
export NVFP4DBG_QUANT_SCATTER=1  # 512 tokens would gather
same_outputs unfused "NVFP4DBG_RS_ROWS_FUSED=0"
unset NVFP4DBG_QUANT_SCATTER
ab_rounds 4 layer_4096 "default| unfused|NVFP4DBG_RS_ROWS_FUSED=0"
ncu="$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)"
for v in default unfused; do
    e=$([ $v = unfused ] && echo NVFP4DBG_RS_ROWS_FUSED=0 || echo NVFP4DBG_RS_ROWS_FUSED=1)
    env $e timeout 150 "$ncu" --clock-control none --metrics gpu__time_duration.sum \
        -k regex:'nvfp4_rows_scatter|nvfp4_quantize_f32_scatter|moe_rows_bf16_rs' -c 6 \
        .dev/gpu/nvfp4dbg bench --device cuda --quick --only layer_4096 --no-report-dir -q \
        > $R/ncu-$v.txt 2>&1
    stamp "ncu $v rc=$?"
    grep -E "nvfp4_rows_scatter|quantize_f32_scatter|moe_rows_bf16_rs|gpu__time_duration" $R/ncu-$v.txt | head -12
done
stamp done
pack
