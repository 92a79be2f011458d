//! Streaming passes over trace tensors: non-finite search and comparison. Tensors are converted
//! to f32 one block at a time, so a multi-GB activation never needs a full f32 copy; each block
//! is split over threads.

use super::file::TensorRef;
use crate::metrics::{Accum, Metrics};
use rayon::prelude::*;
use serde::Serialize;

/// Elements converted at once (16 MiB of f32).
const BLOCK: usize = 1 << 22;
/// Elements per parallel task; the same chunking `metrics::compare` uses.
const CHUNK: usize = 1 << 16;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    Nan,
    Inf,
}

impl Kind {
    pub fn of(v: f32) -> Option<Kind> {
        if v.is_nan() {
            Some(Kind::Nan)
        } else if v.is_infinite() {
            Some(Kind::Inf)
        } else {
            None
        }
    }
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Nan => "nan",
            Kind::Inf => "inf",
        }
    }
}

/// What a scan of one float tensor found.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct TensorStats {
    pub numel: usize,
    pub nan_count: u64,
    pub inf_count: u64,
    /// How many of the Inf are -Inf.
    pub neg_inf_count: u64,
    /// Flat index and value of the first NaN or ±Inf (whichever comes first).
    pub first_nonfinite: Option<(usize, f32)>,
    /// Flat index of the first NaN.
    pub first_nan: Option<usize>,
    /// Largest |x| among the finite values (0 when there are none): how close a tensor runs
    /// to the overflow that turns into Inf one module later.
    pub max_abs: f32,
}

impl TensorStats {
    pub fn is_finite(&self) -> bool {
        self.nan_count == 0 && self.inf_count == 0
    }

    /// An additive attention mask: only `0` and `-inf` (both present), no NaN, no +Inf. Its
    /// `-inf` are the mask's meaning, not a fault; no computation that went wrong produces
    /// exactly this (an overflow leaves its finite neighbours nonzero).
    pub fn is_mask(&self) -> bool {
        self.nan_count == 0
            && self.inf_count > 0
            && self.neg_inf_count == self.inf_count
            && (self.inf_count as usize) < self.numel
            && self.max_abs == 0.0
    }

    /// The first value that is a fault: the first NaN of a mask that holds NaN too (its `-inf`
    /// are the mask's meaning, not where it went wrong), else the first NaN or ±Inf.
    pub fn first_fault(&self) -> Option<(usize, f32)> {
        let mask_but_nan = self.nan_count > 0
            && self.inf_count > 0
            && self.neg_inf_count == self.inf_count
            && self.max_abs == 0.0;
        match self.first_nan {
            Some(i) if mask_but_nan => Some((i, f32::NAN)),
            _ => self.first_nonfinite,
        }
    }

    pub fn first_kind(&self) -> Option<Kind> {
        self.first_nonfinite.and_then(|(_, v)| Kind::of(v))
    }

    fn over(x: &[f32], offset: usize) -> TensorStats {
        let mut s = TensorStats {
            numel: x.len(),
            ..Default::default()
        };
        for (i, &v) in x.iter().enumerate() {
            if v.is_nan() {
                s.nan_count += 1;
                s.first_nan.get_or_insert(offset + i);
            } else if v.is_infinite() {
                s.inf_count += 1;
                s.neg_inf_count += u64::from(v < 0.0);
            } else {
                s.max_abs = s.max_abs.max(v.abs());
                continue;
            }
            s.first_nonfinite.get_or_insert((offset + i, v));
        }
        s
    }

    pub fn merge(mut self, o: TensorStats) -> TensorStats {
        self.numel += o.numel;
        self.nan_count += o.nan_count;
        self.inf_count += o.inf_count;
        self.neg_inf_count += o.neg_inf_count;
        self.max_abs = self.max_abs.max(o.max_abs);
        self.first_nonfinite = match (self.first_nonfinite, o.first_nonfinite) {
            (Some(a), Some(b)) => Some(if b.0 < a.0 { b } else { a }),
            (a, b) => a.or(b),
        };
        self.first_nan = match (self.first_nan, o.first_nan) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        self
    }
}

/// Scan a tensor for NaN/Inf. `None` for dtypes that cannot hold them (ints, bool, packed FP4).
pub fn tensor_stats(t: &TensorRef) -> Option<TensorStats> {
    if !t.is_float() {
        return None;
    }
    let n = t.numel();
    let mut buf = Vec::new();
    let mut acc = TensorStats::default();
    let mut start = 0;
    while start < n {
        t.read_f32(start, BLOCK, &mut buf);
        if buf.is_empty() {
            break;
        }
        let block = buf
            .par_chunks(CHUNK)
            .enumerate()
            .map(|(i, c)| TensorStats::over(c, start + i * CHUNK))
            .reduce(TensorStats::default, TensorStats::merge);
        acc = acc.merge(block);
        start += buf.len();
    }
    Some(acc)
}

