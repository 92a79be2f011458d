//! FP8 E4M3 as `float8_e4m3fn`: bias 7, no infinity, max 448, `0x7F`/`0xFF` are NaN.

pub const MAX: f32 = 448.0;
pub const NAN: u8 = 0x7F;
/// The code of 448.
pub const MAX_CODE: u8 = 0x7E;

const MIN_NORMAL: f32 = 1.0 / 64.0; // 2^-6

/// Round `a >= 0` to E4M3 precision (round to nearest, ties to even); the result may be 480,
/// i.e. past the format's range. Every operation here is exact in f32.
#[inline]
fn round_magnitude(a: f32) -> f32 {
    if a < MIN_NORMAL {
        // subnormals: multiples of 2^-9
        (a * 512.0).round_ties_even() / 512.0
    } else {
        let exp = ((a.to_bits() >> 23) & 0xFF) as i32 - 127;
        let quantum = f32::from_bits(((exp - 3 + 127) as u32) << 23);
        (a / quantum).round_ties_even() * quantum
    }
}

#[inline]
fn code_of_exact(v: f32) -> u8 {
    // v is exactly representable, 0 <= v <= 448
    if v < MIN_NORMAL {
        (v * 512.0) as u8
    } else {
        let exp = ((v.to_bits() >> 23) & 0xFF) as i32 - 127;
        let mant = ((v.to_bits() >> 20) & 0x7) as u8;
        (((exp + 7) as u8) << 3) | mant
    }
}

/// Round to nearest even and saturate finite overflow (and infinity) to ±448; NaN gives NaN.
#[inline]
pub fn encode_saturating(x: f32) -> u8 {
    if x.is_nan() {
        return NAN;
    }
    let sign = (x.is_sign_negative() as u8) << 7;
    let r = round_magnitude(x.abs());
    if r > MAX {
        sign | MAX_CODE
    } else {
        sign | code_of_exact(r)
    }
}

/// A plain cast (`x.to(torch.float8_e4m3fn)`): values that round past 448 become NaN.
/// This is the bug class DESIGN.md §2 names; use it only to reproduce it.
#[inline]
pub fn encode_cast(x: f32) -> u8 {
    if x.is_nan() {
        return NAN;
    }
    let sign = (x.is_sign_negative() as u8) << 7;
    let r = round_magnitude(x.abs());
    if r > MAX {
        sign | NAN
    } else {
        sign | code_of_exact(r)
    }
}

#[inline]
pub fn is_nan(code: u8) -> bool {
    code & 0x7F == 0x7F
}

const fn build_table() -> [f32; 256] {
    let mut t = [0f32; 256];
    let mut c = 0;
    while c < 256 {
        let e = ((c >> 3) & 0xF) as i32;
        let m = (c & 7) as i32;
        // value = m * 2^-9 (subnormal) or (8 + m) * 2^(e - 10)
        let (num, pow) = if e == 0 { (m, -9) } else { (8 + m, e - 10) };
        let mut v = num as f32;
        let mut p = pow;
        while p < 0 {
            v /= 2.0;
            p += 1;
        }
        while p > 0 {
            v *= 2.0;
            p -= 1;
        }
        if c & 0x7F == 0x7F {
            v = f32::NAN;
        }
        t[c] = if c & 0x80 != 0 { -v } else { v };
        c += 1;
    }
    t
}

static TABLE: [f32; 256] = build_table();

#[inline]
pub fn decode(code: u8) -> f32 {
    TABLE[code as usize]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_round_trips() {
        for c in 0..=255u8 {
            let v = decode(c);
            if is_nan(c) {
                assert!(v.is_nan(), "{c:#x}");
                assert!(is_nan(encode_saturating(v)));
            } else {
                assert_eq!(encode_saturating(v), c, "code {c:#x} value {v}");
                assert_eq!(encode_cast(v), c, "code {c:#x} value {v}");
            }
        }
    }

    #[test]
    fn known_values() {
        assert_eq!(decode(0x7E), 448.0);
        assert_eq!(decode(0x01), 2f32.powi(-9));
        assert_eq!(decode(0x07), 7.0 * 2f32.powi(-9));
        assert_eq!(decode(0x08), 2f32.powi(-6));
        assert_eq!(decode(0x38), 1.0);
        assert_eq!(decode(0x80), -0.0);
        assert!(decode(0x80).is_sign_negative());
    }

    #[test]
    fn ties_go_to_even_between_every_pair_of_neighbours() {
        for c in 0..0x7Eu8 {
            let (lo, hi) = (decode(c), decode(c + 1));
            let mid = (lo as f64 + hi as f64) / 2.0;
            let mid = mid as f32;
            assert_eq!(mid as f64, (lo as f64 + hi as f64) / 2.0, "midpoint exact");
            let want = if c % 2 == 0 { c } else { c + 1 };
            assert_eq!(encode_saturating(mid), want, "tie between {lo} and {hi}");
            assert_eq!(encode_saturating(f32::from_bits(mid.to_bits() - 1)), c);
            assert_eq!(encode_saturating(f32::from_bits(mid.to_bits() + 1)), c + 1);
        }
    }

    #[test]
    fn saturation_and_overflow() {
        assert_eq!(encode_saturating(463.9), MAX_CODE);
        assert_eq!(encode_saturating(464.0), MAX_CODE);
        assert_eq!(encode_saturating(1e30), MAX_CODE);
        assert_eq!(encode_saturating(f32::INFINITY), MAX_CODE);
        assert_eq!(encode_saturating(-1e30), 0x80 | MAX_CODE);
        // a plain cast rounds 448..=464 to 448 (464 is a tie, to even) and above to NaN
        assert_eq!(encode_cast(463.9), MAX_CODE);
        assert_eq!(encode_cast(464.0), MAX_CODE);
        assert!(is_nan(encode_cast(464.1)));
        assert!(is_nan(encode_cast(f32::INFINITY)));
    }

    #[test]
    fn subnormals_and_underflow() {
        let q = 2f32.powi(-9);
        assert_eq!(encode_saturating(q * 0.5), 0x00); // tie to even (0)
        assert_eq!(encode_saturating(q * 0.51), 0x01);
        assert_eq!(encode_saturating(q * 1.5), 0x02); // tie to even (2)
        assert_eq!(encode_saturating(q * 7.5), 0x08); // rounds up into the normals
        assert_eq!(encode_saturating(1e-30), 0x00);
    }
}
