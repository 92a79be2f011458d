#!/usr/bin/env bash
# session 9, first device call: the register-A prefill with wide last tiles (an expert's last
# tile takes up to 160 rows, one m64n160 tile instead of 128 + a 32-row overflow tile) and
# token boxes of 128 and 32 rows (a tile loads only its own width). GPU tests of the prefill kernels,
# then prefill and layer figures alternating between: this build ("wide"), this build with
# NVFP4DBG_RS_SLACK=0 ("narrow": every tile <= 128 rows, the 32-row boxes kept) and the build
# of c35272d in .dev/gpu-old ("old": 128-row boxes).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 NO_COLOR=1 PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NVFP4DBG_CUDA_INCLUDE=/usr/local/cuda/include:/usr/local/cuda/include/cccl
L=${LABEL:-s9a}
R=/tmp/$L; mkdir -p $R
t0=$(date +%s)
pack() { tar czf $OUT/$L.tgz -C $R .; }
nvidia-smi -L | tee $R/gpus.txt
run_test() {  # binary, filter
    timeout 200 .dev/gpu/$1 --ignored --nocapture --test-threads 1 ${2:-} > $R/$1.txt 2>&1
    echo "$1 rc=$? at $(( $(date +%s) - t0 )) s: $(grep -E '^test result' $R/$1.txt | tail -1)" | tee -a $R/log.txt
    grep -E "panicked" -A4 $R/$1.txt | head -10
}
run_test gpu_gemm
run_test gpu_moe
run_test gpu_graph
pack
for i in 1 2; do
    for v in "wide|gpu|" "narrow|gpu|0" "old|gpu-old|"; do
        IFS='|' read -r n b slack <<< "$v"
        NVFP4DBG_RS_SLACK=$slack timeout 60 .dev/$b/nvfp4dbg bench --device cuda --no-report-dir -q --quick \
            --only floors,gemm_prefill,layer_4096 --json $R/$n-$i.json > $R/$n-$i.txt 2>&1
    done
    echo "bench round $i at $(( $(date +%s) - t0 )) s" | tee -a $R/log.txt
    pack
done
python3 bench/ab_summary.py $R wide narrow old
pack
echo "total $(( $(date +%s) - t0 )) s"
