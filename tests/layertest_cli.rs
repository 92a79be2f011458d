//! `layertest` driven through the real binary, on the built-in model and on `synth` checkpoints.

use nvfp4dbg::checkpoint::writer::{bf16_bytes, f32_bytes, i64_bytes, write_file, TensorSpec};
use safetensors::Dtype;
use serde_json::Value;
use std::path::Path;
use std::process::Command;

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_nvfp4dbg"))
}

/// Run the binary in `dir`; returns (exit code, stdout+stderr, JSON report if written).
fn run(dir: &Path, args: &[&str]) -> (i32, String, Option<Value>) {
    let json = dir.join(format!("report-{}.json", rand::random::<u32>()));
    let mut cmd = bin();
    cmd.current_dir(dir).args(args).args([
        "--json",
        json.to_str().unwrap(),
        "--no-report-dir",
        "--quiet",
    ]);
    let out = cmd.output().expect("run nvfp4dbg");
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    let report = std::fs::read(&json)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok());
    (out.status.code().unwrap_or(-1), text, report)
}

/// `h` as the F32 `hidden_states [t, 256]` of `dir/in.safetensors` (the builtin model's width).
fn write_hidden(dir: &Path, h: &[f32], t: usize) {
    let spec = TensorSpec::new("hidden_states", Dtype::F32, &[t, 256]);
    write_file(
        &dir.join("in.safetensors"),
        vec![(spec, f32_bytes(h))],
        None,
    )
    .unwrap();
}

fn synth(dir: &Path, out: &str, extra: &[&str]) {
    let mut args = vec!["synth", "--out", out];
    args.extend_from_slice(extra);
    let (code, text, _) = run(dir, &args);
    assert_eq!(code, 0, "synth {extra:?} failed:\n{text}");
}

#[test]
fn builtin_model_passes_with_plausible_numbers() {
    let seed = rand::random::<u16>().to_string();
    let dir = tempfile::tempdir().unwrap();
    let (code, text, r) = run(
        dir.path(),
        &[
            "layertest",
            "--device",
            "cpu",
            "--tokens",
            "32",
            "--seed",
            &seed,
        ],
    );
    assert_eq!(code, 0, "seed {seed}:\n{text}");
    let r = r.unwrap();
    assert_eq!(r["verdict"], "pass");
    let s = &r["summary"];
    let cos = s["cosine"].as_f64().unwrap();
    let rel = s["rel_l2"].as_f64().unwrap();
    // a fully quantized MoE layer: well below 1, well above a broken one
    assert!(cos > 0.95 && cos < 0.9999, "seed {seed}: cosine {cos}");
    assert!(rel > 0.03 && rel < 0.3, "seed {seed}: rel_l2 {rel}");
    assert_eq!(s["nan_count"], 0);
    assert_eq!(s["layer"], 1);
    assert_eq!(s["tokens"], 32);
    assert!(!r["worst_experts"].as_array().unwrap().is_empty());
    assert!(r["worst_tokens"].as_array().unwrap().len() <= 8);
    assert!(
        text.contains("Worst experts") && text.contains("PASS"),
        "{text}"
    );
}

// `--json -` once wrote a file named `-`: it puts the JSON alone on stdout (for `| jq`) and the
// table on stderr.
#[test]
fn json_dash_writes_the_report_to_stdout_and_the_table_to_stderr() {
    let seed = rand::random::<u16>().to_string();
    let dir = tempfile::tempdir().unwrap();
    let out = bin()
        .current_dir(dir.path())
        .args([
            "layertest",
            "--device",
            "cpu",
            "--tokens",
            "16",
            "--seed",
            &seed,
        ])
        .args(["--json", "-", "--no-report-dir", "--quiet"])
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    let r: Value = serde_json::from_str(&stdout)
        .unwrap_or_else(|e| panic!("seed {seed}: stdout is not JSON ({e}):\n{stdout}"));
    assert_eq!(r["command"], "layertest");
    assert_eq!(
        out.status.code(),
        Some(r["verdict"].as_str().map_or(-1, |v| (v == "fail") as i32))
    );
    assert!(stderr.contains("Worst experts"), "seed {seed}: {stderr}");
    assert!(
        !dir.path().join("-").exists(),
        "a file named `-` was written"
    );
}

#[test]
fn synth_checkpoint_gives_the_same_layer_as_the_builtin_model() {
    let seed = rand::random::<u16>().to_string();
    let dir = tempfile::tempdir().unwrap();
    synth(dir.path(), "ck", &["--seed", &seed]);
    let common = [
        "--device",
        "cpu",
        "--tokens",
        "24",
        "--seed",
        &seed,
        "--gs",
        "checkpoint",
    ];
    let (c1, t1, r1) = run(dir.path(), &[&["layertest"][..], &common].concat());
    let (c2, t2, r2) = run(
        dir.path(),
        &[&["layertest", "--checkpoint", "ck"][..], &common].concat(),
    );
    // the same verdict, whatever it is: under the checkpoint's calibrated input_scales a rare
    // token beyond the calibration's amax may saturate an expert, and both runs must say so
    assert!(c1 <= 1, "seed {seed}: {t1}");
    assert_eq!(c1, c2, "seed {seed}: built-in\n{t1}\ncheckpoint\n{t2}");
    let (r1, r2) = (r1.unwrap(), r2.unwrap());
    assert_eq!(
        r1["summary"]["cosine"], r2["summary"]["cosine"],
        "seed {seed}"
    );
    assert_eq!(r1["gs"], r2["gs"], "seed {seed}");
    // the second MoE layer loads too
    let (c3, t3, _) = run(
        dir.path(),
        &[
            "layertest",
            "--checkpoint",
            "ck",
            "--layer",
            "2",
            "--tokens",
            "8",
            "--device",
            "cpu",
        ],
    );
    assert_eq!(c3, 0, "{t3}");
}

// also guards: a NaN block scale in the checkpoint led the verdict with "NaN in the NVFP4
// output ... token T channel C" instead of naming the expert's tensor that holds it
#[test]
fn planted_nan_block_scale_fails_naming_nan() {
    let seed = rand::random::<u16>().to_string();
    let dir = tempfile::tempdir().unwrap();
    synth(
        dir.path(),
        "ck",
        &["--seed", &seed, "--plant", "nan-block-scale"],
    );
    let planted: Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("ck/planted.json")).unwrap())
            .unwrap();
    let expert = planted["faults"][0]["expert"].as_u64().unwrap();
    let (code, text, r) = run(
        dir.path(),
        &[
            "layertest",
            "--checkpoint",
            "ck",
            "--device",
            "cpu",
            "--tokens",
            "32",
            "--seed",
            &seed,
        ],
    );
    assert_eq!(code, 1, "seed {seed}: {text}");
    let r = r.unwrap();
    assert_eq!(r["verdict"], "fail");
    assert!(r["summary"]["nan_count"].as_u64().unwrap() > 0);
    let failures = r["failures"].to_string();
    assert!(
        failures.contains("NaN in the NVFP4 output"),
        "seed {seed}: {failures}"
    );
    assert!(
        failures.contains(&format!("expert {expert} produces NaN")),
        "seed {seed}: {failures}"
    );
    // the reference (BF16 originals) stays clean
    assert_eq!(r["reference_nonfinite"]["nan_count"], 0);
    // the headline names the tensor that holds the NaN
    let headline = r["summary"]["text"].as_str().unwrap();
    assert!(
        headline.starts_with(&format!("layer 1: expert {expert} produces NaN/Inf")),
        "seed {seed}: {headline}"
    );
    assert!(
        headline.contains("its gate_proj holds 1 NaN block scale code (first at row 0, block 0)"),
        "seed {seed}: {headline}"
    );
}

#[test]
fn bad_input_scale_fails_with_checkpoint_scales_only() {
    let dir = tempfile::tempdir().unwrap();
    synth(dir.path(), "ck", &["--plant", "bad-input-scale"]);
    let (code, text, r) = run(
        dir.path(),
        &[
            "layertest",
            "--checkpoint",
            "ck",
            "--device",
            "cpu",
            "--tokens",
            "32",
            "--gs",
            "checkpoint",
        ],
    );
    assert_eq!(code, 1, "{text}");
    let f = r.unwrap()["failures"].to_string();
    assert!(f.contains("saturate") && f.contains("gs1"), "{f}");
    // calibrated scales do not read the bad input_scale
    let (code, text, _) = run(
        dir.path(),
        &[
            "layertest",
            "--checkpoint",
            "ck",
            "--device",
            "cpu",
            "--tokens",
            "32",
        ],
    );
    assert_eq!(code, 0, "{text}");
}

#[test]
fn swapped_gate_and_up_fail_on_the_expert() {
    let dir = tempfile::tempdir().unwrap();
    synth(dir.path(), "ck", &["--plant", "swap-gate-up@1:3"]);
    let (code, text, r) = run(
        dir.path(),
        &[
            "layertest",
            "--checkpoint",
            "ck",
            "--device",
            "cpu",
            "--tokens",
            "64",
        ],
    );
    // expert 3 must be reached for the fault to show; with 64 tokens x top-4 of 16 it is
    let r = r.unwrap();
    let reached = r["worst_experts"]
        .as_array()
        .unwrap()
        .iter()
        .any(|e| e["expert"] == 3);
    assert!(reached, "{text}");
    assert_eq!(code, 1, "{text}");
    assert_eq!(r["summary"]["worst_expert"]["expert"], 3, "{text}");
}

