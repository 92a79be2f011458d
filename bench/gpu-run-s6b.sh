#!/usr/bin/env bash
# session 6, second device call: the warp-specialized prefill GEMMs with the weights streamed
# by bulk copies: GPU tests, then prefill and layer figures against the first wgmma kernels
# (NVFP4DBG_SM90=v1), alternating, and ncu's warp states of the two new kernels.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 NO_COLOR=1 PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NVFP4DBG_CUDA_INCLUDE=/usr/local/cuda/include:/usr/local/cuda/include/cccl
R=/tmp/s6b; mkdir -p $R
t0=$(date +%s)
pack() { tar czf $OUT/s6b.tgz -C $R .; }
for t in gpu_gemm gpu_moe; do
    timeout 200 .dev/gpu/$t --ignored --nocapture --test-threads 1 > $R/$t.txt 2>&1
    echo "$t rc=$? at $(( $(date +%s) - t0 )) s" | tee -a $R/log.txt
    grep -E "^test |test result|panicked" $R/$t.txt | head -20
    pack
done
B=".dev/gpu/nvfp4dbg bench --device cuda --no-report-dir -q --quick --only floors,gemm_prefill,layer"
for i in 1 2; do
    timeout 90 $B --json $R/ws-$i.json > $R/ws-$i.txt 2>&1
    echo "ws $i rc=$? at $(( $(date +%s) - t0 )) s" | tee -a $R/log.txt
    NVFP4DBG_SM90=v1 timeout 90 $B --json $R/v1-$i.json > $R/v1-$i.txt 2>&1
    echo "v1 $i rc=$? at $(( $(date +%s) - t0 )) s" | tee -a $R/log.txt
    pack
done
for f in $R/ws-1.txt $R/v1-1.txt $R/ws-2.txt $R/v1-2.txt; do
    echo "== $f"; grep -E "│ [a-z_0-9]+ +│" $f | awk -F'│' '{print $2,$3,$5,$9}' | grep -E "prefill|layer_4096|ceil"
    grep -iE "error|panicked" $f | head -5
done
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
if [ -x "$NCU" ]; then
    timeout 150 $NCU --clock-control none -k regex:sm90ws -c 2 --section SpeedOfLight --section WarpStateStats \
        --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
        .dev/gpu/nvfp4dbg bench --device cuda --no-report-dir -q --quick --only gemm_prefill_4096_down > $R/ncu.txt 2>&1
    echo "ncu rc=$? at $(( $(date +%s) - t0 )) s" | tee -a $R/log.txt
    grep -E "Duration|Throughput|Stall|Issued Warp|No Eligible|Busy|Pipe" $R/ncu.txt | head -40
fi
pack
echo "total $(( $(date +%s) - t0 )) s"
