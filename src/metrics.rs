//! The one place metrics are defined (DESIGN.md §6): `test` is compared against `reference`,
//! accumulated in f64. JSON names: cosine, rel_l2, sqnr_db, max_abs_err, nan_count, inf_count.

use serde::Serialize;
use std::cmp::Ordering;

#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Metrics {
    pub cosine: f64,
    /// `‖test − ref‖ / ‖ref‖`
    pub rel_l2: f64,
    /// `20·log10(‖ref‖ / ‖test − ref‖)`
    pub sqnr_db: f64,
    /// NaN where `test` holds NaN/Inf, or where the reference holds a NaN against a finite
    /// test value (a NaN difference ranks above every number, as numpy's `max` has it).
    pub max_abs_err: f64,
    /// Flat index of the largest absolute error (the first, of equal ones; the first NaN
    /// difference, when one is; among finite test values only).
    pub max_abs_err_index: Option<usize>,
    /// Non-finite values in `test` (the reference is checked separately by the caller).
    pub nan_count: u64,
    pub inf_count: u64,
    pub first_nan: Option<usize>,
    pub first_inf: Option<usize>,
    pub len: usize,
}

/// Partial sums: mergeable, so chunks can be reduced in parallel and on the GPU alike.
#[derive(Clone, Copy, Debug, Default)]
pub struct Accum {
    pub dot: f64,
    pub nt: f64,
    pub nr: f64,
    pub err: f64,
    pub max_abs: f64,
    pub max_idx: Option<usize>,
    pub nan: u64,
    pub inf: u64,
    pub first_nan: Option<usize>,
    pub first_inf: Option<usize>,
    pub len: usize,
}

fn min_opt(a: Option<usize>, b: Option<usize>) -> Option<usize> {
    match (a, b) {
        (Some(x), Some(y)) => Some(x.min(y)),
        (x, None) => x,
        (None, y) => y,
    }
}

impl Accum {
    /// Accumulate `test[i]` vs `reference[i]` for i in the chunk starting at flat `offset`.
    /// Non-finite test values are counted and left out of the sums.
    pub fn over(test: &[f32], reference: &[f32], offset: usize) -> Accum {
        let mut a = Accum::default();
        a.add(test, reference, offset);
        a
    }

    /// Continue the pass with `test` against `reference` (from flat index `offset`), after
    /// the values already taken.
    pub fn add(&mut self, test: &[f32], reference: &[f32], offset: usize) {
        let a = self;
        a.len += test.len();
        for (i, (&t, &r)) in test.iter().zip(reference).enumerate() {
            if t.is_nan() {
                a.nan += 1;
                a.first_nan.get_or_insert(offset + i);
                continue;
            }
            if t.is_infinite() {
                a.inf += 1;
                a.first_inf.get_or_insert(offset + i);
                continue;
            }
            let (t, r) = (t as f64, r as f64);
            a.dot += t * r;
            a.nt += t * t;
            a.nr += r * r;
            let d = t - r;
            a.err += d * d;
            // `takes` only where it can: not at or below the maximum (NaN is neither; one
            // compare an element)
            let ad = d.abs();
            let past = !matches!(
                ad.partial_cmp(&a.max_abs),
                Some(Ordering::Less | Ordering::Equal)
            );
            if (past || a.max_idx.is_none()) && a.takes(ad, offset + i) {
                a.max_abs = ad;
                a.max_idx = Some(offset + i);
            }
        }
    }

    /// Whether |difference| `d` at flat index `i` takes the maximum from the one held. A NaN
    /// difference (a NaN in the reference; the test's are counted apart) ranks above every
    /// number, as in numpy's `max` and `argmax`, and of equal values the lower index wins:
    /// the same maximum and index whatever order pieces are taken or merged in, on the CPU
    /// and the GPU (`kernels/reduce.cu`) alike.
    #[inline(always)]
    pub fn takes(&self, d: f64, i: usize) -> bool {
        let Some(j) = self.max_idx else {
            return true;
        };
        let (nan, held_nan) = (d.is_nan(), self.max_abs.is_nan());
        if nan != held_nan {
            return nan;
        }
        d > self.max_abs || ((nan || d == self.max_abs) && i < j)
    }

    pub fn merge(mut self, o: Accum) -> Accum {
        self.dot += o.dot;
        self.nt += o.nt;
        self.nr += o.nr;
        self.err += o.err;
        if let Some(i) = o.max_idx {
            if self.takes(o.max_abs, i) {
                self.max_abs = o.max_abs;
                self.max_idx = o.max_idx;
            }
        }
        self.nan += o.nan;
        self.inf += o.inf;
        self.first_nan = min_opt(self.first_nan, o.first_nan);
        self.first_inf = min_opt(self.first_inf, o.first_inf);
        self.len += o.len;
        self
    }

