#!/usr/bin/env bash
# session 6, last device call: the GPU quantize tests on the build without the sweep's losing
# variants, then ncu on the new BF16 quantize kernel (what bounds it now).
set -uo pipefail
export NO_COLOR=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NVFP4DBG_CUDA_INCLUDE=/usr/local/cuda/include:/usr/local/cuda/include/cccl
R=/tmp/s6d; mkdir -p $R
timeout 120 .dev/gpu/gpu_quant --ignored --test-threads 1 > $R/gpu_quant.txt 2>&1
echo "gpu_quant rc=$?"; grep -E "test result|panicked" $R/gpu_quant.txt
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
timeout 150 $NCU --clock-control none --set full -k regex:nvfp4_quantize_bf16 -c 2 \
    .dev/gpu/nvfp4dbg bench --device cuda --no-report-dir -q --quick --only quantize > $R/ncu.txt 2>&1
echo "ncu rc=$?"
grep -E "Duration|DRAM Throughput|Memory Throughput|SM Busy|Issue Slots|Executed Ipc A|highest-utilized|Registers Per|Achieved Occ|Theoretical Occ|Executed Instructions  |Warp Cycles Per Issued|stalled" $R/ncu.txt | tail -16
tar czf $OUT/s6d.tgz -C $R .
