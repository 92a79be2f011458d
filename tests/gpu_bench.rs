//! Speed of the NVFP4 layer forward at DeepSeek-V3 expert shapes (H 7168, I 2048, top-8),
//! timed as CUDA-graph replays with events. Prints ms and TFLOP/s; asserts only that the
//! output is finite (numbers are checked by gpu_moe.rs).

mod gpu_common;

use gpu_common::*;
use nvfp4dbg::backend::cuda::moe::Nvfp4Forward;
use nvfp4dbg::moe::{ActScales, Expert, MoeLayer, QLinear, ScoringFunc};
use nvfp4dbg::nvfp4::{Flavor, Format, Fp4Tensor};
use rand::{Rng, RngCore};

/// Random codes and E4M3 scales around 1 (no CPU quantization: DSV3-sized experts would
/// take minutes to quantize on the host).
fn random_fp4(r: &mut rand_chacha::ChaCha8Rng, rows: usize, cols: usize) -> Fp4Tensor {
    let mut packed = vec![0u8; rows * cols / 2];
    r.fill_bytes(&mut packed);
    let scales = (0..rows * cols / 16)
        .map(|_| r.gen_range(0x28u8..0x40))
        .collect();
    Fp4Tensor {
        format: Format::Nvfp4,
        rows,
        cols,
        packed,
        scales,
        scale_2: 1.0 / 2688.0,
    }
}

fn big_layer(r: &mut rand_chacha::ChaCha8Rng, h: usize, i: usize, e: usize, k: usize) -> MoeLayer {
    let mut layer = build_layer(
        r,
        LayerSpec {
            h: 64,
            i: 32,
            e,
            k,
            shared: false,
            ..LayerSpec::small(ScoringFunc::Sigmoid)
        },
    );
    layer.config.hidden_size = h;
    layer.config.moe_intermediate_size = i;
    layer.router.weight = normal(r, e * h, 1.0 / (h as f32).sqrt());
    let q = |t: Fp4Tensor| QLinear {
        weight: t,
        input_scale: None,
        original: None,
    };
    layer.experts = (0..e)
        .map(|_| Expert {
            w1: q(random_fp4(r, i, h)),
            w3: q(random_fp4(r, i, h)),
            w2: q(random_fp4(r, h, i)),
        })
        .collect();
    layer
}

#[test]
#[ignore = "needs a GPU (.ci/gpu-nightly)"]
fn bench_nvfp4_layer_forward() {
    let b = backend();
    let (mut r, _) = rng("bench_nvfp4_layer_forward");
    let (h, i, e, k) = (7168, 2048, 64, 8);
    let layer = big_layer(&mut r, h, i, e, k);
    for tokens in [256usize, 4096] {
        let x = hidden(&mut r, tokens, h);
        let scales = ActScales::Fixed {
            gs1: vec![2688.0 / 8.0; e],
            gs2: vec![2688.0; e],
        };
        let mut f =
            Nvfp4Forward::new(b.gpu(), &layer, tokens, &scales, Flavor::Reference, false).unwrap();
        f.route_on_gpu(None).unwrap();
        f.set_hidden(&x).unwrap();
        let g = f.capture().unwrap();
        let mut ms = g.time_replays(10).unwrap();
        ms.sort_by(|a, b| a.partial_cmp(b).unwrap());
        let med = ms[ms.len() / 2] as f64;
        let flop = 6.0 * (tokens * k) as f64 * h as f64 * i as f64;
        let out = f.output().unwrap();
        assert!(out.out.iter().all(|v| v.is_finite()), "non-finite output");
        eprintln!(
            "nvfp4 layer forward H={h} I={i} E={e} top-{k} tokens={tokens}: median {med:.3} ms over 10 graph replays, {:.1} TFLOP/s (expert GEMMs)",
            flop / (med * 1e-3) / 1e12
        );
    }
}
