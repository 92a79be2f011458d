//! Timing statistics: median and min over repeats, how many repeats fit a time budget, and
//! how many input sets to rotate through so that repeats do not read from the L2.

use crate::error::{Error, Result};

/// The per-repeat times of one figure, in milliseconds (finite, positive, at least one).
#[derive(Clone, Debug, PartialEq)]
pub struct Samples {
    sorted: Vec<f64>,
}

impl Samples {
    pub fn new(mut ms: Vec<f64>) -> Result<Samples> {
        if ms.is_empty() {
            return Err(Error::usage("timing: no repeats were timed"));
        }
        if let Some(bad) = ms.iter().find(|v| !v.is_finite() || **v <= 0.0) {
            return Err(Error::usage(format!(
                "timing: an event pair measured {bad} ms (expected a positive time)"
            )));
        }
        ms.sort_by(f64::total_cmp);
        Ok(Samples { sorted: ms })
    }

    pub fn len(&self) -> usize {
        self.sorted.len()
    }

    pub fn is_empty(&self) -> bool {
        self.sorted.is_empty()
    }

    /// The middle value; the mean of the two middle values for an even count.
    pub fn median(&self) -> f64 {
        let n = self.sorted.len();
        if n % 2 == 1 {
            self.sorted[n / 2]
        } else {
            0.5 * (self.sorted[n / 2 - 1] + self.sorted[n / 2])
        }
    }

    pub fn min(&self) -> f64 {
        self.sorted[0]
    }

    pub fn max(&self) -> f64 {
        self.sorted[self.sorted.len() - 1]
    }

    pub fn mean(&self) -> f64 {
        self.sorted.iter().sum::<f64>() / self.sorted.len() as f64
    }
}

/// The rotated input sets must add up to this many L2s, so that by the time a set comes
/// round again the cache has been overwritten several times.
pub const L2_FACTOR: u64 = 4;

/// How many input sets of `bytes_per_set` to rotate through: enough for their total to reach
/// `L2_FACTOR` times the L2, at least 1, at most `cap`.
pub fn rotation_sets(bytes_per_set: u64, l2_bytes: u64, cap: usize) -> usize {
    let want = (L2_FACTOR * l2_bytes).div_ceil(bytes_per_set.max(1));
    (want as usize).clamp(1, cap.max(1))
}

/// Repeats that fit `budget_ms` at `estimate_ms` each, within `[min, max]`.
pub fn reps_for(budget_ms: f64, estimate_ms: f64, min: usize, max: usize) -> usize {
    let max = max.max(min).max(1);
    if !(estimate_ms.is_finite() && estimate_ms > 0.0) {
        return max;
    }
    let n = (budget_ms / estimate_ms).floor();
    if n >= max as f64 {
        max
    } else {
        (n as usize).clamp(min.max(1), max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::seq::SliceRandom;
    use rand::{Rng, SeedableRng};

    #[test]
    fn median_and_min_of_shuffled_repeats() {
        let seed: u64 = rand::random();
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        for _ in 0..50 {
            let n = r.gen_range(1..40);
            let mut v: Vec<f64> = (0..n).map(|_| r.gen_range(0.01..5.0)).collect();
            let mut sorted = v.clone();
            sorted.sort_by(f64::total_cmp);
            v.shuffle(&mut r);
            let s = Samples::new(v).unwrap();
            let want = if n % 2 == 1 {
                sorted[n / 2]
            } else {
                (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
            };
            assert_eq!(s.median(), want, "seed {seed}");
            assert_eq!(s.min(), sorted[0], "seed {seed}");
            assert_eq!(s.max(), sorted[n - 1], "seed {seed}");
            assert_eq!(s.len(), n);
            // the median sits between min and max, and at least half the samples are <= it
            assert!(s.min() <= s.median() && s.median() <= s.max());
            let below = sorted.iter().filter(|x| **x <= s.median()).count();
            assert!(2 * below >= n, "seed {seed}");
        }
    }

    #[test]
    fn median_by_hand() {
        assert_eq!(Samples::new(vec![3.0]).unwrap().median(), 3.0);
        assert_eq!(Samples::new(vec![4.0, 1.0]).unwrap().median(), 2.5);
        assert_eq!(Samples::new(vec![9.0, 1.0, 2.0]).unwrap().median(), 2.0);
        let s = Samples::new(vec![1.0, 100.0, 2.0, 3.0]).unwrap();
        assert_eq!(s.median(), 2.5);
        assert_eq!(s.mean(), 26.5);
        assert_eq!(s.min(), 1.0);
    }

    #[test]
    fn empty_negative_or_nan_times_are_errors() {
        assert!(Samples::new(vec![]).is_err());
        assert!(Samples::new(vec![1.0, f64::NAN]).is_err());
        assert!(Samples::new(vec![1.0, 0.0]).is_err());
        assert!(Samples::new(vec![-1.0]).is_err());
        assert!(Samples::new(vec![f64::INFINITY]).is_err());
    }

    #[test]
    fn rotation_covers_four_l2s() {
        let l2 = 60 << 20;
        // the quantize input (117 MB + outputs): 2 sets of 150 MB = 300 MB >= 240 MB
        assert_eq!(rotation_sets(150 << 20, l2, 16), 2);
        // one 8192^3 GEMM set (512 MB) is already larger
        assert_eq!(rotation_sets(512 << 20, l2, 16), 1);
        // tiny sets hit the cap
        assert_eq!(rotation_sets(1 << 20, l2, 8), 8);
        assert_eq!(rotation_sets(0, l2, 8), 8);
        for per in [
            1u64 << 20,
            7 << 20,
            33 << 20,
            61 << 20,
            100 << 20,
            239 << 20,
        ] {
            let n = rotation_sets(per, l2, 1000) as u64;
            assert!(n * per >= L2_FACTOR * l2, "{per}: {n}");
            assert!(
                (n - 1) * per < L2_FACTOR * l2,
                "{per}: {n} is more than needed"
            );
        }
    }

    #[test]
    fn repeats_fit_the_budget() {
        assert_eq!(reps_for(1000.0, 10.0, 5, 500), 100);
        assert_eq!(reps_for(1000.0, 0.001, 5, 200), 200);
        assert_eq!(reps_for(1000.0, 900.0, 5, 200), 5);
        assert_eq!(reps_for(1000.0, f64::NAN, 5, 200), 200);
        assert_eq!(reps_for(1000.0, 0.0, 5, 200), 200);
        assert_eq!(reps_for(10.0, 1.0, 20, 10), 20);
    }
}
