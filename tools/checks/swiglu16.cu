// Exhaustive GPU check that swiglu16 of kernels/nvfp4dbg_common.cuh (16 SwiGLUs at a time:
// exp's fast path without branches, the declined ones redone afterwards) equals swiglu value
// by value, bit for bit, for every one of the 2^32 f32 bit patterns as the gate, twice: with
// u = 1.25 and no limit, and with u = 3 and swiglu_limit 7 (the gate clamped to <= 7, u to
// [-7, 7]). Also counts the gates whose exp the fast path declined.
//
//   nvcc -gencode=arch=compute_90a,code=sm_90a -O3 --fmad=false -I kernels \
//        -o /tmp/swiglu16_check tools/checks/swiglu16.cu && /tmp/swiglu16_check
//
// Prints "mismatches 0 of N"; exits 1 on any mismatch.
#include "nvfp4dbg_common.cuh"
#include "exhaustive.cuh"

__global__ void check(unsigned long long* counts, unsigned* first) {
    unsigned long long nb = 0, nslow = 0;
    for (unsigned long long i = 16 * ((unsigned long long)blockIdx.x * blockDim.x + threadIdx.x); i < (1ull << 32);
         i += 16ull * gridDim.x * blockDim.x) {
#pragma unroll 1
        for (int pass = 0; pass < 2; pass++) {
            float limit = pass ? 7.0f : 0.0f, u0 = pass ? 3.0f : 1.25f;
            float g[16], u[16], v[16];
#pragma unroll
            for (int k = 0; k < 16; k++) g[k] = __uint_as_float((u32)(i + k)), u[k] = u0;
            swiglu16(g, u, limit, pass, v);
#pragma unroll
            for (int k = 0; k < 16; k++) {
                float x = __uint_as_float((u32)(i + k)), y;
                if (__float_as_uint(v[k]) != __float_as_uint(swiglu(x, u0, limit, pass))) {
                    nb++;
                    atomicMin(first, (u32)(i + k));
                }
                if (pass == 0 && !expf_cr_fast(-x, y)) nslow++;
            }
        }
    }
    atomicAdd(&counts[0], nb);
    atomicAdd(&counts[1], nslow);
}

int main() {
    return run_exhaustive(check, "mismatches %llu of 8589934592 (exp's fast path declined %llu gates)");
}
