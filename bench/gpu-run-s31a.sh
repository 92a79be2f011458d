#!/usr/bin/env bash
# Session 31, first lease: the prefill chain launched early (programmatic dependent launch:
# the rows scatter, the gate/up and the down GEMMs) checked and timed. PART=tests: the GPU
# tests of the prefill kernels and `layertest` outputs against plain launches
# (NVFP4DBG_PDL=0); PART=ab: alternating bench rounds, early against plain launches and the
# trigger at the K loop's start; PART=ncu: the GEMMs' SM activity (their tails), and the SM
# clock, power and throttle reasons under the layer. (The early launches and RS_PDL_TRIGGER are
# in commit 4b606e7 only.)
set -uo pipefail
L=${LABEL:-s31a}-${PART:-tests}
source bench/gpu-lib.sh
case ${PART:-tests} in
tests)
    run_tests gpu_moe gpu_gemm gpu_graph
    same_outputs plain NVFP4DBG_PDL=0
    ;;
ab)
    ab_rounds ${ROUNDS:-4} layer_4096 "early| plain|NVFP4DBG_PDL=0 start|NVFP4DBG_NVRTC_DEFINES=-DRS_PDL_TRIGGER=0"
    ;;
ncu)
    NCU="${NCU:-$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)}"
    timeout 200 "$NCU" --clock-control none -k regex:sm90rs -c 4 --csv \
        --metrics gpu__time_duration.sum,sm__cycles_active.avg,sm__cycles_active.max,sm__cycles_elapsed.avg,sm__warps_active.avg.pct_of_peak_sustained_active,launch__grid_size \
        .dev/gpu/nvfp4dbg bench --device cuda --quick --only layer_4096_eager --no-report-dir -q > $R/ncu-active.csv 2> $R/ncu-active.err
    stamp "ncu rc=$?"
    grep -E "sm__cycles|gpu__time|grid_size" $R/ncu-active.csv | awk -F'","' '{print $5, $(NF-2), $(NF-1), $NF}' | head -30
    pack
    nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_event_reasons.active --format=csv,noheader,nounits -lms 20 > $R/clocks.csv &
    P=$!
    timeout 120 .dev/gpu/nvfp4dbg bench --device cuda --no-report-dir -q --quick --only layer_4096_graph,gemm_prefill --json $R/clk.json > $R/clk.txt 2>&1
    stamp "bench rc=$?"
    kill $P
    python3 - $R/clocks.csv <<'PY'
import sys, collections, statistics as st
rows = [[x.strip() for x in l.split(',')] for l in open(sys.argv[1]) if l.count(',') == 3]
busy = [r for r in rows if float(r[2]) > 200]
print(len(rows), 'samples;', len(busy), 'above 200 W')
if busy:
    clk = [float(r[1]) for r in busy]
    print('SM clock median', st.median(clk), 'min', min(clk), 'max', max(clk), '; power median', st.median([float(r[2]) for r in busy]), 'max', max(float(r[2]) for r in busy))
    print('throttle reasons (hex mask: count):', dict(collections.Counter(r[3] for r in busy)))
PY
    stamp done
    pack
    ;;
esac
