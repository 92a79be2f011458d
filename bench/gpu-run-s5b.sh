#!/usr/bin/env bash
# session 5, final device call 2 (same lease as s5a): the whole `nvfp4dbg bench`, the decode
# GEMMs' same-binary baselines (row-major weights; no early launch of the down GEMM), then the
# PyTorch peers, back to back.
set -uo pipefail
export NO_COLOR=1 PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NVFP4DBG_CUDA_INCLUDE=/usr/local/cuda/include:/usr/local/cuda/include/cccl
R=/tmp/s5b; mkdir -p $R; B=".dev/gpu/nvfp4dbg bench --device cuda --no-report-dir -q"
t0=$(date +%s)
timeout 170 $B --json $R/bench.json > $R/bench.txt 2>&1
echo "bench rc=$? at $(( $(date +%s) - t0 )) s" | tee -a $R/log.txt
NVFP4DBG_MOE_DECODE=rows timeout 40 $B --only floors,gemm_decode,layer_16 --json $R/bench_rows.json > $R/bench_rows.txt 2>&1
echo "bench rows rc=$? at $(( $(date +%s) - t0 )) s" | tee -a $R/log.txt
NVFP4DBG_PDL=0 timeout 40 $B --only floors,gemm_decode,layer_16 --json $R/bench_nopdl.json > $R/bench_nopdl.txt 2>&1
echo "bench nopdl rc=$? at $(( $(date +%s) - t0 )) s" | tee -a $R/log.txt
timeout 150 python3 bench/peers.py --quick --json $R/peers.json > $R/peers.txt 2>&1
echo "peers rc=$? at $(( $(date +%s) - t0 )) s" | tee -a $R/log.txt
grep -E "│ [a-z_0-9]+ +│" $R/bench.txt | awk -F'│' '{print $2,$3,$5,$9}'
for f in rows nopdl; do echo "== $f"; grep -E "gemm_decode|layer_16" $R/bench_$f.txt | awk -F'│' '{print $2,$3,$9}'; done
tail -30 $R/peers.txt
tar czf $OUT/s5b.tgz -C $R .
echo "total $(( $(date +%s) - t0 )) s"
