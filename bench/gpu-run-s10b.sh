#!/usr/bin/env bash
# session 10, second device call: (1) bench/quantize_traffic_probe.cu (built here with the
# nvcc wheel, carried in .dev/gpu): the quantizer's traffic in several kernel shapes against
# the driver's copies; (2) the layer with the shared expert on a low-priority side stream
# (the main stream now at the highest priority), at the same priority, forked after the
# prologue, and off (the middle two knobs are gone since); (3) gpu_moe and gpu_graph.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 NO_COLOR=1 PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NVFP4DBG_CUDA_INCLUDE=/usr/local/cuda/include:/usr/local/cuda/include/cccl
export NVFP4DBG_CACHE_DIR=/tmp/nvfp4dbg-cubin
L=${LABEL:-s10b}
R=/tmp/$L; mkdir -p $R
t0=$(date +%s)
pack() { tar czf $OUT/$L.tgz -C $R .; }
stamp() { echo "$1 at $(( $(date +%s) - t0 )) s" | tee -a $R/log.txt; }
# (carried from the build machine, else built here with the device's nvcc)
[ -x .dev/gpu/quantize_traffic_probe ] || /usr/local/cuda/bin/nvcc -O3 -gencode=arch=compute_90a,code=sm_90a \
    -o .dev/gpu/quantize_traffic_probe bench/quantize_traffic_probe.cu
timeout 120 .dev/gpu/quantize_traffic_probe > $R/probe.txt 2>&1
stamp "probe rc=$?"; cat $R/probe.txt
pack
# (s10b ran "low| same|NVFP4DBG_SIDE_PRIORITY=main late|NVFP4DBG_SHARED_FORK=gemm off|NVFP4DBG_SHARED_STREAM=0";
# the middle two knobs were removed after it: no difference)
VARIANTS=${VARIANTS:-"low| off|NVFP4DBG_SHARED_STREAM=0"}
for i in $(seq ${ROUNDS:-3}); do
    for v in $VARIANTS; do
        n=${v%%|*}
        env $(echo "${v#*|}" | tr ',' ' ') timeout 120 .dev/gpu/nvfp4dbg bench --device cuda --no-report-dir -q --quick \
            --only ${ONLY:-layer} --json $R/$n-$i.json > $R/$n-$i.txt 2>&1
        echo "$n-$i rc=$?" >> $R/log.txt
    done
    stamp "bench round $i"
    pack
done
python3 bench/ab_summary.py $R $(for v in $VARIANTS; do echo "${v%%|*}"; done)
for t in ${TESTS:-gpu_moe gpu_graph}; do
    timeout 150 .dev/gpu/$t --ignored --nocapture --test-threads 1 > $R/$t.txt 2>&1
    stamp "$t rc=$?: $(grep -E '^test result' $R/$t.txt | tail -1)"
    grep -E "panicked" -A3 $R/$t.txt | head -10
    pack
done
stamp total
