#!/usr/bin/env bash
# session 6, final device call: the nightly, the whole `nvfp4dbg bench` and the PyTorch peers
# back to back in one lease, then the quantizer's new encoder against the old one
# (QUANT_ENCODER=0), alternating.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 NO_COLOR=1 PYTHONUNBUFFERED=1
R=/tmp/s6c; mkdir -p $R
pack() { tar czf $OUT/s6c.tgz -C $R .; }
nvidia-smi -L | tee $R/gpus.txt
t0=$(date +%s)
NVFP4DBG_REPORTS=$R/nightly timeout 420 bash .ci/gpu-nightly .dev/gpu > $R/nightly.txt 2>&1
echo "nightly rc=$? in $(( $(date +%s) - t0 )) s" | tee -a $R/log.txt
grep -E "GPU tests:|cases:" $R/nightly.txt | tail -3
grep -E "^(FAIL|fail)|FAILED|panicked" $R/nightly.txt | head -10
pack
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NVFP4DBG_CUDA_INCLUDE=/usr/local/cuda/include:/usr/local/cuda/include/cccl
timeout 60 .dev/gpu/nvfp4dbg bench --device cuda --no-report-dir -q --json $R/bench.json > $R/bench.txt 2>&1
echo "bench rc=$? at $(( $(date +%s) - t0 )) s" | tee -a $R/log.txt
pack
timeout 70 python3 bench/peers.py --quick --json $R/peers.json > $R/peers.txt 2>&1
echo "peers rc=$? at $(( $(date +%s) - t0 )) s" | tee -a $R/log.txt
pack
grep -E "│ [a-z_0-9]+ +│" $R/bench.txt | awk -F'│' '{print $2,$3,$5,$9}'
Q=".dev/gpu/nvfp4dbg bench --device cuda --no-report-dir -q --quick --only floors,quantize"
for i in 1 2; do
    timeout 40 $Q --json $R/quant-new-$i.json > $R/quant-new-$i.txt 2>&1
    NVFP4DBG_NVRTC_DEFINES="-DQUANT_ENCODER=0" timeout 40 $Q --json $R/quant-old-$i.json > $R/quant-old-$i.txt 2>&1
    NVFP4DBG_NVRTC_DEFINES="-DQUANT_MIN_BLOCKS=4" timeout 40 $Q --json $R/quant-new4-$i.json > $R/quant-new4-$i.txt 2>&1
done
for f in $R/quant-*.txt; do echo "== $f"; grep -E "quantize" $f | awk -F'│' '{print $2,$3,$5,$9}'; done
pack
echo "total $(( $(date +%s) - t0 )) s"
