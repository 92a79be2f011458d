// Exhaustive GPU check that the hardware E4M3 conversion (`e4m3_encode_hw`, cvt.rn.satfinite)
// equals the reference's `e4m3_encode_sat` on every f32 the reference flavor of
// kernels/nvfp4dbg_common.cuh `quant_block_nvfp4_core` hands it: t = min(gs * (vmax * R6), 448),
// i.e. every non-NaN f32 <= 448 (NaN is mapped to E4M3_NAN before the conversion).
//
//   nvcc -gencode=arch=compute_90a,code=sm_90a -O3 --fmad=false -I kernels \
//        -o /tmp/e4m3_check tools/checks/e4m3_hw_encode.cu && /tmp/e4m3_check
//
// Prints "mismatches 0 of N"; exits 1 on any mismatch.
#include <cstdio>
#include "nvfp4dbg_common.cuh"

__global__ void check(unsigned long long* bad, unsigned long long* n, unsigned* first) {
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
    atomicAdd(bad, nb);
    atomicAdd(n, nn);
}

int main() {
    unsigned long long* d;
    unsigned* f;
    if (cudaMalloc(&d, 16) != cudaSuccess || cudaMalloc(&f, 4) != cudaSuccess) return 2;
    cudaMemset(d, 0, 16);
    cudaMemset(f, 0xFF, 4);
    check<<<132 * 16, 256>>>(d, d + 1, f);
    if (cudaDeviceSynchronize() != cudaSuccess || cudaGetLastError() != cudaSuccess) return 2;
    unsigned long long h[2];
    unsigned first;
    cudaMemcpy(h, d, 16, cudaMemcpyDeviceToHost);
    cudaMemcpy(&first, f, 4, cudaMemcpyDeviceToHost);
    printf("mismatches %llu of %llu", h[0], h[1]);
    if (h[0]) printf(" (first at bits %08x)", first);
    printf("\n");
    return h[0] != 0;
}
