//! What makes a global scale (`weight_scale_2`, `input_scale`, or their compressed-tensors
//! reciprocals) unusable: the one check behind `audit`'s findings and `--gs checkpoint`'s
//! refusal.

/// Why a global scale cannot be used.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScaleProblem {
    /// NaN or ±Inf: every output of the linear becomes NaN/Inf.
    NotFinite,
    /// 0: its reciprocal (`gs = 1/input_scale`) is inf.
    Zero,
    /// Below 0: an engine's `alpha = input_scale · weight_scale_2` flips the output's sign.
    Negative,
    /// Finite and positive, but so small that its reciprocal overflows to inf.
    ReciprocalOverflows,
}

impl ScaleProblem {
    /// The problem of `v`, if any.
    pub fn of(v: f32) -> Option<Self> {
        if !v.is_finite() {
            Some(ScaleProblem::NotFinite)
        } else if v == 0.0 {
            Some(ScaleProblem::Zero)
        } else if v < 0.0 {
            Some(ScaleProblem::Negative)
        } else if !(1.0 / v).is_finite() {
            Some(ScaleProblem::ReciprocalOverflows)
        } else {
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    #[test]
    fn only_finite_positive_scales_with_a_finite_reciprocal_pass() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(rand::random());
        for _ in 0..100 {
            let v: f32 = rng.gen_range(1e-30..1e30);
            assert_eq!(ScaleProblem::of(v), None, "{v}");
            assert_eq!(ScaleProblem::of(-v), Some(ScaleProblem::Negative), "{v}");
        }
        assert_eq!(ScaleProblem::of(f32::NAN), Some(ScaleProblem::NotFinite));
        assert_eq!(
            ScaleProblem::of(-f32::INFINITY),
            Some(ScaleProblem::NotFinite)
        );
        assert_eq!(ScaleProblem::of(0.0), Some(ScaleProblem::Zero));
        assert_eq!(ScaleProblem::of(-0.0), Some(ScaleProblem::Zero));
        assert_eq!(
            ScaleProblem::of(1e-45),
            Some(ScaleProblem::ReciprocalOverflows)
        );
    }
}