/// `a` and `b` as f32 over their common length, `BLOCK` values at a time: `f(start, a, b)` for
/// each block, until it returns false. True when every block was read in full and accepted.
pub fn paired_blocks(
    a: &TensorRef,
    b: &TensorRef,
    mut f: impl FnMut(usize, &[f32], &[f32]) -> bool,
) -> bool {
    let n = a.numel().min(b.numel());
    let (mut ba, mut bb) = (Vec::new(), Vec::new());
    let mut start = 0;
    while start < n {
        a.read_f32(start, BLOCK, &mut ba);
        b.read_f32(start, BLOCK, &mut bb);
        let len = ba.len().min(bb.len());
        if len == 0 || !f(start, &ba[..len], &bb[..len]) {
            return false;
        }
        start += len;
    }
    true
}

/// `test` against `reference` with the metrics of `crate::metrics` (the same `Accum` partial
/// sums `metrics::compare` reduces, fed block by block), plus the reference's own NaN/Inf
/// counts, which `Metrics` leaves to the caller. Both must be float with equal `numel`.
pub fn compare_tensors(test: &TensorRef, reference: &TensorRef) -> (Metrics, TensorStats) {
    let mut acc = Accum::default();
    let mut ref_stats = TensorStats::default();
    paired_blocks(test, reference, |start, t, r| {
        let (a, s) = block_stats(start, t, r);
        acc = acc.merge(a);
        ref_stats = ref_stats.merge(s);
        true
    });
    (acc.finish(), ref_stats)
}

/// One block of [`compare_tensors`] (values `start..` of TEST `t` and REF `r`): the metrics'
/// partial sums and REF's NaN/Inf counts, over the cores.
pub fn block_stats(start: usize, t: &[f32], r: &[f32]) -> (Accum, TensorStats) {
    t.par_chunks(CHUNK)
        .zip(r.par_chunks(CHUNK))
        .enumerate()
        .map(|(i, (t, r))| {
            let off = start + i * CHUNK;
            (Accum::over(t, r, off), TensorStats::over(r, off))
        })
        .reduce(
            || (Accum::default(), TensorStats::default()),
            |(a1, s1), (a2, s2)| (a1.merge(a2), s1.merge(s2)),
        )
}

/// Where a flat index lies: the first dim is the token, the rest flattened is the channel.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ElementIndex {
    pub flat: usize,
    /// `None` for a 0-d tensor.
    pub token: Option<usize>,
    pub channel: Option<usize>,
    /// The full multi-index, row-major.
    pub multi: Vec<usize>,
}

pub fn element_index(shape: &[usize], flat: usize) -> ElementIndex {
    let mut multi = vec![0; shape.len()];
    let mut rest = flat;
    for (m, &d) in multi.iter_mut().zip(shape).rev() {
        if d > 0 {
            *m = rest % d;
            rest /= d;
        }
    }
    // Leading dims are tokens (`[T, H]` from vLLM, `[B, S, H]` from transformers: the token
    // is then the flattened `b * S + s`, as vLLM numbers them); the last dim is the channel.
    let per_token: usize = if shape.len() >= 2 {
        shape[shape.len() - 1]
    } else {
        1
    };
    let (token, channel) = if shape.is_empty() || per_token == 0 {
        (None, None)
    } else {
        (Some(flat / per_token), Some(flat % per_token))
    };
    ElementIndex {
        flat,
        token,
        channel,
        multi,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn element_index_splits_token_and_channel() {
        let i = element_index(&[4, 3, 5], 2 * 15 + 5 + 4);
        assert_eq!(i.token, Some(2 * 3 + 1));
        assert_eq!(i.channel, Some(4));
        assert_eq!(i.multi, vec![2, 1, 4]);
        let i = element_index(&[7], 6);
        assert_eq!((i.token, i.channel, i.multi), (Some(6), Some(0), vec![6]));
        let i = element_index(&[], 0);
        assert_eq!((i.token, i.channel), (None, None));
    }

    #[test]
    fn stats_over_chunks_match_a_plain_loop() {
        use rand::{Rng, SeedableRng};
        let seed: u64 = rand::random();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let n = CHUNK * 3 + rng.gen_range(1..CHUNK);
        let mut x: Vec<f32> = (0..n).map(|_| rng.gen_range(-3.0f32..3.0)).collect();
        let bad: Vec<usize> = (0..5).map(|_| rng.gen_range(CHUNK..n)).collect();
        for (k, &i) in bad.iter().enumerate() {
            x[i] = if k % 2 == 0 {
                f32::NAN
            } else {
                f32::NEG_INFINITY
            };
        }
        let chunks = x
            .par_chunks(CHUNK)
            .enumerate()
            .map(|(i, c)| TensorStats::over(c, i * CHUNK))
            .reduce(TensorStats::default, TensorStats::merge);
        let first = *bad.iter().min().unwrap();
        assert_eq!(
            chunks.first_nonfinite.map(|f| f.0),
            Some(first),
            "seed {seed}"
        );
        assert_eq!(chunks.numel, n);
        let nan = x.iter().filter(|v| v.is_nan()).count() as u64;
        let inf = x.iter().filter(|v| v.is_infinite()).count() as u64;
        assert_eq!(
            (chunks.nan_count, chunks.inf_count),
            (nan, inf),
            "seed {seed}"
        );
        let max = x
            .iter()
            .filter(|v| v.is_finite())
            .fold(0f32, |m, v| m.max(v.abs()));
        assert_eq!(chunks.max_abs, max, "seed {seed}");
    }
}
