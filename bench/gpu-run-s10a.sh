#!/usr/bin/env bash
# session 10, first device call: the GPU tests of the two layer changes (the shared expert on a
# second stream beside the routed experts; the expert inputs quantized token by token), then
# the layer figures with each change on and off (env knobs, one build), alternating.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 NO_COLOR=1 PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NVFP4DBG_CUDA_INCLUDE=/usr/local/cuda/include:/usr/local/cuda/include/cccl
export NVFP4DBG_CACHE_DIR=/tmp/nvfp4dbg-cubin
L=${LABEL:-s10a}
R=/tmp/$L; mkdir -p $R
t0=$(date +%s)
pack() { tar czf $OUT/$L.tgz -C $R .; }
stamp() { echo "$1 at $(( $(date +%s) - t0 )) s" | tee -a $R/log.txt; }
for t in ${TESTS:-gpu_moe gpu_graph}; do
    timeout 150 .dev/gpu/$t --ignored --nocapture --test-threads 1 > $R/$t.txt 2>&1
    stamp "$t rc=$?: $(grep -E '^test result' $R/$t.txt | tail -1)"
    grep -E "^test .* (ok|FAILED)$|panicked" -A3 $R/$t.txt | head -30
    pack
done
# the quantize figures with the traffic-only kernel beside them (details.traffic_only_ms)
for i in 1 2; do
    timeout 60 .dev/gpu/nvfp4dbg bench --device cuda --no-report-dir -q --quick --only floors,quantize \
        --json $R/quant-$i.json > $R/quant-$i.txt 2>&1
    stamp "quantize bench $i rc=$?"
done
python3 - $R <<'PY'
import json, sys, glob
for f in sorted(glob.glob(sys.argv[1] + "/quant-*.json")):
    for r in json.load(open(f))["results"]:
        d = r.get("details") or {}
        print(f.split("/")[-1], r["name"], r.get("median_ms"), r.get("ratio"),
              {k: d[k] for k in d if "copy" in k or "traffic" in k})
PY
pack
VARIANTS=${VARIANTS:-"both| noside|NVFP4DBG_SHARED_STREAM=0 gather|NVFP4DBG_QUANT_SCATTER=0 neither|NVFP4DBG_SHARED_STREAM=0,NVFP4DBG_QUANT_SCATTER=0"}
for i in $(seq ${ROUNDS:-2}); do
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
python3 - $R <<'PY'
import json, sys, glob
for f in sorted(glob.glob(sys.argv[1] + "/*-1.json")):
    for r in json.load(open(f))["results"]:
        if r["name"].startswith("layer_") and r.get("details"):
            d = r["details"]
            print(f.split("/")[-1], r["name"], d.get("schedule"), d.get("stage_median_ms"))
PY
pack
stamp total
