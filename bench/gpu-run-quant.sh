#!/usr/bin/env bash
# The quantizer on the device, on the build of `bash .ci/gpu-nightly --package .dev/gpu`: its GPU
# tests (gpu_quant, gpu_moe), the sweep of its variants (bench/gpu-sweep-quant.sh: VARIANTS, or
# the names given), then the full quantize figures with the copy of the quantizer's own bytes.
# Writes $OUT/$LABEL.tgz (LABEL default "quant"). Session 8's s8a-s8d ran this script as of
# their commits (s8a-s8b without the full figures, s8b with torch copies at the quantizer's size).
set -uo pipefail
L=${LABEL:-quant}
export NO_COLOR=1 PYTHONUNBUFFERED=1
R=/tmp/$L; mkdir -p $R
pack() { tar czf $OUT/$L.tgz -C $R .; }
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NVFP4DBG_CUDA_INCLUDE=/usr/local/cuda/include:/usr/local/cuda/include/cccl
nvidia-smi -L | tee $R/gpus.txt
t0=$(date +%s)
for t in gpu_quant gpu_moe; do
    timeout 150 .dev/gpu/$t --ignored --test-threads=1 --nocapture > $R/test-$t.txt 2>&1
    echo "$t rc=$? at $(( $(date +%s) - t0 )) s: $(grep -E '^test result' $R/test-$t.txt | tail -1)" | tee -a $R/log.txt
    grep -E "^test .*(FAILED|ok)$|panicked|bulk quantizer" $R/test-$t.txt | head -20
done
pack
OUT=$R/quant SWEEP_BUDGET_S=${SWEEP_BUDGET_S:-200} timeout 320 bash bench/gpu-sweep-quant.sh "$@" > $R/quant-sweep.txt 2>&1
echo "quant sweep rc=$? at $(( $(date +%s) - t0 )) s" | tee -a $R/log.txt
cat $R/quant/summary.txt 2>/dev/null | tail -30
grep -E "test-" $R/quant-sweep.txt | head -20
pack
# the full (not --quick) quantize figures, with the copy at the quantizer's bytes
timeout 60 .dev/gpu/nvfp4dbg bench --device cuda --only floors,quantize --no-report-dir -q --json $R/bench-quant.json > $R/bench-quant.txt 2>&1
echo "bench rc=$?" | tee -a $R/log.txt
python3 -c "
import json,sys
for r in json.load(open('$R/bench-quant.json'))['results']:
    d=r.get('details',{})
    print(r['name'], r.get('median_ms'), r.get('ratio'), d.get('copy_same_bytes_ms'), d.get('over_copy_same_bytes'))
" | tee -a $R/log.txt
pack
echo "total $(( $(date +%s) - t0 )) s"
