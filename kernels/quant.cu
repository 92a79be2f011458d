// Block quantization kernels: NVFP4 (reference and cuda-fast flavors), MXFP4, scale
// swizzling, and the flipped-code count between two quantizations.
#include "nvfp4dbg_common.cuh"

template <typename T> __device__ __forceinline__ void load16(const T* p, float (&x)[16]);
template <> __device__ __forceinline__ void load16<float>(const float* p, float (&x)[16]) {
    const float4* q = reinterpret_cast<const float4*>(p);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        float4 v = q[i];
        x[4 * i] = v.x; x[4 * i + 1] = v.y; x[4 * i + 2] = v.z; x[4 * i + 3] = v.w;
    }
}
template <> __device__ __forceinline__ void load16<u16>(const u16* p, float (&x)[16]) {
    const uint4* q = reinterpret_cast<const uint4*>(p);
#pragma unroll
    for (int i = 0; i < 2; i++) {
        uint4 v = q[i];
        u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int j = 0; j < 4; j++) {
            x[8 * i + 2 * j] = bf16_to_f32((u16)(w[j] & 0xFFFFu));
            x[8 * i + 2 * j + 1] = bf16_to_f32((u16)(w[j] >> 16));
        }
    }
}

// ---- Tuning knobs of the NVFP4 quantizer ----
// Each is an #ifndef constant that NVFP4DBG_NVRTC_DEFINES="-DNAME=V ..." overrides at NVRTC
// compile time, so that one GPU session can compare them (bench/gpu-sweep-quant.sh). The
// defaults are the measured kernel; every setting gives the same codes, scales and statistics.

// 16-blocks of a row per thread: 2, 4 or 8. All their loads are issued before any is
// quantized, so this sets the bytes in flight per thread (BF16: 32 per block). The grid
// depends on it: src/backend/cuda/quant.rs reads the same define.
#ifndef QUANT_BLOCKS
#define QUANT_BLOCKS 4
#endif
static_assert(QUANT_BLOCKS == 2 || QUANT_BLOCKS == 4 || QUANT_BLOCKS == 8, "QUANT_BLOCKS: 2, 4 or 8");

// CTAs per SM the BF16 kernel is compiled for (of QUANT_BF16_THREADS, defined below: the
// default is 28 warps per SM, 72 registers, since session 35). 0: no bound (QUANT_ENCODER 1: 71 registers, 72
// with QUANT_TRANSPOSE, so 3 CTAs of 256 threads per SM; QUANT_ENCODER 0: 54, 4 CTAs). N:
// registers capped at 64K / (256 N) so that N CTAs fit: more warps to cover one warp's load
// latency with other warps' arithmetic. 4 (default since session 10): 64 registers and a
// 24-byte spill of set-up values with QUANT_TRANSPOSE (63, none, without); measured 0.0437 ->
// 0.0422 ms with the warp-wide loads (session 6, per-thread loads: no gain). Since session 11
// (QUANT_FLAT) the kernel takes 64 registers unbounded, without a spill. 5 and more spill
// hundreds of bytes (ptxas; 5: 380 bytes at 48 registers). Session 35 (s35e), once the
// global scale was read before the loads (QUANT_GS_EARLY), re-swept 128-thread CTAs: 8 an SM
// (32 warps, 64 registers) 0.0405 ms, 7 (28 warps, 72 registers, the default since) 0.0400,
// 6 (80 registers) 0.0403; 64-thread CTAs at 16 an SM 0.0405, 256-thread at 4 0.0407.
#ifndef QUANT_MIN_BLOCKS
#define QUANT_MIN_BLOCKS (7 * 128 / QUANT_BF16_THREADS)
#endif

// Block statistics: 0 per CTA (warp sums, a barrier, 4 atomics). 1 (default) no barrier: the
// block count is rows x kb (each block of the tensor is quantized once), added by one thread of
// the grid; the rare classes (saturated, flushed, NaN) by warp sums and atomics in the warps that
// saw one (none on ordinary activations). The same totals either way (+1.5% measured for 1).
#ifndef QUANT_STATS
#define QUANT_STATS 1
#endif

// BF16 block encoder: 1 (default) quant_block_bf16_fast below for every block it takes (normal,
// unsaturated scale codes: ordinary data), the general path for the others; 0 every block
// through the general path (quant_block_nvfp4_core + classify_nvfp4), flavor read at run time.
// Same codes, scales and statistics (tools/checks/quant_block_fast.c). SASS on sm_90a, main
// path of one thread (4 blocks, 64 values; QUANT_STATS 0 -> 1 included): 1311 -> 867
// instructions. Kept for an A/B on a GPU: NVFP4DBG_NVRTC_DEFINES="-DQUANT_ENCODER=0".
#ifndef QUANT_ENCODER
#define QUANT_ENCODER 1
#endif

// Units of work per thread of the BF16 kernel, software-pipelined: 1 (default) one, loaded,
// quantized, stored, then the thread exits. N >= 2: the thread walks N of them (a group of
// QUANT_BLOCKS blocks, or with QUANT_COALESCED its lane's part of a warp's chunk) and issues
// the loads of unit k + 1 before it quantizes unit k, so that they are in flight while it
// computes. The N units of a thread lie blockDim.x units apart inside its CTA's N * blockDim.x
// (CTA-strided, not a contiguous run per thread): at each step the lanes of a warp read what
// they read in the default kernel (32 consecutive groups), where a contiguous run of N groups
// per thread would put adjacent lanes N x 128 B apart. The grid shrinks by N:
// src/backend/cuda/quant.rs reads the same define. BF16 kernel only. sm_90a (ptxas, the
// kernel; the default 71 registers, 3 CTAs of 256 threads per SM): N = 2 and 4 take 128
// registers (two units of raw registers), 2 CTAs per SM, no spill; QUANT_MIN_BLOCKS 3 (80)
// spills 292 / 576 bytes, 4 (64) 424 / 1040. SASS of the ordinary-data path (reference flavor,
// linear scales): 13.8 (N = 2), 13.5 (N = 4) instructions per value, the default 13.9.
// Measured (session 7 sweep, BENCHMARKS.md): N = 2 0.0544 ms, N = 4 0.0582, the default 0.0460.
#ifndef QUANT_PIPE
#define QUANT_PIPE 1
#endif
static_assert(QUANT_PIPE >= 1 && QUANT_PIPE <= 8, "QUANT_PIPE: 1..8");

// With QUANT_PIPE >= 2, where the loads of unit k + 1 go: 0 (default) all of them before unit
// k is quantized, into a second set of raw registers; 1 each 16-block (QUANT_COALESCED: each
// 16-byte load) of unit k + 1 right after the same one of unit k is quantized, into the
// registers that one just freed (a ring: a unit's worth of loads in flight while the thread
// computes, one unit of raw registers). sm_90a: N = 2 96 registers, N = 4 100 (2 CTAs per SM;
// QUANT_MIN_BLOCKS 3 spills); with QUANT_BLOCKS 2, N = 4: 72 (3 CTAs), 16.1 instructions per
// value (more per-group work). Measured: N = 4 0.0563 ms; with QUANT_BLOCKS 2, N = 4 0.0449
// (the default 0.0460: the only variant of session 7's sweep that gained, +2.4%).
#ifndef QUANT_PIPE_RING
#define QUANT_PIPE_RING 0
#endif

// Thread-to-data mapping of the BF16 kernel: 0 (default) each thread loads its own
// QUANT_BLOCKS consecutive blocks (adjacent lanes 32 x QUANT_BLOCKS bytes apart: each 16-byte
// load of a warp uses half of every 32-byte sector it touches). 1: a warp reads a chunk of
// 32 x QUANT_BLOCKS consecutive blocks of the [rows, kb] scale matrix (the padded one with
// swizzled scales) as 2 x QUANT_BLOCKS loads of 512 contiguous bytes (load i of lane t at
// chunk + 512 i + 16 t), so lanes t and t ^ 1 hold the two halves of a block: max|x| by one
// shuffle, both lanes compute the scale, each encodes its 8 values into a word of codes
// (consecutive lanes store consecutive words); scale bytes go out as words, 4 consecutive
// blocks' each (coal_quantize). The chunks run on across rows (the block index is flat), so no
// lane idles at a row's end and a ragged kb needs no other path. Linear scales without gather
// or per-row global scales (what quant.rs launches with linear scales) take a flat path where
// a lane's loads and stores are one address and immediate offsets; the others find row and
// column per block. The same bytes in flight per thread as 0, more work per value (a scale
// per 8 values, a shuffle per load). The grid changes: src/backend/cuda/quant.rs reads the
// same define. BF16 kernel only (the f32 one keeps the per-thread mapping). sm_90a: 72
// registers (set by the swizzled / gather path; the flat one alone 62), 3 CTAs per SM, no
// spill (QUANT_MIN_BLOCKS 4: 64 with an 8-byte spill); 16.9 instructions per value on the
// flat path (default 13.9). With QUANT_BLOCKS 2: 53 registers, 4 CTAs per SM, 19.2. Measured:
// 0.0556 ms, with QUANT_BLOCKS 2 0.0514, with QUANT_PIPE 2 in a ring 0.0729 (the default
// 0.0460): the coalesced sectors do not pay for the extra instructions.
#ifndef QUANT_COALESCED
#define QUANT_COALESCED 0
#endif

// Loads of the BF16 grid kernel's default mapping (one group of QUANT_BLOCKS blocks per
// thread): 0 each thread its own group (16-byte loads, adjacent lanes 32 x QUANT_BLOCKS bytes
// apart); 1 (default, session 10) where a warp's 32 groups are one contiguous run (no gather,
// linear scales, QUANT_BLOCKS dividing the row's blocks, the whole warp in the tensor), the
// warp loads the run with 512 contiguous bytes per load instruction and hands each lane its
// group through shared memory (no bank conflicts either way), then every lane
// encodes as before. Same groups per thread, same codes, scales and statistics.
// bench/quantize_traffic_probe.cu, kernels with this traffic and no arithmetic on an H200:
// 0.0520 ms with per-thread loads, 0.0384 warp-wide (0.92 of copy_d2d). The quantizer
// (session 10, s10d/s10e): 0.0463 -> 0.0437 ms, and 0.0422 with QUANT_MIN_BLOCKS 4. Tried and
// dropped (s10f-s10i): the run brought to shared memory by cp.async (0.0429 ms; 5 or 6 CTAs
// per SM spill: 0.054, 0.062); a separate kernel for whole runs only (64 registers without the
// cap, 0.0439; again with two blocks at a time out of shared memory, 48 registers at 5 CTAs per
// SM, 0.0447); encoding two blocks at a time out of shared memory (0.0449). All of them also
// disagreed with the grid and bulk kernels on block statistics in gpu_quant (BENCHMARKS.md):
// not understood, and none of them is kept. This path declares its array where it uses it.
#ifndef QUANT_TRANSPOSE
#define QUANT_TRANSPOSE 1
#endif
static_assert(QUANT_TRANSPOSE == 0 || (QUANT_TRANSPOSE == 1 && QUANT_BLOCKS <= 4),
              "QUANT_TRANSPOSE: 0, or 1 with QUANT_BLOCKS 2 or 4 (shared memory)");

// Session 11: 1 (default) reads a tensor with linear scales, no gather and one global scale as
// one row (quant_dims_flat): no division per thread to find a group's row, and groups may span
// rows, so warps load warp-wide wherever their 32 groups are whole. With the transposition's
// slots at one base address plus constants (group_load_warp), the thread's set-up before its
// first block went from ~234 to ~90 SASS instructions (of ~890 for its 64 values) and the
// capped kernel's 24-byte spill went away. 0 keeps the row-by-row view, for an A/B.
#ifndef QUANT_FLAT
#define QUANT_FLAT 1
#endif

// Session 35: 1 (default) reads the global scale of a tensor with one (no gs_idx) before the
// group's loads, so its L2 round trip overlaps theirs; 0 reads it after them (group_gs, where
// the encoder first needs it: a second round trip, ~0.3-0.5 us under load, in every warp's
// life on the warp-wide path, where the loads go through shared memory first). Measured
// (s35b, 8192 x 7168): 0.0408 ms against 0.0427.
#ifndef QUANT_GS_EARLY
#define QUANT_GS_EARLY 1
#endif

