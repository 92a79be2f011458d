//! Each token's row of a tensor pair, for bisect's per-token check: the whole tensor's
//! metrics hide a few bad rows (one position's RoPE, a padded row, two tokens' rows swapped),
//! so each row (leading dims flattened, the last dim the channel) is held to a looser bar of
//! its own. The rows' sums come from the same single read as the whole tensor's metrics.

use super::file::TensorRef;
use super::scan::{block_stats, paired_blocks, TensorStats};
use crate::metrics::{max_rel_l2, Accum, Metrics};
use rayon::prelude::*;

/// The cosine one token's row must reach: ten times the tensor's allowed `1 − C`, so the
/// spread of healthy noise over thousands of rows stays above it while a zeroed, swapped or
/// garbage row (cosine near 0) does not.
pub fn token_min_cosine(min_cosine: f64) -> f64 {
    1.0 - 10.0 * (1.0 - min_cosine)
}

/// The tokens of a tensor that fail [`token_min_cosine`].
pub struct WorstToken {
    /// The first failing token (row index over all leading dims).
    pub token: usize,
    pub cosine: f64,
    /// Failing tokens, and tokens in all.
    pub count: usize,
    pub tokens: usize,
}

/// (TEST · REF, ‖TEST‖², ‖REF‖², ‖TEST − REF‖²) of each whole row, in element order.
struct Rows {
    len: usize,
    sums: Vec<[f64; 4]>,
    /// The row a block ended inside of.
    open: [f64; 4],
}

fn fold(s: &mut [f64; 4], t: &[f32], r: &[f32]) {
    for (&x, &y) in t.iter().zip(r) {
        let (x, y) = (x as f64, y as f64);
        s[0] += x * y;
        s[1] += x * x;
        s[2] += y * y;
        s[3] += (x - y) * (x - y);
    }
}

impl Rows {
    /// Elements `start..start + t.len()`: the open row's rest, whole rows (in parallel), the
    /// next open row's start.
    fn add(&mut self, start: usize, t: &[f32], r: &[f32]) {
        let off = start % self.len;
        let mut i = 0;
        if off != 0 {
            i = (self.len - off).min(t.len());
            fold(&mut self.open, &t[..i], &r[..i]);
            if off + i == self.len {
                self.sums.push(std::mem::take(&mut self.open));
            }
        }
        let whole = (t.len() - i) / self.len * self.len;
        let (tw, rw) = (&t[i..i + whole], &r[i..i + whole]);
        self.sums.par_extend(
            tw.par_chunks_exact(self.len)
                .zip(rw.par_chunks_exact(self.len))
                .map(|(a, b)| {
                    let mut s = [0f64; 4];
                    fold(&mut s, a, b);
                    s
                }),
        );
        fold(&mut self.open, &t[i + whole..], &r[i + whole..]);
    }
}

/// `test` against `reference` as `scan::compare_tensors` does, and each token row's sums
/// when the per-token check applies to the pair (two dims or more, two rows or more, a bar
/// above -1 at `min_cosine`): one read of both.
pub fn compare(
    test: &TensorRef,
    reference: &TensorRef,
    min_cosine: f64,
) -> (Metrics, TensorStats, Option<Vec<[f64; 4]>>) {
    let row = reference.shape.last().copied().unwrap_or(0);
    let n = test.numel().min(reference.numel());
    let applies = reference.shape.len() >= 2
        && row > 0
        && n / row >= 2
        && token_min_cosine(min_cosine) > -1.0;
    let mut rows = applies.then(|| Rows {
        len: row,
        sums: Vec::with_capacity(n / row),
        open: [0f64; 4],
    });
    let mut acc = Accum::default();
    let mut stats = TensorStats::default();
    let whole = paired_blocks(test, reference, |start, t, r| {
        let (a, s) = block_stats(start, t, r);
        acc = acc.merge(a);
        stats = stats.merge(s);
        if let Some(rows) = &mut rows {
            rows.add(start, t, r);
        }
        true
    });
    // a short read leaves rows out: no per-token verdict on a part
    let sums = rows.filter(|_| whole).map(|r| r.sums);
    (acc.finish(), stats, sums)
}

/// Rows whose cosine is below [`token_min_cosine`] and whose error is more than noise could
/// put on an average row (`max_rel_l2(C)` × the RMS row norm of REF), so near-zero rows
/// (padding) cannot trip it. `None` when every token passes.
pub fn worst(sums: &[[f64; 4]], min_cosine: f64) -> Option<WorstToken> {
    let floor = token_min_cosine(min_cosine);
    let rows = sums.len();
    if rows < 2 {
        return None;
    }
    let mean_nr = sums.iter().map(|s| s[2]).sum::<f64>() / rows as f64;
    let min_err = max_rel_l2(min_cosine).powi(2) * mean_nr;
    let mut worst: Option<WorstToken> = None;
    for (i, s) in sums.iter().enumerate() {
        let cos = if s[1] == 0.0 && s[2] == 0.0 {
            1.0
        } else if s[1] == 0.0 || s[2] == 0.0 {
            0.0
        } else {
            s[0] / (s[1].sqrt() * s[2].sqrt())
        };
        // NaN/Inf rows are the global check's business
        if !cos.is_finite() || !s[3].is_finite() || cos >= floor || s[3] <= min_err {
            continue;
        }
        match &mut worst {
            None => {
                worst = Some(WorstToken {
                    token: i,
                    cosine: cos,
                    count: 1,
                    tokens: rows,
                })
            }
            Some(w) => w.count += 1,
        }
    }
    worst
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Rows cut anywhere by the blocks give each row's sums as one pass over the row does.
    #[test]
    fn rows_across_blocks_are_each_rows_sums() {
        let seed: u64 = rand::random();
        let mut g = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        for _ in 0..20 {
            let len = g.gen_range(1..50);
            let n = len * g.gen_range(1..30) + g.gen_range(0..len);
            let t: Vec<f32> = (0..n).map(|_| g.gen_range(-2.0..2.0)).collect();
            let r: Vec<f32> = (0..n).map(|_| g.gen_range(-2.0..2.0)).collect();
            let mut rows = Rows {
                len,
                sums: vec![],
                open: [0f64; 4],
            };
            let mut start = 0;
            while start < n {
                let end = (start + g.gen_range(1..3 * len)).min(n);
                rows.add(start, &t[start..end], &r[start..end]);
                start = end;
            }
            assert_eq!(rows.sums.len(), n / len, "seed {seed}");
            for (k, got) in rows.sums.iter().enumerate() {
                let mut want = [0f64; 4];
                fold(
                    &mut want,
                    &t[k * len..(k + 1) * len],
                    &r[k * len..(k + 1) * len],
                );
                assert_eq!(*got, want, "seed {seed}: row {k} of {len}");
            }
        }
    }
}
