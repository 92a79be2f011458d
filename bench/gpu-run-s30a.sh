#!/usr/bin/env bash
# Session 30, first lease: what the 4096-token layer's time is made of. (1) How much the
# register-A GEMMs' empty CTAs cost: the grid's row tiles set to the bench routing's real count
# (NVFP4DBG_RS_GRID_Y, a diagnostic knob of this lease's build only: wrong below the real count)
# against the worst-case bound. (2) One eager forward's kernel timeline under nsys (gaps,
# tails, the shared expert beside the routed experts).
set -uo pipefail
L=${LABEL:-s30a}
source bench/gpu-lib.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv > $R/smi.txt 2>&1
NSYS=$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys /usr/local/cuda/nsight-systems*/bin/nsys 2>/dev/null | head -1)
echo "nsys: ${NSYS:-none}" | tee -a $R/log.txt
ab_rounds 3 layer_4096 "default| y349|NVFP4DBG_RS_GRID_Y=349 y380|NVFP4DBG_RS_GRID_Y=380"
if [ -n "$NSYS" ]; then
    timeout 200 $NSYS profile --force-overwrite true -o $R/layer --trace cuda --cuda-graph-trace node \
        .dev/gpu/nvfp4dbg bench --device cuda --no-report-dir -q --quick --only layer_4096_eager > $R/nsys-run.txt 2>&1
    stamp "nsys rc=$?"
    timeout 120 $NSYS stats --force-export true --report cuda_gpu_kern_sum --format csv -o $R/kern $R/layer.nsys-rep > /dev/null 2>&1
    timeout 120 $NSYS stats --report cuda_gpu_trace --format csv -o $R/trace $R/layer.nsys-rep > /dev/null 2>&1
    stamp "nsys stats rc=$?"
    ls -la $R >> $R/log.txt
    rm -f $R/layer.nsys-rep $R/layer.sqlite
    # keep the trace's last 400 rows (the last forwards) only
    f=$(ls $R/trace*.csv 2>/dev/null | head -1)
    [ -n "$f" ] && { head -1 $f > $R/trace-tail.csv; tail -400 $f >> $R/trace-tail.csv; rm -f $f; }
fi
stamp done
pack
