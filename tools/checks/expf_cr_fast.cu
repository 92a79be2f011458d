// Exhaustive GPU check that expf_cr of kernels/nvfp4dbg_common.cuh, with its fast path
// (EXPF_CR_FAST, the default), equals (float)exp((double)x), CUDA's double exp rounded to f32,
// bit for bit on every one of the 2^32 f32 bit patterns; also counts the inputs that the fast
// path hands to CUDA's exp (within 2^12 double ulps of an f32 rounding boundary, |x| > 87, NaN).
//
//   nvcc -gencode=arch=compute_90a,code=sm_90a -O3 --fmad=false -I kernels \
//        -o /tmp/expf_check tools/checks/expf_cr_fast.cu && /tmp/expf_check
//
// Prints "mismatches 0 of N"; exits 1 on any mismatch.
#include "nvfp4dbg_common.cuh"
#include "exhaustive.cuh"

__global__ void check(unsigned long long* counts, unsigned* first) {
    unsigned long long nb = 0, nslow = 0;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < (1ull << 32);
         i += (unsigned long long)gridDim.x * blockDim.x) {
        float x = __uint_as_float((u32)i), y;
        if (!expf_cr_fast(x, y) && fabsf(x) <= 87.0f) nslow++;
        if (__float_as_uint(expf_cr(x)) != __float_as_uint((float)exp((double)x))) {
            nb++;
            atomicMin(first, (u32)i);
        }
    }
    atomicAdd(&counts[0], nb);
    atomicAdd(&counts[1], nslow);
}

int main() {
    return run_exhaustive(check, "mismatches %llu of 4294967296 (fast path declined %llu with |x| <= 87)");
}
