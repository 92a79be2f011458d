//! AVX-512: the 16 values of every scale code are tabled once per matrix as f64 (exact
//! widenings of the reference's f32 `(e2m1 · scale) · scale_2`), so a block is two
//! `vpermt2pd` lookups per side (even and odd elements, straight from the packed bytes) and
//! eight f64 lanes of sums, with no per-block table and no f32 → f64 conversion. The squared
//! error is fused (`d·d + err` rounds once); the max |difference| is `vrangepd` (exact).
//!
//! Checks move from blocks to rows: a row whose scale codes all give finite tables (one
//! vectorized max over its codes) runs with no per-block branch, and its maximum |difference|
//! is compared with the running one once, at the row's end; only a row that beats it is
//! walked again for the first index. Other rows take the per-block path of the AVX2 body.
//!
//! Pieces run in parallel and each starts with no maximum, so each would walk its early rows
//! again as its own maximum rises. They share the largest maximum found so far (`best`): a
//! row or block below it cannot hold the answer, and its index is not looked for. A piece
//! whose maximum reaches the final one finds that value's first index as before (ties are
//! not skipped), so the merged answer is the same whatever the threads did.

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
        let tables: Vec<[f32; BLOCK]> = (0..256).map(|c| super::table(c as u8, scale_2)).collect();
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

    pub(super) fn all_finite(&self, codes: &[u8]) -> bool {
        codes.iter().fold(0u8, |m, &c| m.max(c & 0x7F)) < self.limit
    }
}

/// Four quantities in 2 × 8 f64 lanes (even and odd elements of a block).
#[derive(Clone, Copy)]
pub(super) struct Sums {
    dot: [__m512d; 2],
    nt: [__m512d; 2],
    nr: [__m512d; 2],
    err: [__m512d; 2],
}

impl Sums {
    #[target_feature(enable = "avx512f,avx512dq")]
    pub(super) unsafe fn zero() -> Sums {
        let z = _mm512_setzero_pd();
        Sums {
            dot: [z; 2],
            nt: [z; 2],
            nr: [z; 2],
            err: [z; 2],
        }
    }

    /// Adds the lanes to `acc`'s sums.
    #[target_feature(enable = "avx512f,avx512dq")]
    pub(super) unsafe fn add_to(&self, acc: &mut Accum) {
        let sum = |v: [__m512d; 2]| _mm512_reduce_add_pd(_mm512_add_pd(v[0], v[1]));
        acc.dot += sum(self.dot);
        acc.nt += sum(self.nt);
        acc.nr += sum(self.nr);
        acc.err += sum(self.err);
    }
}

/// One cache line of each side's packed row, [`PREFETCH`] bytes past block `j` when `j`
/// starts a line (8 blocks).
#[target_feature(enable = "avx512f,avx512dq")]
pub(super) unsafe fn prefetch(pa: *const u8, pb: *const u8, j: usize) {
    if j.is_multiple_of(8) {
        let ahead = j * 8 + PREFETCH;
        _mm_prefetch::<_MM_HINT_T0>(pa.wrapping_add(ahead) as *const i8);
        _mm_prefetch::<_MM_HINT_T0>(pb.wrapping_add(ahead) as *const i8);
    }
}

/// [`block`] `j` of a row (`pa`, `pb` its packed bytes, `ca`, `cb` the block's finite scale
/// codes).
#[target_feature(enable = "avx512f,avx512dq")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn block_of(
    ta: &Tables,
    tb: &Tables,
    ca: u8,
    cb: u8,
    pa: *const u8,
    pb: *const u8,
    j: usize,
    s: &mut Sums,
    m: __m512d,
) -> __m512d {
    block(
        ta.rows.get_unchecked(ca as usize),
        tb.rows.get_unchecked(cb as usize),
        pa.add(j * 8),
        pb.add(j * 8),
        s,
        m,
    )
}

