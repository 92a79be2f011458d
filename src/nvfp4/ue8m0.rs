//! UE8M0: an unsigned power of two, `2^(code - 127)`; `0xFF` is NaN (OCP MX scales).

pub const NAN: u8 = 0xFF;

#[inline]
pub fn decode(code: u8) -> f32 {
    if code == NAN {
        return f32::NAN;
    }
    // 2^(code-127): code 0 is the f32 subnormal 2^-127
    if code == 0 {
        f32::from_bits(0x0040_0000)
    } else {
        f32::from_bits((code as u32) << 23)
    }
}

/// The code of `2^exp`, `exp` clamped to the format's range [-127, 127].
#[inline]
pub fn encode_exp(exp: i32) -> u8 {
    (exp.clamp(-127, 127) + 127) as u8
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_round_trips() {
        for c in 0..0xFFu8 {
            let v = decode(c) as f64;
            assert_eq!(v, 2f64.powi(c as i32 - 127));
            assert_eq!(encode_exp(c as i32 - 127), c);
        }
        assert!(decode(NAN).is_nan());
    }
}