// Session 35: 1 (default) gives the flat BF16 case (QUANT_FLAT's: linear scales, no gather,
// one global scale) a path of its own (quantize_flat_bf16), compiled for it alone, whose
// warp-wide loads are issued a few instructions into the thread instead of after the general
// path's set-up (dimensions, row division, the gather and layout tests: ~60 instructions).
// Measured (s35c): 0.0404 ms against 0.0408, less than the set-up's share of a warp's life
// predicted. 0: the general path for it too.
#ifndef QUANT_FLAT_PATH
#define QUANT_FLAT_PATH 1
#endif
// (QUANT_ASYNC, session 11, since removed: linear BF16 tensors by warps of a persistent grid
// that copied their next run into shared memory by cp.async while they encoded the current
// one: 0.0477 ms against the grid kernel's 0.0435 (s11b); with the runs handed out by a
// counter, 0.0626 against 0.0426 (s12a). Both bit-exact.)

// Block statistics of a CTA: warp sums, then one integer atomic per CTA and field (atomics
// from every warp on the same four counters serialize in L2 and cost more than the kernel).
#define QUANT_THREADS 256
// The BF16 grid kernel's CTA size (src/backend/cuda/quant.rs reads it from the defines too).
// 128 since session 11: the same 32 warps per SM as 4 CTAs of 256 (QUANT_MIN_BLOCKS 8), but an
// SM takes a new CTA once 4 warps are done instead of 8, so fewer warp slots idle while the
// last warps of a CTA finish. s11b / s11c (8192 x 7168, alternating in one lease each): 0.0426 /
// 0.0425 ms against 0.0435 / 0.0435 for 256 threads; 64 0.0424, 32 0.0426, 512 0.0476. Since
// session 35, 7 such CTAs an SM (QUANT_MIN_BLOCKS).
#ifndef QUANT_BF16_THREADS
#define QUANT_BF16_THREADS 128
#endif
// The flat BF16 path's tail (QUANT_FLAT_PATH): CTAs from `tail0` on (a kernel argument the
// host sets, src/backend/cuda/quant.rs, from its QUANT_TAIL: tail CTAs per SM, 0 none) run
// only their first QUANT_TAIL_WARPS warps' runs, the rest exit at once. What an SM holds
// loaded but not yet encoded when the tensor's last loads land, which it then encodes with
// the memory idle, is that many warps' runs instead of QUANT_BF16_THREADS / 32. Session 36:
// a launch of the quantizer costs ~6.4 us more than its bytes at its marginal rate (1.05-1.06
// of copy_d2d, from 8192 and 4 x 8192 rows), the driver's copy of the same bytes ~4.1 (s36a,
// s36b). The last 7 CTAs an SM (the default QUANT_TAIL, one wave) at 2 warps: 0.0396-0.0400
// ms against 0.0399-0.0403 (s36c, s36d, 8 alternating rounds each); 14 an SM, 5, or 1 warp:
// no better; the first 7 or 14 CTAs an SM at 2 warps as well (QUANT_HEAD, since removed):
// 0.3-0.7 us slower. s36e: 0.0399-0.0403 against 0.0401-0.0404 without the tail; the first 3,
// 7 or 14 CTAs an SM bringing the runs of the CTAs that many on into the L2 (`prefetch.global
// .L2`, a line a lane after the warp's own loads; since removed): 0.0410-0.0459, slower.
#ifndef QUANT_TAIL_WARPS
#define QUANT_TAIL_WARPS 2
#endif
static_assert(QUANT_TAIL_WARPS >= 1 && QUANT_TAIL_WARPS <= QUANT_BF16_THREADS / 32, "QUANT_TAIL_WARPS");
__device__ __forceinline__ void add_stats_cta(u64* stats, const u32 (&c)[4]) {
    __shared__ u32 part[32][4];  // any CTA size up to 1024
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
    for (int f = 0; f < 4; f++) {
        u32 n = __reduce_add_sync(0xFFFFFFFFu, c[f]);
        if (lane == 0) part[warp][f] = n;
    }
    __syncthreads();
    if (threadIdx.x < 4 && stats != nullptr) {
        u64 n = 0;
        for (int w = 0; w < (int)(blockDim.x / 32); w++) n += part[w][threadIdx.x];
        if (n) atomicAdd(&stats[threadIdx.x], n);
    }
}

// QUANT_STATS 1: `blocks` (all of the tensor's) added once by thread 0 of CTA 0, c[1..3] by
// the warps where one is not zero. Every thread of the warp must call it (full-mask votes).
__device__ __forceinline__ void add_stats_rare(u64* stats, const u32 (&c)[4], u64 blocks) {
    if (stats == nullptr) return;
    if (blockIdx.x == 0 && threadIdx.x == 0 && blocks) atomicAdd(&stats[0], blocks);
    if (!__any_sync(0xFFFFFFFFu, (c[1] | c[2] | c[3]) != 0u)) return;
#pragma unroll
    for (int f = 1; f < 4; f++) {
        u32 n = __reduce_add_sync(0xFFFFFFFFu, c[f]);
        if (threadIdx.x % 32 == 0 && n) atomicAdd(&stats[f], (u64)n);
    }
}

// Scale bytes stored as one word: 4 (a whole k-group of the swizzled layout), or 2 with
// QUANT_BLOCKS 2.
#define QUANT_SCALE_WORD (QUANT_BLOCKS < 4 ? QUANT_BLOCKS : 4)
__device__ __forceinline__ void st_scale_word(u8* dst, u32 word) {
#if QUANT_SCALE_WORD == 4
    *reinterpret_cast<u32*>(dst) = word;
#else
    *reinterpret_cast<u16*>(dst) = (u16)word;
#endif
}

// Raw 16-byte loads of one block (BF16: two, F32: four), converted only after every load of
// the thread is in flight.
template <typename T> struct RawBlock;
template <> struct RawBlock<float> { uint4 q[4]; };
template <> struct RawBlock<u16> { uint4 q[2]; };

template <typename T>
__device__ __forceinline__ void load_raw(const T* p, RawBlock<T>& r) {
    const uint4* q = reinterpret_cast<const uint4*>(p);
#pragma unroll
    for (int i = 0; i < (int)(sizeof(r.q) / 16); i++) r.q[i] = q[i];
}

// |x| of both BF16 halves: w & 0x7FFF7FFF, opaque to the compiler, which otherwise folds the
// mask into each shift that takes a low half apart (two instructions a value instead of one).
__device__ __forceinline__ u32 abs2_bf16(u32 w) {
    u32 r;
    asm("and.b32 %0, %1, 0x7FFF7FFF;" : "=r"(r) : "r"(w));
    return r;
}

// The block as floats and max|x| as bits (amax_bits16). BF16: the maximum is taken on the
// 16-bit halves (|x| bit patterns order as unsigned integers, as in f32, NaN above inf), so the
// bits are those amax_bits16 gives on the converted values.
__device__ __forceinline__ u32 unpack_raw(const RawBlock<float>& r, float (&x)[16]) {
#pragma unroll
    for (int i = 0; i < 4; i++) {
        x[4 * i] = __uint_as_float(r.q[i].x);
        x[4 * i + 1] = __uint_as_float(r.q[i].y);
        x[4 * i + 2] = __uint_as_float(r.q[i].z);
        x[4 * i + 3] = __uint_as_float(r.q[i].w);
    }
    return amax_bits16(x);
}
__device__ __forceinline__ u32 amax_raw(const RawBlock<u16>& r) {
    u32 w[8] = {r.q[0].x, r.q[0].y, r.q[0].z, r.q[0].w, r.q[1].x, r.q[1].y, r.q[1].z, r.q[1].w};
    u32 m = abs2_bf16(w[0]);
#pragma unroll
    for (int j = 1; j < 8; j++) asm("max.u16x2 %0, %0, %1;" : "+r"(m) : "r"(abs2_bf16(w[j])));
    return max(m << 16, m & 0xFFFF0000u);
}
__device__ __forceinline__ u32 unpack_raw(const RawBlock<u16>& r, float (&x)[16]) {
#pragma unroll
    for (int i = 0; i < 2; i++) {
        u32 w[4] = {r.q[i].x, r.q[i].y, r.q[i].z, r.q[i].w};
#pragma unroll
        for (int j = 0; j < 4; j++) {
            x[8 * i + 2 * j] = __uint_as_float(w[j] << 16);
            x[8 * i + 2 * j + 1] = __uint_as_float(w[j] & 0xFFFF0000u);
        }
    }
    return amax_raw(r);
}

// ---- QUANT_ENCODER 1: the BF16 block encoder with the fewest instructions ----

// The E4M3 code of t by the hardware conversion (round to nearest even, satfinite), in the low
// byte; the high byte is the code of 0.0 (0), so no mask is needed.
__device__ __forceinline__ u32 e4m3_hw_code(float t) {
    u32 r;
    asm("{ .reg .b16 c;\n cvt.rn.satfinite.e4m3x2.f32 c, %1, %2;\n mov.b32 %0, {c, 0};\n}"
        : "=r"(r)
        : "f"(0.0f), "f"(t));
    return r;
}

// The value of the E4M3 code in the low byte of c (high byte ignored): the hardware conversion
// to f16 (every E4M3 value is exact in f16) and on to f32, two instructions where e4m3_decode
// takes a dozen. NaN codes give a NaN (its payload differs from e4m3_decode's; only the fast
// path's own test reads it).
__device__ __forceinline__ float e4m3_value_hw(u32 c) {
    float s;
    asm("{ .reg .b32 h2; .reg .b16 lo, hi;\n cvt.rn.f16x2.e4m3x2 h2, %1;\n mov.b32 {lo, hi}, h2;\n"
        " cvt.f32.f16 %0, lo;\n}"
        : "=f"(s)
        : "h"((u16)c));
    return s;
}

// 1/v rounded to nearest even (= rcp_ref(v) = __fdiv_rn(1, v)) for v whose exponent field is in
// [1, 252] (rcp_fast_ok): ptxas's own expansion of the IEEE reciprocal (rcp.rn.f32, __frcp_rn)
// in that range, MUFU.RCP and one Newton step (its negation of e is FADD.FTZ: exact, e is 0 or
// far from the subnormals), without the range test and the slow path, which the caller replaces
// by sending the other v down the general path.
__device__ __forceinline__ float rcp_rn_inrange(float v) {
    float r = rcp_approx_ftz(v);
    float e = __fmaf_rn(v, r, -1.0f);
    return __fmaf_rn(r, -e, r);
}
__device__ __forceinline__ bool rcp_fast_ok(float v) {
    return ((__float_as_uint(v) + 0x01800000u) & 0x7F800000u) > 0x01FFFFFFu;
}

// prmt.b32 in its default mode, where a selector nibble with bit 3 set replicates the sign bit
// of the chosen byte over the output byte (__byte_perm ignores that bit).
__device__ __forceinline__ u32 prmt_sign(u32 a, u32 b, u32 sel) {
    u32 d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}

// E2M1 magnitude code of a = |v| for 0 <= a < 7, as the bits of 2^23 + code (0x4B000000 + code).
// The code is RNE(g(a)) with g(a) = min(2a, a + 2, a/2 + 4): g maps the E2M1 grid 0, .5, 1, 1.5,
// 2, 3, 4, 6 onto 0..7 and each rounding boundary (.25, .75, 1.25, 1.75, 2.5, 3.5, 5) onto a
// half-integer, where rounding half to even gives DESIGN.md's ties (<= .25 -> 0, < .75 -> .5,
// ...). g is increasing, so RNE(g) = min of the RNE of the three lines, and each is one IEEE
// operation whose result lies in [2^23, 2^24), where the f32 step is 1: 2^23 + RNE(2a),
// 2^23 + 2 + RNE(a) (RNE(a + 2) = RNE(a) + 2: 2 is even), 2^23 + 4 + RNE(a/2). Positive floats
// order as their bits: the minimum is one 3-input integer min. 3 FMA-pipe + 1 ALU instructions
// where e2m1_mag_bits takes 8 (tools/checks/quant_block_fast.c: every f32 a in [0, 7)).
__device__ __forceinline__ u32 e2m1_code_min3(float a) {
    const float M = 8388608.0f;  // 2^23
    u32 c1 = __float_as_uint(__fmaf_rn(a, 2.0f, M));
    u32 c2 = __float_as_uint(__fadd_rn(a, M + 2.0f));
    u32 c3 = __float_as_uint(__fmaf_rn(a, 0.5f, M + 4.0f));
    return min(min(c1, c2), c3);
}

// Four code pairs (pair j: 2^23 offsets above its low byte, the two nibbles of output byte j)
// as one word.
__device__ __forceinline__ u32 e2m1_pack_pairs(const u32* pair) {
    return __byte_perm(__byte_perm(pair[0], pair[1], 0x0040u), __byte_perm(pair[2], pair[3], 0x0040u), 0x5410u);
}

