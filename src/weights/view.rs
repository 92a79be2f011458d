//! Zero-copy views of tensor bytes: strided byte matrices (a TP slice of a weight is a
//! sub-matrix of the memory map), and a quantized linear's parts with its block scales in the
//! linear layout whatever layout the file holds them in.

use crate::nvfp4::layout::{self, LayoutGuess, ScaleLayout};
use crate::nvfp4::{dequantize_row, Format};
use std::borrow::Cow;

/// A `[rows, row_bytes]` byte matrix inside `data`, rows `stride` bytes apart.
#[derive(Clone, Copy, Debug)]
pub struct Mat<'a> {
    data: &'a [u8],
    pub rows: usize,
    pub row_bytes: usize,
    stride: usize,
}

impl<'a> Mat<'a> {
    /// None when `data` is too short for the claimed shape.
    pub fn new(data: &'a [u8], rows: usize, row_bytes: usize, stride: usize) -> Option<Mat<'a>> {
        let need = match rows {
            0 => 0,
            r => (r - 1).checked_mul(stride)?.checked_add(row_bytes)?,
        };
        (data.len() >= need && row_bytes <= stride.max(row_bytes)).then_some(Mat {
            data,
            rows,
            row_bytes,
            stride,
        })
    }

    /// A dense matrix.
    pub fn dense(data: &'a [u8], rows: usize, row_bytes: usize) -> Option<Mat<'a>> {
        (rows.checked_mul(row_bytes)? == data.len()).then_some(Mat {
            data,
            rows,
            row_bytes,
            stride: row_bytes,
        })
    }

    #[inline]
    pub fn row(&self, i: usize) -> &'a [u8] {
        let a = i * self.stride;
        &self.data[a..a + self.row_bytes]
    }

    pub fn slice_rows(&self, r0: usize, n: usize) -> Option<Mat<'a>> {
        if r0.checked_add(n)? > self.rows {
            return None;
        }
        let data = if n == 0 {
            &self.data[..0]
        } else {
            &self.data[r0 * self.stride..]
        };
        Mat::new(data, n, self.row_bytes, self.stride)
    }

