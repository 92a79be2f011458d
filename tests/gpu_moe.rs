//! GPU vs CPU reference on whole MoE layers: router ids, the NVFP4 path (fixed and dynamic
//! global scales, both flavors, MXFP4 experts, swiglu_limit, shared experts, per-slot), the
//! BF16 reference path, determinism, and the CUDA-graph capture of the layer forward.

mod gpu_common;

use gpu_common::*;
use nvfp4dbg::backend::cpu::CpuBackend;
use nvfp4dbg::backend::cuda::moe::{DownRows, InputQuantize, Nvfp4Forward, RsRows, Stage};
use nvfp4dbg::backend::cuda::quant;
use nvfp4dbg::backend::Backend;
use nvfp4dbg::metrics;
use nvfp4dbg::moe::{self, router, ActScales, MoeLayer, Path, Routing, ScoringFunc};
use nvfp4dbg::nvfp4::Flavor;

const MIN_COSINE: f64 = 0.99999;

/// Is this token's top-k decision far from a tie (so FP32 vs f64 logits cannot flip it)?
fn tie_free(layer: &MoeLayer, logits: &[f32]) -> bool {
    let c = &layer.config;
    let scores = router::score(c.scoring_func, logits);
    let sel: Vec<f32> = match &layer.router.e_score_correction_bias {
        Some(b) => scores.iter().zip(b).map(|(s, b)| s + b).collect(),
        None => scores.clone(),
    };
    let gaps_ok = |mut v: Vec<f32>, upto: usize| {
        v.sort_by(|a, b| b.partial_cmp(a).unwrap());
        // FP32 vs f64 logits move a score by a few 1e-6 of itself (more near 1 for sigmoid)
        v.windows(2)
            .take(upto)
            .all(|w| w[0] - w[1] > 2e-5 * w[0].abs().max(w[1].abs()).max(0.01))
    };
    if !gaps_ok(sel.clone(), c.num_experts_per_tok + 1) {
        return false;
    }
    if c.n_group > 1 {
        let gsz = c.n_routed_experts / c.n_group;
        let mut groups: Vec<(f32, usize)> = sel
            .chunks(gsz)
            .map(|g| {
                let mut g = g.to_vec();
                g.sort_by(|a, b| b.partial_cmp(a).unwrap());
                g.iter().take(2).sum()
            })
            .zip(0..)
            .collect();
        if !gaps_ok(groups.iter().map(|g| g.0).collect(), c.topk_group + 1) {
            return false;
        }
        // the top-k inside the kept groups
        groups.sort_by(|a, b| b.0.partial_cmp(&a.0).unwrap());
        let kept: Vec<f32> = groups
            .iter()
            .take(c.topk_group)
            .flat_map(|&(_, g)| sel[g * gsz..(g + 1) * gsz].to_vec())
            .collect();
        return gaps_ok(kept, c.num_experts_per_tok + 1);
    }
    true
}

#[test]
#[ignore = "needs a GPU (.ci/gpu-nightly)"]
fn router_ids_match_the_cpu_on_tie_free_tokens() {
    let b = backend();
    let cpu = CpuBackend::new();
    let (mut r, seed) = rng("router_ids_match_the_cpu_on_tie_free_tokens");
    let mut cases = Vec::new();
    for func in [
        ScoringFunc::Sigmoid,
        ScoringFunc::Softmax,
        ScoringFunc::Sqrtsoftplus,
    ] {
        cases.push(LayerSpec {
            e: 64,
            k: 8,
            ..LayerSpec::small(func)
        });
        cases.push(LayerSpec {
            e: 64,
            k: 8,
            n_group: 8,
            topk_group: 4,
            ..LayerSpec::small(func)
        });
        cases.push(LayerSpec {
            e: 32,
            k: 4,
            hash: true,
            ..LayerSpec::small(func)
        });
    }
    cases.push(LayerSpec {
        e: 256,
        k: 8,
        n_group: 8,
        topk_group: 4,
        h: 512,
        ..LayerSpec::small(ScoringFunc::Sigmoid)
    });
    // a prefill-size batch and a decode-size one (the group-limited pick runs per token)
    // each case three times: BF16 router and BF16-exact input (the logits on the tensor cores),
    // then an input or a router weight that is not BF16-exact (FP32 logits on the FMA pipes)
    for (spec, tokens) in cases.into_iter().flat_map(|s| [(s, 512usize), (s, 64)]) {
        let bf16_layer = build_layer(&mut r, spec);
        let bf16_x = hidden(&mut r, tokens, spec.h);
        let mut f32_layer = bf16_layer.clone();
        f32_layer.router.weight = not_bf16(&f32_layer.router.weight);
        let f32_x = not_bf16(&bf16_x);
        for (path, layer, x) in [
            ("BF16 logits", &bf16_layer, &bf16_x),
            ("FP32 logits (input)", &bf16_layer, &f32_x),
            ("FP32 logits (weight)", &f32_layer, &bf16_x),
        ] {
            let ids = input_ids(&mut r, tokens);
            let want = cpu.route(layer, x, Some(&ids)).unwrap();
            let got = b.route(layer, x, Some(&ids)).unwrap();
            assert_eq!((got.tokens, got.top_k), (want.tokens, want.top_k));
            let logits = router::router_logits(&layer.router.weight, x, tokens, spec.h, spec.e);
            let (mut checked, mut same_ids) = (0, 0);
            let mut max_w_err = 0f32;
            for t in 0..tokens {
                let s = t * spec.k..(t + 1) * spec.k;
                let free = spec.hash || tie_free(layer, &logits[t * spec.e..(t + 1) * spec.e]);
                if free {
                    checked += 1;
                    assert_eq!(
                        got.topk_ids[s.clone()],
                        want.topk_ids[s.clone()],
                        "seed {seed} {spec:?} {path}: token {t} ids differ on a tie-free token"
                    );
                }
                if got.topk_ids[s.clone()] == want.topk_ids[s.clone()] {
                    same_ids += 1;
                    for j in s {
                        let (g, w) = (got.topk_weights[j], want.topk_weights[j]);
                        max_w_err = max_w_err.max((g - w).abs() / w.abs().max(1e-6));
                    }
                }
            }
            eprintln!(
            "router {path} {:?} E={} K={} groups={}/{} hash={}: {checked}/{tokens} tie-free tokens identical, {same_ids}/{tokens} same ids overall, max rel weight err {max_w_err:.2e}",
            spec.func, spec.e, spec.k, spec.topk_group, spec.n_group, spec.hash
        );
            assert!(
                checked * 100 >= tokens * if tokens >= 512 { 85 } else { 75 },
                "seed {seed} {spec:?}: only {checked} tie-free tokens, the test checks too little"
            );
            assert!(
                max_w_err < 1e-4,
                "seed {seed} {spec:?} {path}: weights differ by {max_w_err}"
            );
        }
    }
}

