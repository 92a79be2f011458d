/* nvfp4dbg_moe.h — the "bring your own kernel" ABI of nvfp4dbg (ABI version 1).
 *
 * A plugin is a shared library exporting `nvfp4dbg_moe_abi_version` and `nvfp4dbg_moe_forward`
 * (plus any of the optional queries below). `nvfp4dbg layertest --kernel PATH.so` loads it, lays
 * one MoE layer's inputs out on the GPU exactly as described here, poisons the output with NaN,
 * calls `nvfp4dbg_moe_forward` on its own stream and compares what the plugin wrote with the BF16
 * reference and with nvfp4dbg's built-in kernels.
 *
 * What the plugin computes: the ROUTED experts' weighted sum of one DeepSeek MoE layer, what an
 * engine's fused MoE kernel computes (vLLM `cutlass_moe_fp4`, FlashInfer `cutlass_fused_moe`):
 *
 *   out[t] = sum over slots k with topk_ids[t,k] on this rank of
 *            topk_weights[t,k] * W2_e · q2( silu(clamp(W1_e · q1(x_t))) * clamp(W3_e · q1(x_t)) )
 *
 * with q1 / q2 the NVFP4 quantization of the activations under the quant-direction global
 * scales a1_gscale[e] / a2_gscale[e] (docs/moe-forward.md pins every rounding step). The
 * plugin quantizes the activations itself. Shared experts, the router and the residual are
 * NOT the plugin's business: nvfp4dbg adds the shared experts' output (BF16, identical in
 * every path) to the plugin's output before comparing whole layers, and compares routed-only
 * outputs when judging the plugin against its own kernels.
 *
 * Ownership: nvfp4dbg allocates and frees every buffer; all pointers are device pointers valid
 * for the duration of the call (and until the stream reaches the end of the plugin's work).
 * The plugin must not free, keep or write any input; it writes `output` (every element) and
 * may use `workspace` as scratch. It must enqueue its work on `stream` and return without
 * requiring a synchronization (nvfp4dbg synchronizes, with a deadline). It may allocate
 * nothing on the device beyond the workspace (use `nvfp4dbg_moe_workspace_size`).
 *
 * Numbers: E2M1 codes, two per byte, element 2i in the LOW nibble; E4M3 (float8_e4m3fn)
 * block scales, one per 16 elements along K (the last dim); weight_scale_2 in the dequant
 * direction (w = e2m1 * e4m3 * weight_scale_2); activation global scales in the quant
 * direction (gs = 1 / input_scale, vLLM's a1_gscale).
 *
 * Return: 0 on success, any other value is an error (nvfp4dbg exits 2 naming the plugin and
 * the code; `nvfp4dbg_moe_last_error`, if exported, explains it).
 */
#ifndef NVFP4DBG_MOE_H
#define NVFP4DBG_MOE_H

#ifdef __CUDACC_RTC__ /* NVRTC has no libc headers: CPU CI compile-checks device code with it */
#include <cuda/std/cstdint>
using cuda::std::int32_t;
using cuda::std::int64_t;
using cuda::std::uint16_t;
using cuda::std::uint32_t;
using cuda::std::uint64_t;
using cuda::std::uint8_t;
#else
#include <stdint.h>
#endif

/* The stream is a cudaStream_t (the same handle as a driver-API CUstream). Without the CUDA
 * runtime headers (a plain C compiler) it is an opaque pointer of the same size. */
#if (defined(__CUDACC__) || defined(__CUDA_RUNTIME_API_H__)) && !defined(__CUDACC_RTC__)
#include <cuda_runtime_api.h>
typedef cudaStream_t nvfp4dbg_stream_t;
#else
typedef void *nvfp4dbg_stream_t;
#endif