// The E2M1 codes of the 8 BF16 values in w[0..3] (value 2j in the low half of w[j]) times
// os >= +0, as one word (value i in nibble i), all |x * os| < 7. `wa` holds w & 0x7FFF7FFF.
// Magnitudes: the codes (each 2^23 + code, see e2m1_code_min3) of a pair as hi * 16 + lo,
// whose low byte is the output byte, and three byte permutes gather the four. Signs: the sign
// of x * os is the sign of x (os >= +0); a sign-replicating byte permute gives byte k = 0xFF / 0
// for the sign of value (k of 0, 2, 1, 3) from two words, two more put the even and the odd
// values' bytes apart, and the nibble halves of those bytes carry bit 3 (even values) and bit 7
// (odd values) of each output byte.
__device__ __forceinline__ u32 e2m1_word_bf16(const u32* w, const u32* wa, float os) {
    u32 pair[4];
#pragma unroll
    for (int j = 0; j < 4; j++) {
        u32 lo = e2m1_code_min3(__fmul_rn(__uint_as_float(wa[j] << 16), os));
        u32 hi = e2m1_code_min3(__fmul_rn(__uint_as_float(wa[j] & 0xFFFF0000u), os));
        pair[j] = hi * 16u + lo;  // low byte: the two nibbles (0x4B000000 offsets above it)
    }
    u32 acc = e2m1_pack_pairs(pair);
    u32 ra = prmt_sign(w[0], w[1], 0xFBD9u);  // signs of values 0, 2, 1, 3
    u32 rb = prmt_sign(w[2], w[3], 0xFBD9u);  // 4, 6, 5, 7
    u32 e = __byte_perm(ra, rb, 0x5410u);     // 0, 2, 4, 6
    u32 o = __byte_perm(ra, rb, 0x7632u);     // 1, 3, 5, 7
    u32 sg = (e & 0x0F0F0F0Fu) | (o & 0xF0F0F0F0u);
    return acc | (sg & 0x88888888u);
}

// One BF16 block on the fast path, if it takes it: then the same scale code and codes as
// quant_block_nvfp4_core (and class 0 in classify_nvfp4), else false and nothing written but
// s_code. The scale as nvfp4_block_scale computes it for FLAVOR (decoded by e4m3_value_hw; the
// reference's 1/v by rcp_rn_inrange). Taken: scale codes 0x08..0x7D (normal, not saturated,
// not NaN, so vmax and gs are finite and nonzero, as are s, v and out_scale > 0) with v in the
// reciprocal's range. Then |x * out_scale| <= vmax * out_scale ~ 6 t / s <= 6 (1 + 1/16) (1 +
// a few ulps) < 7 (t = gs vmax / 6 before the E4M3 rounding, off by at most 1/16 of s for a
// normal s): none is NaN, none needs the clamp at 6 (e2m1_code_min3 gives 6 up to 7). Zero
// blocks, flushed, saturated and NaN scales, denormal scales (where t / s reaches 1.5) and
// exotic global scales go the general way. mbits: max|x| as bits (amax_raw).
template <u32 FLAVOR>
__device__ __forceinline__ bool bf16_fast_scale(u32 mbits, float gs, float rgs, u32& s_code, float& out_scale) {
    float vmax = __uint_as_float(mbits);
    float v;
    if (FLAVOR == FLAVOR_CUDA_FAST) {
        s_code = e4m3_hw_code(__fmul_rn(gs, __fmul_rn(vmax, rcp_approx_ftz(6.0f))));
        v = __fmul_rn(e4m3_value_hw(s_code), rgs);
        out_scale = rcp_approx_ftz(v);
    } else {
        // clamp_max keeps a NaN t, whose code (0x7F) then fails the test below
        s_code = e4m3_hw_code(clamp_max(__fmul_rn(gs, __fmul_rn(vmax, NVFP4_R6)), E4M3_MAX));
        v = __fmul_rn(e4m3_value_hw(s_code), rgs);
        out_scale = rcp_rn_inrange(v);
    }
    // Normal, unsaturated scale codes 0x08..0x7D (so s != 0 and the general path's s != 0 /
    // v != 0 tests agree), v in rcp_rn_inrange's range.
    return (s_code - 8u < 0x76u) & rcp_fast_ok(v);
}

// Half a block on the fast path: the 8 BF16 values of w[0..3] (value 2j in the low half of
// w[j]) times the block's out_scale, as one word of codes (value i in nibble i).
__device__ __forceinline__ void unpack_half_bf16(const u32* w, float* x) {
#pragma unroll
    for (int j = 0; j < 4; j++) {
        x[2 * j] = __uint_as_float(w[j] << 16);
        x[2 * j + 1] = __uint_as_float(w[j] & 0xFFFF0000u);
    }
}
__device__ __forceinline__ u32 bf16_fast_word(const u32* w, float out_scale) {
#if NVFP4DBG_HW_E2M1
    // Blackwell: the conversion instruction encodes two values at once (nvfp4_word)
    float x[8];
    unpack_half_bf16(w, x);
    return nvfp4_word(x, out_scale, false);
#else
    u32 wa[4];
#pragma unroll
    for (int j = 0; j < 4; j++) wa[j] = abs2_bf16(w[j]);
    return e2m1_word_bf16(w, wa, out_scale);
#endif
}

// One BF16 block on the fast path, if it takes it: then the same scale code and codes as
// quant_block_nvfp4_core (and class 0 in classify_nvfp4), else false and nothing written but
// s_code. The scale as nvfp4_block_scale computes it for FLAVOR (decoded by e4m3_value_hw; the
// reference's 1/v by rcp_rn_inrange): bf16_fast_scale. Taken: scale codes 0x08..0x7D (normal,
// not saturated, not NaN, so vmax and gs are finite and nonzero, as are s, v and out_scale > 0)
// with v in the reciprocal's range. Then |x * out_scale| <= vmax * out_scale ~ 6 t / s <= 6 (1 +
// 1/16) (1 + a few ulps) < 7 (t = gs vmax / 6 before the E4M3 rounding, off by at most 1/16 of
// s for a normal s): none is NaN, none needs the clamp at 6 (e2m1_code_min3 gives 6 up to 7).
// Zero blocks, flushed, saturated and NaN scales, denormal scales (where t / s reaches 1.5) and
// exotic global scales go the general way. mbits: max|x| as bits (amax_raw). Each half of the
// block is encoded on its own (bf16_fast_word), so a lane holding half a block (QUANT_COALESCED)
// gives the same word.
template <u32 FLAVOR>
__device__ __forceinline__ bool quant_block_bf16_fast(const RawBlock<u16>& r, u32 mbits, float gs, float rgs,
                                                      u32& s_code, u32 (&packed)[2]) {
    float out_scale;
    if (!bf16_fast_scale<FLAVOR>(mbits, gs, rgs, s_code, out_scale)) return false;
#if NVFP4DBG_HW_E2M1
    // the same conversions as bf16_fast_word's, all 16 values unpacked first
    float x[16];
    unpack_raw(r, x);
    packed[0] = nvfp4_word(x, out_scale, false);
    packed[1] = nvfp4_word(x + 8, out_scale, false);
    return true;
#endif
    u32 w[8] = {r.q[0].x, r.q[0].y, r.q[0].z, r.q[0].w, r.q[1].x, r.q[1].y, r.q[1].z, r.q[1].w};
    packed[0] = bf16_fast_word(w, out_scale);
    packed[1] = bf16_fast_word(w + 4, out_scale);
    return true;
}

// The E2M1 codes of 8 f32 values x[0..7] times os > 0 (value i in nibble i), all |x * os| < 7:
// e2m1_word_bf16's assembly on f32 inputs. |x| * os = |x * os| (the rounding is symmetric) and
// the sign of x * os is that of x (os > 0; -0 included): the signs come from the top bytes of
// x (e2m1_signs), where e2m1_word_fast takes those of the products.
__device__ __forceinline__ u32 e2m1_word_f32(const float* x, float os) {
    u32 pair[4];
#pragma unroll
    for (int j = 0; j < 4; j++) {
        u32 lo = e2m1_code_min3(__fmul_rn(fabsf(x[2 * j]), os));
        u32 hi = e2m1_code_min3(__fmul_rn(fabsf(x[2 * j + 1]), os));
        pair[j] = hi * 16u + lo;  // low byte: the two nibbles
    }
    u32 p[8];
#pragma unroll
    for (int i = 0; i < 8; i++) p[i] = __float_as_uint(x[i]);
    return e2m1_pack_pairs(pair) | e2m1_signs(p);
}

// quant_block_bf16_fast for an f32 block (its values x, max|x| as bits mbits): the same test
// (bf16_fast_scale) and, where taken, the same scale code and codes as the general path. Its
// bound |x * out_scale| < 7 comes from vmax and the scale alone, whatever the input's precision.
template <u32 FLAVOR>
__device__ __forceinline__ bool quant_block_f32_fast(const float (&x)[16], u32 mbits, float gs, float rgs,
                                                     u32& s_code, u32 (&packed)[2]) {
    float out_scale;
    if (!bf16_fast_scale<FLAVOR>(mbits, gs, rgs, s_code, out_scale)) return false;
#if NVFP4DBG_HW_E2M1
    packed[0] = nvfp4_word(x, out_scale, false);
    packed[1] = nvfp4_word(x + 8, out_scale, false);
#else
    packed[0] = e2m1_word_f32(x, out_scale);
    packed[1] = e2m1_word_f32(x + 8, out_scale);
#endif
    return true;
}

// The quantizer's problem: the grid covers rows_g x kb_g blocks (with `swizzled`, the padded
// scale matrix) in `total` groups of QUANT_BLOCKS, `groups` per row.
struct QuantDims {
    u64 rows, kb, kb_g, groups, total;
    u32 cols;
};

__device__ __forceinline__ QuantDims quant_dims(u64 rows, u32 cols, u32 swizzled) {
    QuantDims d;
    d.rows = rows;
    d.cols = cols;
    d.kb = cols / 16;
    u64 rows_g = swizzled ? (rows + 127) / 128 * 128 : rows;
    d.kb_g = swizzled ? (d.kb + 3) / 4 * 4 : d.kb;
    d.groups = (d.kb_g + QUANT_BLOCKS - 1) / QUANT_BLOCKS;
    d.total = rows_g * d.groups;
    return d;
}

// Linear scales, no gather and one global scale: the [rows, cols] tensor is one row of
// rows x cols / 16 blocks (the codes and scales of row r + 1 follow those of row r), so the
// groups need no division to find their row, and a group may span two rows (their blocks
// are consecutive in the input and in both outputs alike). `cols` is then never read.
__device__ __forceinline__ QuantDims quant_dims_flat(u64 rows, u32 cols) {
    QuantDims d = quant_dims(1, 0, 0);
    d.kb = d.kb_g = rows * (cols / 16);
    d.groups = d.total = (d.kb + QUANT_BLOCKS - 1) / QUANT_BLOCKS;
    return d;
}

// Whether every group lies in row 0 (a tensor of one row, or quant_dims_flat's view; not the
// swizzled layout's padded rows).
__device__ __forceinline__ bool quant_one_row(const QuantDims& d) { return d.total == d.groups; }

// One thread's group: QUANT_BLOCKS consecutive 16-blocks of output row r from block b0 (a
// multiple of QUANT_BLOCKS), and their raw input (in flight until first used).
template <typename T> struct Group {
    u64 r, b0;
    bool in_row;
    RawBlock<T> raw[QUANT_BLOCKS];
};

// Where group `idx` (< d.total) lives; returns the input row it reads.
template <typename T>
__device__ __forceinline__ u64 group_locate(u64 idx, const QuantDims& d, const int* __restrict__ row_src,
                                            Group<T>& g) {
    if (quant_one_row(d)) {  // no division (quant_dims_flat)
        g.r = 0;
        g.b0 = QUANT_BLOCKS * idx;
    } else if (d.total <= 0xFFFFFFFFull) {  // 32-bit division: a 64-bit one costs ~5 ops per value
        u32 r32 = (u32)idx / (u32)d.groups;
        g.r = r32;
        g.b0 = QUANT_BLOCKS * ((u32)idx - r32 * (u32)d.groups);
    } else {
        g.r = idx / d.groups;
        g.b0 = QUANT_BLOCKS * (idx % d.groups);
    }
    g.in_row = g.r < d.rows;
    return g.in_row ? (row_src ? (u64)row_src[g.r] : g.r) : 0;
}

