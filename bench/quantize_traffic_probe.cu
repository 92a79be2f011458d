// What bounds the NVFP4 quantize figure (issue 10's target: 0.9 of copy_d2d)? Kernels with the
// quantizer's memory traffic and none of its arithmetic, in several shapes, beside the
// driver's copy of the same bytes and copy_d2d's 2 GiB copy, timed in one process.
//
//   nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -o /tmp/probe bench/quantize_traffic_probe.cu
//   /tmp/probe
//
// The quantize figure moves 8192 x 7168 BF16 in (117.4 MB) and codes (29.4 MB) + E4M3 scales
// (3.7 MB) out: 150.6 MB. Each kernel below reads every input byte once and writes every output
// byte once (values derived from the inputs, so no load can be dropped); only the grid shape
// and the bytes in flight per thread differ. If none reaches 0.9 of copy_d2d, neither can a
// quantizer with the same traffic.
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>

#define CK(x)                                                                                   \
    do {                                                                                        \
        cudaError_t e_ = (x);                                                                   \
        if (e_ != cudaSuccess) {                                                                \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
            exit(2);                                                                            \
        }                                                                                       \
    } while (0)

typedef unsigned long long u64;
typedef unsigned int u32;

__device__ __forceinline__ uint4 x4(uint4 a, uint4 b) { return make_uint4(a.x ^ b.x, a.y ^ b.y, a.z ^ b.z, a.w ^ b.w); }

// one group (4 blocks of 16 BF16: 128 bytes in; 32 bytes of codes and 4 of scales out)
__device__ __forceinline__ void group_out(const uint4 (&v)[8], u64 g, uint4* codes, u32* scales) {
    uint4 a = x4(v[0], v[1]), b = x4(v[2], v[3]), c = x4(v[4], v[5]), d = x4(v[6], v[7]);
    codes[2 * g] = a;
    codes[2 * g + 1] = c;
    scales[g] = b.x ^ b.y ^ b.z ^ b.w ^ d.x ^ d.y ^ d.z ^ d.w;
}

// U groups per thread, CTA-strided (group (blockIdx.x * U + j) * 256 + threadIdx.x), all loads
// issued before any store
template <int U>
__global__ void __launch_bounds__(256) grid_u(const uint4* __restrict__ x, u64 groups, uint4* __restrict__ codes,
                                              u32* __restrict__ scales) {
    uint4 v[U][8];
#pragma unroll
    for (int j = 0; j < U; j++) {
        u64 g = ((u64)blockIdx.x * U + j) * 256 + threadIdx.x;
        if (g < groups)
#pragma unroll
            for (int i = 0; i < 8; i++) v[j][i] = __ldcs(x + 8 * g + i);
    }
#pragma unroll
    for (int j = 0; j < U; j++) {
        u64 g = ((u64)blockIdx.x * U + j) * 256 + threadIdx.x;
        if (g < groups) group_out(v[j], g, codes, scales);
    }
}

// grid-stride over U-group steps with a persistent grid, the next step's loads issued before
// this step's stores
template <int U>
__global__ void __launch_bounds__(256) stride_u(const uint4* __restrict__ x, u64 groups, uint4* __restrict__ codes,
                                                u32* __restrict__ scales) {
    const u64 T = (u64)gridDim.x * 256;
    u64 base = (u64)blockIdx.x * 256 + threadIdx.x;
    uint4 v[U][8];
    auto load = [&](u64 b) {
#pragma unroll
        for (int j = 0; j < U; j++) {
            u64 g = b + j * T;
            if (g < groups)
#pragma unroll
                for (int i = 0; i < 8; i++) v[j][i] = __ldcs(x + 8 * g + i);
        }
    };
    load(base);
    for (; base < groups; base += U * T) {
        uint4 w[U][8];
#pragma unroll
        for (int j = 0; j < U; j++)
#pragma unroll
            for (int i = 0; i < 8; i++) w[j][i] = v[j][i];
        load(base + U * T);
#pragma unroll
        for (int j = 0; j < U; j++) {
            u64 g = base + j * T;
            if (g < groups) group_out(w[j], g, codes, scales);
        }
    }
}

