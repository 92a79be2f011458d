//! Which quantization blocks of two matrices of one geometry differ, by their bytes: a block
//! differs when its packed codes or its block scale do. compare-weights says "N of M blocks
//! differ, the first at row r, block j" where values differ under one global scale: a stray
//! byte, a few rescaled blocks and a whole re-quantization read apart there.
//!
//! The count is one branch-free pass over a run of rows (each block's codes one fixed-size
//! compare): a `memcmp` call and a mispredicted branch a block were most of compare-weights'
//! time where every unit differs. The CPU diff engine counts each piece of rows right after
//! its arithmetic pass (`fused`), while the piece is still in cache; re-reading both sides
//! from memory for the count cost ~0.1 s of ~0.55 s on the 6.3 GB all-differ pair.

use super::view::QMatrix;

/// Differing blocks over rows of A and B.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BlockCount {
    /// Blocks whose codes or scale differ.
    pub n: usize,
    /// The first of them: (row, block, its codes differ, its scale differs).
    pub first: Option<(usize, usize, bool, bool)>,
    /// Some block's codes differ (not only scales).
    pub codes_differ: bool,
}

impl BlockCount {
    /// Rows `[r0, r1)` of `a` and `b`; `None` when their geometries differ.
    pub fn rows(a: &QMatrix, b: &QMatrix, r0: usize, r1: usize) -> Option<BlockCount> {
        if !same_geometry(a, b) {
            return None;
        }
        let mut t = BlockCount::default();
        for r in r0..r1 {
            let (pa, pb) = (a.packed.row(r), b.packed.row(r));
            let (sa, sb) = (a.scale_row(r), b.scale_row(r));
            if pa == pb && sa == sb {
                continue;
            }
            match a.format.block() / 2 {
                8 => t.row::<8>(r, pa, pb, sa, sb),
                _ => t.row::<16>(r, pa, pb, sa, sb),
            }
        }
        Some(t)
    }

    /// The count over `self`'s rows, then `later`'s.
    pub fn merge(self, later: BlockCount) -> BlockCount {
        BlockCount {
            n: self.n + later.n,
            first: self.first.or(later.first),
            codes_differ: self.codes_differ || later.codes_differ,
        }
    }

    /// Row `r`: packed codes `pa`, `pb` in blocks of `N` bytes, block scales `sa`, `sb`. The
    /// first block is looked for only where it can be.
    fn row<const N: usize>(&mut self, r: usize, pa: &[u8], pb: &[u8], sa: &[u8], sb: &[u8]) {
        let (ca, cb) = (pa.as_chunks::<N>().0, pb.as_chunks::<N>().0);
        let blocks = ca.len().min(cb.len()).min(sa.len()).min(sb.len());
        let (n, codes) = count::<N>(&ca[..blocks], &cb[..blocks], &sa[..blocks], &sb[..blocks]);
        self.n += n;
        self.codes_differ |= codes;
        if self.first.is_none() {
            self.first = (0..blocks)
                .map(|j| (j, ca[j] != cb[j], sa[j] != sb[j]))
                .find(|&(_, c, s)| c || s)
                .map(|(j, c, s)| (r, j, c, s));
        }
    }
}

/// Blocks of one row whose codes (`N` bytes a block) or scale differ, and whether some
/// block's codes do. NVFP4 rows on AVX-512 BW: 64 blocks a step, as bit masks.
fn count<const N: usize>(ca: &[[u8; N]], cb: &[[u8; N]], sa: &[u8], sb: &[u8]) -> (usize, bool) {
    #[cfg(target_arch = "x86_64")]
    if N == 8 && avx512bw() {
        // SAFETY: AVX-512 F/BW seen; the four slices are of one length (the caller's `blocks`)
        return unsafe { count8_avx512(ca.as_flattened(), cb.as_flattened(), sa, sb) };
    }
    count_portable(ca, cb, sa, sb)
}

/// AVX-512 F and BW, what the byte-mask loops here and in `audit` are compiled for.
#[cfg(target_arch = "x86_64")]
pub fn avx512bw() -> bool {
    std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("avx512bw")
}

/// [`count`] one block at a time, branch-free.
fn count_portable<const N: usize>(
    ca: &[[u8; N]],
    cb: &[[u8; N]],
    sa: &[u8],
    sb: &[u8],
) -> (usize, bool) {
    let n = (ca.iter().zip(cb))
        .zip(sa.iter().zip(sb))
        .map(|((x, y), (s, t))| usize::from(x != y) | usize::from(s != t))
        .sum();
    (n, ca != cb)
}

/// [`count`] for 8-byte blocks: a step compares 64 blocks' codes as eight 64-byte vectors of
/// u64 lanes and their 64 scale bytes as one, ORs the two masks and counts the bits; the
/// tail goes block by block. Block by block, the count was ~20% of compare-weights' CPU time
/// on the all-differ pair, with the data already in cache.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn count8_avx512(pa: &[u8], pb: &[u8], sa: &[u8], sb: &[u8]) -> (usize, bool) {
    use std::arch::x86_64::*;
    let blocks = sa.len();
    debug_assert!(sb.len() == blocks && pa.len() == 8 * blocks && pb.len() == 8 * blocks);
    let (mut n, mut codes) = (0usize, 0u64);
    let steps = blocks / 64;
    for i in 0..steps {
        let j = 64 * i;
        let mut cm = 0u64;
        for g in 0..8 {
            let at = 8 * (j + 8 * g);
            let x = _mm512_loadu_si512(pa.as_ptr().add(at) as *const __m512i);
            let y = _mm512_loadu_si512(pb.as_ptr().add(at) as *const __m512i);
            cm |= u64::from(_mm512_cmpneq_epu64_mask(x, y)) << (8 * g);
        }
        let s = _mm512_cmpneq_epu8_mask(
            _mm512_loadu_si512(sa.as_ptr().add(j) as *const __m512i),
            _mm512_loadu_si512(sb.as_ptr().add(j) as *const __m512i),
        );
        n += (cm | s).count_ones() as usize;
        codes |= cm;
    }
    let j = 64 * steps;
    let (ca, cb) = (
        pa[8 * j..].as_chunks::<8>().0,
        pb[8 * j..].as_chunks::<8>().0,
    );
    let (m, c) = count_portable(ca, cb, &sa[j..], &sb[j..]);
    (n + m, codes != 0 || c)
}

