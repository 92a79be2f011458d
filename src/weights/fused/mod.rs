//! Metrics of two NVFP4 matrices of one geometry in one pass: each 16-element block of both
//! sides is dequantized into registers and folded into the f64 sums of [`Accum`], without
//! writing the values out. The reference side may also be BF16 ([`Ref::Bf16`]: a
//! checkpoint's BF16 originals, an engine that dequantized at load); its values are read
//! straight from the map. Dequantizing into buffers and then running `Accum::over` cost
//! ~4x the memory traffic and one serial chain of f64 adds per sum; here the sums run in
//! [`LANES`] independent lanes.
//!
//! Four bodies, the widest the CPU has picked once per matrix pair (`Path`): with AVX-512 VBMI
//! and global scales within 1/64 of each other, groups of eight blocks of equal scale codes
//! as integer code-pair sums (`same_scale`; other groups and rows go to the next body);
//! AVX-512 (per-scale-code f64 tables, 8-lane sums, row-level checks; `avx512`; against a
//! BF16 reference only the test side is tabled and checks are per block), AVX2 + FMA (a
//! table per block in one register; `avx2`) and the portable one. The tests run every body
//! the CPU has against the reference.
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

use super::blocks::BlockCount;
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
    metrics_nvfp4_counted(a, b, false).map(|(m, _)| m)
}

/// [`metrics_nvfp4`], and with `count`, the blocks that differ (`blocks`): each piece of rows
/// counted right after its pass, while it is in cache.
pub fn metrics_nvfp4_counted(
    a: &QMatrix,
    b: &QMatrix,
    count: bool,
) -> Option<(Metrics, Option<BlockCount>)> {
    let same = (a.rows, a.cols) == (b.rows, b.cols);
    if !same || a.format != Format::Nvfp4 {
        return None;
    }
    fused(Ref::Q(a), b, Path::detect(a, b), count)
}

/// NVFP4 `b` (test) against BF16 `a` (reference) of its shape; `None` otherwise.
pub fn metrics_bf16_nvfp4(a: &DView, b: &QMatrix) -> Option<Metrics> {
    let same = a.mat.rows == b.rows && a.mat.row_bytes == 2 * b.cols;
    if !same || a.dtype != Dtype::BF16 {
        return None;
    }
    fused(Ref::Bf16(a), b, Path::detect_bf16(b), false).map(|(m, _)| m)
}

fn fused(a: Ref, b: &QMatrix, path: Path, count: bool) -> Option<(Metrics, Option<BlockCount>)> {
    if b.format != Format::Nvfp4 || !b.cols.is_multiple_of(BLOCK) || b.rows == 0 || b.cols == 0 {
        return None;
    }
    // the pieces fault both sides' pages in as they read them. Mapping them first in one
    // MADV_POPULATE_READ per side (session 42: 0.45 → 0.43 s) measured 0.03-0.05 s slower on
    // the 6.3 GB all-differ pair where the page cache holds small folios (a page-table walk
    // per 4 KiB page), and the same where it holds 2 MiB ones (session 59)
    let rows_per = (CHUNK / b.cols).max(1);
    let n_chunks = b.rows.div_ceil(rows_per);
    let best = AtomicU64::new(0);
    // merged in order: the same bits on every run, whatever thread did which piece
    let parts: Vec<(Accum, Option<BlockCount>)> = (0..n_chunks)
        .into_par_iter()
        .map(|c| {
            let (r0, r1) = (c * rows_per, ((c + 1) * rows_per).min(b.rows));
            let acc = path.rows(a, b, &best, r0, r1);
            let blocks = match a {
                Ref::Q(q) if count => BlockCount::rows(q, b, r0, r1),
                _ => None,
            };
            (acc, blocks)
        })
        .collect();
    let counted = (count && matches!(a, Ref::Q(_))).then(BlockCount::default);
    let (acc, blocks) = parts
        .into_iter()
        .fold((Accum::default(), counted), |(acc, n), (a, m)| {
            (acc.merge(a), n.zip(m).map(|(n, m)| n.merge(m)))
        });
    Some((acc.finish(), blocks))
}

