// Exhaustive GPU check that expf_cr of kernels/nvfp4dbg_common.cuh, with its fast path
// (EXPF_CR_FAST, the default), equals (float)exp((double)x), CUDA's double exp rounded to f32,
// bit for bit on every one of the 2^32 f32 bit patterns; also counts the inputs that the fast
// path hands to CUDA's exp (within 2^12 double ulps of an f32 rounding boundary, |x| > 87, NaN).
//
//   nvcc -gencode=arch=compute_90a,code=sm_90a -O3 --fmad=false -I kernels \
//        -o /tmp/expf_check tools/checks/expf_cr_fast.cu && /tmp/expf_check
//
// Prints "mismatches 0 of N"; exits 1 on any mismatch.
#include <cstdio>
#include "nvfp4dbg_common.cuh"

__global__ void check(unsigned long long* out, unsigned* first) {
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
    atomicAdd(&out[0], nb);
    atomicAdd(&out[1], nslow);
}

int main() {
    unsigned long long* d;
    unsigned* f;
    if (cudaMalloc(&d, 16) != cudaSuccess || cudaMalloc(&f, 4) != cudaSuccess) return 2;
    cudaMemset(d, 0, 16);
    cudaMemset(f, 0xFF, 4);
    check<<<132 * 16, 256>>>(d, f);
    if (cudaDeviceSynchronize() != cudaSuccess || cudaGetLastError() != cudaSuccess) return 2;
    unsigned long long h[2];
    unsigned first;
    cudaMemcpy(h, d, 16, cudaMemcpyDeviceToHost);
    cudaMemcpy(&first, f, 4, cudaMemcpyDeviceToHost);
    printf("mismatches %llu of 4294967296 (fast path declined %llu with |x| <= 87)", h[0], h[1]);
    if (h[0]) printf(" (first at bits %08x)", first);
    printf("\n");
    return h[0] != 0;
}