/// The GPU router against the CPU's on logits both compute exactly (one-hot hidden states,
/// router weights and biases drawn from a few values): every token decided alike, ties (equal
/// selection scores, equal group scores) and NaN logits included, on each of `router_topk`'s
/// paths: groups of 32 experts on keys alone (E = 96, 256, 512), group limits of other sizes
/// through flags then keys, no group limit, E not a multiple of 32 (the scan), hash layers;
/// every scoring function. Weights within an ulp of the exp (and bit for bit where the
/// CPU's expf rounds as the GPU's does).
#[test]
#[ignore = "needs a GPU (.ci/gpu-nightly)"]
fn router_decides_ties_and_nan_like_the_cpu_on_exact_logits() {
    use rand::Rng;
    let b = backend();
    let cpu = CpuBackend::new();
    let (mut r, seed) = rng("router_decides_ties_and_nan_like_the_cpu_on_exact_logits");
    // (E, K, n_group, topk_group, scoring, hash)
    let cases = [
        (256, 8, 8, 4, ScoringFunc::Sigmoid, false),
        (512, 8, 16, 4, ScoringFunc::Sigmoid, false),
        (96, 6, 3, 2, ScoringFunc::Softmax, false),
        (256, 8, 16, 5, ScoringFunc::Sigmoid, false),
        (160, 6, 8, 3, ScoringFunc::Sqrtsoftplus, false),
        (64, 8, 1, 1, ScoringFunc::Sqrtsoftplus, false),
        (100, 4, 1, 1, ScoringFunc::Sigmoid, false),
        (100, 4, 4, 2, ScoringFunc::Softmax, false),
        (64, 4, 1, 1, ScoringFunc::Sigmoid, true),
    ];
    let values = [-1.0f32, -0.5, -0.0, 0.0, 0.5, 1.0, 2.0];
    let biases = [0.0f32, 0.25, -0.25];
    for (e, k, n_group, topk_group, func, hash) in cases {
        let spec = LayerSpec {
            e,
            k,
            n_group,
            topk_group,
            h: 64,
            i: 128,
            hash,
            shared: false,
            ..LayerSpec::small(func)
        };
        let mut layer = build_layer(&mut r, spec);
        let h = spec.h;
        for w in layer.router.weight.iter_mut() {
            *w = values[r.gen_range(0..values.len())];
        }
        // a NaN logit for every token in one expert (0 * NaN is NaN in every sum; under
        // softmax it would make every score NaN)
        if e != 256 && func != ScoringFunc::Softmax {
            layer.router.weight[(e / 3) * h + 5] = f32::NAN;
        }
        if let Some(bias) = layer.router.e_score_correction_bias.as_mut() {
            for v in bias.iter_mut() {
                *v = biases[r.gen_range(0..biases.len())];
            }
        }
        let tokens = 300;
        let mut x = vec![0f32; tokens * h];
        for t in 0..tokens {
            x[t * h + (t * 7) % h] = 1.0;
        }
        let ids = input_ids(&mut r, tokens);
        let want = cpu.route(&layer, &x, Some(&ids)).unwrap();
        let got = b.route(&layer, &x, Some(&ids)).unwrap();
        let what =
            format!("seed {seed}: E {e} K {k} groups {topk_group}/{n_group} {func:?} hash {hash}");
        let mut ties = 0;
        for t in 0..tokens {
            let s = t * k..(t + 1) * k;
            assert_eq!(
                got.topk_ids[s.clone()],
                want.topk_ids[s.clone()],
                "{what}: token {t}"
            );
            for j in s {
                let (g, w) = (got.topk_weights[j], want.topk_weights[j]);
                assert!(
                    g.to_bits() == w.to_bits()
                        || (g.is_nan() && w.is_nan())
                        || (g - w).abs() <= 2.0 * f32::EPSILON * w.abs(),
                    "{what}: token {t} slot weight {g} against {w}"
                );
            }
            // how often the decision had a tie to break (the test's point)
            let logits = &layer.router.weight;
            let row: Vec<f32> = (0..e).map(|x| logits[x * h + (t * 7) % h]).collect();
            let chosen: Vec<f32> = want.topk_ids[t * k..(t + 1) * k]
                .iter()
                .map(|&i| row[i as usize])
                .collect();
            ties += usize::from(
                row.iter()
                    .filter(|&&v| chosen.iter().any(|&c| c.to_bits() == v.to_bits()))
                    .count()
                    > k,
            );
        }
        eprintln!(
            "router {what}: {tokens} tokens identical, {ties} with tied logits among the chosen"
        );
        assert!(
            hash || ties * 2 > tokens,
            "{what}: only {ties} tokens with ties, the test checks too little"
        );
    }
}