    pub fn finish(self) -> Metrics {
        let nonfinite = self.nan + self.inf > 0;
        let cosine = if self.nt == 0.0 && self.nr == 0.0 {
            1.0
        } else if self.nt == 0.0 || self.nr == 0.0 {
            0.0
        } else if self.err == 0.0 {
            // equal values: exactly 1 (the quotient below can land an ulp short of it, so a
            // `cosine >= 1` test of equal tensors would fail)
            1.0
        } else {
            // |cos| ≤ 1 (Cauchy–Schwarz); summation rounding can put it an ulp past
            (self.dot / (self.nt.sqrt() * self.nr.sqrt())).clamp(-1.0, 1.0)
        };
        let rel_l2 = if self.nr == 0.0 {
            if self.err == 0.0 {
                0.0
            } else {
                f64::INFINITY
            }
        } else {
            (self.err / self.nr).sqrt()
        };
        let sqnr_db = if self.err == 0.0 {
            f64::INFINITY
        } else {
            10.0 * (self.nr / self.err).log10()
        };
        Metrics {
            // a tensor holding NaN/Inf does not get a reassuring cosine
            cosine: if nonfinite { f64::NAN } else { cosine },
            rel_l2: if nonfinite { f64::NAN } else { rel_l2 },
            sqnr_db: if nonfinite { f64::NAN } else { sqnr_db },
            max_abs_err: if nonfinite { f64::NAN } else { self.max_abs },
            // where it is NaN, at the test's first NaN (or Inf), as numpy's argmax puts it: not
            // at the largest finite difference, which a NaN maximum never names
            max_abs_err_index: if nonfinite {
                self.first_nan.or(self.first_inf)
            } else {
                self.max_idx
            },
            nan_count: self.nan,
            inf_count: self.inf,
            first_nan: self.first_nan,
            first_inf: self.first_inf,
            len: self.len,
        }
    }
}

/// Compare `test` against `reference` (same length).
pub fn compare(test: &[f32], reference: &[f32]) -> Metrics {
    use rayon::prelude::*;
    assert_eq!(test.len(), reference.len(), "compare: length mismatch");
    const CHUNK: usize = 1 << 16;
    test.par_chunks(CHUNK)
        .zip(reference.par_chunks(CHUNK))
        .enumerate()
        .map(|(i, (t, r))| Accum::over(t, r, i * CHUNK))
        .reduce(Accum::default, Accum::merge)
        .finish()
}

pub fn cosine(test: &[f32], reference: &[f32]) -> f64 {
    compare(test, reference).cosine
}

/// Count NaN and Inf and find the first of each.
pub fn nonfinite(x: &[f32]) -> (u64, u64, Option<usize>, Option<usize>) {
    let a = Accum::over(x, x, 0);
    (a.nan, a.inf, a.first_nan, a.first_inf)
}

/// The relative L2 error uncorrelated noise reaches at cosine `c`: `sqrt(1/c² − 1)` (infinite
/// for `c ≤ 0`). Cosine is blind to scale (`2·x` has cosine 1 with `x`); a comparison that must
/// also catch an output off by a factor bounds `rel_l2` by this.
pub fn max_rel_l2(c: f64) -> f64 {
    if c <= 0.0 {
        return f64::INFINITY;
    }
    (1.0 / (c * c) - 1.0).max(0.0).sqrt()
}

