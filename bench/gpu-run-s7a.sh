#!/usr/bin/env bash
# session 7, first device call: the register-A prefill GEMMs (kernels/moe_gemm_sm90.cu `_sm90rs`):
# GPU tests (gpu_gemm, gpu_moe, gpu_graph), then prefill and layer figures against the first wgmma
# kernels (NVFP4DBG_SM90=v1), alternating, and ncu on the two new kernels.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 NO_COLOR=1 PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NVFP4DBG_CUDA_INCLUDE=/usr/local/cuda/include:/usr/local/cuda/include/cccl
R=/tmp/s7a; mkdir -p $R
t0=$(date +%s)
pack() { tar czf $OUT/s7a.tgz -C $R .; }
for t in gpu_gemm gpu_moe gpu_graph; do
    timeout 150 .dev/gpu/$t --ignored --nocapture --test-threads 1 > $R/$t.txt 2>&1
    rc=$?
    echo "$t rc=$rc at $(( $(date +%s) - t0 )) s" | tee -a $R/log.txt
    # a hang (an mbarrier that never completes) would eat the lease: stop here
    [ $rc -eq 124 ] && { grep -E "^test |panicked" $R/$t.txt | head; pack; exit 1; }
    grep -E "^test |test result|panicked" $R/$t.txt | head -20
    pack
done
B=".dev/gpu/nvfp4dbg bench --device cuda --no-report-dir -q --quick --only floors,gemm_prefill,cublas_bf16_experts_4096,layer"
for i in 1 2; do
    timeout 90 $B --json $R/ws-$i.json > $R/ws-$i.txt 2>&1
    echo "ws $i rc=$? at $(( $(date +%s) - t0 )) s" | tee -a $R/log.txt
    NVFP4DBG_SM90=v1 timeout 90 $B --json $R/v1-$i.json > $R/v1-$i.txt 2>&1
    echo "v1 $i rc=$? at $(( $(date +%s) - t0 )) s" | tee -a $R/log.txt
    pack
done
for f in $R/ws-1.txt $R/v1-1.txt $R/ws-2.txt $R/v1-2.txt; do
    echo "== $f"; grep -E "│ [a-z_0-9]+ +│" $f | awk -F'│' '{print $2,$3,$5,$9}' | grep -E "prefill|layer|ceil|cublas"
    grep -iE "error|panicked" $f | head -5
done
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
if [ -x "$NCU" ]; then
    timeout 150 $NCU --clock-control none -k regex:sm90rs -c 2 --section SpeedOfLight --section WarpStateStats \
        --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
        .dev/gpu/nvfp4dbg bench --device cuda --no-report-dir -q --quick --only gemm_prefill > $R/ncu.txt 2>&1
    echo "ncu rc=$? at $(( $(date +%s) - t0 )) s" | tee -a $R/log.txt
    grep -E "Duration|Throughput|Stall|Issued Warp|No Eligible|Busy|Pipe" $R/ncu.txt | head -40
fi
pack
echo "total $(( $(date +%s) - t0 )) s"
