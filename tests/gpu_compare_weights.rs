//! compare-weights' GPU diff against the CPU reference: the CUDA engine on random quantized
//! and float views (every dtype, TP-strided rows, tensors larger than the staging buffer), the
//! real binary with `--device cuda` vs `--device cpu` on fresh synthetic checkpoints with
//! every planted fault, and the early out-of-memory exit of layertest. GPU tests are
//! `#[ignore]` (run by .ci/gpu-nightly); the no-GPU test runs in CPU CI.
//!
//! Tolerance: dequantized values are bit-identical, so counts, first indices, `max_abs_err`
//! and its index must be equal; `cosine`, `rel_l2` and `sqnr_db` come from f64 sums in
//! another order and may differ by ~1e-12 relative: 1e-9 is allowed.

mod common;
mod gpu_common;

use common::binary;
use nvfp4dbg::metrics::Metrics;
use nvfp4dbg::nvfp4::Format;
use nvfp4dbg::weights::compare::{DView, Values};
use nvfp4dbg::weights::engine::{CpuDiff, CudaDiff, DiffEngine};
use nvfp4dbg::weights::view::{Mat, QMatrix};
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, StandardNormal};
use safetensors::Dtype;
use serde_json::Value;
use std::borrow::Cow;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

const TOL: f64 = 1e-9;

fn close(a: f64, b: f64) -> bool {
    (a.is_nan() && b.is_nan()) || a == b || (a - b).abs() <= TOL * a.abs().max(b.abs()).max(1.0)
}

fn same_metrics(cpu: &Metrics, gpu: &Metrics, what: &str) {
    assert_eq!(cpu.len, gpu.len, "{what}: len");
    assert_eq!(
        (cpu.nan_count, cpu.inf_count, cpu.first_nan, cpu.first_inf),
        (gpu.nan_count, gpu.inf_count, gpu.first_nan, gpu.first_inf),
        "{what}: non-finite counts"
    );
    assert!(
        gpu_common::same_max(cpu.max_abs_err, gpu.max_abs_err),
        "{what}: max_abs_err {} vs {}",
        cpu.max_abs_err,
        gpu.max_abs_err
    );
    assert_eq!(
        cpu.max_abs_err_index, gpu.max_abs_err_index,
        "{what}: max_abs_err_index"
    );
    for (name, c, g) in [
        ("cosine", cpu.cosine, gpu.cosine),
        ("rel_l2", cpu.rel_l2, gpu.rel_l2),
        ("sqnr_db", cpu.sqnr_db, gpu.sqnr_db),
    ] {
        assert!(close(c, g), "{what}: {name} cpu {c:e} gpu {g:e}");
    }
}

fn both(cpu: &CpuDiff, gpu: &CudaDiff, a: &Values, b: &Values, what: &str) {
    let t = Instant::now();
    let mc = cpu.metrics(a, b).unwrap();
    let tc = t.elapsed();
    let t = Instant::now();
    let mg = gpu.metrics(a, b).unwrap();
    let tg = t.elapsed();
    eprintln!(
        "{what}: {} values, cpu {:.1} ms, gpu {:.1} ms",
        a.len(),
        tc.as_secs_f64() * 1e3,
        tg.as_secs_f64() * 1e3
    );
    match (mc, mg) {
        (Some(c), Some(g)) => same_metrics(&c, &g, what),
        (None, None) => {}
        (c, g) => panic!("{what}: cpu {c:?} gpu {g:?}"),
    }
}

/// Random packed FP4: the reference never NaN (a NaN in A makes max_abs_err depend on the
/// summation split, on the CPU alone as well), the test with NaN scales when `nan`.
fn fp4(
    r: &mut ChaCha8Rng,
    format: Format,
    rows: usize,
    cols: usize,
    nan: bool,
) -> (Vec<u8>, Vec<u8>) {
    let packed = (0..rows * cols / 2).map(|_| r.gen()).collect();
    let scales = (0..rows * cols / format.block())
        .map(|_| match format {
            Format::Nvfp4 if nan && r.gen_bool(0.001) => 0x7F,
            Format::Nvfp4 => r.gen_range(0x20..0x60u8) | if r.gen_bool(0.1) { 0x80 } else { 0 },
            Format::Mxfp4 if nan && r.gen_bool(0.001) => 0xFF,
            Format::Mxfp4 => r.gen_range(100..140u8),
        })
        .collect();
    (packed, scales)
}

