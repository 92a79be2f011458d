//! `nvfp4dbg quantize` against an independent Python quantizer (tools/golden/make_golden.py,
//! numpy + ml_dtypes, written from DESIGN.md §2): bit-identical on committed adversarial files,
//! and on fresh random data when python + ml_dtypes are available.

mod checkpoint_util;
use checkpoint_util::*;
use nvfp4dbg::checkpoint::TensorFile;
use nvfp4dbg::nvfp4::e4m3;
use rand::Rng;
use std::path::{Path, PathBuf};
use std::process::Command;

fn golden_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/golden")
}

/// Same tensor names, dtypes, shapes and bytes; the first differing byte is reported.
fn assert_same_tensors(got: &Path, want: &Path, ctx: &str) {
    let g = TensorFile::open(got).unwrap();
    let w = TensorFile::open(want).unwrap();
    let mut gn: Vec<&str> = g.names().collect();
    let mut wn: Vec<&str> = w.names().collect();
    gn.sort();
    wn.sort();
    assert_eq!(gn, wn, "{ctx}: tensor names");
    for n in wn {
        let (gi, wi) = (g.info(n).unwrap(), w.info(n).unwrap());
        assert_eq!((gi.dtype, &gi.shape), (wi.dtype, &wi.shape), "{ctx}: {n}");
        let (gb, wb) = (g.bytes(n).unwrap(), w.bytes(n).unwrap());
        if let Some(i) = gb.iter().zip(wb).position(|(a, b)| a != b) {
            panic!(
                "{ctx}: tensor {n} differs at byte {i} of {}: nvfp4dbg {:#04x}, python {:#04x}",
                wb.len(),
                gb[i],
                wb[i]
            );
        }
    }
}

fn quantize(input: &Path, out: &Path, extra: &[&str]) {
    let mut args = vec!["quantize", p(input), p(out)];
    args.extend_from_slice(extra);
    let o = run(&args);
    assert_eq!(code(&o), 0, "quantize {extra:?}: {}", stderr(&o));
}

#[test]
fn committed_golden_files_are_bit_identical() {
    let g = golden_dir();
    let d = tempfile::tempdir().unwrap();
    let input = g.join("input.safetensors");
    for (expected, extra) in [
        ("expected_nvfp4.safetensors", vec![]),
        ("expected_nvfp4_gs1024.safetensors", vec!["--gs", "1024"]),
        ("expected_nvfp4_gs0.75.safetensors", vec!["--gs", "0.75"]),
        ("expected_mxfp4.safetensors", vec!["--format", "mxfp4"]),
    ] {
        let out = d.path().join(expected);
        quantize(&input, &out, &extra);
        assert_same_tensors(&out, &g.join(expected), expected);
    }
}

/// The committed data must exercise what it claims to: saturated, subnormal and zero block
/// scales, and negative values rounding to the signed zero code 0x8.
#[test]
fn golden_data_is_adversarial() {
    let w = TensorFile::open(&golden_dir().join("expected_nvfp4.safetensors")).unwrap();
    let base = "model.layers.0.mlp.experts.0.gate_proj";
    let s = w.bytes(&format!("{base}.weight_scale")).unwrap();
    let packed = w.bytes(&format!("{base}.weight")).unwrap();
    assert!(
        s.iter().filter(|&&c| c == e4m3::MAX_CODE).count() >= 3,
        "saturated scales"
    );
    assert!(
        s.iter().filter(|&&c| c > 0 && c < 8).count() >= 5,
        "subnormal scales"
    );
    let zero_blocks_with_data = s
        .iter()
        .enumerate()
        .filter(|(b, &c)| c == 0 && packed[b * 8..b * 8 + 8].iter().any(|&x| x != 0))
        .count();
    assert!(
        zero_blocks_with_data >= 1,
        "a zero-scale block with signed zeros"
    );
    let neg_zero = packed
        .iter()
        .flat_map(|&b| [b & 0xF, b >> 4])
        .filter(|&c| c == 8)
        .count();
    assert!(neg_zero >= 20, "signed zero codes: {neg_zero}");
    assert_eq!(
        w.scalar_f32(&format!("{base}.weight_scale_2")).unwrap(),
        10.5 / 2688.0
    );
}

fn python_quantize(py: &str, input: &Path, out: &Path, extra: &[&str]) {
    let o = Command::new(py)
        .arg(golden_script())
        .args(["quantize", p(input), p(out)])
        .args(extra)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "python: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

#[test]
fn fresh_random_bf16_matches_python_live() {
    let Some(py) = python_with_ml_dtypes() else {
        eprintln!("NOTE: python3 with numpy + ml_dtypes not importable; skipping the live golden comparison (pip install numpy ml_dtypes)");
        return;
    };
    let (_, mut r) = rng("live golden");
    let d = tempfile::tempdir().unwrap();
    let input = d.path().join("in.safetensors");
    let mut tensors = vec![];
    for t in 0..4 {
        let (rows, cols) = (r.gen_range(1..64), 32 * r.gen_range(1..12));
        let mut v = weights(&mut r, rows, cols);
        // sprinkle exact E2M1 ties, zeros and tiny negatives at the tensor's scale
        let u = 2f32.powi(r.gen_range(-12..2));
        for x in v.iter_mut() {
            match r.gen_range(0..20) {
                0 => *x = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0][r.gen_range(0..7)] * u,
                1 => *x = -0.0,
                2 => *x = -1e-3 * u,
                _ => {}
            }
            *x = half::bf16::from_f32(*x).to_f32();
        }
        tensors.push(bf16(
            &format!("model.layers.{t}.mlp.experts.0.down_proj.weight"),
            &[rows, cols],
            &v,
        ));
    }
    let v = weights(&mut r, 8, 64);
    tensors.push(f32t("model.layers.9.self_attn.o_proj.weight", &[8, 64], &v));
    tensors.push(bf16("model.norm.weight", &[64], &v[..64]));
    write(&input, tensors);
    let gs = format!("{}", r.gen_range(1..1 << 16) as f32 / 64.0);
    for extra in [vec![], vec!["--gs", gs.as_str()], vec!["--format", "mxfp4"]] {
        let (a, b) = (
            d.path().join("rust.safetensors"),
            d.path().join("py.safetensors"),
        );
        quantize(&input, &a, &extra);
        python_quantize(&py, &input, &b, &extra);
        assert_same_tensors(&a, &b, &format!("live {extra:?}"));
    }
}
