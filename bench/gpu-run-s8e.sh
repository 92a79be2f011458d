#!/usr/bin/env bash
# session 8, fifth device call: the bulk quantizer's tile balancing A/B (bench/gpu-sweep-quant.sh
# nobal), then ncu's per-instruction stall samples (SourceCounters) of the register-A prefill
# kernels, exported as SASS with their stall columns, for reading where the warps wait.
set -uo pipefail
export NO_COLOR=1 PYTHONUNBUFFERED=1
R=/tmp/s8e; mkdir -p $R
pack() { tar czf $OUT/s8e.tgz -C $R .; }
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NVFP4DBG_CUDA_INCLUDE=/usr/local/cuda/include:/usr/local/cuda/include/cccl
nvidia-smi -L | tee $R/gpus.txt
t0=$(date +%s)
OUT=$R/quant SWEEP_BUDGET_S=70 timeout 120 bash bench/gpu-sweep-quant.sh nobal > $R/quant-sweep.txt 2>&1
echo "quant sweep rc=$? at $(( $(date +%s) - t0 )) s" | tee -a $R/log.txt
head -4 $R/quant/summary.txt
pack
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
$NCU --version | tail -1
for k in moe_gemm_gate_up_nvfp4_sm90rs moe_gemm_nvfp4_sm90rs; do
    timeout 150 $NCU --clock-control none -k regex:"^$k\$" -c 1 --set full --import-source no -f -o $R/$k \
        .dev/gpu/nvfp4dbg bench --device cuda --no-report-dir -q --quick --only gemm_prefill > $R/ncu-$k.txt 2>&1
    echo "ncu $k rc=$? at $(( $(date +%s) - t0 )) s" | tee -a $R/log.txt
    $NCU --import $R/$k.ncu-rep --page source --csv --print-source sass > $R/$k-sass.csv 2> $R/$k-sass.err
    echo "source page rc=$? $(wc -l < $R/$k-sass.csv) lines" | tee -a $R/log.txt
    head -c 600 $R/$k-sass.err
    $NCU --import $R/$k.ncu-rep --page details > $R/$k-details.txt 2>&1
    grep -E "Duration|Warp Cycles Per Issued|Issue Slots Busy|Registers Per" $R/$k-details.txt | head -6
    pack
done
echo "total $(( $(date +%s) - t0 )) s"
