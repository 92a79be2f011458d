#!/usr/bin/env bash
# Historical: RS_WSMEM was removed after s13c (it measured slower and hung); at HEAD the
# RS_WSMEM defines below are ignored, so every variant runs the same kernels.
# session 13, second device call: s13a's gpu_gemm and bench runs timed out. Which kernel and
# which setting: the DeepSeek-V3-width GEMM test and the two prefill GEMM figures, each alone
# under a short timeout, default (RS_WSMEM=3) against RS_WSMEM=0.
set -uo pipefail
L=${LABEL:-s13b}
source bench/gpu-lib.sh
D=NVFP4DBG_NVRTC_DEFINES
for v in "w3|" "regs|$D=-DRS_WSMEM=0" "w2|$D=-DRS_WSMEM=2"; do
    n=${v%%|*}; IFS=, read -ra kv <<< "${v#*|}"
    env "${kv[@]//\~/ }" timeout 40 .dev/gpu/gpu_gemm --ignored --nocapture --test-threads 1 deepseek > $R/dsv3-$n.txt 2>&1
    stamp "$n dsv3 rc=$?: $(grep -E '^test result' $R/dsv3-$n.txt)"
    for f in gemm_prefill_4096_down gemm_prefill_4096_gate_up; do
        env "${kv[@]//\~/ }" timeout 30 .dev/gpu/nvfp4dbg bench --device cuda --quick --only $f --no-report-dir -q --json $R/$n-$f.json > $R/$n-$f.txt 2>&1
        stamp "$n $f rc=$?: $(grep -E "^ *$f" $R/$n-$f.txt | head -1)"
    done
    pack
done
