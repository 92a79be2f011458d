//! GPU vs CPU reference: NVFP4 quantization (both flavors, f32 and BF16 input, linear and
//! swizzled scales), MXFP4, the swizzle kernels and the comparison reductions.

mod gpu_common;

use gpu_common::*;
use nvfp4dbg::backend::cuda::quant::{self, DevRows};
use nvfp4dbg::backend::cuda::reduce;
use nvfp4dbg::backend::Backend;
use nvfp4dbg::metrics;
use nvfp4dbg::nvfp4::{self, e4m3, layout, Flavor, ScaleLayout};
use rand::Rng;

/// Positions where two packed buffers differ, as (byte, cpu, gpu), first few.
fn diff(a: &[u8], b: &[u8]) -> (usize, Vec<(usize, u8, u8)>) {
    let mut n = 0;
    let mut first = Vec::new();
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        if x != y {
            n += 1;
            if first.len() < 8 {
                first.push((i, *x, *y));
            }
        }
    }
    (n + a.len().abs_diff(b.len()), first)
}

fn gs_cases(x: &[f32]) -> Vec<(&'static str, f32)> {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    vec![
        ("calibrated 2688/amax", 2688.0 / amax),
        ("default 2688", 2688.0),
        ("tiny (flushes blocks)", 1e-3),
        ("huge (saturates blocks)", 2688.0 / amax * 1e4),
        ("one", 1.0),
    ]
}

#[test]
#[ignore = "needs a GPU (.ci/gpu-nightly)"]
fn nvfp4_reference_flavor_is_bit_exact() {
    let b = backend();
    let (mut r, seed) = rng("nvfp4_reference_flavor_is_bit_exact");
    for &(rows, cols) in &[(1usize, 16usize), (37, 160), (300, 1024), (129, 7168)] {
        let x = activations(&mut r, rows * cols);
        for (what, gs) in gs_cases(&x) {
            let (want, wst) = nvfp4::quantize_nvfp4(&x, rows, cols, gs);
            let (got, gst) = b.quantize(&x, rows, cols, gs, Flavor::Reference).unwrap();
            let (nd, first) = diff(&want.packed, &got.packed);
            assert_eq!(nd, 0, "seed {seed} [{rows},{cols}] gs {what}={gs}: {nd} packed bytes differ, first (byte, cpu, gpu) {first:x?}");
            let (nd, first) = diff(&want.scales, &got.scales);
            assert_eq!(
                nd, 0,
                "seed {seed} [{rows},{cols}] gs {what}={gs}: {nd} scales differ {first:x?}"
            );
            assert_eq!(want.scale_2, got.scale_2);
            assert_eq!(
                wst, gst,
                "seed {seed} [{rows},{cols}] gs {what}: block stats"
            );
        }
    }
    eprintln!("nvfp4 reference flavor: bit-exact on 4 shapes x 5 global scales");
}

#[test]
#[ignore = "needs a GPU (.ci/gpu-nightly)"]
fn nvfp4_special_values_and_stats() {
    let b = backend();
    let (mut r, seed) = rng("nvfp4_special_values_and_stats");
    let (rows, cols) = (64, 256);
    let mut x = activations(&mut r, rows * cols);
    // whole-zero blocks, -0.0, subnormal-scale blocks, infinities, exact E2M1 ties
    for v in &mut x[0..16] {
        *v = 0.0;
    }
    x[20] = -0.0;
    for (i, v) in x[32..48].iter_mut().enumerate() {
        *v = (i as f32 - 8.0) * 1e-6;
    }
    x[100] = f32::INFINITY;
    x[200] = f32::NEG_INFINITY;
    for (i, v) in x[256..272].iter_mut().enumerate() {
        *v = [0.25f32, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0][i % 8]
            * if i % 2 == 0 { 1.0 } else { -1.0 };
    }
    let nan_at = [513usize, 4000, 9999];
    for &i in &nan_at {
        x[i] = f32::NAN;
    }
    for gs in [448.0f32, 2688.0, 1.0, 1e-2, 1e7] {
        let (want, wst) = nvfp4::quantize_nvfp4(&x, rows, cols, gs);
        let (got, gst) = b.quantize(&x, rows, cols, gs, Flavor::Reference).unwrap();
        assert_eq!(wst, gst, "seed {seed} gs {gs}: block stats");
        assert_eq!(wst.nan_scales, nan_at.len() as u64);
        assert_eq!(want.scales, got.scales, "seed {seed} gs {gs}: scales");
        // codes of a NaN block depend on the platform's NaN sign; compare all others
        for blk in 0..rows * cols / 16 {
            if e4m3::is_nan(want.scales[blk]) {
                continue;
            }
            assert_eq!(
                want.packed[blk * 8..blk * 8 + 8],
                got.packed[blk * 8..blk * 8 + 8],
                "seed {seed} gs {gs}: block {blk} codes (input {:?})",
                &x[blk * 16..blk * 16 + 16]
            );
        }
    }
}

