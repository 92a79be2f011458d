//! Synthetic material for timing, made fast on the host: an NVFP4 MoE layer of random codes
//! and valid E4M3 block scales (a DeepSeek-V3 layer is 6.3 GB of them; quantizing real
//! weights on the CPU would take minutes), and BF16-exact hidden states. Timing needs valid,
//! non-zero, unstructured data, not a trained model.

use crate::moe::{DenseMlp, Expert, MoeConfig, MoeLayer, QLinear, Router};
use crate::nvfp4::{Format, Fp4Tensor};
use rayon::prelude::*;

/// Counter-based generator (SplitMix64 of seed and index): any chunking gives the same bytes.
fn mix64(seed: u64, i: u64) -> u64 {
    let mut z = seed.wrapping_add(i.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A stream id for (tensor role, index), mixed into the seed.
fn stream(seed: u64, role: u64, idx: u64) -> u64 {
    mix64(mix64(seed, role), idx)
}

/// Uniform in `[-amp, amp)` from 24 bits, rounded to BF16.
fn uniform_bf16(r: u64, amp: f32) -> f32 {
    let u = (r >> 40) as f32 * (1.0 / 16_777_216.0);
    half::bf16::from_f32((2.0 * u - 1.0) * amp).to_f32()
}

const CHUNK: usize = 1 << 16;

/// Random bytes: every byte is two valid E2M1 codes.
pub fn random_codes(n: usize, seed: u64) -> Vec<u8> {
    let mut v = vec![0u8; n];
    v.par_chunks_mut(CHUNK).enumerate().for_each(|(c, out)| {
        let base = (c * CHUNK / 8) as u64;
        for (w, bytes) in out.chunks_mut(8).enumerate() {
            let r = mix64(seed, base + w as u64).to_le_bytes();
            bytes.copy_from_slice(&r[..bytes.len()]);
        }
    });
    v
}

/// Valid E4M3 block scales in [0.5, 1.875] (codes 0x30..=0x3F).
pub fn random_scales(n: usize, seed: u64) -> Vec<u8> {
    let mut v = vec![0u8; n];
    v.par_chunks_mut(CHUNK).enumerate().for_each(|(c, out)| {
        let base = (c * CHUNK) as u64;
        for (j, s) in out.iter_mut().enumerate() {
            *s = 0x30 | (mix64(seed, base + j as u64) & 0xF) as u8;
        }
    });
    v
}

/// BF16-exact values uniform in `[-amp, amp)`.
pub fn random_bf16(n: usize, amp: f32, seed: u64) -> Vec<f32> {
    let mut v = vec![0f32; n];
    v.par_chunks_mut(CHUNK).enumerate().for_each(|(c, out)| {
        let base = (c * CHUNK) as u64;
        for (j, x) in out.iter_mut().enumerate() {
            *x = uniform_bf16(mix64(seed, base + j as u64), amp);
        }
    });
    v
}

/// RMS of the random E2M1 codes (mean of the squared magnitudes 0..6) times that of the
/// scales (≈1.2): `weight_scale_2 = 1 / (RMS · sqrt(in))` gives weights of RMS 1/sqrt(in), so
/// activations keep their size through the layer and nothing saturates.
const CODE_SCALE_RMS: f32 = 3.5;

fn fp4_weight(rows: usize, cols: usize, seed: u64) -> QLinear {
    QLinear {
        weight: Fp4Tensor {
            format: Format::Nvfp4,
            rows,
            cols,
            packed: random_codes(rows * cols / 2, mix64(seed, 1)),
            scales: random_scales(rows * cols / 16, mix64(seed, 2)),
            scale_2: 1.0 / (CODE_SCALE_RMS * (cols as f32).sqrt()),
        },
        input_scale: None,
        original: None,
    }
}

/// Layer `index` of `config` with random NVFP4 experts, a random BF16 router (with bias when
/// the config routes by score) and a random BF16 shared expert.
pub fn layer(config: &MoeConfig, index: usize, seed: u64) -> MoeLayer {
    let c = config;
    let (h, i, e) = (c.hidden_size, c.moe_intermediate_size, c.n_routed_experts);
    let si = c.n_shared_experts * i;
    let router = Router {
        weight: random_bf16(e * h, 1.0 / (h as f32).sqrt(), stream(seed, 1, 0)),
        e_score_correction_bias: Some(random_bf16(e, 0.05, stream(seed, 2, 0))),
        tid2eid: None,
    };
    let experts = (0..e)
        .map(|x| {
            let s = |w: u64| stream(seed, 3 + w, x as u64);
            Expert {
                w1: fp4_weight(i, h, s(0)),
                w3: fp4_weight(i, h, s(1)),
                w2: fp4_weight(h, i, s(2)),
            }
        })
        .collect();
    let shared = (si > 0).then(|| DenseMlp {
        intermediate: si,
        w1: random_bf16(si * h, 1.0 / (h as f32).sqrt(), stream(seed, 6, 0)),
        w3: random_bf16(si * h, 1.0 / (h as f32).sqrt(), stream(seed, 7, 0)),
        w2: random_bf16(h * si, 1.0 / (si as f32).sqrt(), stream(seed, 8, 0)),
    });
    MoeLayer {
        index,
        config: c.clone(),
        router,
        experts,
        shared,
        norm_weight: None,
    }
}

/// Amplitude of the synthetic hidden states (uniform, so amax = this).
pub const HIDDEN_AMP: f32 = 4.0;

/// `[tokens, hidden]` BF16-exact hidden states, uniform in ±[`HIDDEN_AMP`].
pub fn hidden(tokens: usize, hidden: usize, seed: u64) -> Vec<f32> {
    random_bf16(tokens * hidden, HIDDEN_AMP, stream(seed, 9, 0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::moe::synthetic::Preset;
    use crate::nvfp4::e4m3;

    fn small() -> MoeConfig {
        MoeConfig {
            hidden_size: 256,
            moe_intermediate_size: 128,
            n_routed_experts: 16,
            num_experts_per_tok: 4,
            n_group: 4,
            topk_group: 2,
            ..Preset::Dsv3.config()
        }
    }

    #[test]
    fn the_layer_is_valid_and_depends_on_the_seed() {
        let seed: u64 = rand::random();
        let l = layer(&small(), 3, seed);
        l.validate().unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        assert_eq!(l.experts.len(), 16);
        let w = &l.experts[5].w2.weight;
        assert_eq!((w.rows, w.cols), (256, 128));
        for s in &w.scales {
            let v = e4m3::decode(*s);
            assert!(
                (0.5..=1.875).contains(&v),
                "seed {seed}: scale {s:#x} = {v}"
            );
        }
        // the codes use every nibble value, and tensors differ from each other
        let mut seen = [false; 16];
        for b in &w.packed {
            seen[(b & 0xF) as usize] = true;
            seen[(b >> 4) as usize] = true;
        }
        assert!(seen.iter().all(|x| *x), "seed {seed}");
        assert_ne!(l.experts[0].w1.weight.packed, l.experts[0].w3.weight.packed);
        assert_ne!(l.experts[0].w1.weight.packed, l.experts[1].w1.weight.packed);
        // dequantized weights have RMS near 1/sqrt(in)
        let d = l.experts[2].w1.weight.dequantize();
        let rms = (d.iter().map(|x| (x * x) as f64).sum::<f64>() / d.len() as f64).sqrt();
        let want = 1.0 / (256f64).sqrt();
        assert!(
            (rms / want - 1.0).abs() < 0.15,
            "seed {seed}: rms {rms} vs {want}"
        );
        // deterministic
        let again = layer(&small(), 3, seed);
        assert_eq!(
            again.experts[7].w3.weight.packed,
            l.experts[7].w3.weight.packed
        );
        assert_eq!(again.router.weight, l.router.weight);
        let other = layer(&small(), 3, seed ^ 0x55);
        assert_ne!(
            other.experts[7].w3.weight.packed,
            l.experts[7].w3.weight.packed
        );
    }

    #[test]
    fn generators_do_not_depend_on_the_chunking_and_fill_every_byte() {
        let seed: u64 = rand::random();
        // a length that is neither a multiple of the chunk nor of 8
        let n = 3 * CHUNK + 13;
        let v = random_codes(n, seed);
        assert_eq!(v.len(), n);
        for (w, chunk) in v.chunks(8).enumerate() {
            let r = mix64(seed, w as u64).to_le_bytes();
            assert_eq!(chunk, &r[..chunk.len()], "seed {seed}: word {w}");
        }
        let zeros = v.iter().filter(|b| **b == 0).count();
        assert!(zeros < n / 100, "seed {seed}: {zeros} zero bytes");
        let s = random_scales(n, seed);
        assert!(s.iter().all(|b| (0x30..=0x3F).contains(b)));
        assert_eq!(s[n - 1], 0x30 | (mix64(seed, (n - 1) as u64) & 0xF) as u8);
    }

    #[test]
    fn hidden_states_are_bf16_exact_and_spread() {
        let seed: u64 = rand::random();
        let x = hidden(32, 256, seed);
        assert_eq!(x.len(), 32 * 256);
        assert!(x
            .iter()
            .all(|v| half::bf16::from_f32(*v).to_f32() == *v && v.abs() <= HIDDEN_AMP));
        let zeros = x.iter().filter(|v| **v == 0.0).count();
        assert!(zeros < 10, "seed {seed}: {zeros} zeros");
        let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert!(amax > 0.9 * HIDDEN_AMP, "seed {seed}: amax {amax}");
        let mean = x.iter().map(|v| *v as f64).sum::<f64>() / x.len() as f64;
        assert!(mean.abs() < 0.2, "seed {seed}: mean {mean}");
    }
}
