#!/usr/bin/env bash
# Session 27, third lease: gpu_moe again (s27b's run failed on the test's own schedule check,
# fixed), then ncu's time of every kernel of one 4096-token layer forward (the bench's layer,
# caches flushed, each launch alone).
set -uo pipefail
L=${LABEL:-s27c}
source bench/gpu-lib.sh
run_tests gpu_moe
ncu="$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)"
timeout 200 "$ncu" --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \
    -k regex:'router|moe_|nvfp4_|swiglu|gather|fill|broadcast|dynamic|gemm|xmma|cutlass|sm90|Kernel' -c 400 \
    .dev/gpu/nvfp4dbg bench --device cuda --quick --only layer_4096 --no-report-dir -q \
    > $R/ncu-layer.txt 2>&1
stamp "ncu layer rc=$?"
python3 - $R/ncu-layer.txt <<'PY'
import re, sys
rows, cur = [], None
for line in open(sys.argv[1]):
    m = re.match(r"^  (\S+) \(", line)
    if m:
        cur = [m.group(1), None, None, None]
        rows.append(cur)
        continue
    m = re.search(r"(gpu__time_duration.sum|dram__bytes_read.sum|dram__bytes_write.sum)\s+(\S+)\s+([\d.,]+)", line)
    if m and cur:
        v = float(m.group(3).replace(",", ""))
        unit = m.group(2)
        i = {"gpu__time_duration.sum": 1, "dram__bytes_read.sum": 2, "dram__bytes_write.sum": 3}[m.group(1)]
        if i == 1 and unit == "ms": v *= 1000
        if i > 1 and unit == "Gbyte": v *= 1000
        if i > 1 and unit == "Kbyte": v /= 1000
        cur[i] = v
print(len(rows), "launches")
for r in rows[-60:]:
    print(f"{r[0][:60]:60s} {r[1] or 0:9.2f} us  rd {r[2] or 0:9.2f} MB  wr {r[3] or 0:9.2f} MB")
PY
stamp done
pack
