#!/usr/bin/env bash
# The NVFP4 quantizer's compile-time variants (kernels/quant.cu, "Tuning knobs") in one GPU
# session, on the build packaged by `bash .ci/gpu-nightly --package .dev/gpu`:
#
#   bash bench/gpu-sweep-quant.sh              # the VARIANTS below, from the repository root
#   bash bench/gpu-sweep-quant.sh qb2 noalloc  # only these (names from VARIANTS or EXTRA)
#
# 1. numerics: each variant's GPU quantize tests (bit-exact against the CPU reference: codes,
#    scales, statistics; f32 and BF16, linear and swizzled, ragged shapes) and the NVFP4 MoE
#    layer test (the f32 kernel with row gather and per-row global scales), all variants at
#    once (separate processes: NVFP4DBG_NVRTC_DEFINES is read when the module is compiled);
# 2. `nvfp4dbg bench --quick --only floors,quantize` per variant, the default between any two
#    (A B A C A ...), every variant once, then a second round while time is left;
# 3. ncu on the default kernel (if ncu is installed), between the two rounds;
# 4. a table (median over runs of each figure's median, ratio to that run's copy bandwidth).
#
# Everything is written under a temporary folder and packed into $OUT/quant-sweep.tgz (with
# summary.txt also left in $OUT). Aims to end within SWEEP_BUDGET_S (default 145) seconds.
set -uo pipefail
cd "$(dirname "$0")/.."
export NO_COLOR=1 PYTHONUNBUFFERED=1
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
    [ -d "$d" ] && export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
done
export NVFP4DBG_CUDA_INCLUDE="${NVFP4DBG_CUDA_INCLUDE:-/usr/local/cuda/include:/usr/local/cuda/include/cccl}"

