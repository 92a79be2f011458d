//! Block quantization to FP4 (NVFP4 and MXFP4) and back, exactly as DESIGN.md §2 pins it.
//!
//! NVFP4 follows vLLM's `ref_nvfp4_quant`: every step one IEEE f32 operation, in this order
//! (another order flips codes at ties, which BF16 data hit often):
//! `s = e4m3(min(gs * (vmax * R6), 448))`, `out_scale = rcp(f32(s) * rcp(gs))`,
//! `q = e2m1(clamp(x * out_scale, -6, 6))`.

use super::{e2m1, e4m3, ue8m0};
use rayon::prelude::*;

/// `f32(1/6)`, as the reference multiplies by it (it does not divide by 6).
pub const R6: f32 = 1.0 / 6.0;
/// `6 * 448`: `weight_scale_2 = amax / 2688`.
pub const GS_DENOM: f32 = 2688.0;
/// The seed code's default activation global scale (quant direction): an `input_scale` of
/// 1/2688, which assumes amax = 1.
pub const DEFAULT_GS: f32 = GS_DENOM;

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    /// E2M1, blocks of 16, E4M3 block scales, an f32 global scale.
    Nvfp4,
    /// E2M1, blocks of 32, UE8M0 block scales, no global scale (OCP MX).
    Mxfp4,
}

impl Format {
    pub fn block(self) -> usize {
        match self {
            Format::Nvfp4 => 16,
            Format::Mxfp4 => 32,
        }
    }
    #[inline]
    pub fn decode_scale(self, code: u8) -> f32 {
        match self {
            Format::Nvfp4 => e4m3::decode(code),
            Format::Mxfp4 => ue8m0::decode(code),
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Format::Nvfp4 => "nvfp4",
            Format::Mxfp4 => "mxfp4",
        }
    }
}

/// `1/v`, with `rcp(0) = 0` as the reference's `get_reciprocal`.
#[inline]
pub fn rcp(v: f32) -> f32 {
    if v == 0.0 {
        0.0
    } else {
        1.0 / v
    }
}

/// Whether the pinned recipe's `out_scale = rcp(f32(s) * rcp(gs))` stays finite for every
/// nonzero block scale `s` under the quant-direction global scale `gs`. Past gs ≈ 2^119 the
/// smallest scales (E4M3 subnormals from 2^-9) make `s * rcp(gs)` fall below 2^-128, its
/// reciprocal overflows to inf, and step 3 computes `0 * inf = NaN` for the block's zeros
/// (encoded as -6) and ±6 for all its other elements: garbage codes that look valid. Such a
/// block needs `vmax` below about 1.8e-38 (f32 subnormals), or a tensor amax below about
/// 4e-33 for the weight scale `2688/amax`; callers that choose `gs` refuse it instead.
pub fn out_scale_finite(gs: f32) -> bool {
    rcp(e4m3::decode(1) * rcp(gs)).is_finite()
}

/// The largest `gs` for which [`out_scale_finite`] holds (about 6.6e35), found on the bits
/// (the test is monotone in a positive `gs`).
pub fn max_finite_out_scale_gs() -> f32 {
    let (mut lo, mut hi) = (1.0f32.to_bits(), f32::MAX.to_bits());
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if out_scale_finite(f32::from_bits(mid)) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    f32::from_bits(lo)
}

/// A quantized 2-D tensor `[rows, cols]` (cols along K), block scales in linear layout.
#[derive(Clone, Debug, PartialEq)]
pub struct Fp4Tensor {
    pub format: Format,
    pub rows: usize,
    pub cols: usize,
    /// `[rows, cols/2]`, element 2i in the low nibble.
    pub packed: Vec<u8>,
    /// `[rows, cols/block]` scale codes (E4M3 or UE8M0), linear layout.
    pub scales: Vec<u8>,
    /// Dequant-direction global scale (`weight_scale_2`; `1/gs` for activations; 1 for MXFP4).
    pub scale_2: f32,
}