    pub fn slice_cols(&self, b0: usize, nb: usize) -> Option<Mat<'a>> {
        if b0.checked_add(nb)? > self.row_bytes {
            return None;
        }
        let data = if self.rows == 0 {
            &self.data[..0]
        } else {
            &self.data[b0..]
        };
        Mat::new(data, self.rows, nb, self.stride)
    }

    pub fn len(&self) -> usize {
        self.rows * self.row_bytes
    }

    /// The bytes from the first row's start to the last row's end (strides included).
    pub fn span(&self) -> &'a [u8] {
        match self.rows {
            0 => &self.data[..0],
            r => &self.data[..(r - 1) * self.stride + self.row_bytes],
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `o` holds these bytes with the two nibbles of every byte exchanged (element 2i in the
    /// high nibble instead of the low one); same row split only.
    pub fn nibble_swapped_of(&self, o: &Mat) -> bool {
        self.rows == o.rows
            && self.row_bytes == o.row_bytes
            && !self.is_empty()
            && (0..self.rows).all(|i| {
                self.row(i)
                    .iter()
                    .zip(o.row(i))
                    .all(|(a, b)| a.rotate_left(4) == *b)
            })
    }

    /// Byte-identical as byte streams (row-major), whatever the row split of each side:
    /// memcmp speed over the overlapping pieces.
    pub fn same(&self, o: &Mat) -> bool {
        if self.len() != o.len() {
            return false;
        }
        if self.rows == o.rows && self.row_bytes == o.row_bytes {
            return (0..self.rows).all(|i| self.row(i) == o.row(i));
        }
        let (mut i, mut io, mut j, mut jo) = (0, 0, 0, 0);
        while i < self.rows && j < o.rows {
            let (a, b) = (&self.row(i)[io..], &o.row(j)[jo..]);
            let n = a.len().min(b.len());
            if a[..n] != b[..n] {
                return false;
            }
            io += n;
            jo += n;
            if io == self.row_bytes {
                i += 1;
                io = 0;
            }
            if jo == o.row_bytes {
                j += 1;
                jo = 0;
            }
        }
        true
    }

    /// `self` is `o` transposed, element size `elem` bytes.
    pub fn transposed_of(&self, o: &Mat, elem: usize) -> bool {
        if elem == 0 || !self.row_bytes.is_multiple_of(elem) || !o.row_bytes.is_multiple_of(elem) {
            return false;
        }
        let (sr, sc) = (self.rows, self.row_bytes / elem);
        let (or, oc) = (o.rows, o.row_bytes / elem);
        if sr != oc || sc != or {
            return false;
        }
        (0..sr).all(|i| {
            let row = self.row(i);
            (0..sc).all(|j| row[j * elem..(j + 1) * elem] == o.row(j)[i * elem..(i + 1) * elem])
        })
    }

    /// Rows `[r0, r1)` as one byte stream: borrowed from the map when they are adjacent
    /// there, gathered otherwise (a TP column slice).
    pub fn rows_bytes(&self, r0: usize, r1: usize) -> Cow<'a, [u8]> {
        if r1 <= r0 {
            return Cow::Borrowed(&self.data[..0]);
        }
        if self.stride == self.row_bytes || r1 - r0 == 1 {
            let a = r0 * self.stride;
            return Cow::Borrowed(&self.data[a..a + (r1 - r0 - 1) * self.stride + self.row_bytes]);
        }
        let mut v = Vec::with_capacity((r1 - r0) * self.row_bytes);
        for i in r0..r1 {
            v.extend_from_slice(self.row(i));
        }
        Cow::Owned(v)
    }

    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(self.len());
        for i in 0..self.rows {
            v.extend_from_slice(self.row(i));
        }
        v
    }

    /// A 64-bit fingerprint of the contents as a byte stream (not cryptographic: it only
    /// has to tell apart the experts of one layer).
    pub fn fingerprint(&self, depth: Depth) -> u64 {
        let mut h = Fingerprint::new();
        self.hash_into(&mut h, depth);
        h.finish()
    }

    fn hash_into(&self, h: &mut Fingerprint, depth: Depth) {
        match depth {
            Depth::Full => (0..self.rows).for_each(|i| h.update(self.row(i))),
            Depth::Sample => {
                for (start, end) in sample_windows(self.len()) {
                    let mut at = start;
                    while at < end {
                        let (r, c) = (at / self.row_bytes, at % self.row_bytes);
                        let take = (self.row_bytes - c).min(end - at);
                        h.update(&self.row(r)[c..c + take]);
                        at += take;
                    }
                }
            }
        }
    }
}

/// How much of a tensor a fingerprint reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Depth {
    /// Every byte: equal fingerprints mean equal contents (up to a 64-bit collision).
    Full,
    /// 16 windows of 4 KiB spread evenly over the stream (all of it when it is shorter):
    /// cheap, and tells unrelated tensors apart; equal samples only nominate.
    Sample,
}

const SAMPLES: usize = 16;
const WINDOW: usize = 4096;

/// The `[start, end)` stream ranges a sampled fingerprint reads: disjoint and in order.
fn sample_windows(len: usize) -> Vec<(usize, usize)> {
    if len <= SAMPLES * WINDOW {
        return vec![(0, len)];
    }
    (0..SAMPLES)
        .map(|k| {
            let start = k * (len - WINDOW) / (SAMPLES - 1);
            (start, start + WINDOW)
        })
        .collect()
}

/// A fast word-at-a-time mixing hash over a byte stream (independent of how the stream is cut).
/// Word `i` of the stream goes to lane `i % 4`: four independent multiply chains instead of
/// one (the single chain ran at ~2 GB/s, a third of what reading the bytes costs).
pub struct Fingerprint {
    h: [u64; 4],
    words: u64,
    pending: [u8; 8],
    npending: usize,
    len: u64,
}

impl Default for Fingerprint {
    fn default() -> Self {
        Self::new()
    }
}

const MIX: u64 = 0xFF51_AFD7_ED55_8CCD;

#[inline(always)]
fn mix(h: u64, w: u64) -> u64 {
    (h ^ w).wrapping_mul(MIX).rotate_left(29)
}

