#!/usr/bin/env bash
# Session 27, second lease: nvfp4_rows_scatter_* with warp-coalesced loads, and from the BF16
# copy of the layer input (NVFP4DBG_RS_ROWS: default auto = BF16 where exact, f32, codes = the
# path before this session). The GPU tests, the bit-for-bit layertest checks (all scattering),
# 4 alternating rounds of the layer, then ncu's time of the prologue's kernels per variant.
set -uo pipefail
L=${LABEL:-s27b}
source bench/gpu-lib.sh
run_tests gpu_moe gpu_gemm gpu_quant
export NVFP4DBG_QUANT_SCATTER=1  # 512 tokens would gather
same_outputs codes "NVFP4DBG_RS_ROWS=codes"
same_outputs f32 "NVFP4DBG_RS_ROWS=f32"
unset NVFP4DBG_QUANT_SCATTER
U="NVFP4DBG_RS_ROWS=f32,NVFP4DBG_NVRTC_DEFINES=-DRS_SCATTER_COALESCED=0"
ab_rounds 4 layer_4096 "default| f32|NVFP4DBG_RS_ROWS=f32 uncoal|$U codes|NVFP4DBG_RS_ROWS=codes"
ncu="$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)"
for v in "default|NVFP4DBG_RS_ROWS=auto" "f32|NVFP4DBG_RS_ROWS=f32" "uncoal|$U" "codes|NVFP4DBG_RS_ROWS=codes"; do
    n=${v%%|*}
    IFS=, read -ra kv <<< "${v#*|}"
    env "${kv[@]}" timeout 150 "$ncu" --clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \
        -k regex:'nvfp4_rows_scatter|nvfp4_quantize_f32_scatter|moe_rows_bf16_rs' -c 6 \
        .dev/gpu/nvfp4dbg bench --device cuda --quick --only layer_4096 --no-report-dir -q \
        > $R/ncu-$n.txt 2>&1
    stamp "ncu $n rc=$?"
    grep -E "^  [a-z_0-9]+ \(|gpu__time_duration|dram__bytes" $R/ncu-$n.txt | head -8
done
stamp done
pack
