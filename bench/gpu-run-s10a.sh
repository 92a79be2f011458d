#!/usr/bin/env bash
# session 10, first device call: the GPU tests of the two layer changes (the shared expert on a
# second stream beside the routed experts; the expert inputs quantized token by token), the
# quantize figures with the traffic-only kernel beside them, then the layer figures with each
# change on and off (env knobs, one build), alternating.
set -uo pipefail
L=${LABEL:-s10a}
source bench/gpu-lib.sh
run_tests ${TESTS:-gpu_moe gpu_graph}
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
ab_rounds ${ROUNDS:-2} ${ONLY:-layer} "${VARIANTS:-both| noside|NVFP4DBG_SHARED_STREAM=0 gather|NVFP4DBG_QUANT_SCATTER=0 neither|NVFP4DBG_SHARED_STREAM=0,NVFP4DBG_QUANT_SCATTER=0}"
# how each variant laid the layer out, and its stages
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
