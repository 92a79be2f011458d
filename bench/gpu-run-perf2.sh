#!/usr/bin/env bash
# (kept from .dev/perf2/run.sh: the binaries come from `bash .ci/gpu-nightly --package .dev/perf2`, plus
# tools/checks/e4m3_hw_encode.cu and kernels/nvfp4dbg_common.cuh copied beside them)
# perf2 (issue #10 round 2): the lead's final GPU validation + the perf2 figures, one call.
# GPU tests first (each with --ignored --test-threads=1), then the bench, then the first decode
# kernels of the same binary (NVFP4DBG_MOE_DECODE=v1) as the baseline. Logs under $OUT.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 NO_COLOR=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NVFP4DBG_CUDA_INCLUDE=/usr/local/cuda/include:/usr/local/cuda/include/cccl
D=.dev/perf2
t0=$(date +%s)
left() { echo $(( 288 - ($(date +%s) - t0) )); }
nvidia-smi -L > $OUT/gpu.txt 2>&1
: > $OUT/tests.txt
# the reference flavor's scale now goes through the hardware E4M3 conversion: all inputs
/usr/local/cuda/bin/nvcc -gencode=arch=compute_90a,code=sm_90a -O3 --fmad=false -I $D -o /tmp/e4m3_check $D/e4m3_hw_encode.cu > $OUT/e4m3.txt 2>&1 && /tmp/e4m3_check >> $OUT/e4m3.txt 2>&1
echo "e4m3_hw_encode rc=$? $(tail -1 $OUT/e4m3.txt)" | tee -a $OUT/tests.txt
for tl in gpu_faults:50 gpu_quant:45 gpu_moe:75 gpu_graph:45 gpu_gemm:45; do
    t=${tl%%:*}; ts=$(date +%s)
    timeout ${tl##*:} $D/$t --ignored --test-threads=1 > $OUT/$t.log 2>&1
    rc=$?
    echo "$t rc=$rc $(( $(date +%s) - ts ))s $(grep -E '^test result' $OUT/$t.log | tail -1)" | tee -a $OUT/tests.txt
    grep -E "FAILED|panicked" $OUT/$t.log | head -5 | tee -a $OUT/tests.txt
done
tar czf $OUT/testlogs.tgz -C $OUT gpu_faults.log gpu_quant.log gpu_moe.log gpu_graph.log gpu_gemm.log && rm -f $OUT/gpu_*.log
L=$(left); [ $L -gt 170 ] && L=170
echo "bench (lean) timeout $L s" | tee -a $OUT/tests.txt
timeout $L $D/nvfp4dbg bench --device cuda --only floors,quantize,gemm_decode,layer --json $OUT/bench.json --no-report-dir -q > $OUT/bench.txt 2>&1
echo "bench rc=$? at $(( $(date +%s) - t0 ))s" | tee -a $OUT/bench.txt
L=$(left)
if [ $L -gt 20 ]; then
    NVFP4DBG_MOE_DECODE=v1 timeout $L $D/nvfp4dbg bench --device cuda --only floors,gemm_decode,layer_16 --json $OUT/bench_v1.json --no-report-dir -q > $OUT/bench_v1.txt 2>&1
    echo "bench v1 rc=$? at $(( $(date +%s) - t0 ))s" | tee -a $OUT/bench_v1.txt
fi
cat $OUT/tests.txt
grep -E "copy|quantize|gemm_decode|layer" $OUT/bench.txt | head -30
grep -E "gemm_decode|layer" $OUT/bench_v1.txt 2>/dev/null | head -10
echo "total $(( $(date +%s) - t0 )) s"
