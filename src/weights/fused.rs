//! Metrics of two NVFP4 matrices of one geometry in one pass: each 16-element block of both
//! sides is dequantized into registers and folded into the f64 sums of [`Accum`], without
//! writing the values out. The reference side may also be BF16 ([`Ref::Bf16`]: a
//! checkpoint's BF16 originals, an engine that dequantized at load); its values are read
//! straight from the map. Dequantizing into buffers and then running `Accum::over` cost
//! ~4x the memory traffic and one serial chain of f64 adds per sum; here the sums run in
//! [`LANES`] independent lanes.
//!
//! Three bodies, the widest the CPU has picked once per matrix pair (`Path`): AVX-512
//! (per-scale-code f64 tables, 8-lane sums, row-level checks; `avx512`; against a BF16
//! reference only the test side is tabled and checks are per block), AVX2 + FMA (a table per
//! block in one register; `avx2`) and the portable one. The tests run every body the CPU has
//! against the reference.
//!
//! What the reference (`compare::metrics_qq`, `compare::metrics_any` for a BF16 side) gives,
//! and what this keeps:
//! - every value is the same f32 `(e2m1(q) * scale) * scale_2`, read from a per-block table
//!   built with exactly those two multiplications;
//! - `max_abs_err` and its index are bit-identical (the same f64 differences; the first index
//!   of the largest);
//! - NaN/Inf counts and first indices are identical: a block whose table holds a non-finite
//!   value (NaN scale code, overflow through `scale_2`), or whose BF16 values do, goes
//!   through `Accum::over` itself;
//! - the f64 sums (dot, norms, squared error) differ only in summation order (and, in the
//!   AVX-512 body, a fused `d·d + err`): a few ulps, within the 1e-9 relative the engines are
//!   held to (`tests/gpu_compare_weights.rs`).

use super::compare::DView;
use super::view::QMatrix;
use crate::metrics::{Accum, Metrics};
use crate::nvfp4::{e2m1, e4m3, Format};
use rayon::prelude::*;
use safetensors::Dtype;
use std::sync::atomic::AtomicU64;

/// Elements per parallel piece (whole rows), as in `compare::metrics_qq`.
const CHUNK: usize = 1 << 16;
/// Independent f64 partial sums per quantity: two AVX2 vectors, and short add chains.
const LANES: usize = 8;
const BLOCK: usize = 16;

/// The reference side (A) of a fused pass.
#[derive(Clone, Copy)]
pub enum Ref<'r, 'a> {
    /// NVFP4, like the test side.
    Q(&'r QMatrix<'a>),
    /// BF16 values `[rows, cols]`.
    Bf16(&'r DView<'a>),
}

/// `None` unless both sides are NVFP4 with one shape (the caller takes the general path).
pub fn metrics_nvfp4(a: &QMatrix, b: &QMatrix) -> Option<Metrics> {
    let same = (a.rows, a.cols) == (b.rows, b.cols);
    if !same || a.format != Format::Nvfp4 {
        return None;
    }
    fused(Ref::Q(a), b, Path::detect(a, b))
}

/// NVFP4 `b` (test) against BF16 `a` (reference) of its shape; `None` otherwise.
pub fn metrics_bf16_nvfp4(a: &DView, b: &QMatrix) -> Option<Metrics> {
    let same = a.mat.rows == b.rows && a.mat.row_bytes == 2 * b.cols;
    if !same || a.dtype != Dtype::BF16 {
        return None;
    }
    fused(Ref::Bf16(a), b, Path::detect_bf16(b))
}

fn fused(a: Ref, b: &QMatrix, path: Path) -> Option<Metrics> {
    if b.format != Format::Nvfp4 || !b.cols.is_multiple_of(BLOCK) || b.rows == 0 || b.cols == 0 {
        return None;
    }
    let rows_per = (CHUNK / b.cols).max(1);
    let n_chunks = b.rows.div_ceil(rows_per);
    let best = AtomicU64::new(0);
    // merged in order: the same bits on every run, whatever thread did which piece
    let parts: Vec<Accum> = (0..n_chunks)
        .into_par_iter()
        .map(|c| path.rows(a, b, &best, c * rows_per, ((c + 1) * rows_per).min(b.rows)))
        .collect();
    Some(
        parts
            .into_iter()
            .fold(Accum::default(), Accum::merge)
            .finish(),
    )
}

/// The widest body this CPU runs, picked once per matrix pair.
enum Path {
    /// AVX-512 with both sides' per-scale-code tables built up front.
    #[cfg(target_arch = "x86_64")]
    Avx512(Box<[avx512::Tables; 2]>),
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// AVX-512 against a BF16 reference: the test side's tables only.
    #[cfg(target_arch = "x86_64")]
    Avx512Bf16(Box<avx512::Tables>),
    Portable,
}