/// Flip a few codes of `packed` (a test side that is close but not equal).
fn perturb(r: &mut ChaCha8Rng, packed: &[u8], rate: f64) -> Vec<u8> {
    packed
        .iter()
        .map(|&b| {
            if r.gen_bool(rate) {
                b ^ r.gen_range(1..16u8)
            } else {
                b
            }
        })
        .collect()
}

fn encode(dtype: Dtype, v: &[f32]) -> Vec<u8> {
    match dtype {
        Dtype::BF16 => v
            .iter()
            .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
            .collect(),
        Dtype::F16 => v
            .iter()
            .flat_map(|x| half::f16::from_f32(*x).to_le_bytes())
            .collect(),
        Dtype::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        Dtype::F64 => v.iter().flat_map(|x| (*x as f64).to_le_bytes()).collect(),
        // E4M3 / E5M2: nearest code by search is slow; any byte is a value, take the bits of
        // the BF16 top byte (E5M2 is the top byte of an F16)
        Dtype::F8_E5M2 => v
            .iter()
            .map(|x| (half::f16::from_f32(*x).to_bits() >> 8) as u8)
            .collect(),
        Dtype::F8_E4M3 => v
            .iter()
            .map(|x| {
                let b = (x.abs().clamp(0.0, 400.0) * 8.0) as u8 & 0x7E;
                b | if *x < 0.0 { 0x80 } else { 0 }
            })
            .collect(),
        _ => unreachable!(),
    }
}