#[test]
fn input_file_and_saved_outputs_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let seed: u64 = rand::random();
    let t = 12;
    // the layer's own kind of input (what layertest draws without --input: RMS-normed residual
    // rows with outlier channels); uniform noise let single-slot experts fall under
    // --min-expert-cosine about 1 seed in 50
    let h = nvfp4dbg::moe::synthetic::moe_input(256, t, None, 1e-6, seed);
    let ids: Vec<i64> = (0..t as i64).collect();
    write_file(
        &dir.path().join("in.safetensors"),
        vec![
            (
                TensorSpec::new("hidden_states", Dtype::BF16, &[t, 256]),
                bf16_bytes(&h),
            ),
            (
                TensorSpec::new("input_ids", Dtype::I64, &[t]),
                i64_bytes(&ids),
            ),
        ],
        None,
    )
    .unwrap();
    let (code, text, r) = run(
        dir.path(),
        &[
            "layertest",
            "--device",
            "cpu",
            "--input",
            "in.safetensors",
            "--save-outputs",
            "out.safetensors",
        ],
    );
    assert_eq!(code, 0, "seed {seed}: {text}");
    let r = r.unwrap();
    assert_eq!(r["summary"]["tokens"], t);
    let bytes = std::fs::read(dir.path().join("out.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let get = |n: &str| st.tensor(n).unwrap();
    assert_eq!(get("nvfp4_out").shape(), &[t, 256]);
    assert_eq!(get("reference_out").shape(), &[t, 256]);
    assert_eq!(get("topk_ids").shape(), &[t, 4]);
    assert_eq!(get("topk_ids").dtype(), Dtype::I64);
    assert_eq!(get("topk_weights").shape(), &[t, 4]);
    let f = |n: &str| -> Vec<f32> {
        get(n)
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    };
    let m = nvfp4dbg::metrics::compare(&f("nvfp4_out"), &f("reference_out"));
    assert!((m.cosine - r["summary"]["cosine"].as_f64().unwrap()).abs() < 1e-12);
    // --tokens takes the first rows of the file (5 tokens x top-4 leave single-slot experts,
    // whose cosine is noise around NVFP4's error: the per-expert bar is not what this checks)
    let (code, text, r) = run(
        dir.path(),
        &[
            "layertest",
            "--device",
            "cpu",
            "--input",
            "in.safetensors",
            "--tokens",
            "5",
            "--min-expert-cosine",
            "0.5",
        ],
    );
    assert_eq!(code, 0, "seed {seed}: {text}");
    assert_eq!(r.unwrap()["summary"]["tokens"], 5);
}

/// H2: a NaN that comes in with the hidden states is named as the input's, at its token and
/// channel, before what it does downstream.
#[test]
fn nan_in_the_input_hidden_states_is_named_first() {
    let dir = tempfile::tempdir().unwrap();
    let seed: u64 = rand::random();
    let t = 8;
    let mut h = nvfp4dbg::moe::synthetic::moe_input(256, t, None, 1e-6, seed);
    let (tok, ch) = (seed as usize % t, (seed >> 8) as usize % 256);
    h[tok * 256 + ch] = f32::NAN;
    let write = |h: &[f32]| write_hidden(dir.path(), h, t);
    write(&h);
    for cmd in ["layertest", "gs-sweep", "multilayer"] {
        let (code, text, r) = run(
            dir.path(),
            &[cmd, "--device", "cpu", "--input", "in.safetensors"],
        );
        assert_eq!(code, 1, "{cmd} seed {seed}: {text}");
        let r = r.unwrap();
        assert_eq!(r["input_nonfinite"]["nan_count"], 1, "{cmd} seed {seed}");
        assert_eq!(
            r["input_nonfinite"]["first_index"],
            tok * 256 + ch,
            "{cmd} seed {seed}"
        );
        let first = r["failures"][0].as_str().unwrap().to_string();
        assert!(
            first.contains("input hidden states already hold 1 NaN")
                && first.contains(&format!("token {tok} channel {ch}")),
            "{cmd} seed {seed}: {first}"
        );
    }
    // a clean input says nothing about it
    h[tok * 256 + ch] = 0.5;
    write(&h);
    let (_, text, _) = run(
        dir.path(),
        &["layertest", "--device", "cpu", "--input", "in.safetensors"],
    );
    assert!(!text.contains("input hidden states"), "seed {seed}: {text}");
}

/// One token 1e4x the others' magnitude (its RMSNorm skipped or broken): the layer's
/// cosine is its cosine (0.988), while the tokens sharing its experts lose their blocks to the
/// global scale it sets (cosine 0.67-0.83). It passed; per-token cosines were only listed.
#[test]
fn a_token_of_huge_norm_does_not_carry_the_others() {
    let dir = tempfile::tempdir().unwrap();
    let seed: u64 = rand::random();
    let t = 32;
    let mut h = nvfp4dbg::moe::synthetic::moe_input(256, t, None, 1e-6, seed);
    let big = seed as usize % t;
    let write = |h: &[f32]| write_hidden(dir.path(), h, t);
    // the same tokens at their own magnitude pass, in layertest and in gs-sweep at a gs that
    // suits them
    write(&h);
    let args = ["layertest", "--device", "cpu", "--input", "in.safetensors"];
    let sweep = [
        "gs-sweep",
        "--device",
        "cpu",
        "--input",
        "in.safetensors",
        "--gs",
        "calibrated",
        "--points",
        "5",
    ];
    let (code, text, _) = run(dir.path(), &args);
    assert_eq!(code, 0, "seed {seed}: {text}");
    let (code, text, _) = run(dir.path(), &sweep);
    assert_eq!(code, 0, "seed {seed}: {text}");
    h[big * 256..(big + 1) * 256]
        .iter_mut()
        .for_each(|v| *v *= 1e4);
    write(&h);
    let (code, text, r) = run(dir.path(), &args);
    assert_eq!(code, 1, "seed {seed}: {text}");
    let r = r.unwrap();
    assert!(
        r["summary"]["cosine"].as_f64().unwrap() > 0.95,
        "seed {seed}"
    );
    let failures = r["failures"].to_string();
    assert!(
        failures.contains("fall below --min-token-cosine 0.9")
            && failures.contains(&format!("token {big} carries")),
        "seed {seed}: {failures}"
    );
    // gs-sweep: the calibrated gs is the best there is (the layer cosine stays high), and it
    // passed; the tokens it ruins fail it, blamed on the input
    let (code, text, r) = run(dir.path(), &sweep);
    assert_eq!(code, 1, "seed {seed}: {text}");
    let r = r.unwrap();
    assert_eq!(r["summary"]["cause"], "input", "seed {seed}: {text}");
    assert!(
        text.contains(&format!("token {big} carries")),
        "seed {seed}: {text}"
    );
}

/// Guards: a batch of one token (or a few of ordinary norm) is not "one token of huge norm".
/// Some token of such a batch always carries half the energy; gs-sweep under the engines'
/// default gs blamed the input (`cause: "input"`, "fails token 0 only ... its input row's norm
/// is 1.000e0x the median token's") where the gs is the fault, and layertest led with it.
#[test]
fn a_batch_of_one_ordinary_token_is_not_a_token_of_huge_norm() {
    let dir = tempfile::tempdir().unwrap();
    let seed: u64 = rand::random();
    for t in [1, 2] {
        let h = nvfp4dbg::moe::synthetic::moe_input(256, t, None, 1e-6, seed);
        write_hidden(dir.path(), &h, t);
        let (code, text, r) = run(
            dir.path(),
            &[
                "gs-sweep",
                "--device",
                "cpu",
                "--input",
                "in.safetensors",
                "--points",
                "5",
            ],
        );
        assert_eq!(code, 1, "seed {seed}, {t} token(s): {text}");
        let r = r.unwrap();
        assert_eq!(
            r["summary"]["cause"], "gs",
            "seed {seed}, {t} token(s): {text}"
        );
        assert!(
            !text.contains("carries") && !text.contains("only:"),
            "seed {seed}, {t} token(s): {text}"
        );
        let (_, text, _) = run(
            dir.path(),
            &[
                "layertest",
                "--device",
                "cpu",
                "--input",
                "in.safetensors",
                "--gs",
                "default",
            ],
        );
        assert!(
            !text.contains("carries"),
            "seed {seed}, {t} token(s): {text}"
        );
    }
}

/// A token blown up to 1e20 (finite, even in BF16): every product of the experts overflows,
/// the reference's too. gs-sweep blamed "the weights, their scales or the reference" (every gs
/// gives NaN), layertest an expert's "activation global scale (gs1) too small".
#[test]
fn input_values_that_overflow_the_layer_are_named_first() {
    let dir = tempfile::tempdir().unwrap();
    let seed: u64 = rand::random();
    let t = 8;
    let mut h = nvfp4dbg::moe::synthetic::moe_input(256, t, None, 1e-6, seed);
    let tok = seed as usize % t;
    h[tok * 256..(tok + 1) * 256]
        .iter_mut()
        .for_each(|v| *v *= 1e20);
    write_hidden(dir.path(), &h, t);
    for cmd in ["layertest", "gs-sweep", "multilayer"] {
        let (code, text, r) = run(
            dir.path(),
            &[cmd, "--device", "cpu", "--input", "in.safetensors"],
        );
        assert_eq!(code, 1, "{cmd} seed {seed}: {text}");
        let r = r.unwrap();
        let first = r["failures"][0].as_str().unwrap().to_string();
        assert!(
            first.contains("beyond sqrt(f32 max)")
                && first.contains(&format!("token {tok} channel")),
            "{cmd} seed {seed}: {first}"
        );
        assert!(r["input_nonfinite"]["overflow_count"].as_u64().unwrap() > 0);
        if cmd == "gs-sweep" {
            assert_eq!(r["summary"]["cause"], "input", "seed {seed}");
        }
    }
}

#[test]
fn bad_input_is_exit_2_naming_the_problem() {
    let dir = tempfile::tempdir().unwrap();
    write_file(
        &dir.path().join("wide.safetensors"),
        vec![(
            TensorSpec::new("hidden_states", Dtype::F32, &[4, 128]),
            f32_bytes(&[0.5; 512]),
        )],
        None,
    )
    .unwrap();
    let (code, text, _) = run(
        dir.path(),
        &[
            "layertest",
            "--device",
            "cpu",
            "--input",
            "wide.safetensors",
        ],
    );
    assert_eq!(code, 2, "{text}");
    assert!(
        text.contains("hidden_states") && text.contains("[tokens, 256]"),
        "{text}"
    );
    write_file(
        &dir.path().join("ids.safetensors"),
        vec![
            (
                TensorSpec::new("hidden_states", Dtype::F32, &[4, 256]),
                f32_bytes(&[0.5; 1024]),
            ),
            (
                TensorSpec::new("input_ids", Dtype::I64, &[3]),
                i64_bytes(&[1, 2, 3]),
            ),
        ],
        None,
    )
    .unwrap();
    let (code, text, _) = run(
        dir.path(),
        &["layertest", "--device", "cpu", "--input", "ids.safetensors"],
    );
    assert_eq!(code, 2, "{text}");
    assert!(text.contains("input_ids"), "{text}");
    let (code, text, _) = run(
        dir.path(),
        &[
            "layertest",
            "--device",
            "cpu",
            "--input",
            "missing.safetensors",
        ],
    );
    assert_eq!(code, 2, "{text}");
    assert!(text.contains("missing.safetensors"), "{text}");
    let (code, text, _) = run(
        dir.path(),
        &[
            "layertest",
            "--device",
            "cpu",
            "--input",
            "ids.safetensors",
            "--tokens",
            "9",
        ],
    );
    assert_eq!(code, 2, "{text}");
    // layer 0 of the built-in model is dense
    let (code, text, _) = run(
        dir.path(),
        &["layertest", "--device", "cpu", "--layer", "0"],
    );
    assert_eq!(code, 2, "{text}");
    assert!(text.contains("not an MoE layer"), "{text}");
    let (code, text, _) = run(
        dir.path(),
        &["layertest", "--device", "cpu", "--gs", "sometimes"],
    );
    assert_eq!(code, 2, "{text}");
}

#[test]
fn hash_layer_needs_input_ids() {
    let dir = tempfile::tempdir().unwrap();
    synth(dir.path(), "v4", &["--preset", "tiny-v4"]);
    // layer 0 routes by tid2eid[input_ids]: synthetic input carries ids and passes
    let (code, text, r) = run(
        dir.path(),
        &[
            "layertest",
            "--checkpoint",
            "v4",
            "--device",
            "cpu",
            "--tokens",
            "16",
        ],
    );
    assert_eq!(code, 0, "{text}");
    assert_eq!(r.unwrap()["summary"]["layer"], 0);
    write_file(
        &dir.path().join("noids.safetensors"),
        vec![(
            TensorSpec::new("hidden_states", Dtype::F32, &[4, 256]),
            f32_bytes(&[0.25; 1024]),
        )],
        None,
    )
    .unwrap();
    let (code, text, _) = run(
        dir.path(),
        &[
            "layertest",
            "--checkpoint",
            "v4",
            "--device",
            "cpu",
            "--input",
            "noids.safetensors",
        ],
    );
    assert_eq!(code, 2, "{text}");
    assert!(text.contains("input_ids"), "{text}");
    // a scored V4 layer (sqrtsoftplus, swiglu_limit) needs none
    let (code, text, _) = run(
        dir.path(),
        &[
            "layertest",
            "--checkpoint",
            "v4",
            "--layer",
            "1",
            "--device",
            "cpu",
            "--input",
            "noids.safetensors",
        ],
    );
    assert_eq!(code, 0, "{text}");
}

/// Multiply the F32 scalar `name` of the synth checkpoint `ck` by `factor`, in place.
fn scale_scalar(ck: &Path, name: &str, factor: f32) {
    let ix: Value =
        serde_json::from_slice(&std::fs::read(ck.join("model.safetensors.index.json")).unwrap())
            .unwrap();
    let shard = ck.join(ix["weight_map"][name].as_str().unwrap());
    let mut b = std::fs::read(&shard).unwrap();
    let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
    let h: Value = serde_json::from_slice(&b[8..8 + n]).unwrap();
    assert_eq!(h[name]["dtype"], "F32");
    let at = 8 + n + h[name]["data_offsets"][0].as_u64().unwrap() as usize;
    let v = f32::from_le_bytes(b[at..at + 4].try_into().unwrap()) * factor;
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
    std::fs::write(&shard, b).unwrap();
}

/// An expert whose output is off by a factor keeps its cosine: one expert's down_proj
/// weight_scale_2 2x (or 0.4x) off must fail on that expert, by its rel-L2.
#[test]
fn one_expert_off_by_a_factor_fails_on_its_rel_l2() {
    let dir = tempfile::tempdir().unwrap();
    let seed = rand::random::<u16>();
    synth(dir.path(), "ck", &["--seed", &seed.to_string()]);
    let lt = [
        "layertest",
        "--checkpoint",
        "ck",
        "--device",
        "cpu",
        "--save-outputs",
        "out.safetensors",
    ];
    let (code, text, _) = run(dir.path(), &lt);
    assert_eq!(code, 0, "seed {seed}: {text}");
    // the busiest expert of the layer
    let bytes = std::fs::read(dir.path().join("out.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut count = [0usize; 16];
    for c in st.tensor("topk_ids").unwrap().data().chunks_exact(8) {
        count[i64::from_le_bytes(c.try_into().unwrap()) as usize] += 1;
    }
    let e = (0..16).max_by_key(|&e| count[e]).unwrap();
    let factor = if seed.is_multiple_of(2) { 2.0 } else { 0.4 };
    scale_scalar(
        &dir.path().join("ck"),
        &format!("model.layers.1.mlp.experts.{e}.down_proj.weight_scale_2"),
        factor,
    );
    let (code, text, r) = run(dir.path(), &lt);
    assert_eq!(code, 1, "seed {seed} expert {e} x{factor}: {text}");
    let r = r.unwrap();
    let row = r["worst_experts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["expert"] == e)
        .cloned()
        .unwrap_or_else(|| panic!("seed {seed}: expert {e} not listed: {text}"));
    // the cosine alone would pass it
    assert!(row["cosine"].as_f64().unwrap() >= 0.9, "seed {seed}: {row}");
    assert_eq!(r["summary"]["worst_expert"]["expert"], e, "seed {seed}");
    let f = r["failures"].to_string();
    assert!(
        f.contains(&format!("expert {e}: rel-L2")) && f.contains("--min-expert-cosine"),
        "seed {seed}: {f}"
    );
}

/// An expert reached by one or two token slots carries the NVFP4 noise of one or two tokens:
/// a healthy one can fall under --min-expert-cosine (seed 408070430907894220 at 12 tokens:
/// expert 14, one slot, cosine 0.899; about 1 run in 700 at 4-16 tokens). It is reported as
/// too few tokens to judge, not failed; `--min-expert-slots 1` restores the bare bar.
#[test]
fn a_healthy_expert_on_one_slot_is_too_few_tokens_to_judge() {
    let dir = tempfile::tempdir().unwrap();
    let lt = |extra: &[&str]| {
        let mut a = vec![
            "layertest",
            "--device",
            "cpu",
            "--tokens",
            "12",
            "--seed",
            "408070430907894220",
        ];
        a.extend_from_slice(extra);
        run(dir.path(), &a)
    };
    let (code, text, r) = lt(&[]);
    assert_eq!(code, 0, "{text}");
    let r = r.unwrap();
    assert_eq!(r["summary"]["experts_too_few_slots"], 1, "{text}");
    let x = &r["worst_experts"][0];
    assert_eq!(
        (&x["expert"], &x["slots"], &x["verdict"]),
        (&14.into(), &1.into(), &"too-few-slots".into()),
        "{x}"
    );
    assert!(
        text.contains("expert 14") && text.contains("too few tokens to judge"),
        "{text}"
    );
    let (code, text, _) = lt(&["--min-expert-slots", "1"]);
    assert_eq!(code, 1, "{text}");
    assert!(
        text.contains("expert 14: cosine 0.8991 < --min-expert-cosine 0.9 over 1 slots"),
        "{text}"
    );
    // fresh healthy layers at few tokens pass
    for t in [4, 8, 16] {
        let seed = rand::random::<u32>().to_string();
        let t = t.to_string();
        let (code, text, _) = run(
            dir.path(),
            &[
                "layertest",
                "--device",
                "cpu",
                "--tokens",
                &t,
                "--seed",
                &seed,
            ],
        );
        assert_eq!(code, 0, "seed {seed}, {t} tokens: {text}");
    }
}

/// An expert broken beyond anything NVFP4 noise reaches still fails on one or two slots: its
/// down_proj weight_scale_2 4x off on the least-routed expert of a 12-token batch.
#[test]
fn a_broken_expert_on_few_slots_still_fails() {
    let dir = tempfile::tempdir().unwrap();
    let seed = rand::random::<u16>();
    synth(dir.path(), "ck", &["--seed", &seed.to_string()]);
    let lt = [
        "layertest",
        "--checkpoint",
        "ck",
        "--device",
        "cpu",
        "--tokens",
        "12",
        "--save-outputs",
        "out.safetensors",
    ];
    let (code, text, _) = run(dir.path(), &lt);
    assert_eq!(code, 0, "seed {seed}: {text}");
    let bytes = std::fs::read(dir.path().join("out.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut count = [0usize; 16];
    for c in st.tensor("topk_ids").unwrap().data().chunks_exact(8) {
        count[i64::from_le_bytes(c.try_into().unwrap()) as usize] += 1;
    }
    let e = (0..16)
        .filter(|&e| count[e] > 0)
        .min_by_key(|&e| count[e])
        .unwrap();
    scale_scalar(
        &dir.path().join("ck"),
        &format!("model.layers.1.mlp.experts.{e}.down_proj.weight_scale_2"),
        4.0,
    );
    let (code, text, r) = run(dir.path(), &lt);
    assert_eq!(
        code, 1,
        "seed {seed} expert {e} ({} slots): {text}",
        count[e]
    );
    let f = r.unwrap()["failures"].to_string();
    assert!(
        f.contains(&format!("expert {e}: rel-L2")),
        "seed {seed}: {f}"
    );
    if count[e] < 3 {
        assert!(f.contains("--min-expert-slots 3"), "seed {seed}: {f}");
    }
}

#[test]
fn a_batch_past_host_memory_is_bad_input_before_anything_is_allocated() {
    // 1e11 tokens of the built-in model need petabytes: refused up front (exit 2, with the
    // need and advice), where the allocation used to abort the process
    let dir = tempfile::tempdir().unwrap();
    for c in ["layertest", "gs-sweep", "multilayer"] {
        let (code, text, _) = run(
            dir.path(),
            &[c, "--device", "cpu", "--tokens", "100000000000"],
        );
        assert_eq!(code, 2, "{c}: {text}");
        assert!(
            text.contains("GB of host memory") && text.contains("try fewer --tokens"),
            "{c}: {text}"
        );
        assert!(!text.contains("memory allocation of"), "{c}: {text}");
    }
}

/// Set element `at` of the BF16/F32 tensor `name` to NaN, in the shard the index of `dir`
/// (a checkpoint directory, or its `bf16/` originals) places it in.
fn nan_element(dir: &Path, name: &str, at: usize) {
    let ix: Value =
        serde_json::from_slice(&std::fs::read(dir.join("model.safetensors.index.json")).unwrap())
            .unwrap();
    let shard = dir.join(ix["weight_map"][name].as_str().unwrap());
    let mut b = std::fs::read(&shard).unwrap();
    let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
    let h: Value = serde_json::from_slice(&b[8..8 + n]).unwrap();
    let nan: &[u8] = match h[name]["dtype"].as_str().unwrap() {
        "BF16" => &[0xC0, 0x7F],
        "F32" => &[0x00, 0x00, 0xC0, 0x7F],
        d => panic!("{name}: {d}"),
    };
    let at = 8 + n + h[name]["data_offsets"][0].as_u64().unwrap() as usize + at * nan.len();
    b[at..at + nan.len()].copy_from_slice(nan);
    std::fs::write(&shard, b).unwrap();
}

/// A NaN in a float tensor the layer computes with (router weight, its correction bias, a
/// shared-expert weight, a BF16 original the reference uses) is bad input naming that tensor
/// and element. They used to surface as an anonymous NaN in the output (or the reference), or
/// — for the bias — pass: a NaN bias only reorders the selection.
#[test]
fn a_nan_in_a_float_tensor_of_the_layer_is_bad_input_naming_it() {
    use rand::{Rng, SeedableRng};
    let seed: u64 = rand::random();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let dir = tempfile::tempdir().unwrap();
    synth(dir.path(), "ck", &["--seed", &seed.to_string()]);
    let ck = dir.path().join("ck");
    let (e, p) = (
        rng.gen_range(0..16usize),
        ["gate_proj", "up_proj", "down_proj"][rng.gen_range(0..3)],
    );
    let l = "model.layers.1.mlp";
    let (file_dir, name, len, row_len) = match rng.gen_range(0..4) {
        0 => (ck.clone(), format!("{l}.gate.weight"), 16 * 256, 256),
        1 => (
            ck.clone(),
            format!("{l}.gate.e_score_correction_bias"),
            16,
            0,
        ),
        2 => (
            ck.clone(),
            format!("{l}.shared_experts.{p}.weight"),
            128 * 256,
            if p == "down_proj" { 128 } else { 256 },
        ),
        _ => (
            ck.join("bf16"),
            format!("{l}.experts.{e}.{p}.weight"),
            128 * 256,
            if p == "down_proj" { 128 } else { 256 },
        ),
    };
    let at = rng.gen_range(0..len);
    nan_element(&file_dir, &name, at);
    let (code, text, _) = run(
        dir.path(),
        &[
            "layertest",
            "--checkpoint",
            "ck",
            "--device",
            "cpu",
            "--tokens",
            "16",
        ],
    );
    let elem = match row_len {
        0 => format!("element [{at}] is NaN"),
        c => format!("element [{}, {}] is NaN", at / c, at % c),
    };
    assert_eq!(code, 2, "seed {seed}: {name} {elem}: {text}");
    assert!(
        text.contains(&format!("tensor `{name}`")) && text.contains(&elem),
        "seed {seed}: {name} {elem}: {text}"
    );
}

/// Remove tensor `name` from its shard of checkpoint `ck` and from the index.
fn remove_tensor(ck: &Path, name: &str) {
    let ix_path = ck.join("model.safetensors.index.json");
    let mut ix: Value = serde_json::from_slice(&std::fs::read(&ix_path).unwrap()).unwrap();
    let shard = ck.join(ix["weight_map"][name].as_str().unwrap());
    ix["weight_map"].as_object_mut().unwrap().remove(name);
    std::fs::write(&ix_path, ix.to_string()).unwrap();
    let b = std::fs::read(&shard).unwrap();
    let st = safetensors::SafeTensors::deserialize(&b).unwrap();
    let keep: Vec<(TensorSpec, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .filter(|(n, _)| n != name)
        .map(|(n, v)| (TensorSpec::new(n, v.dtype(), v.shape()), v.data().to_vec()))
        .collect();
    write_file(&shard, keep, None).unwrap();
}

/// A layer without its e_score_correction_bias while config.json's topk_method is
/// `noaux_tc` (selection on score + bias) is bad input naming the tensor: an engine would run
/// it with an uninitialized or zero bias. It used to pass, routing without a bias.
#[test]
fn a_missing_correction_bias_under_noaux_tc_is_bad_input() {
    let seed = rand::random::<u16>();
    let layer = 1 + (seed % 2) as usize;
    let dir = tempfile::tempdir().unwrap();
    synth(dir.path(), "ck", &["--seed", &seed.to_string()]);
    let name = format!("model.layers.{layer}.mlp.gate.e_score_correction_bias");
    remove_tensor(&dir.path().join("ck"), &name);
    let l = layer.to_string();
    let args = [
        "layertest",
        "--checkpoint",
        "ck",
        "--device",
        "cpu",
        "--tokens",
        "8",
        "--layer",
        &l,
    ];
    let (code, text, _) = run(dir.path(), &args);
    assert_eq!(code, 2, "seed {seed}: {text}");
    assert!(
        text.contains(&format!("tensor `{name}`: missing")) && text.contains("noaux_tc"),
        "seed {seed}: {text}"
    );
    // a config.json without topk_method leaves the bias optional
    let p = dir.path().join("ck/config.json");
    let mut c: Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    c.as_object_mut().unwrap().remove("topk_method");
    std::fs::write(&p, c.to_string()).unwrap();
    let (code, text, _) = run(dir.path(), &args);
    assert_ne!(code, 2, "seed {seed}: {text}");
}

/// A checkpoint that holds the pre-MoE RMSNorm weight for its other layers but not for this
/// one lost it (a loading or conversion bug): bad input naming the tensor. multilayer ran such
/// a layer on unit weights and passed, with only a note.
#[test]
fn a_missing_rmsnorm_weight_among_present_ones_is_bad_input() {
    let seed = rand::random::<u16>();
    let layer = 1 + (seed % 2) as usize;
    let dir = tempfile::tempdir().unwrap();
    synth(dir.path(), "ck", &["--seed", &seed.to_string()]);
    let name = format!("model.layers.{layer}.post_attention_layernorm.weight");
    remove_tensor(&dir.path().join("ck"), &name);
    let l = layer.to_string();
    for args in [
        vec![
            "layertest",
            "--checkpoint",
            "ck",
            "--device",
            "cpu",
            "--tokens",
            "8",
            "--layer",
            &l,
        ],
        vec![
            "multilayer",
            "--checkpoint",
            "ck",
            "--device",
            "cpu",
            "--tokens",
            "8",
        ],
    ] {
        let (code, text, _) = run(dir.path(), &args);
        assert_eq!(code, 2, "seed {seed}: {args:?}: {text}");
        assert!(
            text.contains(&name) && text.contains("is missing"),
            "seed {seed}: {args:?}: {text}"
        );
    }
}

/// One expert's down_proj input_scale 100x too small saturates its SwiGLU output before W2:
/// under `--gs checkpoint` the expert fails and the failure says its down_proj input
/// saturates. It used to give only the expert's cosine (the gate/up blocks were fine).
#[test]
fn a_saturated_down_proj_input_is_named_as_the_cause() {
    let seed = rand::random::<u16>().to_string();
    let dir = tempfile::tempdir().unwrap();
    // the planted fault marks the busiest expert of this seed
    synth(
        dir.path(),
        "p",
        &["--seed", &seed, "--plant", "bad-input-scale"],
    );
    let planted: Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("p/planted.json")).unwrap()).unwrap();
    let e = planted["faults"][0]["expert"].as_u64().unwrap();
    synth(dir.path(), "ck", &["--seed", &seed]);
    scale_scalar(
        &dir.path().join("ck"),
        &format!("model.layers.1.mlp.experts.{e}.down_proj.input_scale"),
        0.01,
    );
    let (code, text, r) = run(
        dir.path(),
        &[
            "layertest",
            "--checkpoint",
            "ck",
            "--device",
            "cpu",
            "--tokens",
            "32",
            "--gs",
            "checkpoint",
        ],
    );
    assert_eq!(code, 1, "seed {seed}: {text}");
    let failures = r.unwrap()["failures"].to_string();
    let ours = failures
        .split("\",\"")
        .find(|f| f.contains(&format!("expert {e}:")))
        .unwrap_or_else(|| panic!("seed {seed}: expert {e} not failed: {failures}"));
    assert!(
        ours.contains("its down_proj input saturates"),
        "seed {seed}: {ours}"
    );
}

/// config.json stating n_shared_experts = 0 while the layer holds a shared expert: an engine
/// builds none and drops it, so the layer it computes is not the one tested. Bad input naming
/// the field and the tensor; it used to pass, adding the shared expert anyway.
#[test]
fn a_shared_expert_config_json_says_there_is_none_is_bad_input() {
    let seed = rand::random::<u16>();
    let layer = 1 + (seed % 2) as usize;
    let dir = tempfile::tempdir().unwrap();
    synth(dir.path(), "ck", &["--seed", &seed.to_string()]);
    let p = dir.path().join("ck/config.json");
    let mut c: Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    c["n_shared_experts"] = 0.into();
    std::fs::write(&p, c.to_string()).unwrap();
    let l = layer.to_string();
    let args = [
        "layertest",
        "--checkpoint",
        "ck",
        "--device",
        "cpu",
        "--tokens",
        "8",
        "--layer",
        &l,
    ];
    let (code, text, _) = run(dir.path(), &args);
    assert_eq!(code, 2, "seed {seed}: {text}");
    let name = format!("model.layers.{layer}.mlp.shared_experts.gate_proj.weight");
    assert!(
        text.contains(&format!("tensor `{name}`")) && text.contains("n_shared_experts = 0"),
        "seed {seed}: {text}"
    );
    // without the field: the shared expert the checkpoint holds is used
    c.as_object_mut().unwrap().remove("n_shared_experts");
    std::fs::write(&p, c.to_string()).unwrap();
    let (code, text, _) = run(dir.path(), &args);
    assert_ne!(code, 2, "seed {seed}: {text}");
}

/// Set the F32 scalar `name` of the synth checkpoint `ck` to `v`, in place.
fn set_scalar(ck: &Path, name: &str, v: f32) {
    let ix: Value =
        serde_json::from_slice(&std::fs::read(ck.join("model.safetensors.index.json")).unwrap())
            .unwrap();
    let shard = ck.join(ix["weight_map"][name].as_str().unwrap());
    let mut b = std::fs::read(&shard).unwrap();
    let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
    let h: Value = serde_json::from_slice(&b[8..8 + n]).unwrap();
    let at = 8 + n + h[name]["data_offsets"][0].as_u64().unwrap() as usize;
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
    std::fs::write(&shard, b).unwrap();
}

/// DeepSeek-like MoE inputs: randn rows of spread norms, plus three massive-activation
/// channels (~500, -300, 200) in three different 16-blocks.
fn massive_channel_input(t: usize, seed: u64) -> Vec<f32> {
    use rand::{Rng, SeedableRng};
    use rand_distr::{Distribution, StandardNormal};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut h = vec![0f32; t * 256];
    for row in h.chunks_mut(256) {
        let s: f32 = rng.gen_range(0.6..1.6);
        for v in row.iter_mut() {
            let x: f32 = StandardNormal.sample(&mut rng);
            *v = x * s;
        }
        for (c, m) in [(17, 500.0), (101, -300.0), (200, 200.0)] {
            row[c] = m * rng.gen_range(0.8f32..1.2);
        }
    }
    h
}

/// One expert's gate/up input_scale 100x too small, on activations with a few massive
/// channels: only the massive channels' blocks saturate (3 of 16, under the 20% share that
/// names a saturated gate/up input), and layertest named the expert's down_proj input or
/// nothing, never its gate/up input_scale (gs-sweep did).
#[test]
fn an_expert_gate_up_input_scale_too_small_is_named_on_massive_channels() {
    let dir = tempfile::tempdir().unwrap();
    let seed: u64 = rand::random();
    synth(dir.path(), "ck", &["--seed", &(seed % 1000).to_string()]);
    let t = 32;
    let h = massive_channel_input(t, seed);
    write_hidden(dir.path(), &h, t);
    let ck = dir.path().join("ck");
    let amax = h.iter().fold(0f32, |m, v| m.max(v.abs()));
    for e in 0..16 {
        let p = format!("model.layers.1.mlp.experts.{e}");
        set_scalar(&ck, &format!("{p}.gate_proj.input_scale"), amax / 2688.0);
        set_scalar(&ck, &format!("{p}.up_proj.input_scale"), amax / 2688.0);
        set_scalar(&ck, &format!("{p}.down_proj.input_scale"), 1e5 / 2688.0);
    }
    let lt = [
        "layertest",
        "--checkpoint",
        "ck",
        "--device",
        "cpu",
        "--input",
        "in.safetensors",
        "--gs",
        "checkpoint",
        "--save-outputs",
        "out.safetensors",
    ];
    let (code, text, _) = run(dir.path(), &lt);
    assert_eq!(code, 0, "seed {seed}: {text}");
    let bytes = std::fs::read(dir.path().join("out.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut count = [0usize; 16];
    for c in st.tensor("topk_ids").unwrap().data().chunks_exact(8) {
        count[i64::from_le_bytes(c.try_into().unwrap()) as usize] += 1;
    }
    let e = (0..16).max_by_key(|&e| count[e]).unwrap();
    for proj in ["gate_proj", "up_proj"] {
        set_scalar(
            &ck,
            &format!("model.layers.1.mlp.experts.{e}.{proj}.input_scale"),
            amax / 2688.0 / 100.0,
        );
    }
    let (code, text, r) = run(dir.path(), &lt);
    assert_eq!(code, 1, "seed {seed} expert {e}: {text}");
    let r = r.unwrap();
    let line = r["failures"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|l| l.as_str())
        .find(|l| l.starts_with(&format!("expert {e}:")))
        .unwrap_or_else(|| panic!("seed {seed}: expert {e} not failed: {text}"))
        .to_string();
    assert!(
        line.contains("its gate/up input saturates")
            && line.contains("gate_proj/up_proj input_scale too small"),
        "seed {seed}: {line}"
    );
}

/// One token of 100x the others' norm under fixed scales that fit every other token (the
/// checkpoint's input scales): fixed scales quantize each token on its own, so that token alone
/// fails, and it carries the layer's cosine. gs-sweep blamed the gs (`cause: "gs"`, "loses
/// 0.4 cosine"), sending the user to recalibrate, and layertest led with the experts that
/// token reaches; both now lead with the token, named with its input norm.
#[test]
fn one_huge_token_under_fixed_scales_is_blamed_on_the_input() {
    let dir = tempfile::tempdir().unwrap();
    // TSEED=N reruns one seed
    let seed: u64 = std::env::var("TSEED").map_or_else(|_| rand::random(), |v| v.parse().unwrap());
    synth(dir.path(), "ck", &["--seed", &(seed % 1000).to_string()]);
    let t = 32;
    let mut h = massive_channel_input(t, seed);
    let ck = dir.path().join("ck");
    let amax = h.iter().fold(0f32, |m, v| m.max(v.abs()));
    for e in 0..16 {
        let p = format!("model.layers.1.mlp.experts.{e}");
        set_scalar(&ck, &format!("{p}.gate_proj.input_scale"), amax / 2688.0);
        set_scalar(&ck, &format!("{p}.up_proj.input_scale"), amax / 2688.0);
        set_scalar(&ck, &format!("{p}.down_proj.input_scale"), 1e5 / 2688.0);
    }
    let sweep = [
        "gs-sweep",
        "--checkpoint",
        "ck",
        "--device",
        "cpu",
        "--input",
        "in.safetensors",
        "--gs",
        "checkpoint",
        "--points",
        "5",
    ];
    let lt = [
        "layertest",
        "--checkpoint",
        "ck",
        "--device",
        "cpu",
        "--input",
        "in.safetensors",
        "--gs",
        "checkpoint",
    ];
    write_hidden(dir.path(), &h, t);
    let (code, text, _) = run(dir.path(), &sweep);
    assert_eq!(code, 0, "seed {seed}: {text}");
    // token row b of the input, 100x
    let boost = |h: &mut Vec<f32>, b: usize| {
        h[b * 256..(b + 1) * 256]
            .iter_mut()
            .for_each(|v| *v *= 100.0)
    };
    let big = (seed >> 8) as usize % t;
    boost(&mut h, big);
    write_hidden(dir.path(), &h, t);
    let (code, text, r) = run(dir.path(), &sweep);
    assert_eq!(code, 1, "seed {seed}: {text}");
    let r = r.unwrap();
    assert_eq!(r["summary"]["cause"], "input", "seed {seed}: {text}");
    let first = r["failures"][0].as_str().unwrap();
    assert!(
        first.contains(&format!("fails token {big} only"))
            && first.contains("input row's norm is")
            && first.contains(&format!("the other {} token(s) pass", t - 1)),
        "seed {seed}: {first}"
    );
    let (code, text, r) = run(dir.path(), &lt);
    assert_eq!(code, 1, "seed {seed}: {text}");
    let first = r.unwrap()["failures"][0].as_str().unwrap().to_string();
    assert!(
        first.contains(&format!("token {big} carries")),
        "seed {seed}: {first}"
    );
    // three such tokens are the inputs' fault as one is (gs-sweep blamed the gs: none of
    // the three carries half the energy alone)
    let mut more = vec![big];
    while more.len() < 3 {
        let b = (more.len() * 7 + big + 3 + (seed >> 20) as usize % 5) % t;
        if !more.contains(&b) {
            boost(&mut h, b);
            more.push(b);
        }
    }
    more.sort_unstable();
    write_hidden(dir.path(), &h, t);
    let (code, text, r) = run(dir.path(), &sweep);
    assert_eq!(code, 1, "seed {seed}: {text}");
    let r = r.unwrap();
    assert_eq!(r["summary"]["cause"], "input", "seed {seed}: {text}");
    let first = r["failures"][0].as_str().unwrap();
    let listed = format!("fails tokens {}, {}, {} only", more[0], more[1], more[2]);
    assert!(
        first.contains(&listed) && first.contains(&format!("the other {} token(s) pass", t - 3)),
        "seed {seed}: {first}"
    );
}

/// `--input` problems of a hash layer name the file (the router's message named no file), an
/// all-zero batch (padding rows only) is bad input rather than a pass at cosine 1 that tested
/// nothing, and `--tokens 0` says so.
#[test]
fn input_ids_zero_batches_and_zero_tokens_are_bad_input_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let seed: u64 = rand::random();
    synth(
        dir.path(),
        "v4",
        &["--preset", "tiny-v4", "--seed", &(seed % 1000).to_string()],
    );
    let t = 1 + (seed % 8) as usize;
    let h = massive_channel_input(t, seed);
    let hs = (
        TensorSpec::new("hidden_states", Dtype::F32, &[t, 256]),
        f32_bytes(&h),
    );
    let bad = if seed.is_multiple_of(2) {
        -1
    } else {
        1000 + (seed % 1000) as i64
    };
    let mut ids: Vec<i64> = (0..t as i64).collect();
    ids[t - 1] = bad;
    write_file(
        &dir.path().join("noids.safetensors"),
        vec![hs.clone()],
        None,
    )
    .unwrap();
    write_file(
        &dir.path().join("badids.safetensors"),
        vec![
            hs,
            (
                TensorSpec::new("input_ids", Dtype::I64, &[t]),
                i64_bytes(&ids),
            ),
        ],
        None,
    )
    .unwrap();
    for cmd in ["layertest", "gs-sweep"] {
        for (file, want) in [
            (
                "noids.safetensors",
                "missing: MoE layer 0 is a hash layer".to_string(),
            ),
            (
                "badids.safetensors",
                format!("input_ids[{}] = {bad} is outside", t - 1),
            ),
        ] {
            let (code, text, _) = run(
                dir.path(),
                &[
                    cmd,
                    "--checkpoint",
                    "v4",
                    "--device",
                    "cpu",
                    "--input",
                    file,
                ],
            );
            assert_eq!(code, 2, "{cmd} {file} seed {seed}: {text}");
            assert!(
                text.contains(file) && text.contains("`input_ids`") && text.contains(&want),
                "{cmd} {file} seed {seed}: {text}"
            );
        }
    }
    write_hidden(dir.path(), &vec![0.0; t * 256], t);
    for cmd in ["layertest", "gs-sweep", "multilayer"] {
        let (code, text, _) = run(
            dir.path(),
            &[cmd, "--device", "cpu", "--input", "in.safetensors"],
        );
        assert_eq!(code, 2, "{cmd} seed {seed}: {text}");
        assert!(
            text.contains("in.safetensors")
                && text.contains("hidden_states")
                && text.contains("all zeros"),
            "{cmd} seed {seed}: {text}"
        );
    }
    // padding rows among real ones are fine
    let mut h = massive_channel_input(t + 2, seed);
    h[t * 256..].iter_mut().for_each(|v| *v = 0.0);
    write_hidden(dir.path(), &h, t + 2);
    let (code, text, _) = run(
        dir.path(),
        &[
            "layertest",
            "--device",
            "cpu",
            "--input",
            "in.safetensors",
            "--tokens",
            "0",
        ],
    );
    assert_eq!(code, 2, "seed {seed}: {text}");
    assert!(
        text.contains("--tokens must be at least 1"),
        "seed {seed}: {text}"
    );
    let (code, text, _) = run(
        dir.path(),
        &["layertest", "--device", "cpu", "--input", "in.safetensors"],
    );
    assert_ne!(code, 2, "seed {seed}: {text}");
}

/// Guards: `--help` did not name the values of --input-scale-reduce (`global-max` was only
/// discoverable by typing a wrong one), unlike every other enum flag.
#[test]
fn input_scale_reduce_help_lists_its_values() {
    let dir = tempfile::tempdir().unwrap();
    for cmd in ["layertest", "gs-sweep", "multilayer"] {
        let (code, text, _) = run(dir.path(), &[cmd, "--help"]);
        assert_eq!(code, 0, "{cmd}: {text}");
        assert!(
            text.contains("- per-expert:") && text.contains("- global-max:"),
            "{cmd}: {text}"
        );
    }
    let seed: u64 = rand::random::<u64>() % 1000;
    let (code, text, r) = run(
        dir.path(),
        &[
            "layertest",
            "--device",
            "cpu",
            "--tokens",
            "16",
            "--seed",
            &seed.to_string(),
            "--gs",
            "checkpoint",
            "--input-scale-reduce",
            "global-max",
        ],
    );
    assert_ne!(code, 2, "seed {seed}: {text}");
    assert_eq!(
        r.unwrap()["gs"]["input_scale_reduce"],
        "global-max",
        "seed {seed}"
    );
    let (code, text, _) = run(
        dir.path(),
        &[
            "layertest",
            "--device",
            "cpu",
            "--input-scale-reduce",
            "max",
        ],
    );
    assert_eq!(code, 2, "{text}");
    assert!(text.contains("global-max"), "{text}");
}

/// A few tokens of huge norm (six of 32, none carrying half the energy alone) set the
/// calibrated and the dynamic gs of their experts as one such token does, and the other tokens
/// sharing those experts lose their blocks. gs-sweep blamed "the weights, their scales or the
/// reference" (`cause: "not_gs"`, naming only the worst ordinary token) and layertest named no
/// culprit; both now name the tokens of outsized norm, and gs-sweep's cause is `input`.
#[test]
fn a_few_tokens_of_huge_norm_are_blamed_on_the_input_under_calibrated_scales() {
    let dir = tempfile::tempdir().unwrap();
    let seed: u64 = rand::random();
    let t = 32;
    let mut h = nvfp4dbg::moe::synthetic::moe_input(256, t, None, 1e-6, seed);
    use rand::SeedableRng;
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut big = rand::seq::index::sample(&mut r, t, 6).into_vec();
    big.sort_unstable();
    for &b in &big {
        h[b * 256..(b + 1) * 256].iter_mut().for_each(|v| *v *= 1e3);
    }
    write_hidden(dir.path(), &h, t);
    let list: Vec<String> = big.iter().map(|b| b.to_string()).collect();
    let named = format!("tokens {} (output norm 10x", list.join(", "));
    for gs in ["calibrated", "dynamic"] {
        let (code, text, r) = run(
            dir.path(),
            &[
                "gs-sweep",
                "--device",
                "cpu",
                "--input",
                "in.safetensors",
                "--gs",
                gs,
                "--points",
                "5",
            ],
        );
        assert_eq!(code, 1, "seed {seed}, {gs}: {text}");
        let r = r.unwrap();
        assert_eq!(r["summary"]["cause"], "input", "seed {seed}, {gs}: {text}");
        let first = r["failures"][0].as_str().unwrap();
        assert!(
            first.contains("fall below --min-token-cosine") && first.contains(&named),
            "seed {seed}, {gs}: {first}"
        );
    }
    let (code, text, r) = run(
        dir.path(),
        &["layertest", "--device", "cpu", "--input", "in.safetensors"],
    );
    assert_eq!(code, 1, "seed {seed}: {text}");
    let first = r.unwrap()["failures"][0].as_str().unwrap().to_string();
    assert!(first.contains(&named), "seed {seed}: {first}");
}

/// A NaN block scale in an expert no token of the batch reaches: the output cannot show it,
/// but every token an engine routes there comes out NaN. It used to pass (one token reaches 4
/// of 16 experts; 64 tokens of a 256-expert model leave dozens unreached).
#[test]
fn a_nan_block_scale_in_an_expert_the_batch_does_not_reach_fails_naming_it() {
    let base = rand::random::<u16>() as u64;
    let dir = tempfile::tempdir().unwrap();
    let mut unreached = 0;
    for seed in (base..).take(12).map(|s| s.to_string()) {
        let ck = format!("ck{seed}");
        synth(
            dir.path(),
            &ck,
            &["--seed", &seed, "--plant", "nan-block-scale"],
        );
        let planted: Value = serde_json::from_slice(
            &std::fs::read(dir.path().join(&ck).join("planted.json")).unwrap(),
        )
        .unwrap();
        let e = planted["faults"][0]["expert"].as_u64().unwrap();
        let args = ["--checkpoint", &ck, "--device", "cpu", "--tokens", "1"];
        let (code, text, r) = run(
            dir.path(),
            &[&["layertest", "--seed", &seed], &args[..]].concat(),
        );
        assert_eq!(code, 1, "seed {seed}: {text}");
        let r = r.unwrap();
        let headline = r["summary"]["text"].as_str().unwrap().to_string();
        assert!(
            headline.contains("its gate_proj holds 1 NaN block scale code"),
            "seed {seed}: {headline}"
        );
        if r["summary"]["nan_count"].as_u64().unwrap() == 0 {
            unreached += 1;
            assert!(
                headline.starts_with(&format!(
                    "layer 1: expert {e} (no token of this batch reaches it)"
                )),
                "seed {seed}: {headline}"
            );
        }
        // multilayer walks the same layer with the same verdict
        let (code, text, r) = run(
            dir.path(),
            &[&["multilayer", "--seed", &seed], &args[..]].concat(),
        );
        assert_eq!(code, 1, "seed {seed}: {text}");
        let r = r.unwrap();
        let failures = r["failures"].to_string();
        assert!(
            failures.contains(&format!("expert {e} ")) && failures.contains("NaN block scale code"),
            "seed {seed}: {failures}"
        );
        assert_eq!(r["summary"]["first_failing_layer"], 1, "seed {seed}");
        if unreached >= 2 {
            return;
        }
    }
    panic!("from seed {base}: one token reached the planted expert in 11 of 12 checkpoints");
}

/// One expert's gate/up or down `input_scale` 1e6x too large under `--input-scale-reduce
/// global-max` becomes every expert's: the layer's blocks flush to zero. gs-sweep said "66.7%
/// of its activation blocks flush to zero" and layertest led with whichever expert failed
/// first ("100% of its gate/up input blocks flush to zero"), neither naming the expert whose
/// input_scale set the layer-wide max (saturation names its worst experts). Both now lead with
/// it, its projection(s) and how far its input_scale sits above what its amax needs; the clean
/// checkpoint passes both under the same flags.
#[test]
fn an_input_scale_far_too_large_under_global_max_is_named_as_the_flush() {
    use rand::Rng;
    let dir = tempfile::tempdir().unwrap();
    let mut rng = rand::thread_rng();
    let seed: u16 = rng.gen();
    let seed = seed.to_string();
    synth(dir.path(), "ck", &["--seed", &seed]);
    let flags = [
        "--checkpoint",
        "ck",
        "--device",
        "cpu",
        "--seed",
        &seed,
        "--gs",
        "checkpoint",
        "--input-scale-reduce",
        "global-max",
    ];
    let cmds = ["gs-sweep", "layertest"];
    for cmd in cmds {
        let (code, text, _) = run(dir.path(), &[&[cmd][..], &flags[..]].concat());
        assert_eq!(code, 0, "seed {seed} clean {cmd}: {text}");
    }
    let e = rng.gen_range(0..16);
    let projs: &[&str] = match rng.gen_range(0..4) {
        0 => &["gate_proj"],
        1 => &["up_proj"],
        2 => &["gate_proj", "up_proj"],
        _ => &["down_proj"],
    };
    for p in projs {
        scale_scalar(
            &dir.path().join("ck"),
            &format!("model.layers.1.mlp.experts.{e}.{p}.input_scale"),
            1e6,
        );
    }
    let named = format!("expert {e} {} input_scale ", projs.join("/"));
    for cmd in cmds {
        let (code, text, r) = run(dir.path(), &[&[cmd][..], &flags[..]].concat());
        assert_eq!(code, 1, "seed {seed} expert {e} {projs:?} {cmd}: {text}");
        let first = r.unwrap()["failures"][0].as_str().unwrap().to_string();
        let at = first
            .find(&named)
            .unwrap_or_else(|| panic!("seed {seed} {cmd}: `{named}` not in: {first}"));
        assert!(
            first.contains("global-max: every expert's"),
            "seed {seed} {cmd}: {first}"
        );
        // `... input_scale S is Rx the N ...`: R, the planted 1e6 times how far the clean
        // scale was from this batch's amax (a calibration within 100x either way)
        let rest = &first[at + named.len()..];
        let ratio: f64 = rest
            .split(" is ")
            .nth(1)
            .and_then(|x| x.split("x the ").next())
            .and_then(|x| x.parse().ok())
            .unwrap_or_else(|| panic!("seed {seed} {cmd}: no factor in: {first}"));
        assert!((1e4..1e8).contains(&ratio), "seed {seed} {cmd}: {first}");
    }
    // per expert, the scale flushes its own expert's inputs only: its failure names it
    let mut per_expert = flags.to_vec();
    *per_expert.last_mut().unwrap() = "per-expert";
    let (code, text, r) = run(dir.path(), &[&["layertest"][..], &per_expert].concat());
    if code == 1 {
        let failures = r.unwrap()["failures"].to_string();
        let ours = failures
            .split("\",\"")
            .find(|f| f.contains(&format!("expert {e}:")))
            .unwrap_or_else(|| panic!("seed {seed}: expert {e} not failed: {failures}"));
        assert!(
            ours.contains(&named) && ours.contains("its blocks flush to zero"),
            "seed {seed}: {ours}"
        );
    } else {
        assert_eq!(code, 0, "seed {seed} expert {e} per-expert: {text}");
    }
}

/// `synth --plant bad-input-scale` (gate/up input_scale 1000x too small) as `dir/name`: the
/// planted expert.
fn synth_bad_input_scale(dir: &Path, name: &str, seed: &str) -> u64 {
    synth(dir, name, &["--seed", seed, "--plant", "bad-input-scale"]);
    let planted: Value =
        serde_json::from_slice(&std::fs::read(dir.join(name).join("planted.json")).unwrap())
            .unwrap();
    planted["faults"][0]["expert"].as_u64().unwrap()
}

/// A checkpoint input_scale far off is named in the JSON CI scripts read, not only in the
/// failure text: under `--gs checkpoint`, gs-sweep's and layertest's summary list the expert
/// and projection(s) whose input_scale flushes its inputs (`input_scale_flush`, one 1e6x too
/// large) and the expert GEMM input whose gs saturates it (`input_scale_saturate`, the
/// planted bad-input-scale: gate/up 1000x too small). Both used to be in the text only.
#[test]
fn an_input_scale_far_off_is_named_in_the_json() {
    use rand::Rng;
    let dir = tempfile::tempdir().unwrap();
    let mut rng = rand::thread_rng();
    let seed = rng.gen::<u16>().to_string();
    let e = synth_bad_input_scale(dir.path(), "lo", &seed);
    // the same model with expert e's input_scale(s) 1e6x too large instead
    synth(dir.path(), "hi", &["--seed", &seed]);
    let (projs, gemm): (&[&str], &str) = match rng.gen_range(0..4) {
        0 => (&["gate_proj"], "gate/up"),
        1 => (&["up_proj"], "gate/up"),
        2 => (&["gate_proj", "up_proj"], "gate/up"),
        _ => (&["down_proj"], "down"),
    };
    for p in projs {
        scale_scalar(
            &dir.path().join("hi"),
            &format!("model.layers.1.mlp.experts.{e}.{p}.input_scale"),
            1e6,
        );
    }
    let args = |cmd: &'static str, ck: &'static str| -> Vec<&str> {
        let mut a = vec![cmd, "--checkpoint", ck, "--device", "cpu", "--tokens", "32"];
        a.extend(["--gs", "checkpoint", "--seed", &seed]);
        if cmd == "gs-sweep" {
            a.extend(["--points", "5"]);
        }
        a
    };
    let ours = |list: &Value, field: &str| -> Value {
        list[field]
            .as_array()
            .unwrap_or_else(|| panic!("seed {seed}: no {field} list: {list}"))
            .iter()
            .find(|x| x["expert"] == e)
            .unwrap_or_else(|| panic!("seed {seed}: expert {e} not in {field}: {list}"))
            .clone()
    };
    for cmd in ["gs-sweep", "layertest"] {
        let (code, text, r) = run(dir.path(), &args(cmd, "hi"));
        assert_eq!(code, 1, "seed {seed} {cmd} hi {projs:?}: {text}");
        let sm = &r.unwrap()["summary"];
        let x = ours(sm, "input_scale_flush");
        assert_eq!(x["gemm"], gemm, "seed {seed} {cmd}: {x}");
        assert_eq!(
            x["projs"],
            serde_json::json!(projs),
            "seed {seed} {cmd}: {x}"
        );
        let ratio = x["ratio"].as_f64().unwrap();
        assert!((1e3..1e9).contains(&ratio), "seed {seed} {cmd}: {x}");

        let (code, text, r) = run(dir.path(), &args(cmd, "lo"));
        assert_eq!(code, 1, "seed {seed} {cmd} lo: {text}");
        let sm = &r.unwrap()["summary"];
        let x = ours(sm, "input_scale_saturate");
        assert_eq!(x["gemm"], "gate/up", "seed {seed} {cmd}: {x}");
        assert!(
            x["ratio"].as_f64().unwrap() >= 10.0,
            "seed {seed} {cmd}: {x}"
        );
    }
}

/// The checkpoint's input_scale is what the engine takes whatever gs the sweep tries: a
/// gs-sweep under `--gs default` or `--gs VALUE` names one far off in its JSON as `--gs
/// checkpoint` does (`input_scale_saturate` for the planted bad-input-scale, gate/up 1000x
/// too small; `input_scale_flush` for one 1e6x too large), and names none on the clean
/// checkpoint. Both fields used to be null under any gs but `checkpoint`.
#[test]
fn an_input_scale_far_off_is_named_in_the_json_under_any_gs() {
    use rand::Rng;
    let dir = tempfile::tempdir().unwrap();
    let mut rng = rand::thread_rng();
    let seed = rng.gen::<u16>().to_string();
    let e = synth_bad_input_scale(dir.path(), "lo", &seed);
    synth(dir.path(), "clean", &["--seed", &seed]);
    synth(dir.path(), "hi", &["--seed", &seed]);
    let (proj, gemm) = match rng.gen_range(0..3) {
        0 => ("gate_proj", "gate/up"),
        1 => ("up_proj", "gate/up"),
        _ => ("down_proj", "down"),
    };
    scale_scalar(
        &dir.path().join("hi"),
        &format!("model.layers.1.mlp.experts.{e}.{proj}.input_scale"),
        1e6,
    );
    // a fixed gs anywhere from 10x under to 10x over the engines' default
    let value = format!("{:.4e}", 2688.0 * 10f64.powf(rng.gen_range(-1.0..1.0)));
    for gs in ["default", value.as_str()] {
        let json = |ck: &str| -> (String, Value) {
            let (code, text, r) = run(
                dir.path(),
                &[
                    "gs-sweep",
                    "--checkpoint",
                    ck,
                    "--device",
                    "cpu",
                    "--tokens",
                    "32",
                    "--points",
                    "5",
                    "--gs",
                    gs,
                    "--seed",
                    &seed,
                ],
            );
            assert!(code == 0 || code == 1, "seed {seed} {ck} --gs {gs}: {text}");
            (text, r.unwrap()["summary"].clone())
        };
        let list = |sm: &Value, field: &str| -> Vec<Value> {
            sm[field]
                .as_array()
                .unwrap_or_else(|| panic!("seed {seed} --gs {gs}: no {field} list: {sm}"))
                .clone()
        };
        // and the text names them beside the verdict on the gs in use
        let section = "The checkpoint's input scales (what an engine takes)";
        let (text, sm) = json("lo");
        let named = format!("expert {e} gate_proj/up_proj input_scale");
        assert!(
            text.contains(section) && text.contains(&named),
            "seed {seed} --gs {gs}: {named} not in\n{text}"
        );
        let x = list(&sm, "input_scale_saturate");
        let x = x
            .iter()
            .find(|x| x["expert"] == e && x["gemm"] == "gate/up")
            .unwrap_or_else(|| panic!("seed {seed} --gs {gs}: expert {e} not saturating: {sm}"));
        assert!(
            x["ratio"].as_f64().unwrap() >= 10.0,
            "seed {seed} --gs {gs}: {x}"
        );

        let (text, sm) = json("hi");
        let named = format!("expert {e} {proj} input_scale");
        assert!(
            text.contains(section) && text.contains(&named),
            "seed {seed} --gs {gs}: {named} not in\n{text}"
        );
        let x = list(&sm, "input_scale_flush");
        let x = x
            .iter()
            .find(|x| x["expert"] == e)
            .unwrap_or_else(|| panic!("seed {seed} --gs {gs}: expert {e} not flushing: {sm}"));
        assert_eq!(x["gemm"], gemm, "seed {seed} --gs {gs}: {x}");
        assert_eq!(x["projs"], serde_json::json!([proj]), "seed {seed}: {x}");
        let ratio = x["ratio"].as_f64().unwrap();
        assert!((1e3..1e9).contains(&ratio), "seed {seed} --gs {gs}: {x}");

        // no false alarm: the clean checkpoint's input scales fit its inputs
        let (text, sm) = json("clean");
        assert!(
            !text.contains(section),
            "seed {seed} --gs {gs} clean:\n{text}"
        );
        for field in ["input_scale_saturate", "input_scale_flush"] {
            assert!(
                list(&sm, field).is_empty(),
                "seed {seed} --gs {gs} clean: {field}: {sm}"
            );
        }
    }
}

/// The checkpoint's input scales are what an engine takes whatever gs layertest runs under:
/// the default layertest (gs `calibrated`, or `dynamic`) passes a checkpoint whose own input
/// scales are far off, exit 0, but names them in its JSON and a note: the planted
/// bad-input-scale (gate/up 1000x too small) in `input_scale_saturate`, one projection's 1e6x
/// too large in `input_scale_flush`, input scales holding their reciprocals (of ones
/// calibrated on the batch) in `input_scale_reciprocal`. The clean checkpoint, and the one
/// calibrated on the batch, name none. All three were null unless an expert failed (and the
/// reciprocals unless under `--gs checkpoint`).
#[test]
fn layertest_names_the_checkpoint_input_scales_under_a_passing_gs() {
    use rand::Rng;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let mut rng = rand::thread_rng();
    let seed: u64 = rng.gen::<u16>().into();
    let s = seed.to_string();
    let e = synth_bad_input_scale(d, "lo", &s);
    for ck in ["clean", "hi", "recip", "cal"] {
        synth(d, ck, &["--seed", &s]);
    }
    let (proj, gemm) = match rng.gen_range(0..3) {
        0 => ("gate_proj", "gate/up"),
        1 => ("up_proj", "gate/up"),
        _ => ("down_proj", "down"),
    };
    scale_scalar(
        &d.join("hi"),
        &format!("model.layers.1.mlp.experts.{e}.{proj}.input_scale"),
        1e6,
    );
    // input scales calibrated on the test's batch (in BF16, as layertest reads it), and
    // their reciprocals
    let t = 32;
    let h: Vec<f32> = massive_channel_input(t, seed)
        .into_iter()
        .map(nvfp4dbg::moe::forward::bf16)
        .collect();
    write_hidden(d, &h, t);
    let mc = nvfp4dbg::checkpoint::MoeCheckpoint::open(&d.join("cal")).unwrap();
    let layer = mc.load_layer(1).unwrap();
    let routing = nvfp4dbg::moe::route(&layer, &h, None).unwrap();
    let (a1, a2) = nvfp4dbg::moe::forward::expert_input_amax(&layer, &h, &routing).unwrap();
    let max = |a: &[Option<f32>]| a.iter().flatten().fold(0f32, |m, &v| m.max(v));
    for x in 0..layer.experts.len() {
        for (p, a) in [
            ("gate_proj", a1[x].unwrap_or(max(&a1))),
            ("up_proj", a1[x].unwrap_or(max(&a1))),
            ("down_proj", a2[x].unwrap_or(max(&a2))),
        ] {
            let name = format!("model.layers.1.mlp.experts.{x}.{p}.input_scale");
            set_scalar(&d.join("cal"), &name, a / 2688.0);
            set_scalar(&d.join("recip"), &name, 2688.0 / a);
        }
    }
    let layertest = |ck: &str, gs: Option<&str>| -> (String, Value) {
        let mut args = vec!["layertest", "--checkpoint", ck, "--device", "cpu"];
        args.extend(match ck {
            "recip" | "cal" => ["--input", "in.safetensors"],
            _ => ["--tokens", "32"],
        });
        args.extend(["--seed", &s]);
        if let Some(g) = gs {
            args.extend(["--gs", g]);
        }
        let (code, text, r) = run(d, &args);
        let what = format!("seed {s} {ck} --gs {gs:?}");
        assert_eq!(code, 0, "{what}: {text}");
        let sm = r.unwrap()["summary"].clone();
        assert_eq!(sm["gs"], gs.unwrap_or("calibrated"), "{what}: {sm}");
        assert!(sm["cause"].is_null(), "{what}: {sm}");
        (text, sm)
    };
    let list = |sm: &Value, field: &str| -> Vec<Value> {
        sm[field]
            .as_array()
            .unwrap_or_else(|| panic!("seed {s}: no {field} list: {sm}"))
            .clone()
    };
    let note = "The checkpoint's input scales (what an engine takes)";
    for gs in [None, Some("dynamic")] {
        let (text, sm) = layertest("lo", gs);
        let x = list(&sm, "input_scale_saturate");
        let x = x
            .iter()
            .find(|x| x["expert"] == e && x["gemm"] == "gate/up")
            .unwrap_or_else(|| panic!("seed {s} {gs:?}: expert {e} not saturating: {sm}"));
        assert!(x["ratio"].as_f64().unwrap() >= 10.0, "seed {s}: {x}");
        let named = format!("expert {e} gate_proj/up_proj input_scale");
        assert!(
            text.contains(note) && text.contains(&named),
            "seed {s} {gs:?}: {text}"
        );
    }
    let (text, sm) = layertest("hi", None);
    let x = list(&sm, "input_scale_flush");
    let x = x
        .iter()
        .find(|x| x["expert"] == e)
        .unwrap_or_else(|| panic!("seed {s}: expert {e} not flushing: {sm}"));
    assert_eq!(x["gemm"], gemm, "seed {s}: {x}");
    assert_eq!(x["projs"], serde_json::json!([proj]), "seed {s}: {x}");
    assert!(
        text.contains(note) && text.contains(&format!("expert {e} {proj} input_scale")),
        "seed {s}: {text}"
    );

    let (text, sm) = layertest("recip", None);
    let x = &sm["input_scale_reciprocal"];
    let tensor = x["tensor"]
        .as_str()
        .unwrap_or_else(|| panic!("seed {s}: reciprocals not named: {sm}"));
    assert!(
        tensor.starts_with("model.layers.1.mlp.experts.") && tensor.ends_with("_proj.input_scale"),
        "seed {s}: {x}"
    );
    let (st, cal) = (
        x["stored"].as_f64().unwrap(),
        x["calibrated"].as_f64().unwrap(),
    );
    assert!((st * cal - 1.0).abs() < 1e-3, "seed {s}: {x}");
    assert!(
        text.contains(note) && text.contains(tensor),
        "seed {s}: {text}"
    );

    // no false alarm: input scales that fit their inputs name nothing
    for ck in ["clean", "cal"] {
        let (text, sm) = layertest(ck, None);
        for field in ["input_scale_saturate", "input_scale_flush"] {
            assert!(list(&sm, field).is_empty(), "seed {s} {ck}: {field}: {sm}");
        }
        assert!(
            sm["input_scale_reciprocal"].is_null(),
            "seed {s} {ck}: {sm}"
        );
        assert!(!text.contains(note), "seed {s} {ck}: {text}");
    }
}