/// What happened to the blocks while quantizing: the numbers gs-sweep and audit report.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct BlockStats {
    pub blocks: u64,
    /// Block scale at the top of its range (448 for E4M3).
    pub saturated: u64,
    /// Non-zero input whose block scale rounded to zero: the whole block is flushed.
    pub flushed: u64,
    /// Block scale is NaN (NaN in the input, or a NaN global scale).
    pub nan_scales: u64,
}

impl BlockStats {
    fn add(&mut self, o: &BlockStats) {
        self.blocks += o.blocks;
        self.saturated += o.saturated;
        self.flushed += o.flushed;
        self.nan_scales += o.nan_scales;
    }
}

/// Max |x| of a block; NaN if any element is NaN (as `torch.max` propagates it).
/// On the bits: non-negative IEEE values order like their bit patterns (as i32), NaN sorts
/// above infinity, and an integer max has no order to respect, so the loop vectorizes.
#[inline(always)]
fn block_amax(x: &[f32]) -> f32 {
    let m = x
        .iter()
        .map(|v| (v.to_bits() & 0x7FFF_FFFF) as i32)
        .fold(0i32, i32::max);
    if m > 0x7F80_0000 {
        f32::NAN
    } else {
        f32::from_bits(m as u32)
    }
}

/// NaN-propagating `min(v, hi)` (torch.clamp semantics; `f32::min` would drop the NaN).
#[inline]
fn clamp_max(v: f32, hi: f32) -> f32 {
    if v > hi {
        hi
    } else {
        v
    }
}

#[inline]
fn clamp6(v: f32) -> f32 {
    v.clamp(-6.0, 6.0)
}

/// Step 1 and 2 of a block: its E4M3 scale code and `out_scale`, given `rgs = rcp(gs)`.
#[inline(always)]
fn block_scale(vmax: f32, gs: f32, rgs: f32, stats: &mut BlockStats) -> (u8, f32) {
    let s_code = e4m3::encode_saturating(clamp_max(gs * (vmax * R6), e4m3::MAX));
    let s = e4m3::decode(s_code);
    let out_scale = rcp(s * rgs);
    stats.blocks += 1;
    if e4m3::is_nan(s_code) {
        stats.nan_scales += 1;
    } else if s_code & 0x7F == e4m3::MAX_CODE {
        stats.saturated += 1;
    } else if s_code & 0x7F == 0 && vmax > 0.0 {
        stats.flushed += 1;
    }
    (s_code, out_scale)
}

/// Step 3 of a block: codes first, then pairs, two plain loops the compiler vectorizes.
#[inline(always)]
fn block_codes(x: &[f32], out_scale: f32, packed: &mut [u8]) {
    let mut q = [0u8; 16];
    for (c, &v) in q.iter_mut().zip(x) {
        *c = e2m1::encode(clamp6(v * out_scale));
    }
    for (p, c) in packed.iter_mut().zip(q.chunks_exact(2)) {
        *p = e2m1::pack(c[0], c[1]);
    }
}

/// Quantize one NVFP4 block of 16 with quant-direction global scale `gs`.
/// Writes 8 packed bytes and returns the E4M3 scale code.
#[inline]
pub fn quantize_block_nvfp4(x: &[f32], gs: f32, packed: &mut [u8], stats: &mut BlockStats) -> u8 {
    debug_assert_eq!(x.len(), 16);
    let (s_code, out_scale) = block_scale(block_amax(x), gs, rcp(gs), stats);
    block_codes(x, out_scale, packed);
    s_code
}