/// The largest |difference| of one finite block (`ba`, `bb` its 8 packed bytes on each
/// side, `ca`, `cb` its scale codes), exactly.
#[target_feature(enable = "avx512f,avx512dq")]
pub(super) unsafe fn block_max(
    ta: &Tables,
    tb: &Tables,
    ca: u8,
    cb: u8,
    ba: *const u8,
    bb: *const u8,
) -> f64 {
    let x = lookup(ta.rows.get_unchecked(ca as usize), ba);
    let y = lookup(tb.rows.get_unchecked(cb as usize), bb);
    let d = [_mm512_sub_pd(y[0], x[0]), _mm512_sub_pd(y[1], x[1])];
    _mm512_reduce_max_pd(_mm512_range_pd::<0b1011>(d[0], d[1]))
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

/// The flat index of the first element of row `r`, from block `j0` on, whose |difference|
/// is `mb` (finite blocks only: the others went through `Accum::over`).
#[target_feature(enable = "avx512f,avx512dq")]
pub(super) unsafe fn first_of(
    a: &QMatrix,
    b: &QMatrix,
    ta: &Tables,
    tb: &Tables,
    r: usize,
    j0: usize,
    mb: f64,
) -> usize {
    let (pa, pb) = (a.packed.row(r).as_ptr(), b.packed.row(r).as_ptr());
    let target = _mm512_set1_pd(mb);
    for j in j0..a.kb() {
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
            return r * a.cols + j * BLOCK + i;
        }
    }
    r * a.cols + j0 * BLOCK
}

/// `m`'s maximum when it beats this piece's (`cur`) and is not below every piece's `best`.
#[target_feature(enable = "avx512f,avx512dq")]
pub(super) unsafe fn beats(m: __m512d, cur: __m512d, best: &AtomicU64) -> Option<f64> {
    if _mm512_cmp_pd_mask::<_CMP_GT_OQ>(m, cur) == 0 {
        return None;
    }
    let mb = _mm512_reduce_max_pd(m);
    (mb >= f64::from_bits(best.load(Ordering::Relaxed))).then_some(mb)
}

/// Raise every piece's `best` to `mb` (non-negative f64s order as their bits do).
pub(super) fn publish(best: &AtomicU64, mb: f64) {
    best.fetch_max(mb.to_bits(), Ordering::Relaxed);
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
    let mut s = Sums::zero();
    let mut acc = Accum::default();
    let current = |acc: &Accum| _mm512_set1_pd(super::running_max(acc));
    let mut cur = current(&acc);
    for r in r0..r1 {
        let (pa, pb) = (a.packed.row(r).as_ptr(), b.packed.row(r).as_ptr());
        let (sa, sb) = (a.scale_row(r), b.scale_row(r));
        if ta.all_finite(sa) && tb.all_finite(sb) {
            let mut m = z;
            for j in 0..kb {
                prefetch(pa, pb, j);
                let (ca, cb) = (*sa.get_unchecked(j), *sb.get_unchecked(j));
                m = block_of(ta, tb, ca, cb, pa, pb, j, &mut s, m);
            }
            if let Some(mb) = beats(m, cur, best) {
                acc.max_abs = mb;
                acc.max_idx = Some(first_of(a, b, ta, tb, r, 0, mb));
                cur = current(&acc);
                publish(best, mb);
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
                acc.add(&y, &x, at);
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
            if let Some(mb) = beats(m, cur, best) {
                acc.max_abs = mb;
                acc.max_idx = Some(first_of(a, b, ta, tb, r, j, mb));
                cur = current(&acc);
                publish(best, mb);
            }
        }
    }
    s.add_to(&mut acc);
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
        _mm512_cmp_ps_mask::<_CMP_LT_OQ>(_mm512_abs_ps(f), _mm512_set1_ps(f32::INFINITY)) == 0xFFFF;
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
    let mut s = Sums::zero();
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
                acc.add(&yv, &xv, at);
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
    s.add_to(&mut acc);
    acc.len = (r1 - r0) * cols;
    acc
}
