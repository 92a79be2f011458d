#!/usr/bin/env bash
# final device call 1: the nightly (GPU tests + cases on cuda), then the bench
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 NO_COLOR=1
R=/tmp/rep; mkdir -p $R
nvidia-smi -L | tee $OUT/gpus.txt
t0=$(date +%s)
NVFP4DBG_REPORTS=$R/nightly timeout 470 bash .ci/gpu-nightly .dev/gpu > $R/nightly.txt 2>&1
echo "nightly rc=$? in $(( $(date +%s) - t0 )) s" | tee -a $R/nightly.txt
grep -E "^(passed|failed)" $R/nightly.txt | grep -v "^passed" ; grep -E "GPU tests:|verdict" $R/nightly.txt
cp $R/nightly/summary.md $OUT/ 2>/dev/null
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NVFP4DBG_CUDA_INCLUDE=/usr/local/cuda/include:/usr/local/cuda/include/cccl
t1=$(date +%s)
timeout 100 .dev/gpu/nvfp4dbg bench --device cuda --json $OUT/bench.json --no-report-dir -q > $OUT/bench.txt 2>&1
echo "bench rc=$? in $(( $(date +%s) - t1 )) s" | tee -a $OUT/bench.txt
tail -45 $OUT/bench.txt
tar czf $OUT/nightly.tgz -C $R . 2>/dev/null
echo "total $(( $(date +%s) - t0 )) s"