// Locate group `idx` and issue its loads.
template <typename T>
__device__ __forceinline__ void group_load(const T* __restrict__ x, u64 idx, const QuantDims& d,
                                           const int* __restrict__ row_src, Group<T>& g) {
    u64 src = group_locate<T>(idx, d, row_src, g);
#pragma unroll
    for (int h = 0; h < QUANT_BLOCKS; h++)
        if (g.in_row && g.b0 + h < d.kb) load_raw<T>(x + src * d.cols + (g.b0 + h) * 16, g.raw[h]);
}

// The transposition's shared memory (group_load_warp, nvfp4_bf16_runs_async): a warp's run of
// 32 groups as TR_PIECES 16-byte pieces a lane, piece q in slot q + q / 8 (a padding slot after
// every 8). The lanes of an 8-lane phase write 8 consecutive slots (pieces 32 i + l: slot
// 36 i + tr_slot(l)) and read 8 slots one apart mod 8 (pieces TR_PIECES l + j: slot
// tr_slot(TR_PIECES l) + j, as (U l + j) / 8 = (U l) / 8 for U = 4 or 8 and j < U), so no bank
// conflicts either way, and each lane's slots are one base address plus constants.
#define TR_PIECES (2 * QUANT_BLOCKS)
#define TR_SLOTS (36 * TR_PIECES)  // tr_slot(32 TR_PIECES): a warp's slots
__device__ __forceinline__ u32 tr_slot(u32 q) { return q + q / 8; }
#if QUANT_TRANSPOSE
// One array for the BF16 kernel's warp-wide loads on both its paths (group_load_warp,
// quantize_flat_bf16), allocated only in the kernels that use it.
__shared__ uint4 quant_tr[QUANT_BF16_THREADS / 32][TR_SLOTS];
#endif

#if QUANT_TRANSPOSE
// A warp's run of 32 groups from `run` (16-byte aligned): 512 contiguous bytes a load
// (load i of lane l at run[32 i + l]), through the warp's slots of quant_tr, so that lane l
// ends with group l's raw blocks in g.raw. Plain `ld.global` (LDG.E.128): session 37 (s37a,
// bench/gpu-run-s37a.sh) measured `ld.global.nc.L1::no_allocate` at 0.0422 ms and with
// `L2::256B` 0.0428 against 0.0397 (marginal rates 0.977 / 0.963 of copy against 1.060).
__device__ __forceinline__ void run_load_warp(const uint4* __restrict__ run, Group<u16>& g) {
    constexpr int U = TR_PIECES;  // 16-byte pieces of a group
    const u32 lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    uint4 v[U];
#pragma unroll
    for (int i = 0; i < U; i++) v[i] = run[32 * i + lane];
    uint4* wr = &quant_tr[warp][tr_slot(lane)];
#pragma unroll
    for (int i = 0; i < U; i++) wr[36 * i] = v[i];
    __syncwarp();
    const uint4* rd = &quant_tr[warp][tr_slot(U * lane)];
#pragma unroll
    for (int j = 0; j < U; j++) g.raw[j / 2].q[j % 2] = rd[j];
}
#endif

// QUANT_TRANSPOSE: group `idx`'s loads done by its whole warp (see the knob). False, with
// nothing loaded, where the warp's 32 groups are not one contiguous run of whole groups (or
// the knob is 0, or T is f32); the test is the same for all lanes of a warp.
template <typename T>
__device__ __forceinline__ bool group_load_warp(const T* __restrict__ x, u64 idx, const QuantDims& d,
                                                const int* __restrict__ row_src, u32 swizzled, Group<T>& g) {
#if QUANT_TRANSPOSE
    if constexpr (sizeof(T) == 2) {
        const u64 w0 = idx - threadIdx.x % 32;
        if (row_src != nullptr || swizzled || w0 + 32 > d.total) return false;
        // whole groups only: in one row (quant_dims_flat), the warp's 32 inside it; else rows
        // of whole groups
        if (quant_one_row(d) ? (w0 + 32) * QUANT_BLOCKS > d.kb : d.kb % QUANT_BLOCKS != 0) return false;
        group_locate<T>(idx, d, nullptr, g);
        run_load_warp(reinterpret_cast<const uint4*>(x + w0 * 16 * QUANT_BLOCKS), g);
        return true;
    }
#endif
    return false;
}

// The global scale of a group's row (0 outside the rows).
template <typename T>
__device__ __forceinline__ float group_gs(const Group<T>& g, const float* __restrict__ gs,
                                          const int* __restrict__ gs_idx) {
    return g.in_row ? gs[gs_idx ? gs_idx[g.r] : 0] : 0.0f;
}

#define FLAVOR_RUNTIME 2u  // the flavor read at run time (every block through the general path)

// One block: its scale code (returned) and codes (p), counted into c (c[0] blocks; c[1..3]
// saturated, flushed, NaN scales). FL a constant (BF16): the fast path first, with `mbits` =
// amax_raw(raw); else, or where it does not take the block, the general path.
template <typename T, u32 FL>
__device__ __forceinline__ u32 quant_block_counted(const RawBlock<T>& raw, u32 mbits, float gv, float rg,
                                                   u32 flavor, u32 (&p)[2], u32 (&c)[4]) {
    if constexpr (sizeof(T) == 2 && FL != FLAVOR_RUNTIME) {
        u32 s;
        if (__builtin_expect(quant_block_bf16_fast<FL>(raw, mbits, gv, rg, s, p), 1)) {
            c[0] += 1;
            return s;
        }
    }
    float v[16];
    mbits = unpack_raw(raw, v);
    if constexpr (sizeof(T) == 4 && FL != FLAVOR_RUNTIME) {
        u32 s;
        if (__builtin_expect(quant_block_f32_fast<FL>(v, mbits, gv, rg, s, p), 1)) {
            c[0] += 1;
            return s;
        }
    }
    u32 s = quant_block_nvfp4_core(v, mbits, gv, rg, flavor, p);
    u32 cls = classify_nvfp4(s, __uint_as_float(mbits) > 0.0f);
    c[0] += 1;
    c[1] += cls & 1u;
    c[2] += (cls >> 1) & 1u;
    c[3] += (cls >> 2) & 1u;
    return s;
}

// A refill that does nothing (group_quantize_fl's default).
struct NoRefill {
    __device__ __forceinline__ void operator()(int) const {}
};
// The encoding half of group_quantize_fl: the group's codes p and scale codes sc with global
// scale gv, its blocks counted into c; refill(h) once block h's raw registers are read.
template <typename T, u32 FL, typename Refill = NoRefill>
__device__ __forceinline__ void group_encode_fl(const Group<T>& g, const QuantDims& d, float gv, u32 flavor,
                                                u32 (&c)[4], u32 (&p)[QUANT_BLOCKS][2], u32 (&sc)[QUANT_BLOCKS],
                                                Refill refill = {}) {
    const u64 b0 = g.b0, kb = d.kb;
    const bool in_row = g.in_row;
    float rg = nvfp4_rgs(gv, flavor);
#pragma unroll
    for (int h = 0; h < QUANT_BLOCKS; h++) {
        if (h > 0) refill(h - 1);
        p[h][0] = p[h][1] = 0;
        sc[h] = 0;
        if (in_row && b0 + h < kb) {
            u32 mbits = 0;
            if constexpr (sizeof(T) == 2) mbits = amax_raw(g.raw[h]);
            sc[h] = quant_block_counted<T, FL>(g.raw[h], mbits, gv, rg, flavor, p[h], c);
        }
    }
    refill(QUANT_BLOCKS - 1);
}

// The storing half: the group's codes and scale codes into output row g.r.
template <typename T>
__device__ __forceinline__ void group_store(const Group<T>& g, const QuantDims& d, const u32 (&p)[QUANT_BLOCKS][2],
                                            const u32 (&sc)[QUANT_BLOCKS], u8* __restrict__ packed,
                                            u8* __restrict__ scales, u32 swizzled) {
    const u64 r = g.r, b0 = g.b0, kb = d.kb;
    const bool in_row = g.in_row;
    bool whole = in_row && b0 + QUANT_BLOCKS <= kb;
    if (in_row) {
        u8* dst = packed + r * (d.cols / 2) + b0 * 8;
        if (whole && ((size_t)dst & 15u) == 0) {
            uint4* o = reinterpret_cast<uint4*>(dst);
#pragma unroll
            for (int v = 0; v < QUANT_BLOCKS / 2; v++)
                o[v] = make_uint4(p[2 * v][0], p[2 * v][1], p[2 * v + 1][0], p[2 * v + 1][1]);
        } else {
#pragma unroll
            for (int h = 0; h < QUANT_BLOCKS; h++)
                if (b0 + h < kb) *reinterpret_cast<uint2*>(dst + h * 8) = make_uint2(p[h][0], p[h][1]);
        }
    }
    constexpr int W = QUANT_SCALE_WORD;
    u32 word[QUANT_BLOCKS / W];
#pragma unroll
    for (int u = 0; u < QUANT_BLOCKS / W; u++) {
        word[u] = 0;
#pragma unroll
        for (int h = 0; h < W; h++) word[u] |= sc[W * u + h] << (8 * h);
    }
    if (swizzled) {
        // the scales of 4 consecutive blocks from a multiple of 4 are 4 consecutive bytes of
        // the 128x4 tile (padding 0); with QUANT_BLOCKS 8 the second four may lie past kb_g
#pragma unroll
        for (int u = 0; u < QUANT_BLOCKS; u += W) {
            if (u > 0 && b0 + u >= d.kb_g) continue;
            u8* dst = scales + swizzle_offset(r, b0 + u, kb);
            if (((size_t)dst & (W - 1)) == 0) {
                st_scale_word(dst, word[u / W]);
            } else {
#pragma unroll
                for (int h = 0; h < W; h++) dst[h] = (u8)sc[u + h];
            }
        }
    } else {
        u8* dst = scales + r * kb + b0;
        if (whole && ((size_t)dst & (W - 1)) == 0) {
#pragma unroll
            for (int u = 0; u < QUANT_BLOCKS; u += W) st_scale_word(dst + u, word[u / W]);
        } else {
#pragma unroll
            for (int h = 0; h < QUANT_BLOCKS; h++)
                if (b0 + h < kb) dst[h] = (u8)sc[h];
        }
    }
}

// Quantize a loaded group, store its codes (16 bytes at a time where aligned) and scales (a
// word at a time where aligned; swizzled padding as zero), count its blocks into c. FL: the
// flavor as a constant (QUANT_ENCODER 1, BF16: the fast path first), or FLAVOR_RUNTIME:
// `flavor`, every block through the general path. GV_LOADED: the row's global scale is
// `gv_loaded` (group_gs, read with the group's loads: QUANT_PIPE), not read here. refill(h)
// once block h's raw registers are no longer read (QUANT_PIPE_RING).
template <typename T, u32 FL, bool GV_LOADED = false, typename Refill = NoRefill>
__device__ __forceinline__ void group_quantize_fl(const Group<T>& g, const QuantDims& d,
                                                  const float* __restrict__ gs, const int* __restrict__ gs_idx,
                                                  u8* __restrict__ packed, u8* __restrict__ scales,
                                                  u32 swizzled, u32 flavor_arg, u32 (&c)[4], float gv_loaded = 0.0f,
                                                  Refill refill = {}) {
    const u32 flavor = FL == FLAVOR_RUNTIME ? flavor_arg : FL;
    float gv = GV_LOADED ? gv_loaded : group_gs(g, gs, gs_idx);
    u32 p[QUANT_BLOCKS][2];
    u32 sc[QUANT_BLOCKS];
    group_encode_fl<T, FL>(g, d, gv, flavor, c, p, sc, refill);
    group_store<T>(g, d, p, sc, packed, scales, swizzled);
}

// ---- QUANT_COALESCED 1: a warp's chunk of 32 x QUANT_BLOCKS consecutive blocks ----

#define COAL_LOADS (2 * QUANT_BLOCKS)  // 16-byte loads per lane (half a BF16 block each)
#define COAL_BLOCKS (16 * COAL_LOADS)  // blocks per chunk (a warp)

// The problem as the chunks see it: the R x K scale matrix (with `swizzled` the padded one:
// R = rows rounded up to 128, K = kb to 4; else rows, kb), its n = R K blocks by flat index
// f = r K + b, cut into `chunks` of COAL_BLOCKS. A lane's next block is 16 further on:
// b += r16, r += q16 (16 = q16 K + r16), then at most one carry.
struct CoalDims {
    u64 rows, R, n, chunks;
    u32 cols, kb, K, q16, r16;
};

