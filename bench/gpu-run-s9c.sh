#!/usr/bin/env bash
# session 9, third device call (build of the wide-tile commit): the register-A prefill's L2
# prefetch distance now that each expert's weights stream from DRAM once (one tile per expert
# at 4096 tokens): RS_L2_AHEAD 4 (default), 6, 8 and 2 (none), prefill figures alternating.
# (The macro is now one per kernel, RS_L2_AHEAD_DOWN / RS_L2_AHEAD_GATE_UP: pass VARIANTS.)
set -uo pipefail
export NCCL_NVLS_ENABLE=0 NO_COLOR=1 PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NVFP4DBG_CUDA_INCLUDE=/usr/local/cuda/include:/usr/local/cuda/include/cccl
L=${LABEL:-s9c}
R=/tmp/$L; mkdir -p $R
t0=$(date +%s)
pack() { tar czf $OUT/$L.tgz -C $R .; }
VARIANTS=${VARIANTS:-"l2a4| l2a6|-DRS_L2_AHEAD=6 l2a8|-DRS_L2_AHEAD=8 l2a2|-DRS_L2_AHEAD=2"}
for i in $(seq ${ROUNDS:-2}); do
    for v in $VARIANTS; do
        n=${v%%|*}
        NVFP4DBG_NVRTC_DEFINES="${v#*|}" timeout 60 .dev/gpu/nvfp4dbg bench --device cuda --no-report-dir -q --quick \
            --only gemm_prefill --json $R/$n-$i.json > $R/$n-$i.txt 2>&1
    done
    echo "bench round $i at $(( $(date +%s) - t0 )) s" | tee -a $R/log.txt
    pack
done
python3 bench/ab_summary.py $R $(for v in $VARIANTS; do echo "${v%%|*}"; done)
pack
echo "total $(( $(date +%s) - t0 )) s"