impl Fingerprint {
    pub fn new() -> Fingerprint {
        let h0 = 0x9E37_79B9_7F4A_7C15u64;
        Fingerprint {
            h: [h0, h0 ^ 1, h0 ^ 2, h0 ^ 3],
            words: 0,
            pending: [0; 8],
            npending: 0,
            len: 0,
        }
    }
    #[inline]
    fn word(&mut self, w: u64) {
        let l = (self.words % 4) as usize;
        self.h[l] = mix(self.h[l], w);
        self.words += 1;
    }
    pub fn update(&mut self, mut bytes: &[u8]) {
        self.len += bytes.len() as u64;
        if self.npending > 0 {
            let take = (8 - self.npending).min(bytes.len());
            self.pending[self.npending..self.npending + take].copy_from_slice(&bytes[..take]);
            self.npending += take;
            bytes = &bytes[take..];
            if self.npending < 8 {
                return;
            }
            self.word(u64::from_le_bytes(self.pending));
            self.npending = 0;
        }
        let w = |c: &[u8]| u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]);
        // single words up to the next word of lane 0, then four words (one per lane) at a time
        let lead = ((4 - self.words % 4) % 4).min(bytes.len() as u64 / 8) as usize;
        for c in bytes[..8 * lead].chunks_exact(8) {
            self.word(w(c));
        }
        let mut quads = bytes[8 * lead..].chunks_exact(32);
        for q in &mut quads {
            for l in 0..4 {
                self.h[l] = mix(self.h[l], w(&q[8 * l..8 * l + 8]));
            }
            self.words += 4;
        }
        let mut singles = quads.remainder().chunks_exact(8);
        for c in &mut singles {
            self.word(w(c));
        }
        let rest = singles.remainder();
        self.pending[..rest.len()].copy_from_slice(rest);
        self.npending = rest.len();
    }
    pub fn finish(mut self) -> u64 {
        if self.npending > 0 {
            let mut b = [0u8; 8];
            b[..self.npending].copy_from_slice(&self.pending[..self.npending]);
            self.word(u64::from_le_bytes(b));
        }
        let h = self.h[1..].iter().fold(self.h[0], |h, &l| mix(h, l));
        mix(h, self.len ^ 0x2545_F491_4F6C_DD1D)
    }
}

/// How a side's block scales were read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ScalesSeen {
    Linear,
    /// The size says 128x4 swizzled (padded).
    Swizzled,
    /// Both layouts have this size; read as linear unless the other side says otherwise.
    Ambiguous,
}

/// The raw block-scale bytes of one matrix, before the layout is decided: `region` holds the
/// scales of `region_rows` rows (a fused w13 expert holds gate and up together: the swizzle
/// runs over both), of which the unit is rows `[row0, row0 + rows)`.
#[derive(Clone, Copy, Debug)]
pub struct RawScales<'a> {
    pub region: &'a [u8],
    pub region_rows: usize,
    pub row0: usize,
    /// The other experts of this fused tensor were read swizzled: an ambiguous size is read
    /// so too (a kernel takes one layout for the whole tensor).
    pub tensor_swizzled: bool,
}

/// Rows `[row0, row0 + rows)` of a 128x4-swizzled `[.., kb]` scale matrix, in linear layout.
/// Within a 512-byte tile the 4 scales of one row and k-tile are adjacent, so a row is read
/// 4 bytes at a time (`nvfp4::layout::swizzle_offset` pins the layout).
pub fn unswizzle_rows(swizzled: &[u8], kb: usize, row0: usize, rows: usize) -> Vec<u8> {
    let k_tiles = kb.div_ceil(4);
    let mut out = vec![0u8; rows * kb];
    for (i, o) in out.chunks_mut(kb.max(1)).enumerate() {
        let m = row0 + i;
        let within = (m % 32) * 16 + ((m / 32) % 4) * 4;
        let row_tile = m / 128 * k_tiles;
        // whole k-tiles as fixed 4-byte moves (a length known only at run time made each
        // one a memcpy call), then the partial last tile
        let full = kb / 4;
        for (kt, d) in o.chunks_exact_mut(4).enumerate() {
            let src = (row_tile + kt) * 512 + within;
            d.copy_from_slice(&swizzled[src..src + 4]);
        }
        if full < k_tiles {
            let src = (row_tile + full) * 512 + within;
            let n = kb - full * 4;
            o[full * 4..].copy_from_slice(&swizzled[src..src + n]);
        }
    }
    out
}

