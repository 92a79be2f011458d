#!/usr/bin/env bash
# Session 18: the memory-bound kernels of the layer rewritten (moe_rows_bf16_rs, the f32 scatter
# quantizer, gather_rows_bf16, swiglu_bf16, moe_combine): the GPU tests that check them bit for
# bit, their durations under ncu (as s18b), then the 4096-token layer and its stages.
L=${L:-s18c}; source bench/gpu-lib.sh
run_tests gpu_moe gpu_gemm
ncu_layer 200 --launch-count ${COUNT:-560}
ncu_kernels | tee $R/kernels.txt | tail -22
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
