//! One expert's own output against its reference (layertest and multilayer): when it fails
//! the verdict, and when too few token slots reached it to judge.
//!
//! An expert's error over `n` slots is pooled over `n` tokens, and one token's is noisy: a
//! token whose expert output is small, or whose input has outlier channels, carries a large
//! relative NVFP4 error. On healthy synthetic layers (4-64 tokens, 164k experts) one slot went
//! down to cosine 0.78 / up to rel-L2 0.64, two slots to 0.896 / 0.45 (past the 0.90 / 0.484
//! of `--min-expert-cosine`: about 1 run in 700 at 4-12 tokens failed on a healthy layer),
//! three or more never below 0.92 / above 0.39. So the bar an expert must reach ramps with its
//! slots: [`FEW_SLOTS_MIN_COSINE`] (0.7) on one slot, linearly up to `--min-expert-cosine` at
//! `--min-expert-slots` (3): 0.7, 0.8, then 0.9, each under the healthy minimum of its slot
//! count. An expert between its bar and `--min-expert-cosine` is too few tokens to judge: a
//! note, not a failure.

use super::layertest::below;
use crate::moe::breakdown::ExpertMetrics;
use crate::report::f;

/// Default `--min-expert-slots`: the fewest (token, slot) pairs over which an expert must
/// reach `--min-expert-cosine` itself (see the module doc for the measurements).
pub const DEFAULT_MIN_EXPERT_SLOTS: usize = 3;
/// The bar of an expert on a single slot (or the rel-L2 it allows, sqrt(1/0.7² − 1) = 1.02;
/// `--min-expert-cosine` when that is lower): healthy single slots stayed above 0.78 and
/// within 0.64, while a swapped gate/up or a 2x down_proj weight_scale_2 lands past it on
/// about half of single slots (and past 0.8 on nine in ten pairs); a 0.4x one stays within
/// one token's noise.
pub const FEW_SLOTS_MIN_COSINE: f64 = 0.7;

/// The widest an expert's output norm may stray from its reference's (`‖test‖/‖ref‖` within
/// [1/1.75, 1.75]), whatever its slots: healthy single slots of the built-in layer stayed within
/// 0.675-1.48 (38,400 slots, 150 seeds), pooled experts closer to 1, while a weight_scale_2 or
/// input_scale off by 2 (or 0.5) moves the ratio to about 2 (0.5). On one slot the cosine bar
/// (rel-L2 1.02) lets such a factor through about half the time; this catches it.
pub const MAX_NORM_RATIO: f64 = 1.75;

/// How experts are judged: `--min-expert-cosine` and `--min-expert-slots`.
#[derive(Clone, Copy, Debug)]
pub struct ExpertCheck {
    pub min_cosine: f64,
    pub min_slots: usize,
}

/// What one expert's own output says.
#[derive(Clone, Debug, PartialEq)]
pub enum ExpertVerdict {
    Pass,
    /// Misses `--min-expert-cosine` over fewer than `--min-expert-slots` slots, within what
    /// NVFP4 noise reaches on so few tokens.
    TooFewSlots,
    /// The failure line.
    Fail(String),
}

impl ExpertCheck {
    /// The verdict on `x` (NaN/Inf in it are reported on their own: `Pass` here).
    pub fn judge(&self, x: &ExpertMetrics) -> ExpertVerdict {
        let c = self.min_cosine;
        let Some(miss) = expert_failure(x, c, &format!("--min-expert-cosine {c}")) else {
            return magnitude_failure(x).map_or(ExpertVerdict::Pass, ExpertVerdict::Fail);
        };
        if x.slots >= self.min_slots {
            return ExpertVerdict::Fail(miss);
        }
        let low = self.bar(x.slots);
        let bar = format!(
            "{} (the bar of {} slot{} under --min-expert-slots {}: beyond NVFP4 noise on so few tokens)",
            f(low, 3),
            x.slots,
            if x.slots == 1 { "" } else { "s" },
            self.min_slots
        );
        match expert_failure(x, low, &bar).or_else(|| magnitude_failure(x)) {
            Some(gross) => ExpertVerdict::Fail(gross),
            None => ExpertVerdict::TooFewSlots,
        }
    }

