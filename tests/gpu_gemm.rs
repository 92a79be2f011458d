//! The prefill grouped GEMMs on Hopper's warpgroup MMA (kernels/moe_gemm_sm90.cu: operands in
//! shared memory, and the weights as the register A operand) against the mma.sync kernels
//! (kernels/moe.cu) and the CPU NVFP4 path, on routings built to hit the ragged cases: experts
//! with 0, 1, 3, 33, 64, 65, 127, 129 and 300 rows (one-row tiles, tiles of <= 32 and <= 64
//! rows, a tile one row past 128, three tiles), and output widths that end in partial tiles.

mod gpu_common;

use gpu_common::*;
use nvfp4dbg::backend::cpu::CpuBackend;
use nvfp4dbg::backend::cuda::moe::{Nvfp4Forward, PrefillGemm};
use nvfp4dbg::backend::Backend;
use nvfp4dbg::metrics;
use nvfp4dbg::moe::{ActScales, MoeLayer, MoeOutput, Path, Routing, ScoringFunc};
use nvfp4dbg::nvfp4::Flavor;
use rand::seq::SliceRandom;
use rand::Rng;
use rand_chacha::ChaCha8Rng;

const MIN_COSINE: f64 = 0.99999;

/// Top-2 routing of `sum(counts) / 2` tokens in which expert `e` gets exactly `counts[e]`
/// rows (sum even, every count below half the entries so a token never gets one expert
/// twice), tokens in random order, random positive weights.
fn ragged_routing(r: &mut ChaCha8Rng, counts: &[usize]) -> Routing {
    let entries: Vec<i32> = counts
        .iter()
        .enumerate()
        .flat_map(|(e, &c)| std::iter::repeat_n(e as i32, c))
        .collect();
    assert!(entries.len().is_multiple_of(2) && counts.iter().all(|&c| c < entries.len() / 2));
    let tokens = entries.len() / 2;
    let mut order: Vec<usize> = (0..tokens).collect();
    order.shuffle(r);
    let mut ids = vec![0i32; 2 * tokens];
    for (t, &o) in order.iter().enumerate() {
        ids[2 * o] = entries[t];
        ids[2 * o + 1] = entries[t + tokens];
    }
    Routing {
        tokens,
        top_k: 2,
        topk_ids: ids,
        topk_weights: (0..2 * tokens).map(|_| r.gen_range(0.1f32..1.5)).collect(),
    }
}

fn run(
    layer: &MoeLayer,
    x: &[f32],
    routing: &Routing,
    scales: &ActScales,
    which: PrefillGemm,
) -> MoeOutput {
    let gpu = gpu();
    let mut f = Nvfp4Forward::new(&gpu, layer, routing.tokens, scales, Flavor::Reference, true)
        .unwrap_or_else(|e| panic!("{e}"));
    f.set_prefill_gemm(which).unwrap_or_else(|e| panic!("{e}"));
    f.set_hidden(x).unwrap();
    f.set_routing(layer, routing).unwrap();
    f.run().unwrap_or_else(|e| panic!("{which:?}: {e}"))
}

fn close(what: &str, seed: u64, got: &[f32], want: &[f32]) {
    let m = metrics::compare(got, want);
    eprintln!(
        "{what}: cosine {:.9} rel_l2 {:.3e} max_abs_err {:.3e} nan {} inf {}",
        m.cosine, m.rel_l2, m.max_abs_err, m.nan_count, m.inf_count
    );
    assert!(
        m.nan_count == 0 && m.inf_count == 0 && m.passes(MIN_COSINE),
        "seed {seed} {what}: {m:?}"
    );
}

/// The wgmma kernels that apply to a layer of hidden size `h` and intermediate size `i`.
fn wgmma_kernels(h: usize, i: usize) -> Vec<PrefillGemm> {
    let mut v = vec![PrefillGemm::Wgmma];
    if h.is_multiple_of(128) && i.is_multiple_of(128) {
        v.push(PrefillGemm::WgmmaRs);
    }
    v
}

