#!/usr/bin/env bash
# End to end: nvfp4dbg on transformers' own DeepSeek-V3, with bugs planted the way they happen
# in engines. One run: build a small DeepseekV3ForCausalLM, quantize its routed experts with
# `nvfp4dbg quantize`, audit and compare the checkpoint, record traces with
# tools/nvfp4dbg_trace.py, and check that each planted bug is named by the command made for it
# and that every clean run passes.
#
#   tools/e2e/run_e2e.sh [NVFP4DBG]      (default: nvfp4dbg on PATH)
#
# Env: PYTHON (default python3; needs torch, transformers >= 5, safetensors), E2E_WORK (work
# dir; default a new temp dir; each command's output and JSON report land in its e2e-logs/),
# OUT (when set, e2e-logs/ is also archived to $OUT/e2e-logs.tar.gz, even after a failure),
# E2E_DEVICE (cuda|cpu; default cuda when torch sees a GPU).
# Exit 0 when every step got what it expected, 1 otherwise.

set -u
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
NV_ARG=${1:-nvfp4dbg}
if [[ "$NV_ARG" == */* ]]; then
    NV="$(cd "$(dirname "$NV_ARG")" && pwd)/$(basename "$NV_ARG")"
else
    NV=$(command -v "$NV_ARG" || true)
fi
if [[ -z "$NV" || ! -x "$NV" ]]; then
    echo "run_e2e.sh: no nvfp4dbg binary at '$NV_ARG'" >&2
    exit 2
fi
PY=${PYTHON:-python3}
W=${E2E_WORK:-$(mktemp -d "${TMPDIR:-/tmp}/nvfp4dbg-e2e.XXXXXX")}
mkdir -p "$W"
W=$(cd "$W" && pwd)
LOGDIR=$W/e2e-logs
mkdir -p "$LOGDIR"
if [[ -n "${OUT:-}" ]]; then
    # one archive rather than ~40 files: a device run brings back only a few files of $OUT
    mkdir -p "$OUT"
    trap 'tar czf "$OUT/e2e-logs.tar.gz" -C "$W" e2e-logs 2>/dev/null' EXIT
fi
export HF_HUB_DISABLE_PROGRESS_BARS=1 TRANSFORMERS_VERBOSITY=error TQDM_DISABLE=1 \
    HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 NO_COLOR=1
DEV=${E2E_DEVICE:-$("$PY" -c 'import torch; print("cuda" if torch.cuda.is_available() else "cpu")' 2>/dev/null || echo cpu)}

cd "$W" || exit 2
echo "nvfp4dbg end-to-end on transformers DeepSeek-V3"
echo "  binary   $NV ($("$NV" --version 2>/dev/null))"
echo "  python   $("$PY" -c 'import sys, torch, transformers; print(sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__)' 2>&1)"
echo "  device   $DEV$([[ $DEV == cuda ]] && "$PY" -c 'import torch; print(" (" + torch.cuda.get_device_name(0) + ")")' 2>/dev/null)"
echo "  work dir $W (commands below run there)"
echo "  logs     $LOGDIR${OUT:+ (archived to \$OUT/e2e-logs.tar.gz)}"
echo

ROWS=()      # summary rows
DETAILS=()   # expected / got per step
FAILED=0

# run_step ID TITLE WANT_RC EXPECTED CHECK -- CMD...
#   CHECK: "KIND ARGS..." for check.py (reads the step's --json report), or "-"
#   @JSON@ in CMD becomes the step's JSON report path
run_step() {
    local id=$1 title=$2 want_rc=$3 expected=$4 check=$5
    shift 6
    local log="$LOGDIR/$id.log" json="$LOGDIR/$id.json"
    local cmd=() a
    for a in "$@"; do cmd+=("${a//@JSON@/$json}"); done
    local shown="${cmd[*]}"
    shown=${shown//$NV/nvfp4dbg}
    shown=${shown//$LOGDIR\//\$LOGS\/}
    shown=${shown//$HERE\//tools\/e2e\/}
    echo "== [$id] $title"
    echo "\$ $shown"
    local t0=$SECONDS
    "${cmd[@]}" >"$log" 2>&1
    local rc=$?
    local dt=$((SECONDS - t0))
    local verdict
    verdict=$(grep -E '^(PASS|FAIL|error)' "$log" | tail -n 1)
    if [[ -n "$verdict" ]]; then
        echo "   ${verdict:0:400}"
    else  # the Python steps: their few lines say what they made
        grep -v '^\s*$' "$log" | tail -n 12 | sed 's/^/   /'
    fi
    local got="" crc=0
    if [[ "$check" != "-" ]]; then
        check=${check//@JSON@/$json}
        # shellcheck disable=SC2086
        got=$("$PY" "$HERE/check.py" $check 2>&1)
        crc=$?
        got=$(tail -n 1 <<<"$got")
        echo "   $got"
    fi
    local result=OK
    if [[ $rc -ne $want_rc || $crc -ne 0 ]]; then
        result=MISMATCH
        FAILED=$((FAILED + 1))
        echo "   !! expected exit $want_rc and: $expected -- got exit $rc$([[ $crc -ne 0 ]] && echo ", check failed") (log: $log)"
        tail -n 15 "$log" | sed 's/^/   | /'
    fi
    echo "   exit $rc (expected $want_rc), ${dt}s: $result"
    echo
    ROWS+=("$(printf '%-5s %-58s %4s %4s %6s  %s' "$id" "${title:0:58}" "$want_rc" "$rc" "${dt}s" "$result")")
    DETAILS+=("[$id] \$ $shown"$'\n'"      expected: exit $want_rc, $expected"$'\n'"      got:      exit $rc${got:+, ${got#got: }}")
}

E2E="$HERE/e2e.py"
L_NAN=1; TOK_NAN=41          # model.layers.1.self_attn, batch 1 position 9 of 32 -> token 41
SWAP_L=2; SWAP_E=5; RL=2

echo "### 1. model and NVFP4 checkpoint"
run_step 1.1 "build DeepseekV3ForCausalLM (random weights), save BF16" 0 \
    "a BF16 HF checkpoint + routed-expert weights + calibration amax" - -- \
    "$PY" "$E2E" build .
run_step 1.2 "quantize the routed experts (gate|up fused, down)" 0 \
    "NVFP4 tensors written" "quantize @JSON@" -- \
    "$NV" quantize experts_bf16.safetensors experts_nvfp4.safetensors --json @JSON@ --no-report-dir -q
run_step 1.3 "assemble the ModelOpt NVFP4 checkpoint (ckpt/)" 0 \
    "routed experts NVFP4 + input_scale, the rest BF16, bf16/ originals" - -- \
    "$PY" "$E2E" assemble .
run_step 1.4 "audit the checkpoint" 0 \
    "pass: no hazards" "audit_pass @JSON@" -- \
    "$NV" audit ckpt --json @JSON@ --no-report-dir -q
run_step 1.5 "PLANTED: quantize gate and up separately (per-tensor)" 0 \
    "NVFP4 tensors written" "quantize @JSON@" -- \
    "$NV" quantize experts_bf16_unfused.safetensors experts_nvfp4_unfused.safetensors --json @JSON@ --no-report-dir -q
run_step 1.6 "audit names the gate/up weight_scale_2 mismatch" 1 \
    "fail: gate_up_scale_mismatch findings" "audit_gate_up @JSON@" -- \
    "$NV" audit experts_nvfp4_unfused.safetensors --json @JSON@ --no-report-dir -q
run_step 1.7 "compare-weights: checkpoint vs itself" 0 \
    "pass: every tensor bitwise equal" "weights_identical @JSON@" -- \
    "$NV" compare-weights ckpt ckpt --json @JSON@ --no-report-dir -q
run_step 1.8 "compare-weights: checkpoint vs its state dict file" 0 \
    "pass: every tensor bitwise equal" "weights_identical @JSON@" -- \
    "$NV" compare-weights ckpt ckpt/model.safetensors --json @JSON@ --no-report-dir -q

echo "### 2. traces and dumps from the model (tools/nvfp4dbg_trace.py)"
run_step 2.1 "record traces, write engine and routing dumps" 0 \
    "traces bf16, bf16-rerun, nan-attn, nvfp4, nvfp4-default-gs; dumps" - -- \
    "$PY" "$E2E" material .

echo "### 3. a NaN produced inside one attention module"
run_step 3.1 "nan-locate on the clean BF16 trace" 0 \
    "pass: no NaN/Inf" "verdict_pass @JSON@" -- \
    "$NV" nan-locate traces/bf16 --json @JSON@ --no-report-dir -q
run_step 3.2 "nan-locate: NaN written into model.layers.1.self_attn" 1 \
    "fail naming model.layers.1.self_attn, token $TOK_NAN, inputs clean" \
    "nan_named @JSON@ model.layers.$L_NAN.self_attn $TOK_NAN" -- \
    "$NV" nan-locate traces/nan-attn --json @JSON@ --no-report-dir -q

echo "### 4. routed experts in NVFP4 vs the BF16 model"
run_step 4.1 "bisect BF16 vs BF16 rerun (--min-cosine 0.9999)" 0 \
    "pass: runs agree" "verdict_pass @JSON@" -- \
    "$NV" bisect traces/bf16 traces/bf16-rerun --min-cosine 0.9999 --json @JSON@ --no-report-dir -q
run_step 4.2 "bisect BF16 vs NVFP4 experts (checkpoint input_scale)" 1 \
    "fail naming model.layers.1.mlp.experts (first MoE experts), inputs matched" \
    "bisect_named @JSON@ model.layers.1.mlp.experts" -- \
    "$NV" bisect traces/bf16 traces/nvfp4 --json @JSON@ --no-report-dir -q
run_step 4.3 "bisect BF16 vs NVFP4 experts with the default gs 1/2688" 1 \
    "fail naming model.layers.1.mlp.experts or a module inside it" \
    "bisect_named @JSON@ model.layers.1.mlp.experts" -- \
    "$NV" bisect traces/bf16 traces/nvfp4-default-gs --json @JSON@ --no-report-dir -q

echo "### 5. a weight loaded with gate/up swapped in one expert"
run_step 5.1 "compare-weights: checkpoint vs clean engine dump" 0 \
    "pass (fused w13, swizzled scales, merged gate_up_proj and fused_qkv_a_proj recognized)" "weights_clean @JSON@" -- \
    "$NV" compare-weights ckpt dumps/engine-clean.safetensors --json @JSON@ --no-report-dir -q
run_step 5.2 "compare-weights: engine dump, layer $SWAP_L expert $SWAP_E gate/up swapped" 1 \
    "fail naming exactly model.layers.$SWAP_L.mlp.experts.$SWAP_E.{gate,up}_proj, diagnosed gate_up_swapped" \
    "weights_swapped @JSON@ $SWAP_L $SWAP_E" -- \
    "$NV" compare-weights ckpt dumps/engine-swapped.safetensors --json @JSON@ --no-report-dir -q

echo "### 6. local expert ids under a simulated EP split (rank 1 of 2)"
run_step 6.1 "routing: clean dump of layer $RL (global ids, EP 1/2)" 0 \
    "pass: ids, weights and recomputed routing agree" "routing_clean @JSON@" -- \
    "$NV" routing dumps/routing-clean.safetensors --checkpoint ckpt --device "$DEV" --json @JSON@ --no-report-dir -q
run_step 6.2 "routing: EP rank 1 dump with local ids" 1 \
    "fail naming local_ids_as_global" "routing_local @JSON@" -- \
    "$NV" routing dumps/routing-ep-local.safetensors --checkpoint ckpt --device "$DEV" --json @JSON@ --no-report-dir -q

echo "### 7. the MoE layer on real hidden states"
run_step 7.1 "layertest layer $RL on its captured MoE-block input ($DEV)" 0 \
    "pass: NVFP4 layer within NVFP4 error of BF16, no NaN$([[ $DEV == cuda ]] && echo ', kernels = CPU NVFP4 path')" \
    "layertest @JSON@ $DEV" -- \
    "$NV" layertest --checkpoint ckpt --layer "$RL" --input "layer$RL-mlp-input.safetensors" \
    --gs checkpoint --device "$DEV" --save-outputs "$LOGDIR/layertest-outputs.safetensors" \
    --json @JSON@ --no-report-dir -q
run_step 7.2 "cross-check layertest outputs vs transformers' MoE block" 0 \
    "NVFP4 and BF16 outputs agree with the PyTorch versions (cosine >= 0.9999)" - -- \
    "$PY" "$E2E" crosscheck . "$LOGDIR/layertest-outputs.safetensors"

echo "================================ summary ================================"
printf '%-5s %-58s %4s %4s %6s  %s\n' "step" "what" "want" "exit" "time" "result"
for r in "${ROWS[@]}"; do echo "$r"; done
echo
for d in "${DETAILS[@]}"; do echo "$d"; done
echo
if [[ $FAILED -eq 0 ]]; then
    echo "ALL ${#ROWS[@]} STEPS AS EXPECTED: every planted bug named, no false alarm on clean runs"
    exit 0
fi
echo "$FAILED of ${#ROWS[@]} STEPS NOT AS EXPECTED (logs in $LOGDIR)"
exit 1
