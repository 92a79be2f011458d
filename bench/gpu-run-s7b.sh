#!/usr/bin/env bash
# session 7, second device call: the register-A prefill GEMMs with FP16 operands and two MMA
# groups in flight (the defaults now) against BF16 operands (-DRS_F16=0), one group in flight
# (-DRS_INFLIGHT=1) and the first wgmma kernels (NVFP4DBG_SM90=v1): GPU tests per variant,
# prefill and layer figures alternating, and ncu's stall reasons on the default kernels.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 NO_COLOR=1 PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NVFP4DBG_CUDA_INCLUDE=/usr/local/cuda/include:/usr/local/cuda/include/cccl
R=/tmp/s7b; mkdir -p $R
t0=$(date +%s)
pack() { tar czf $OUT/s7b.tgz -C $R .; }
tests() {  # name, defines, test filter
    NVFP4DBG_NVRTC_DEFINES="$2" timeout 100 .dev/gpu/gpu_gemm --ignored --nocapture --test-threads 1 ${3:-} > $R/gemm-$1.txt 2>&1
    local rc=$?
    echo "gpu_gemm [$1] rc=$rc at $(( $(date +%s) - t0 )) s" | tee -a $R/log.txt
    grep -E "test result|panicked" $R/gemm-$1.txt | head -5
    [ $rc -eq 124 ] && { pack; exit 1; }
}
tests f16 ""
timeout 60 .dev/gpu/gpu_moe --ignored --nocapture --test-threads 1 > $R/gpu_moe.txt 2>&1
echo "gpu_moe rc=$? at $(( $(date +%s) - t0 )) s" | tee -a $R/log.txt; grep -E "test result|panicked" $R/gpu_moe.txt
tests bf16 "-DRS_F16=0"
tests inflight1 "-DRS_INFLIGHT=1" deepseek_v3_widths
pack
B=".dev/gpu/nvfp4dbg bench --device cuda --no-report-dir -q --quick --only floors,gemm_prefill,layer_4096"
for i in 1 2; do
    timeout 60 $B --json $R/f16-$i.json > $R/f16-$i.txt 2>&1
    NVFP4DBG_NVRTC_DEFINES="-DRS_F16=0" timeout 60 $B --json $R/bf16-$i.json > $R/bf16-$i.txt 2>&1
    NVFP4DBG_NVRTC_DEFINES="-DRS_INFLIGHT=1" timeout 60 $B --json $R/inflight1-$i.json > $R/inflight1-$i.txt 2>&1
    NVFP4DBG_SM90=v1 timeout 60 $B --json $R/v1-$i.json > $R/v1-$i.txt 2>&1
    echo "bench round $i at $(( $(date +%s) - t0 )) s" | tee -a $R/log.txt
    pack
done
for v in f16 bf16 inflight1 v1; do for i in 1 2; do
    echo "== $v $i"; grep -E "│ [a-z_0-9]+ +│" $R/$v-$i.txt | awk -F'│' '{print $2,$3,$5,$9}' | grep -E "prefill|layer|ceil"
    grep -iE "error|panicked" $R/$v-$i.txt | head -3
done; done
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
if [ -x "$NCU" ]; then
    M=smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_dispatch_stall_per_issue_active.ratio,smsp__average_warps_issue_stalled_membar_per_issue_active.ratio,smsp__average_warps_issue_stalled_sleeping_per_issue_active.ratio,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio,smsp__average_warps_issue_stalled_branch_resolving_per_issue_active.ratio,smsp__average_warps_issue_stalled_imc_miss_per_issue_active.ratio,smsp__average_warps_issue_stalled_drain_per_issue_active.ratio,smsp__average_warps_issue_stalled_misc_per_issue_active.ratio,smsp__average_warps_issue_stalled_tex_throttle_per_issue_active.ratio,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_tensor_op_gmma.sum,smsp__inst_executed.sum,sm__cycles_active.avg
    timeout 150 $NCU --clock-control none -k regex:sm90rs -c 2 --section SpeedOfLight --metrics $M \
        .dev/gpu/nvfp4dbg bench --device cuda --no-report-dir -q --quick --only gemm_prefill > $R/ncu.txt 2>&1
    echo "ncu rc=$? at $(( $(date +%s) - t0 )) s" | tee -a $R/log.txt
    grep -E "sm90rs|Duration|Throughput|stalled|tensor|inst_executed|cycles_active" $R/ncu.txt | head -60
fi
pack
echo "total $(( $(date +%s) - t0 )) s"
