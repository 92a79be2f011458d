//! The same blocks with AVX2: a block's 8 positive table entries sit in one register, the
//! codes index it (`vpermps`) and the sign bit is put back with an XOR (negation is exact, so
//! this is the reference's `(-v * s) * g` bit for bit); sums in 4-wide f64 lanes, two
//! registers per quantity. FMA only where the product is exact (an f32 times an f32 fits an
//! f64), so it rounds as a multiply then an add; the squared error keeps the two steps. A
//! BF16 reference block is two 8-value loads, widened to f32 by a shift.

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
                acc.add(&store16(ys), &store16(xs), at);
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