__device__ __forceinline__ CoalDims coal_dims(u64 rows, u32 cols, u32 swizzled) {
    CoalDims c;
    c.rows = rows;
    c.cols = cols;
    c.kb = cols / 16;
    c.R = swizzled ? (rows + 127) / 128 * 128 : rows;
    c.K = swizzled ? (c.kb + 3) / 4 * 4 : c.kb;
    c.n = c.R * c.K;
    c.chunks = (c.n + COAL_BLOCKS - 1) / COAL_BLOCKS;
    c.q16 = c.K ? 16u / c.K : 0u;
    c.r16 = c.K ? 16u % c.K : 0u;
    return c;
}

__device__ __forceinline__ void coal_rb(u64 f, const CoalDims& c, u64& r, u32& b) {
    if (c.n <= 0xFFFFFFFFull) {  // 32-bit division, as in group_locate
        u32 r32 = (u32)f / c.K;
        r = r32;
        b = (u32)f - r32 * c.K;
    } else {
        r = f / c.K;
        b = (u32)(f % c.K);
    }
}

__device__ __forceinline__ void coal_step(const CoalDims& c, u64& r, u32& b) {
    b += c.r16;
    r += c.q16;
    if (b >= c.K) {
        b -= c.K;
        r += 1;
    }
}

// A lane's part of a chunk: blocks f0 + 16 i (i < COAL_LOADS), its half (lane & 1) of each,
// and their raw 16 bytes (in flight until first used; from `x` itself for blocks outside the
// rows x kb ones). FLAT (linear scales, no gather, one global scale): the flat index alone
// places a block, as rows are contiguous (input x + 16 f, codes packed + 8 f, scale
// scales + f; blocks f >= n are not real), so a lane's loads and stores are one address and
// immediate offsets. Otherwise f0 = r0 K + b0, and (rl, bl) is the block of the next load.
// The location `l` is all that moves from one chunk to the next (pipe_run's take).
struct CoalLoc {
    u64 f0, r0, rl;
    u32 b0, bl;
    u32 nreal, nfull4;  // FLAT: loads i < nreal are real; i < nfull4: so are the 3 after lane 8j's
};
struct CoalChunk {
    CoalLoc l;
    uint4 raw[COAL_LOADS];
};

template <bool B> struct CoalFlat {
    static constexpr bool value = B;
};

// The loads i < COAL_LOADS of a lane from block f with f + 16 i < n.
__device__ __forceinline__ u32 coal_count(u64 f, u64 n) {
    return f >= n ? 0u : (u32)min((n - f + 15) / 16, (u64)COAL_LOADS);
}

template <bool FLAT>
__device__ __forceinline__ void coal_locate(u64 chunk, u32 lane, const CoalDims& c, CoalChunk& ch) {
    ch.l.f0 = chunk * COAL_BLOCKS + lane / 2;
    if (FLAT) {
        ch.l.nreal = coal_count(ch.l.f0, c.n);
        ch.l.nfull4 = coal_count(ch.l.f0 - ((lane >> 1) & 3u) + 3, c.n);
    } else {
        coal_rb(ch.l.f0, c, ch.l.r0, ch.l.b0);
        ch.l.rl = ch.l.r0;
        ch.l.bl = ch.l.b0;
    }
}

// Load i of the lane's part of the chunk at loc (called for i = 0, 1, ... in order: it steps
// loc's cursor) into dst's registers. With QUANT_PIPE 1, FLAT, a predicated load; else a load
// from `x` for blocks that are not real (see pipe_run).
template <bool FLAT>
__device__ __forceinline__ void coal_fetch(const u16* __restrict__ x, int i, u32 lane, const CoalDims& c,
                                           const int* __restrict__ row_src, CoalChunk& loc, CoalChunk& dst) {
    const u16* p;
    if (FLAT) {
        const u16* base = x + loc.l.f0 * 16 + (lane & 1) * 8;
#if QUANT_PIPE == 1
        if ((u32)i < loc.l.nreal) dst.raw[i] = *reinterpret_cast<const uint4*>(base + 256 * i);
        return;
#else
        p = (u32)i < loc.l.nreal ? base + 256 * i : x;
#endif
    } else {
        if (i > 0) coal_step(c, loc.l.rl, loc.l.bl);
        const bool real = loc.l.rl < c.rows && loc.l.bl < c.kb;
        const u64 src = real && row_src ? (u64)row_src[loc.l.rl] : loc.l.rl;
        p = real ? x + src * c.cols + loc.l.bl * 16 + (lane & 1) * 8 : x;
    }
    dst.raw[i] = *reinterpret_cast<const uint4*>(p);
}

// max|x| of half a block as bits (amax_raw on 4 words): the maximum of the pair's two is the
// block's (an integer maximum).
__device__ __forceinline__ u32 amax_half_bf16(const u32 (&w)[4]) {
    u32 m = abs2_bf16(w[0]);
#pragma unroll
    for (int j = 1; j < 4; j++) asm("max.u16x2 %0, %0, %1;" : "+r"(m) : "r"(abs2_bf16(w[j])));
    return max(m << 16, m & 0xFFFF0000u);
}

// The global scale and its flavor reciprocal: gs[0] once, or gs[gs_idx[r]] again when a lane's
// row changes (the chunks cross rows).
struct CoalGs {
    float gv, rg;
    u64 r;
};

// Quantize a lane's part of a loaded chunk: per load, the pair's max|x| by a shuffle, the scale
// and the lane's word of codes (the fast path, else the general one on 8 values: the same steps
// as quant_block_nvfp4_core's for that half), the word stored (consecutive lanes, consecutive
// words), then the scales. FLAT: each pair keeps its scales of 4 loads in a word, a 4x4 byte
// transpose across the 4 pairs of lanes 8g..8g+7 (two shuffles) gives pair j the 4 consecutive
// scales of load 4q + j, one word store. Otherwise per load: the 4 scales of lanes 8g..8g+7
// gathered into lane 8g by two shuffles, one word store (linear: at f; swizzled: K is a
// multiple of 4, so the 4 lie in one row, 4 consecutive bytes of the 128x4 tile). Where the 4
// are not all there (the linear tail) or `scales` is not word-aligned, the even lanes store
// their bytes. Padding (swizzled) gets scale 0. The even lane of a pair counts the block. Every
// lane of the warp runs it (full-mask shuffles). refill(i) once load i's raw registers are no
// longer read (QUANT_PIPE_RING).
template <u32 FL, bool FLAT, typename Refill>
__device__ __forceinline__ void coal_quantize(const CoalChunk& ch, u32 lane, const CoalDims& c,
                                              const float* __restrict__ gs, const int* __restrict__ gs_idx,
                                              CoalGs& gc, u8* __restrict__ packed, u8* __restrict__ scales,
                                              u32 swizzled, u32 flavor_arg, u32 (&cnt)[4], Refill refill) {
    const u32 flavor = FL == FLAVOR_RUNTIME ? flavor_arg : FL;
    const u32 lead = (lane & 1u) ^ 1u;
    const bool aligned = ((size_t)scales & 3u) == 0;
    u64 r = FLAT ? 0 : ch.l.r0, f = ch.l.f0;
    u32 b = FLAT ? 0 : ch.l.b0;
    u32 quad = 0;  // FLAT: byte k = the scale of load 4q + k
#pragma unroll
    for (int i = 0; i < COAL_LOADS; i++) {
        if (i > 0) {
            if (!FLAT) coal_step(c, r, b);
            f += 16;
        }
        const bool real = FLAT ? (u32)i < ch.l.nreal : r < c.rows && b < c.kb;
        const u32 w[4] = {ch.raw[i].x, ch.raw[i].y, ch.raw[i].z, ch.raw[i].w};
        u32 m = real ? amax_half_bf16(w) : 0u;
        m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, 1));
        u32 s = 0;
        if (real) {
            if (!FLAT && gs_idx != nullptr && r != gc.r) {
                gc.gv = gs[gs_idx[r]];
                gc.rg = nvfp4_rgs(gc.gv, flavor);
                gc.r = r;
            }
            u32 word = 0;
            bool done = false;
            if constexpr (FL != FLAVOR_RUNTIME) {
                float os;
                u32 sc;
                if (__builtin_expect(bf16_fast_scale<FL>(m, gc.gv, gc.rg, sc, os), 1)) {
                    word = bf16_fast_word(w, os);
                    s = sc;
                    cnt[0] += lead;
                    done = true;
                }
            }
            if (!done) {
                float v[8];
                unpack_half_bf16(w, v);
                float os;
                s = nvfp4_block_scale(m, gc.gv, gc.rg, flavor, os);
                word = nvfp4_word(v, os, nvfp4_fast_path(m, os));
                u32 cls = classify_nvfp4(s, __uint_as_float(m) > 0.0f) * lead;
                cnt[0] += lead;
                cnt[1] += cls & 1u;
                cnt[2] += (cls >> 1) & 1u;
                cnt[3] += (cls >> 2) & 1u;
            }
            u8* q = FLAT ? packed + ch.l.f0 * 8 + 128 * i : packed + r * (c.cols / 2) + b * 8;
            *reinterpret_cast<u32*>(q + (lane & 1u) * 4) = word;
        }
        refill(i);
        if (FLAT) {
            quad |= s << (8 * (i & 3));
            if ((i & 3) == 3) {
                // bytes of groups not stored as a word below (the tail of the tensor, or a
                // `scales` not word-aligned): by their own lanes (nfull4 <= nreal counts a prefix)
                if (!(aligned && (u32)i < ch.l.nfull4) && lead) {
#pragma unroll
                    for (int k = i - 3; k <= i; k++)
                        if ((u32)k < ch.l.nreal && !(aligned && (u32)k < ch.l.nfull4))
                            scales[ch.l.f0 + 16 * k] = (u8)(quad >> (8 * (k & 3)));
                }
                // 4x4 byte transpose across the pairs j = 0..3 of lanes 8g..8g+7 (pair j held
                // its scales of loads i-3..i): two butterflies, each a shuffle and a byte permute
                quad = __byte_perm(quad, __shfl_xor_sync(0xFFFFFFFFu, quad, 4), (lane & 4u) ? 0x3276u : 0x5410u);
                quad = __byte_perm(quad, __shfl_xor_sync(0xFFFFFFFFu, quad, 2), (lane & 2u) ? 0x3715u : 0x6240u);
                // pair j now holds the 4 scales of load i - 3 + j: the word at the group's first block
                const u32 li = (u32)i - 3 + ((lane >> 1) & 3u);
                if (lead && aligned && li < ch.l.nfull4)
                    *reinterpret_cast<u32*>(scales + ch.l.f0 - ((lane >> 1) & 3u) + 16 * li) = quad;
                quad = 0;
            }
        } else {
            u32 w2 = s | (__shfl_xor_sync(0xFFFFFFFFu, s, 2) << 8);
            u32 w4 = w2 | (__shfl_xor_sync(0xFFFFFFFFu, w2, 4) << 16);
            u8* dst = scales + (swizzled ? swizzle_offset(r, b, c.kb) : f);
            if (aligned && f - ((lane >> 1) & 3u) + 3 < c.n) {  // lane 8g's 4
                if ((lane & 7u) == 0) *reinterpret_cast<u32*>(dst) = w4;
            } else if (lead && r < c.R) {
                *dst = (u8)s;
            }
        }
    }
}

// ---- the BF16 kernel's other mappings (QUANT_PIPE > 1 or QUANT_COALESCED 1) ----

// Virtual thread k (< QUANT_PIPE) of this thread: CTA-strided (QUANT_PIPE).
__device__ __forceinline__ u64 pipe_vidx(int k) {
    return ((u64)blockIdx.x * QUANT_PIPE + (u64)k) * blockDim.x + threadIdx.x;
}

// This thread's virtual threads v < n, each a unit of PARTS loads: locate(v, unit) (where it
// lies: index arithmetic, row gather, global scale; for any v, also v >= n: then nothing of it
// is real), fetch(loc, dst, i) (load i of the unit at loc into dst's registers: issued for
// every unit and i, from `x` itself where the block is not real, so that no register keeps an
// older value on a path where the load is skipped: that would hold two units' registers
// alive), take(dst, loc) (loc's location into dst, dst's raw registers kept), quant(unit,
// refill). The loads of the next unit are issued before the current one is quantized: all at
// once into a second unit's registers, or with QUANT_PIPE_RING one at a time by refill(i) from
// inside quant, into the registers that load i of the current unit leaves.
template <typename U, int PARTS, typename Locate, typename Fetch, typename Take, typename Quant>
__device__ __forceinline__ void pipe_run(u64 n, Locate locate, Fetch fetch, Take take, Quant quant) {
#if QUANT_PIPE_RING
    U cur, nxt;  // nxt: a location only
    locate(pipe_vidx(0), cur);
#pragma unroll
    for (int i = 0; i < PARTS; i++) fetch(cur, cur, i);
#pragma unroll
    for (int k = 0; k < QUANT_PIPE; k++) {
        if (pipe_vidx(k) >= n) break;  // the later ones are past n too
        if (k + 1 < QUANT_PIPE) {
            locate(pipe_vidx(k + 1), nxt);
            quant(cur, [&](int i) { fetch(nxt, cur, i); });
            take(cur, nxt);
        } else {
            quant(cur, NoRefill{});
        }
    }
#else
    U u[2];
    locate(pipe_vidx(0), u[0]);
#pragma unroll
    for (int i = 0; i < PARTS; i++) fetch(u[0], u[0], i);
#pragma unroll
    for (int k = 0; k < QUANT_PIPE; k++) {
        if (pipe_vidx(k) >= n) break;
        U& cur = u[k & 1];
        U& nxt = u[(k + 1) & 1];
        if (k + 1 < QUANT_PIPE) {
            locate(pipe_vidx(k + 1), nxt);
#pragma unroll
            for (int i = 0; i < PARTS; i++) fetch(nxt, nxt, i);
        }
        quant(cur, NoRefill{});
    }
#endif
}

