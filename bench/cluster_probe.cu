// What 2-CTA clusters cost the register-A GEMMs' schedule on this GPU, apart from the kernels:
// how many clusters of one-CTA-an-SM blocks fit at once (cudaOccupancyMaxActiveClusters), and
// how long a grid of the down GEMM's shape (28 x 349 CTAs, 256 threads, the register-A kernels'
// 167 472 bytes of shared memory, so one CTA an SM) takes when each CTA only spins for a fixed
// number of cycles, launched as single CTAs and as clusters of 2. Session 32 (BENCHMARKS.md).
// Build: nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -o cluster_probe bench/cluster_probe.cu
#include <cstdio>
#include <cuda_runtime.h>

#define CHECK(x)                                                                  \
    do {                                                                          \
        cudaError_t e_ = (x);                                                     \
        if (e_ != cudaSuccess) {                                                  \
            printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
            return 1;                                                             \
        }                                                                         \
    } while (0)

__global__ void spin(long long cycles, int* sink) {
    extern __shared__ int smem[];
    long long t0 = clock64();
    while (clock64() - t0 < cycles) {
    }
    if (threadIdx.x == 0 && smem[0] == 12345) sink[0] = 1;  // keeps the shared memory in use
}

int main() {
    const int smem = 167472, threads = 256;
    const dim3 grid(28, 349);
    CHECK(cudaFuncSetAttribute(spin, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    CHECK(cudaFuncSetAttribute(spin, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    int sms = 0;
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    int* sink;
    CHECK(cudaMalloc(&sink, 4));
    cudaEvent_t a, b;
    CHECK(cudaEventCreate(&a));
    CHECK(cudaEventCreate(&b));
    for (int cluster = 1; cluster <= 2; cluster++) {
        cudaLaunchConfig_t cfg = {};
        cudaLaunchAttribute attr[1];
        attr[0].id = cudaLaunchAttributeClusterDimension;
        attr[0].val.clusterDim.x = cluster;
        attr[0].val.clusterDim.y = 1;
        attr[0].val.clusterDim.z = 1;
        cfg.gridDim = grid;
        cfg.blockDim = dim3(threads);
        cfg.dynamicSmemBytes = smem;
        cfg.attrs = attr;
        cfg.numAttrs = 1;
        int active = 0;
        CHECK(cudaOccupancyMaxActiveClusters(&active, spin, &cfg));
        printf("cluster %d: %d SMs, at most %d clusters active (%d CTAs)\n", cluster, sms, active, active * cluster);
        for (long long cycles : {10000LL, 50000LL}) {
            float best = 1e30f;
            for (int rep = 0; rep < 5; rep++) {
                CHECK(cudaEventRecord(a));
                CHECK(cudaLaunchKernelEx(&cfg, spin, cycles, sink));
                CHECK(cudaEventRecord(b));
                CHECK(cudaEventSynchronize(b));
                float ms;
                CHECK(cudaEventElapsedTime(&ms, a, b));
                if (ms < best) best = ms;
            }
            int ctas = grid.x * grid.y, waves = (ctas + sms - 1) / sms;
            printf("  spin %lld cycles a CTA: %.4f ms over %d waves of %d SMs (%.3f us a wave)\n", cycles, best, waves,
                   sms, 1000.0 * best / waves);
        }
    }
    return 0;
}
