#!/usr/bin/env bash
# Session 45: the compare reduction on an H200 (s45b read 0.77 of copy after session 44's
# acc_takes, against 0.86 in s41c). Alternating quick rounds of four builds of pass 1: batch
# (the default: acc_batch, branch-free where a batch is all finite), r0 (every element through
# acc_one, its ascending-index rule), s44 (acc_one with session 44's acc_takes) and old (the
# rule before session 44, wrong for a NaN reference, timed only); then the GPU tests of the
# reduction and the nightly on the default. Writes $OUT/$LABEL.tgz after each step. (The
# variants' macros, REDUCE_BATCH and REDUCE_ONE_RULE, went after this A/B: batch was kept.)
set -uo pipefail
L=${LABEL:-s45c}
source bench/gpu-lib.sh
nvidia-smi -L | tee $R/gpus.txt
ab_rounds 4 copy_d2d,reduce "batch|NVFP4DBG_NVRTC_DEFINES= r0|NVFP4DBG_NVRTC_DEFINES=-DREDUCE_BATCH=0 s44|NVFP4DBG_NVRTC_DEFINES=-DREDUCE_BATCH=0~-DREDUCE_ONE_RULE=1 old|NVFP4DBG_NVRTC_DEFINES=-DREDUCE_BATCH=0~-DREDUCE_ONE_RULE=2"
for v in batch r0 s44 old; do
    echo "$v: $(python3 -c "
import glob, json, statistics as st
r = [{x['name']: x for x in json.load(open(p))['results']} for p in sorted(glob.glob('$R/$v-*.json'))]
print(' '.join('%s %.4f ms %.3f' % (k, st.median(x[k]['median_ms'] for x in r), st.median(x[k]['achieved_over_floor'] for x in r)) for k in ('reduce_compare', 'reduce_nan_scan')))
")" | tee -a $R/log.txt
done
pack
run_tests gpu_quant gpu_compare_weights
NIGHTLY_S=${NIGHTLY_S:-220} run_nightly