#ifdef __cplusplus
extern "C" {
#endif

#define NVFP4DBG_MOE_ABI_VERSION 1

/* Layout of the E4M3 block scales of every weight matrix. */
typedef enum nvfp4dbg_scale_layout {
    /* [rows, cols/16] row-major, as checkpoints hold them. */
    NVFP4DBG_SCALES_LINEAR = 0,
    /* CUTLASS / FlashInfer 128x4 swizzle: rows padded to 128, cols/16 padded to 4 (padding 0);
     * scale (m, k) at (m/128 * kTiles + k/4) * 512 + (m%32)*16 + ((m/32)%4)*4 + k%4,
     * kTiles = ceil(cols/16 / 4). One matrix is pad128(rows) * pad4(cols/16) bytes. */
    NVFP4DBG_SCALES_SWIZZLED_128x4 = 1
} nvfp4dbg_scale_layout;

/* What the ids in `topk_ids` are. */
typedef enum nvfp4dbg_id_convention {
    /* Global expert ids in [0, num_experts); the plugin applies expert_map to find the local
     * expert (-1: another rank's expert, contributes 0). */
    NVFP4DBG_IDS_GLOBAL = 0,
    /* Local expert ids in [0, num_local_experts), -1 for slots of other ranks' experts:
     * expert_map has already been applied by nvfp4dbg (as by an engine's EP dispatch). */
    NVFP4DBG_IDS_LOCAL = 1
} nvfp4dbg_id_convention;

/* Output element type. */
typedef enum nvfp4dbg_dtype {
    NVFP4DBG_F32 = 0,
    NVFP4DBG_BF16 = 1
} nvfp4dbg_dtype;

typedef struct nvfp4dbg_moe_args {
    /* == NVFP4DBG_MOE_ABI_VERSION of the caller; == sizeof(nvfp4dbg_moe_args). */
    uint32_t abi_version;
    uint32_t struct_size;

    /* Dims. T tokens, H hidden, I intermediate (per expert), E global experts, L local experts
     * (the experts of this EP rank; L == E without expert parallelism), K slots per token.
     * H and I are multiples of 16. */
    int64_t tokens;            /* T */
    int64_t hidden;            /* H */
    int64_t intermediate;      /* I */
    int64_t num_experts;       /* E */
    int64_t num_local_experts; /* L */
    int64_t top_k;             /* K */

    /* SwiGLU clamp (DeepSeek V4), on the dequantized gate/up outputs (after alpha):
     * gate = min(gate, swiglu_limit), up = clamp(up, -swiglu_limit, swiglu_limit) when
     * has_swiglu_limit != 0; then act = gate / (1 + exp(-gate)) * up in f32. */
    float swiglu_limit;
    int32_t has_swiglu_limit;

    /* BF16 [T, H] row-major: the MoE block input. */
    const uint16_t *hidden_states;

    /* F32 [L]: quant-direction activation global scales per local expert. a1 quantizes the
     * gate/up input, a2 the down input (the SwiGLU output). */
    const float *a1_gscale;
    const float *a2_gscale;

    /* Packed E2M1, per local expert, contiguous: w1 (gate_proj) and w3 (up_proj) [L, I, H/2],
     * w2 (down_proj) [L, H, I/2]. Row-major [out, in/2]. */
    const uint8_t *w1;
    const uint8_t *w3;
    const uint8_t *w2;

    /* E4M3 block scales per local expert, in `scale_layout`:
     *   linear:   w1/w3 [L, I, H/16], w2 [L, H, I/16];
     *   swizzled: w1/w3 [L, pad128(I) * pad4(H/16)], w2 [L, pad128(H) * pad4(I/16)] bytes,
     *             each expert's matrix swizzled on its own. */
    const uint8_t *w1_scale;
    const uint8_t *w3_scale;
    const uint8_t *w2_scale;
    int32_t scale_layout; /* nvfp4dbg_scale_layout: what `nvfp4dbg_moe_scale_layout()` asked for */

    /* Output element type (nvfp4dbg_dtype): what `nvfp4dbg_moe_output_dtype()` asked for. */
    int32_t output_dtype;

    /* F32 [L]: weight_scale_2 (dequant direction) per local expert and matrix. */
    const float *w1_scale_2;
    const float *w3_scale_2;
    const float *w2_scale_2;

    /* I32 / F32 [T, K] row-major, slot order = the router's (descending score); weights
     * already normalized and scaled (routed_scaling_factor). Ids in `id_convention`. */
    const int32_t *topk_ids;
    const float *topk_weights;
    /* I32 [E]: expert_map[global] = local id on this rank, or -1. */
    const int32_t *expert_map;
    int32_t id_convention; /* nvfp4dbg_id_convention: what `nvfp4dbg_moe_id_convention()` asked for */

    /* Expert parallelism: this call is rank ep_rank of ep_size (0 of 1 without EP). */
    int32_t ep_rank;
    int32_t ep_size;
    int32_t reserved0;

    /* [T, H] row-major in output_dtype: overwritten (not accumulated). nvfp4dbg fills it with
     * NaN before the call, so an element the plugin does not write shows up. Slots of other
     * ranks contribute 0. */
    void *output;

    /* Scratch of workspace_bytes (>= nvfp4dbg_moe_workspace_size(args)), 256-byte aligned,
     * contents undefined on entry. NULL when 0 bytes were asked for. */
    void *workspace;
    uint64_t workspace_bytes;
} nvfp4dbg_moe_args;

/* ---- required ---- */

/* NVFP4DBG_MOE_ABI_VERSION the plugin was built against; nvfp4dbg refuses any other. */
uint32_t nvfp4dbg_moe_abi_version(void);

/* Enqueue the routed MoE forward on `stream` (a cudaStream_t / CUstream). 0 = success. */
int nvfp4dbg_moe_forward(const nvfp4dbg_moe_args *args, nvfp4dbg_stream_t stream);

/* ---- optional (defaults in brackets) ---- */

/* A human-readable name for reports ["the file name"]. */
const char *nvfp4dbg_moe_name(void);
/* The block-scale layout the plugin reads [NVFP4DBG_SCALES_LINEAR]. */
int32_t nvfp4dbg_moe_scale_layout(void);
/* The id convention the plugin takes [NVFP4DBG_IDS_GLOBAL]. */
int32_t nvfp4dbg_moe_id_convention(void);
/* The output element type the plugin writes [NVFP4DBG_F32]. */
int32_t nvfp4dbg_moe_output_dtype(void);
/* Workspace bytes for these args (all pointers NULL, dims and enums set) [0]. */
uint64_t nvfp4dbg_moe_workspace_size(const nvfp4dbg_moe_args *args);
/* A message about the last non-zero return [none]. */
const char *nvfp4dbg_moe_last_error(void);

#ifdef __cplusplus
}
#endif

#endif /* NVFP4DBG_MOE_H */
