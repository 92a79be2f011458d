#!/usr/bin/env bash
# session 10, second device call: (1) bench/quantize_traffic_probe.cu: the quantizer's traffic
# in several kernel shapes against the driver's copies; (2) the layer with the shared expert on
# a low-priority side stream (the main stream at the highest priority) and after the routed
# experts, alternating (s10b also ran the side stream at the main one's priority, and forked
# after the prologue: no difference; those knobs are gone); (3) gpu_moe and gpu_graph.
set -uo pipefail
L=${LABEL:-s10b}
source bench/gpu-lib.sh
# (carried from the build machine, else built here with the device's nvcc)
[ -x .dev/gpu/quantize_traffic_probe ] || /usr/local/cuda/bin/nvcc -O3 -gencode=arch=compute_90a,code=sm_90a \
    -o .dev/gpu/quantize_traffic_probe bench/quantize_traffic_probe.cu
timeout 120 .dev/gpu/quantize_traffic_probe > $R/probe.txt 2>&1
stamp "probe rc=$?"; cat $R/probe.txt
pack
ab_rounds ${ROUNDS:-3} ${ONLY:-layer} "${VARIANTS:-low| off|NVFP4DBG_SHARED_STREAM=0}"
run_tests ${TESTS:-gpu_moe gpu_graph}
stamp total