/// `v` with the lowest mantissa bit set: no value is BF16-exact any more.
fn not_bf16(v: &[f32]) -> Vec<f32> {
    v.iter().map(|x| f32::from_bits(x.to_bits() | 1)).collect()
}

fn fixed_scales(layer: &MoeLayer, x: &[f32]) -> ActScales {
    let e = layer.config.n_routed_experts;
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    ActScales::Fixed {
        gs1: (0..e)
            .map(|j| 2688.0 / amax * (1.0 + j as f32 / 64.0))
            .collect(),
        gs2: (0..e)
            .map(|j| 2688.0 / 0.5 * (1.0 + j as f32 / 32.0))
            .collect(),
    }
}

fn check_close(what: &str, seed: u64, got: &[f32], want: &[f32], min_cos: f64) -> metrics::Metrics {
    let m = metrics::compare(got, want);
    eprintln!(
        "{what}: cosine {:.9} rel_l2 {:.3e} max_abs_err {:.3e} nan {} inf {}",
        m.cosine, m.rel_l2, m.max_abs_err, m.nan_count, m.inf_count
    );
    assert!(m.passes(min_cos), "seed {seed} {what}: {m:?}");
    m
}

#[test]
#[ignore = "needs a GPU (.ci/gpu-nightly)"]
fn nvfp4_layer_matches_the_cpu_nvfp4_path() {
    let b = backend();
    let cpu = CpuBackend::new();
    let (mut r, seed) = rng("nvfp4_layer_matches_the_cpu_nvfp4_path");
    let specs = [
        (
            "sigmoid, shared, fixed gs",
            LayerSpec::small(ScoringFunc::Sigmoid),
            false,
            96usize,
        ),
        (
            "softmax, dynamic gs",
            LayerSpec {
                shared: false,
                ..LayerSpec::small(ScoringFunc::Softmax)
            },
            true,
            64,
        ),
        (
            "sqrtsoftplus, swiglu_limit, hash",
            LayerSpec {
                limit: Some(0.5),
                hash: true,
                ..LayerSpec::small(ScoringFunc::Sqrtsoftplus)
            },
            false,
            80,
        ),
        (
            "MXFP4 experts",
            LayerSpec {
                mxfp4: true,
                ..LayerSpec::small(ScoringFunc::Sigmoid)
            },
            true,
            48,
        ),
        (
            "many empty experts, odd dims",
            LayerSpec {
                e: 64,
                k: 2,
                h: 208,
                i: 80,
                ..LayerSpec::small(ScoringFunc::Sigmoid)
            },
            false,
            7,
        ),
        (
            "group-limited, larger",
            LayerSpec {
                e: 32,
                k: 8,
                n_group: 4,
                topk_group: 2,
                h: 1024,
                i: 256,
                ..LayerSpec::small(ScoringFunc::Sigmoid)
            },
            false,
            300,
        ),
        (
            // an expert count that does not divide moe_offsets' 1024 threads: 3 runs of chunks
            // per expert, 124 threads idle
            "300 experts, prefill tiles",
            LayerSpec {
                e: 300,
                k: 6,
                ..LayerSpec::small(ScoringFunc::Sigmoid)
            },
            false,
            120,
        ),
    ];
    for (what, spec, dynamic, tokens) in specs {
        let layer = build_layer(&mut r, spec);
        let x = hidden(&mut r, tokens, spec.h);
        let ids = input_ids(&mut r, tokens);
        let routing = cpu.route(&layer, &x, Some(&ids)).unwrap();
        let scales = if dynamic {
            ActScales::Dynamic
        } else {
            fixed_scales(&layer, &x)
        };
        let path = Path::Nvfp4 {
            scales: &scales,
            flavor: Flavor::Reference,
        };
        let want = cpu.moe_forward(&layer, &x, &routing, &path, true).unwrap();
        let got = b.moe_forward(&layer, &x, &routing, &path, true).unwrap();
        check_close(
            &format!("nvfp4 [{what}] out"),
            seed,
            &got.out,
            &want.out,
            MIN_COSINE,
        );
        check_close(
            &format!("nvfp4 [{what}] per_slot"),
            seed,
            got.per_slot.as_ref().unwrap(),
            want.per_slot.as_ref().unwrap(),
            MIN_COSINE,
        );
        assert_bf16_rows(
            &format!("nvfp4 [{what}] per_slot"),
            seed,
            got.per_slot.as_ref().unwrap(),
        );
        assert_eq!(
            got.act_stats.blocks, want.act_stats.blocks,
            "seed {seed} {what}: blocks quantized"
        );
        let d = |a: u64, b: u64| a.abs_diff(b) as f64 / (want.act_stats.blocks as f64);
        assert!(
            d(got.act_stats.saturated, want.act_stats.saturated) < 1e-3
                && d(got.act_stats.flushed, want.act_stats.flushed) < 1e-3,
            "seed {seed} {what}: stats {:?} vs {:?}",
            got.act_stats,
            want.act_stats
        );
        eprintln!(
            "  act_stats gpu {:?} cpu {:?}",
            got.act_stats, want.act_stats
        );
        // the fast flavor runs and stays close
        let fast = Path::Nvfp4 {
            scales: &scales,
            flavor: Flavor::CudaFast,
        };
        let gf = b.moe_forward(&layer, &x, &routing, &fast, false).unwrap();
        // a flipped code in an expert input moves every element of the row's SwiGLU output a
        // little, and its re-quantization turns that into whole-step flips: the flavors differ
        // by far more than their flip rate suggests. How far is what the tool reports.
        let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        let fl = quant::flavor_flips(b.gpu(), &x, tokens, spec.h, 2688.0 / amax).unwrap();
        eprintln!(
            "  hidden codes flipped between flavors at gs 2688/amax: {} of {}",
            fl.codes, fl.total_codes
        );
        // (the flips themselves are checked to sit at rounding ties in gpu_quant.rs)
        check_close(
            &format!("nvfp4 cuda-fast [{what}] out"),
            seed,
            &gf.out,
            &want.out,
            0.99,
        );
    }
}

