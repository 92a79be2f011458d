#!/usr/bin/env bash
# session 5, final device call 1: the nightly (every GPU test, every case on cuda) on the
# build packaged by `bash .ci/gpu-nightly --package .dev/gpu`.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 NO_COLOR=1
R=/tmp/rep; mkdir -p $R
nvidia-smi -L | tee $OUT/gpus.txt
t0=$(date +%s)
NVFP4DBG_REPORTS=$R/nightly timeout 560 bash .ci/gpu-nightly .dev/gpu > $R/nightly.txt 2>&1
echo "nightly rc=$? in $(( $(date +%s) - t0 )) s" | tee -a $R/nightly.txt
grep -E "GPU tests:|cases:" $R/nightly.txt | tail -3
grep -E "^(FAIL|fail)|FAILED|panicked" $R/nightly.txt | head -10
tar czf $OUT/nightly.tgz -C $R .