# Session 6 also swept shared-memory staging, grid-stride pipelining and cache hints for the
# grid kernel, session 7 its pipelined and coalesced mappings (QUANT_PIPE, QUANT_COALESCED):
# all bit-exact, only ring4qb2 faster (BENCHMARKS.md).
# name|defines[|environment]. Session 8: the persistent bulk-copy kernel (nvfp4_quantize_bf16_bulk,
# the default for linear scales on sm_90+: 4 blocks per lane per tile, 2 tiles in flight per
# warp, 123 registers, 2 CTAs/SM) against the grid kernel (NVFP4DBG_QUANT=grid, the default until
# then) and its best variant, and the bulk kernel's tile and ring sizes. Shared memory per CTA:
# 8 warps x BULK_STAGES x BULK_QB KiB.
VARIANTS=(
    # session 10: the default is the grid kernel with each warp's run of groups loaded 512
    # contiguous bytes a load and handed out through shared memory (QUANT_TRANSPOSE 1), capped
    # at 4 CTAs/SM (QUANT_MIN_BLOCKS 4: 64 regs, 24-byte spill). s10d/s10e: 0.0422 ms; a flat
    # kernel of the same idea without the per-thread path (64 regs unforced) 0.0439, dropped.
    # session 11: the tensor read as one row (QUANT_FLAT 1, no per-thread division) and the
    # transposition's slots at one base plus constants: 64 registers without a spill. s11b
    # (default 0.0435 ms over 17 runs): s10 0.0435, noflat 0.0438, oldslots 0.0432, t128 0.0426,
    # t512 0.0476, async 0.0477, bulk 0.0438, notr 0.0475
    # s11c (default 0.0435 over 11 runs): s10 0.0434, t128 0.0425, t128old 0.0426, t64 0.0424,
    # t32 0.0426. Since then the default is 128-thread CTAs (t128) and session 10's slots are
    # gone. s12a (default 0.0426 over 9 runs): qb2 0.0463, qb2m10 0.0463, t64 0.0427.
    "t256|-DQUANT_BF16_THREADS=256 -DQUANT_MIN_BLOCKS=4"  # s11b/s11c's default: 0.0435 / 0.0435 ms
    "t64|-DQUANT_BF16_THREADS=64 -DQUANT_MIN_BLOCKS=16"   # CTAs of 2 warps: s11c 0.0424
    # (s11b/s12a, QUANT_ASYNC, since removed: a persistent grid whose warps copy their next run
    # by cp.async, 80 regs, 6 CTAs/SM: 0.0477 ms (default 0.0435); the runs handed out by a
    # counter: 0.0626 (default 0.0426))
    # (s10k, QUANT_L2_AHEAD N, since removed: each lane also prefetching into L2 the line its
    # twin N CTAs on would load: N = 264 / 528 / 1056 gave 0.0440 / 0.0438 / 0.0533 ms against
    # the default's 0.0421)
    # (s10h, QUANT_TRANSPOSE 2, since removed: the run staged by cp.async, 0.0429 ms at 4 CTAs/SM,
    # 0.0538 / 0.0622 at 5 / 6 (spills); its cuda-fast block statistics disagreed with bulk's)
)
# Session 8's variants of the bulk kernel and the grid kernel's best: EXTRA below.
# s8c (tiles sized to fill the last round, but 125 blocks: not 128-byte aligned): the default
# (4 blocks per lane, 2 stages) 0.0449 ms, 3 stages 0.0461, 2 blocks 4 stages 0.0479, 8 blocks
# 0.0473.
# Session 8's sweeps before the tiles were dealt in turn (s8a, s8b; one contiguous range of
# tiles per warp, 2 blocks per lane and 4 stages: 0.0484 ms): 3 stages 0.0483, 6 stages 0.0492,
# 1 block per lane with 8 / 4 stages 0.0512 / 0.0516, 4 with 2 stages 0.0461-0.0467 (3 stages
# 0.0474), 8 blocks 0.0498, 3 blocks 0.0472, 4 blocks capped to 3 CTAs/SM (80 registers,
# spills; that knob, BULK_MIN_CTAS, since removed) 0.0486; dealt in turn, not yet balanced: 2 blocks 0.0446, 4 blocks 0.0437.
# By name only: the bulk kernel's losers above, and session 7's variants of the grid kernel
# (measured then: BENCHMARKS.md).
EXTRA=(
    "qb2|-DQUANT_BLOCKS=2 -DQUANT_MIN_BLOCKS=0"           # 2 blocks a lane, 58 regs, 32 warps/SM: s12a 0.0463 (default 0.0426)
    "qb2m10|-DQUANT_BLOCKS=2 -DQUANT_MIN_BLOCKS=10"       # 48 regs, 40 warps/SM: s12a 0.0463
    "noflat|-DQUANT_FLAT=0 -DQUANT_BF16_THREADS=256 -DQUANT_MIN_BLOCKS=4"  # row by row, the new slots: s11a 0.0439 (default 0.0437), s11b 0.0438 (0.0435)
    # (s11b/s11c, since removed: session 10's XOR-swizzled slots, QUANT_TR_SLOTS 0: with session
    # 10's row-by-row view 0.0435 / 0.0434 ms, in one row 0.0432, in 128-thread CTAs 0.0426)
    "t32|-DQUANT_BF16_THREADS=32 -DQUANT_MIN_BLOCKS=32"   # CTAs of 1 warp: s11c 0.0426
    "t512|-DQUANT_BF16_THREADS=512 -DQUANT_MIN_BLOCKS=2"  # s11b 0.0476
    "bulk||NVFP4DBG_QUANT=bulk"                     # session 8's default: s10d 0.0441, s11b 0.0438 ms
    "notr|-DQUANT_TRANSPOSE=0 -DQUANT_MIN_BLOCKS=0|NVFP4DBG_QUANT=grid"  # session 9's grid kernel: s10d 0.0463, s11b 0.0475
    "tr3|-DQUANT_MIN_BLOCKS=0"                      # s10d: 72 regs, 3 CTAs/SM, 0.0437 ms; since session 11 the same 64 regs as the default
    "gridring4qb2|-DQUANT_PIPE=4 -DQUANT_PIPE_RING=1 -DQUANT_BLOCKS=2 -DQUANT_MIN_BLOCKS=0|NVFP4DBG_QUANT=grid"
    "ilp2|-DBULK_ILP=2|NVFP4DBG_QUANT=bulk"
    "ilp1|-DBULK_ILP=1|NVFP4DBG_QUANT=bulk"
    "qb2st3|-DBULK_QB=2 -DBULK_STAGES=3|NVFP4DBG_QUANT=bulk"
    "qb3|-DBULK_QB=3 -DBULK_STAGES=3|NVFP4DBG_QUANT=bulk"
    "qb8ilp2|-DBULK_QB=8 -DBULK_ILP=2|NVFP4DBG_QUANT=bulk"
    "nobal|-DBULK_BALANCE=0|NVFP4DBG_QUANT=bulk"                  # 128-block tiles, the last round part-full (s8b: 0.0437 ms, s8d's balanced default 0.0444)
    "qb1|-DBULK_QB=1 -DBULK_STAGES=8|NVFP4DBG_QUANT=bulk"
    "pipe2|-DQUANT_PIPE=2 -DQUANT_MIN_BLOCKS=0|NVFP4DBG_QUANT=grid"
    "ring4|-DQUANT_PIPE=4 -DQUANT_PIPE_RING=1 -DQUANT_MIN_BLOCKS=0|NVFP4DBG_QUANT=grid"
    "coal|-DQUANT_COALESCED=1 -DQUANT_MIN_BLOCKS=0|NVFP4DBG_QUANT=grid"
    "coalqb2|-DQUANT_COALESCED=1 -DQUANT_BLOCKS=2 -DQUANT_MIN_BLOCKS=0|NVFP4DBG_QUANT=grid"
    "gridqb2|-DQUANT_BLOCKS=2 -DQUANT_MIN_BLOCKS=0|NVFP4DBG_QUANT=grid"
    "gridqb8|-DQUANT_BLOCKS=8 -DQUANT_MIN_BLOCKS=0 -DQUANT_TRANSPOSE=0|NVFP4DBG_QUANT=grid"
    "old|-DQUANT_ENCODER=0 -DQUANT_MIN_BLOCKS=0"
    "stats0|-DQUANT_STATS=0"
)
if [ $# -gt 0 ]; then
    picked=()
    for want in "$@"; do
        hit=""
        for v in "${VARIANTS[@]}" "${EXTRA[@]}"; do [ "${v%%|*}" = "$want" ] && hit="$v"; done
        [ -n "$hit" ] || { echo "gpu-sweep-quant: no variant '$want'" >&2; exit 2; }
        picked+=("$hit")
    done
    VARIANTS=("${picked[@]}")
fi

BUDGET=${SWEEP_BUDGET_S:-145}
D=.dev/gpu
OUT="${OUT:-reports/quant-sweep}"
mkdir -p "$OUT"
R="$(mktemp -d /tmp/quant-sweep.XXXXXX)"
SECONDS=0
log() { echo "[${SECONDS}s] $*" | tee -a "$R/log.txt"; }
finish() {
    log "packing $R into $OUT/quant-sweep.tgz"
    tar czf "$OUT/quant-sweep.tgz" -C "$R" .
    [ -f "$R/summary.txt" ] && cp "$R/summary.txt" "$OUT/summary.txt"
    echo "total ${SECONDS}s"
}

[ -x "$D/nvfp4dbg" ] || { echo "gpu-sweep-quant: $D/nvfp4dbg missing (bash .ci/gpu-nightly --package $D)" >&2; exit 2; }
nvidia-smi -L > "$R/gpus.txt" 2>&1 || { echo "gpu-sweep-quant: no GPU" >&2; cat "$R/gpus.txt" >&2; exit 2; }
cat "$R/gpus.txt"
git log -1 --format='%H %s' > "$R/commit.txt" 2>/dev/null
printf '%s\n' "default|" "${VARIANTS[@]}" > "$R/variants.txt"
defs_of() { local v="${1#*|}"; echo "${v%%|*}"; }
env_of() { local v="${1#*|}"; [ "$v" = "${v#*|}" ] && return; echo "${v#*|}"; }

# ---- 1. numerics, every variant at once (each test process compiles its own module)
QT="$(ls $D/gpu_quant $D/gpu_quant-* 2>/dev/null | head -1)"
MT="$(ls $D/gpu_moe $D/gpu_moe-* 2>/dev/null | head -1)"
pids=()
for v in "${VARIANTS[@]}"; do
    name="${v%%|*}" defs="$(defs_of "$v")" envs="$(env_of "$v")"
    if [ -n "$QT" ]; then
        env $envs NVFP4DBG_NVRTC_DEFINES="$defs" timeout 60 "$QT" --ignored nvfp4 --test-threads=1 \
            > "$R/test-quant-$name.txt" 2>&1 &
        pids+=($!)
    fi
    if [ -n "$MT" ]; then
        env $envs NVFP4DBG_NVRTC_DEFINES="$defs" timeout 60 "$MT" --ignored nvfp4_layer_matches_the_cpu_nvfp4_path \
            --test-threads=1 > "$R/test-moe-$name.txt" 2>&1 &
        pids+=($!)
    fi
done
for p in "${pids[@]}"; do wait "$p"; done
log "tests done ($([ -n "$QT" ] && basename "$QT") $([ -n "$MT" ] && basename "$MT"))"
for f in "$R"/test-*.txt; do
    [ -f "$f" ] || continue
    res="$(grep -E '^test result' "$f" | tail -1)"
    printf '  %-20s %s\n' "$(basename "$f" .txt)" "${res:-NO RESULT (timeout or crash): see the log}" | tee -a "$R/log.txt"
done

# ---- 2. the bench, alternating with the default
declare -A runs
bench() {  # name defines [environment]
    local name=$1 defs=$2 envs=${3:-} i=${runs[$1]:-0}
    runs[$1]=$((i + 1))
    local t=$SECONDS
    env $envs NVFP4DBG_NVRTC_DEFINES="$defs" timeout 40 "$D/nvfp4dbg" bench --device cuda --quick \
        --only floors,quantize --no-report-dir -q --json "$R/quant-$name-$i.json" \
        > "$R/bench-$name-$i.txt" 2>&1
    log "bench $name #$i rc=$? ($((SECONDS - t)) s)"
    bench_n=$((bench_n + 1)) bench_s=$((bench_s + SECONDS - t))
}
round() {  # round number; returns 1 when out of time
    local v name
    for v in "${VARIANTS[@]}"; do
        name="${v%%|*}"
        # a variant and the default after it: ~2 bench runs
        if [ $((SECONDS + 2 * per_run + RESERVE + HOLD)) -gt "$BUDGET" ]; then
            log "round $1: out of time before $name"
            return 1
        fi
        bench "$name" "$(defs_of "$v")" "$(env_of "$v")"
        bench default ""
    done
}
RESERVE=5  # summary and tar
NCU="$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)"
HOLD=0; [ -n "$NCU" ] && HOLD=30  # round 1 leaves this much for ncu
bench_n=0 bench_s=0
bench default ""
per_run=$((bench_s < 4 ? 4 : bench_s))  # the first run starts cold: an upper bound
round 1
per_run=$(( (bench_s + bench_n - 1) / bench_n ))
log "round 1 done, ~${per_run} s per bench run"

# ---- 3. ncu on the default kernel
HOLD=0
left=$((BUDGET - RESERVE - SECONDS))
if [ -n "$NCU" ] && [ "$left" -ge 20 ]; then
    cap=$(( left < 120 ? left : 120 ))
    # with a second round to come, ncu gets at most half of what is left
    [ "$left" -ge $((4 * per_run + 40)) ] && cap=$(( left / 2 < 120 ? left / 2 : 120 ))
    log "ncu ($NCU), at most ${cap} s"
    # NCU_VARIANT=name profiles that variant instead of the default
    nv=""; for v in "${VARIANTS[@]}"; do [ "${v%%|*}" = "${NCU_VARIANT:-}" ] && nv="$v"; done
    [ -n "$nv" ] && log "ncu on $NCU_VARIANT"
    env $(env_of "$nv") NVFP4DBG_NVRTC_DEFINES="$(defs_of "$nv")" \
    timeout "$cap" "$NCU" --clock-control none --set full -k regex:nvfp4_quantize_bf16 -c 2 -f \
        -o "$R/ncu-quant-default" "$D/nvfp4dbg" bench --device cuda --quick \
        --only quantize_bf16_reference --no-report-dir -q > "$R/ncu-run.txt" 2>&1
    log "ncu rc=$?"
    if [ -f "$R/ncu-quant-default.ncu-rep" ]; then
        "$NCU" --import "$R/ncu-quant-default.ncu-rep" --page details > "$R/ncu-details.txt" 2>&1
        "$NCU" --import "$R/ncu-quant-default.ncu-rep" --page raw --csv > "$R/ncu-raw.csv" 2>&1
    else
        tail -n 5 "$R/ncu-run.txt" | tee -a "$R/log.txt"
    fi
else
    log "ncu skipped (${NCU:-not found}; ${left} s left)"
fi

# ---- 2b. second round while time is left
round 2 && log "round 2 done"

# ---- 4. the table
python3 - "$R" > "$R/summary.txt" <<'PY'
import glob, json, os, re, statistics, sys
R = sys.argv[1]
order = [l.rstrip("\n").split("|", 1) for l in open(os.path.join(R, "variants.txt")) if "|" in l]
order = [(n, d.replace("|", " ")) for n, d in order]
defs = dict(order)
rows = {}
for f in sorted(glob.glob(os.path.join(R, "quant-*.json"))):
    m = re.match(r"quant-(.+)-(\d+)\.json$", os.path.basename(f))
    try:
        res = {r["name"]: r for r in json.load(open(f)).get("results", [])}
    except Exception as e:
        print(f"{os.path.basename(f)}: unreadable ({e})")
        continue
    ref, fast, copy = (res.get(k, {}) for k in ("quantize_bf16_reference", "quantize_bf16_cuda_fast", "copy_d2d"))
    if ref.get("median_ms") is None:
        print(f"{os.path.basename(f)}: no quantize figure ({ref.get('error')})")
        continue
    rows.setdefault(m.group(1), []).append((ref["median_ms"], ref.get("ratio"), fast.get("median_ms"), copy.get("value")))

def tests(name):
    out = []
    for kind in ("quant", "moe"):
        p = os.path.join(R, f"test-{kind}-{name}.txt")
        if not os.path.exists(p):
            continue
        t = open(p, errors="replace").read()
        m = re.findall(r"test result: (\w+)\. (\d+) passed; (\d+) failed", t)
        out.append(f"{kind}:" + (f"{m[-1][0]} {m[-1][1]}/{int(m[-1][1]) + int(m[-1][2])}" if m else "NO RESULT"))
    return " ".join(out) or "-"

base = statistics.median([r[0] for r in rows.get("default", [])]) if rows.get("default") else None
print(f"{'variant':<9} {'runs':>4} {'ref ms':>8} {'min..max':>15} {'x copy':>7} {'vs def':>7} {'fast ms':>8}  tests  defines")
for name in [n for n, _ in order]:
    rs = rows.get(name)
    if not rs:
        continue
    ms = [r[0] for r in rs]
    med = statistics.median(ms)
    ratio = statistics.median([r[1] for r in rs if r[1] is not None] or [float("nan")])
    fast = statistics.median([r[2] for r in rs if r[2] is not None] or [float("nan")])
    rel = f"{base / med:6.3f}x" if base else "-"
    print(f"{name:<9} {len(rs):>4} {med:8.4f} {min(ms):7.4f}..{max(ms):.4f} {ratio:7.3f} {rel:>7} {fast:8.4f}  "
          f"{tests(name) if name != 'default' else '(nightly)'}  {defs.get(name, '')}")
copies = [r[3] for rs in rows.values() for r in rs if r[3]]
if copies:
    print(f"copy bandwidth over all runs: median {statistics.median(copies):.0f} GB/s "
          f"({min(copies):.0f}..{max(copies):.0f}); 'vs def' = default median / variant median (>1: faster)")
PY
cat "$R/summary.txt"
if [ -f "$R/ncu-details.txt" ]; then
    echo "== ncu, the default kernel's last profiled launch (all of it: ncu-details.txt, ncu-raw.csv)" | tee -a "$R/summary.txt"
    awk '/nvfp4_quantize_bf16/ { buf = "" } { buf = buf $0 "\n" } END { printf "%s", buf }' "$R/ncu-details.txt" \
        | grep -E "Duration|DRAM Throughput|Memory Throughput|L1/TEX Hit Rate|L2 Hit Rate|Achieved Occupancy|Theoretical Occupancy|Registers Per Thread|Block Limit|Issue Slots Busy|Issued Warp Per Scheduler|Warp Cycles Per Issued|No Eligible|Compute \(SM\) Throughput" \
        | tee -a "$R/summary.txt"
fi
finish
