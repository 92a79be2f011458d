// A correct, deliberately simple NVFP4 MoE plugin for `nvfp4dbg --kernel`, written only against
// kernels/include/nvfp4dbg_moe.h (no nvfp4dbg code): activations quantized to NVFP4 as
// docs/moe-forward.md pins it (vLLM's ref_nvfp4_quant, IEEE f32 steps), dequantized products
// summed in FP32, alpha in the epilogue. One thread per output element; speed is not the point.
//
// Build (see README.md):
//   nvcc -O3 -arch=sm_90a -shared -Xcompiler -fPIC -I kernels/include \
//        kernels/examples/moe_reference_plugin.cu -o moe_reference_plugin.so
//
// The same source builds the buggy twins the nightly must catch, with -DNVFP4DBG_BUG=N:
//   1  local ids read as global: asks for local ids (as an EP engine hands them) and applies
//      expert_map to them again (shows under --ep 2 or more: tokens silently dropped)
//   2  gate/up reversed: w3 taken as gate_proj and w1 as up_proj (a fused w13 read w31)
//   3  scales read linear when swizzled: asks for 128x4 swizzled scales, reads them as linear
//   4  crash: writes far outside the output (illegal address, a sticky CUDA error)
//   5  error: returns 7 without launching anything
// and -DNVFP4DBG_OUT_BF16 makes it write a BF16 output (as engines do) instead of F32.
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#ifndef __CUDACC_RTC__  // NVRTC (the CPU CI's compile check) sees the device code only
#include <cuda_runtime.h>
#include <stdint.h>
#endif

#include "nvfp4dbg_moe.h"

#ifndef NVFP4DBG_BUG
#define NVFP4DBG_BUG 0
#endif
#define BUG_LOCAL_AS_GLOBAL 1
#define BUG_GATE_UP_SWAPPED 2
#define BUG_SCALES_LINEAR 3
#define BUG_CRASH 4
#define BUG_ERROR 5

namespace {

__device__ float e2m1_value(uint32_t code) {
    const float mag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    float v = mag[code & 7];
    return (code & 8) ? -v : v;
}

// Round half to even onto {0, 0.5, 1, 1.5, 2, 3, 4, 6}; the sign of x survives a zero.
__device__ float e2m1_round(float x) {
    float a = fabsf(x), r;
    if (a <= 0.25f) r = 0.0f;
    else if (a < 0.75f) r = 0.5f;
    else if (a <= 1.25f) r = 1.0f;
    else if (a < 1.75f) r = 1.5f;
    else if (a <= 2.5f) r = 2.0f;
    else if (a < 3.5f) r = 3.0f;
    else if (a <= 5.0f) r = 4.0f;
    else r = 6.0f;
    return copysignf(r, x);
}

__device__ float e4m3_value(uint8_t code) {
    __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)code, __NV_E4M3);
    return __half2float(__half(h));
}

__device__ float rcp(float v) { return v == 0.0f ? 0.0f : __fdiv_rn(1.0f, v); }

__device__ float bf16_value(uint16_t bits) { return __uint_as_float((uint32_t)bits << 16); }

// Offset of block scale (m, k) of a [rows, kb] matrix in the 128x4 swizzle.
__device__ int64_t swizzle_offset(int64_t m, int64_t k, int64_t kb) {
    int64_t k_tiles = (kb + 3) / 4;
    return (m / 128 * k_tiles + k / 4) * 512 + (m % 32) * 16 + ((m / 32) % 4) * 4 + k % 4;
}

struct Mat {
    const uint8_t* codes;   // [L, rows, cols/2]
    const uint8_t* scales;  // [L, ...] in `layout`
    const float* scale_2;   // [L]
    int64_t rows, cols;
};