/// Off sm_90a the wgmma kernels must be refused: that is what these tests check there.
fn refused_off_hopper(gpu: &std::sync::Arc<nvfp4dbg::backend::cuda::device::Gpu>) -> bool {
    if gpu.arch == "sm_90a" {
        return false;
    }
    let mut r = rng("refused_off_hopper").0;
    let layer = build_layer(
        &mut r,
        LayerSpec {
            h: 256,
            i: 128,
            e: 4,
            k: 2,
            shared: false,
            ..LayerSpec::small(ScoringFunc::Sigmoid)
        },
    );
    let mut f = Nvfp4Forward::new(
        gpu,
        &layer,
        8,
        &ActScales::Dynamic,
        Flavor::Reference,
        false,
    )
    .unwrap();
    for which in [PrefillGemm::Wgmma, PrefillGemm::WgmmaRs] {
        assert!(
            f.set_prefill_gemm(which).is_err(),
            "{which:?} on {}",
            gpu.arch
        );
    }
    eprintln!(
        "{}: the wgmma kernels are refused, as they must be",
        gpu.arch
    );
    true
}

#[test]
#[ignore = "needs a GPU (.ci/gpu-nightly)"]
fn wgmma_prefill_gemm_matches_mma_sync_and_the_cpu_on_ragged_experts() {
    let gpu = gpu();
    if refused_off_hopper(&gpu) {
        return;
    }
    let cpu = CpuBackend::new();
    let (mut r, seed) = rng("wgmma_prefill_gemm_matches_mma_sync_and_the_cpu_on_ragged_experts");
    // (hidden, intermediate): down outputs of 2 full + 1 partial 256-column tiles and gate/up
    // outputs ending in a partial 128-column tile; K of 9 and 3 slices (the pipeline is 4
    // stages deep); (640, 384) for the register-A kernels (K chunks of 128: 5 and 3 against 4
    // stages, a partial 256-column down tile), then a wider case. The register-A kernels' last
    // tile of an expert takes up to 160 rows: 129, 160 and 288 (128 + 160) rows have a wide
    // tile, 161 (128 + 33), 250 (128 + 122) and 300 (128 + 128 + 44) do not; 170 (128 + 42),
    // 200 (128 + 72) and 330 rows (128 + 128 + 74).
    for (h, i) in [(576usize, 192usize), (640, 384), (1024, 512)] {
        let counts = [
            0usize, 1, 127, 129, 300, 65, 0, 2, 33, 64, 160, 161, 288, 250, 170, 200, 330,
        ];
        let spec = LayerSpec {
            h,
            i,
            e: counts.len(),
            k: 2,
            shared: false,
            ..LayerSpec::small(ScoringFunc::Sigmoid)
        };
        let layer = build_layer(&mut r, spec);
        let routing = ragged_routing(&mut r, &counts);
        let x = hidden(&mut r, routing.tokens, h);
        let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        let e = counts.len();
        let fixed = ActScales::Fixed {
            gs1: (0..e)
                .map(|j| 2688.0 / amax * (1.0 + j as f32 / 64.0))
                .collect(),
            gs2: (0..e)
                .map(|j| 2688.0 / 0.5 * (1.0 + j as f32 / 32.0))
                .collect(),
        };
        for (sname, scales) in [("fixed gs", fixed), ("dynamic gs", ActScales::Dynamic)] {
            let what = format!("h {h} i {i} {sname}");
            let path = Path::Nvfp4 {
                scales: &scales,
                flavor: Flavor::Reference,
            };
            let want = cpu.moe_forward(&layer, &x, &routing, &path, true).unwrap();
            let ms = run(&layer, &x, &routing, &scales, PrefillGemm::MmaSync);
            let (mp, cp) = (
                ms.per_slot.as_ref().unwrap(),
                want.per_slot.as_ref().unwrap(),
            );
            close(&format!("{what}: mma.sync vs cpu, per_slot"), seed, mp, cp);
            assert_bf16_rows(&format!("{what}: mma.sync per_slot"), seed, mp);
            for which in wgmma_kernels(h, i) {
                let what = format!("{what} {which:?}");
                let wg = run(&layer, &x, &routing, &scales, which);
                let wp = wg.per_slot.as_ref().unwrap();
                close(&format!("{what}: vs cpu, out"), seed, &wg.out, &want.out);
                close(&format!("{what}: vs cpu, per_slot"), seed, wp, cp);
                close(&format!("{what}: vs mma.sync, per_slot"), seed, wp, mp);
                assert_bf16_rows(&format!("{what}: per_slot"), seed, wp);
                // every expert's rows, one by one: a wrong tile shows up even where the others
                // hide it
                for (ex, _) in counts.iter().enumerate().filter(|(_, &c)| c > 0) {
                    let rows: Vec<usize> = (0..routing.tokens * 2)
                        .filter(|&s| routing.topk_ids[s] as usize == ex)
                        .collect();
                    let pick = |v: &[f32]| -> Vec<f32> {
                        rows.iter()
                            .flat_map(|&s| v[s * h..(s + 1) * h].to_vec())
                            .collect()
                    };
                    close(
                        &format!("{what}: expert {ex} ({} rows) vs cpu", rows.len()),
                        seed,
                        &pick(wp),
                        &pick(cp),
                    );
                }
                assert_eq!(
                    wg.act_stats.blocks, want.act_stats.blocks,
                    "seed {seed} {what}: blocks quantized"
                );
                // run to run: bit for bit
                let again = run(&layer, &x, &routing, &scales, which);
                assert_eq!(
                    bits(&wg.out),
                    bits(&again.out),
                    "seed {seed} {what}: two runs differ"
                );
                assert_eq!(bits(wp), bits(again.per_slot.as_ref().unwrap()));
            }
        }
    }
}

