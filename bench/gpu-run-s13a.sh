#!/usr/bin/env bash
# Historical: RS_WSMEM was removed after s13c (it measured slower and hung); at HEAD the
# RS_WSMEM defines below are ignored, so every variant runs the same kernels.
# session 13, first device call: the register-A prefill's weights streamed through warp-private
# shared-memory stages (kernels/moe_gemm_sm90.cu RS_WSMEM). (1) gpu_moe, gpu_gemm (bit-exact
# against the CPU) and gpu_checks on the new default; (2) the prefill GEMMs and the layers:
# default (3 stages) against the weights in registers (RS_WSMEM=0, the old default), 5 stages
# with 3 token stages, 2 stages, two MMA groups in flight on the wide tiles, and no L2 prefetch
# in the down GEMM, alternating; (3) ncu on the gate/up kernel.
set -uo pipefail
L=${LABEL:-s13a}
source bench/gpu-lib.sh
run_tests ${TESTS:-gpu_moe gpu_gemm gpu_checks}
D=NVFP4DBG_NVRTC_DEFINES
ab_rounds ${ROUNDS:-3} ${ONLY:-gemm_prefill,layer_4096} "w3| regs|$D=-DRS_WSMEM=0 w5s3|$D=-DRS_WSMEM=5~-DR_STAGES=3 w2|$D=-DRS_WSMEM=2 wide2|$D=-DRS_INFLIGHT_WIDE=2 nol2|$D=-DRS_L2_AHEAD_DOWN=0"
NCU="$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)"
timeout 90 "$NCU" --clock-control none --set full -k regex:gate_up_nvfp4_sm90rs -c 1 -f -o $R/ncu-gate-up \
    .dev/gpu/nvfp4dbg bench --device cuda --quick --only gemm_prefill_4096_gate_up --no-report-dir -q > $R/ncu-run.txt 2>&1
stamp "ncu rc=$?"
"$NCU" --import $R/ncu-gate-up.ncu-rep --page details > $R/ncu-gate-up-details.txt 2>&1
grep -E "Duration|Issued Warp|No Eligible|Registers Per|Compute \(SM\) Throughput|Memory Throughput" $R/ncu-gate-up-details.txt | head
pack
stamp total