#[test]
#[ignore = "needs a GPU (.ci/gpu-nightly)"]
fn nvfp4_bf16_input_and_swizzled_scales_are_bit_exact() {
    let g = gpu();
    let (mut r, seed) = rng("nvfp4_bf16_input_and_swizzled_scales_are_bit_exact");
    // (257, 2048) and (130, 2112): whole warps of contiguous groups (QUANT_TRANSPOSE), the
    // latter with a part-full last warp; (300, 80) and (97, 208): linear scales read the
    // tensor as one row, so groups of 4 blocks span rows (5 and 13 blocks a row), whole warps
    // of them included, and the last group of (97, 208) has one block; (1100, 4096): 2200
    // runs of 32 groups, more than the flat path's tail takes (7 CTAs an SM of 2 warps' runs:
    // 1848 on an H200's 132 SMs, 2072 on a B200's 148), so CTAs of 4 warps' runs before it
    for &(rows, cols) in &[
        (1usize, 16usize),
        (130, 48),
        (257, 2048),
        (130, 2112),
        (300, 80),
        (97, 208),
        (1100, 4096),
    ] {
        let x = activations(&mut r, rows * cols);
        let bits = to_bf16_bits(&x);
        let gs = 2688.0 / x.iter().fold(0f32, |m, v| m.max(v.abs()));
        let (want, wst) = nvfp4::quantize_nvfp4(&x, rows, cols, gs);
        for layout in [ScaleLayout::Linear, ScaleLayout::Swizzled] {
            let (q, st) =
                quant::quantize_nvfp4_bf16(&g, &bits, rows, cols, gs, Flavor::Reference, layout)
                    .unwrap();
            assert_eq!(st, wst, "seed {seed} [{rows},{cols}] {layout:?}: stats");
            let host = q.to_host(&g).unwrap();
            assert_eq!(
                host.packed, want.packed,
                "seed {seed} [{rows},{cols}] {layout:?}: codes"
            );
            assert_eq!(
                host.scales, want.scales,
                "seed {seed} [{rows},{cols}] {layout:?}: scales"
            );
            if layout == ScaleLayout::Swizzled {
                let raw = q.raw_scales(&g).unwrap();
                assert_eq!(
                    raw,
                    layout::swizzle(&want.scales, rows, cols / 16),
                    "seed {seed}: swizzled bytes incl. zero padding"
                );
            }
        }
    }
}

