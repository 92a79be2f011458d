#!/usr/bin/env bash
# Session 36, first lease: what a launch of the BF16 quantizer pays once, against what it pays
# per byte. `nvfp4dbg bench --only floors,quantize` (full repeats) three times: the quantize
# figure now also times the reference flavor and the driver's copy at 4x the rows
# (details.longer_*, marginal_over_copy). The quantize tests first.
set -uo pipefail
L=${LABEL:-s36a}
source bench/gpu-lib.sh
run_tests gpu_quant
for i in 1 2 3; do
    timeout 150 .dev/gpu/nvfp4dbg bench --device cuda --no-report-dir -q --only floors,quantize \
        --json $R/q-$i.json > $R/q-$i.txt 2>&1
    stamp "bench floors,quantize $i rc=$?"
    pack
done
python3 - $R <<'PY'
import json, sys
for i in (1, 2, 3):
    figs = {f["name"]: f for f in json.load(open(f"{sys.argv[1]}/q-{i}.json"))["results"]}
    c = figs["copy_d2d"]["value"]
    for n in ("quantize_bf16_reference", "quantize_bf16_cuda_fast"):
        f = figs[n]; d = f.get("details", {})
        print(i, n, "ms %.4f ratio %.3f same-copy %.3f" % (f["median_ms"], f["ratio"], d.get("over_copy_same_bytes", 0)),
              " ".join("%s=%.4f" % (k, v) for k, v in d.items() if k.startswith(("longer", "marginal", "copy_same", "traffic"))),
              "copy %.0f" % c)
PY
stamp done
pack
