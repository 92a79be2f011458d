#!/usr/bin/env bash
# session 7, third device call: the register-A prefill with the weights prefetched into L2
# RS_L2_AHEAD = 4 chunks ahead (the default now) against 0 (none) and 8: gpu_gemm, then prefill
# and layer figures alternating (the layer's stage split included).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 NO_COLOR=1 PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NVFP4DBG_CUDA_INCLUDE=/usr/local/cuda/include:/usr/local/cuda/include/cccl
R=/tmp/s7c; mkdir -p $R
t0=$(date +%s)
pack() { tar czf $OUT/s7c.tgz -C $R .; }
timeout 100 .dev/gpu/gpu_gemm --ignored --nocapture --test-threads 1 > $R/gpu_gemm.txt 2>&1
rc=$?; echo "gpu_gemm rc=$rc at $(( $(date +%s) - t0 )) s" | tee -a $R/log.txt
grep -E "test result|panicked" $R/gpu_gemm.txt | head -5
[ $rc -eq 124 ] && { pack; exit 1; }
B=".dev/gpu/nvfp4dbg bench --device cuda --no-report-dir -q --quick --only floors,gemm_prefill,layer_4096"
for i in 1 2; do
    timeout 60 $B --json $R/l2a4-$i.json > $R/l2a4-$i.txt 2>&1
    NVFP4DBG_NVRTC_DEFINES="-DRS_L2_AHEAD=0" timeout 60 $B --json $R/l2a0-$i.json > $R/l2a0-$i.txt 2>&1
    NVFP4DBG_NVRTC_DEFINES="-DRS_L2_AHEAD=8" timeout 60 $B --json $R/l2a8-$i.json > $R/l2a8-$i.txt 2>&1
    echo "bench round $i at $(( $(date +%s) - t0 )) s" | tee -a $R/log.txt
    pack
done
for v in l2a4 l2a0 l2a8; do for i in 1 2; do
    echo "== $v $i"; grep -E "│ [a-z_0-9]+ +│" $R/$v-$i.txt | awk -F'│' '{print $2,$3,$5,$9}' | grep -E "prefill|layer|ceil"
    grep -iE "error|panicked" $R/$v-$i.txt | head -3
done; done
python3 - $R/l2a4-1.json <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["results"]:
    if r.get("name") == "layer_4096_graph":
        print("stage split:", json.dumps(r.get("details", {}).get("stage_median_ms")))
PY
pack
echo "total $(( $(date +%s) - t0 )) s"