// A group, the input row it reads and its row's global scale (QUANT_PIPE with the per-thread
// mapping): group_load in two steps, the global scale read with the loads.
template <typename T> struct PipeGroup {
    Group<T> g;
    u64 src;
    float gv;
};

template <u32 FL>
__device__ __forceinline__ void nvfp4_quantize_bf16_mapped(const u16* __restrict__ x, u64 rows, u32 cols,
                                                           const int* __restrict__ row_src,
                                                           const float* __restrict__ gs,
                                                           const int* __restrict__ gs_idx, u8* __restrict__ packed,
                                                           u8* __restrict__ scales, u32 swizzled, u32 flavor,
                                                           const QuantDims& d, u32 (&c)[4]) {
#if QUANT_COALESCED
    // virtual threads: 32 per chunk (v / 32 is warp-uniform: blockDim.x is a multiple of 32)
    const CoalDims cd = coal_dims(rows, cols, swizzled);
    const u32 lane = threadIdx.x % 32;
    CoalGs gc;
    gc.r = ~0ull;
    gc.gv = gs_idx == nullptr ? gs[0] : 0.0f;
    gc.rg = nvfp4_rgs(gc.gv, FL == FLAVOR_RUNTIME ? flavor : FL);
    auto run = [&](auto flat) {
        constexpr bool FLAT = decltype(flat)::value;
        pipe_run<CoalChunk, COAL_LOADS>(
            cd.chunks * 32, [&](u64 v, CoalChunk& ch) { coal_locate<FLAT>(v / 32, lane, cd, ch); },
            [&](CoalChunk& loc, CoalChunk& dst, int i) { coal_fetch<FLAT>(x, i, lane, cd, row_src, loc, dst); },
            [&](CoalChunk& dst, const CoalChunk& loc) { dst.l = loc.l; },
            [&](const CoalChunk& ch, auto refill) {
                coal_quantize<FL, FLAT>(ch, lane, cd, gs, gs_idx, gc, packed, scales, swizzled, flavor, c, refill);
            });
    };
    if (row_src == nullptr && gs_idx == nullptr && !swizzled)
        run(CoalFlat<true>{});
    else
        run(CoalFlat<false>{});
#else
    pipe_run<PipeGroup<u16>, QUANT_BLOCKS>(
        d.total,
        [&](u64 v, PipeGroup<u16>& p) {
            p.src = group_locate<u16>(v, d, row_src, p.g);
            p.gv = group_gs(p.g, gs, gs_idx);
        },
        [&](const PipeGroup<u16>& loc, PipeGroup<u16>& dst, int h) {  // group_load's loads
            const bool real = loc.g.in_row && loc.g.b0 + h < d.kb;
            load_raw<u16>(real ? x + loc.src * d.cols + (loc.g.b0 + h) * 16 : x, dst.g.raw[h]);
        },
        [&](PipeGroup<u16>& dst, const PipeGroup<u16>& loc) {
            dst.g.r = loc.g.r;
            dst.g.b0 = loc.g.b0;
            dst.g.in_row = loc.g.in_row;
            dst.src = loc.src;
            dst.gv = loc.gv;
        },
        [&](const PipeGroup<u16>& p, auto refill) {
            group_quantize_fl<u16, FL, true>(p.g, d, gs, gs_idx, packed, scales, swizzled, flavor, c, p.gv, refill);
        });
#endif
}

// QUANT_FLAT_PATH: the flat BF16 tensor (QUANT_FLAT: rows x cols / 16 blocks as one row,
// one global scale gs[0], linear scales), group `idx` per thread as in nvfp4_quantize_fl: a
// warp whose 32 groups are whole loads them warp-wide (run_load_warp), the last,
// partial warp per thread. Same codes, scales and counts.
template <u32 FL>
__device__ __forceinline__ void quantize_flat_bf16(const u16* __restrict__ x, u64 rows, u32 cols,
                                                   const float* __restrict__ gs, u8* __restrict__ packed,
                                                   u8* __restrict__ scales, u32 flavor, u32 tail0, u32 (&c)[4]) {
    const u32 lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    constexpr u32 WARPS = QUANT_BF16_THREADS / 32;
    // the warp's run of 32 groups: WARPS a CTA before tail0, QUANT_TAIL_WARPS from it on
    const bool tail = blockIdx.x >= tail0;
    if (tail && warp >= QUANT_TAIL_WARPS) return;
    const u64 run = tail ? (u64)tail0 * WARPS + (u64)(blockIdx.x - tail0) * QUANT_TAIL_WARPS + warp
                         : (u64)blockIdx.x * WARPS + warp;
    const u64 w0 = 32 * run, idx = w0 + lane;
    const QuantDims d = quant_dims_flat(rows, cols);
    const float gv = gs[0];
    Group<u16> g;
    g.r = 0;
    g.b0 = QUANT_BLOCKS * idx;
    g.in_row = true;
    bool any = true;
    if ((w0 + 32) * QUANT_BLOCKS <= d.kb) {
        run_load_warp(reinterpret_cast<const uint4*>(x + w0 * 16 * QUANT_BLOCKS), g);
    } else if (idx < d.total) {
        group_load<u16>(x, idx, d, nullptr, g);
    } else {
        any = false;
    }
    if (any) group_quantize_fl<u16, FL, true>(g, d, gs, nullptr, packed, scales, 0, flavor, c, gv);
}

// QUANT_BLOCKS consecutive 16-blocks of a row per thread. `row_src` (nullable) gathers: output row r reads input row row_src[r].
// `gs_idx` (nullable) picks gs[gs_idx[r]] per row, else gs[0]. With `swizzled`, the grid
// covers the padded scale matrix and padding is written as zero. Launched with QUANT_THREADS
// threads.
template <typename T, u32 FL>
__device__ __forceinline__ void nvfp4_quantize_fl(const T* __restrict__ x, u64 rows, u32 cols,
                                                  const int* __restrict__ row_src, const float* __restrict__ gs,
                                                  const int* __restrict__ gs_idx, u8* __restrict__ packed,
                                                  u8* __restrict__ scales, u32 swizzled, u64* __restrict__ stats,
                                                  u32 flavor, u32 tail0) {
    const bool flat = QUANT_FLAT && QUANT_PIPE == 1 && !QUANT_COALESCED && row_src == nullptr && gs_idx == nullptr &&
                      !swizzled;
#if QUANT_FLAT_PATH && QUANT_TRANSPOSE && QUANT_PIPE == 1 && !QUANT_COALESCED
    if constexpr (sizeof(T) == 2 && FL != FLAVOR_RUNTIME) {
        if (flat) {
            u32 c[4] = {0, 0, 0, 0};
            quantize_flat_bf16<FL>(x, rows, cols, gs, packed, scales, flavor, tail0, c);
#if QUANT_STATS
            add_stats_rare(stats, c, rows * (cols / 16));
#else
            add_stats_cta(stats, c);
#endif
            return;
        }
    }
#endif
    const QuantDims d = flat ? quant_dims_flat(rows, cols) : quant_dims(rows, cols, swizzled);
    u32 c[4] = {0, 0, 0, 0};
#if QUANT_PIPE > 1 || QUANT_COALESCED
    if constexpr (sizeof(T) == 2) {
        nvfp4_quantize_bf16_mapped<FL>(x, rows, cols, row_src, gs, gs_idx, packed, scales, swizzled, flavor, d, c);
    } else
#endif
    {
        u64 idx = (u64)blockIdx.x * blockDim.x + threadIdx.x;
        const bool gs_early = QUANT_GS_EARLY && gs_idx == nullptr;
        const float gv_early = gs_early ? gs[0] : 0.0f;
        Group<T> g;
        const bool warp = group_load_warp<T>(x, idx, d, row_src, swizzled, g);
        if (warp || idx < d.total) {
            if (!warp) group_load<T>(x, idx, d, row_src, g);
            // (outside the rows group_gs gives 0, but no block is encoded there)
            const float gv = gs_early ? gv_early : group_gs(g, gs, gs_idx);
            group_quantize_fl<T, FL, true>(g, d, gs, gs_idx, packed, scales, swizzled, flavor, c, gv);
        }
    }
#if QUANT_STATS
    add_stats_rare(stats, c, rows * (cols / 16));
#else
    add_stats_cta(stats, c);
#endif
}

// QUANT_ENCODER 1: the BF16 kernel is compiled once per flavor (a constant in the fast path),
// picked once per thread; otherwise one body reads `flavor` where it matters.
template <typename T>
__device__ void nvfp4_quantize(const T* __restrict__ x, u64 rows, u32 cols, const int* __restrict__ row_src,
                               const float* __restrict__ gs, const int* __restrict__ gs_idx,
                               u8* __restrict__ packed, u8* __restrict__ scales, u32 swizzled,
                               u64* __restrict__ stats, u32 flavor, u32 tail0) {
    if (QUANT_ENCODER && sizeof(T) == 2) {
        if (flavor == FLAVOR_CUDA_FAST)
            nvfp4_quantize_fl<T, FLAVOR_CUDA_FAST>(x, rows, cols, row_src, gs, gs_idx, packed, scales, swizzled,
                                                   stats, flavor, tail0);
        else
            nvfp4_quantize_fl<T, FLAVOR_REFERENCE>(x, rows, cols, row_src, gs, gs_idx, packed, scales, swizzled,
                                                   stats, flavor, tail0);
    } else {
        nvfp4_quantize_fl<T, FLAVOR_RUNTIME>(x, rows, cols, row_src, gs, gs_idx, packed, scales, swizzled, stats,
                                             flavor, tail0);
    }
}

extern "C" __global__ void nvfp4_quantize_f32(const float* x, u64 rows, u32 cols, const int* row_src,
                                              const float* gs, const int* gs_idx, u8* packed,
                                              u8* scales, u32 swizzled, u64* stats, u32 flavor) {
    nvfp4_quantize<float>(x, rows, cols, row_src, gs, gs_idx, packed, scales, swizzled, stats, flavor, 0xFFFFFFFFu);
}

// The expert inputs of a MoE layer token by token: input row t (of `tokens`) is quantized into
// output rows pos[t k + j], j < k (the sorted positions of its k routed slots, a permutation
// of the out_rows = tokens k rows), each with gs[gs_idx[row]]. The same codes, scales and
// statistics as nvfp4_quantize_f32 gathering with row_src[pos[t k + j]] = t, but each input
// row is read once instead of k times (the gather re-reads every row k times, far apart in
// time: 940 MB for 4096 DeepSeek-V3 tokens, 117 MB here). Linear scales. A thread takes a
// group of QUANT_BLOCKS blocks of row t and writes it k times.
template <u32 FL>
__device__ __forceinline__ void quantize_f32_scatter_fl(const float* __restrict__ x, u64 tokens, u32 cols, u32 k,
                                                        const int* __restrict__ pos, u64 out_rows,
                                                        const float* __restrict__ gs, const int* __restrict__ gs_idx,
                                                        u8* __restrict__ packed, u8* __restrict__ scales,
                                                        u64* __restrict__ stats, u32 flavor) {
    const QuantDims din = quant_dims(tokens, cols, 0), dout = quant_dims(out_rows, cols, 0);
    u32 c[4] = {0, 0, 0, 0};
    u64 idx = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx < din.total) {
        Group<float> g;
        group_load<float>(x, idx, din, nullptr, g);
        const u64 t = g.r;
        // The codes depend on the block and the bits of its global scale alone: a slot whose
        // expert has the same gs bits as the slot encoded last stores that slot's codes again
        // (one encode per token where every expert shares gs1: dynamic scales, a calibrated or
        // engine-wide gs).
        bool encoded = false;
        u32 last_bits = 0;
        u32 q[QUANT_BLOCKS][2], sc[QUANT_BLOCKS], counted[4] = {0, 0, 0, 0};
        const u32 fl = FL == FLAVOR_RUNTIME ? flavor : FL;
        for (u32 j = 0; j < k; j++) {
            const int p = pos[t * k + j];
            if (p < 0 || (u64)p >= out_rows) continue;
            g.r = (u64)p;
            const float gv = group_gs(g, gs, gs_idx);
            if (!encoded || __float_as_uint(gv) != last_bits) {
                counted[0] = counted[1] = counted[2] = counted[3] = 0;
                group_encode_fl<float, FL>(g, dout, gv, fl, counted, q, sc);
                last_bits = __float_as_uint(gv);
                encoded = true;
            }
#pragma unroll
            for (int f = 0; f < 4; f++) c[f] += counted[f];
            group_store<float>(g, dout, q, sc, packed, scales, 0);
        }
    }
