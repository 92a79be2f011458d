#!/usr/bin/env bash
# A session's final device call: the nightly, the whole `nvfp4dbg bench` and the PyTorch peers
# back to back in one lease (RUN_SWEEP=1 adds the quantizer sweep, bench/gpu-sweep-quant.sh), on
# the build of `bash .ci/gpu-nightly --package .dev/gpu`. Writes $OUT/$LABEL.tgz (LABEL default
# "final"; session 7's s7e, session 8's s8g and session 9's s9g ran it under those names).
# PART=nightly runs the nightly alone (560 s: in s9g it outgrew the 420 s it has beside the
# bench and the peers within one 600 s call), PART=bench the bench and the peers alone.
# NIGHTLY_S overrides the nightly's time limit (session 10 ran PART=bench, then PART=nightly
# with NIGHTLY_S=430, in one call).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 NO_COLOR=1 PYTHONUNBUFFERED=1
L=${LABEL:-final}
R=/tmp/$L; mkdir -p $R
pack() { tar czf $OUT/$L.tgz -C $R .; }
nvidia-smi -L | tee $R/gpus.txt
t0=$(date +%s)
PART=${PART:-all}
if [ "$PART" != bench ]; then
    NVFP4DBG_REPORTS=$R/nightly timeout ${NIGHTLY_S:-$([ "$PART" = nightly ] && echo 560 || echo 420)} \
        bash .ci/gpu-nightly .dev/gpu > $R/nightly.txt 2>&1
    echo "nightly rc=$? in $(( $(date +%s) - t0 )) s" | tee -a $R/log.txt
    grep -E "GPU tests:|cases:" $R/nightly.txt | tail -3
    grep -E "^(FAIL|fail)|FAILED|panicked" $R/nightly.txt | head -10
    pack
    [ "$PART" = nightly ] && exit 0
fi
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NVFP4DBG_CUDA_INCLUDE=/usr/local/cuda/include:/usr/local/cuda/include/cccl
timeout 120 .dev/gpu/nvfp4dbg bench --device cuda --no-report-dir -q --json $R/bench.json > $R/bench.txt 2>&1
echo "bench rc=$? at $(( $(date +%s) - t0 )) s" | tee -a $R/log.txt
pack
timeout 70 python3 bench/peers.py --quick --json $R/peers.json > $R/peers.txt 2>&1
echo "peers rc=$? at $(( $(date +%s) - t0 )) s" | tee -a $R/log.txt
pack
grep -E "│ [a-z_0-9]+ +│" $R/bench.txt | awk -F'│' '{print $2,$3,$5,$9}'
if [ "${RUN_SWEEP:-0}" = 1 ]; then
    OUT=$R/quant SWEEP_BUDGET_S=${SWEEP_BUDGET_S:-150} timeout 200 bash bench/gpu-sweep-quant.sh > $R/quant-sweep.txt 2>&1
    echo "quant sweep rc=$? at $(( $(date +%s) - t0 )) s" | tee -a $R/log.txt
    cat $R/quant/summary.txt 2>/dev/null | tail -30
fi
pack
echo "total $(( $(date +%s) - t0 )) s"