/// The widest body this CPU runs, picked once per matrix pair.
enum Path {
    /// AVX-512 with both sides' per-scale-code tables built up front.
    #[cfg(target_arch = "x86_64")]
    Avx512(Box<[avx512::Tables; 2]>),
    /// AVX-512 with VBMI and global scales within 1/64 of each other: both sides' tables,
    /// and groups of blocks of equal scale codes as integer sums (`same_scale`).
    #[cfg(target_arch = "x86_64")]
    SameScale(Box<([avx512::Tables; 2], same_scale::Codes)>),
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
            if same_scale::available() && same_scale::Codes::usable(a.scale_2, b.scale_2) {
                return Path::SameScale(Box::new((
                    [
                        avx512::Tables::new(a.scale_2),
                        avx512::Tables::new(b.scale_2),
                    ],
                    same_scale::Codes::new(a.scale_2, b.scale_2),
                )));
            }
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
            // SAFETY: `detect` saw AVX-512 F/DQ/BW/VBMI
            #[cfg(target_arch = "x86_64")]
            (Path::SameScale(t), Ref::Q(a)) => unsafe {
                let ([ta, tb], c) = (&t.0, &t.1);
                if c.two_scales() {
                    same_scale::rows::<true>(a, b, ta, tb, c, best, r0, r1)
                } else {
                    same_scale::rows::<false>(a, b, ta, tb, c, best, r0, r1)
                }
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
/// NaN once a NaN difference took it, as in `Accum::takes`, where nothing exceeds NaN. (A
/// finite block whose maximum equals it holds the index after it, which `takes` leaves.)
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
                // the reference's own pass: a NaN difference (a NaN reference value)
                // takes the maximum from every number
                acc.add(&y, &x, at);
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

#[cfg(target_arch = "x86_64")]
mod avx2;

#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod same_scale;

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
    /// ones with NaN scale codes and overflowing blocks in B, with NaN scale codes in A only,
    /// near-identical ones.
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
            // NaN scale codes in the reference only: the test side stays finite, so the
            // maximum and its index are compared whole (a NaN difference must not take it)
            let mut sa = sa;
            if case % 4 == 3 {
                for _ in 0..r.gen_range(1..6) {
                    let i = r.gen_range(0..sa.len());
                    sa[i] = 0x7F;
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
            for (path, got) in bodies(Ref::Q(&qa), &qb) {
                same(
                    &format!("seed {seed} case {case} [{rows}, {cols}] {path}"),
                    &got,
                    &want,
                );
            }
        }
    }

    /// Equal scale codes (re-encoded or corrupted codes under the original scales), under
    /// one global scale or two close ones (a rewritten `weight_scale_2`, a re-quantization):
    /// the integer body, against the reference. Rows of whole 8-block groups and rows with a
    /// tail; codes of both signs, NaN codes, codes whose products are subnormal (tiny
    /// `scale_2`) or overflow (huge), a row whose codes differ in one block, codes that differ
    /// in one block of twenty (groups of the f64 body among the integer ones), one code
    /// throughout (ties across pieces), scales growing along the rows (a new maximum row
    /// after row), a few flipped bytes or all.
    #[test]
    fn same_scale_matches_the_reference() {
        let seed: u64 = rand::random();
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        for case in 0..48 {
            let rows = r.gen_range(1..200);
            let cols = 16
                * if case % 2 == 0 {
                    8 * r.gen_range(1..6)
                } else {
                    r.gen_range(1..50)
                };
            let pa: Vec<u8> = (0..rows * cols / 2).map(|_| r.gen()).collect();
            let mut pb = pa.clone();
            match case % 3 {
                0 => pb.iter_mut().for_each(|b| *b = r.gen()),
                1 => pb.iter_mut().step_by(16).for_each(|b| *b ^= 1),
                _ => (0..r.gen_range(1..8)).for_each(|_| {
                    let i = r.gen_range(0..pb.len());
                    pb[i] = r.gen();
                }),
            }
            let one_code = r.gen_range(0..0xFFu8);
            let mut sa: Vec<u8> = (0..rows * cols / 16)
                .map(|_| if case % 5 == 4 { one_code } else { r.gen() })
                .collect();
            // scales growing along the matrix: each row may raise the maximum
            if case % 7 == 5 {
                sa.sort_unstable_by_key(|c| c & 0x7F);
            }
            // NaN codes only where asked: elsewhere they send whole rows to the f64 body
            if case % 4 != 1 {
                sa.iter_mut()
                    .filter(|c| **c & 0x7F == 0x7F)
                    .for_each(|c| *c ^= 1);
            }
            let mut sb = sa.clone();
            if case % 6 == 3 {
                let i = r.gen_range(0..sb.len());
                sb[i] ^= 0x08;
            }
            if case % 5 == 2 {
                sb.iter_mut()
                    .filter(|_| r.gen_bool(0.05))
                    .for_each(|c| *c ^= 1);
            }
            let g = match case % 8 {
                2 => 3e36,
                6 => 1e-42,
                _ => 1e-4 * r.gen_range(0.5..2.0f32),
            };
            let g_b = match case % 3 {
                1 => g * (1.0 + 1.0 / 1024.0),
                2 => g * r.gen_range(0.985..1.015),
                _ => g,
            };
            let (qa, qb) = (q(&pa, sa, g, rows, cols), q(&pb, sb, g_b, rows, cols));
            #[cfg(target_arch = "x86_64")]
            if same_scale::available() {
                assert!(matches!(Path::detect(&qa, &qb), Path::SameScale(_)));
            }
            let what = format!("seed {seed} case {case} [{rows}, {cols}] g {g:e} {g_b:e}");
            let (m, counted) = metrics_nvfp4_counted(&qa, &qb, true).unwrap();
            same(&what, &m, &metrics_qq(&qa, &qb));
            // the count made piece by piece in the pass is the count over the whole matrix
            assert_eq!(counted, BlockCount::rows(&qa, &qb, 0, rows), "{what}");
        }
    }

    /// A NaN reference value (its block's scale code NaN, the test side's finite) takes the
    /// maximum from every number, larger differences before and after it included, and the
    /// first NaN difference is its index, whatever piece ran first: pieces run here one after
    /// the other, in three orders, sharing `best` as the threads do. Piece 0 holds a large
    /// difference (row 10), piece 1 smaller ones, then the NaN (row 300, its first block: a
    /// piece that passed its first rows below `best` has recorded nothing when it comes),
    /// then the largest (row 400) and a second NaN (row 500); under one global scale (the
    /// integer body) and two (the f64 one).
    #[test]
    fn a_nan_in_the_reference_takes_the_maximum_in_any_piece_order() {
        let seed: u64 = rand::random();
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let (rows, cols) = (600, 256);
        let kb = cols / 16;
        let pa: Vec<u8> = (0..rows * cols / 2).map(|_| r.gen()).collect();
        let mut pb = pa.clone();
        pb.iter_mut().step_by(16).for_each(|b| *b ^= 1);
        let sa: Vec<u8> = (0..rows * kb).map(|_| r.gen_range(0x30..0x38)).collect();
        let mut sb = sa.clone();
        sb[10 * kb] += 8;
        sb[400 * kb + 3] += 16;
        let mut sa = sa;
        sa[300 * kb] = 0x7F;
        sa[500 * kb + 2] = 0xFF;
        for g_b in [1e-4, 2e-4] {
            let (qa, qb) = (
                q(&pa, sa.clone(), 1e-4, rows, cols),
                q(&pb, sb.clone(), g_b, rows, cols),
            );
            let want = metrics_qq(&qa, &qb);
            assert!(
                want.max_abs_err.is_nan(),
                "seed {seed}: the reference's maximum"
            );
            assert_eq!(
                want.max_abs_err_index,
                Some(300 * cols),
                "seed {seed}: the reference's index, the first NaN difference"
            );
            let path = Path::detect(&qa, &qb);
            let rows_per = CHUNK / cols;
            for order in [[0, 1, 2], [1, 0, 2], [2, 1, 0]] {
                let best = AtomicU64::new(0);
                let mut parts = [Accum::default(), Accum::default(), Accum::default()];
                for c in order {
                    let (r0, r1) = (c * rows_per, ((c + 1) * rows_per).min(rows));
                    parts[c] = path.rows(Ref::Q(&qa), &qb, &best, r0, r1);
                }
                let got = parts
                    .into_iter()
                    .fold(Accum::default(), Accum::merge)
                    .finish();
                same(
                    &format!("seed {seed} g_b {g_b:e} pieces in order {order:?}"),
                    &got,
                    &want,
                );
            }
        }
    }

    /// A NaN in a BF16 reference block, after a maximum elsewhere and before a larger
    /// difference in its block, takes the maximum: every body this CPU has.
    #[test]
    fn a_nan_in_a_bf16_reference_block_takes_the_maximum() {
        use crate::checkpoint::writer::bf16_bytes;
        use crate::nvfp4::quantize_weight_nvfp4;
        use crate::weights::compare::{metrics_any, Values};
        use safetensors::Dtype;
        let seed: u64 = rand::random();
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let (rows, cols) = (4, 64);
        let w: Vec<f32> = (0..rows * cols)
            .map(|_| half::bf16::from_f32(r.gen_range(-0.1f32..0.1)).to_f32())
            .collect();
        let (t, _) = quantize_weight_nvfp4(&w, rows, cols);
        let qb = q(&t.packed, t.scales.clone(), t.scale_2, rows, cols);
        let mut x = w.clone();
        let first = cols + 32;
        x[first] = f32::NAN;
        x[first + 5] = half::bf16::from_f32(w[first + 5] + 50.0).to_f32();
        let bytes = bf16_bytes(&x);
        let d = DView {
            mat: Mat::dense(&bytes, rows, 2 * cols).unwrap(),
            dtype: Dtype::BF16,
        };
        let want = metrics_any(&Values::D(d), &Values::Q(&qb)).unwrap();
        assert!(want.max_abs_err.is_nan(), "seed {seed}: the reference");
        assert_eq!(
            want.max_abs_err_index,
            Some(first),
            "seed {seed}: the reference"
        );
        for (path, got) in bodies(Ref::Bf16(&d), &qb) {
            same(&format!("seed {seed} {path}"), &got, &want);
        }
    }

    /// `b` against `a` through the dispatched body and every narrower one this CPU runs.
    fn bodies(a: Ref, b: &QMatrix) -> Vec<(&'static str, Metrics)> {
        let rows = b.rows;
        let mut out = vec![
            (
                "dispatched",
                match a {
                    Ref::Q(q) => metrics_nvfp4(q, b).unwrap(),
                    Ref::Bf16(d) => metrics_bf16_nvfp4(d, b).unwrap(),
                },
            ),
            ("portable", rows_body(a, b, 0, rows).finish()),
        ];
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            let best = AtomicU64::new(0);
            out.push(("avx2", Path::Avx2.rows(a, b, &best, 0, rows).finish()));
        }
        #[cfg(target_arch = "x86_64")]
        if matches!(a, Ref::Bf16(_)) && avx512::available() {
            let (best, p) = (AtomicU64::new(0), Path::detect_bf16(b));
            assert!(matches!(p, Path::Avx512Bf16(_)));
            out.push(("avx512", p.rows(a, b, &best, 0, rows).finish()));
        }
        out
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
            for (path, got) in bodies(Ref::Bf16(&d), &qb) {
                same(
                    &format!("seed {seed} case {case} [{rows}, {cols}] {path}"),
                    &got,
                    &want,
                );
            }
        }
    }
}
