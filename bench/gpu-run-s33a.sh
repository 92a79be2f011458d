#!/usr/bin/env bash
# Session 33, first lease (commit 1e16aa2; s33b ran it on ef87de5): the register-A gate/up
# reading one 16-bit row per token through the sort's token ids (moe_gemm_gate_up_nvfp4_sm90rs_gather, NVFP4DBG_RS_GATHER)
# against a row per slot. The prefill GPU tests, `layertest` outputs byte for byte with and
# without (a fixed gs for all experts and dynamic: the gather; calibrated: per-expert gs, no
# gather), alternating bench rounds against the slot rows and the build before (BIN=nvfp4dbg-old,
# commit abf1a96: its stripped target/release/nvfp4dbg copied into .dev/gpu by hand), then
# compute-sanitizer memcheck on the expert-input test.
set -uo pipefail
L=${LABEL:-s33a}
source bench/gpu-lib.sh
run_tests gpu_moe gpu_gemm gpu_graph
for gs in 2688 dynamic calibrated; do
    for v in 1 0; do
        NVFP4DBG_RS_GATHER=$v timeout 120 .dev/gpu/nvfp4dbg layertest --device cuda --tokens 512 --gs $gs \
            --save-outputs $R/lt-$v-$gs.safetensors > $R/lt-$v-$gs.txt 2>&1
        stamp "layertest gather=$v gs=$gs rc=$?: $(grep -E '^(PASS|FAIL)' $R/lt-$v-$gs.txt | head -1)"
    done
    cmp $R/lt-1-$gs.safetensors $R/lt-0-$gs.safetensors &&
        stamp "layertest gs=$gs: gather and slot rows bit for bit the same"
done
pack
ab_rounds ${ROUNDS:-4} layer_4096 "gather|NVFP4DBG_RS_GATHER=1 slot|NVFP4DBG_RS_GATHER=0 old|BIN=nvfp4dbg-old"
for v in gather slot; do
    python3 -c "import json,sys; [print(sys.argv[2], r['name'], r['details'].get('schedule')) for r in json.load(open(sys.argv[1]))['results'] if r['name'] == 'layer_4096_graph']" $R/$v-1.json $v
done
timeout ${SAN_S:-120} compute-sanitizer --tool memcheck --print-limit 20 .dev/gpu/gpu_moe --ignored --nocapture \
    --test-threads 1 expert_inputs_scattered_token_by_token_equal_the_gather > $R/memcheck.txt 2>&1
stamp "memcheck rc=$?: $(grep -E 'ERROR SUMMARY|^test result' $R/memcheck.txt | tr '\n' ' ')"
stamp done
pack