#[test]
#[ignore = "needs a GPU"]
fn cuda_engine_matches_the_cpu_on_every_path() {
    let (mut r, seed) = gpu_common::rng("cuda_engine_matches_the_cpu_on_every_path");
    let gpu = CudaDiff::open(0).unwrap_or_else(|e| panic!("GPU test without a usable GPU: {e}"));
    let cpu = CpuDiff;
    eprintln!("engine: {}", gpu.name());
    // quantized pairs: small and odd, a DeepSeek expert, and one larger than the stage
    let shapes = [
        (1usize, 64usize),
        (r.gen_range(1..300), 32 * r.gen_range(1..20)),
        (2048, 7168),
        (20_000, 7168),
    ];
    for (k, &(rows, cols)) in shapes.iter().enumerate() {
        for format in [Format::Nvfp4, Format::Mxfp4] {
            // B: A's codes with a few flipped and A's scales, or unrelated values; unrelated,
            // A holds NaN scales too (NaN differences, which take the maximum from every
            // number whatever order the GPU merges in)
            let related = k % 2 == 0;
            let (pa, sa) = fp4(&mut r, format, rows, cols, !related);
            let (pb0, sb) = fp4(&mut r, format, rows, cols, true);
            let pb = if related {
                perturb(&mut r, &pa, 0.01)
            } else {
                pb0
            };
            let sb = if related { sa.clone() } else { sb };
            let qa = QMatrix {
                format,
                rows,
                cols,
                packed: Mat::dense(&pa, rows, cols / 2).unwrap(),
                scales: Cow::Borrowed(&sa),
                scale_2: if format == Format::Nvfp4 {
                    r.gen_range(1e-4..1e-2)
                } else {
                    1.0
                },
            };
            let qb = QMatrix {
                packed: Mat::dense(&pb, rows, cols / 2).unwrap(),
                scales: Cow::Borrowed(&sb),
                ..qa.clone()
            };
            let what = format!("seed {seed}: {format:?} [{rows}, {cols}]");
            both(&cpu, &gpu, &Values::Q(&qa), &Values::Q(&qb), &what);
            // TP shards: a row slice, and a column slice (strided rows in the map)
            if rows >= 2 && cols >= 4 * format.block() {
                let (r0, n) = (rows / 2, rows - rows / 2);
                let (a2, b2) = (qa.rows_slice(r0, n).unwrap(), qb.rows_slice(r0, n).unwrap());
                both(
                    &cpu,
                    &gpu,
                    &Values::Q(&a2),
                    &Values::Q(&b2),
                    &format!("{what} rows"),
                );
                let c0 = format.block() * (cols / format.block() / 2);
                let (a3, b3) = (
                    qa.cols_slice(c0, cols - c0).unwrap(),
                    qb.cols_slice(c0, cols - c0).unwrap(),
                );
                both(
                    &cpu,
                    &gpu,
                    &Values::Q(&a3),
                    &Values::Q(&b3),
                    &format!("{what} cols"),
                );
            }
            // a quantized side against a float one (an engine that dequantized at load)
            if rows * cols <= 1 << 24 {
                let deq: Vec<f32> = qa.dequantize();
                let bf = encode(Dtype::BF16, &deq);
                let d = DView {
                    mat: Mat::dense(&bf, rows, cols * 2).unwrap(),
                    dtype: Dtype::BF16,
                };
                both(
                    &cpu,
                    &gpu,
                    &Values::Q(&qa),
                    &Values::D(d),
                    &format!("{what} vs BF16"),
                );
                both(
                    &cpu,
                    &gpu,
                    &Values::D(d),
                    &Values::Q(&qb),
                    &format!("BF16 vs {what}"),
                );
            }
        }
    }
    // float pairs of every dtype the CPU decodes, mixed dtypes, with NaN / Inf in B
    let dtypes = [
        Dtype::BF16,
        Dtype::F16,
        Dtype::F32,
        Dtype::F64,
        Dtype::F8_E4M3,
        Dtype::F8_E5M2,
    ];
    for &(rows, cols) in &[(1usize, 1usize), (37, 129), (1, 40_000_000), (4096, 7168)] {
        let n = rows * cols;
        let a: Vec<f32> = (0..n)
            .map(|_| {
                let g: f32 = StandardNormal.sample(&mut r);
                g * 0.05
            })
            .collect();
        let mut b: Vec<f32> = a
            .iter()
            .map(|x| {
                let g: f32 = StandardNormal.sample(&mut r);
                x + g * 1e-3
            })
            .collect();
        for _ in 0..(n / 100_000).max(1) {
            let i = r.gen_range(0..n);
            b[i] = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY][r.gen_range(0..3)];
        }
        for _ in 0..3 {
            let (da, db) = (
                dtypes[r.gen_range(0..dtypes.len())],
                dtypes[r.gen_range(0..dtypes.len())],
            );
            let (ba, bb) = (encode(da, &a), encode(db, &b));
            let (ea, eb) = (da.bitsize() / 8, db.bitsize() / 8);
            let va = DView {
                mat: Mat::dense(&ba, rows, cols * ea).unwrap(),
                dtype: da,
            };
            let vb = DView {
                mat: Mat::dense(&bb, rows, cols * eb).unwrap(),
                dtype: db,
            };
            let what = format!("seed {seed}: {da:?} vs {db:?} [{rows}, {cols}]");
            both(&cpu, &gpu, &Values::D(va), &Values::D(vb), &what);
            if cols >= 3 {
                // a column slice of both: strided rows
                let w = cols - cols / 3;
                let sa = DView {
                    mat: va.mat.slice_cols(ea * (cols / 3), ea * w).unwrap(),
                    dtype: da,
                };
                let sb = DView {
                    mat: vb.mat.slice_cols(eb * (cols / 3), eb * w).unwrap(),
                    dtype: db,
                };
                both(
                    &cpu,
                    &gpu,
                    &Values::D(sa),
                    &Values::D(sb),
                    &format!("{what} cols"),
                );
            }
        }
    }
    // element counts that differ, and an integer dtype: None from both
    let bytes = vec![1u8; 64];
    let ints = DView {
        mat: Mat::dense(&bytes, 4, 16).unwrap(),
        dtype: Dtype::I32,
    };
    assert!(gpu
        .metrics(&Values::D(ints), &Values::D(ints))
        .unwrap()
        .is_none());
    let short = DView {
        mat: Mat::dense(&bytes[..32], 4, 8).unwrap(),
        dtype: Dtype::F32,
    };
    let long = DView {
        mat: Mat::dense(&bytes, 4, 16).unwrap(),
        dtype: Dtype::F32,
    };
    assert!(gpu
        .metrics(&Values::D(short), &Values::D(long))
        .unwrap()
        .is_none());
}