impl Metrics {
    /// Does this comparison pass a cosine threshold (no NaN/Inf allowed)?
    pub fn passes(&self, min_cosine: f64) -> bool {
        self.nan_count == 0 && self.inf_count == 0 && self.cosine >= min_cosine
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identical_and_scaled() {
        let a: Vec<f32> = (0..1000).map(|i| (i as f32 * 0.37).sin()).collect();
        let m = compare(&a, &a);
        assert!((m.cosine - 1.0).abs() < 1e-15);
        assert_eq!(m.rel_l2, 0.0);
        assert_eq!(m.sqnr_db, f64::INFINITY);
        let b: Vec<f32> = a.iter().map(|v| v * 1.1).collect();
        let m = compare(&b, &a);
        assert!((m.cosine - 1.0).abs() < 1e-12);
        assert!((m.rel_l2 - 0.1).abs() < 1e-6);
        assert!((m.sqnr_db - 20.0).abs() < 1e-4);
    }

    #[test]
    fn nan_and_inf_are_counted_with_first_index() {
        let mut a = vec![1f32; 200_000];
        let r = a.clone();
        a[70_000] = f32::NAN;
        a[150_000] = f32::NAN;
        a[100_000] = f32::NEG_INFINITY;
        let m = compare(&a, &r);
        assert_eq!((m.nan_count, m.inf_count), (2, 1));
        assert_eq!(m.first_nan, Some(70_000));
        assert_eq!(m.first_inf, Some(100_000));
        assert!(m.cosine.is_nan());
        assert!(!m.passes(0.0));
    }

    /// Sums whose rounding puts the dot product an ulp past the norms' product (a derived dot
    /// product of nearly equal tensors can) still give a cosine within [-1, 1].
    #[test]
    fn cosine_stays_within_one() {
        for (dot, want) in [(1.0 + f64::EPSILON, 1.0), (-1.0 - f64::EPSILON, -1.0)] {
            let a = Accum {
                dot,
                nt: 1.0,
                nr: 1.0,
                err: 1e-30,
                len: 2,
                ..Accum::default()
            };
            assert_eq!(a.finish().cosine, want);
        }
    }

    /// A NaN in the reference (the test finite there) takes the maximum from every number,
    /// before or after it, and the first such index is kept; equal maxima keep the lower
    /// index. Pieces cut at random places and merged in every order give what one pass does.
    #[test]
    fn a_nan_difference_takes_the_maximum_whatever_the_merge_order() {
        use rand::{Rng, SeedableRng};
        let seed: u64 = rand::random();
        let mut g = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        for case in 0..200 {
            let n = g.gen_range(8..400);
            let r: Vec<f32> = (0..n).map(|_| g.gen_range(-1.0f32..1.0)).collect();
            let mut t: Vec<f32> = r.iter().map(|v| v + g.gen_range(-0.01f32..0.01)).collect();
            let mut r = r;
            // a large difference twice (a tie), and in half the cases NaNs in the reference
            let (big1, big2) = (g.gen_range(0..n), g.gen_range(0..n));
            t[big1] = r[big1] + 8.0;
            t[big2] = r[big2] + 8.0;
            let nans: Vec<usize> = if case % 2 == 0 {
                (0..g.gen_range(1..4)).map(|_| g.gen_range(0..n)).collect()
            } else {
                vec![]
            };
            for &i in &nans {
                r[i] = f32::NAN;
            }
            let want = match nans.iter().min() {
                Some(&i) => (f64::NAN, i),
                None => {
                    let m = (0..n)
                        .map(|i| (t[i] as f64 - r[i] as f64).abs())
                        .fold(0.0, f64::max);
                    let i = (0..n)
                        .find(|&i| (t[i] as f64 - r[i] as f64).abs() == m)
                        .unwrap();
                    (m, i)
                }
            };
            let mut cuts: Vec<usize> = (0..g.gen_range(0..5)).map(|_| g.gen_range(0..=n)).collect();
            cuts.extend([0, n]);
            cuts.sort();
            let mut parts: Vec<Accum> = cuts
                .windows(2)
                .map(|w| Accum::over(&t[w[0]..w[1]], &r[w[0]..w[1]], w[0]))
                .collect();
            for order in 0..3 {
                match order {
                    1 => parts.reverse(),
                    2 => {
                        let half = parts.len() / 2;
                        parts.rotate_left(half)
                    }
                    _ => {}
                }
                let m = parts
                    .iter()
                    .fold(Accum::default(), |a, &p| a.merge(p))
                    .finish();
                let got = (m.max_abs_err, m.max_abs_err_index.unwrap());
                assert!(
                    got.1 == want.1 && (got.0 == want.0 || (got.0.is_nan() && want.0.is_nan())),
                    "seed {seed} case {case} order {order}: {got:?} against {want:?}"
                );
            }
        }
    }

    #[test]
    fn max_abs_err_index() {
        let r = vec![0f32, 1.0, 2.0, 3.0];
        let t = vec![0f32, 1.5, 2.0, 2.0];
        let m = compare(&t, &r);
        assert_eq!(m.max_abs_err, 1.0);
        assert_eq!(m.max_abs_err_index, Some(3));
    }

    /// A NaN (or Inf) in the test side makes `max_abs_err` NaN: its index is the first NaN
    /// (it was the largest finite difference's, a place that holds no NaN), else the first Inf.
    #[test]
    fn a_nan_maximum_is_placed_at_the_first_nan() {
        use rand::{Rng, SeedableRng};
        let seed: u64 = rand::random();
        let mut g = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let n = 1000;
        let r: Vec<f32> = (0..n).map(|_| g.gen_range(-1.0..1.0)).collect();
        let mut t: Vec<f32> = r.iter().map(|x| x + g.gen_range(-0.01..0.01)).collect();
        let (big, inf, nan) = (
            g.gen_range(0..300),
            g.gen_range(300..600),
            g.gen_range(600..n),
        );
        t[big] += 100.0;
        t[inf] = f32::INFINITY;
        let m = compare(&t, &r);
        assert!(m.max_abs_err.is_nan(), "seed {seed}");
        assert_eq!(m.max_abs_err_index, Some(inf), "seed {seed}");
        t[nan] = f32::NAN;
        let m = compare(&t, &r);
        assert_eq!(m.max_abs_err_index, Some(nan), "seed {seed}");
        assert_eq!(
            (m.first_nan, m.first_inf),
            (Some(nan), Some(inf)),
            "seed {seed}"
        );
    }
}
