// The host side of the exhaustive GPU checks in this folder (tests/gpu_checks.rs builds and
// runs them): `check` walks all 2^32 f32 bit patterns with a grid-stride loop, adds its
// mismatches to counts[0] and its second count to counts[1], and keeps the smallest
// mismatching bit pattern in *first.
#include <cstdio>

typedef void (*ExhaustiveCheck)(unsigned long long* counts, unsigned* first);

// Runs `check` and prints `format` with the two counts ("mismatches %llu of ..."), then the
// first mismatch if any. Returns the process's exit code: 0 clean, 1 a mismatch, 2 a CUDA
// call failed.
inline int run_exhaustive(ExhaustiveCheck check, const char* format) {
    unsigned long long* d;
    unsigned* f;
    if (cudaMalloc(&d, 16) != cudaSuccess || cudaMalloc(&f, 4) != cudaSuccess) return 2;
    if (cudaMemset(d, 0, 16) != cudaSuccess || cudaMemset(f, 0xFF, 4) != cudaSuccess) return 2;
    check<<<132 * 16, 256>>>(d, f);
    if (cudaGetLastError() != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess) return 2;
    unsigned long long h[2];
    unsigned first;
    if (cudaMemcpy(h, d, 16, cudaMemcpyDeviceToHost) != cudaSuccess ||
        cudaMemcpy(&first, f, 4, cudaMemcpyDeviceToHost) != cudaSuccess)
        return 2;
    printf(format, h[0], h[1]);
    if (h[0]) printf(" (first at bits %08x)", first);
    printf("\n");
    return h[0] != 0;
}