// coalesced: a warp takes 32 consecutive groups (4 KB in), load i of lane l at 16 (32 i + l)
// bytes (512 contiguous bytes per load instruction); codes out as two 512-byte stores, scales
// as one 128-byte store. groups is a multiple of 32.
__global__ void __launch_bounds__(256) coal(const uint4* __restrict__ x, u64 groups, uint4* __restrict__ codes,
                                            u32* __restrict__ scales) {
    const u64 g0 = ((u64)blockIdx.x * 256 + threadIdx.x) / 32 * 32;
    const u32 lane = threadIdx.x % 32;
    if (g0 >= groups) return;
    uint4 v[8];
#pragma unroll
    for (int i = 0; i < 8; i++) v[i] = x[8 * g0 + 32 * i + lane];
    uint4 a = x4(v[0], v[1]), b = x4(v[2], v[3]), c = x4(v[4], v[5]), d = x4(v[6], v[7]);
    codes[2 * g0 + lane] = a;
    codes[2 * g0 + 32 + lane] = c;
    scales[g0 + lane] = b.x ^ b.y ^ b.z ^ b.w ^ d.x ^ d.y ^ d.z ^ d.w;
}
__global__ void __launch_bounds__(256) coal_read_only(const uint4* __restrict__ x, u64 groups, u32* __restrict__ sink) {
    const u64 g0 = ((u64)blockIdx.x * 256 + threadIdx.x) / 32 * 32;
    const u32 lane = threadIdx.x % 32;
    if (g0 >= groups) return;
    uint4 v[8];
#pragma unroll
    for (int i = 0; i < 8; i++) v[i] = x[8 * g0 + 32 * i + lane];
    uint4 a = x4(x4(v[0], v[1]), x4(x4(v[2], v[3]), x4(x4(v[4], v[5]), x4(v[6], v[7]))));
    u32 r = a.x ^ a.y ^ a.z ^ a.w;
    if (r == 0x12345678u) sink[lane] = r;  // (almost) never: keeps the loads
}

// the same traffic split by kind: reads only (one word per thread out), writes only
__global__ void __launch_bounds__(256) read_only(const uint4* __restrict__ x, u64 groups, u32* __restrict__ sink) {
    u64 g = (u64)blockIdx.x * 256 + threadIdx.x;
    if (g >= groups) return;
    uint4 v[8];
#pragma unroll
    for (int i = 0; i < 8; i++) v[i] = __ldcs(x + 8 * g + i);
    uint4 a = x4(x4(v[0], v[1]), x4(x4(v[2], v[3]), x4(x4(v[4], v[5]), x4(v[6], v[7]))));
    u32 r = a.x ^ a.y ^ a.z ^ a.w;
    if (r == 0x12345678u) sink[g & 1023] = r;  // (almost) never: keeps the loads
}
__global__ void __launch_bounds__(256) write_only(u64 groups, uint4* __restrict__ codes, u32* __restrict__ scales) {
    u64 g = (u64)blockIdx.x * 256 + threadIdx.x;
    if (g >= groups) return;
    uint4 a = make_uint4((u32)g, (u32)(g >> 32), 1, 2);
    codes[2 * g] = a;
    codes[2 * g + 1] = a;
    scales[g] = (u32)g;
}
// a plain copy kernel (16 bytes per thread, one per thread)
__global__ void __launch_bounds__(256) copy_k(const uint4* __restrict__ x, u64 n16, uint4* __restrict__ y) {
    u64 i = (u64)blockIdx.x * 256 + threadIdx.x;
    if (i < n16) y[i] = __ldcs(x + i);
}

__global__ void fill(u32* p, u64 n, u32 seed) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        u32 z = (u32)(i * 2654435761u) ^ seed;
        z ^= z >> 15;
        z *= 0x2c1b3c6du;
        z ^= z >> 12;
        p[i] = (z & 0x3FFF3FFFu) | 0x3C003C00u;  // finite BF16 pairs
    }
}