/// Block scales in linear layout `[rows, kb]`.
#[derive(Clone, Debug)]
pub struct Scales<'a> {
    pub linear: Cow<'a, [u8]>,
    pub seen: ScalesSeen,
    /// For an ambiguous size: where the swizzled reading comes from (computed on demand:
    /// DeepSeek's shapes are all ambiguous, and unswizzling every tensor would cost more
    /// than comparing it).
    ambiguous: Option<(RawScales<'a>, usize, usize)>,
}

impl<'a> RawScales<'a> {
    /// Bytes of the unit's `rows` (the region may hold more rows than the unit).
    pub fn unit_len(&self, rows: usize) -> usize {
        self.region.len() * rows / self.region_rows.max(1)
    }

    /// Read the unit's `[rows, kb]` scales. Err names the sizes when neither layout fits.
    pub fn resolve(&self, rows: usize, kb: usize) -> Result<Scales<'a>, String> {
        let (rr, r0) = (self.region_rows, self.row0);
        if r0 + rows > rr {
            return Err(format!(
                "rows {r0}..{} outside the {rr} rows of the scales",
                r0 + rows
            ));
        }
        let n = self.region.len();
        // an ambiguous size reads as its fused tensor's other experts were read
        let guess = match layout::detect_layout(n, rr, kb, Some(self.region)) {
            LayoutGuess::Ambiguous if self.tensor_swizzled => LayoutGuess::Swizzled,
            g => g,
        };
        match guess {
            LayoutGuess::Linear => Ok(Scales {
                linear: Cow::Borrowed(&self.region[r0 * kb..(r0 + rows) * kb]),
                seen: ScalesSeen::Linear,
                ambiguous: None,
            }),
            LayoutGuess::Swizzled => Ok(Scales {
                linear: Cow::Owned(unswizzle_rows(self.region, kb, r0, rows)),
                seen: ScalesSeen::Swizzled,
                ambiguous: None,
            }),
            LayoutGuess::Ambiguous => Ok(Scales {
                linear: Cow::Borrowed(&self.region[r0 * kb..(r0 + rows) * kb]),
                seen: ScalesSeen::Ambiguous,
                ambiguous: Some((*self, rows, kb)),
            }),
            LayoutGuess::Neither => {
                let (pr, pk) = layout::swizzled_dims(rr, kb);
                Err(if n == pr * pk && n != rr * kb {
                    // the swizzled size, but a genuine swizzle pads with zeros
                    format!(
                        "{n} block-scale bytes are the size of the swizzled [{pr}, {pk}] layout, \
                         but its padding (rows past {rr} or blocks past {kb}) holds nonzero bytes: \
                         not the 128x4 swizzle of [{rr}, {kb}] (another tile order, or scales \
                         written into the padding)"
                    )
                } else {
                    format!(
                        "{n} block-scale bytes fit neither the linear [{rr}, {kb}] ({}) nor the \
                         swizzled [{pr}, {pk}] ({}) layout",
                        rr * kb,
                        pr * pk
                    )
                })
            }
        }
    }
}

impl Scales<'_> {
    /// The swizzled reading of an ambiguous tensor, in linear layout.
    pub fn alternative(&self) -> Option<Vec<u8>> {
        let (raw, rows, kb) = self.ambiguous?;
        Some(unswizzle_rows(raw.region, kb, raw.row0, rows))
    }

    /// The swizzled reading of an ambiguous tensor's first `n` rows, in linear layout.
    pub fn alternative_head(&self, n: usize) -> Option<Vec<u8>> {
        let (raw, rows, kb) = self.ambiguous?;
        Some(unswizzle_rows(raw.region, kb, raw.row0, n.min(rows)))
    }

    /// Use the swizzled reading of an ambiguous tensor.
    pub fn take_alternative(&mut self) {
        if let Some(a) = self.alternative() {
            self.linear = Cow::Owned(a);
            self.seen = ScalesSeen::Swizzled;
            self.ambiguous = None;
        }
    }
}