#[test]
#[ignore = "needs a GPU (.ci/gpu-nightly)"]
fn cuda_fast_flavor_flips_few_codes() {
    let b = backend();
    let g = b.gpu().clone();
    let (mut r, seed) = rng("cuda_fast_flavor_flips_few_codes");
    let (rows, cols) = (512, 4096);
    let x = activations(&mut r, rows * cols);
    let gs = 2688.0 / x.iter().fold(0f32, |m, v| m.max(v.abs()));
    // BF16 activations, f32 activations, and global scales that are not 2688/amax
    let f32_rows = normal(&mut r, rows * cols, 0.7);
    let layer_rows = hidden(&mut r, rows, cols);
    let datasets: [(&str, &[f32]); 3] = [
        ("bf16 activations", &x),
        ("f32 normal", &f32_rows),
        ("bf16 hidden with outlier channels", &layer_rows),
    ];
    for (what, data) in datasets {
        let amax = data.iter().fold(0f32, |m, v| m.max(v.abs()));
        for mult in [1.0f32, 1.0 + 1.0 / 64.0, 0.37, 3.3] {
            let g = 2688.0 / amax * mult;
            let flips = quant::flavor_flips(b.gpu(), data, rows, cols, g).unwrap();
            let rate = flips.codes as f64 / flips.total_codes as f64;
            eprintln!(
                "cuda-fast vs reference [{what}, gs = 2688/amax x {mult}]: {} of {} codes flipped ({rate:.2e}), {} of {} scales differ",
                flips.codes, flips.total_codes, flips.scales, flips.total_scales
            );
            assert!(rate < 1e-2, "seed {seed}: flip rate {rate}");
            if flips.codes + flips.scales > 0 {
                let n = check_flips_are_ties(&b, data, rows, cols, g, seed);
                assert!(
                    n > 0,
                    "seed {seed}: the host sees no flip where the kernel counted some"
                );
            }
        }
    }
    // the fast flavor through the trait, and a flip count that can see a difference at all
    let flips = quant::flavor_flips(&g, &x, rows, cols, gs * 3.3).unwrap();
    let gs = gs * 3.3;
    let (fast, _) = b.quantize(&x, rows, cols, gs, Flavor::CudaFast).unwrap();
    let (refq, _) = nvfp4::quantize_nvfp4(&x, rows, cols, gs);
    let mut n = 0u64;
    for (a, c) in fast.packed.iter().zip(&refq.packed) {
        n += ((a ^ c) & 0xF != 0) as u64 + ((a ^ c) >> 4 != 0) as u64;
    }
    assert_eq!(
        n, flips.codes,
        "seed {seed}: the flip kernel counts what the host sees"
    );
    let d = g.upload(&x, "x").unwrap();
    let a = quant::quantize_nvfp4_dev(
        &g,
        DevRows::F32(&d),
        rows,
        cols,
        gs,
        Flavor::Reference,
        ScaleLayout::Linear,
    )
    .unwrap();
    let mut y = x.clone();
    // the sign alone: its code's sign bit flips whatever the magnitude rounds to (DESIGN.md
    // §2); -3x + 1 kept the code of an x near 0.25 (seed 511534306189530444 in s37a: 0.244 ->
    // 0.268, the same code under the same scale)
    y[5] = -y[5];
    let d2 = g.upload(&y, "y").unwrap();
    let c = quant::quantize_nvfp4_dev(
        &g,
        DevRows::F32(&d2),
        rows,
        cols,
        gs,
        Flavor::Reference,
        ScaleLayout::Linear,
    )
    .unwrap();
    assert!(
        quant::count_flips_dev(&g, &a, &c).unwrap().codes > 0,
        "seed {seed}"
    );
}

/// Is `v` within `ulps` of `target` (same sign)?
fn near(v: f32, target: f32, ulps: i64) -> bool {
    v == target
        || (v.signum() == target.signum()
            && (v.to_bits() as i64 - target.to_bits() as i64).abs() <= ulps)
}

