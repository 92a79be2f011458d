#!/usr/bin/env bash
# final device call 2 (warm): the PyTorch peers, multilayer at DeepSeek-V3 dims, EP 1 vs 2 at 4096 tokens
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 NO_COLOR=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NVFP4DBG_CUDA_INCLUDE=/usr/local/cuda/include:/usr/local/cuda/include/cccl
B=.dev/gpu/nvfp4dbg; t0=$(date +%s)
timeout 110 python3 bench/peers.py --quick --json $OUT/peers.json > $OUT/peers.txt 2>&1; echo "peers rc=$? $(( $(date +%s) - t0 )) s" | tee -a $OUT/peers.txt
tail -25 $OUT/peers.txt
S=/tmp/dsv3
{ /usr/bin/time -f "synth %e s %M KB" $B synth --out $S --preset dsv3 --layers 5 --no-originals -q
  echo "--- multilayer"; /usr/bin/time -f "multilayer %e s %M KB" $B multilayer --checkpoint $S --tokens 1024 --device cuda -q --no-report-dir; echo "rc=$?"
  for ep in 1 2; do echo "--- layertest ep $ep"; /usr/bin/time -f "layertest ep$ep %e s %M KB" $B layertest --checkpoint $S --layer 4 --tokens 4096 --device cuda --ep $ep -q --no-report-dir; echo "rc=$?"; done
} > $OUT/realdims.txt 2>&1
cat $OUT/realdims.txt | tail -60
echo "total $(( $(date +%s) - t0 )) s"