    /// The cosine an expert over `slots` slots must reach to pass (and the rel-L2 it allows):
    /// `--min-expert-cosine` from `--min-expert-slots` slots on; below, from
    /// [`FEW_SLOTS_MIN_COSINE`] on one slot linearly up to it.
    pub fn bar(&self, slots: usize) -> f64 {
        let c = self.min_cosine;
        if slots >= self.min_slots || c <= FEW_SLOTS_MIN_COSINE {
            return c;
        }
        // here 1 <= slots < min_slots, so min_slots >= 2
        let t = slots.saturating_sub(1) as f64 / (self.min_slots - 1) as f64;
        FEW_SLOTS_MIN_COSINE + (c - FEW_SLOTS_MIN_COSINE) * t
    }

    /// The failure line of an expert whose own output holds NaN/Inf (kept apart from
    /// [`ExpertCheck::judge`], which has no cosine to judge then).
    pub fn nonfinite(x: &ExpertMetrics) -> Option<String> {
        let m = &x.metrics;
        (m.nan_count + m.inf_count > 0).then(|| {
            format!(
                "expert {} produces NaN/Inf ({} NaN, {} Inf over {} slots)",
                x.expert, m.nan_count, m.inf_count, x.slots
            )
        })
    }

    /// The failure line of `x`, if it fails.
    pub fn failure(&self, x: &ExpertMetrics) -> Option<String> {
        match self.judge(x) {
            ExpertVerdict::Fail(m) => Some(m),
            _ => None,
        }
    }

    /// The note on an expert too few tokens reached to judge.
    pub fn too_few_line(&self, x: &ExpertMetrics) -> String {
        format!(
            "expert {}: cosine {}, rel-L2 {} over {} slot{}: misses --min-expert-cosine {} but \
             passes {}, the bar of so few slots (NVFP4 noise on one or two tokens reaches \
             lower): too few tokens to judge; rerun with more --tokens to give it \
             --min-expert-slots {} slots",
            x.expert,
            f(x.metrics.cosine, 4),
            f(x.metrics.rel_l2, 3),
            x.slots,
            if x.slots == 1 { "" } else { "s" },
            self.min_cosine,
            f(self.bar(x.slots), 3),
            self.min_slots
        )
    }
}

/// An expert whose output norm is off its reference's by more than [`MAX_NORM_RATIO`] either
/// way (NaN/Inf are reported on their own).
fn magnitude_failure(x: &ExpertMetrics) -> Option<String> {
    let (m, r) = (&x.metrics, x.norm_ratio);
    if m.nan_count + m.inf_count > 0 || (1.0 / MAX_NORM_RATIO..=MAX_NORM_RATIO).contains(&r) {
        return None;
    }
    Some(format!(
        "expert {}: its output's norm is {}x its reference's over {} slot{} (healthy NVFP4 stays \
         within {}-{}x even on one slot), at cosine {}: its output has the wrong magnitude (a \
         weight_scale_2 or input_scale off by a factor?)",
        x.expert,
        f(r, 3),
        x.slots,
        if x.slots == 1 { "" } else { "s" },
        f(1.0 / MAX_NORM_RATIO, 3),
        MAX_NORM_RATIO,
        f(m.cosine, 4)
    ))
}

