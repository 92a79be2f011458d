# Shared by the session-10 device scripts (source it from the repository root on the device):
# the environment, the result folder /tmp/$L packed into $OUT/$L.tgz, the GPU tests and the
# environment-variable A/B rounds of `nvfp4dbg bench`.
export NCCL_NVLS_ENABLE=0 NO_COLOR=1 PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NVFP4DBG_CUDA_INCLUDE=/usr/local/cuda/include:/usr/local/cuda/include/cccl
export NVFP4DBG_CACHE_DIR=/tmp/nvfp4dbg-cubin
R=/tmp/$L; mkdir -p $R
t0=$(date +%s)
pack() { tar czf $OUT/$L.tgz -C $R .; }
stamp() { echo "$1 at $(( $(date +%s) - t0 )) s" | tee -a $R/log.txt; }

# run_tests TEST...: each GPU test binary of .dev/gpu, its result line and any failure
run_tests() {
    for t in "$@"; do
        timeout 150 .dev/gpu/$t --ignored --nocapture --test-threads 1 > $R/$t.txt 2>&1
        stamp "$t rc=$?: $(grep -E '^test result' $R/$t.txt | tail -1)"
        grep -E "panicked" -A3 $R/$t.txt | head -10
        pack
    done
}

# variant_tests NAME VAR=v TEST...: the GPU tests under a variant's environment (a kernel knob
# through NVFP4DBG_NVRTC_DEFINES; a `~` in the value is a space, as in ab_rounds), into
# $R/NAME-TEST.txt; true when every one passed.
variant_tests() {
    local name=$1 env=$2 t ok=0; shift 2
    for t in "$@"; do
        env "${env//\~/ }" timeout 150 .dev/gpu/$t --ignored --nocapture --test-threads 1 > $R/$name-$t.txt 2>&1
        stamp "$name $t rc=$?: $(grep -E '^test result' $R/$name-$t.txt | tail -1)"
        grep -E "panicked" -A3 $R/$name-$t.txt | head -10
        grep -q "test result: ok" $R/$name-$t.txt || ok=1
        pack
    done
    return $ok
}

# same_outputs NAME VAR=v (`~` a space): `layertest --device cuda` (512 tokens: the prefill kernels) under the
# variant's environment and without it, calibrated and dynamic gs, its saved outputs compared
# byte for byte (for a knob that must not change a bit).
same_outputs() {
    local name=$1 env=$2 gs v e
    for gs in calibrated dynamic; do
        for v in default $name; do
            e=$([ $v = $name ] && echo "$env" || echo "NVFP4DBG_NVRTC_DEFINES=")
            env "${e//\~/ }" timeout 120 .dev/gpu/nvfp4dbg layertest --device cuda --tokens 512 --gs $gs \
                --save-outputs $R/lt-$v-$gs.safetensors > $R/lt-$v-$gs.txt 2>&1
            stamp "layertest $v $gs rc=$?"
        done
        cmp $R/lt-default-$gs.safetensors $R/lt-$name-$gs.safetensors &&
            stamp "layertest $gs: $name and default outputs bit for bit the same"
    done
    pack
}