/// Quantize a row (`x.len()` a multiple of 16) to NVFP4: the bytes of [`quantize_block_nvfp4`]
/// block after block, computed in stages over groups of blocks (all maxima, then all scales,
/// then all codes) so that each stage runs as straight vector code instead of alternating
/// scalar and vector work 16 elements at a time (~1.6x faster).
pub fn quantize_row_nvfp4(
    x: &[f32],
    gs: f32,
    packed: &mut [u8],
    scales: &mut [u8],
    stats: &mut BlockStats,
) {
    // The same IEEE f32 operations in 256-bit registers where the CPU has them (no FMA is
    // enabled, and Rust never contracts a*b+c on its own): bit-identical, ~1.3x faster.
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2, checked just above.
        unsafe { quantize_row_nvfp4_avx2(x, gs, packed, scales, stats) };
        return;
    }
    quantize_row_nvfp4_impl(x, gs, packed, scales, stats)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn quantize_row_nvfp4_avx2(
    x: &[f32],
    gs: f32,
    packed: &mut [u8],
    scales: &mut [u8],
    stats: &mut BlockStats,
) {
    quantize_row_nvfp4_impl(x, gs, packed, scales, stats)
}

#[inline(always)]
fn quantize_row_nvfp4_impl(
    x: &[f32],
    gs: f32,
    packed: &mut [u8],
    scales: &mut [u8],
    stats: &mut BlockStats,
) {
    // 64 blocks = 4 KiB of input: the group stays in L1 between the stages
    const G: usize = 64;
    let rgs = rcp(gs);
    for ((xg, pg), sg) in x
        .chunks(G * 16)
        .zip(packed.chunks_mut(G * 8))
        .zip(scales.chunks_mut(G))
    {
        let mut vmax = [0f32; G];
        for (m, xb) in vmax.iter_mut().zip(xg.chunks_exact(16)) {
            *m = block_amax(xb);
        }
        let mut out_scale = [0f32; G];
        for ((o, sc), &m) in out_scale.iter_mut().zip(sg.iter_mut()).zip(&vmax) {
            (*sc, *o) = block_scale(m, gs, rgs, stats);
        }
        for ((xb, pb), &o) in xg
            .chunks_exact(16)
            .zip(pg.chunks_exact_mut(8))
            .zip(&out_scale)
        {
            block_codes(xb, o, pb);
        }
    }
}

/// Quantize one MXFP4 block of 32 (OCP MX v1.0: shared exponent `floor(log2 amax) - 2`,
/// elements rounded to nearest even and clamped to ±6).
#[inline]
pub fn quantize_block_mxfp4(x: &[f32], packed: &mut [u8], stats: &mut BlockStats) -> u8 {
    debug_assert_eq!(x.len(), 32);
    let vmax = block_amax(x);
    stats.blocks += 1;
    if vmax.is_nan() {
        stats.nan_scales += 1;
        packed.iter_mut().for_each(|b| *b = 0);
        return ue8m0::NAN;
    }
    let exp = if vmax == 0.0 || vmax.is_infinite() {
        if vmax == 0.0 {
            -127
        } else {
            127
        }
    } else {
        floor_log2(vmax) - 2
    };
    let code = ue8m0::encode_exp(exp);
    if code == 254 {
        stats.saturated += 1;
    }
    let scale = ue8m0::decode(code);
    for i in 0..16 {
        let lo = e2m1::encode(clamp6(x[2 * i] / scale));
        let hi = e2m1::encode(clamp6(x[2 * i + 1] / scale));
        packed[i] = e2m1::pack(lo, hi);
    }
    code
}

/// `floor(log2(v))` for finite v > 0, subnormals included.
fn floor_log2(v: f32) -> i32 {
    let bits = v.to_bits();
    let e = ((bits >> 23) & 0xFF) as i32;
    if e == 0 {
        // subnormal: 2^-149 * mantissa
        -149 + (31 - (bits & 0x7F_FFFF).leading_zeros() as i32)
    } else {
        e - 127
    }
}

/// Quantize `x` (`[rows, cols]`, row-major) to NVFP4 with quant-direction global scale `gs`;
/// the tensor's `scale_2` is `1/gs`.
pub fn quantize_nvfp4(x: &[f32], rows: usize, cols: usize, gs: f32) -> (Fp4Tensor, BlockStats) {
    quantize_with(Format::Nvfp4, x, rows, cols, gs)
}

