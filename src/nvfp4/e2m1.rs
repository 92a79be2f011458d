//! E2M1 (FP4): 1 sign bit (bit 3), 2 exponent bits, 1 mantissa bit. No NaN, no infinity.

/// Magnitudes of the codes 0..=7 (bit 3 is the sign).
pub const VALUES: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
pub const MAX: f32 = 6.0;

/// Round-half-to-even to the nearest E2M1 value; the sign bit is the sign of `x`, also when
/// the magnitude rounds to zero (as PTX `cvt.rn` and ModelOpt do). Magnitudes past 6 give 6.
///
/// Branch-free (the magnitude is the number of rounding thresholds `a` lies past), so that it
/// vectorizes; NaN passes no threshold test but encodes as 7, as the if-chain of DESIGN.md §2
/// (`a <= 0.25 → 0, ... else 7`) gives it.
#[inline(always)]
pub fn encode(x: f32) -> u8 {
    let a = x.abs();
    let mag = (a > 0.25) as u8
        + (a >= 0.75) as u8
        + (a > 1.25) as u8
        + (a >= 1.75) as u8
        + (a > 2.5) as u8
        + (a >= 3.5) as u8
        + (a > 5.0) as u8;
    let mag = if a.is_nan() { 7 } else { mag };
    mag | ((x.is_sign_negative() as u8) << 3)
}

/// The value of a code. The sign bit goes straight into the f32's sign bit (what negation
/// does, `-0.0` included): branch-free, since codes' signs are random and a mispredicted
/// branch per value made dequantizing ~4 ns a value.
#[inline]
pub fn decode(code: u8) -> f32 {
    let v = VALUES[(code & 7) as usize];
    f32::from_bits(v.to_bits() | (((code & 8) as u32) << 28))
}

/// Element `2i` in the low nibble, `2i+1` in the high nibble.
#[inline]
pub fn pack(lo: u8, hi: u8) -> u8 {
    (lo & 0xF) | ((hi & 0xF) << 4)
}

#[inline]
pub fn unpack(byte: u8) -> (u8, u8) {
    (byte & 0xF, byte >> 4)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ties_round_as_the_table_says() {
        // (input, expected magnitude) at every tie and just beside it.
        let cases = [
            (0.25, 0.0),
            (0.2500001, 0.5),
            (0.75, 1.0),
            (0.7499999, 0.5),
            (1.25, 1.0),
            (1.2500001, 1.5),
            (1.75, 2.0),
            (1.7499999, 1.5),
            (2.5, 2.0),
            (2.5000002, 3.0),
            (3.5, 4.0),
            (3.4999998, 3.0),
            (5.0, 4.0),
            (5.0000005, 6.0),
            (1e9, 6.0),
            (f32::INFINITY, 6.0),
        ];
        for (x, want) in cases {
            assert_eq!(decode(encode(x)), want, "encode({x})");
            assert_eq!(decode(encode(-x)), -want, "encode(-{x})");
        }
    }

    #[test]
    fn sign_survives_rounding_to_zero() {
        assert_eq!(encode(-0.1), 0x8);
        assert_eq!(encode(-0.0), 0x8);
        assert_eq!(encode(0.1), 0x0);
    }

    #[test]
    fn every_code_round_trips() {
        for code in 0u8..16 {
            assert_eq!(encode(decode(code)), code);
        }
    }

    #[test]
    fn decode_is_the_magnitude_negated_bit_for_bit() {
        for code in 0u8..16 {
            let v = VALUES[(code & 7) as usize];
            let want = if code & 8 != 0 { -v } else { v };
            assert_eq!(decode(code).to_bits(), want.to_bits(), "code {code:#x}");
        }
    }

    #[test]
    fn nibble_order() {
        assert_eq!(pack(0x3, 0xA), 0xA3);
        assert_eq!(unpack(0xA3), (0x3, 0xA));
    }
}
