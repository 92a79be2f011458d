// Exhaustive GPU check that the hardware E4M3 conversion (`e4m3_encode_hw`, cvt.rn.satfinite)
// equals the reference's `e4m3_encode_sat` on every f32 the reference flavor of
// kernels/nvfp4dbg_common.cuh `quant_block_nvfp4_core` hands it: t = min(gs * (vmax * R6), 448),
// i.e. every non-NaN f32 <= 448 (NaN is mapped to E4M3_NAN before the conversion).
//
//   nvcc -gencode=arch=compute_90a,code=sm_90a -O3 --fmad=false -I kernels \
//        -o /tmp/e4m3_check tools/checks/e4m3_hw_encode.cu && /tmp/e4m3_check
//
// Prints "mismatches 0 of N"; exits 1 on any mismatch.
#include "nvfp4dbg_common.cuh"
#include "exhaustive.cuh"

__global__ void check(unsigned long long* counts, unsigned* first) {
    unsigned long long nb = 0, nn = 0;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < (1ull << 32);
         i += (unsigned long long)gridDim.x * blockDim.x) {
        float x = __uint_as_float((u32)i);
        if (x != x || x > 448.0f) continue;
        nn++;
        if (e4m3_encode_hw(x) != e4m3_encode_sat(x)) {
            nb++;
            atomicMin(first, (u32)i);
        }
    }
    atomicAdd(&counts[0], nb);
    atomicAdd(&counts[1], nn);
}

int main() { return run_exhaustive(check, "mismatches %llu of %llu"); }