/// A quantized linear ready to compare: packed codes, linear scales, global scale.
#[derive(Clone, Debug)]
pub struct QMatrix<'a> {
    pub format: Format,
    pub rows: usize,
    pub cols: usize,
    /// `[rows, cols/2]`
    pub packed: Mat<'a>,
    /// `[rows, cols/block]`, linear
    pub scales: Cow<'a, [u8]>,
    /// Dequant direction (`weight_scale_2`); 1 for MXFP4.
    pub scale_2: f32,
}

impl<'a> QMatrix<'a> {
    pub fn kb(&self) -> usize {
        self.cols / self.format.block()
    }

    /// Rows `[r0, r0 + n)`.
    pub fn rows_slice(&self, r0: usize, n: usize) -> Option<QMatrix<'a>> {
        let kb = self.kb();
        let packed = self.packed.slice_rows(r0, n)?;
        let scales = match &self.scales {
            Cow::Borrowed(s) => Cow::Borrowed(s.get(r0 * kb..(r0 + n) * kb)?),
            Cow::Owned(s) => Cow::Owned(s.get(r0 * kb..(r0 + n) * kb)?.to_vec()),
        };
        Some(QMatrix {
            packed,
            scales,
            rows: n,
            ..*self
        })
    }

    /// Columns (K) `[c0, c0 + n)`; both must be multiples of the block.
    pub fn cols_slice(&self, c0: usize, n: usize) -> Option<QMatrix<'a>> {
        let block = self.format.block();
        if !c0.is_multiple_of(block) || !n.is_multiple_of(block) || c0 + n > self.cols {
            return None;
        }
        let kb = self.kb();
        let packed = self.packed.slice_cols(c0 / 2, n / 2)?;
        let (b0, nb) = (c0 / block, n / block);
        let mut scales = Vec::with_capacity(self.rows * nb);
        for r in 0..self.rows {
            scales.extend_from_slice(self.scales.get(r * kb + b0..r * kb + b0 + nb)?);
        }
        Some(QMatrix {
            packed,
            scales: Cow::Owned(scales),
            cols: n,
            ..*self
        })
    }

    /// Row `r`'s block scales (linear layout).
    pub fn scale_row(&self, r: usize) -> &[u8] {
        let kb = self.kb();
        &self.scales[r * kb..(r + 1) * kb]
    }

    /// Dequantize rows `[r0, r1)` into `out` (`(r1 - r0) * cols`).
    pub fn dequant_rows(&self, r0: usize, r1: usize, out: &mut [f32]) {
        let (cols, block) = (self.cols, self.format.block());
        for (i, r) in (r0..r1).enumerate() {
            dequantize_row(
                self.format,
                self.packed.row(r),
                self.scale_row(r),
                self.scale_2,
                block,
                &mut out[i * cols..(i + 1) * cols],
            );
        }
    }

    pub fn dequantize(&self) -> Vec<f32> {
        let mut v = vec![0f32; self.rows * self.cols];
        self.dequant_rows(0, self.rows, &mut v);
        v
    }

    /// Packed codes and block scales identical (the global scale aside).
    pub fn same_codes(&self, o: &QMatrix) -> bool {
        self.format == o.format && self.packed.same(&o.packed) && self.scales == o.scales
    }

    /// A sample reads the packed codes only: it nominates matches whatever layout a side's
    /// block scales were read in (a size both layouts fit reads linear unless told); the full
    /// fingerprint adds the scales.
    pub fn fingerprint(&self, depth: Depth) -> u64 {
        let mut h = Fingerprint::new();
        self.packed.hash_into(&mut h, depth);
        if depth == Depth::Full {
            h.update(&self.scales);
        }
        h.update(&[self.format.block() as u8]);
        h.finish()
    }
}