// Like `nvfp4dbg bench` (src/bench/timer.rs): warm-up, then every repeat enqueued between its
// own pair of events without waiting, so the host runs ahead and no launch gap is timed.
template <typename F> float median_ms(F body, int reps = 40) {
    for (int i = 0; i < 3; i++) body(i);
    CK(cudaDeviceSynchronize());
    std::vector<cudaEvent_t> a(reps), b(reps);
    for (int i = 0; i < reps; i++) {
        CK(cudaEventCreate(&a[i]));
        CK(cudaEventCreate(&b[i]));
    }
    for (int i = 0; i < reps; i++) {
        CK(cudaEventRecord(a[i]));
        body(i);
        CK(cudaEventRecord(b[i]));
    }
    CK(cudaDeviceSynchronize());
    CK(cudaGetLastError());
    std::vector<float> t;
    for (int i = 0; i < reps; i++) {
        float ms;
        CK(cudaEventElapsedTime(&ms, a[i], b[i]));
        t.push_back(ms);
        CK(cudaEventDestroy(a[i]));
        CK(cudaEventDestroy(b[i]));
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}

int main() {
    const u64 rows = 8192, cols = 7168, n = rows * cols, groups = n / 64;
    const double bytes = n * 2.0 + n / 2.0 + n / 16.0;
    int sms;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    uint4 *x[2], *codes;
    u32 *scales, *sink;
    for (int s = 0; s < 2; s++) {
        CK(cudaMalloc(&x[s], n * 2));
        fill<<<4096, 256>>>((u32*)x[s], n / 2, 77u + s);
    }
    CK(cudaMalloc(&codes, n / 2));
    CK(cudaMalloc(&scales, n / 16));
    CK(cudaMalloc(&sink, 4096 * 4));
    const size_t big = 2ull << 30;
    void *bs, *bd;
    CK(cudaMalloc(&bs, big));
    CK(cudaMalloc(&bd, big));
    fill<<<4096, 256>>>((u32*)bs, big / 4, 5u);
    CK(cudaDeviceSynchronize());

    float copy_big = median_ms([&](int) { CK(cudaMemcpyAsync(bd, bs, big, cudaMemcpyDeviceToDevice)); }, 20);
    const double copy_gbps = 2.0 * big / copy_big / 1e6;
    printf("copy_d2d 2 GiB: %.4f ms, %.0f GB/s (the figure's copy bandwidth)\n", copy_big, copy_gbps);
    auto report = [&](const char* what, float ms, double b) {
        printf("%-46s %.4f ms %6.0f GB/s  %.3f of copy_d2d\n", what, ms, b / ms / 1e6, b / ms / 1e6 / copy_gbps);
    };
    report("driver copy of the quantizer's 150.6 MB", median_ms([&](int i) {
               CK(cudaMemcpyAsync(x[(i + 1) % 2], x[i % 2], (size_t)(bytes / 2), cudaMemcpyDeviceToDevice));
           }),
           bytes);
    const u64 n16 = (u64)(bytes / 2) / 16;
    report("copy kernel, 16 B per thread, same bytes", median_ms([&](int i) {
               copy_k<<<(n16 + 255) / 256, 256>>>(x[i % 2], n16, x[(i + 1) % 2]);
           }),
           bytes);
    report("traffic, 1 group per thread (bench's)", median_ms([&](int i) {
               grid_u<1><<<(groups + 255) / 256, 256>>>(x[i % 2], groups, codes, scales);
           }),
           bytes);
    report("traffic, 2 groups per thread", median_ms([&](int i) {
               grid_u<2><<<(groups + 511) / 512, 256>>>(x[i % 2], groups, codes, scales);
           }),
           bytes);
    report("traffic, 4 groups per thread", median_ms([&](int i) {
               grid_u<4><<<(groups + 1023) / 1024, 256>>>(x[i % 2], groups, codes, scales);
           }),
           bytes);
    for (int per_sm : {4, 8, 16}) {
        char name[96];
        snprintf(name, sizeof name, "traffic, grid-stride 1 group, %d CTAs/SM", per_sm);
        report(name, median_ms([&](int i) { stride_u<1><<<sms * per_sm, 256>>>(x[i % 2], groups, codes, scales); }),
               bytes);
        snprintf(name, sizeof name, "traffic, grid-stride 2 groups, %d CTAs/SM", per_sm);
        report(name, median_ms([&](int i) { stride_u<2><<<sms * per_sm, 256>>>(x[i % 2], groups, codes, scales); }),
               bytes);
    }
    report("traffic, coalesced (a warp's 4 KB, 512 B a load)", median_ms([&](int i) {
               coal<<<(groups + 255) / 256, 256>>>(x[i % 2], groups, codes, scales);
           }),
           bytes);
    report("reads only, coalesced (117.4 MB)", median_ms([&](int i) {
               coal_read_only<<<(groups + 255) / 256, 256>>>(x[i % 2], groups, sink);
           }),
           n * 2.0);
    report("reads only (117.4 MB)", median_ms([&](int i) {
               read_only<<<(groups + 255) / 256, 256>>>(x[i % 2], groups, sink);
           }),
           n * 2.0);
    report("writes only (33.0 MB)", median_ms([&](int) { write_only<<<(groups + 255) / 256, 256>>>(groups, codes, scales); }),
           n / 2.0 + n / 16.0);
    float empty = median_ms([&](int) { write_only<<<1, 32>>>(0, codes, scales); });
    printf("empty kernel between events: %.4f ms\n", empty);
    CK(cudaDeviceSynchronize());
    return 0;
}
