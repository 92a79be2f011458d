#!/usr/bin/env bash
# Session 14, lease c: s14b found the gate/up weights' L2 prefetch (4 chunks ahead) 1.2% faster
# on the layer's gate/up stage in all three rounds and 5% slower on the uniform GEMM figure.
# The uneven load's extra tiles are narrow (32/64 tokens: a whole weight slice for few MMAs),
# so: the prefetch on the narrow tiles only (RS_L2_AHEAD_NARROW=4), against the default and
# against the prefetch everywhere, alternating.
set -uo pipefail
L=${LABEL:-s14c}
source bench/gpu-lib.sh
D=NVFP4DBG_NVRTC_DEFINES
ab_rounds ${ROUNDS:-4} ${ONLY:-gemm_prefill,layer_4096} \
    "default| narrow4|$D=-DRS_L2_AHEAD_NARROW=4 l2gu4|$D=-DRS_L2_AHEAD_GATE_UP=4"
python3 - $R <<'PY'
import json, sys, glob
r = sys.argv[1]
for v in ("default", "narrow4", "l2gu4"):
    print(v)
    for f in sorted(glob.glob(f"{r}/{v}-*.json")):
        d = {x["name"]: x for x in json.load(open(f))["results"]}
        st = d["layer_4096_eager"]["details"]["stage_median_ms"]
        print("  gu %.3f dn %.3f | layer gu %.3f dn %.3f | eager %.3f graph %.3f" % (
            d["gemm_prefill_4096_gate_up"]["median_ms"], d["gemm_prefill_4096_down"]["median_ms"],
            st["GateUp"], st["Down"], d["layer_4096_eager"]["median_ms"], d["layer_4096_graph"]["median_ms"]))
PY
stamp total