// ---------------------------------------------------------------------------------------

struct Run {
    code: i32,
    json: Value,
    stderr: String,
    seconds: f64,
}

fn nvfp4dbg(dir: &Path, args: &[&str]) -> Run {
    let json = dir.join(format!("r{}.json", rand::random::<u32>()));
    let t = Instant::now();
    let out = Command::new(binary())
        .args(args)
        .arg("--json")
        .arg(&json)
        .args(["--no-report-dir", "--quiet"])
        .current_dir(dir)
        .output()
        .expect("run nvfp4dbg");
    Run {
        code: out.status.code().unwrap_or(-1),
        json: std::fs::read(&json)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or(Value::Null),
        stderr: String::from_utf8_lossy(&out.stderr).into(),
        seconds: t.elapsed().as_secs_f64(),
    }
}

/// The two reports agree: every key and value, metrics within the tolerance; timings and the
/// note naming the engine aside.
fn same_report(cpu: &Value, gpu: &Value, path: &str) {
    match (cpu, gpu) {
        (Value::Object(c), Value::Object(g)) => {
            let skip = |k: &str| matches!(k, "seconds" | "gb_per_s");
            let kc: Vec<&String> = c.keys().filter(|k| !skip(k)).collect();
            let kg: Vec<&String> = g.keys().filter(|k| !skip(k)).collect();
            assert_eq!(kc, kg, "{path}: keys");
            for k in kc {
                let p = format!("{path}.{k}");
                if matches!(k.as_str(), "cosine" | "rel_l2" | "sqnr_db") {
                    let (x, y) = (c[k].as_f64(), g[k].as_f64());
                    match (x, y) {
                        (Some(x), Some(y)) => assert!(close(x, y), "{p}: cpu {x:e} gpu {y:e}"),
                        _ => assert_eq!(c[k], g[k], "{p}"),
                    }
                } else {
                    same_report(&c[k], &g[k], &p);
                }
            }
        }
        (Value::Array(c), Value::Array(g)) => {
            let keep = |v: &&Value| !v.as_str().is_some_and(|s| s.contains("diffed on"));
            let (c, g): (Vec<&Value>, Vec<&Value>) = (
                c.iter().filter(keep).collect(),
                g.iter().filter(keep).collect(),
            );
            assert_eq!(c.len(), g.len(), "{path}: length\ncpu {c:?}\ngpu {g:?}");
            for (i, (x, y)) in c.iter().zip(&g).enumerate() {
                same_report(x, y, &format!("{path}[{i}]"));
            }
        }
        (c, g) => assert_eq!(c, g, "{path}"),
    }
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
#[ignore = "needs a GPU"]
fn cuda_and_cpu_reports_agree_on_every_planted_fault() {
    let (mut r, seed) = gpu_common::rng("cuda_and_cpu_reports_agree_on_every_planted_fault");
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let synth_seed = r.gen_range(0..1_000_000u64).to_string();
    let other_seed = (r.gen_range(1_000_000..2_000_000u64)).to_string();
    let synth = |name: &str, seed: &str, plant: Option<&str>| -> PathBuf {
        let dir = root.join(name);
        let mut a = vec!["synth", "--out", s(&dir), "--seed", seed];
        if let Some(p) = plant {
            a.extend(["--plant", p]);
        }
        let o = nvfp4dbg(root, &a);
        assert_eq!(o.code, 0, "synth {name}: {}", o.stderr);
        dir
    };
    let clean = synth("clean", &synth_seed, None);
    let mut pairs: Vec<(String, PathBuf, PathBuf)> = vec![];
    for fault in [
        "nan-block-scale",
        "bad-input-scale",
        "ws2-mismatch",
        "saturated-scales",
        "missing-tensor",
        "swap-gate-up",
    ] {
        pairs.push((
            fault.into(),
            clean.clone(),
            synth(fault, &synth_seed, Some(fault)),
        ));
    }
    // every value differs: the diff runs on every unit (BF16 dense, F32, NVFP4)
    pairs.push((
        "another seed".into(),
        clean.clone(),
        synth("other", &other_seed, None),
    ));
    // BF16 originals against their NVFP4 quantization, both ways (quantized vs float)
    pairs.push(("bf16 vs nvfp4".into(), clean.join("bf16"), clean.clone()));
    pairs.push(("nvfp4 vs bf16".into(), clean.clone(), clean.join("bf16")));
    for (what, a, b) in &pairs {
        let run = |dev: &str| nvfp4dbg(root, &["compare-weights", s(a), s(b), "--device", dev]);
        let (c, g) = (run("cpu"), run("cuda"));
        eprintln!(
            "seed {seed} (synth {synth_seed}) {what}: exit {} / {}, cpu {:.2} s, cuda {:.2} s",
            c.code, g.code, c.seconds, g.seconds
        );
        assert!(c.code == 0 || c.code == 1, "{what}: cpu: {}", c.stderr);
        assert_eq!(
            c.code, g.code,
            "{what}: exit codes; cuda stderr {}",
            g.stderr
        );
        let notes = g.json["notes"].to_string();
        assert!(notes.contains("diffed on cuda:0"), "{what}: {notes}");
        same_report(&c.json, &g.json, &format!("seed {seed} {what}"));
    }
}

#[test]
#[ignore = "needs a GPU"]
fn layertest_out_of_gpu_memory_fails_fast_with_exit_2() {
    let tmp = tempfile::tempdir().unwrap();
    // 20M tokens of the tiny model: ~400 GB of forward buffers, and 20 GB of host activations
    // that must not be generated before the refusal
    let o = nvfp4dbg(
        tmp.path(),
        &["layertest", "--device", "cuda", "--tokens", "20000000"],
    );
    eprintln!("{:.2} s: {}", o.seconds, o.stderr);
    assert_eq!(o.code, 2, "{}", o.stderr);
    for want in [
        "out of GPU memory",
        "GB are free",
        "fewer --tokens",
        "20000000 tokens",
    ] {
        assert!(o.stderr.contains(want), "missing `{want}`: {}", o.stderr);
    }
    assert!(o.seconds < 30.0, "took {:.1} s", o.seconds);
    // the same for multilayer
    let o = nvfp4dbg(
        tmp.path(),
        &["multilayer", "--device", "cuda", "--tokens", "20000000"],
    );
    assert_eq!(o.code, 2, "{}", o.stderr);
    assert!(o.stderr.contains("out of GPU memory"), "{}", o.stderr);
    assert!(o.seconds < 30.0, "took {:.1} s", o.seconds);
}

/// CPU CI: `--device cuda` without a GPU is exit 2 with the reason (on a GPU machine this
/// checks nothing).
#[test]
fn compare_weights_on_cuda_without_a_gpu_is_exit_2() {
    if nvfp4dbg::backend::cuda::probe(0).is_ok() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    let seed = rand::random::<u32>().to_string();
    let o = nvfp4dbg(tmp.path(), &["synth", "--out", s(&dir), "--seed", &seed]);
    assert_eq!(o.code, 0, "{}", o.stderr);
    for dev in ["cuda", "cuda:3"] {
        let o = nvfp4dbg(
            tmp.path(),
            &["compare-weights", s(&dir), s(&dir), "--device", dev],
        );
        assert_eq!(o.code, 2, "{}", o.stderr);
        assert!(o.stderr.contains("no usable CUDA device"), "{}", o.stderr);
    }
    // without --device: the CPU, as before
    let o = nvfp4dbg(tmp.path(), &["compare-weights", s(&dir), s(&dir)]);
    assert_eq!(o.code, 0, "{}", o.stderr);
    assert!(o.json["notes"].to_string().contains("diffed on cpu"));
}