pub fn quantize_mxfp4(x: &[f32], rows: usize, cols: usize) -> (Fp4Tensor, BlockStats) {
    quantize_with(Format::Mxfp4, x, rows, cols, 1.0)
}

/// The weight global scale: `weight_scale_2 = f32(amax) / 2688`, `gs = 1 / weight_scale_2`.
/// An all-zero (or underflowing) tensor gets `weight_scale_2 = 1/2688` (amax taken as 1) so
/// every scale stays finite. Returns `(weight_scale_2, gs)`.
pub fn weight_global_scale(x: &[f32]) -> (f32, f32) {
    let amax = x
        .par_chunks(1 << 16)
        .map(|c| c.iter().fold(0f32, |m, v| m.max(v.abs())))
        .reduce(|| 0.0, f32::max);
    let ws2 = amax / GS_DENOM;
    let ws2 = if ws2 > 0.0 && ws2.is_finite() && (1.0 / ws2).is_finite() {
        ws2
    } else {
        1.0 / GS_DENOM
    };
    (ws2, 1.0 / ws2)
}

/// Quantize a weight with its own global scale (ModelOpt's `weight_scale_2`); `scale_2` is
/// that `weight_scale_2`, not `1/gs`.
pub fn quantize_weight_nvfp4(x: &[f32], rows: usize, cols: usize) -> (Fp4Tensor, BlockStats) {
    let (ws2, gs) = weight_global_scale(x);
    let (mut t, st) = quantize_nvfp4(x, rows, cols, gs);
    t.scale_2 = ws2;
    (t, st)
}

fn quantize_with(
    format: Format,
    x: &[f32],
    rows: usize,
    cols: usize,
    gs: f32,
) -> (Fp4Tensor, BlockStats) {
    let block = format.block();
    assert_eq!(x.len(), rows * cols, "quantize: data length != rows*cols");
    assert!(
        cols.is_multiple_of(block),
        "quantize: cols not a multiple of the block"
    );
    let kb = cols / block;
    let mut packed = vec![0u8; rows * cols / 2];
    let mut scales = vec![0u8; rows * kb];
    let stats = packed
        .par_chunks_mut(cols / 2)
        .zip(scales.par_chunks_mut(kb))
        .zip(x.par_chunks(cols))
        .with_min_len(16)
        .map(|((p, s), xr)| {
            let mut st = BlockStats::default();
            if format == Format::Nvfp4 {
                quantize_row_nvfp4(xr, gs, p, s, &mut st);
                return st;
            }
            for b in 0..kb {
                let xs = &xr[b * block..(b + 1) * block];
                let ps = &mut p[b * block / 2..(b + 1) * block / 2];
                s[b] = match format {
                    Format::Nvfp4 => quantize_block_nvfp4(xs, gs, ps, &mut st),
                    Format::Mxfp4 => quantize_block_mxfp4(xs, ps, &mut st),
                };
            }
            st
        })
        .reduce(BlockStats::default, |mut a, b| {
            a.add(&b);
            a
        });
    let scale_2 = match format {
        Format::Nvfp4 => 1.0 / gs,
        Format::Mxfp4 => 1.0,
    };
    (
        Fp4Tensor {
            format,
            rows,
            cols,
            packed,
            scales,
            scale_2,
        },
        stats,
    )
}

impl Fp4Tensor {
    pub fn blocks_per_row(&self) -> usize {
        self.cols / self.format.block()
    }