/// B's scale / A's scale of the first block whose scale alone differs (its codes A's), and
/// how many such blocks share that factor: block scales rescaled at load. A pass over the
/// scales, and the codes of the blocks whose scale differs.
pub fn scale_factor(a: &QMatrix, b: &QMatrix) -> Option<(f32, usize)> {
    if !same_geometry(a, b) {
        return None;
    }
    let bytes = a.format.block() / 2;
    let (mut factor, mut same) = (None, 0);
    for r in 0..a.rows {
        let (sa, sb) = (a.scale_row(r), b.scale_row(r));
        if sa == sb {
            continue;
        }
        let (pa, pb) = (a.packed.row(r), b.packed.row(r));
        let codes =
            |j: usize| pa.get(j * bytes..(j + 1) * bytes) == pb.get(j * bytes..(j + 1) * bytes);
        for j in (0..sa.len()).filter(|&j| sa[j] != sb[j] && codes(j)) {
            let f = b.format.decode_scale(sb[j]) / a.format.decode_scale(sa[j]);
            if f.is_finite() && f > 0.0 && *factor.get_or_insert(f) == f {
                same += 1;
            }
        }
    }
    factor.map(|f| (f, same))
}

fn same_geometry(a: &QMatrix, b: &QMatrix) -> bool {
    (a.format, a.rows, a.cols) == (b.format, b.rows, b.cols) && a.scales.len() == b.scales.len()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::nvfp4::Format;
    use crate::weights::view::Mat;
    use rand::{Rng, SeedableRng};

    /// A quantized matrix over `codes` and `scales`, global scale 1.
    pub(crate) fn q<'a>(
        format: Format,
        rows: usize,
        cols: usize,
        codes: &'a [u8],
        scales: &[u8],
    ) -> QMatrix<'a> {
        QMatrix {
            format,
            rows,
            cols,
            packed: Mat::new(codes, rows, cols / 2, cols / 2).unwrap(),
            scales: std::borrow::Cow::Owned(scales.to_vec()),
            scale_2: 1.0,
        }
    }

    /// The branch-free count, over pieces of rows merged in order, against a block-by-block
    /// count: codes and scales changed at random places, both formats; and the scale factor
    /// against the blocks whose scale alone differs.
    #[test]
    fn the_count_is_a_block_by_block_count_over_pieces_merged_in_order() {
        let seed: u64 = rand::random();
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        for format in [[Format::Nvfp4; 20], [Format::Mxfp4; 20]].concat() {
            let (block, bytes) = (format.block(), format.block() / 2);
            // rows past 64 blocks: the AVX-512 steps and their tail
            let (rows, kb) = (r.gen_range(1..9), r.gen_range(1..200));
            let cols = kb * block;
            let pa: Vec<u8> = (0..rows * kb * bytes).map(|_| r.gen()).collect();
            let sa: Vec<u8> = (0..rows * kb).map(|_| r.gen_range(90..110)).collect();
            let (mut pb, mut sb) = (pa.clone(), sa.clone());
            for _ in 0..r.gen_range(0..rows * kb) {
                match r.gen_range(0..3) {
                    0 => {
                        let at = r.gen_range(0..pb.len());
                        pb[at] ^= 1 << r.gen_range(0..8);
                    }
                    // ×2: one exponent step up
                    1 => {
                        let at = r.gen_range(0..sb.len());
                        sb[at] = sa[at] + 8;
                    }
                    _ => {
                        let at = r.gen_range(0..sb.len());
                        sb[at] ^= 1;
                    }
                }
            }
            let naive: Vec<(usize, usize, bool, bool)> = (0..rows * kb)
                .map(|i| {
                    let c = pa[i * bytes..(i + 1) * bytes] != pb[i * bytes..(i + 1) * bytes];
                    (i / kb, i % kb, c, sa[i] != sb[i])
                })
                .filter(|&(_, _, c, s)| c || s)
                .collect();
            let (a, b) = (
                q(format, rows, cols, &pa, &sa),
                q(format, rows, cols, &pb, &sb),
            );
            let cut = r.gen_range(0..=rows);
            let t = BlockCount::rows(&a, &b, 0, cut)
                .unwrap()
                .merge(BlockCount::rows(&a, &b, cut, rows).unwrap());
            let what = format!("seed {seed} {format:?}, cut at row {cut}");
            assert_eq!(t, BlockCount::rows(&a, &b, 0, rows).unwrap(), "{what}");
            assert_eq!(t.n, naive.len(), "{what}");
            assert_eq!(t.first, naive.first().copied(), "{what}");
            assert_eq!(t.codes_differ, naive.iter().any(|x| x.2), "{what}");
            let scale_only: Vec<f32> = naive
                .iter()
                .filter(|x| !x.2 && x.3)
                .map(|&(i, j, _, _)| {
                    let k = i * kb + j;
                    format.decode_scale(sb[k]) / format.decode_scale(sa[k])
                })
                .collect();
            let want = scale_only
                .first()
                .map(|&f| (f, scale_only.iter().filter(|&&g| g == f).count()));
            assert_eq!(scale_factor(&a, &b), want, "{what}");
        }
    }
}
