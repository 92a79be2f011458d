#!/usr/bin/env bash
# Session 18: the memory-bound kernels of the layer rewritten (moe_rows_bf16_rs, the f32 scatter
# quantizer, gather_rows_bf16, swiglu_bf16, moe_combine): the GPU tests that check them bit for
# bit, their durations under ncu (as s18b), then the 4096-token layer and its stages.
L=${L:-s18c}; source bench/gpu-lib.sh
run_tests gpu_moe gpu_gemm
NCU=/usr/local/cuda/bin/ncu
timeout 200 $NCU --clock-control none --metrics gpu__time_duration.sum --launch-count ${COUNT:-560} --csv \
    .dev/gpu/nvfp4dbg bench --device cuda --no-report-dir -q --quick --only layer_4096 > $R/ncu.csv 2> $R/ncu.err
stamp "ncu rc=$?"
python3 - $R/ncu.csv <<'PY' | tee $R/kernels.txt | tail -22
import csv, sys
lines = [l for l in open(sys.argv[1]) if l.startswith('"')]
rows = list(csv.DictReader(lines))
print(len(rows), "kernels")
for i, r in enumerate(rows):
    print(i, r["Kernel Name"][:60], r["Grid Size"], r["Metric Value"], r["Metric Unit"])
PY
pack
for i in 1 2; do
    timeout 120 .dev/gpu/nvfp4dbg bench --device cuda --no-report-dir -q --quick --only layer_4096 --json $R/layer-$i.json > $R/layer-$i.txt 2>&1
    stamp "layer $i rc=$?"
    python3 -c "
import json,sys
for f in json.load(open('$R/layer-$i.json'))['results']:
    print(f['name'], round(f.get('median_ms') or 0,3), {k:(round(v,3) if isinstance(v,float) else v) for k,v in f['details'].get('stage_median_ms',{}).items()})
"
done
pack