// e2m1 * e4m3 of weight element (expert, n, k), without weight_scale_2 (it goes into alpha).
__device__ float weight_value(const Mat& w, int layout, int64_t e, int64_t n, int64_t k) {
    uint8_t byte = w.codes[(e * w.rows + n) * (w.cols / 2) + k / 2];
    uint32_t code = (k & 1) ? (byte >> 4) : (byte & 15);
    int64_t kb = w.cols / 16;
    int64_t off;
    if (layout == NVFP4DBG_SCALES_SWIZZLED_128x4) {
        int64_t per = (w.rows + 127) / 128 * 128 * ((kb + 3) / 4 * 4);
        off = e * per + swizzle_offset(n, k / 16, kb);
    } else {
        off = (e * w.rows + n) * kb + k / 16;
    }
    return e2m1_value(code) * e4m3_value(w.scales[off]);
}

// The layout this build reads, whatever it asked for (bug 3 asks swizzled, reads linear).
__device__ int read_layout(int given) {
#if NVFP4DBG_BUG == BUG_SCALES_LINEAR
    (void)given;
    return NVFP4DBG_SCALES_LINEAR;
#else
    return given;
#endif
}

// The local expert of slot s, or -1.
__device__ int local_expert(const nvfp4dbg_moe_args& a, int64_t s) {
    int id = a.topk_ids[s];
    if (id < 0) return -1;
#if NVFP4DBG_BUG == BUG_LOCAL_AS_GLOBAL
    // the bug: the ids are already local, and the map is applied again
    return id < a.num_experts ? a.expert_map[id] : -1;
#else
    if (a.id_convention == NVFP4DBG_IDS_GLOBAL) return id < a.num_experts ? a.expert_map[id] : -1;
    return id < a.num_local_experts ? id : -1;
#endif
}

// NVFP4 quantize-dequantize one row of `cols` (f32 in) with quant-direction gs: out holds
// e2m1 * e4m3 (no global scale). One thread per 16-block.
__device__ void quant_row(const float* x, int64_t cols, float gs, float* out) {
    for (int64_t b = threadIdx.x; b < cols / 16; b += blockDim.x) {
        float vmax = 0.0f;
        for (int i = 0; i < 16; i++) vmax = fmaxf(vmax, fabsf(x[b * 16 + i]));
        float t = fminf(__fmul_rn(gs, __fmul_rn(vmax, 1.0f / 6.0f)), 448.0f);
        float s = e4m3_value((uint8_t)__nv_cvt_float_to_fp8(t, __NV_SATFINITE, __NV_E4M3));
        float out_scale = rcp(__fmul_rn(s, rcp(gs)));
        for (int i = 0; i < 16; i++) {
            float v = fminf(fmaxf(__fmul_rn(x[b * 16 + i], out_scale), -6.0f), 6.0f);
            out[b * 16 + i] = e2m1_round(v) * s;
        }
    }
}

// Workspace: per slot, x (H) | xq (H) | act (I) | aq (I) | y (H) floats.
struct Ws {
    float *x, *xq, *act, *aq, *y;
};
__host__ __device__ Ws carve(void* base, int64_t slots, int64_t h, int64_t i) {
    float* p = (float*)base;
    Ws w;
    w.x = p;
    w.xq = w.x + slots * h;
    w.act = w.xq + slots * h;
    w.aq = w.act + slots * i;
    w.y = w.aq + slots * i;
    return w;
}
__host__ __device__ int64_t ws_bytes(int64_t slots, int64_t h, int64_t i) { return slots * (3 * h + 2 * i) * 4; }

// grid: slots. Quantize the slot's token row with a1_gscale of its expert.
__global__ void quant_input(nvfp4dbg_moe_args a, Ws w) {
    int64_t s = blockIdx.x, h = a.hidden;
    int e = local_expert(a, s);
    if (e < 0) return;
    int64_t t = s / a.top_k;
    for (int64_t k = threadIdx.x; k < h; k += blockDim.x)
        w.x[s * h + k] = bf16_value(a.hidden_states[t * h + k]);
    __syncthreads();
    quant_row(w.x + s * h, h, a.a1_gscale[e], w.xq + s * h);
}