/// Which layout won when both were possible: `b`'s cosine with `reference` (of its shape)
/// under each scale reading, in the fused pass (no dequantized copies: a re-quantized
/// checkpoint decides this for every unit), and the rule of
/// `nvfp4::layout::layout_by_cosines`. Returns the layout and the cosines (linear, swizzled).
pub fn pick_scales(
    reference: &QMatrix,
    b: &QMatrix,
    alternative: &[u8],
) -> (ScaleLayout, f64, f64) {
    let cosine = |b: &QMatrix| {
        super::fused::metrics_nvfp4(reference, b)
            .unwrap_or_else(|| super::compare::metrics_qq(reference, b))
            .cosine
    };
    let swizzled = QMatrix {
        scales: Cow::Borrowed(alternative),
        ..b.clone()
    };
    let (cl, cs) = (cosine(b), cosine(&swizzled));
    (layout::layout_by_cosines(cl, cs), cl, cs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    #[test]
    fn fingerprint_ignores_how_the_stream_is_cut() {
        use rand::{Rng, SeedableRng};
        let seed: u64 = rand::random();
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        for _ in 0..50 {
            let n = r.gen_range(0..300);
            let v: Vec<u8> = (0..n).map(|_| r.gen()).collect();
            let mut whole = Fingerprint::new();
            whole.update(&v);
            let mut cut = Fingerprint::new();
            let mut at = 0;
            while at < n {
                let k = r.gen_range(0..=(n - at).min(41));
                cut.update(&v[at..at + k]);
                at += k;
            }
            let whole = whole.finish();
            assert_eq!(whole, cut.finish(), "seed {seed}, {n} bytes");
            if n > 0 {
                let mut w = v.clone();
                let i = r.gen_range(0..n);
                w[i] ^= 1 << r.gen_range(0..8);
                let mut f = Fingerprint::new();
                f.update(&w);
                assert_ne!(whole, f.finish(), "seed {seed}: one bit flipped at {i}");
            }
        }
    }

    /// On streams longer than the sample: the same windows whatever the row split and the
    /// stride, a flipped byte inside a window changes it, one between windows does not (the
    /// full fingerprint sees both).
    #[test]
    fn sampled_fingerprint_reads_the_windows_only() {
        let seed: u64 = rand::random();
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let (rows, cols) = (64 * r.gen_range(2..6), 1024 * r.gen_range(2..5));
        let data: Vec<u8> = (0..rows * (cols + 16)).map(|_| r.gen()).collect();
        // a strided view (a TP column slice) and the same bytes gathered densely
        let m = Mat::new(&data, rows, cols, cols + 16).unwrap();
        let dense = m.to_vec();
        let flat = Mat::dense(&dense, rows / 2, cols * 2).unwrap();
        let (s, f) = (m.fingerprint(Depth::Sample), m.fingerprint(Depth::Full));
        assert_eq!(s, flat.fingerprint(Depth::Sample), "seed {seed}");
        assert_eq!(f, flat.fingerprint(Depth::Full), "seed {seed}");
        let windows = sample_windows(dense.len());
        assert_eq!(windows.len(), SAMPLES);
        for (inside, at) in [
            (true, windows[0].0),
            (true, windows[SAMPLES - 1].1 - 1),
            (true, r.gen_range(windows[7].0..windows[7].1)),
            (false, r.gen_range(windows[3].1..windows[4].0)),
        ] {
            let mut other = dense.clone();
            other[at] ^= 1 << r.gen_range(0..8);
            let o = Mat::dense(&other, rows, cols).unwrap();
            assert_eq!(
                o.fingerprint(Depth::Sample) != s,
                inside,
                "seed {seed}, byte {at}"
            );
            assert_ne!(o.fingerprint(Depth::Full), f, "seed {seed}, byte {at}");
        }
    }

    #[test]
    fn strided_views_slice_and_compare() {
        let seed: u64 = rand::random();
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let data: Vec<u8> = (0..6 * 10).map(|_| r.gen()).collect();
        let m = Mat::dense(&data, 6, 10).unwrap();
        let s = m.slice_cols(4, 3).unwrap().slice_rows(2, 3).unwrap();
        for i in 0..3 {
            assert_eq!(
                s.row(i),
                &data[(i + 2) * 10 + 4..(i + 2) * 10 + 7],
                "seed {seed}"
            );
        }
        assert!(m.slice_rows(5, 2).is_none());
        assert!(m.slice_cols(8, 3).is_none());
        assert!(Mat::dense(&data, 7, 10).is_none());
        let t: Vec<u8> = (0..10)
            .flat_map(|c| (0..6).map(move |rr| (rr, c)))
            .map(|(rr, c)| data[rr * 10 + c])
            .collect();
        let tm = Mat::dense(&t, 10, 6).unwrap();
        assert!(tm.transposed_of(&m, 1));
        assert!(!m.same(&tm));
        assert_ne!(m.fingerprint(Depth::Full), tm.fingerprint(Depth::Full));
        // the row split does not matter to identity or fingerprints
        let flat = Mat::dense(&data, 1, 60).unwrap();
        assert!(flat.same(&m) && m.same(&flat));
        for depth in [Depth::Full, Depth::Sample] {
            assert_eq!(m.fingerprint(depth), flat.fingerprint(depth));
            assert_eq!(
                m.fingerprint(depth),
                Mat::dense(&data, 4, 15).unwrap().fingerprint(depth)
            );
        }
        let mut other = data.clone();
        other[37] ^= 1;
        let o = Mat::dense(&other, 3, 20).unwrap();
        assert!(!o.same(&m));
        assert_ne!(o.fingerprint(Depth::Full), m.fingerprint(Depth::Full));
    }

    #[test]
    fn fast_unswizzle_matches_the_reference_layout() {
        let seed: u64 = rand::random();
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        for _ in 0..20 {
            let (rows, kb) = (r.gen_range(1..400), r.gen_range(1..30));
            let lin: Vec<u8> = (0..rows * kb).map(|_| r.gen()).collect();
            let sw = layout::swizzle(&lin, rows, kb);
            let r0 = r.gen_range(0..rows);
            let n = r.gen_range(0..=rows - r0);
            assert_eq!(
                unswizzle_rows(&sw, kb, r0, n),
                lin[r0 * kb..(r0 + n) * kb],
                "seed {seed} {rows}x{kb}"
            );
        }
    }

    #[test]
    fn scales_are_read_in_either_layout() {
        let seed: u64 = rand::random();
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        // a fused region of 2 × 70 rows, kb = 3: swizzling pads, so the size decides
        let (rr, kb) = (140, 3);
        let lin: Vec<u8> = (0..rr * kb).map(|_| r.gen_range(1..=0x7e)).collect();
        let sw = layout::swizzle(&lin, rr, kb);
        for (bytes, seen) in [(&lin, ScalesSeen::Linear), (&sw, ScalesSeen::Swizzled)] {
            let raw = RawScales {
                region: bytes,
                region_rows: rr,
                row0: 70,
                tensor_swizzled: false,
            };
            let s = raw.resolve(70, kb).unwrap();
            assert_eq!(s.seen, seen);
            assert_eq!(&s.linear[..], &lin[70 * kb..], "seed {seed}");
        }
        let bad = vec![1u8; 17];
        let raw = RawScales {
            region: &bad,
            region_rows: rr,
            row0: 0,
            tensor_swizzled: false,
        };
        assert!(raw.resolve(70, kb).unwrap_err().contains("neither"));
        // 128 × 4: same size, ambiguous; the alternative is the swizzled reading
        let lin: Vec<u8> = (0..128 * 4).map(|_| r.gen_range(1..=0x7e)).collect();
        let sw = layout::swizzle(&lin, 128, 4);
        let mut raw = RawScales {
            region: &sw,
            region_rows: 128,
            row0: 0,
            tensor_swizzled: false,
        };
        let mut s = raw.resolve(128, 4).unwrap();
        assert_eq!(s.seen, ScalesSeen::Ambiguous);
        s.take_alternative();
        assert_eq!(&s.linear[..], &lin[..], "seed {seed}");
        // the tensor's other experts read swizzled: so is this one
        raw.tensor_swizzled = true;
        let s = raw.resolve(128, 4).unwrap();
        assert_eq!(s.seen, ScalesSeen::Swizzled);
        assert_eq!(&s.linear[..], &lin[..], "seed {seed}");
    }
}