# ab_rounds ROUNDS ONLY "name|VAR=v,VAR=v ...": `nvfp4dbg bench --quick --only ONLY` under
# each variant's environment, the variants alternating within each round, then the medians
# (bench/ab_summary.py). A `~` in a value is a space (two defines: -DA=1~-DB=2); BIN=file runs
# .dev/gpu/file instead of .dev/gpu/nvfp4dbg (another build, e.g. the commit before).
ab_rounds() {
    local rounds=$1 only=$2 variants=$3 i v n kv bin x
    for i in $(seq $rounds); do
        for v in $variants; do
            n=${v%%|*}
            IFS=, read -ra kv <<< "${v#*|}"
            bin=nvfp4dbg
            for x in "${kv[@]}"; do [[ $x == BIN=* ]] && bin=${x#BIN=}; done
            env "${kv[@]//\~/ }" timeout 120 .dev/gpu/$bin bench --device cuda --no-report-dir -q \
                --quick --only $only --json $R/$n-$i.json > $R/$n-$i.txt 2>&1
            echo "$n-$i rc=$?" >> $R/log.txt
        done
        stamp "bench round $i"
        pack
    done
    python3 bench/ab_summary.py $R $(for v in $variants; do echo "${v%%|*}"; done)
}

# reduce_rounds N: N runs of `bench --quick --only copy_d2d,reduce` (the copy and the GPU
# reductions) into $R/bench-reduce-I.txt and $R/reduce-I.json, their figures' lines
reduce_rounds() {
    local i
    for i in $(seq $1); do
        timeout 60 .dev/gpu/nvfp4dbg bench --device cuda --quick --only copy_d2d,reduce \
            --no-report-dir -q --json $R/reduce-$i.json > $R/bench-reduce-$i.txt 2>&1
        stamp "bench reductions $i rc=$?"
    done
    grep -hE "│ (copy_d2d|reduce_[a-z_]+) +│" $R/bench-reduce-*.txt | awk -F'│' '{print $2,$3,$5,$9}'
    pack
}

# bench_and_peers: the whole `nvfp4dbg bench --device cuda` ($R/bench.json, .txt) and then
# bench/peers.py --quick ($R/peers.json, .txt) in the same lease, their figures' lines
bench_and_peers() {
    timeout 120 .dev/gpu/nvfp4dbg bench --device cuda --no-report-dir -q --json $R/bench.json > $R/bench.txt 2>&1
    stamp "bench rc=$?"
    grep -E "│ [a-z_0-9]+ +│" $R/bench.txt | awk -F'│' '{print $2,$3,$5,$9}'
    pack
    timeout 70 python3 bench/peers.py --quick --json $R/peers.json > $R/peers.txt 2>&1
    stamp "peers rc=$?"
    grep -E "^(floor|moe|quantize|scan) " $R/peers.txt
    pack
}

# run_nightly: .ci/gpu-nightly on .dev/gpu (under $NIGHTLY_S seconds, default 300), its
# summary lines and any failure
run_nightly() {
    NVFP4DBG_REPORTS=$R/nightly timeout ${NIGHTLY_S:-300} bash .ci/gpu-nightly .dev/gpu > $R/nightly.txt 2>&1
    stamp "nightly rc=$?"
    grep -E "GPU tests:|cases:|not run" $R/nightly.txt | tail -3
    grep -E "^(FAIL|fail)|FAILED|panicked" $R/nightly.txt | head -10
    pack
}

# ncu_full NAME KERNEL_REGEX FIGURE: ncu --set full on the first launch of the kernel in
# `bench --quick --only FIGURE`; its details page in $R/ncu-NAME-details.txt and its
# per-instruction SASS page (stall samples, execution counts) in $R/ncu-NAME-sass.csv
ncu_full() {
    local n=$1 k=$2 fig=$3
    local ncu="${NCU:-$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)}"
    timeout 150 "$ncu" --clock-control none --set full -k regex:$k -s 1 -c 1 -f -o $R/ncu-$n \
        .dev/gpu/nvfp4dbg bench --device cuda --quick --only $fig --no-report-dir -q > $R/ncu-$n-run.txt 2>&1
    stamp "ncu $n rc=$?"
    "$ncu" --import $R/ncu-$n.ncu-rep --page details > $R/ncu-$n-details.txt 2>&1
    "$ncu" --import $R/ncu-$n.ncu-rep --page source --csv --print-source sass > $R/ncu-$n-sass.csv 2>&1
    rm -f $R/ncu-$n.ncu-rep
    grep -E "Duration|Throughput|Registers|Achieved Occupancy|No Eligible|Issue Slots Busy|Executed Ipc" \
        $R/ncu-$n-details.txt | head -20
    pack
}

# ncu_layer SECONDS [NCU ARGS...]: ncu's duration of each kernel (clocks left alone) over one
# `bench --quick --only layer_4096` run, as CSV in $R/ncu.csv; $NCU overrides the toolkit's ncu.
ncu_layer() {
    local secs=$1; shift
    timeout $secs ${NCU:-/usr/local/cuda/bin/ncu} --clock-control none --metrics gpu__time_duration.sum "$@" --csv \
        .dev/gpu/nvfp4dbg bench --device cuda --no-report-dir -q --quick --only layer_4096 > $R/ncu.csv 2> $R/ncu.err
    stamp "ncu rc=$?"
}

# ncu_kernels: $R/ncu.csv as one line a launch (index, kernel, grid, block, duration)
ncu_kernels() {
    python3 - $R/ncu.csv <<'PY'
import csv, sys
lines = [l for l in open(sys.argv[1]) if l.startswith('"')]
rows = list(csv.DictReader(lines))
print(len(rows), "kernels")
for i, r in enumerate(rows):
    print(i, r["Kernel Name"][:90], r["Grid Size"], r["Block Size"], r["Metric Value"], r["Metric Unit"])
PY
}

# sanitize TOOL...: compute-sanitizer (each TOOL under $SAN_S seconds, default 150) on
# gpu_gemm's ragged-experts test, which runs the register-A kernels at tile widths 32 to 160.
sanitize() {
    local tool
    for tool in "$@"; do
        timeout ${SAN_S:-150} compute-sanitizer --tool $tool --print-limit 20 .dev/gpu/gpu_gemm --ignored --nocapture \
            --test-threads 1 wgmma_prefill_gemm_matches_mma_sync_and_the_cpu_on_ragged_experts > $R/$tool.txt 2>&1
        stamp "compute-sanitizer $tool rc=$?: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|^test result' $R/$tool.txt | tr '\n' ' ')"
        pack
    done
}

# quant_rounds VARIANT...: per round of ab_rounds, the reference quantizer's median, the longer
# run's (4x the rows) and its marginal rate over copy_d2d (bench details), one line a variant
quant_rounds() {
    python3 - $R "$@" <<'PY'
import glob, json, sys
R = sys.argv[1]
for v in sys.argv[2:]:
    rows = []
    for p in sorted(glob.glob(f"{R}/{v}-*.json")):
        f = {x["name"]: x for x in json.load(open(p))["results"]}["quantize_bf16_reference"]
        d = f.get("details", {})
        rows.append("%.4f/%.4f/%.3f" % (f["median_ms"] or 0, d.get("longer_ms", 0), d.get("marginal_over_copy", 0)))
    print(v, "ms/longer ms/marginal:", " ".join(rows))
PY
}
