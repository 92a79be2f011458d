#!/usr/bin/env bash
# session 8, second device call: the GPU tests (gpu_quant, gpu_moe), then the
# quantizer sweep (bench/gpu-sweep-quant.sh: the bulk kernel's tile and ring sizes against the
# grid kernel), on the build of `bash .ci/gpu-nightly --package .dev/gpu`.
set -uo pipefail
export NO_COLOR=1 PYTHONUNBUFFERED=1
R=/tmp/s8b; mkdir -p $R
pack() { tar czf $OUT/s8b.tgz -C $R .; }
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NVFP4DBG_CUDA_INCLUDE=/usr/local/cuda/include:/usr/local/cuda/include/cccl
nvidia-smi -L | tee $R/gpus.txt
t0=$(date +%s)
for t in gpu_quant gpu_moe; do
    timeout 150 .dev/gpu/$t --ignored --test-threads=1 --nocapture > $R/test-$t.txt 2>&1
    echo "$t rc=$? at $(( $(date +%s) - t0 )) s: $(grep -E '^test result' $R/test-$t.txt | tail -1)" | tee -a $R/log.txt
    grep -E "^test .*(FAILED|ok)$|panicked|bulk quantizer" $R/test-$t.txt | head -20
done
pack
OUT=$R/quant SWEEP_BUDGET_S=${SWEEP_BUDGET_S:-200} timeout 320 bash bench/gpu-sweep-quant.sh > $R/quant-sweep.txt 2>&1
echo "quant sweep rc=$? at $(( $(date +%s) - t0 )) s" | tee -a $R/log.txt
cat $R/quant/summary.txt 2>/dev/null | tail -30
grep -E "test-" $R/quant-sweep.txt | head -20
pack
# the copy floor at the quantizer's size: torch copies of 150 MB (the quantizer's bytes moved:
# 117 MB read + 33 MB written) and of 2 GiB (the bench's floor), medians of 200 event-timed
# repeats over rotating buffers (4 x 150 MB > the 50 MB L2)
timeout 60 python3 - > $R/copy-sizes.txt 2>&1 <<'PY'
import torch
def med(nbytes, sets):
    src = [torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_() for _ in range(sets)]
    dst = [torch.empty_like(s) for s in src]
    for i in range(20): dst[i % sets].copy_(src[i % sets])
    ts = []
    for i in range(200):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); dst[i % sets].copy_(src[i % sets]); b.record(); b.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort(); m = ts[len(ts) // 2]
    return m, 2 * nbytes / m / 1e6
for nb, sets in ((75_000_000, 4), (150_000_000, 4), (1 << 31, 2)):
    m, gbs = med(nb, sets)
    print(f"copy of {nb / 1e6:.0f} MB (read + write {2 * nb / 1e6:.0f} MB): median {m * 1e3:.1f} us, {gbs:.0f} GB/s")
PY
cat $R/copy-sizes.txt
pack
echo "total $(( $(date +%s) - t0 )) s"
