#!/usr/bin/env bash
# Session 14, lease b: the register-A kernels' knobs were tuned on the GEMM figures' uniform
# routing (s9c, s9e/f); the layer figure routes with its router's uneven load (many tiles of
# 32/64 tokens that stream a whole weight slice for few MMAs). Alternating A/B of the knobs the
# uneven load could flip: L2 prefetch of the gate/up weights 4 chunks ahead, the down GEMM at
# width 144, and the down GEMM without its prefetch (control), on the 4096-token layer and the
# prefill GEMMs.
set -uo pipefail
L=${LABEL:-s14b}
source bench/gpu-lib.sh
D=NVFP4DBG_NVRTC_DEFINES
ab_rounds ${ROUNDS:-3} ${ONLY:-gemm_prefill,layer_4096} \
    "default| l2gu4|$D=-DRS_L2_AHEAD_GATE_UP=4 n144d|$D=-DRS_N144_DOWN=1 l2d0|$D=-DRS_L2_AHEAD_DOWN=0"
python3 - $R <<'PY'
import json, sys, glob, statistics
r = sys.argv[1]
for v in ("default", "l2gu4", "n144d", "l2d0"):
    st = {}
    for f in sorted(glob.glob(f"{r}/{v}-*.json")):
        for x in json.load(open(f))["results"]:
            if x["name"] == "layer_4096_eager" and x.get("details"):
                for k in ("GateUp", "Down"):
                    st.setdefault(k, []).append(x["details"]["stage_median_ms"][k])
    print(v, {k: round(statistics.median(s), 4) for k, s in st.items()})
PY
stamp total