#[test]
#[ignore = "needs a GPU (.ci/gpu-nightly)"]
fn reference_path_matches_the_cpu_reference() {
    let b = backend();
    let cpu = CpuBackend::new();
    let (mut r, seed) = rng("reference_path_matches_the_cpu_reference");
    for (what, spec, tokens) in [
        (
            "originals + shared",
            LayerSpec::small(ScoringFunc::Sigmoid),
            128usize,
        ),
        (
            "dequantized weights, limit",
            LayerSpec {
                originals: false,
                limit: Some(0.75),
                ..LayerSpec::small(ScoringFunc::Softmax)
            },
            77,
        ),
        (
            "many empty experts",
            LayerSpec {
                e: 64,
                k: 2,
                ..LayerSpec::small(ScoringFunc::Sigmoid)
            },
            5,
        ),
    ] {
        let layer = build_layer(&mut r, spec);
        let x = hidden(&mut r, tokens, spec.h);
        let ids = input_ids(&mut r, tokens);
        let routing = cpu.route(&layer, &x, Some(&ids)).unwrap();
        let want = cpu
            .moe_forward(&layer, &x, &routing, &Path::Reference, true)
            .unwrap();
        let got = b
            .moe_forward(&layer, &x, &routing, &Path::Reference, true)
            .unwrap();
        check_close(
            &format!("reference [{what}] out"),
            seed,
            &got.out,
            &want.out,
            MIN_COSINE,
        );
        check_close(
            &format!("reference [{what}] per_slot"),
            seed,
            got.per_slot.as_ref().unwrap(),
            want.per_slot.as_ref().unwrap(),
            MIN_COSINE,
        );
    }
}

