#!/usr/bin/env bash
# session 9, last device call (device budget nearly spent; s9g's nightly ran out of its 420 s
# in gpu_plugin, every earlier GPU test passed): what the nightly had left, on the build with
# the on-disk CUBIN cache: the cases (cold cache: they compile), gpu_plugin (many CLI runs:
# cache hits), gpu_quant; and one `layertest` with the cache off then on, timed.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 NO_COLOR=1 PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NVFP4DBG_CUDA_INCLUDE=/usr/local/cuda/include:/usr/local/cuda/include/cccl
[ -x /usr/local/cuda/bin/nvcc ] && export NVCC=/usr/local/cuda/bin/nvcc
export NVFP4DBG_CACHE_DIR=/tmp/nvfp4dbg-cubin
L=${LABEL:-s9h}
R=/tmp/$L; mkdir -p $R
t0=$(date +%s)
pack() { tar czf $OUT/$L.tgz -C $R .; }
stamp() { echo "$1 at $(( $(date +%s) - t0 )) s" | tee -a $R/log.txt; }
timeout 100 .dev/gpu/nvfp4dbg run cases/ --device cuda --quiet --json $R/cases.json --report-dir $R/cases > $R/cases.txt 2>&1
stamp "cases rc=$?"; tail -4 $R/cases.txt
ls -la $NVFP4DBG_CACHE_DIR > $R/cache.txt 2>&1
pack
for v in off $NVFP4DBG_CACHE_DIR; do
    s=$(date +%s%N)
    NVFP4DBG_CACHE_DIR=$v timeout 60 .dev/gpu/nvfp4dbg layertest --device cuda --json $R/layertest-$(basename $v).json > $R/layertest-$(basename $v).txt 2>&1
    echo "layertest cache=$v rc=$? $(( ($(date +%s%N) - s) / 1000000 )) ms" | tee -a $R/log.txt
done
pack
for t in gpu_plugin gpu_quant; do
    timeout 100 .dev/gpu/$t --ignored --nocapture --test-threads 1 > $R/$t.txt 2>&1
    stamp "$t rc=$?: $(grep -E '^test result' $R/$t.txt | tail -1)"
    grep -E "panicked" -A4 $R/$t.txt | head -8
    pack
done
stamp total
