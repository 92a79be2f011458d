#!/usr/bin/env bash
# session 12, third device call, on the final build: (1) is the quantize figure's 0.0447 ms in
# s12b's whole bench (0.0426 in every --quick sweep) an order effect? The full-length quantize
# figures alone, after the 8192^3 cuBLAS figure, and after the floors; (2) the nightly
# (bench/gpu-run-final.sh PART=nightly), its CUBIN cache warmed by (1).
set -uo pipefail
L=${LABEL:-s12c}
export NCCL_NVLS_ENABLE=0 NO_COLOR=1 PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NVFP4DBG_CUDA_INCLUDE=/usr/local/cuda/include:/usr/local/cuda/include/cccl
R=/tmp/$L; mkdir -p $R; t0=$(date +%s)
for only in quantize cublas_bf16_8192,quantize floors,quantize quantize; do
    n=$(echo $only | tr ',' '+')
    timeout 60 .dev/gpu/nvfp4dbg bench --device cuda --no-report-dir -q --only $only --json $R/q-$n.json > $R/q-$n.txt 2>&1
    echo "$only rc=$? at $(( $(date +%s) - t0 )) s: $(grep -oE 'quantize_bf16_[a-z_]+ +│ [0-9.]+' $R/q-$n.txt | tr -s ' │' ' ' | tr '\n' ' ')" | tee -a $R/log.txt
done
tar czf $OUT/$L.tgz -C $R .
PART=nightly NIGHTLY_S=${NIGHTLY_S:-480} LABEL=$L-nightly bash bench/gpu-run-final.sh
echo "total $(( $(date +%s) - t0 )) s"