impl Path {
    fn detect(a: &QMatrix, b: &QMatrix) -> Path {
        #[cfg(target_arch = "x86_64")]
        {
            if avx512::available() {
                return Path::Avx512(Box::new([
                    avx512::Tables::new(a.scale_2),
                    avx512::Tables::new(b.scale_2),
                ]));
            }
            if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                return Path::Avx2;
            }
        }
        let _ = (a, b);
        Path::Portable
    }

    /// A BF16 reference has no tables: only the test side's.
    fn detect_bf16(b: &QMatrix) -> Path {
        #[cfg(target_arch = "x86_64")]
        {
            if avx512::available() {
                return Path::Avx512Bf16(Box::new(avx512::Tables::new(b.scale_2)));
            }
            if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                return Path::Avx2;
            }
        }
        let _ = b;
        Path::Portable
    }

    /// `best`: the largest maximum |difference| any piece has found (f64 bits); only the
    /// AVX-512 body uses it.
    fn rows(&self, a: Ref, b: &QMatrix, best: &AtomicU64, r0: usize, r1: usize) -> Accum {
        match (self, a) {
            // SAFETY: `detect` saw AVX-512 F/DQ
            #[cfg(target_arch = "x86_64")]
            (Path::Avx512(t), Ref::Q(a)) => unsafe {
                avx512::rows(a, b, &t[0], &t[1], best, r0, r1)
            },
            // SAFETY: `detect_bf16` saw AVX-512 F/DQ
            #[cfg(target_arch = "x86_64")]
            (Path::Avx512Bf16(t), Ref::Bf16(a)) => unsafe { avx512::rows_bf16(a, b, t, r0, r1) },
            // SAFETY: `detect` / `detect_bf16` saw AVX2 and FMA
            #[cfg(target_arch = "x86_64")]
            (Path::Avx2, a) => unsafe { avx2::rows(a, b, r0, r1) },
            _ => rows_body(a, b, r0, r1),
        }
    }
}

/// What a difference must exceed to become the maximum: -1 until the first block sets it;
/// NaN once a NaN reference value took it, as in `Accum::over`, where nothing exceeds NaN.
fn running_max(acc: &Accum) -> f64 {
    if acc.max_idx.is_some() {
        acc.max_abs
    } else {
        -1.0
    }
}

/// `(e2m1(c) * scale) * scale_2` for the 16 codes: the reference's two f32 multiplications.
#[inline(always)]
fn table(scale_code: u8, scale_2: f32) -> [f32; BLOCK] {
    let s = e4m3::decode(scale_code);
    let mut t = [0f32; BLOCK];
    for (c, v) in t.iter_mut().enumerate() {
        *v = (e2m1::decode(c as u8) * s) * scale_2;
    }
    t
}

#[inline(always)]
fn values(t: &[f32; BLOCK], packed: &[u8]) -> [f32; BLOCK] {
    let mut v = [0f32; BLOCK];
    for (i, &byte) in packed.iter().enumerate().take(BLOCK / 2) {
        v[2 * i] = t[(byte & 0xF) as usize];
        v[2 * i + 1] = t[(byte >> 4) as usize];
    }
    v
}

/// BF16 `bytes` (2 a value) as f32: exact.
#[inline(always)]
fn bf16_values(bytes: &[u8]) -> [f32; BLOCK] {
    let mut v = [0f32; BLOCK];
    for (o, h) in v.iter_mut().zip(bytes.chunks_exact(2)) {
        *o = f32::from_bits((u16::from_le_bytes([h[0], h[1]]) as u32) << 16);
    }
    v
}

/// Block `j` of row `r` of the reference side, and whether all its values are finite.
#[inline(always)]
fn ref_block(a: Ref, r: usize, j: usize) -> ([f32; BLOCK], bool) {
    match a {
        Ref::Q(q) => {
            let t = table(q.scale_row(r)[j], q.scale_2);
            let x = values(&t, &q.packed.row(r)[j * BLOCK / 2..(j + 1) * BLOCK / 2]);
            // entry 7 (6 · scale · scale_2) has the largest magnitude: when it is finite, so
            // is every entry (NaN scales, Inf and 0 · Inf all show there)
            (x, t[7].is_finite())
        }
        Ref::Bf16(d) => {
            let x = bf16_values(&d.mat.row(r)[j * 2 * BLOCK..(j + 1) * 2 * BLOCK]);
            (x, x.iter().all(|v| v.is_finite()))
        }
    }
}

#[inline(always)]
fn rows_body(a: Ref, b: &QMatrix, r0: usize, r1: usize) -> Accum {
    let (cols, kb) = (b.cols, b.kb());
    let mut acc = Accum::default();
    let (mut dot, mut nt, mut nr, mut err) =
        ([0f64; LANES], [0f64; LANES], [0f64; LANES], [0f64; LANES]);
    for r in r0..r1 {
        let (pb, sb) = (b.packed.row(r), b.scale_row(r));
        for j in 0..kb {
            let (x, x_finite) = ref_block(a, r, j);
            let tb = table(sb[j], b.scale_2);
            let y = values(&tb, &pb[j * BLOCK / 2..(j + 1) * BLOCK / 2]);
            let at = r * cols + j * BLOCK;
            if !(x_finite && tb[7].is_finite()) {
                acc = acc.merge(Accum::over(&y, &x, at));
                continue;
            }
            let mut dabs = [0f64; BLOCK];
            for i in 0..BLOCK {
                let (t, rf) = (y[i] as f64, x[i] as f64);
                let d = t - rf;
                let l = i % LANES;
                dot[l] += t * rf;
                nt[l] += t * t;
                nr[l] += rf * rf;
                err[l] += d * d;
                dabs[i] = d.abs();
            }
            let m = dabs.iter().fold(0f64, |m, &v| m.max(v));
            if m > acc.max_abs || acc.max_idx.is_none() {
                let i = dabs.iter().position(|&v| v == m).unwrap_or(0);
                acc.max_abs = m;
                acc.max_idx = Some(at + i);
            }
        }
    }
    acc.dot += dot.iter().sum::<f64>();
    acc.nt += nt.iter().sum::<f64>();
    acc.nr += nr.iter().sum::<f64>();
    acc.err += err.iter().sum::<f64>();
    acc.len = (r1 - r0) * cols;
    acc
}