#[test]
#[ignore = "needs a GPU (.ci/gpu-nightly)"]
fn wgmma_prefill_gemm_matches_the_cpu_at_deepseek_v3_widths() {
    // H 7168 / I 2048: 112 and 32 K slices (the pipeline wraps its ring many times), 28 and
    // 16 output tiles; fewer experts than the model to keep the CPU reference short
    let gpu = gpu();
    if refused_off_hopper(&gpu) {
        return;
    }
    let cpu = CpuBackend::new();
    let (mut r, seed) = rng("wgmma_prefill_gemm_matches_the_cpu_at_deepseek_v3_widths");
    let counts = [0usize, 1, 129, 190, 64, 2, 160];
    let (h, i) = (7168usize, 2048usize);
    let spec = LayerSpec {
        h,
        i,
        e: counts.len(),
        k: 2,
        shared: false,
        originals: false,
        ..LayerSpec::small(ScoringFunc::Sigmoid)
    };
    let layer = build_layer(&mut r, spec);
    let routing = ragged_routing(&mut r, &counts);
    let x = hidden(&mut r, routing.tokens, h);
    let scales = ActScales::Dynamic;
    let path = Path::Nvfp4 {
        scales: &scales,
        flavor: Flavor::Reference,
    };
    let want = cpu.moe_forward(&layer, &x, &routing, &path, true).unwrap();
    for which in wgmma_kernels(h, i) {
        let wg = run(&layer, &x, &routing, &scales, which);
        close(
            &format!("DSv3 widths: {which:?} vs cpu, out"),
            seed,
            &wg.out,
            &want.out,
        );
        close(
            &format!("DSv3 widths: {which:?} vs cpu, per_slot"),
            seed,
            wg.per_slot.as_ref().unwrap(),
            want.per_slot.as_ref().unwrap(),
        );
    }
}

#[test]
#[ignore = "needs a GPU (.ci/gpu-nightly)"]
fn wgmma_is_refused_where_it_does_not_apply() {
    let gpu = gpu();
    let (mut r, _) = rng("wgmma_is_refused_where_it_does_not_apply");
    // K = 208 is not a multiple of 64 (nor of 128): the forward keeps the mma.sync kernels
    let spec = LayerSpec {
        h: 208,
        i: 80,
        e: 4,
        k: 2,
        shared: false,
        ..LayerSpec::small(ScoringFunc::Sigmoid)
    };
    let layer = build_layer(&mut r, spec);
    let mut f = Nvfp4Forward::new(
        &gpu,
        &layer,
        8,
        &ActScales::Dynamic,
        Flavor::Reference,
        false,
    )
    .unwrap();
    assert!(f.set_prefill_gemm(PrefillGemm::Wgmma).is_err());
    assert!(f.set_prefill_gemm(PrefillGemm::WgmmaRs).is_err());
    f.set_prefill_gemm(PrefillGemm::MmaSync).unwrap();
}