#[test]
#[ignore = "needs a GPU (.ci/gpu-nightly)"]
fn the_forward_is_deterministic() {
    let b = backend();
    let cpu = CpuBackend::new();
    let (mut r, _seed) = rng("the_forward_is_deterministic");
    let spec = LayerSpec {
        e: 32,
        k: 8,
        ..LayerSpec::small(ScoringFunc::Sigmoid)
    };
    let layer = build_layer(&mut r, spec);
    let x = hidden(&mut r, 1000, spec.h);
    let routing = cpu.route(&layer, &x, None).unwrap();
    for scales in [fixed_scales(&layer, &x), ActScales::Dynamic] {
        let path = Path::Nvfp4 {
            scales: &scales,
            flavor: Flavor::Reference,
        };
        let a = b.moe_forward(&layer, &x, &routing, &path, true).unwrap();
        let c = b.moe_forward(&layer, &x, &routing, &path, true).unwrap();
        assert_eq!(bits(&a.out), bits(&c.out), "two runs differ");
        assert_eq!(
            bits(a.per_slot.as_ref().unwrap()),
            bits(c.per_slot.as_ref().unwrap())
        );
        assert_eq!(a.act_stats, c.act_stats);
    }
}

/// `nvfp4dbg bench` times each stage repeated alone, after a whole forward left what it reads:
/// the grouped GEMMs run again, in the bench's orders, recompute the same outputs bit for bit
/// (a stage whose input a later stage overwrote would not: the gate/up's token rows, made by
/// the prologue, once shared their buffer with the down's).
#[test]
#[ignore = "needs a GPU (.ci/gpu-nightly)"]
fn stages_repeated_alone_recompute_the_same_outputs() {
    let b = backend();
    let (mut r, seed) = rng("stages_repeated_alone_recompute_the_same_outputs");
    let spec = LayerSpec {
        e: 32,
        k: 8,
        ..LayerSpec::small(ScoringFunc::Sigmoid)
    };
    let layer = build_layer(&mut r, spec);
    // a prefill batch (the register-A GEMMs on sm_90a), inputs scattered as at 4096 tokens
    let tokens = 700;
    let x = hidden(&mut r, tokens, spec.h);
    for scales in [fixed_scales(&layer, &x), ActScales::Dynamic] {
        let mut f =
            Nvfp4Forward::new(b.gpu(), &layer, tokens, &scales, Flavor::Reference, true).unwrap();
        f.set_input_quantize(InputQuantize::Scatter);
        f.route_on_gpu(None).unwrap();
        f.set_hidden(&x).unwrap();
        let want = f.run().unwrap();
        let orders: [&[Stage]; 3] = [
            &[Stage::GateUp],
            &[Stage::Down],
            &[Stage::GateUp, Stage::Down, Stage::GateUp, Stage::Down],
        ];
        for stages in orders {
            for s in stages {
                f.enqueue_stage(*s).unwrap();
            }
            f.enqueue_stage(Stage::Epilogue).unwrap();
            let got = f.output().unwrap();
            let what = format!("seed {seed}, {}, after {stages:?}", f.schedule());
            assert_eq!(bits(&got.out), bits(&want.out), "{what}: outputs differ");
            assert_eq!(
                bits(got.per_slot.as_ref().unwrap()),
                bits(want.per_slot.as_ref().unwrap()),
                "{what}: per-slot rows differ"
            );
        }
    }
}

#[test]
#[ignore = "needs a GPU (.ci/gpu-nightly)"]
fn cuda_graph_replay_matches_eager() {
    let b = backend();
    let cpu = CpuBackend::new();
    let (mut r, seed) = rng("cuda_graph_replay_matches_eager");
    let spec = LayerSpec {
        e: 32,
        k: 4,
        hash: false,
        ..LayerSpec::small(ScoringFunc::Sigmoid)
    };
    let layer = build_layer(&mut r, spec);
    let tokens = 200;
    let x0 = hidden(&mut r, tokens, spec.h);
    let x1 = hidden(&mut r, tokens, spec.h);
    for scales in [fixed_scales(&layer, &x0), ActScales::Dynamic] {
        let mut f =
            Nvfp4Forward::new(b.gpu(), &layer, tokens, &scales, Flavor::Reference, true).unwrap();
        f.route_on_gpu(None).unwrap();
        f.set_hidden(&x0).unwrap();
        // capture runs one eager forward first (on x0), then records the graph
        let graph = f.capture().unwrap();
        let eager0 = f.output().unwrap();
        let replay0 = graph.run().unwrap();
        assert_eq!(
            bits(&replay0.out),
            bits(&eager0.out),
            "seed {seed}: graph replay differs from eager"
        );
        // new input, same graph: the graph reads the input buffer and routes on the GPU again
        graph.set_hidden(&x1).unwrap();
        let replay1 = graph.run().unwrap();
        let eager1 = f.run().unwrap();
        assert_eq!(
            bits(&replay1.out),
            bits(&eager1.out),
            "seed {seed}: replay on new input differs from eager"
        );
        assert_eq!(
            bits(replay1.per_slot.as_ref().unwrap()),
            bits(eager1.per_slot.as_ref().unwrap())
        );
        assert_eq!(replay1.act_stats, eager1.act_stats);
        assert_ne!(bits(&eager0.out), bits(&eager1.out));
        for _ in 0..3 {
            graph.replay().unwrap();
        }
        let again = f.output().unwrap();
        assert_eq!(
            bits(&again.out),
            bits(&eager1.out),
            "seed {seed}: repeated replays drift"
        );
        // and the replayed forward is the layer: against the CPU with the GPU's routing
        let routing = f.routing().unwrap();
        assert_routes_like_the_cpu(&routing, &cpu.route(&layer, &x1, None).unwrap(), seed);
        let path = Path::Nvfp4 {
            scales: &scales,
            flavor: Flavor::Reference,
        };
        let want = moe::moe_forward(&layer, &x1, &routing, &path, false).unwrap();
        check_close(
            "graph replay vs cpu",
            seed,
            &replay1.out,
            &want.out,
            MIN_COSINE,
        );
        // BF16 router, BF16-exact input: the logits ran on the tensor cores. The graph keeps
        // that path, so it refuses an input that is not BF16-exact; the eager forward takes it
        // and routes in FP32 on the FMA pipes, still the CPU's routing.
        assert!(
            f.schedule().contains("router logits BF16 tensor cores"),
            "{}",
            f.schedule()
        );
        let inexact = not_bf16(&x1);
        let err = graph.set_hidden(&inexact).unwrap_err().to_string();
        assert!(err.contains("not BF16-exact"), "{err}");
        drop(graph);
        f.set_hidden(&inexact).unwrap();
        f.run().unwrap();
        assert!(
            f.schedule().contains("router logits FP32 (SIMT)"),
            "{}",
            f.schedule()
        );
        let want_route = cpu.route(&layer, &inexact, None).unwrap();
        assert_routes_like_the_cpu(&f.routing().unwrap(), &want_route, seed);
    }
}