/// Every code where the flavors differ must sit at a rounding tie of the reference (or a few
/// ulps from one): the fast flavor's reciprocals are off by an ulp or two, nothing else.
/// Blocks whose scale differs must have the reference's unrounded scale at an E4M3 midpoint.
/// Prints the first few flips with the reference's intermediate values. Returns the count.
fn check_flips_are_ties(
    b: &nvfp4dbg::backend::cuda::CudaBackend,
    x: &[f32],
    rows: usize,
    cols: usize,
    gs: f32,
    seed: u64,
) -> usize {
    const TIES: [f32; 7] = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0];
    let (f, _) = b.quantize(x, rows, cols, gs, Flavor::CudaFast).unwrap();
    let (q, _) = b.quantize(x, rows, cols, gs, Flavor::Reference).unwrap();
    let mut shown = 0;
    let mut flips = 0;
    for blk in 0..rows * cols / 16 {
        let xs = &x[blk * 16..blk * 16 + 16];
        let vmax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
        let sf = gs * (vmax * (1.0f32 / 6.0));
        if f.scales[blk] != q.scales[blk] {
            let (lo, hi) = (
                e4m3::decode(q.scales[blk] & 0x7F),
                e4m3::decode(f.scales[blk] & 0x7F),
            );
            let mid = (lo + hi) / 2.0;
            assert!(
                near(sf, mid, 4),
                "seed {seed}: block {blk} scale {:#x} vs {:#x} but sf {sf:e} is no E4M3 tie",
                q.scales[blk],
                f.scales[blk]
            );
            flips += 1;
            continue;
        }
        let s = e4m3::decode(q.scales[blk]);
        let out_scale = nvfp4::rcp(s * nvfp4::rcp(gs));
        for (j, &xj) in xs.iter().enumerate() {
            let (r, c) = (blk * 16 / cols, (blk * 16) % cols + j);
            let (cf, cq) = (f.code(r, c), q.code(r, c));
            if cf == cq {
                continue;
            }
            flips += 1;
            let v = (xj * out_scale).abs();
            if shown < 3 {
                shown += 1;
                eprintln!(
                    "  block {blk} elem {j}: x {xj:e} gs {gs:e} vmax {vmax:e} sf {sf:e} scale {:#04x} out_scale {out_scale:e} x*out_scale {:.9} code ref {cq:#x} fast {cf:#x}",
                    q.scales[blk],
                    xj * out_scale
                );
            }
            assert!(
                TIES.iter().any(|&t| near(v, t, 4)),
                "seed {seed}: block {blk} elem {j}: x*out_scale = {v} is no E2M1 tie, yet the flavors differ (ref {cq:#x}, fast {cf:#x})"
            );
        }
    }
    flips
}

#[test]
#[ignore = "needs a GPU (.ci/gpu-nightly)"]
fn mxfp4_is_bit_exact() {
    let g = gpu();
    let (mut r, seed) = rng("mxfp4_is_bit_exact");
    for &(rows, cols) in &[(1usize, 32usize), (77, 320), (256, 4096)] {
        let mut x = activations(&mut r, rows * cols);
        x[0] = 0.0;
        if x.len() > 64 {
            for v in &mut x[32..64] {
                *v = 0.0;
            }
        }
        let (want, wst) = nvfp4::quantize_mxfp4(&x, rows, cols);
        let (got, gst) = quant::quantize_mxfp4(&g, &x, rows, cols).unwrap();
        assert_eq!(wst, gst, "seed {seed} [{rows},{cols}]: stats");
        assert_eq!(
            want.scales, got.scales,
            "seed {seed} [{rows},{cols}]: scales"
        );
        let (nd, first) = diff(&want.packed, &got.packed);
        assert_eq!(
            nd, 0,
            "seed {seed} [{rows},{cols}]: {nd} bytes differ {first:x?}"
        );
    }
}

#[test]
#[ignore = "needs a GPU (.ci/gpu-nightly)"]
fn swizzle_kernels_match_the_layout_module() {
    let g = gpu();
    let (mut r, seed) = rng("swizzle_kernels_match_the_layout_module");
    for &(rows, kb) in &[
        (1usize, 1usize),
        (7, 3),
        (129, 5),
        (300, 14),
        (128, 4),
        (256, 448),
    ] {
        let lin: Vec<u8> = (0..rows * kb).map(|_| r.gen_range(1..=255)).collect();
        let want = layout::swizzle(&lin, rows, kb);
        let got = quant::swizzle_scales(&g, &lin, rows, kb).unwrap();
        assert_eq!(got, want, "seed {seed} [{rows},{kb}] swizzle");
        let back = quant::unswizzle_scales(&g, &got, rows, kb).unwrap();
        assert_eq!(back, lin, "seed {seed} [{rows},{kb}] unswizzle");
    }
}

