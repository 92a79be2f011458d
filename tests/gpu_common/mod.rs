//! Shared helpers of the GPU tests (tests/gpu_*.rs). Every GPU test is `#[ignore]` (CPU CI
//! has no GPU) and run by .ci/gpu-nightly with `--ignored`; without a usable GPU it FAILS.
#![allow(dead_code)]

use nvfp4dbg::backend::cuda::{CudaBackend, Gpu};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, StandardNormal};
use std::sync::Arc;

pub fn backend() -> CudaBackend {
    CudaBackend::open(0).unwrap_or_else(|e| panic!("GPU test without a usable GPU: {e}"))
}

pub fn gpu() -> Arc<Gpu> {
    backend().gpu().clone()
}

/// A fresh seed, printed so a failure can be replayed with NVFP4DBG_SEED.
pub fn rng(test: &str) -> (ChaCha8Rng, u64) {
    let seed = std::env::var("NVFP4DBG_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    eprintln!("{test}: seed {seed}");
    (ChaCha8Rng::seed_from_u64(seed), seed)
}

pub fn bf16_round(v: f32) -> f32 {
    half::bf16::from_f32(v).to_f32()
}

/// BF16-exact values with a spread of magnitudes per block (ties happen often, as they do
/// on real BF16 activations) and occasional outliers.
pub fn activations(r: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(n);
    let mut block_scale = 1.0f32;
    for i in 0..n {
        if i % 16 == 0 {
            block_scale = 2f32.powf(r.gen_range(-8.0..6.0));
        }
        let g: f32 = StandardNormal.sample(r);
        let mut v = g * block_scale;
        if r.gen_bool(0.002) {
            v *= 50.0;
        }
        out.push(bf16_round(v));
    }
    out
}

pub fn normal(r: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let g: f32 = StandardNormal.sample(r);
            g * scale
        })
        .collect()
}

pub fn to_bf16_bits(x: &[f32]) -> Vec<u16> {
    x.iter()
        .map(|v| half::bf16::from_f32(*v).to_bits())
        .collect()
}
