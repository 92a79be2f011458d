#!/usr/bin/env bash
# session 7, fourth device call: the register-A prefill walking its tiles persistently (one CTA
# per SM, the default now) against one CTA per tile (NVFP4DBG_SM90_GRID=tiles): gpu_gemm,
# gpu_moe, gpu_graph, then prefill and layer figures alternating.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 NO_COLOR=1 PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NVFP4DBG_CUDA_INCLUDE=/usr/local/cuda/include:/usr/local/cuda/include/cccl
R=/tmp/s7d; mkdir -p $R
t0=$(date +%s)
pack() { tar czf $OUT/s7d.tgz -C $R .; }
for t in gpu_gemm gpu_moe gpu_graph; do
    timeout 120 .dev/gpu/$t --ignored --nocapture --test-threads 1 > $R/$t.txt 2>&1
    rc=$?; echo "$t rc=$rc at $(( $(date +%s) - t0 )) s" | tee -a $R/log.txt
    grep -E "test result|panicked" $R/$t.txt | head -5
    [ $rc -eq 124 ] && { pack; exit 1; }
done
B=".dev/gpu/nvfp4dbg bench --device cuda --no-report-dir -q --quick --only floors,gemm_prefill,layer_4096"
for i in 1 2; do
    timeout 60 $B --json $R/walk-$i.json > $R/walk-$i.txt 2>&1
    NVFP4DBG_SM90_GRID=tiles timeout 60 $B --json $R/tiles-$i.json > $R/tiles-$i.txt 2>&1
    echo "bench round $i at $(( $(date +%s) - t0 )) s" | tee -a $R/log.txt
    pack
done
for v in walk tiles; do for i in 1 2; do
    echo "== $v $i"; grep -E "│ [a-z_0-9]+ +│" $R/$v-$i.txt | awk -F'│' '{print $2,$3,$5,$9}' | grep -E "prefill|layer|ceil"
    grep -iE "error|panicked" $R/$v-$i.txt | head -3
done; done
python3 - $R/walk-1.json <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["results"]:
    if r.get("name") == "layer_4096_graph":
        print("stage split:", json.dumps(r.get("details", {}).get("stage_median_ms")))
PY
pack
echo "total $(( $(date +%s) - t0 )) s"
