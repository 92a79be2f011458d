#!/usr/bin/env bash
# Session 18: where the 4096-token layer's time goes kernel by kernel: ncu's duration of each
# kernel (clocks left alone), the first 700 launches of `bench --quick --only layer_4096`.
L=s18b; source bench/gpu-lib.sh
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $NCU" | tee -a $R/log.txt
timeout 400 $NCU --clock-control none --metrics gpu__time_duration.sum --launch-count ${COUNT:-700} --csv \
    .dev/gpu/nvfp4dbg bench --device cuda --no-report-dir -q --quick --only layer_4096 > $R/ncu.csv 2> $R/ncu.err
stamp "ncu rc=$?"
tail -5 $R/ncu.err
pack
python3 - $R/ncu.csv <<'PY'
import csv, sys
lines = [l for l in open(sys.argv[1]) if l.startswith('"')]
rows = list(csv.DictReader(lines))
print(len(rows), "kernels")
for i, r in enumerate(rows):
    print(i, r["Kernel Name"][:90], r["Grid Size"], r["Block Size"], r["Metric Value"], r["Metric Unit"])
PY
