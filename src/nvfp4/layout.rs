//! Block-scale layouts: checkpoints hold linear `[N, K/16]`; CUTLASS / FlashInfer kernels
//! take the 128x4 swizzle (N padded to 128, K/16 padded to 4, padding zero). Reading one as
//! the other is a classic silent bug, so both directions and a detector live here.

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ScaleLayout {
    Linear,
    Swizzled,
}

#[inline]
fn ceil_to(v: usize, m: usize) -> usize {
    v.div_ceil(m) * m
}

/// Padded (rows, blocks-per-row) of the swizzled layout.
pub fn swizzled_dims(rows: usize, kb: usize) -> (usize, usize) {
    (ceil_to(rows, 128), ceil_to(kb, 4))
}

pub fn swizzled_len(rows: usize, kb: usize) -> usize {
    let (r, k) = swizzled_dims(rows, kb);
    r * k
}

/// Byte offset of scale (m, k) in the 128x4 swizzled layout.
#[inline]
pub fn swizzle_offset(m: usize, k: usize, kb: usize) -> usize {
    let k_tiles = kb.div_ceil(4);
    (m / 128 * k_tiles + k / 4) * 512 + (m % 32) * 16 + ((m / 32) % 4) * 4 + k % 4
}

/// Linear `[rows, kb]` → swizzled, zero padding.
pub fn swizzle(linear: &[u8], rows: usize, kb: usize) -> Vec<u8> {
    assert_eq!(linear.len(), rows * kb);
    let mut out = vec![0u8; swizzled_len(rows, kb)];
    for m in 0..rows {
        for k in 0..kb {
            out[swizzle_offset(m, k, kb)] = linear[m * kb + k];
        }
    }
    out
}

/// Swizzled → linear `[rows, kb]` (padding dropped).
pub fn unswizzle(swizzled: &[u8], rows: usize, kb: usize) -> Vec<u8> {
    assert_eq!(swizzled.len(), swizzled_len(rows, kb));
    let mut out = vec![0u8; rows * kb];
    for m in 0..rows {
        for k in 0..kb {
            out[m * kb + k] = swizzled[swizzle_offset(m, k, kb)];
        }
    }
    out
}

/// What the bytes of a scale tensor say about its layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LayoutGuess {
    Linear,
    Swizzled,
    /// Both layouts have the same size and nothing in the bytes tells them apart.
    Ambiguous,
    /// Neither size fits.
    Neither,
}

/// Tell the layout of `n` scale bytes for a `[rows, kb]` scale matrix. When the sizes differ,
/// the size decides. When they agree (rows % 128 == 0 and kb % 4 == 0) the swizzle leaves no
/// padding, and only the contents can tell: a non-zero byte in what would be padding of the
/// other layout cannot happen, so this is ambiguous; compare against a reference with
/// [`pick_layout_by_reference`] then.
pub fn detect_layout(n: usize, rows: usize, kb: usize, bytes: Option<&[u8]>) -> LayoutGuess {
    let lin = rows * kb;
    let sw = swizzled_len(rows, kb);
    if lin == sw {
        return if n == lin {
            LayoutGuess::Ambiguous
        } else {
            LayoutGuess::Neither
        };
    }
    if n == lin {
        return LayoutGuess::Linear;
    }
    if n == sw {
        // padding of a genuine swizzled tensor is zero
        if let Some(b) = bytes {
            let padding_clean = (0..sw).all(|off| b[off] == 0 || !is_padding(off, rows, kb));
            if !padding_clean {
                return LayoutGuess::Neither;
            }
        }
        return LayoutGuess::Swizzled;
    }
    LayoutGuess::Neither
}

fn is_padding(off: usize, rows: usize, kb: usize) -> bool {
    // invert the swizzle for this offset
    let k_tiles = kb.div_ceil(4);
    let tile = off / 512;
    let within = off % 512;
    let (m_tile, k_tile) = (tile / k_tiles, tile % k_tiles);
    let m = m_tile * 128 + ((within % 16) / 4) * 32 + within / 16;
    let k = k_tile * 4 + within % 4;
    m >= rows || k >= kb
}

/// Decide between the layouts by dequantizing under each and comparing with a reference of
/// the same tensor (e.g. the BF16 original or the other side of a weight comparison).
/// `dequant(layout)` returns the dequantized tensor under that reading of the scales.
/// Returns the layout (linear unless the swizzled reading is decisively closer) and the
/// cosines under (linear, swizzled).
pub fn pick_layout_by_reference(
    reference: &[f32],
    mut dequant: impl FnMut(ScaleLayout) -> Vec<f32>,
) -> (ScaleLayout, f64, f64) {
    let cl = crate::metrics::cosine(&dequant(ScaleLayout::Linear), reference);
    let cs = crate::metrics::cosine(&dequant(ScaleLayout::Swizzled), reference);
    (layout_by_cosines(cl, cs), cl, cs)
}