/// How one expert's own output fails cosine `c` (`bar` names it), if it does (NaN/Inf in it
/// are reported on their own): a cosine below `c`, or, since the cosine is blind to magnitude
/// (an expert whose weight_scale_2 or input_scale is off by a factor keeps it), a rel-L2 beyond
/// what `c` allows an error orthogonal to the output, `sqrt(1/c² − 1)`.
fn expert_failure(x: &ExpertMetrics, c: f64, bar: &str) -> Option<String> {
    let m = &x.metrics;
    if m.nan_count + m.inf_count > 0 {
        return None;
    }
    let max_rel = crate::metrics::max_rel_l2(c);
    if below(m.cosine, c) {
        Some(format!(
            "expert {}: cosine {} < {bar} over {} slots (rel-L2 {})",
            x.expert,
            f(m.cosine, 4),
            x.slots,
            f(m.rel_l2, 3)
        ))
    } else if m.rel_l2 > max_rel {
        Some(format!(
            "expert {}: rel-L2 {} > {}, the error {bar} allows, at cosine {} over {} slots: its output has the wrong magnitude (a weight_scale_2 or input_scale off by a factor?)",
            x.expert,
            f(m.rel_l2, 3),
            f(max_rel, 3),
            f(m.cosine, 4),
            x.slots
        ))
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand_distr::{Distribution, StandardNormal};

    /// An expert over `slots` slots whose output is `scale · r + e`, `e ⟂ r` with
    /// `‖e‖ = noise · ‖r‖`: cosine `scale / sqrt(scale² + noise²)`.
    fn expert(seed: u64, slots: usize, scale: f32, noise: f32) -> ExpertMetrics {
        let mut g = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let n = slots * 256;
        let mut draw = || -> Vec<f32> { (0..n).map(|_| StandardNormal.sample(&mut g)).collect() };
        let (r, mut e) = (draw(), draw());
        let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f32>();
        let p = dot(&e, &r) / dot(&r, &r);
        e.iter_mut().zip(&r).for_each(|(v, &x)| *v -= p * x);
        let k = noise * (dot(&r, &r) / dot(&e, &e)).sqrt();
        let t: Vec<f32> = r.iter().zip(&e).map(|(&x, &y)| scale * x + k * y).collect();
        ExpertMetrics::new(5, slots, &t, &r)
    }

    #[test]
    fn few_slots_are_judged_only_past_noise() {
        let seed: u64 = rand::random();
        let check = ExpertCheck {
            min_cosine: 0.9,
            min_slots: 3,
        };
        // cosine 0.894 (rel-L2 0.5): healthy NVFP4 noise on one or two tokens reaches it
        for slots in [1, 2] {
            let x = expert(seed, slots, 1.0, 0.5);
            assert_eq!(check.judge(&x), ExpertVerdict::TooFewSlots, "seed {seed}");
            assert!(check.too_few_line(&x).contains("too few tokens to judge"));
        }
        // over three slots it fails, as it always did
        let m = check.failure(&expert(seed, 3, 1.0, 0.5)).unwrap();
        assert!(
            m.contains("expert 5: cosine") && m.contains("--min-expert-cosine 0.9"),
            "{m}"
        );
        // healthy noise passes whatever the slots
        for slots in [1, 3, 20] {
            assert_eq!(
                check.judge(&expert(seed, slots, 1.0, 0.2)),
                ExpertVerdict::Pass
            );
        }
        // the bar ramps: 0.7 on one slot, 0.8 on two, --min-expert-cosine from three
        let bars: Vec<f64> = (1..=4).map(|n| check.bar(n)).collect();
        assert!(
            (bars[0] - 0.7).abs() < 1e-12 && (bars[1] - 0.8).abs() < 1e-12,
            "{bars:?}"
        );
        assert_eq!((bars[2], bars[3]), (0.9, 0.9));
        // cosine 0.78 (rel-L2 0.8): a single slot is too few, two slots fail
        assert_eq!(
            check.judge(&expert(seed, 1, 1.0, 0.8)),
            ExpertVerdict::TooFewSlots
        );
        let m = check.failure(&expert(seed, 2, 1.0, 0.8)).unwrap();
        assert!(
            m.contains("cosine 0.78") && m.contains("bar of 2 slots"),
            "{m}"
        );
        // a broken expert on one slot still fails: direction lost, or 3x off
        for (scale, noise, what) in [(1.0, 2.0, "cosine"), (3.0, 0.2, "rel-L2")] {
            let m = check.failure(&expert(seed, 1, scale, noise)).unwrap();
            assert!(
                m.contains(&format!("expert 5: {what}")) && m.contains("--min-expert-slots 3"),
                "seed {seed}: {m}"
            );
        }
        // a down_proj weight_scale_2 off by 2 (or 0.5) on one slot, with a slot's pull (rel-L2
        // 0.82 / 0.51, within the one-slot bar of 1.02): its norm ratio (1.81 / 0.51) names it.
        // It passed as too few slots to judge.
        for (scale, noise) in [(1.8, 0.2), (0.5, 0.1)] {
            let x = expert(seed, 1, scale, noise);
            let m = check
                .failure(&x)
                .unwrap_or_else(|| panic!("seed {seed}: {x:?}"));
            assert!(m.contains("wrong magnitude") && m.contains("norm"), "{m}");
        }
        // --min-expert-slots 1: every expert by --min-expert-cosine alone
        let all = ExpertCheck {
            min_slots: 1,
            ..check
        };
        assert!(all.failure(&expert(seed, 1, 1.0, 0.5)).is_some());
        // a --min-expert-cosine under the few-slot bar is the bar
        let low = ExpertCheck {
            min_cosine: 0.5,
            ..check
        };
        assert_eq!(low.judge(&expert(seed, 1, 1.0, 1.2)), ExpertVerdict::Pass);
        assert!(low.failure(&expert(seed, 1, 1.0, 2.0)).is_some());
    }
}