// grid: (slots, ceil(I/128)). act = silu(clamp(gate)) * clamp(up).
__global__ void gate_up(nvfp4dbg_moe_args a, Ws w, Mat w1, Mat w3) {
    int64_t s = blockIdx.x, n = (int64_t)blockIdx.y * blockDim.x + threadIdx.x;
    int e = local_expert(a, s);
    if (e < 0 || n >= a.intermediate) return;
    int layout = read_layout(a.scale_layout);
#if NVFP4DBG_BUG == BUG_GATE_UP_SWAPPED
    Mat gate = w3, up = w1;
#else
    Mat gate = w1, up = w3;
#endif
    const float* xq = w.xq + s * a.hidden;
    float g = 0.0f, u = 0.0f;
    for (int64_t k = 0; k < a.hidden; k++) {
        g += xq[k] * weight_value(gate, layout, e, n, k);
        u += xq[k] * weight_value(up, layout, e, n, k);
    }
    float inv_gs = rcp(a.a1_gscale[e]);
    g *= __fmul_rn(inv_gs, gate.scale_2[e]);
    u *= __fmul_rn(inv_gs, up.scale_2[e]);
    if (a.has_swiglu_limit) {
        g = fminf(g, a.swiglu_limit);
        u = fminf(fmaxf(u, -a.swiglu_limit), a.swiglu_limit);
    }
    w.act[s * a.intermediate + n] = __fmul_rn(__fdiv_rn(g, 1.0f + expf(-g)), u);
}

__global__ void quant_act(nvfp4dbg_moe_args a, Ws w) {
    int64_t s = blockIdx.x;
    int e = local_expert(a, s);
    if (e < 0) return;
    quant_row(w.act + s * a.intermediate, a.intermediate, a.a2_gscale[e],
              w.aq + s * a.intermediate);
}

// grid: (slots, ceil(H/128)).
__global__ void down(nvfp4dbg_moe_args a, Ws w, Mat w2) {
    int64_t s = blockIdx.x, n = (int64_t)blockIdx.y * blockDim.x + threadIdx.x;
    if (n >= a.hidden) return;
    int e = local_expert(a, s);
    float y = 0.0f;
    if (e >= 0) {
        int layout = read_layout(a.scale_layout);
        const float* aq = w.aq + s * a.intermediate;
        for (int64_t k = 0; k < a.intermediate; k++) y += aq[k] * weight_value(w2, layout, e, n, k);
        y *= __fmul_rn(rcp(a.a2_gscale[e]), w2.scale_2[e]);
    }
    w.y[s * a.hidden + n] = y;
}

// grid: (T, ceil(H/128)). out[t] = sum over slots in order of w * y (0 for other ranks').
__global__ void combine(nvfp4dbg_moe_args a, Ws w) {
    int64_t t = blockIdx.x, n = (int64_t)blockIdx.y * blockDim.x + threadIdx.x;
    if (n >= a.hidden) return;
    float acc = 0.0f;
    for (int64_t k = 0; k < a.top_k; k++) {
        int64_t s = t * a.top_k + k;
        if (local_expert(a, s) >= 0) acc += a.topk_weights[s] * w.y[s * a.hidden + n];
    }
#if NVFP4DBG_BUG == BUG_CRASH
    // the bug: an index computed in the wrong units runs ~2^40 bytes past the buffer
    ((float*)a.output)[(t * a.hidden + n) << 38] = acc;
#else
    if (a.output_dtype == NVFP4DBG_BF16)
        ((__nv_bfloat16*)a.output)[t * a.hidden + n] = __float2bfloat16_rn(acc);
    else
        ((float*)a.output)[t * a.hidden + n] = acc;
#endif
}

}  // namespace

#ifndef __CUDACC_RTC__
namespace {
const char* g_last_error = "";
}