/// At least 99% of the GPU's expert ids are the CPU's (the rest: near-ties of the logits).
fn assert_routes_like_the_cpu(got: &Routing, want: &Routing, seed: u64) {
    let same = got
        .topk_ids
        .iter()
        .zip(&want.topk_ids)
        .filter(|(a, b)| a == b)
        .count();
    assert!(
        same * 100 >= got.topk_ids.len() * 99,
        "seed {seed}: GPU routing disagrees with the CPU's ({same} of {} ids)",
        got.topk_ids.len()
    );
}

/// The expert inputs quantized token by token (each hidden row read once, written to its k
/// sorted rows; on sm_90a's prefill also straight into the register-A gate/up's 16-bit token
/// rows) against the row gather: the same outputs, per-slot rows and activation block
/// statistics, bit for bit, with fixed scales (all different, or three values shared among the
/// experts) and dynamic ones, both flavors, at a decode and a prefill batch. The gather runs
/// the down's rows prepass from the codes, the others (with fixed scales on sm_90a's prefill)
/// have the gate/up's epilogue write the down's 16-bit rows. (The gather path is the one
/// checked against the CPU elsewhere.)
#[test]
#[ignore = "needs a GPU (.ci/gpu-nightly)"]
fn expert_inputs_scattered_token_by_token_equal_the_gather() {
    let b = backend();
    let (mut r, seed) = rng("expert_inputs_scattered_token_by_token_equal_the_gather");
    let spec = LayerSpec {
        e: 32,
        k: 8,
        ..LayerSpec::small(ScoringFunc::Sigmoid)
    };
    let layer = build_layer(&mut r, spec);
    for tokens in [5, 700] {
        let x = hidden(&mut r, tokens, spec.h);
        // per-expert gs1 all different, three values shared among the experts (a slot's codes
        // reused from the slot before where their gs1 bits match, encoded again where not),
        // and one for all (dynamic)
        let shared3 = match fixed_scales(&layer, &x) {
            ActScales::Fixed { gs1, gs2 } => ActScales::Fixed {
                gs1: (0..gs1.len()).map(|j| gs1[j % 3]).collect(),
                gs2,
            },
            ActScales::Dynamic => unreachable!(),
        };
        for (scales, flavor) in [
            (fixed_scales(&layer, &x), Flavor::Reference),
            (shared3, Flavor::CudaFast),
            (ActScales::Dynamic, Flavor::CudaFast),
        ] {
            let run = |how: InputQuantize, rows: RsRows, down: DownRows| {
                let mut f =
                    Nvfp4Forward::new(b.gpu(), &layer, tokens, &scales, flavor, true).unwrap();
                f.set_input_quantize(how);
                f.set_rs_rows(rows);
                f.set_down_rows(down);
                f.route_on_gpu(None).unwrap();
                f.set_hidden(&x).unwrap();
                (f.run().unwrap(), f.schedule())
            };
            let (g, g_schedule) = run(InputQuantize::Gather, RsRows::Auto, DownRows::Prepass);
            assert!(!g_schedule.contains("gate/up epilogue"), "{g_schedule}");
            let rs_prefill = tokens > 64 && b.gpu().arch == "sm_90a";
            // the scatter through the codes in memory, then straight into the register-A
            // gate/up's 16-bit token rows where that kernel runs (sm_90a, the prefill batch),
            // from the f32 input and from its BF16 copy
            for rows in [RsRows::Codes, RsRows::F32, RsRows::Auto] {
                let (s, schedule) = run(InputQuantize::Scatter, rows, DownRows::Auto);
                let what = format!("seed {seed}, {tokens} tokens, {flavor:?}, {schedule}");
                let straight = schedule.contains("straight into");
                assert_eq!(straight, rows != RsRows::Codes && rs_prefill, "{what}");
                assert_eq!(
                    schedule.contains("down's 16-bit rows from the gate/up epilogue"),
                    rs_prefill && !matches!(scales, ActScales::Dynamic),
                    "{what}"
                );
                // the test's inputs are BF16-exact, and the shared expert keeps their copy
                if straight {
                    assert_eq!(
                        schedule.contains("rows, from BF16"),
                        rows == RsRows::Auto,
                        "{what}"
                    );
                }
                assert_eq!(bits(&s.out), bits(&g.out), "{what}: outputs differ");
                assert_eq!(
                    bits(s.per_slot.as_ref().unwrap()),
                    bits(g.per_slot.as_ref().unwrap()),
                    "{what}: per-slot rows differ"
                );
                assert_eq!(s.act_stats, g.act_stats, "{what}: block statistics differ");
                assert!(s.out.iter().all(|v| v.is_finite()), "{what}");
            }
        }
    }
}

