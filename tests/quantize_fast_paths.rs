//! The branch-free / vectorizable formulations `quantize` runs on (nvfp4's `e2m1::encode`,
//! block amax on the bits, codes-then-pack) must equal the plain formulations of DESIGN.md §2
//! they replaced, bit for bit, on every kind of input: ties, NaN, infinities, signed zeros,
//! subnormals, extreme global scales.

use nvfp4dbg::nvfp4::quant::quantize_block_nvfp4;
use nvfp4dbg::nvfp4::{e2m1, e4m3, rcp, BlockStats};
use rand::{Rng, SeedableRng};

/// The if-chain of DESIGN.md §2 (round half to even at the E2M1 thresholds).
fn encode_chain(x: f32) -> u8 {
    let a = x.abs();
    let mag = if a <= 0.25 {
        0
    } else if a < 0.75 {
        1
    } else if a <= 1.25 {
        2
    } else if a < 1.75 {
        3
    } else if a <= 2.5 {
        4
    } else if a < 3.5 {
        5
    } else if a <= 5.0 {
        6
    } else {
        7
    };
    mag | ((x.is_sign_negative() as u8) << 3)
}

/// The reference block quantizer written step by step, with an early-exit NaN amax.
// written as plainly as DESIGN.md states it, on purpose
#[allow(clippy::manual_clamp)]
fn block_reference(x: &[f32], gs: f32, packed: &mut [u8]) -> u8 {
    let mut vmax = 0f32;
    for &v in x {
        let a = v.abs();
        if a.is_nan() {
            vmax = f32::NAN;
            break;
        }
        if a > vmax {
            vmax = a;
        }
    }
    let t = gs * (vmax * (1.0f32 / 6.0));
    let t = if t > 448.0 { 448.0 } else { t };
    let s_code = e4m3::encode_saturating(t);
    let out_scale = rcp(e4m3::decode(s_code) * rcp(gs));
    for i in 0..8 {
        let c = |v: f32| {
            let v = v * out_scale;
            encode_chain(if v > 6.0 {
                6.0
            } else if v < -6.0 {
                -6.0
            } else {
                v
            })
        };
        packed[i] = c(x[2 * i]) | (c(x[2 * i + 1]) << 4);
    }
    s_code
}

#[test]
fn e2m1_encode_equals_the_if_chain() {
    let seed: u64 = rand::random();
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let check = |x: f32| {
        assert_eq!(
            e2m1::encode(x),
            encode_chain(x),
            "x = {x:e} ({:#x}), seed {seed}",
            x.to_bits()
        )
    };
    // every BF16 value (both signs, NaN and infinities included)
    for b in 0..=u16::MAX {
        check(f32::from_bits((b as u32) << 16));
    }
    // every f32 within 64 ulps of each threshold, both signs
    for t in [0.25f32, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.0] {
        for d in -64i32..=64 {
            let v = f32::from_bits((t.to_bits() as i32 + d).max(0) as u32);
            check(v);
            check(-v);
        }
    }
    for _ in 0..2_000_000 {
        check(f32::from_bits(r.gen()));
    }
}

#[test]
fn block_quantizer_equals_the_step_by_step_reference() {
    let seed: u64 = rand::random();
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let ties = [0.25f32, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0];
    for n in 0..200_000 {
        let gs = match n % 5 {
            0 => 2688.0 / r.gen_range(1e-3f32..50.0),
            1 => 2f32.powi(r.gen_range(-30..40)),
            2 => f32::from_bits(r.gen_range(0x0080_0000u32..0x7F00_0000)),
            _ => r.gen_range(1.0f32..1e5),
        };
        let scale = 2f32.powi(r.gen_range(-20..10));
        let mut x = [0f32; 16];
        for v in x.iter_mut() {
            *v = match r.gen_range(0..12) {
                0 => ties[r.gen_range(0..ties.len())] * scale * if r.gen() { 1.0 } else { -1.0 },
                1 => -0.0,
                2 => 0.0,
                3 => f32::from_bits(r.gen_range(1..0x0080_0000)), // subnormal
                4 if n % 97 == 0 => f32::NAN,
                5 if n % 89 == 0 => f32::INFINITY,
                6 if n % 83 == 0 => f32::NEG_INFINITY,
                7 => f32::from_bits(r.gen::<u32>() & 0xBFFF_FFFF), // any finite-ish magnitude
                _ => r.gen_range(-1.0f32..1.0) * scale,
            };
            *v = half::bf16::from_f32(*v).to_f32();
        }
        let (mut a, mut b) = ([0u8; 8], [0u8; 8]);
        let mut st = BlockStats::default();
        let sa = quantize_block_nvfp4(&x, gs, &mut a, &mut st);
        let sb = block_reference(&x, gs, &mut b);
        assert_eq!(
            (sa, a),
            (sb, b),
            "seed {seed}, block {n}: gs {gs:e}, x {x:?}"
        );
    }
}

#[test]
fn row_quantizer_equals_block_after_block() {
    use nvfp4dbg::nvfp4::quant::quantize_row_nvfp4;
    let seed: u64 = rand::random();
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    for n in 0..300 {
        // lengths around the stage group (64 blocks) and far past it
        let nb = match n % 4 {
            0 => r.gen_range(1..8),
            1 => 64 * r.gen_range(1..4) + r.gen_range(0..2),
            2 => r.gen_range(60..70),
            _ => r.gen_range(1..700),
        };
        let gs = if n % 3 == 0 {
            f32::from_bits(r.gen_range(0x0080_0000u32..0x7F00_0000))
        } else {
            2688.0 / r.gen_range(1e-3f32..30.0)
        };
        let x: Vec<f32> = (0..nb * 16)
            .map(|i| match r.gen_range(0..40) {
                0 if i % 7 == 0 => f32::NAN,
                1 if i % 5 == 0 => f32::NEG_INFINITY,
                2 => -0.0,
                3 => f32::from_bits(r.gen_range(1..0x0080_0000)),
                _ => {
                    half::bf16::from_f32(r.gen_range(-1.0f32..1.0) * 2f32.powi(r.gen_range(-12..6)))
                        .to_f32()
                }
            })
            .collect();
        let (mut pa, mut sa, mut sta) = (vec![0u8; nb * 8], vec![0u8; nb], BlockStats::default());
        quantize_row_nvfp4(&x, gs, &mut pa, &mut sa, &mut sta);
        let (mut pb, mut sb, mut stb) = (vec![0u8; nb * 8], vec![0u8; nb], BlockStats::default());
        for b in 0..nb {
            sb[b] = quantize_block_nvfp4(
                &x[b * 16..b * 16 + 16],
                gs,
                &mut pb[b * 8..b * 8 + 8],
                &mut stb,
            );
        }
        assert_eq!(
            (sa, pa, sta),
            (sb, pb, stb),
            "seed {seed}, row {n}: {nb} blocks, gs {gs:e}"
        );
    }
}
