//! Metrics of two NVFP4 matrices of one geometry in one pass: each 16-element block of both
//! sides is dequantized into registers and folded into the f64 sums of [`Accum`], without
//! writing the values out. Dequantizing into buffers and then running `Accum::over` cost
//! ~4x the memory traffic and one serial chain of f64 adds per sum; here the sums run in
//! [`LANES`] independent lanes.
//!
//! What the reference (`compare::metrics_qq`) gives, and what this keeps:
//! - every value is the same f32 `(e2m1(q) * scale) * scale_2`, read from a per-block table
//!   built with exactly those two multiplications;
//! - `max_abs_err` and its index are bit-identical (the same f64 differences; the first index
//!   of the largest);
//! - NaN/Inf counts and first indices are identical: a block whose table holds a non-finite
//!   value (NaN scale code, overflow through `scale_2`) goes through `Accum::over` itself;
//! - the f64 sums (dot, norms, squared error) differ only in summation order: a few ulps,
//!   within the 1e-9 relative the engines are held to (`tests/gpu_compare_weights.rs`).

use super::view::QMatrix;
use crate::metrics::{Accum, Metrics};
use crate::nvfp4::{e2m1, e4m3, Format};
use rayon::prelude::*;

/// Elements per parallel piece (whole rows), as in `compare::metrics_qq`.
const CHUNK: usize = 1 << 16;
/// Independent f64 partial sums per quantity: two AVX2 vectors, and short add chains.
const LANES: usize = 8;
const BLOCK: usize = 16;

/// `None` unless both sides are NVFP4 with one shape (the caller takes the general path).
pub fn metrics_nvfp4(a: &QMatrix, b: &QMatrix) -> Option<Metrics> {
    let same = (a.rows, a.cols) == (b.rows, b.cols);
    if !same || a.format != Format::Nvfp4 || b.format != Format::Nvfp4 {
        return None;
    }
    if !a.cols.is_multiple_of(BLOCK) || a.rows == 0 || a.cols == 0 {
        return None;
    }
    let rows_per = (CHUNK / a.cols).max(1);
    let n_chunks = a.rows.div_ceil(rows_per);
    // merged in order: the same bits on every run, whatever thread did which piece
    let parts: Vec<Accum> = (0..n_chunks)
        .into_par_iter()
        .map(|c| rows(a, b, c * rows_per, ((c + 1) * rows_per).min(a.rows)))
        .collect();
    Some(
        parts
            .into_iter()
            .fold(Accum::default(), Accum::merge)
            .finish(),
    )
}

fn rows(a: &QMatrix, b: &QMatrix, r0: usize, r1: usize) -> Accum {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has AVX2 and FMA (checked just above)
        return unsafe { avx2::rows(a, b, r0, r1) };
    }
    rows_body(a, b, r0, r1)
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

#[inline(always)]
fn rows_body(a: &QMatrix, b: &QMatrix, r0: usize, r1: usize) -> Accum {
    let (cols, kb) = (a.cols, a.kb());
    let mut acc = Accum::default();
    let (mut dot, mut nt, mut nr, mut err) =
        ([0f64; LANES], [0f64; LANES], [0f64; LANES], [0f64; LANES]);
    for r in r0..r1 {
        let (pa, pb) = (a.packed.row(r), b.packed.row(r));
        let (sa, sb) = (
            &a.scales[r * kb..(r + 1) * kb],
            &b.scales[r * kb..(r + 1) * kb],
        );
        for j in 0..kb {
            let (ta, tb) = (table(sa[j], a.scale_2), table(sb[j], b.scale_2));
            let x = values(&ta, &pa[j * BLOCK / 2..(j + 1) * BLOCK / 2]);
            let y = values(&tb, &pb[j * BLOCK / 2..(j + 1) * BLOCK / 2]);
            let at = r * cols + j * BLOCK;
            // entry 7 (6 · scale · scale_2) has the largest magnitude: when it is finite, so
            // is every entry (NaN scales, Inf and 0 · Inf all show there)
            if !(ta[7].is_finite() && tb[7].is_finite()) {
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
/// f64), so it rounds as a multiply then an add; the squared error keeps the two steps.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{QMatrix, BLOCK};
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

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn rows(a: &QMatrix, b: &QMatrix, r0: usize, r1: usize) -> Accum {
        let (cols, kb) = (a.cols, a.kb());
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
        // one of its differences exceeds it (-1 until the first block sets it; NaN once a NaN
        // reference value took it, as in `Accum::over`, where nothing exceeds NaN)
        let current = |acc: &Accum| {
            _mm256_set1_pd(if acc.max_idx.is_some() {
                acc.max_abs
            } else {
                -1.0
            })
        };
        let mut cur = current(&acc);
        for r in r0..r1 {
            let (pa, pb) = (a.packed.row(r), b.packed.row(r));
            let (sa, sb) = (
                &a.scales[r * kb..(r + 1) * kb],
                &b.scales[r * kb..(r + 1) * kb],
            );
            for j in 0..kb {
                let (ta, tb) = (table(sa[j], a.scale_2, pos), table(sb[j], b.scale_2, pos));
                let at = r * cols + j * BLOCK;
                let (ba, bb) = (&pa[j * 8..j * 8 + 8], &pb[j * 8..j * 8 + 8]);
                if !(finite(ta) && finite(tb)) {
                    let (x, y) = (
                        super::values(&table_of(ta), ba),
                        super::values(&table_of(tb), bb),
                    );
                    acc = acc.merge(Accum::over(&y, &x, at));
                    cur = current(&acc);
                    continue;
                }
                let mut m = z;
                for h in 0..2 {
                    let wa = u32::from_le_bytes([
                        ba[4 * h],
                        ba[4 * h + 1],
                        ba[4 * h + 2],
                        ba[4 * h + 3],
                    ]);
                    let wb = u32::from_le_bytes([
                        bb[4 * h],
                        bb[4 * h + 1],
                        bb[4 * h + 2],
                        bb[4 * h + 3],
                    ]);
                    let (x8, y8) = (decode8(ta, wa), decode8(tb, wb));
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
                    let (x, y) = (
                        super::values(&table_of(ta), ba),
                        super::values(&table_of(tb), bb),
                    );
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

    /// The 16-entry table (negative half by negation) of a block's 8 positive entries.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn table_of(t: __m256) -> [f32; BLOCK] {
        let mut v = [0f32; BLOCK];
        _mm256_storeu_ps(v.as_mut_ptr(), t);
        for c in 0..8 {
            v[8 + c] = -v[c];
        }
        v
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
            let sa: Vec<u8> = (0..rows * cols / 16)
                .map(|_| r.gen_range(0..0x7F))
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
            // the dispatched path (AVX2 here), then the portable body every CPU can run
            let portable = rows_body(&qa, &qb, 0, rows).finish();
            for (path, got) in [
                ("dispatched", metrics_nvfp4(&qa, &qb).unwrap()),
                ("portable", portable),
            ] {
                let what = format!("seed {seed} case {case} [{rows}, {cols}] {path}");
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
        }
    }
}
