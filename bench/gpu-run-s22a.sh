#!/usr/bin/env bash
# Session 22, first lease: the down projection's stores through shared memory (RS_DOWN_SMEM 1,
# 16-byte stores of whole lines; 2 the same with streaming stores) against the accumulators'
# 4-byte stores (0, the old path). The GPU tests of the register-A kernels first (the new
# default's outputs against the CPU and the mma.sync kernels), then alternating rounds, then
# ncu --set full on one launch of the down kernel in the layer (where its time goes now).
set -uo pipefail
L=${LABEL:-s22a}
source bench/gpu-lib.sh
D=NVFP4DBG_NVRTC_DEFINES
run_tests gpu_gemm gpu_moe
ab_rounds ${ROUNDS:-3} ${ONLY:-gemm_prefill,layer_4096} \
    "default| reg|$D=-DRS_DOWN_SMEM=0 cs|$D=-DRS_DOWN_SMEM=2"
NCU="$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)"
timeout 150 "$NCU" --clock-control none --set full -k regex:moe_gemm_nvfp4_sm90rs -s 1 -c 1 -f \
    -o $R/ncu-down .dev/gpu/nvfp4dbg bench --device cuda --quick --only layer_4096_eager \
    --no-report-dir -q > $R/ncu-down-run.txt 2>&1
stamp "ncu down rc=$?"
"$NCU" --import $R/ncu-down.ncu-rep --page details > $R/ncu-down-details.txt 2>&1
"$NCU" --import $R/ncu-down.ncu-rep --page source --csv --print-source sass > $R/ncu-down-sass.csv 2>&1
rm -f $R/ncu-down.ncu-rep
grep -E "Duration|Throughput|Registers|Achieved Occupancy|No Eligible|Issue Slots Busy|Executed Ipc" $R/ncu-down-details.txt | head -20
stamp total
pack