#[test]
#[ignore = "needs a GPU (.ci/gpu-nightly)"]
fn compare_matches_metrics_compare() {
    let b = backend();
    let (mut r, seed) = rng("compare_matches_metrics_compare");
    for &n in &[1usize, 1000, 8192, 8193, 1_000_003] {
        let reference = normal(&mut r, n, 1.0);
        let mut test: Vec<f32> = reference
            .iter()
            .map(|v| v + 0.01 * v.abs() * r.gen_range(-1.0f32..1.0))
            .collect();
        let clean = b.compare(&test, &reference).unwrap();
        let want = metrics::compare(&test, &reference);
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * b.abs().max(1e-300) || a == b;
        assert!(
            close(clean.cosine, want.cosine),
            "seed {seed} n {n}: cosine {} vs {}",
            clean.cosine,
            want.cosine
        );
        assert!(
            close(clean.rel_l2, want.rel_l2),
            "seed {seed} n {n}: rel_l2 {} vs {}",
            clean.rel_l2,
            want.rel_l2
        );
        assert!(
            close(clean.sqnr_db, want.sqnr_db),
            "seed {seed} n {n}: sqnr"
        );
        assert_eq!(clean.max_abs_err, want.max_abs_err, "seed {seed} n {n}");
        assert_eq!(
            clean.max_abs_err_index, want.max_abs_err_index,
            "seed {seed} n {n}"
        );
        assert_eq!((clean.nan_count, clean.inf_count, clean.len), (0, 0, n));
        if n > 100 {
            let nans = [r.gen_range(0..n), r.gen_range(0..n)];
            let inf = r.gen_range(0..n);
            for &i in &nans {
                test[i] = f32::NAN;
            }
            test[inf] = f32::INFINITY;
            let got = b.compare(&test, &reference).unwrap();
            let want = metrics::compare(&test, &reference);
            assert_eq!(
                (got.nan_count, got.inf_count),
                (want.nan_count, want.inf_count),
                "seed {seed}"
            );
            assert_eq!(
                (got.first_nan, got.first_inf),
                (want.first_nan, want.first_inf),
                "seed {seed}"
            );
            assert!(got.cosine.is_nan() && !got.passes(0.0));
            // two equal maxima (the lower index wins), then NaNs in the reference as well (a
            // NaN difference ranks above every number, the first one its index): the GPU's
            // merge order gives what the CPU's pass does
            let (mut t2, mut r2) = (reference.clone(), reference.clone());
            t2.iter_mut()
                .for_each(|v| *v += 0.01 * r.gen_range(-1.0f32..1.0));
            let (p, q) = (r.gen_range(0..n), r.gen_range(0..n));
            for i in [p, q] {
                (t2[i], r2[i]) = (64.5, 0.5);
            }
            let nans: Vec<usize> = (0..3).map(|_| r.gen_range(0..n)).collect();
            for step in 0..2 {
                if step == 1 {
                    nans.iter().for_each(|&i| r2[i] = f32::NAN);
                }
                let got = b.compare(&t2, &r2).unwrap();
                let want = metrics::compare(&t2, &r2);
                let at = if step == 0 {
                    p.min(q)
                } else {
                    *nans.iter().min().unwrap()
                };
                assert_eq!(
                    want.max_abs_err_index,
                    Some(at),
                    "seed {seed} n {n} step {step}: the CPU"
                );
                assert_eq!(
                    want.max_abs_err.is_nan(),
                    step == 1,
                    "seed {seed} n {n} step {step}"
                );
                assert_eq!(
                    got.max_abs_err_index,
                    Some(at),
                    "seed {seed} n {n} step {step}: the GPU"
                );
                assert!(
                    same_max(got.max_abs_err, want.max_abs_err),
                    "seed {seed} n {n} step {step}: {} vs {}",
                    got.max_abs_err,
                    want.max_abs_err
                );
            }
        }
    }
    // the GPU and the CPU agree on which of two near-identical tensors is better
    let reference = normal(&mut r, 4096, 1.0);
    let test: Vec<f32> = reference.iter().map(|v| v * 0.5).collect();
    let m = reduce::compare(b.gpu(), &test, &reference).unwrap();
    assert!(
        (m.cosine - 1.0).abs() < 1e-12 && (m.rel_l2 - 0.5).abs() < 1e-9,
        "seed {seed}: {m:?}"
    );
}

