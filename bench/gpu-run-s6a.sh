#!/usr/bin/env bash
# session 6, first device call: the warp-specialized prefill GEMMs' GPU tests, then the
# prefill GEMM and layer figures with them and (NVFP4DBG_SM90=v1) with the first wgmma
# kernels, alternating, in one lease; one CTA per tile instead of the persistent grid; fewer
# stages; the decode down GEMM at 4 CTAs per SM; then the quantize sweep if it is there.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 NO_COLOR=1 PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NVFP4DBG_CUDA_INCLUDE=/usr/local/cuda/include:/usr/local/cuda/include/cccl
R=/tmp/s6a; mkdir -p $R
nvidia-smi -L | tee $R/gpus.txt
t0=$(date +%s)
for t in gpu_gemm gpu_moe; do
    timeout 240 .dev/gpu/$t --ignored --nocapture --test-threads 1 > $R/$t.txt 2>&1
    echo "$t rc=$? at $(( $(date +%s) - t0 )) s" | tee -a $R/log.txt
    grep -E "^test |test result|panicked" $R/$t.txt | head -20
    tar czf $OUT/s6a.tgz -C $R .
done
B=".dev/gpu/nvfp4dbg bench --device cuda --no-report-dir -q --quick --only floors,gemm_prefill,layer"
for i in 1 2; do
    timeout 90 $B --json $R/ws-$i.json > $R/ws-$i.txt 2>&1
    echo "ws $i rc=$? at $(( $(date +%s) - t0 )) s" | tee -a $R/log.txt
    NVFP4DBG_SM90=v1 timeout 90 $B --json $R/v1-$i.json > $R/v1-$i.txt 2>&1
    echo "v1 $i rc=$? at $(( $(date +%s) - t0 )) s" | tee -a $R/log.txt
    tar czf $OUT/s6a.tgz -C $R .
done
NVFP4DBG_SM90_GRID=tiles timeout 90 $B --json $R/wstiles.json > $R/wstiles.txt 2>&1
echo "ws one CTA per tile rc=$? at $(( $(date +%s) - t0 )) s" | tee -a $R/log.txt
NVFP4DBG_NVRTC_DEFINES="-DWS_STAGES_DOWN=3 -DWS_STAGES_GATE_UP=2" timeout 90 $B --json $R/ws-fewer.json > $R/ws-fewer.txt 2>&1
echo "ws fewer stages rc=$? at $(( $(date +%s) - t0 )) s" | tee -a $R/log.txt
NVFP4DBG_NVRTC_DEFINES="-DDEC_DOWN_MIN_BLOCKS=4" timeout 90 .dev/gpu/nvfp4dbg bench --device cuda --no-report-dir -q --only floors,gemm_decode,layer_16 --json $R/dec4.json > $R/dec4.txt 2>&1
echo "decode down 4 CTAs rc=$? at $(( $(date +%s) - t0 )) s" | tee -a $R/log.txt
timeout 90 .dev/gpu/nvfp4dbg bench --device cuda --no-report-dir -q --only floors,gemm_decode,layer_16 --json $R/dec3.json > $R/dec3.txt 2>&1
echo "decode down 3 CTAs rc=$? at $(( $(date +%s) - t0 )) s" | tee -a $R/log.txt
for f in $R/ws-1.txt $R/v1-1.txt $R/ws-2.txt $R/v1-2.txt $R/wstiles.txt $R/ws-fewer.txt $R/dec4.txt $R/dec3.txt; do
    echo "== $f"; grep -E "│ [a-z_0-9]+ +│" $f | awk -F'│' '{print $2,$3,$5,$9}'
    grep -iE "error|panicked" $f | head -5
done
tar czf $OUT/s6a.tgz -C $R .
if [ -f bench/gpu-sweep-quant.sh ]; then
    SWEEP_BUDGET_S=$(( 560 - ($(date +%s) - t0) )) timeout $(( 575 - ($(date +%s) - t0) )) bash bench/gpu-sweep-quant.sh > $R/quant-sweep.txt 2>&1
    echo "quant sweep rc=$? at $(( $(date +%s) - t0 )) s" | tee -a $R/log.txt
    tail -25 $R/quant-sweep.txt
fi
tar czf $OUT/s6a.tgz -C $R .
echo "total $(( $(date +%s) - t0 )) s"
