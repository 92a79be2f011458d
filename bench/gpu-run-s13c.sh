#!/usr/bin/env bash
# Historical: RS_WSMEM was removed after s13c (it measured slower and hung); at HEAD the
# RS_WSMEM defines below are ignored, so every variant runs the same kernels.
# session 13, third device call: (1) does the weight-stage path (RS_WSMEM=3) hang? gpu_gemm's
# ragged-expert test 4 times, alternating with RS_WSMEM=0 as the control, each under a timeout;
# (2) its speed, alternating rounds of the prefill GEMM figures (s13b ran each variant once,
# and whole processes shift by ~10%).
set -uo pipefail
L=${LABEL:-s13c}
source bench/gpu-lib.sh
D=NVFP4DBG_NVRTC_DEFINES
for i in 1 2 3 4; do
    for v in "w3|" "regs|$D=-DRS_WSMEM=0"; do
        n=${v%%|*}; IFS=, read -ra kv <<< "${v#*|}"
        s=$(date +%s.%N)
        env "${kv[@]//\~/ }" timeout 45 .dev/gpu/gpu_gemm --ignored --nocapture --test-threads 1 ragged > $R/ragged-$n-$i.txt 2>&1
        rc=$?
        stamp "$n ragged $i rc=$rc in $(python3 -c "import time; print(round(time.time() - $s, 1))") s: $(grep -E '^test result' $R/ragged-$n-$i.txt) last: $(grep -E 'vs cpu' $R/ragged-$n-$i.txt | tail -1 | cut -c1-60)"
    done
    pack
done
ab_rounds ${ROUNDS:-4} ${ONLY:-gemm_prefill} "w3| regs|$D=-DRS_WSMEM=0"
stamp total
