// Exhaustive GPU check of swiglu_nvfp4_16 (kernels/nvfp4dbg_common.cuh: the register-A gate/up
// epilogue's SwiGLU and NVFP4 block together, fast values where they cannot change a scale or
// a code). Two parts:
//  1. its premise: silu_fast(g) within 2^-17 (relative) of the reference chain
//     g / (1 + expf_cr(-g)) on every f32 gate with 2^-60 <= |g| <= 64 (prints the largest
//     error seen, as a power of two);
//  2. its result: for all 2^32 f32 bit patterns as gates, in blocks of 16 consecutive ones, the
//     scale code, the packed codes and the nonzero flag equal those of swiglu16 then
//     quant_block_nvfp4_vmax, twice: without a limit in the reference flavor and with
//     swiglu_limit 7 in the cuda-fast flavor. Each block's u values come from a hash of its
//     index (mostly in [-4, 4]; 0, -0, tiny, huge, infinite and NaN ones mixed in), and its
//     global scale puts the block's largest value at a hashed fraction of E4M3 x E2M1's range,
//     so that scales and codes land everywhere, boundaries included.
//
//   nvcc -gencode=arch=compute_90a,code=sm_90a -O3 --fmad=false -I kernels \
//        -o /tmp/swiglu_nvfp4_check tools/checks/swiglu_nvfp4.cu && /tmp/swiglu_nvfp4_check
//
// Prints "mismatches 0 of N"; exits 1 on any mismatch, 2 when a CUDA call fails.
#include <cmath>
#include <cstdio>
#include <cstring>

#include "nvfp4dbg_common.cuh"

__device__ __forceinline__ u32 hash32(u32 x) {
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

// part 1: counts[0] gates over the bound, counts[1] gates in the domain; maxerr the largest
// relative error's f32 bits
__global__ void bound(unsigned long long* counts, unsigned* maxerr, unsigned* first) {
    unsigned long long over = 0, seen = 0;
    u32 worst = 0;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < (1ull << 32);
         i += (unsigned long long)gridDim.x * blockDim.x) {
        float g = __uint_as_float((u32)i), ag = fabsf(g);
        if (!(ag >= 0x1p-60f && ag <= 64.0f)) continue;
        seen++;
        double ref = (double)__fdiv_rn(g, __fadd_rn(1.0f, expf_cr(-g)));
        float err = (float)fabs(((double)silu_fast(g) - ref) / ref);
        worst = max(worst, __float_as_uint(err));
        if (!(err <= 0x1p-17f)) {
            over++;
            atomicMin(first, (u32)i);
        }
    }
    atomicAdd(&counts[0], over);
    atomicAdd(&counts[1], seen);
    atomicMax(maxerr, worst);
}

__device__ float hashed_u(u32 h) {
    switch (h & 63u) {
        case 0: return 0.0f;
        case 1: return -0.0f;
        case 2: return __int_as_float(0x7F800000);
        case 3: return f32_nan();
        case 4: return 0x1p-110f;
        case 5: return -0x1p110f;
        default: return __fmul_rn((float)(int)(h >> 8) - 8388608.0f, 0x1p-21f);  // [-4, 4)
    }
}

// part 2: counts[0] blocks that differ, counts[1] blocks compared
__global__ void blocks(unsigned long long* counts, unsigned* first) {
    unsigned long long bad = 0, seen = 0;
    for (unsigned long long i = 16 * ((unsigned long long)blockIdx.x * blockDim.x + threadIdx.x); i < (1ull << 32);
         i += 16ull * gridDim.x * blockDim.x) {
#pragma unroll 1
        for (u32 pass = 0; pass < 2; pass++) {
            float limit = pass ? 7.0f : 0.0f;
            u32 flavor = pass ? FLAVOR_CUDA_FAST : FLAVOR_REFERENCE;
            float g[16], u[16], g2[16], u2[16], v[16];
#pragma unroll
            for (int k = 0; k < 16; k++) {
                g[k] = g2[k] = __uint_as_float((u32)(i + k));
                u[k] = u2[k] = hashed_u(hash32((u32)(i + k) ^ (pass << 31)));
            }
            // the reference: the exact SwiGLU of every value, then the block
            swiglu16(g, u, limit, pass, v);
            u32 mb = amax_bits16(v);
            float vmax = __uint_as_float(mb);
            // a global scale that puts max|a| at 2^-12 .. 2^4 of 448 * 6 (hashed), or 1
            u32 h = hash32((u32)(i >> 4) * 2 + pass);
            float gs = vmax > 0.0f && vmax < 0x1p120f && vmax > 0x1p-120f
                           ? __fmul_rn(__fdiv_rn(2688.0f, vmax), exp2f((float)(int)(h % 4096) * (16.0f / 4096) - 12.0f))
                           : 1.0f;
            float rgs = nvfp4_rgs(gs, flavor);
            u32 pr[2], pf[2];
            float m;
            u32 sr = quant_block_nvfp4_vmax(v, gs, flavor, pr, m);
            bool nzr = m > 0.0f, nzf;
            u32 sf = swiglu_nvfp4_16(g2, u2, limit, pass, gs, rgs, flavor, pf, nzf);
            seen++;
            if (sr != sf || pr[0] != pf[0] || pr[1] != pf[1] || nzr != nzf) {
                bad++;
                atomicMin(first, (u32)i);
            }
        }
    }
    atomicAdd(&counts[0], bad);
    atomicAdd(&counts[1], seen);
}

int main() {
    unsigned long long* d;
    unsigned* f;
    if (cudaMalloc(&d, 32) != cudaSuccess || cudaMalloc(&f, 12) != cudaSuccess) return 2;
    if (cudaMemset(d, 0, 32) != cudaSuccess || cudaMemset(f, 0xFF, 8) != cudaSuccess ||
        cudaMemset(f + 2, 0, 4) != cudaSuccess)
        return 2;
    bound<<<132 * 16, 256>>>(d, f + 2, f);
    blocks<<<132 * 16, 256>>>(d + 2, f + 1);
    if (cudaGetLastError() != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess) return 2;
    unsigned long long h[4];
    unsigned hf[3];
    if (cudaMemcpy(h, d, 32, cudaMemcpyDeviceToHost) != cudaSuccess ||
        cudaMemcpy(hf, f, 12, cudaMemcpyDeviceToHost) != cudaSuccess)
        return 2;
    float worst;
    memcpy(&worst, &hf[2], 4);
    printf("mismatches %llu of %llu (gates past the 2^-17 bound: %llu of %llu, largest error 2^%.2f; blocks "
           "that differ: %llu of %llu)",
           h[0] + h[2], h[1] + h[3], h[0], h[1], log2((double)worst), h[2], h[3]);
    if (h[0]) printf(" (first gate past the bound at bits %08x)", hf[0]);
    if (h[2]) printf(" (first block that differs at bits %08x)", hf[1]);
    printf("\n");
    return h[0] + h[2] != 0;
}