/// The layout of the cosines with a reference under the linear (`cl`) and the swizzled
/// (`cs`) reading: the swizzled one only when it is decisively closer (under a quarter of
/// the linear reading's distance 1 - cosine). A tensor that is not the reference's (another
/// expert, gate and up swapped) is far under both readings, and the nearer of two wrong
/// readings says nothing about the layout; a genuinely swizzled one is near under the
/// swizzled reading and scrambled under the linear one.
pub fn layout_by_cosines(cl: f64, cs: f64) -> ScaleLayout {
    if (1.0 - cs) * 4.0 < 1.0 - cl {
        ScaleLayout::Swizzled
    } else {
        ScaleLayout::Linear
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    #[test]
    fn offsets_are_a_permutation_at_padded_sizes() {
        for &(rows, kb) in &[(128, 4), (256, 8), (384, 12)] {
            let mut seen = vec![false; rows * kb];
            for m in 0..rows {
                for k in 0..kb {
                    let o = swizzle_offset(m, k, kb);
                    assert!(!seen[o]);
                    seen[o] = true;
                }
            }
        }
    }

    #[test]
    fn swizzle_round_trips_at_unpadded_sizes() {
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(rand::random());
        for &(rows, kb) in &[(1, 1), (7, 3), (129, 5), (300, 14), (128, 4), (256, 448)] {
            let lin: Vec<u8> = (0..rows * kb).map(|_| r.gen_range(1..=255)).collect();
            let sw = swizzle(&lin, rows, kb);
            assert_eq!(sw.len(), swizzled_len(rows, kb));
            assert_eq!(unswizzle(&sw, rows, kb), lin);
            // padding is zero and counted as such
            let nonzero = sw.iter().filter(|&&b| b != 0).count();
            assert_eq!(nonzero, rows * kb);
        }
    }

    #[test]
    fn known_offsets() {
        assert_eq!(swizzle_offset(0, 0, 4), 0);
        assert_eq!(swizzle_offset(0, 3, 4), 3);
        assert_eq!(swizzle_offset(1, 0, 4), 16);
        assert_eq!(swizzle_offset(32, 0, 4), 4);
        assert_eq!(swizzle_offset(127, 3, 4), 31 * 16 + 3 * 4 + 3);
        assert_eq!(swizzle_offset(0, 4, 8), 512);
        assert_eq!(swizzle_offset(128, 0, 8), 1024);
    }

    /// Swizzled only when that reading is decisively nearer: a swizzled tensor with some codes
    /// changed is still called swizzled; an unrelated tensor, where both readings are far, and
    /// a linear one are not.
    #[test]
    fn the_swizzled_reading_must_win_decisively() {
        let seed: u64 = rand::random();
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let (rows, kb) = (128 * r.gen_range(1..3), 4 * r.gen_range(1..4));
        let cols = 16 * kb;
        let codes = |r: &mut rand_chacha::ChaCha8Rng| -> Vec<u8> {
            (0..rows * cols).map(|_| r.gen_range(0..16)).collect()
        };
        let scales = |r: &mut rand_chacha::ChaCha8Rng| -> Vec<u8> {
            (0..rows * kb).map(|_| r.gen_range(0x18..0x60)).collect()
        };
        let values = |c: &[u8], s: &[u8]| -> Vec<f32> {
            (0..rows * cols)
                .map(|i| {
                    let (m, k) = (i / cols, (i % cols) / 16);
                    crate::nvfp4::e2m1::decode(c[i]) * crate::nvfp4::e4m3::decode(s[m * kb + k])
                })
                .collect()
        };
        let (ca, sa) = (codes(&mut r), scales(&mut r));
        let reference = values(&ca, &sa);
        // B stores its scales as given; the swizzled reading unswizzles them first
        let pick = |cb: &[u8], stored: &[u8]| {
            pick_layout_by_reference(&reference, |l| match l {
                ScaleLayout::Linear => values(cb, stored),
                ScaleLayout::Swizzled => values(cb, &unswizzle(stored, rows, kb)),
            })
        };
        let mut perturbed = ca.clone();
        for c in perturbed.iter_mut() {
            if r.gen_bool(0.1) {
                *c = r.gen_range(0..16);
            }
        }
        let (other_c, other_s) = (codes(&mut r), scales(&mut r));
        for (what, cb, stored, want) in [
            (
                "swizzled, 10% of codes changed",
                &perturbed,
                swizzle(&sa, rows, kb),
                ScaleLayout::Swizzled,
            ),
            (
                "another tensor, swizzled",
                &other_c,
                swizzle(&other_s, rows, kb),
                ScaleLayout::Linear,
            ),
            (
                "the same tensor, linear",
                &ca,
                sa.clone(),
                ScaleLayout::Linear,
            ),
        ] {
            let (got, cl, cs) = pick(cb, &stored);
            assert_eq!(
                got, want,
                "seed {seed}, {rows}x{kb}: {what}: cosines linear {cl}, swizzled {cs}"
            );
        }
    }

    #[test]
    fn detect_by_size_and_padding() {
        let lin: Vec<u8> = vec![0x38; 130 * 3];
        assert_eq!(
            detect_layout(lin.len(), 130, 3, Some(&lin)),
            LayoutGuess::Linear
        );
        let sw = swizzle(&lin, 130, 3);
        assert_eq!(
            detect_layout(sw.len(), 130, 3, Some(&sw)),
            LayoutGuess::Swizzled
        );
        let mut dirty = sw.clone();
        dirty[swizzle_offset(129, 3, 3)] = 1; // padding column
        assert_eq!(
            detect_layout(dirty.len(), 130, 3, Some(&dirty)),
            LayoutGuess::Neither
        );
        assert_eq!(detect_layout(128 * 4, 128, 4, None), LayoutGuess::Ambiguous);
        assert_eq!(detect_layout(5, 128, 4, None), LayoutGuess::Neither);
    }
}