#if QUANT_STATS
    add_stats_rare(stats, c, out_rows * dout.kb);
#else
    add_stats_cta(stats, c);
#endif
}

// One entry point per flavor (moe.rs picks it), each with its own registers: with the flavor a
// constant (QUANT_ENCODER 1), the fast path first (quant_block_f32_fast), as the BF16 kernel
// encodes; with QUANT_ENCODER 0 both run every block through the general path. (Every block
// through the general path measured 0.196 ms at 4096 DeepSeek-V3 tokens, 14.7M blocks
// encoded, session 18.)
#define QUANT_F32_SCATTER_ARGS                                                                                   \
    const float *__restrict__ x, u64 tokens, u32 cols, u32 k, const int *__restrict__ pos, u64 out_rows,          \
        const float *__restrict__ gs, const int *__restrict__ gs_idx, u8 *__restrict__ packed,                    \
        u8 *__restrict__ scales, u64 *__restrict__ stats, u32 flavor
extern "C" __global__ void __launch_bounds__(QUANT_THREADS)
nvfp4_quantize_f32_scatter_reference(QUANT_F32_SCATTER_ARGS) {
    quantize_f32_scatter_fl<QUANT_ENCODER ? FLAVOR_REFERENCE : FLAVOR_RUNTIME>(x, tokens, cols, k, pos, out_rows, gs,
                                                                               gs_idx, packed, scales, stats, flavor);
}
extern "C" __global__ void __launch_bounds__(QUANT_THREADS)
nvfp4_quantize_f32_scatter_cuda_fast(QUANT_F32_SCATTER_ARGS) {
    quantize_f32_scatter_fl<QUANT_ENCODER ? FLAVOR_CUDA_FAST : FLAVOR_RUNTIME>(x, tokens, cols, k, pos, out_rows, gs,
                                                                               gs_idx, packed, scales, stats, flavor);
}

// The expert inputs of a MoE layer straight into the register-A prefill's token rows
// (kernels/moe_gemm_sm90.cu, rs_unit_words): quantize_f32_scatter_fl's codes and statistics,
// each slot's codes then dequantized exactly into row pos[t k + j] of `rows_out` ([out_rows,
// cols] 16-bit values), what moe_rows_bf16_rs makes of the codes, without the codes' round trip
// through memory (`packed` may be null: the codes and scales are then not stored). x is the
// layer input in f32 or its BF16 copy (where it holds the same values). cols must be a
// multiple of 128, so that a group (QUANT_BLOCKS 4: two units of 32 codes) and its neighbour
// fill one 128-wide chunk. A warp's 32 groups lie in a row of x (group w starts at element
// 64 w): they are loaded 512 bytes an instruction into the warp's slice of the dynamic shared
// memory (RS_SCATTER_WARP_BYTES; piece q in slot q + q / P, P pieces a group: no bank conflict
// either way), and read from there by their lanes. Encoded, they are 16 chunks of the rows,
// staged in the same slice (pitch 68 words, as moe_rows_bf16_rs) and stored 512 contiguous
// bytes an instruction: each half warp stores a chunk to the row of the lanes that encoded it.
#define RS_SLICE_PITCH 68
// 0: each lane loads its own 256 bytes (group_load: 16-byte pieces 256 bytes apart across the
// warp), as quantize_f32_scatter_fl does. A/B only.
#ifndef RS_SCATTER_COALESCED
#define RS_SCATTER_COALESCED 1
#endif
#define RS_SCATTER_WARP_BYTES (544 * 16)  // f32: 512 pieces of 16 bytes and 32 pads; moe.rs
                                          // launches QUANT_THREADS / 32 of them
template <typename T, u32 FL>
__device__ __forceinline__ void rows_scatter_fl(const T* __restrict__ x, u64 tokens, u32 cols, u32 k,
                                                const int* __restrict__ pos, u64 out_rows,
                                                const float* __restrict__ gs, const int* __restrict__ gs_idx,
                                                u8* __restrict__ packed, u8* __restrict__ scales,
                                                u64* __restrict__ stats, u32 flavor, u32* __restrict__ rows_out) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && QUANT_BLOCKS == 4  // (moe.rs: rows_scatter_fits)
    static_assert(16 * RS_SLICE_PITCH * 4 <= RS_SCATTER_WARP_BYTES, "the chunks fit the slice");
    extern __shared__ __align__(16) u8 scatter_smem[];
    u32 smem_bytes;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(smem_bytes));
    if (smem_bytes < blockDim.x / 32 * RS_SCATTER_WARP_BYTES) __trap();
    const QuantDims din = quant_dims(tokens, cols, 0), dout = quant_dims(out_rows, cols, 0);
    const u32 lane = threadIdx.x % 32;
    u32* sl = reinterpret_cast<u32*>(scatter_smem + threadIdx.x / 32 * RS_SCATTER_WARP_BYTES);
    u32 c[4] = {0, 0, 0, 0};
    const u64 idx = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const bool live = idx < din.total;
    Group<T> g;
    const u64 w0 = idx - lane;
    if (RS_SCATTER_COALESCED && w0 + 32 <= din.total) {
        group_locate<T>(idx, din, nullptr, g);
        constexpr int P = 4 * sizeof(T);  // 16-byte pieces of a group
        const uint4* run = reinterpret_cast<const uint4*>(x) + w0 * P;
        uint4 v[P];
#pragma unroll
        for (int i = 0; i < P; i++) v[i] = run[32 * i + lane];
        uint4* s4 = reinterpret_cast<uint4*>(sl);
#pragma unroll
        for (int i = 0; i < P; i++) s4[32 * i + lane + (32 * i + lane) / P] = v[i];
        __syncwarp();
        constexpr int PB = P / QUANT_BLOCKS;  // pieces of a block
#pragma unroll
        for (int j = 0; j < P; j++) g.raw[j / PB].q[j % PB] = s4[(P + 1) * lane + j];
    } else if (live) {
        group_load<T>(x, idx, din, nullptr, g);
    }
    const u64 t = live ? g.r : 0;
    u32 q[QUANT_BLOCKS][2], sc[QUANT_BLOCKS], counted[4] = {0, 0, 0, 0};
    const u32 fl = FL == FLAVOR_RUNTIME ? flavor : FL;
    // The first routed slot's gs encodes the group, and the raw input dies there (a later
    // slot whose gs bits differ reads it again, from L2): ptxas keeps it out of the slot loop.
    u32 first = k, last_bits = 0;
    for (u32 j = 0; live && j < k; j++) {
        const int p = pos[t * k + j];
        if (p >= 0 && (u64)p < out_rows) {
            g.r = (u64)p;
            const float gv = group_gs(g, gs, gs_idx);
            group_encode_fl<T, FL>(g, dout, gv, fl, counted, q, sc);
            last_bits = __float_as_uint(gv);
            first = j;
            break;
        }
    }
    // the lane's 64 values: units 2 (lane % 2) and + 1 of chunk lane / 2 of the slice
    u32* mine = sl + (lane / 2) * RS_SLICE_PITCH;
    for (u32 j = 0; j < k; j++) {
        const int p = live ? pos[t * k + j] : -1;
        const bool valid = p >= 0 && (u64)p < out_rows;
        bool fresh = j == first;
        u64 dst = 0;  // this slot's 256 bytes of chunk b0 / 8 in row p (0: none)
        if (valid) {
            g.r = (u64)p;
            const float gv = group_gs(g, gs, gs_idx);
            if (__float_as_uint(gv) != last_bits) {
                group_load<T>(x, idx, din, nullptr, g);
                g.r = (u64)p;
                counted[0] = counted[1] = counted[2] = counted[3] = 0;
                group_encode_fl<T, FL>(g, dout, gv, fl, counted, q, sc);
                last_bits = __float_as_uint(gv);
                fresh = true;
            }
#pragma unroll
            for (int f = 0; f < 4; f++) c[f] += counted[f];
            if (packed != nullptr) group_store<T>(g, dout, q, sc, packed, scales, 0);
            dst = reinterpret_cast<u64>(rows_out) + ((u64)p * cols + (g.b0 / 8) * 128) * 2;
        }
        if (__any_sync(0xFFFFFFFFu, fresh)) {
            __syncwarp();  // the slot before has read the slice
            if (fresh) {
#pragma unroll
                for (int v = 0; v < 2; v++)
                    rs_unit_words(make_uint4(q[2 * v][0], q[2 * v][1], q[2 * v + 1][0], q[2 * v + 1][1]),
                                  sc[2 * v] | (sc[2 * v + 1] << 8), 2 * (lane % 2) + v, mine);
            }
            __syncwarp();
        }
#pragma unroll
        for (int i = 0; i < 8; i++) {
            // chunks 2 i (lanes 0-15) and 2 i + 1 (16-31), encoded by lanes 4 i and 4 i + 2
            const u32 cl = 2 * i + lane / 16;
            const u64 to = __shfl_sync(0xFFFFFFFFu, dst, 2 * cl);
            const uint4 v = *reinterpret_cast<const uint4*>(sl + cl * RS_SLICE_PITCH + 4 * (lane % 16));
            if (to != 0) reinterpret_cast<uint4*>(to)[lane % 16] = v;
        }
    }
#if QUANT_STATS
    add_stats_rare(stats, c, out_rows * dout.kb);
#else
    add_stats_cta(stats, c);
#endif
#else
    __trap();
#endif
}

// One entry point per input (the layer input in f32, or its BF16 copy: the same values) and
// flavor (moe.rs picks it), as the scatter kernels above; 2 CTAs an SM (3 spill 782 bytes; the
// BF16 ones at 3, 80 registers and a 20-byte spill, were 2.7 us slower: s34a).
#define QUANT_ROWS_SCATTER(name, T, FLAV)                                                                        \
    extern "C" __global__ void __launch_bounds__(QUANT_THREADS, 2)                                               \
        name(const T* __restrict__ x, u64 tokens, u32 cols, u32 k, const int* __restrict__ pos, u64 out_rows,     \
             const float* __restrict__ gs, const int* __restrict__ gs_idx, u8* __restrict__ packed,              \
             u8* __restrict__ scales, u64* __restrict__ stats, u32 flavor, u32* __restrict__ rows_out) {         \
        rows_scatter_fl<T, QUANT_ENCODER ? FLAV : FLAVOR_RUNTIME>(x, tokens, cols, k, pos, out_rows, gs, gs_idx, \
                                                                   packed, scales, stats, flavor, rows_out);      \
    }
QUANT_ROWS_SCATTER(nvfp4_rows_scatter_reference, float, FLAVOR_REFERENCE)
QUANT_ROWS_SCATTER(nvfp4_rows_scatter_cuda_fast, float, FLAVOR_CUDA_FAST)
QUANT_ROWS_SCATTER(nvfp4_rows_scatter_bf16_reference, u16, FLAVOR_REFERENCE)
QUANT_ROWS_SCATTER(nvfp4_rows_scatter_bf16_cuda_fast, u16, FLAVOR_CUDA_FAST)

// QUANT_MIN_BLOCKS bounds the BF16 kernel only (the f32 one holds twice the raw bytes).
#if QUANT_MIN_BLOCKS > 0
#define QUANT_BF16_BOUNDS __launch_bounds__(QUANT_BF16_THREADS, QUANT_MIN_BLOCKS)
#else
#define QUANT_BF16_BOUNDS __launch_bounds__(QUANT_BF16_THREADS)
#endif
extern "C" __global__ void QUANT_BF16_BOUNDS
nvfp4_quantize_bf16(const u16* x, u64 rows, u32 cols, const int* row_src, const float* gs,
                    const int* gs_idx, u8* packed, u8* scales, u32 swizzled, u64* stats, u32 flavor,
                    u32 tail0) {
    nvfp4_quantize<u16>(x, rows, cols, row_src, gs, gs_idx, packed, scales, swizzled, stats, flavor, tail0);
}