/// The same blocks with AVX2: a block's 8 positive table entries sit in one register, the
/// codes index it (`vpermps`) and the sign bit is put back with an XOR (negation is exact, so
/// this is the reference's `(-v * s) * g` bit for bit); sums in 4-wide f64 lanes, two
/// registers per quantity. FMA only where the product is exact (an f32 times an f32 fits an
/// f64), so it rounds as a multiply then an add; the squared error keeps the two steps. A
/// BF16 reference block is two 8-value loads, widened to f32 by a shift.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{QMatrix, Ref, BLOCK};
    use crate::metrics::Accum;
    use crate::nvfp4::{e2m1, e4m3};
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx2,fma")]
    unsafe fn table(scale_code: u8, scale_2: f32, pos: __m256) -> __m256 {
        let s = _mm256_set1_ps(e4m3::decode(scale_code));
        _mm256_mul_ps(_mm256_mul_ps(pos, s), _mm256_set1_ps(scale_2))
    }

    /// Elements `8h..8h + 8` of a block: nibble k of the 4 bytes `w` is element k.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn decode8(t: __m256, w: u32) -> __m256 {
        let codes = _mm256_and_si256(
            _mm256_srlv_epi32(
                _mm256_set1_epi32(w as i32),
                _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28),
            ),
            _mm256_set1_epi32(0xF),
        );
        let sign = _mm256_slli_epi32(_mm256_and_si256(codes, _mm256_set1_epi32(8)), 28);
        _mm256_xor_ps(
            _mm256_permutevar8x32_ps(t, codes),
            _mm256_castsi256_ps(sign),
        )
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn finite(t: __m256) -> bool {
        let abs = _mm256_andnot_ps(_mm256_set1_ps(-0.0), t);
        _mm256_movemask_ps(_mm256_cmp_ps(
            abs,
            _mm256_set1_ps(f32::INFINITY),
            _CMP_LT_OQ,
        )) == 0xFF
    }

    /// Bytes `4h..4h + 4` of a block's 8 packed bytes, little-endian.
    #[inline(always)]
    fn word(b: &[u8], h: usize) -> u32 {
        u32::from_le_bytes([b[4 * h], b[4 * h + 1], b[4 * h + 2], b[4 * h + 3]])
    }

    /// 8 BF16 values (16 bytes) as f32: exact.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn bf16x8(b: &[u8]) -> __m256 {
        debug_assert!(b.len() >= 16);
        let h = _mm_loadu_si128(b.as_ptr() as *const __m128i);
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn store16(v: [__m256; 2]) -> [f32; BLOCK] {
        let mut o = [0f32; BLOCK];
        _mm256_storeu_ps(o.as_mut_ptr(), v[0]);
        _mm256_storeu_ps(o.as_mut_ptr().add(8), v[1]);
        o
    }

    /// Block `j` of row `r` of the reference side in two registers (elements 0-7, 8-15),
    /// and whether all its values are finite. An NVFP4 block is its table read by `decode8`:
    /// the same bits as the portable `values` (the sign put back by XOR is negation).
    #[target_feature(enable = "avx2,fma")]
    unsafe fn ref_block(a: Ref, r: usize, j: usize, pos: __m256) -> ([__m256; 2], bool) {
        match a {
            Ref::Q(q) => {
                let t = table(q.scale_row(r)[j], q.scale_2, pos);
                let b = &q.packed.row(r)[j * 8..j * 8 + 8];
                ([decode8(t, word(b, 0)), decode8(t, word(b, 1))], finite(t))
            }
            Ref::Bf16(d) => {
                let b = &d.mat.row(r)[j * 2 * BLOCK..(j + 1) * 2 * BLOCK];
                let x = [bf16x8(&b[..16]), bf16x8(&b[16..])];
                (x, finite(x[0]) && finite(x[1]))
            }
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn rows(a: Ref, b: &QMatrix, r0: usize, r1: usize) -> Accum {
        let (cols, kb) = (b.cols, b.kb());
        let mut pos = [0f32; 8];
        for (c, v) in pos.iter_mut().enumerate() {
            *v = e2m1::decode(c as u8);
        }
        let pos = _mm256_loadu_ps(pos.as_ptr());
        let sign = _mm256_set1_pd(-0.0);
        let z = _mm256_setzero_pd();
        let (mut dot, mut nt, mut nr, mut err) = ([z; 2], [z; 2], [z; 2], [z; 2]);
        let mut acc = Accum::default();
        // the running maximum, broadcast: a block is looked at element by element only when
        // one of its differences exceeds it
        let current = |acc: &Accum| _mm256_set1_pd(super::running_max(acc));
        let mut cur = current(&acc);
        for r in r0..r1 {
            let (pb, sb) = (b.packed.row(r), b.scale_row(r));
            for j in 0..kb {
                let (xs, x_finite) = ref_block(a, r, j, pos);
                let tb = table(sb[j], b.scale_2, pos);
                let bb = &pb[j * 8..j * 8 + 8];
                let ys = [decode8(tb, word(bb, 0)), decode8(tb, word(bb, 1))];
                let at = r * cols + j * BLOCK;
                if !(x_finite && finite(tb)) {
                    acc = acc.merge(Accum::over(&store16(ys), &store16(xs), at));
                    cur = current(&acc);
                    continue;
                }
                let mut m = z;
                for h in 0..2 {
                    let (x8, y8) = (xs[h], ys[h]);
                    for (k, (x4, y4)) in [
                        (_mm256_castps256_ps128(x8), _mm256_castps256_ps128(y8)),
                        (_mm256_extractf128_ps(x8, 1), _mm256_extractf128_ps(y8, 1)),
                    ]
                    .into_iter()
                    .enumerate()
                    {
                        let (x, y) = (_mm256_cvtps_pd(x4), _mm256_cvtps_pd(y4));
                        let d = _mm256_sub_pd(y, x);
                        dot[k] = _mm256_fmadd_pd(y, x, dot[k]);
                        nt[k] = _mm256_fmadd_pd(y, y, nt[k]);
                        nr[k] = _mm256_fmadd_pd(x, x, nr[k]);
                        err[k] = _mm256_add_pd(err[k], _mm256_mul_pd(d, d));
                        m = _mm256_max_pd(m, _mm256_andnot_pd(sign, d));
                    }
                }
                if _mm256_movemask_pd(_mm256_cmp_pd(m, cur, _CMP_GT_OQ)) != 0 {
                    // rare: the block's maximum and its first element
                    let mut lanes = [0f64; 4];
                    _mm256_storeu_pd(lanes.as_mut_ptr(), m);
                    let mb = lanes[0].max(lanes[1]).max(lanes[2].max(lanes[3]));
                    let (x, y) = (store16(xs), store16(ys));
                    let i = (0..BLOCK)
                        .position(|i| (y[i] as f64 - x[i] as f64).abs() == mb)
                        .unwrap_or(0);
                    acc.max_abs = mb;
                    acc.max_idx = Some(at + i);
                    cur = current(&acc);
                }
            }
        }
        let sum = |v: [__m256d; 2]| {
            let mut l = [0f64; 4];
            _mm256_storeu_pd(l.as_mut_ptr(), _mm256_add_pd(v[0], v[1]));
            (l[0] + l[1]) + (l[2] + l[3])
        };
        acc.dot += sum(dot);
        acc.nt += sum(nt);
        acc.nr += sum(nr);
        acc.err += sum(err);
        acc.len = (r1 - r0) * cols;
        acc
    }
}

/// AVX-512: the 16 values of every scale code are tabled once per matrix as f64 (exact
/// widenings of the reference's f32 `(e2m1 · scale) · scale_2`), so a block is two
/// `vpermt2pd` lookups per side (even and odd elements, straight from the packed bytes) and
/// eight f64 lanes of sums, with no per-block table and no f32 → f64 conversion. The squared
/// error is fused (`d·d + err` rounds once); the max |difference| is `vrangepd` (exact).
///
/// Checks move from blocks to rows: a row whose scale codes all give finite tables (one
/// vectorized max over its codes) runs with no per-block branch, and its maximum |difference|
/// is compared with the running one once, at the row's end; only a row that beats it is
/// walked again for the first index. Other rows take the per-block path of the AVX2 body.
///
/// Pieces run in parallel and each starts with no maximum, so each would walk its early rows
/// again as its own maximum rises. They share the largest maximum found so far (`best`): a
/// row or block below it cannot hold the answer, and its index is not looked for. A piece
/// whose maximum reaches the final one finds that value's first index as before (ties are
/// not skipped), so the merged answer is the same whatever the threads did.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{DView, QMatrix, BLOCK};
    use crate::metrics::Accum;
    use std::arch::x86_64::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    /// Bytes ahead of the current block that the packed rows are prefetched: the hardware
    /// prefetcher stops at 4 KiB pages of the mapped files, and measured 0.63 → 0.55 s on the
    /// 3.2 GB all-differ pair (2048 to 8192 alike).
    const PREFETCH: usize = 2048;

    pub fn available() -> bool {
        std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("avx512dq")
    }

    #[repr(C, align(64))]
    #[derive(Clone, Copy)]
    struct Row([f64; BLOCK]);

    /// One side's block values for each of the 256 scale codes.
    pub struct Tables {
        rows: Vec<Row>,
        /// The smallest scale-code magnitude (`code & 0x7F`) whose values are not all finite:
        /// every code below it is finite (a code and its negation are alike). E4M3 magnitudes
        /// grow with the code and 0x7F is NaN, so above it there are none either; were there,
        /// they would only take the slower per-block path.
        limit: u8,
    }

    impl Tables {
        pub fn new(scale_2: f32) -> Tables {
            let tables: Vec<[f32; BLOCK]> =
                (0..256).map(|c| super::table(c as u8, scale_2)).collect();
            let finite = |c: usize| tables[c].iter().all(|v| v.is_finite());
            let limit = (0..0x80).find(|&c| !finite(c)).unwrap_or(0x7F) as u8;
            Tables {
                rows: tables.iter().map(|t| Row(t.map(f64::from))).collect(),
                limit,
            }
        }

        fn finite(&self, code: u8) -> bool {
            code & 0x7F < self.limit
        }

        fn all_finite(&self, codes: &[u8]) -> bool {
            codes.iter().fold(0u8, |m, &c| m.max(c & 0x7F)) < self.limit
        }
    }

    /// Four quantities in 2 × 8 f64 lanes (even and odd elements of a block).
    #[derive(Clone, Copy)]
    struct Sums {
        dot: [__m512d; 2],
        nt: [__m512d; 2],
        nr: [__m512d; 2],
        err: [__m512d; 2],
    }

    /// A block's even and odd elements from its 8 packed bytes: the low nibbles, which
    /// `vpermt2pd` reads as the low 4 bits of each index, then the high ones.
    #[target_feature(enable = "avx512f,avx512dq")]
    unsafe fn lookup(t: &Row, bytes: *const u8) -> [__m512d; 2] {
        let (t0, t1) = (
            _mm512_load_pd(t.0.as_ptr()),
            _mm512_load_pd(t.0.as_ptr().add(8)),
        );
        let idx = _mm512_cvtepu8_epi64(_mm_loadl_epi64(bytes as *const __m128i));
        [
            _mm512_permutex2var_pd(t0, idx, t1),
            _mm512_permutex2var_pd(t0, _mm512_srli_epi64::<4>(idx), t1),
        ]
    }

    /// Adds one finite block to `s`; returns `m` raised to the block's largest |difference|.
    /// `ba`, `bb`: the block's 8 packed bytes on each side.
    #[target_feature(enable = "avx512f,avx512dq")]
    unsafe fn block(
        ta: &Row,
        tb: &Row,
        ba: *const u8,
        bb: *const u8,
        s: &mut Sums,
        m: __m512d,
    ) -> __m512d {
        sums(lookup(ta, ba), lookup(tb, bb), s, m)
    }

    /// [`block`] of values already in registers (`x` the reference, `y` the test side).
    #[target_feature(enable = "avx512f,avx512dq")]
    unsafe fn sums(x: [__m512d; 2], y: [__m512d; 2], s: &mut Sums, m: __m512d) -> __m512d {
        let mut d = [_mm512_setzero_pd(); 2];
        for k in 0..2 {
            d[k] = _mm512_sub_pd(y[k], x[k]);
            s.dot[k] = _mm512_fmadd_pd(y[k], x[k], s.dot[k]);
            s.nt[k] = _mm512_fmadd_pd(y[k], y[k], s.nt[k]);
            s.nr[k] = _mm512_fmadd_pd(x[k], x[k], s.nr[k]);
            s.err[k] = _mm512_fmadd_pd(d[k], d[k], s.err[k]);
        }
        // imm 0b1011: the larger magnitude, sign cleared; the block's own maximum first, so
        // the chain carried from block to block is one instruction long
        _mm512_range_pd::<0b1011>(m, _mm512_range_pd::<0b1011>(d[0], d[1]))
    }

    #[target_feature(enable = "avx512f,avx512dq")]
    pub unsafe fn rows(
        a: &QMatrix,
        b: &QMatrix,
        ta: &Tables,
        tb: &Tables,
        best: &AtomicU64,
        r0: usize,
        r1: usize,
    ) -> Accum {
        let (cols, kb) = (a.cols, a.kb());
        let z = _mm512_setzero_pd();
        let mut s = Sums {
            dot: [z; 2],
            nt: [z; 2],
            nr: [z; 2],
            err: [z; 2],
        };
        let mut acc = Accum::default();
        let current = |acc: &Accum| _mm512_set1_pd(super::running_max(acc));
        // the flat index of the first element of row `r`, from block `j0` on, whose
        // |difference| is `mb` (finite blocks only: the others went through `Accum::over`)
        let first_of = |r: usize, j0: usize, mb: f64| {
            let (pa, pb) = (a.packed.row(r).as_ptr(), b.packed.row(r).as_ptr());
            let target = _mm512_set1_pd(mb);
            for j in j0..kb {
                let (ca, cb) = (a.scale_row(r)[j], b.scale_row(r)[j]);
                if !(ta.finite(ca) && tb.finite(cb)) {
                    continue;
                }
                let x = lookup(&ta.rows[ca as usize], pa.add(j * 8));
                let y = lookup(&tb.rows[cb as usize], pb.add(j * 8));
                let hit = |k: usize| {
                    let d = _mm512_abs_pd(_mm512_sub_pd(y[k], x[k]));
                    let lanes = _mm512_cmp_pd_mask::<_CMP_EQ_OQ>(d, target);
                    // lane l of the even (odd) half is element 2l (2l + 1)
                    (lanes != 0).then(|| 2 * lanes.trailing_zeros() as usize + k)
                };
                if let Some(i) = [hit(0), hit(1)].into_iter().flatten().min() {
                    return r * cols + j * BLOCK + i;
                }
            }
            r * cols + j0 * BLOCK
        };
        // `m`'s maximum when it beats this piece's and is not below every piece's best
        let beats = |m: __m512d, cur: __m512d| {
            if _mm512_cmp_pd_mask::<_CMP_GT_OQ>(m, cur) == 0 {
                return None;
            }
            let mb = _mm512_reduce_max_pd(m);
            (mb >= f64::from_bits(best.load(Ordering::Relaxed))).then_some(mb)
        };
        // non-negative f64s order as their bits do
        let publish = |mb: f64| best.fetch_max(mb.to_bits(), Ordering::Relaxed);
        let mut cur = current(&acc);
        for r in r0..r1 {
            let (pa, pb) = (a.packed.row(r).as_ptr(), b.packed.row(r).as_ptr());
            let (sa, sb) = (a.scale_row(r), b.scale_row(r));
            if ta.all_finite(sa) && tb.all_finite(sb) {
                let mut m = z;
                for j in 0..kb {
                    if j % 8 == 0 {
                        // one cache line per 8 blocks on each side
                        let ahead = j * 8 + PREFETCH;
                        _mm_prefetch::<_MM_HINT_T0>(pa.wrapping_add(ahead) as *const i8);
                        _mm_prefetch::<_MM_HINT_T0>(pb.wrapping_add(ahead) as *const i8);
                    }
                    let (ca, cb) = (*sa.get_unchecked(j), *sb.get_unchecked(j));
                    m = block(
                        ta.rows.get_unchecked(ca as usize),
                        tb.rows.get_unchecked(cb as usize),
                        pa.add(j * 8),
                        pb.add(j * 8),
                        &mut s,
                        m,
                    );
                }
                if let Some(mb) = beats(m, cur) {
                    acc.max_abs = mb;
                    acc.max_idx = Some(first_of(r, 0, mb));
                    cur = current(&acc);
                    publish(mb);
                }
                continue;
            }
            for j in 0..kb {
                let (ca, cb) = (sa[j], sb[j]);
                let at = r * cols + j * BLOCK;
                if !(ta.finite(ca) && tb.finite(cb)) {
                    let (x, y) = (
                        super::values(&super::table(ca, a.scale_2), &a.packed.row(r)[j * 8..]),
                        super::values(&super::table(cb, b.scale_2), &b.packed.row(r)[j * 8..]),
                    );
                    acc = acc.merge(Accum::over(&y, &x, at));
                    cur = current(&acc);
                    continue;
                }
                let m = block(
                    &ta.rows[ca as usize],
                    &tb.rows[cb as usize],
                    pa.add(j * 8),
                    pb.add(j * 8),
                    &mut s,
                    z,
                );
                if let Some(mb) = beats(m, cur) {
                    acc.max_abs = mb;
                    acc.max_idx = Some(first_of(r, j, mb));
                    cur = current(&acc);
                    publish(mb);
                }
            }
        }
        let sum = |v: [__m512d; 2]| _mm512_reduce_add_pd(_mm512_add_pd(v[0], v[1]));
        acc.dot += sum(s.dot);
        acc.nt += sum(s.nt);
        acc.nr += sum(s.nr);
        acc.err += sum(s.err);
        acc.len = (r1 - r0) * cols;
        acc
    }

    /// 16 BF16 values (32 bytes) as even and odd elements in f64 (exact widenings), the
    /// layout `lookup` gives the NVFP4 side, and whether all 16 are finite.
    #[target_feature(enable = "avx512f,avx512dq")]
    unsafe fn bf16_block(bytes: *const u8) -> ([__m512d; 2], bool) {
        let h = _mm256_loadu_si256(bytes as *const __m256i);
        let f = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)));
        let finite =
            _mm512_cmp_ps_mask::<_CMP_LT_OQ>(_mm512_abs_ps(f), _mm512_set1_ps(f32::INFINITY))
                == 0xFFFF;
        let p = _mm512_permutexvar_ps(
            _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15),
            f,
        );
        (
            [
                _mm512_cvtps_pd(_mm512_castps512_ps256(p)),
                _mm512_cvtps_pd(_mm512_extractf32x8_ps::<1>(p)),
            ],
            finite,
        )
    }

    /// NVFP4 `b` against a BF16 reference `a`: the test side from its scale code's table,
    /// the reference widened from the map; checks per block (a block with a non-finite value
    /// goes through `Accum::over`, one whose largest |difference| beats the running maximum
    /// is walked for its first index). Prefetching the rows ahead, as `rows` does, measured
    /// no gain here (0.30 CPU-s either way on 2.8 GB).
    #[target_feature(enable = "avx512f,avx512dq")]
    pub unsafe fn rows_bf16(a: &DView, b: &QMatrix, tb: &Tables, r0: usize, r1: usize) -> Accum {
        let (cols, kb) = (b.cols, b.kb());
        let z = _mm512_setzero_pd();
        let mut s = Sums {
            dot: [z; 2],
            nt: [z; 2],
            nr: [z; 2],
            err: [z; 2],
        };
        let mut acc = Accum::default();
        let current = |acc: &Accum| _mm512_set1_pd(super::running_max(acc));
        let mut cur = current(&acc);
        for r in r0..r1 {
            let (ra, pb, sb) = (a.mat.row(r), b.packed.row(r), b.scale_row(r));
            for j in 0..kb {
                let (xa, bb) = (
                    &ra[j * 2 * BLOCK..(j + 1) * 2 * BLOCK],
                    &pb[j * 8..j * 8 + 8],
                );
                let (x, x_finite) = bf16_block(xa.as_ptr());
                let at = r * cols + j * BLOCK;
                let values = || {
                    (
                        super::bf16_values(xa),
                        super::values(&super::table(sb[j], b.scale_2), bb),
                    )
                };
                if !(x_finite && tb.finite(sb[j])) {
                    let (xv, yv) = values();
                    acc = acc.merge(Accum::over(&yv, &xv, at));
                    cur = current(&acc);
                    continue;
                }
                let y = lookup(&tb.rows[sb[j] as usize], bb.as_ptr());
                let m = sums(x, y, &mut s, z);
                if _mm512_cmp_pd_mask::<_CMP_GT_OQ>(m, cur) != 0 {
                    // rare: the block's maximum and its first element
                    let mb = _mm512_reduce_max_pd(m);
                    let (xv, yv) = values();
                    let i = (0..BLOCK)
                        .position(|i| (yv[i] as f64 - xv[i] as f64).abs() == mb)
                        .unwrap_or(0);
                    acc.max_abs = mb;
                    acc.max_idx = Some(at + i);
                    cur = current(&acc);
                }
            }
        }
        let sum = |v: [__m512d; 2]| _mm512_reduce_add_pd(_mm512_add_pd(v[0], v[1]));
        acc.dot += sum(s.dot);
        acc.nt += sum(s.nt);
        acc.nr += sum(s.nr);
        acc.err += sum(s.err);
        acc.len = (r1 - r0) * cols;
        acc
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weights::compare::metrics_qq;
    use crate::weights::view::Mat;
    use rand::{Rng, SeedableRng};
    use std::borrow::Cow;

    /// Equal up to summation order. The sums behind the three figures carry a relative
    /// error up to n·ε of the sum of magnitudes, so the tolerance is relative with an
    /// absolute floor: a cosine near 0 or an SQNR near 0 dB comes from a cancellation, where
    /// a pure relative tolerance fails on rounding alone (seen: SQNR 0.27697569402709 vs
    /// 0.27697569402681 dB). A real fault moves these figures by far more than 1e-10.
    fn close(a: f64, b: f64) -> bool {
        (a.is_nan() && b.is_nan())
            || a == b
            || (a - b).abs() <= 1e-10 * a.abs().max(b.abs()).max(1.0)
    }

    fn q(p: &[u8], s: Vec<u8>, g: f32, rows: usize, cols: usize) -> QMatrix<'_> {
        QMatrix {
            format: Format::Nvfp4,
            rows,
            cols,
            packed: Mat::dense(p, rows, cols / 2).unwrap(),
            scales: Cow::Owned(s),
            scale_2: g,
        }
    }

    /// Against the dequantize-then-`Accum::over` reference on random matrices: clean ones,
    /// ones with NaN scale codes and overflowing blocks in B, near-identical ones.
    #[test]
    fn fused_matches_the_reference() {
        let seed: u64 = rand::random();
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        for case in 0..12 {
            let rows = r.gen_range(1..300);
            let cols = 16 * r.gen_range(1..40);
            let pa: Vec<u8> = (0..rows * cols / 2).map(|_| r.gen()).collect();
            let mut pb = pa.clone();
            let flips = if case % 3 == 0 {
                pb.len()
            } else {
                r.gen_range(1..8)
            };
            for _ in 0..flips {
                let i = r.gen_range(0..pb.len());
                pb[i] = r.gen();
            }
            // every fifth case one scale code throughout: the largest difference then comes
            // up many times, in several pieces, and the first of them must win
            let one_code = r.gen_range(0..0x7F);
            let sa: Vec<u8> = (0..rows * cols / 16)
                .map(|_| {
                    if case % 5 == 4 {
                        one_code
                    } else {
                        r.gen_range(0..0x7F)
                    }
                })
                .collect();
            let mut sb = sa.clone();
            if case % 4 == 1 {
                for _ in 0..r.gen_range(1..4) {
                    let i = r.gen_range(0..sb.len());
                    sb[i] = if r.gen_bool(0.5) { 0x7F } else { 0xFF };
                }
            }
            // a huge scale_2 overflows blocks with large scales to Inf
            let g_b = if case % 4 == 2 {
                3e36
            } else {
                1e-4 * r.gen_range(0.5..2.0f32)
            };
            let (qa, qb) = (q(&pa, sa, 1e-4, rows, cols), q(&pb, sb, g_b, rows, cols));
            let want = metrics_qq(&qa, &qb);
            // the dispatched path, then every narrower body this CPU can run
            let mut paths = vec![
                ("dispatched", metrics_nvfp4(&qa, &qb).unwrap()),
                ("portable", rows_body(Ref::Q(&qa), &qb, 0, rows).finish()),
            ];
            #[cfg(target_arch = "x86_64")]
            if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                let best = AtomicU64::new(0);
                paths.push((
                    "avx2",
                    Path::Avx2.rows(Ref::Q(&qa), &qb, &best, 0, rows).finish(),
                ));
            }
            for (path, got) in paths {
                same(
                    &format!("seed {seed} case {case} [{rows}, {cols}] {path}"),
                    &got,
                    &want,
                );
            }
        }
    }

    /// Identical counts, maximum and first indices; sums up to order.
    fn same(what: &str, got: &Metrics, want: &Metrics) {
        assert_eq!(got.len, want.len, "{what}");
        assert_eq!(
            (got.nan_count, got.inf_count, got.first_nan, got.first_inf),
            (
                want.nan_count,
                want.inf_count,
                want.first_nan,
                want.first_inf
            ),
            "{what}"
        );
        assert!(
            got.max_abs_err.to_bits() == want.max_abs_err.to_bits()
                || (got.max_abs_err.is_nan() && want.max_abs_err.is_nan()),
            "{what}: max_abs_err {} vs {}",
            got.max_abs_err,
            want.max_abs_err
        );
        assert_eq!(got.max_abs_err_index, want.max_abs_err_index, "{what}");
        for (n, g, w) in [
            ("cosine", got.cosine, want.cosine),
            ("rel_l2", got.rel_l2, want.rel_l2),
            ("sqnr_db", got.sqnr_db, want.sqnr_db),
        ] {
            assert!(close(g, w), "{what}: {n} {g:e} vs {w:e}");
        }
    }

    /// NVFP4 against a BF16 reference (a checkpoint's original): its own quantization, the
    /// same with NaN/Inf among the BF16 values or NaN scale codes, and unrelated values.
    #[test]
    fn fused_bf16_matches_the_reference() {
        use crate::checkpoint::writer::bf16_bytes;
        use crate::nvfp4::quantize_weight_nvfp4;
        use crate::weights::compare::{metrics_any, Values};
        use safetensors::Dtype;
        let seed: u64 = rand::random();
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        for case in 0..12 {
            let rows = r.gen_range(1..300);
            let cols = 16 * r.gen_range(1..40);
            let w: Vec<f32> = (0..rows * cols)
                .map(|_| half::bf16::from_f32(r.gen_range(-0.1f32..0.1)).to_f32())
                .collect();
            let (t, _) = quantize_weight_nvfp4(&w, rows, cols);
            let mut x = bf16_bytes(&w);
            if case % 3 == 1 {
                for _ in 0..r.gen_range(1..4) {
                    let i = 2 * r.gen_range(0..rows * cols);
                    let v: f32 = [f32::NAN, f32::INFINITY, -f32::INFINITY][r.gen_range(0..3)];
                    x[i..i + 2].copy_from_slice(&bf16_bytes(&[v]));
                }
            }
            if case % 3 == 2 {
                x.iter_mut().for_each(|b| *b = r.gen::<u8>() & 0xBF);
            }
            let mut sc = t.scales.clone();
            if case % 4 == 3 {
                let i = r.gen_range(0..sc.len());
                sc[i] = 0x7F;
            }
            let qb = q(&t.packed, sc, t.scale_2, rows, cols);
            let d = DView {
                mat: Mat::dense(&x, rows, 2 * cols).unwrap(),
                dtype: Dtype::BF16,
            };
            let want = metrics_any(&Values::D(d), &Values::Q(&qb)).unwrap();
            let mut paths = vec![
                ("dispatched", metrics_bf16_nvfp4(&d, &qb).unwrap()),
                ("portable", rows_body(Ref::Bf16(&d), &qb, 0, rows).finish()),
            ];
            #[cfg(target_arch = "x86_64")]
            if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                let best = AtomicU64::new(0);
                paths.push((
                    "avx2",
                    Path::Avx2.rows(Ref::Bf16(&d), &qb, &best, 0, rows).finish(),
                ));
            }
            #[cfg(target_arch = "x86_64")]
            if avx512::available() {
                let best = AtomicU64::new(0);
                let p = Path::detect_bf16(&qb);
                assert!(matches!(p, Path::Avx512Bf16(_)));
                paths.push((
                    "avx512",
                    p.rows(Ref::Bf16(&d), &qb, &best, 0, rows).finish(),
                ));
            }
            for (path, got) in paths {
                same(
                    &format!("seed {seed} case {case} [{rows}, {cols}] {path}"),
                    &got,
                    &want,
                );
            }
        }
    }
}
