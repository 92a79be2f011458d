#!/usr/bin/env bash
# session 12, fourth device call: SwiGLU's exp by a table-driven double path that rounds to f32
# only where that is certain (kernels/nvfp4dbg_common.cuh EXPF_CR_FAST; results identical to
# CUDA's double exp). (1) tools/checks/expf_cr_fast.cu on all 2^32 f32; (2) gpu_moe and gpu_gemm;
# (3) the prefill GEMMs and the layers against -DEXPF_CR_FAST=0, alternating; (4) ncu on the
# gate/up kernel; (5) the nightly, the whole bench and the peers (bench/gpu-run-final.sh).
set -uo pipefail
L=${LABEL:-s12d}
source bench/gpu-lib.sh
/usr/local/cuda/bin/nvcc -gencode=arch=compute_90a,code=sm_90a -O3 --fmad=false -I kernels -o /tmp/expf_check \
    tools/checks/expf_cr_fast.cu > $R/expf.txt 2>&1 && /tmp/expf_check >> $R/expf.txt 2>&1
stamp "expf_cr_fast check rc=$?: $(tail -1 $R/expf.txt)"
run_tests ${TESTS:-gpu_moe gpu_gemm}
ab_rounds ${ROUNDS:-3} ${ONLY:-gemm_prefill,layer} "default| slowexp|NVFP4DBG_NVRTC_DEFINES=-DEXPF_CR_FAST=0"
NCU="$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)"
timeout 90 "$NCU" --clock-control none --set full -k regex:gate_up_nvfp4_sm90rs -c 1 -f -o $R/ncu-gate-up \
    .dev/gpu/nvfp4dbg bench --device cuda --quick --only gemm_prefill_4096_gate_up --no-report-dir -q > $R/ncu-run.txt 2>&1
stamp "ncu rc=$?"
"$NCU" --import $R/ncu-gate-up.ncu-rep --page raw --csv > $R/ncu-gate-up-raw.csv 2>&1
"$NCU" --import $R/ncu-gate-up.ncu-rep --page details > $R/ncu-gate-up-details.txt 2>&1
grep -E "Duration|Issued Warp|No Eligible" $R/ncu-gate-up-details.txt
pack
[ "${FINAL:-1}" = 1 ] || exit 0
PART=nightly NIGHTLY_S=240 LABEL=$L-nightly bash bench/gpu-run-final.sh
PART=bench LABEL=$L-bench bash bench/gpu-run-final.sh
stamp total