    /// `x̂ = (e2m1(q) * f32(s)) * scale_2` in f32; the first product is exact.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.rows * self.cols];
        self.dequantize_into(&mut out);
        out
    }

    pub fn dequantize_into(&self, out: &mut [f32]) {
        let (cols, block, kb) = (self.cols, self.format.block(), self.blocks_per_row());
        out.par_chunks_mut(cols)
            .zip(self.packed.par_chunks(cols / 2))
            .zip(self.scales.par_chunks(kb))
            .with_min_len(16)
            .for_each(|((o, p), s)| dequantize_row(self.format, p, s, self.scale_2, block, o));
    }

    /// One row, dequantized.
    pub fn dequantize_row(&self, r: usize) -> Vec<f32> {
        let (cols, kb) = (self.cols, self.blocks_per_row());
        let mut o = vec![0f32; cols];
        dequantize_row(
            self.format,
            &self.packed[r * cols / 2..(r + 1) * cols / 2],
            &self.scales[r * kb..(r + 1) * kb],
            self.scale_2,
            self.format.block(),
            &mut o,
        );
        o
    }

    /// The E2M1 code of element (r, c).
    pub fn code(&self, r: usize, c: usize) -> u8 {
        let byte = self.packed[r * self.cols / 2 + c / 2];
        if c.is_multiple_of(2) {
            byte & 0xF
        } else {
            byte >> 4
        }
    }
}

/// Dequantize one row from its packed bytes and scale codes.
pub fn dequantize_row(
    format: Format,
    packed: &[u8],
    scales: &[u8],
    scale_2: f32,
    block: usize,
    out: &mut [f32],
) {
    for (b, &sc) in scales.iter().enumerate() {
        let s = format.decode_scale(sc);
        let base = b * block;
        for i in 0..block / 2 {
            let (lo, hi) = e2m1::unpack(packed[base / 2 + i]);
            out[base + 2 * i] = (e2m1::decode(lo) * s) * scale_2;
            out[base + 2 * i + 1] = (e2m1::decode(hi) * s) * scale_2;
        }
    }
}

