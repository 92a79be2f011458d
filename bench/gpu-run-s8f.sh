#!/usr/bin/env bash
# session 8, sixth device call (on the build of commit 470f522, since reverted: the ring lost, BENCHMARKS.md): the register-A prefill with its weights through per-warp
# shared-memory rings of bulk copies (RS_WRING, default 4) against the global loads one chunk
# ahead (-DRS_WRING=0, sessions 7's kernel) and rings of 3 and 5: GPU tests (gpu_gemm for the
# default and 0, gpu_moe, gpu_graph), then prefill and layer figures alternating.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 NO_COLOR=1 PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NVFP4DBG_CUDA_INCLUDE=/usr/local/cuda/include:/usr/local/cuda/include/cccl
R=/tmp/s8f; mkdir -p $R
t0=$(date +%s)
pack() { tar czf $OUT/s8f.tgz -C $R .; }
run_test() {  # binary, name, defines
    NVFP4DBG_NVRTC_DEFINES="$3" timeout 120 .dev/gpu/$1 --ignored --nocapture --test-threads 1 > $R/$1-$2.txt 2>&1
    echo "$1 [$2] rc=$? at $(( $(date +%s) - t0 )) s: $(grep -E '^test result' $R/$1-$2.txt | tail -1)" | tee -a $R/log.txt
    grep -E "panicked" -A3 $R/$1-$2.txt | head -8
}
run_test gpu_gemm ring4 ""
run_test gpu_moe ring4 ""
run_test gpu_graph ring4 ""
run_test gpu_gemm ring0 "-DRS_WRING=0"
pack
B=".dev/gpu/nvfp4dbg bench --device cuda --no-report-dir -q --quick --only floors,gemm_prefill,layer_4096"
for i in 1 2; do
    for v in "ring4|" "ring0|-DRS_WRING=0" "ring5|-DRS_WRING=5" "ring3|-DRS_WRING=3"; do
        n=${v%%|*}
        NVFP4DBG_NVRTC_DEFINES="${v#*|}" timeout 60 $B --json $R/$n-$i.json > $R/$n-$i.txt 2>&1
    done
    echo "bench round $i at $(( $(date +%s) - t0 )) s" | tee -a $R/log.txt
    pack
done
python3 - $R <<'PY'
import json, glob, os, sys, statistics
R = sys.argv[1]
rows = {}
for f in sorted(glob.glob(os.path.join(R, "ring*-*.json"))):
    v = os.path.basename(f).split("-")[0]
    try:
        res = json.load(open(f))["results"]
    except Exception as e:
        print(f, "unreadable", e); continue
    for r in res:
        if r.get("median_ms") is not None and ("prefill" in r["name"] or "layer" in r["name"]):
            rows.setdefault((r["name"], v), []).append((r["median_ms"], r.get("ratio")))
names = sorted({k[0] for k in rows})
for n in names:
    print(n, "  ".join(f"{v}: {statistics.median(m for m, _ in rows[(n, v)]):.3f} ms"
                       + (f" ({statistics.median(x for _, x in rows[(n, v)] if x is not None):.3f})" if any(x for _, x in rows[(n, v)]) else "")
                       for v in ("ring4", "ring0", "ring5", "ring3") if (n, v) in rows))
PY
pack
echo "total $(( $(date +%s) - t0 )) s"