/// The shared expert on the side stream (the default) against the same forward on one
/// stream: bit-identical outputs, eager and replayed from a graph, at a decode and a prefill
/// batch, and the shared expert is really in them (without it the output differs).
#[test]
#[ignore = "needs a GPU (.ci/gpu-nightly)"]
fn the_shared_expert_beside_the_routed_ones_changes_no_bit() {
    let b = backend();
    let (mut r, seed) = rng("the_shared_expert_beside_the_routed_ones_changes_no_bit");
    let spec = LayerSpec {
        e: 32,
        k: 8,
        ..LayerSpec::small(ScoringFunc::Sigmoid)
    };
    let layer = build_layer(&mut r, spec);
    assert!(layer.shared.is_some());
    let mut plain = layer.clone();
    plain.shared = None;
    for tokens in [8, 600] {
        let x = hidden(&mut r, tokens, spec.h);
        let other = hidden(&mut r, tokens, spec.h);
        let scales = fixed_scales(&layer, &x);
        let run = |layer: &MoeLayer, beside: bool, graph: bool| {
            let mut f = Nvfp4Forward::new(b.gpu(), layer, tokens, &scales, Flavor::Reference, true)
                .unwrap();
            f.set_shared_beside(beside);
            f.route_on_gpu(None).unwrap();
            f.set_hidden(&x).unwrap();
            if graph {
                let g = f.capture().unwrap();
                // a replay on other input first, so the one read back is not the warm-up's
                g.set_hidden(&other).unwrap();
                g.replay().unwrap();
                g.set_hidden(&x).unwrap();
                g.run().unwrap()
            } else {
                f.run().unwrap()
            }
        };
        let one_stream = run(&layer, false, false);
        let what = format!("seed {seed}, {tokens} tokens");
        for graph in [false, true] {
            let beside = run(&layer, true, graph);
            assert_eq!(
                bits(&beside.out),
                bits(&one_stream.out),
                "{what}, graph {graph}: the shared expert beside changes the output"
            );
            assert_eq!(
                bits(beside.per_slot.as_ref().unwrap()),
                bits(one_stream.per_slot.as_ref().unwrap())
            );
        }
        let without = run(&plain, true, false);
        assert_eq!(
            bits(without.per_slot.as_ref().unwrap()),
            bits(one_stream.per_slot.as_ref().unwrap()),
            "{what}: the routed experts do not depend on the shared one"
        );
        assert_ne!(
            bits(&without.out),
            bits(&one_stream.out),
            "{what}: the shared expert adds nothing"
        );
    }
}

