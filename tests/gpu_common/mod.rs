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

/// The NVFP4 down GEMMs write each (token, slot) row in BF16, as the CPU path rounds it: every
/// finite per-slot value must be BF16-exact (an FP32 row would not be).
pub fn assert_bf16_rows(what: &str, seed: u64, rows: &[f32]) {
    let off = rows
        .iter()
        .position(|&v| v.is_finite() && bf16_round(v) != v);
    assert_eq!(
        off, None,
        "seed {seed} {what}: a per-slot value not BF16-exact"
    );
    assert!(
        rows.iter().any(|&v| v != 0.0),
        "seed {seed} {what}: all zero"
    );
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

use nvfp4dbg::moe::{DenseMlp, Expert, MoeConfig, MoeLayer, QLinear, Router, ScoringFunc};
use nvfp4dbg::nvfp4;

/// What a hand-built test layer looks like.
#[derive(Clone, Copy, Debug)]
pub struct LayerSpec {
    pub h: usize,
    pub i: usize,
    pub e: usize,
    pub k: usize,
    pub func: ScoringFunc,
    pub n_group: usize,
    pub topk_group: usize,
    pub shared: bool,
    pub originals: bool,
    pub limit: Option<f32>,
    pub hash: bool,
    pub mxfp4: bool,
}

impl LayerSpec {
    pub fn small(func: ScoringFunc) -> Self {
        LayerSpec {
            h: 256,
            i: 128,
            e: 16,
            k: 4,
            func,
            n_group: 1,
            topk_group: 1,
            shared: true,
            originals: true,
            limit: None,
            hash: false,
            mxfp4: false,
        }
    }
}

pub const VOCAB: usize = 100;

fn weight(r: &mut ChaCha8Rng, rows: usize, cols: usize) -> Vec<f32> {
    let s = 1.0 / (cols as f32).sqrt();
    (0..rows * cols)
        .map(|_| {
            let g: f32 = StandardNormal.sample(r);
            bf16_round(g * s)
        })
        .collect()
}

fn qlinear(
    r: &mut ChaCha8Rng,
    rows: usize,
    cols: usize,
    spec: &LayerSpec,
    input_amax: f32,
) -> QLinear {
    let w = weight(r, rows, cols);
    let weight = if spec.mxfp4 {
        nvfp4::quantize_mxfp4(&w, rows, cols).0
    } else {
        nvfp4::quantize_weight_nvfp4(&w, rows, cols).0
    };
    QLinear {
        weight,
        input_scale: Some(input_amax / 2688.0),
        original: spec.originals.then_some(w),
    }
}

/// A random MoE layer built by hand: NVFP4 (or MXFP4) experts quantized with the CPU's
/// `quantize_weight_nvfp4`, BF16 originals, a BF16 router (+ bias), optional shared expert.
pub fn build_layer(r: &mut ChaCha8Rng, spec: LayerSpec) -> MoeLayer {
    let LayerSpec { h, i, e, k, .. } = spec;
    let index = 3;
    let config = MoeConfig {
        hidden_size: h,
        moe_intermediate_size: i,
        intermediate_size: 2 * i,
        n_routed_experts: e,
        num_experts_per_tok: k,
        n_shared_experts: spec.shared as usize,
        n_group: spec.n_group,
        topk_group: spec.topk_group,
        routed_scaling_factor: 2.5,
        scoring_func: spec.func,
        norm_topk_prob: true,
        first_k_dense_replace: 1,
        num_hidden_layers: 8,
        num_hash_layers: if spec.hash { index + 1 } else { 0 },
        swiglu_limit: spec.limit,
        rms_norm_eps: 1e-6,
        vocab_size: VOCAB,
    };
    let router = Router {
        weight: (0..e * h)
            .map(|_| {
                let g: f32 = StandardNormal.sample(r);
                bf16_round(g * 2.0 / (h as f32).sqrt())
            })
            .collect(),
        e_score_correction_bias: Some((0..e).map(|_| r.gen_range(-0.05..0.05)).collect()),
        tid2eid: spec
            .hash
            .then(|| (0..VOCAB * k).map(|_| r.gen_range(0..e as i64)).collect()),
    };
    let experts = (0..e)
        .map(|_| Expert {
            w1: qlinear(r, i, h, &spec, 4.0),
            w3: qlinear(r, i, h, &spec, 4.0),
            w2: qlinear(r, h, i, &spec, 2.0),
        })
        .collect();
    let shared = spec.shared.then(|| DenseMlp {
        intermediate: 2 * i,
        w1: weight(r, 2 * i, h),
        w3: weight(r, 2 * i, h),
        w2: weight(r, h, 2 * i),
    });
    MoeLayer {
        index,
        config,
        router,
        experts,
        shared,
        norm_weight: None,
    }
}

/// The bit patterns of `v`, for bit-for-bit comparisons (NaN payloads and -0.0 included).
pub fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}

/// The same `max_abs_err`: the same bits, or both NaN (a NaN's payload is the platform's).
pub fn same_max(a: f64, b: f64) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

/// BF16-exact hidden states `[tokens, h]` with a few outlier channels.
pub fn hidden(r: &mut ChaCha8Rng, tokens: usize, h: usize) -> Vec<f32> {
    let outliers: Vec<usize> = (0..4).map(|_| r.gen_range(0..h)).collect();
    (0..tokens * h)
        .map(|j| {
            let g: f32 = StandardNormal.sample(r);
            let v = if outliers.contains(&(j % h)) {
                g * 8.0
            } else {
                g
            };
            bf16_round(v)
        })
        .collect()
}

pub fn input_ids(r: &mut ChaCha8Rng, tokens: usize) -> Vec<i64> {
    (0..tokens).map(|_| r.gen_range(0..VOCAB as i64)).collect()
}
