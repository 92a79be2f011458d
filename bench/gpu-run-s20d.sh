#!/usr/bin/env bash
# Session 20, last lease: SwiGLU's (and the router's) exp without conversion instructions
# (EXPF_CR_BITS 1, the default now: x to double, k and the f32 result by integer and FMA
# operations on their bits). gpu_checks (expf_cr and swiglu16 on all 2^32 inputs), gpu_moe and
# gpu_gemm on it; the layer and the prefill GEMMs against -DEXPF_CR_BITS=0, alternating; then
# the whole bench, the peers and (NIGHTLY=1, the default) the nightly on this build.
set -uo pipefail
L=${LABEL:-s20d}
source bench/gpu-lib.sh
run_tests gpu_checks gpu_moe gpu_gemm
D=NVFP4DBG_NVRTC_DEFINES
ab_rounds ${ROUNDS:-3} ${ONLY:-gemm_prefill,layer_4096} "bits| conv|$D=-DEXPF_CR_BITS=0"
timeout 120 .dev/gpu/nvfp4dbg bench --device cuda --no-report-dir -q --json $R/bench.json > $R/bench.txt 2>&1
stamp "bench rc=$?"
timeout 70 python3 bench/peers.py --quick --json $R/peers.json > $R/peers.txt 2>&1
stamp "peers rc=$?"
pack
grep -E "│ [a-z_0-9]+ +│" $R/bench.txt | awk -F'│' '{print $2,$3,$5,$9}'
if [ "${NIGHTLY:-1}" = 1 ]; then
    NVFP4DBG_REPORTS=$R/nightly timeout ${NIGHTLY_S:-170} bash .ci/gpu-nightly .dev/gpu > $R/nightly.txt 2>&1
    stamp "nightly rc=$?"
    grep -E "GPU tests:|cases:" $R/nightly.txt | tail -3
    grep -E "^(FAIL|fail)|FAILED|panicked" $R/nightly.txt | head -10
    pack
fi