/// The bulk BF16 quantizer and the grid one against each other and the CPU reference: codes,
/// scales and statistics, special blocks planted, both flavors.
#[test]
#[ignore = "needs a GPU (.ci/gpu-nightly)"]
fn nvfp4_bulk_quantizer_matches_the_grid_kernel_and_the_reference() {
    use quant::{Bf16Kernel, DevFp4};
    let g = gpu();
    let (mut r, seed) = rng("nvfp4_bulk_quantizer_matches_the_grid_kernel_and_the_reference");
    // bulk: fewer blocks than warps (one partial round of tiles); two rounds; many (the
    // bench's [8192, 7168]: 15 tiles per warp on an H200, the 2-slot rings wrap 7 times).
    // grid, where its warps load warp-wide (rows of whole 64-value groups): one part-full
    // warp ([5, 192], per-thread loads), whole warps ([257, 2048]), a part-full last warp
    // ([1031, 7168]), the bench's shape
    for &(rows, cols) in &[
        (1usize, 16usize),
        (3, 48),
        (130, 48),
        (5, 192),
        (300, 80),
        (97, 208),
        (257, 2048),
        (1031, 7168),
        (8192, 7168),
    ] {
        let mut x = activations(&mut r, rows * cols);
        let blocks = rows * cols / 16;
        // whole-zero, flushed, infinite, NaN and exact-tie blocks at random places
        for _ in 0..blocks.div_ceil(64) {
            let b = r.gen_range(0..blocks) * 16;
            let kind = r.gen_range(0..5);
            for (i, v) in x[b..b + 16].iter_mut().enumerate() {
                *v = match kind {
                    0 => 0.0,
                    1 => (i as f32 - 8.0) * 1e-30,
                    2 if i == 3 => f32::INFINITY,
                    3 if i == 5 => f32::NAN,
                    4 => [0.25f32, -0.75, 1.25, -1.75, 2.5, -3.5, 5.0, -6.0][i % 8],
                    _ => *v,
                };
            }
        }
        // the kernels read BF16: the reference quantizes the same values
        for v in &mut x {
            *v = bf16_round(*v);
        }
        let bits = to_bf16_bits(&x);
        let amax = x
            .iter()
            .filter(|v| v.is_finite())
            .fold(0f32, |m, v| m.max(v.abs()));
        let gs_v = 2688.0 / amax;
        let d = g.upload(&bits, "the input rows").unwrap();
        let gs = g.upload(&[gs_v], "the global scale").unwrap();
        for flavor in [Flavor::Reference, Flavor::CudaFast] {
            let mut got = Vec::new();
            for k in [Bf16Kernel::Grid, Bf16Kernel::Bulk] {
                let out = DevFp4::alloc_nvfp4(&g, rows, cols, ScaleLayout::Linear).unwrap();
                quant::enqueue_quantize_nvfp4_bf16_with(&g, &d, &gs, flavor, &out, k).unwrap();
                got.push((out.to_host(&g).unwrap(), out.block_stats(&g).unwrap()));
            }
            let what = format!("seed {seed} [{rows},{cols}] {flavor:?}");
            let ((grid, gst), (bulk, bst)) = (&got[0], &got[1]);
            assert_eq!(gst, bst, "{what}: block stats");
            assert_eq!(bst.blocks, blocks as u64, "{what}: every block counted");
            let (n, first) = diff(&grid.scales, &bulk.scales);
            assert_eq!(
                n, 0,
                "{what}: {n} scales differ (block, grid, bulk): {first:?}"
            );
            let (n, first) = diff(&grid.packed, &bulk.packed);
            assert_eq!(
                n, 0,
                "{what}: {n} code bytes differ (byte, grid, bulk): {first:?}"
            );
            if flavor == Flavor::Reference {
                let (want, wst) = nvfp4::quantize_nvfp4(&x, rows, cols, gs_v);
                assert_eq!(wst, *bst, "{what}: stats vs the CPU reference");
                assert_eq!(
                    want.scales, bulk.scales,
                    "{what}: scales vs the CPU reference"
                );
                for blk in (0..blocks).filter(|&b| !e4m3::is_nan(want.scales[b])) {
                    assert_eq!(
                        want.packed[blk * 8..blk * 8 + 8],
                        bulk.packed[blk * 8..blk * 8 + 8],
                        "{what}: block {blk} codes vs the CPU reference"
                    );
                }
            }
        }
        eprintln!(
            "bulk quantizer: [{rows}, {cols}] identical to the grid kernel and the CPU reference"
        );
    }
}
