#!/usr/bin/env bash
# Session 17, lease a: where the build of b2f8762 hangs (s16b/s16h: its layer bench never ends)
# and whether an explicit reconvergence before the warpgroup MMAs changes that.
#  1. .dev/gpu/nvfp4dbg-h (b2f8762 + the RS_SYNCWARP knob, off: the same kernel) runs the
#     layer bench; once it hangs, cuda-gdb attaches and prints each SM's warps (their PCs),
#     the lanes of a few warps and the SASS around them. Its cubins are packed.
#  2. The same build under RS_SYNCWARP=1, 2, 3 (kernels/moe_gemm_sm90.cu): does it still hang?
#  3. The current build (.dev/gpu/nvfp4dbg), RS_SYNCWARP 0 against 3: the layer and prefill
#     figures in alternating rounds, and the register-A GPU tests under 3.
# It ran on commit 1d03ac7; the knob RS_SYNCWARP was removed in f55bc18, where both
# reconvergence points became the kernel's code (value 3). The b2f8762 build is that commit
# with the same knob added (off by default: its SASS is the hanging build's).
set -uo pipefail
L=s17a
source bench/gpu-lib.sh
H=.dev/gpu/nvfp4dbg-h
{ which cuda-gdb compute-sanitizer; nvidia-smi -L; } > $R/tools.txt 2>&1
stamp "tools: $(tr '\n' ' ' < $R/tools.txt)"

# 1. the hang, attached
export NVFP4DBG_CACHE_DIR=$R/cubin-h
$H bench --device cuda --no-report-dir -q --quick --only layer_4096 --json $R/h.json > $R/h.txt 2>&1 &
PID=$!
sleep ${ATTACH_S:-45}
if kill -0 $PID 2>/dev/null; then
    stamp "b2f8762 layer bench still running at ${ATTACH_S:-45} s: attaching"
    nvidia-smi --query-gpu=utilization.gpu,power.draw --format=csv > $R/smi-hang.txt 2>&1
    args=(-q -batch -p $PID -ex "set pagination off" -ex "set width 0" -ex "info cuda kernels"
          -ex "info cuda blocks")
    for sm in $(seq 0 131); do args+=(-ex "cuda sm $sm" -ex "info cuda warps"); done
    for sm in 0 1 2 64; do
        for w in 0 1 4 5; do
            args+=(-ex "cuda sm $sm warp $w lane 0" -ex "info cuda lanes" -ex "x/6i \$pc-48" -ex "x/10i \$pc")
        done
    done
    timeout 240 cuda-gdb "${args[@]}" > $R/gdb.txt 2>&1
    stamp "cuda-gdb rc=$? ($(wc -l < $R/gdb.txt) lines)"
else
    wait $PID
    stamp "b2f8762 layer bench ended by itself: rc=$?"
fi
kill -9 $PID 2>/dev/null; wait $PID 2>/dev/null
unset NVFP4DBG_CACHE_DIR
export NVFP4DBG_CACHE_DIR=/tmp/nvfp4dbg-cubin
pack

# 2. the same build with the reconvergence points
for sw in 1 2 3; do
    NVFP4DBG_NVRTC_DEFINES="-DRS_SYNCWARP=$sw" timeout 60 $H bench --device cuda --no-report-dir -q --quick \
        --only layer_4096 --json $R/h-sw$sw.json > $R/h-sw$sw.txt 2>&1
    stamp "b2f8762 RS_SYNCWARP=$sw layer bench rc=$?"
    pack
done

# 3. the current build: the cost of the reconvergence points, and its tests
ab_rounds 3 layer_4096,gemm_prefill "base|X=0 sw3|NVFP4DBG_NVRTC_DEFINES=-DRS_SYNCWARP=3"
NVFP4DBG_NVRTC_DEFINES="-DRS_SYNCWARP=3" run_tests gpu_gemm gpu_moe
stamp total
pack
