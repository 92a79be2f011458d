#!/usr/bin/env bash
# Session 32, second lease: why 2-CTA clusters lost (bench/cluster_probe.cu: how many clusters
# fit, and a grid of the down's shape that only spins, as CTAs and as clusters), then the
# register-A GEMMs' L2 eviction policies (RS_W_EVICT, RS_TOK_EVICT_LAST): ncu's DRAM bytes of
# the first gate/up and down of a layer forward under each, the prefill tests under the
# combined one, and alternating bench rounds.
# The knob was measured and removed: run this on a build of commit f5dafcf (BENCHMARKS.md, Session 32).
set -uo pipefail
L=${LABEL:-s32b}
source bench/gpu-lib.sh
/usr/local/cuda/bin/nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -o /tmp/cluster_probe bench/cluster_probe.cu \
    > $R/cluster_probe.txt 2>&1 && /tmp/cluster_probe >> $R/cluster_probe.txt 2>&1
stamp "cluster probe rc=$?"; cat $R/cluster_probe.txt
D=NVFP4DBG_NVRTC_DEFINES
V="default| w1|$D=-DRS_W_EVICT=1 tok|$D=-DRS_TOK_EVICT_LAST=1 w1tok|$D=-DRS_W_EVICT=1~-DRS_TOK_EVICT_LAST=1"
for v in $V; do
    n=${v%%|*}; e=${v#*|}
    env ${e//\~/ } timeout 90 /usr/local/cuda/bin/ncu --clock-control none --metrics \
        gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct \
        -k regex:sm90rs -c 2 --csv .dev/gpu/nvfp4dbg bench --device cuda --quick --only layer_4096_eager \
        --no-report-dir -q > $R/ncu-$n.csv 2> $R/ncu-$n.err
    stamp "ncu $n rc=$?"
    grep -E '^"' $R/ncu-$n.csv | awk -F'","' '{print $5" | "$(NF-2)" "$(NF-1)" "$NF}' | cut -c1-150 | grep -v "Kernel Name"
done
pack
variant_tests w1tok $D=-DRS_W_EVICT=1~-DRS_TOK_EVICT_LAST=1 gpu_gemm
ab_rounds ${ROUNDS:-3} layer_4096 "$V"
stamp done
pack