// ---- The flat BF16 quantizer with bulk copies (sm_90 and newer) ----
// [rows, cols] BF16 with linear scales, no gather and one global scale is a flat array of
// n = rows cols / 16 blocks (cols is a multiple of 16): block f reads x + 16 f and writes its
// codes at packed + 8 f and its scale at scales + f. The tensor is cut into tiles of at most
// BULK_TILE blocks, dealt to the warps of a persistent grid in turn (tile k to warp k mod W:
// the grid sweeps the tensor in address order, as a grid-stride loop does; one contiguous
// range per warp measured 10% slower), the tile size (`tile` blocks, <= BULK_TILE) picked by
// the host so that the last round of tiles is nearly full (src/backend/cuda/quant.rs,
// bulk_tile). Each warp streams its tiles through its own ring of BULK_STAGES shared-memory
// slots: lane 0 fetches a tile with one bulk copy completing on the
// slot's mbarrier, so the bytes in flight depend neither on registers nor on how long the lanes
// take over the tiles before (the grid kernel's bound: a thread's loads are in flight only
// while it waits for them). Lane l takes the tile's blocks l, l + 32, ...: 2-way bank conflicts
// on its 16-byte shared loads, and consecutive lanes write consecutive code words and scale
// bytes. A slot is refilled once every lane has its blocks in registers (their max|x|
// computed: the loads have landed). Same encoder (quant_block_counted), same codes, scales and
// statistics as the grid kernel. Since session 10 the host takes it only where the grid
// kernel's warp-wide loads do not apply (rows not of whole groups): those measured 0.0422 ms
// at 8192 x 7168 on an H200, this kernel 0.0440.
// Blocks per lane per tile, and tiles in flight per warp. src/backend/cuda/quant.rs reads both
// (the shared memory size: BULK_WARPS x BULK_STAGES x BULK_TILE x 32 bytes + the barriers).
#ifndef BULK_QB
#define BULK_QB 4
#endif
#ifndef BULK_STAGES
#define BULK_STAGES 2
#endif
// Blocks a lane encodes together (their loads, then their encoders interleaved): a divisor of
// BULK_QB; fewer hold fewer registers.
#ifndef BULK_ILP
#define BULK_ILP BULK_QB
#endif
static_assert(BULK_QB % BULK_ILP == 0, "BULK_ILP must divide BULK_QB");
#define BULK_TILE (32 * BULK_QB)
#define BULK_WARPS (QUANT_THREADS / 32)
#define BULK_BARS_BYTES 1024  // the mbarriers (8 bytes each) ahead of the tiles
static_assert(BULK_WARPS * BULK_STAGES * 8 <= BULK_BARS_BYTES, "BULK_STAGES: too many barriers");

#if NVFP4DBG_BULK
template <u32 FL>
__device__ __forceinline__ void nvfp4_quantize_bulk(const u16* __restrict__ x, u64 n, u64 tile, float gv,
                                                    u8* __restrict__ packed, u8* __restrict__ scales, u32 (&c)[4]) {
    extern __shared__ __align__(128) u8 bulk_smem[];
    const u32 warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const u32 bar0 = smem_addr(bulk_smem) + warp * BULK_STAGES * 8;
    const u8* ring = bulk_smem + BULK_BARS_BYTES + warp * (BULK_STAGES * BULK_TILE * 32);
    const u64 W = (u64)gridDim.x * BULK_WARPS, w = (u64)blockIdx.x * BULK_WARPS + warp;
    const u64 all = (n + tile - 1) / tile;
    const u32 tiles = (u32)(w < all ? (all - w + W - 1) / W : 0);
    const float rg = nvfp4_rgs(gv, FL);
    auto fetch = [&](u32 t) {
        const u64 f = (w + (u64)t * W) * tile;
        const u32 bytes = (u32)min(tile, n - f) * 32u, bar = bar0 + (t % BULK_STAGES) * 8;
        mbar_arrive_expect_tx(bar, bytes);
        bulk_load(smem_addr(ring + (t % BULK_STAGES) * (BULK_TILE * 32)), x + 16 * f, bytes, bar);
    };
    if (lane == 0) {
        for (u32 s = 0; s < BULK_STAGES; s++) mbar_init(bar0 + 8 * s, 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        for (u32 t = 0; t < BULK_STAGES && t < tiles; t++) fetch(t);
    }
    __syncwarp();
    for (u32 t = 0; t < tiles; t++) {
        mbar_wait(bar0 + (t % BULK_STAGES) * 8, (t / BULK_STAGES) & 1u);
        const u64 f0 = (w + (u64)t * W) * tile;
        const u32 nb = (u32)min(tile, n - f0);
        const uint4* slot = reinterpret_cast<const uint4*>(ring + (t % BULK_STAGES) * (BULK_TILE * 32));
        // BULK_ILP blocks at a time out of the slot; the slot is refilled once the last ones
        // are in registers
#pragma unroll
        for (int h0 = 0; h0 < BULK_QB; h0 += BULK_ILP) {
            RawBlock<u16> raw[BULK_ILP];
            u32 mbits[BULK_ILP];
#pragma unroll
            for (int h = 0; h < BULK_ILP; h++) {
                raw[h].q[0] = slot[2 * (32 * (h0 + h) + lane)];
                raw[h].q[1] = slot[2 * (32 * (h0 + h) + lane) + 1];
                mbits[h] = amax_raw(raw[h]);
            }
            if (h0 + BULK_ILP == BULK_QB) {
                __syncwarp();
                if (lane == 0 && t + BULK_STAGES < tiles) fetch(t + BULK_STAGES);
            }
#pragma unroll
            for (int h = 0; h < BULK_ILP; h++) {
                const u32 i = 32 * (h0 + h) + lane;
                if (i < nb) {
                    u32 p[2];
                    const u32 s = quant_block_counted<u16, FL>(raw[h], mbits[h], gv, rg, FL, p, c);
                    *reinterpret_cast<uint2*>(packed + 8 * (f0 + i)) = make_uint2(p[0], p[1]);
                    scales[f0 + i] = (u8)s;
                }
            }
        }
    }
}
#endif

// Launched with QUANT_THREADS threads and the shared memory above, on a persistent grid. x:
// 16-byte aligned; packed: 8-byte aligned.
extern "C" __global__ void __launch_bounds__(QUANT_THREADS)
nvfp4_quantize_bf16_bulk(const u16* x, u64 n, u64 tile, const float* gs, u8* packed, u8* scales, u64* stats,
                         u32 flavor) {
#if NVFP4DBG_BULK
    u32 c[4] = {0, 0, 0, 0};
    const float gv = gs[0];
    tile = tile == 0 ? 1 : min(tile, (u64)BULK_TILE);  // the slots hold BULK_TILE blocks
    if (flavor == FLAVOR_CUDA_FAST)
        nvfp4_quantize_bulk<FLAVOR_CUDA_FAST>(x, n, tile, gv, packed, scales, c);
    else
        nvfp4_quantize_bulk<FLAVOR_REFERENCE>(x, n, tile, gv, packed, scales, c);
#if QUANT_STATS
    add_stats_rare(stats, c, n);
#else
    add_stats_cta(stats, c);
#endif
#else
    __trap();  // the host launches it on sm_90 and newer only
#endif
}

// MXFP4 (OCP MX v1.0): blocks of 32, UE8M0 scale 2^(floor(log2 amax) - 2), elements
// e2m1(clamp(x / scale, -6, 6)); a NaN block gets scale 0xFF and zero codes.
template <typename T>
__device__ void mxfp4_quantize(const T* __restrict__ x, u64 rows, u32 cols, u8* __restrict__ packed,
                               u8* __restrict__ scales, u32 swizzled, u64* __restrict__ stats) {
    u64 kb = cols / 32;
    u64 rows_g = swizzled ? (rows + 127) / 128 * 128 : rows;
    u64 kb_g = swizzled ? (kb + 3) / 4 * 4 : kb;
    u64 idx = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= rows_g * kb_g) return;
    u64 r = idx / kb_g, b = idx % kb_g;
    u32 blocks = 0, cls = 0;
    if (r < rows && b < kb) {
        float v[2][16];
        load16<T>(x + r * cols + b * 32, v[0]);
        load16<T>(x + r * cols + b * 32 + 16, v[1]);
        float vmax = 0.0f;
#pragma unroll
        for (int h = 0; h < 2; h++)
#pragma unroll
            for (int i = 0; i < 16; i++) vmax = amax_step(vmax, v[h][i]);
        u32 code;
        u32 words[4] = {0, 0, 0, 0};
        blocks = 1;
        if (vmax != vmax) {
            code = UE8M0_NAN;
            cls = 4u;
        } else {
            int ex = vmax == 0.0f ? -127 : (isinf(vmax) ? 127 : floor_log2(vmax) - 2);
            ex = ex < -127 ? -127 : (ex > 127 ? 127 : ex);
            code = (u32)(ex + 127);
            if (code == 254u) cls = 1u;
            float scale = ue8m0_decode(code);
#pragma unroll
            for (int w = 0; w < 4; w++) {
                u32 word = 0;
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    float lo = clamp6(__fdiv_rn(v[w / 2][(w % 2) * 8 + 2 * i], scale));
                    float hi = clamp6(__fdiv_rn(v[w / 2][(w % 2) * 8 + 2 * i + 1], scale));
                    word |= e2m1_pack2(lo, hi) << (8 * i);
                }
                words[w] = word;
            }
        }
        *reinterpret_cast<uint4*>(packed + r * (cols / 2) + b * 16) =
            make_uint4(words[0], words[1], words[2], words[3]);
        scales[swizzled ? swizzle_offset(r, b, kb) : r * kb + b] = (u8)code;
    } else {
        scales[swizzle_offset(r, b, kb)] = 0;
    }
    add_stats(stats, blocks, cls);
}

extern "C" __global__ void mxfp4_quantize_f32(const float* x, u64 rows, u32 cols, u8* packed,
                                              u8* scales, u32 swizzled, u64* stats) {
    mxfp4_quantize<float>(x, rows, cols, packed, scales, swizzled, stats);
}

extern "C" __global__ void mxfp4_quantize_bf16(const u16* x, u64 rows, u32 cols, u8* packed,
                                               u8* scales, u32 swizzled, u64* stats) {
    mxfp4_quantize<u16>(x, rows, cols, packed, scales, swizzled, stats);
}

// Linear [rows, kb] -> 128x4 swizzled (padding zero). One thread per padded entry.
extern "C" __global__ void scales_swizzle(const u8* __restrict__ linear, u64 rows, u64 kb,
                                          u8* __restrict__ out) {
    u64 kb_p = (kb + 3) / 4 * 4;
    u64 rows_p = (rows + 127) / 128 * 128;
    u64 idx = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= rows_p * kb_p) return;
    u64 m = idx / kb_p, k = idx % kb_p;
    out[swizzle_offset(m, k, kb)] = (m < rows && k < kb) ? linear[m * kb + k] : (u8)0;
}

// Swizzled -> linear [rows, kb] (padding dropped).
extern "C" __global__ void scales_unswizzle(const u8* __restrict__ swz, u64 rows, u64 kb,
                                            u8* __restrict__ out) {
    u64 idx = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= rows * kb) return;
    u64 m = idx / kb, k = idx % kb;
    out[idx] = swz[swizzle_offset(m, k, kb)];
}

// Codes that differ between two quantizations of the same tensor: counts[0] = differing
// E2M1 codes (nibbles), counts[1] = differing scale bytes.
extern "C" __global__ void count_flips(const u8* __restrict__ a, const u8* __restrict__ b,
                                       u64 n_packed, const u8* __restrict__ sa,
                                       const u8* __restrict__ sb, u64 n_scales,
                                       u64* __restrict__ counts) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    u32 codes = 0, sc = 0;
    if (i < n_packed) {
        u32 d = (u32)(a[i] ^ b[i]);
        codes = ((d & 0xFu) != 0u) + ((d >> 4) != 0u);
    }
    if (i < n_scales) sc = sa[i] != sb[i];
    u32 mask = __activemask();
    u32 c = __reduce_add_sync(mask, codes);
    u32 s = __reduce_add_sync(mask, sc);
    if ((int)(threadIdx.x & 31) == __ffs(mask) - 1) {
        if (c) atomicAdd(&counts[0], (u64)c);
        if (s) atomicAdd(&counts[1], (u64)s);
    }
}