/// The decode GEMMs (kernels/moe_decode.cu, chosen for few tokens) against the CPU NVFP4
/// path: fixed and dynamic scales, swiglu_limit, shared experts, more rows on one expert than
/// a pass holds (several passes over its weights), and bit-exact graph replays.
#[test]
#[ignore = "needs a GPU (.ci/gpu-nightly)"]
fn decode_gemms_match_the_cpu_nvfp4_path() {
    use nvfp4dbg::backend::cuda::moe_decode::{DecodeLayout, GemmKind};
    let b = backend();
    let cpu = CpuBackend::new();
    let (mut r, seed) = rng("decode_gemms_match_the_cpu_nvfp4_path");
    let big = LayerSpec {
        e: 32,
        k: 8,
        h: 1024,
        i: 256,
        ..LayerSpec::small(ScoringFunc::Sigmoid)
    };
    let limited = LayerSpec {
        limit: Some(0.5),
        ..LayerSpec::small(ScoringFunc::Softmax)
    };
    // (what, spec, dynamic, tokens, every token on the same top-k experts)
    let cases = [
        ("1 token, fixed", big, false, 1usize, false),
        ("3 tokens, dynamic", big, true, 3, false),
        ("16 tokens, fixed", big, false, 16, false),
        ("16 tokens, limit, dynamic", limited, true, 16, false),
        (
            "64 tokens, fixed",
            LayerSpec::small(ScoringFunc::Sigmoid),
            false,
            64,
            false,
        ),
        ("21 tokens on the same experts, fixed", big, false, 21, true),
        (
            "40 tokens over 300 experts, fixed",
            LayerSpec {
                e: 300,
                k: 8,
                ..LayerSpec::small(ScoringFunc::Sigmoid)
            },
            false,
            40,
            false,
        ),
        (
            "21 tokens on the same experts, dynamic",
            limited,
            true,
            21,
            true,
        ),
    ];
    for (what, spec, dynamic, tokens, same) in cases {
        let layer = build_layer(&mut r, spec);
        let x = hidden(&mut r, tokens, spec.h);
        let ids = input_ids(&mut r, tokens);
        let mut routing = cpu.route(&layer, &x, Some(&ids)).unwrap();
        if same {
            let first: Vec<i32> = routing.topk_ids[..spec.k].to_vec();
            for t in 0..tokens {
                routing.topk_ids[t * spec.k..(t + 1) * spec.k].copy_from_slice(&first);
            }
        }
        let scales = if dynamic {
            ActScales::Dynamic
        } else {
            fixed_scales(&layer, &x)
        };
        let mut f =
            Nvfp4Forward::new(b.gpu(), &layer, tokens, &scales, Flavor::Reference, true).unwrap();
        assert!(
            matches!(f.choose_gemm(), GemmKind::Decode { .. }),
            "{what}: {tokens} tokens at h {} i {} should take the decode GEMMs",
            spec.h,
            spec.i
        );
        // the weights in decode tiles and in the checkpoint's rows: the same MMAs on the
        // same operands, so the same bits
        f.set_routing(&layer, &routing).unwrap();
        f.set_hidden(&x).unwrap();
        f.set_decode_layout(DecodeLayout::Tiles);
        let tiles = f.run().unwrap();
        f.set_decode_layout(DecodeLayout::Rows);
        let rows = f.run().unwrap();
        drop(f);
        let path = Path::Nvfp4 {
            scales: &scales,
            flavor: Flavor::Reference,
        };
        let want = cpu.moe_forward(&layer, &x, &routing, &path, true).unwrap();
        let got = b.moe_forward(&layer, &x, &routing, &path, true).unwrap();
        assert_eq!(
            bits(&tiles.out),
            bits(&rows.out),
            "seed {seed} {what}: decode tiles and rows differ"
        );
        assert_eq!(
            bits(&tiles.out),
            bits(&got.out),
            "seed {seed} {what}: the forward and Backend::moe_forward differ"
        );
        check_close(
            &format!("decode [{what}] out"),
            seed,
            &got.out,
            &want.out,
            MIN_COSINE,
        );
        check_close(
            &format!("decode [{what}] per_slot"),
            seed,
            got.per_slot.as_ref().unwrap(),
            want.per_slot.as_ref().unwrap(),
            MIN_COSINE,
        );
        assert_bf16_rows(
            &format!("decode [{what}] per_slot"),
            seed,
            got.per_slot.as_ref().unwrap(),
        );
        assert_eq!(
            got.act_stats.blocks, want.act_stats.blocks,
            "seed {seed} {what}: blocks"
        );
        let again = b.moe_forward(&layer, &x, &routing, &path, true).unwrap();
        assert_eq!(
            bits(&got.out),
            bits(&again.out),
            "seed {seed} {what}: two runs differ"
        );
        let fast = Path::Nvfp4 {
            scales: &scales,
            flavor: Flavor::CudaFast,
        };
        let gf = b.moe_forward(&layer, &x, &routing, &fast, false).unwrap();
        check_close(
            &format!("decode cuda-fast [{what}] out"),
            seed,
            &gf.out,
            &want.out,
            0.99,
        );
    }
    // graph replay of a decode forward routed on the GPU is bit-exact with eager
    let layer = build_layer(&mut r, big);
    let x = hidden(&mut r, 16, big.h);
    for scales in [fixed_scales(&layer, &x), ActScales::Dynamic] {
        let mut f =
            Nvfp4Forward::new(b.gpu(), &layer, 16, &scales, Flavor::Reference, true).unwrap();
        f.route_on_gpu(None).unwrap();
        f.set_hidden(&x).unwrap();
        let graph = f.capture().unwrap();
        let eager = f.output().unwrap();
        let replay = graph.run().unwrap();
        assert_eq!(
            bits(&replay.out),
            bits(&eager.out),
            "seed {seed}: decode graph replay differs"
        );
    }
}