extern "C" {

uint32_t nvfp4dbg_moe_abi_version(void) { return NVFP4DBG_MOE_ABI_VERSION; }

const char* nvfp4dbg_moe_name(void) {
    switch (NVFP4DBG_BUG) {
        case BUG_LOCAL_AS_GLOBAL: return "reference plugin, BUG: local ids read as global";
        case BUG_GATE_UP_SWAPPED: return "reference plugin, BUG: gate/up reversed";
        case BUG_SCALES_LINEAR: return "reference plugin, BUG: swizzled scales read linear";
        case BUG_CRASH: return "reference plugin, BUG: illegal address";
        case BUG_ERROR: return "reference plugin, BUG: returns an error";
        default: return "nvfp4dbg reference plugin (simple FP32 kernels)";
    }
}

// Swizzled, as CUTLASS / FlashInfer kernels take them: exercises nvfp4dbg's swizzle path.
int32_t nvfp4dbg_moe_scale_layout(void) { return NVFP4DBG_SCALES_SWIZZLED_128x4; }

int32_t nvfp4dbg_moe_id_convention(void) {
    return NVFP4DBG_BUG == BUG_LOCAL_AS_GLOBAL ? NVFP4DBG_IDS_LOCAL : NVFP4DBG_IDS_GLOBAL;
}

#ifdef NVFP4DBG_OUT_BF16
int32_t nvfp4dbg_moe_output_dtype(void) { return NVFP4DBG_BF16; }
#else
int32_t nvfp4dbg_moe_output_dtype(void) { return NVFP4DBG_F32; }
#endif

uint64_t nvfp4dbg_moe_workspace_size(const nvfp4dbg_moe_args* a) {
    return (uint64_t)ws_bytes(a->tokens * a->top_k, a->hidden, a->intermediate);
}

const char* nvfp4dbg_moe_last_error(void) { return g_last_error; }

int nvfp4dbg_moe_forward(const nvfp4dbg_moe_args* a, nvfp4dbg_stream_t stream) {
    if (NVFP4DBG_BUG == BUG_ERROR) {
        g_last_error = "the buggy twin refuses to run (NVFP4DBG_BUG=5)";
        return 7;
    }
    if (a->abi_version != NVFP4DBG_MOE_ABI_VERSION || a->struct_size != sizeof(nvfp4dbg_moe_args)) {
        g_last_error = "ABI version or struct size mismatch";
        return 1;
    }
    if (a->tokens == 0) return 0;
    int64_t slots = a->tokens * a->top_k;
    if (a->hidden % 16 || a->intermediate % 16 || slots <= 0 ||
        a->workspace_bytes < (uint64_t)ws_bytes(slots, a->hidden, a->intermediate)) {
        g_last_error = "bad dims or workspace too small";
        return 2;
    }
    Ws w = carve(a->workspace, slots, a->hidden, a->intermediate);
    Mat w1{a->w1, a->w1_scale, a->w1_scale_2, a->intermediate, a->hidden};
    Mat w3{a->w3, a->w3_scale, a->w3_scale_2, a->intermediate, a->hidden};
    Mat w2{a->w2, a->w2_scale, a->w2_scale_2, a->hidden, a->intermediate};
    const int th = 128;
    unsigned gi = (unsigned)((a->intermediate + th - 1) / th);
    unsigned gh = (unsigned)((a->hidden + th - 1) / th);
    quant_input<<<(unsigned)slots, th, 0, stream>>>(*a, w);
    gate_up<<<dim3((unsigned)slots, gi), th, 0, stream>>>(*a, w, w1, w3);
    quant_act<<<(unsigned)slots, th, 0, stream>>>(*a, w);
    down<<<dim3((unsigned)slots, gh), th, 0, stream>>>(*a, w, w2);
    combine<<<dim3((unsigned)a->tokens, gh), th, 0, stream>>>(*a, w);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) {
        g_last_error = cudaGetErrorString(e);
        return 3;
    }
    return 0;
}

}  // extern "C"
#endif  // __CUDACC_RTC__