/// Quantize then dequantize (fake-quant) activations with global scale `gs`.
pub fn fake_quant_nvfp4(x: &[f32], rows: usize, cols: usize, gs: f32) -> (Vec<f32>, BlockStats) {
    let (t, st) = quantize_nvfp4(x, rows, cols, gs);
    (t.dequantize(), st)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_distr::{Distribution, StandardNormal};

    fn rng() -> rand_chacha::ChaCha8Rng {
        rand_chacha::ChaCha8Rng::seed_from_u64(rand::random())
    }

    #[test]
    fn block_follows_the_reference_steps() {
        // vmax = 6 at gs = 448: s = e4m3(448 * 1) = 448, out_scale = 1/(448/448) = 1
        let mut x = [0.3f32; 16];
        x[3] = -6.0;
        x[4] = 2.5; // tie -> 2
        x[5] = 0.25; // tie -> 0
        let mut p = [0u8; 8];
        let mut st = BlockStats::default();
        let s = quantize_block_nvfp4(&x, 448.0, &mut p, &mut st);
        assert_eq!(s, e4m3::MAX_CODE);
        assert_eq!(st.saturated, 1);
        assert_eq!(e2m1::unpack(p[1]), (0x1, 0xF)); // x[2]=0.3->0.5, x[3]=-6
        assert_eq!(e2m1::unpack(p[2]), (0x4, 0x0));
    }

    #[test]
    fn saturated_scale_clips_codes_instead_of_nan() {
        // gs so large that gs*vmax/6 >> 448: scale saturates at 448, never NaN
        let x: Vec<f32> = (0..16).map(|i| i as f32 - 7.5).collect();
        let (t, st) = quantize_nvfp4(&x, 1, 16, 1e6);
        assert_eq!(t.scales[0], e4m3::MAX_CODE);
        assert_eq!(st.saturated, 1);
        assert!(t.dequantize().iter().all(|v| v.is_finite()));
    }

    #[test]
    fn tiny_gs_flushes_blocks_to_zero() {
        let x: Vec<f32> = (0..32).map(|i| (i as f32 + 1.0) * 1e-3).collect();
        let (t, st) = quantize_nvfp4(&x, 1, 32, 1e-3);
        assert_eq!(st.flushed, 2);
        assert!(t.dequantize().iter().all(|&v| v == 0.0));
    }

    #[test]
    fn subnormal_block_scale() {
        // gs*vmax/6 = 3 * 2^-9: a subnormal E4M3 scale, still exact
        let gs = 1.0;
        let vmax = 6.0 * 3.0 / 512.0;
        let mut x = vec![vmax / 3.0; 16];
        x[0] = vmax;
        let (t, _) = quantize_nvfp4(&x, 1, 16, gs);
        assert_eq!(t.scales[0], 0x03);
        let d = t.dequantize();
        assert_eq!(d[0], vmax);
    }

    #[test]
    fn zero_tensor_gets_finite_scales() {
        let x = vec![0f32; 64];
        let (t, st) = quantize_weight_nvfp4(&x, 2, 32);
        assert!(t.scale_2.is_finite() && t.scale_2 > 0.0);
        assert!(t.scales.iter().all(|&s| s == 0));
        assert_eq!(st.flushed, 0);
        assert!(t.dequantize().iter().all(|&v| v == 0.0));
    }

    #[test]
    fn nan_input_gives_a_nan_scale_that_is_reported() {
        let mut x = vec![1f32; 32];
        x[17] = f32::NAN;
        let (t, st) = quantize_nvfp4(&x, 1, 32, 100.0);
        assert_eq!(st.nan_scales, 1);
        assert!(e4m3::is_nan(t.scales[1]));
        assert!(!e4m3::is_nan(t.scales[0]));
    }

    #[test]
    fn weight_round_trip_error_is_within_the_format_bound() {
        let mut r = rng();
        let (rows, cols) = (64, 256);
        let x: Vec<f32> = (0..rows * cols)
            .map(|_| {
                let v: f32 = StandardNormal.sample(&mut r);
                v * r.gen_range(0.01f32..3.0)
            })
            .collect();
        let (t, _) = quantize_weight_nvfp4(&x, rows, cols);
        let d = t.dequantize();
        // Per element: |err| <= half the E2M1 step at the element's magnitude in units of
        // the block scale (at most 1 unit, at 4..6), plus the scale's rounding (<= 1/16 rel).
        for (b, (xs, ds)) in x.chunks(16).zip(d.chunks(16)).enumerate() {
            let vmax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
            let s = e4m3::decode(t.scales[b]) * t.scale_2;
            for (&xi, &di) in xs.iter().zip(ds) {
                let bound = s * 1.0 + vmax * (1.0 / 16.0) + 1e-6;
                assert!((xi - di).abs() <= bound, "x {xi} dq {di} s {s}");
            }
        }
        let err: f64 = x
            .iter()
            .zip(&d)
            .map(|(a, b)| ((a - b) as f64).powi(2))
            .sum();
        let nrm: f64 = x.iter().map(|a| (*a as f64).powi(2)).sum();
        let rel = (err / nrm).sqrt();
        assert!(rel > 0.05 && rel < 0.15, "rel-L2 {rel}");
    }

    #[test]
    fn mxfp4_round_trip() {
        let mut r = rng();
        let x: Vec<f32> = (0..8 * 64).map(|_| StandardNormal.sample(&mut r)).collect();
        let (t, _) = quantize_mxfp4(&x, 8, 64);
        assert_eq!(t.scales.len(), 16);
        let d = t.dequantize();
        for (b, (xs, ds)) in x.chunks(32).zip(d.chunks(32)).enumerate() {
            let s = ue8m0::decode(t.scales[b]);
            for (&xi, &di) in xs.iter().zip(ds) {
                // amax/scale < 8, so clipping at 6 can cost up to 2 units; rounding 1 unit
                assert!((xi - di).abs() <= 2.0 * s, "x {xi} dq {di} s {s}");
            }
        }
        // a power of two times a code is exact
        let x = vec![3.0f32; 32];
        let (t, _) = quantize_mxfp4(&x, 1, 32);
        assert_eq!(t.dequantize(), x);
    }

    #[test]
    fn floor_log2_is_exact() {
        for e in -149..128 {
            let v = 2f64.powi(e) as f32;
            assert_eq!(floor_log2(v), e);
            if e > -149 && e < 127 {
                assert_eq!(floor_log2(v * 1.5), e);
            }
        }
    }
}
