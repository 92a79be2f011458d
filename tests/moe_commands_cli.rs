//! `gs-sweep` and `multilayer` driven through the real binary.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

fn run(dir: &Path, args: &[&str]) -> (i32, String, Option<Value>) {
    let out = Command::new(env!("CARGO_BIN_EXE_nvfp4dbg"))
        .current_dir(dir)
        .args(args)
        .args(["--report-dir", "rep", "--quiet"])
        .output()
        .expect("run nvfp4dbg");
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    let report = std::fs::read(dir.join("rep/report.json"))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok());
    (out.status.code().unwrap_or(-1), text, report)
}

fn synth(dir: &Path, args: &[&str]) {
    let out = Command::new(env!("CARGO_BIN_EXE_nvfp4dbg"))
        .current_dir(dir)
        .arg("synth")
        .args(args)
        .args(["--no-report-dir", "--quiet"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn gs_sweep_finds_the_default_gs_costly_and_writes_its_plots() {
    let seed = rand::random::<u16>().to_string();
    let dir = tempfile::tempdir().unwrap();
    let (code, text, r) = run(
        dir.path(),
        &[
            "gs-sweep", "--device", "cpu", "--tokens", "24", "--points", "9", "--seed", &seed,
        ],
    );
    // the engines' default (amax 1) saturates realistic activations
    assert_eq!(code, 1, "seed {seed}: {text}");
    let r = r.unwrap();
    assert_eq!(r["command"], "gs-sweep");
    let s = &r["summary"];
    assert_eq!(s["gs"], "default");
    assert_eq!(s["cause"], "gs", "seed {seed}: {s}");
    assert!(s["loss"].as_f64().unwrap() > 0.05, "seed {seed}: {s}");
    assert!(s["default_loss"].as_f64().unwrap() > s["warmup_loss"].as_f64().unwrap() - 1e-9);
    // the saturated blocks are the ones at the E4M3 maximum, said so; and the failure names
    // the gs source that fixes it (the sweep's best is one gs for every GEMM, which no engine
    // configures)
    let f0 = r["failures"][0].as_str().unwrap();
    assert!(
        f0.contains("activation blocks saturate (block scale at 448"),
        "seed {seed}: {f0}"
    );
    let fits = f0
        .split("; the source that fits: `")
        .nth(1)
        .unwrap_or_else(|| panic!("seed {seed}: {f0}"));
    let name = fits.split('`').next().unwrap();
    let p = r["sources"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["label"] == name)
        .unwrap();
    let best = r["best"]["cosine"].as_f64().unwrap();
    assert!(
        name != "default" && best - p["cosine"].as_f64().unwrap() <= 0.01,
        "seed {seed}: {f0}"
    );
    assert_eq!(r["sweep"].as_array().unwrap().len(), 9);
    let sources: Vec<&str> = r["sources"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["label"].as_str().unwrap())
        .collect();
    assert_eq!(
        sources,
        ["default", "checkpoint", "warmup", "calibrated", "dynamic"]
    );
    let default = &r["sources"][0];
    assert!(
        default["blocks"]["saturated_pct"].as_f64().unwrap() > 10.0,
        "{default}"
    );
    for f in ["gs-sweep.svg", "gs-sweep-blocks.svg", "report.md"] {
        let t = std::fs::read_to_string(dir.path().join("rep").join(f)).unwrap();
        assert!(!t.is_empty());
    }
    let svg = std::fs::read_to_string(dir.path().join("rep/gs-sweep.svg")).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("polyline") && svg.contains("default"));
    // with calibrated scales it passes
    let (code, text, _) = run(
        dir.path(),
        &[
            "gs-sweep",
            "--device",
            "cpu",
            "--tokens",
            "24",
            "--points",
            "5",
            "--seed",
            &seed,
            "--gs",
            "calibrated",
        ],
    );
    assert_eq!(code, 0, "seed {seed}: {text}");
}

#[test]
fn gs_sweep_catches_a_bad_checkpoint_input_scale() {
    let dir = tempfile::tempdir().unwrap();
    synth(dir.path(), &["--out", "ck", "--plant", "bad-input-scale"]);
    let (code, text, r) = run(
        dir.path(),
        &[
            "gs-sweep",
            "--checkpoint",
            "ck",
            "--device",
            "cpu",
            "--tokens",
            "32",
            "--points",
            "5",
            "--gs",
            "checkpoint",
        ],
    );
    assert_eq!(code, 1, "{text}");
    let r = r.unwrap();
    assert_eq!(r["summary"]["cause"], "gs", "{text}");
    let f = r["failures"].to_string();
    assert!(f.contains("checkpoint") && f.contains("loses"), "{f}");
    synth(dir.path(), &["--out", "clean"]);
    let (code, text, _) = run(
        dir.path(),
        &[
            "gs-sweep",
            "--checkpoint",
            "clean",
            "--device",
            "cpu",
            "--tokens",
            "32",
            "--points",
            "5",
            "--gs",
            "checkpoint",
        ],
    );
    assert_eq!(code, 0, "{text}");
}

#[test]
fn multilayer_runs_and_reports_each_layer() {
    let seed = rand::random::<u16>().to_string();
    let dir = tempfile::tempdir().unwrap();
    let (code, text, r) = run(
        dir.path(),
        &[
            "multilayer",
            "--device",
            "cpu",
            "--tokens",
            "16",
            "--layers",
            "1..4",
            "--seed",
            &seed,
        ],
    );
    assert_eq!(code, 0, "seed {seed}: {text}");
    let r = r.unwrap();
    let rows = r["per_layer"].as_array().unwrap();
    assert_eq!(rows.len(), 3);
    assert_eq!(rows[0]["layer"], 1);
    assert!(rows[0]["growth"].is_null());
    // the first layer's input is identical on both paths: its error is its own
    assert!((rows[0]["amplification"].as_f64().unwrap() - 1.0).abs() < 1e-6);
    assert!(rows[2]["growth"].as_f64().unwrap() > 0.0);
    // errors accumulate along the residual stream
    let rel: Vec<f64> = rows
        .iter()
        .map(|x| x["residual"]["rel_l2"].as_f64().unwrap())
        .collect();
    assert!(rel[2] > rel[0], "seed {seed}: {rel:?}");
    assert!(
        std::fs::read_to_string(dir.path().join("rep/multilayer.svg"))
            .unwrap()
            .contains("residual")
    );
    // a layer outside the model is bad usage
    let (code, text, _) = run(
        dir.path(),
        &["multilayer", "--device", "cpu", "--layers", "0..2"],
    );
    assert_eq!(code, 2, "{text}");
    let (code, text, _) = run(
        dir.path(),
        &["multilayer", "--device", "cpu", "--layers", "x"],
    );
    assert_eq!(code, 2, "{text}");
}

/// A fixed `--gs` was labelled "calibrated on the BF16 model's activations" in the table.
#[test]
fn multilayer_labels_a_fixed_gs_as_fixed_not_calibrated() {
    let seed = rand::random::<u16>().to_string();
    let gs = format!("{}", 50 + rand::random::<u16>() % 2000);
    let dir = tempfile::tempdir().unwrap();
    for (g, want, not) in [
        (gs.as_str(), "fixed", "calibrated on"),
        ("default", "fixed", "calibrated on"),
        ("calibrated", "calibrated on the BF16", "fixed"),
    ] {
        let args = [
            "multilayer",
            "--device",
            "cpu",
            "--tokens",
            "8",
            "--layers",
            "1..3",
            "--seed",
            &seed,
            "--gs",
            g,
            "--min-cosine=-1",
            "--min-layer-cosine=-1",
        ];
        let (code, text, r) = run(dir.path(), &args);
        assert!(code == 0 || code == 1, "seed {seed} gs {g}: {text}");
        let row = text
            .lines()
            .find(|l| l.contains("activation gs"))
            .unwrap_or_else(|| panic!("seed {seed}: no gs row in {text}"));
        assert!(
            row.contains(want) && !row.contains(not),
            "seed {seed} gs {g}: {row}"
        );
        assert!(r.is_some(), "seed {seed}");
    }
}

#[test]
fn multilayer_names_the_layer_a_nan_starts_in() {
    let dir = tempfile::tempdir().unwrap();
    synth(
        dir.path(),
        &[
            "--out",
            "ck",
            "--layers",
            "4",
            "--plant",
            "nan-block-scale@2",
        ],
    );
    let (code, text, r) = run(
        dir.path(),
        &[
            "multilayer",
            "--checkpoint",
            "ck",
            "--device",
            "cpu",
            "--tokens",
            "16",
        ],
    );
    assert_eq!(code, 1, "{text}");
    let r = r.unwrap();
    assert_eq!(r["summary"]["first_nonfinite_layer"], 2, "{text}");
    // the expert that produces it leads, the stream it poisons follows
    let failures = r["failures"].to_string();
    assert!(
        r["failures"][0]
            .as_str()
            .unwrap()
            .starts_with("layer 2: expert ")
            && failures.contains("NaN in the NVFP4 residual stream from layer 2"),
        "{failures}"
    );
    assert_eq!(r["per_layer"][0]["residual"]["nan_count"], 0);
}

#[test]
fn multilayer_names_a_broken_expert_its_layer_hides() {
    // one expert's gate and up swapped in layer 3 of 5: the layer alone stays near cosine 0.97
    // (above --min-layer-cosine), the residual stream near 0.999; only the expert shows it
    let seed = rand::random::<u16>().to_string();
    let dir = tempfile::tempdir().unwrap();
    synth(
        dir.path(),
        &[
            "--out",
            "ck",
            "--layers",
            "6",
            "--seed",
            &seed,
            "--plant",
            "swap-gate-up@3",
        ],
    );
    let args = ["multilayer", "--checkpoint", "ck", "--device", "cpu"];
    let (code, text, r) = run(dir.path(), &args);
    assert_eq!(code, 1, "seed {seed}: {text}");
    let r = r.unwrap();
    let failures: Vec<&str> = r["failures"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|v| v.as_str())
        .collect();
    assert!(
        failures.iter().any(|m| m.starts_with("layer 3: expert ")),
        "seed {seed}: {failures:?}"
    );
    assert!(
        !failures
            .iter()
            .any(|m| m.contains(": expert ") && !m.starts_with("layer 3:")),
        "seed {seed}: only layer 3 holds a broken expert: {failures:?}"
    );
    assert_eq!(r["per_layer"][2]["layer"], 3, "{text}");
    assert!(!r["per_layer"][2]["expert_failures"]
        .as_array()
        .unwrap()
        .is_empty());
    // the same checkpoint without the plant passes
    synth(
        dir.path(),
        &["--out", "ok", "--layers", "6", "--seed", &seed],
    );
    let (code, text, _) = run(
        dir.path(),
        &["multilayer", "--checkpoint", "ok", "--device", "cpu"],
    );
    assert_eq!(code, 0, "seed {seed}: {text}");
}

/// The expert whose NaN block scale makes a layer's NaN is named (multilayer named the layer
/// and the first NaN's token and channel, and no expert; layertest did).
#[test]
fn multilayer_names_the_expert_that_makes_a_layers_nan() {
    let seed = rand::random::<u16>().to_string();
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("synth.json");
    synth(
        dir.path(),
        &[
            "--out",
            "ck",
            "--seed",
            &seed,
            "--plant",
            "nan-block-scale@2",
            "--json",
            json.to_str().unwrap(),
        ],
    );
    let planted: Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let expert = planted["planted"][0]["expert"].as_u64().unwrap();
    let (code, text, r) = run(
        dir.path(),
        &["multilayer", "--checkpoint", "ck", "--device", "cpu"],
    );
    assert_eq!(code, 1, "seed {seed}: {text}");
    let failures = r.unwrap()["failures"].to_string();
    assert!(
        failures.contains(&format!("layer 2: expert {expert} produces NaN/Inf")),
        "seed {seed}: {failures}"
    );
}

#[test]
fn multilayer_names_the_first_bad_layer_first() {
    // guards: a NaN stream from layer 4 on dropped layer 2's broken expert from the failures,
    // and the whole stack's residual cosine headed the verdict over the layer that broke it
    let seed = rand::random::<u16>().to_string();
    let dir = tempfile::tempdir().unwrap();
    synth(
        dir.path(),
        &[
            "--out",
            "ck",
            "--layers",
            "6",
            "--seed",
            &seed,
            "--plant",
            "swap-gate-up@2",
            "--plant",
            "nan-block-scale@4",
        ],
    );
    let strs = |r: &Value| -> Vec<String> {
        r["failures"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap().to_string())
            .collect()
    };
    let (code, text, r) = run(
        dir.path(),
        &["multilayer", "--checkpoint", "ck", "--device", "cpu"],
    );
    assert_eq!(code, 1, "seed {seed}: {text}");
    let r = r.unwrap();
    let failures = strs(&r);
    assert!(
        failures[0].starts_with("layer 2: expert "),
        "seed {seed}: {failures:?}"
    );
    assert!(
        failures
            .iter()
            .any(|m| m.starts_with("NaN in the NVFP4 residual stream from layer 4")),
        "seed {seed}: {failures:?}"
    );
    assert!(r["summary"]["text"]
        .as_str()
        .unwrap()
        .starts_with("layer 2: expert "));
    assert_eq!(r["summary"]["first_nonfinite_layer"], 4, "seed {seed}");
    // the JSON names the first bad layer, not only its sentences (a broken expert is no NaN:
    // first_nonfinite_layer is 4)
    assert_eq!(r["summary"]["first_failing_layer"], 2, "seed {seed}");
    let failing = r["summary"]["failing_layers"].as_array().unwrap();
    assert!(
        failing[0] == 2 && failing.contains(&Value::from(4)),
        "seed {seed}: {failing:?}"
    );
    // a residual-stream bar no stack meets fails too, after the layer that broke it
    synth(
        dir.path(),
        &[
            "--out",
            "ck2",
            "--layers",
            "6",
            "--seed",
            &seed,
            "--plant",
            "swap-gate-up@3",
        ],
    );
    let (code, text, r) = run(
        dir.path(),
        &[
            "multilayer",
            "--checkpoint",
            "ck2",
            "--device",
            "cpu",
            "--min-cosine",
            "0.99999",
        ],
    );
    assert_eq!(code, 1, "seed {seed}: {text}");
    let r = r.unwrap();
    let failures = strs(&r);
    assert!(
        failures[0].starts_with("layer 3: expert "),
        "seed {seed}: {failures:?}"
    );
    // the stack's cosine after the last layer is no layer's failure: layer 3 alone is named
    assert_eq!(
        r["summary"]["failing_layers"],
        serde_json::json!([3]),
        "seed {seed}"
    );
    assert!(
        failures
            .last()
            .unwrap()
            .starts_with("residual-stream cosine"),
        "seed {seed}: {failures:?}"
    );
}

/// Out-of-range limits are usage errors naming the flag: a sweep of fewer than 2 points ran 2
/// without a word, a negative --max-loss or --max-amplification failed every layer.
#[test]
fn sweep_points_and_limits_out_of_range_are_usage_errors() {
    let dir = tempfile::tempdir().unwrap();
    let cases: [(&str, &str, &[&str]); 3] = [
        ("gs-sweep", "--points", &["0", "1", "-3", "x"]),
        ("gs-sweep", "--max-loss", &["-0.1", "2.5", "nan", "x"]),
        (
            "multilayer",
            "--max-amplification",
            &["-1", "0", "inf", "x"],
        ),
    ];
    // a gs value whose reciprocal (the dequant scale) is not a normal f32: 1e-45 ran the
    // layer into NaN (exit 1)
    let gs: &[&str] = &["1e-45", "3e38"];
    let cases = cases.into_iter().chain([
        ("layertest", "--gs", gs),
        ("gs-sweep", "--gs", gs),
        ("multilayer", "--gs", gs),
    ]);
    for (cmd, flag, bad) in cases {
        for v in bad {
            let kv = format!("{flag}={v}");
            let a = [cmd, "--device", "cpu", kv.as_str()];
            let (code, text, _) = run(dir.path(), &a);
            assert_eq!(code, 2, "{a:?}: {text}");
            assert!(
                text.contains(flag) && !text.contains("panicked"),
                "{a:?}: {text}"
            );
        }
    }
}

#[test]
fn cosine_thresholds_outside_minus_one_to_one_are_usage_errors() {
    let dir = tempfile::tempdir().unwrap();
    let cases: [(&[&str], &str); 8] = [
        (&["layertest", "--device", "cpu"], "--min-cosine"),
        (&["layertest", "--device", "cpu"], "--min-expert-cosine"),
        (&["multilayer", "--device", "cpu"], "--min-cosine"),
        (&["multilayer", "--device", "cpu"], "--min-layer-cosine"),
        (&["multilayer", "--device", "cpu"], "--min-expert-cosine"),
        (&["compare-weights", "a", "b"], "--min-cosine"),
        (&["compare-outputs", "a", "b"], "--min-cosine"),
        (&["bisect", "a", "b"], "--min-cosine"),
    ];
    for (args, flag) in cases {
        for v in ["1.5", "nan", "-inf", "x"] {
            let kv = format!("{flag}={v}");
            let mut a = args.to_vec();
            a.push(&kv);
            let (code, text, _) = run(dir.path(), &a);
            assert_eq!(code, 2, "{a:?}: {text}");
            assert!(
                text.contains(flag) && !text.contains("panicked"),
                "{a:?}: {text}"
            );
        }
        // a cosine in range is accepted by the parser (what the command then does with `a`
        // and `b` is another matter; the layer commands stop at a checkpoint that is not
        // there rather than run the synthetic layer); a negative one after a space too, where
        // clap read `-0.1` as an unknown flag
        for v in ["0.5", "-0.1"] {
            let mut a = args.to_vec();
            a.extend([flag, v]);
            if a[1] == "--device" {
                a.extend(["--checkpoint", "not-there"]);
            }
            let (code, text, _) = run(dir.path(), &a);
            assert_eq!(code, 2, "{a:?}: {text}");
            assert!(
                !text.contains("a cosine lies in")
                    && !text.contains("unexpected argument")
                    && !text.contains("panicked"),
                "{a:?}: {text}"
            );
        }
    }
}

#[test]
fn a_gs_sweep_span_past_f32_is_a_usage_error() {
    let dir = tempfile::tempdir().unwrap();
    for v in ["nan", "0", "31", "1e6"] {
        let kv = format!("--span={v}");
        let (code, text, _) = run(dir.path(), &["gs-sweep", "--device", "cpu", &kv]);
        assert_eq!(code, 2, "{v}: {text}");
        assert!(text.contains("--span"), "{v}: {text}");
    }
    // each point runs the layer: 1e8 of them ran for hours rather than being refused
    for v in ["1", "1001", "100000000"] {
        let kv = format!("--points={v}");
        let (code, text, _) = run(dir.path(), &["gs-sweep", "--device", "cpu", &kv]);
        assert_eq!(code, 2, "{v}: {text}");
        assert!(text.contains("--points"), "{v}: {text}");
    }
}

/// Set `first_k_dense_replace` in the config.json of checkpoint `ck`.
fn set_dense_layers(ck: &Path, k: usize) {
    let p = ck.join("config.json");
    let mut c: Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    c["first_k_dense_replace"] = k.into();
    std::fs::write(&p, c.to_string()).unwrap();
}

/// A layer that holds routed experts but that config.json's first_k_dense_replace makes dense
/// is never run as MoE by an engine: every command taking a layer refuses it (exit 2, naming
/// config.json, the field, the layer and the MoE layers), and the default layer is an MoE one;
/// multilayer's default walk through every MoE layer refuses it too. (They used to run those
/// experts and give a verdict about weights nobody uses.)
#[test]
fn a_layer_config_json_makes_dense_is_refused_by_every_command() {
    let seed = rand::random::<u16>().to_string();
    let dir = tempfile::tempdir().unwrap();
    // tiny: 3 layers, layer 0 dense, experts in layers 1 and 2
    synth(dir.path(), &["--out", "ck", "--seed", &seed]);
    let ck = dir.path().join("ck");
    set_dense_layers(&ck, 2);
    let cpu = ["--checkpoint", "ck", "--device", "cpu", "--tokens", "16"];
    let with = |cmd: &str, extra: &[&str]| {
        let mut a = vec![cmd];
        a.extend_from_slice(&cpu);
        a.extend_from_slice(extra);
        run(dir.path(), &a)
    };
    for (cmd, extra) in [
        ("layertest", ["--layer", "1"]),
        ("gs-sweep", ["--layer", "1"]),
        ("multilayer", ["--layers", "1..3"]),
    ] {
        let (code, text, _) = with(cmd, &extra);
        assert_eq!(code, 2, "seed {seed} {cmd}: {text}");
        for want in [
            "config.json",
            "first_k_dense_replace = 2",
            "layer 1 is not an MoE layer",
            "MoE layers: 2",
        ] {
            assert!(
                text.contains(want),
                "seed {seed} {cmd}: no `{want}` in {text}"
            );
        }
    }
    // without --layer: the MoE layer, not the first layer holding experts
    let (code, text, r) = with("layertest", &[]);
    assert_ne!(code, 2, "seed {seed}: {text}");
    assert_eq!(r.unwrap()["summary"]["layer"], 2, "seed {seed}: {text}");
    // multilayer's walk through every MoE layer would step over layer 1, which an engine
    // builds as a dense MLP it finds no weights for: refused, naming it; the MoE layers alone
    // walk when asked for
    let (code, text, _) = with("multilayer", &[]);
    assert_eq!(code, 2, "seed {seed}: {text}");
    assert!(
        text.contains("layer 1 is not an MoE layer") && text.contains("first_k_dense_replace = 2"),
        "seed {seed}: {text}"
    );
    let (code, text, r) = with("multilayer", &["--layers", "2"]);
    assert_ne!(code, 2, "seed {seed}: {text}");
    let rows = r.unwrap()["per_layer"].clone();
    let layers: Vec<u64> = rows
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["layer"].as_u64().unwrap())
        .collect();
    assert_eq!(layers, [2], "seed {seed}: {text}");
    // every layer holding experts made dense: no MoE layer, and why
    set_dense_layers(&ck, 3);
    let (code, text, _) = with("gs-sweep", &[]);
    assert_eq!(code, 2, "seed {seed}: {text}");
    assert!(
        text.contains("no MoE layer") && text.contains("first_k_dense_replace = 3"),
        "seed {seed}: {text}"
    );
}

#[test]
fn a_gs_too_small_is_named_as_flushing_blocks_not_saturating_them() {
    // gs 1e-30 flushes every activation block to zero; the verdict used to say "0.0% of its
    // activation blocks saturate", pointing away from the cause
    let dir = tempfile::tempdir().unwrap();
    let (code, text, r) = run(
        dir.path(),
        &[
            "gs-sweep", "--device", "cpu", "--tokens", "16", "--points", "5", "--gs", "1e-30",
        ],
    );
    assert_eq!(code, 1, "{text}");
    let r = r.unwrap();
    assert_eq!(r["summary"]["cause"], "gs", "{text}");
    let f = r["failures"][0].as_str().unwrap().to_string();
    assert!(f.contains("flush to zero (gs too small)"), "{f}");
    assert!(!f.contains("saturate"), "{f}");
}

/// Tensor `name` of a sharded synth checkpoint: its shard, the shard's bytes, the tensor's
/// header entry and the offset of its first byte.
fn locate(ck: &Path, name: &str) -> (PathBuf, Vec<u8>, Value, usize) {
    let index: Value =
        serde_json::from_slice(&std::fs::read(ck.join("model.safetensors.index.json")).unwrap())
            .unwrap();
    let file = ck.join(index["weight_map"][name].as_str().unwrap());
    let b = std::fs::read(&file).unwrap();
    let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&b[8..8 + n]).unwrap();
    let at = 8 + n + header[name]["data_offsets"][0].as_u64().unwrap() as usize;
    (file, b, header[name].clone(), at)
}

/// Overwrite the F32 scalar `name` of a sharded synth checkpoint in place.
fn set_scalar(ck: &Path, name: &str, v: f32) {
    let (file, mut b, _, at) = locate(ck, name);
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
    std::fs::write(&file, b).unwrap();
}

/// A zero or NaN input_scale in use under `--gs checkpoint` is bad input (exit 2) named by
/// layer, expert, projection and value, as a negative one is. It used to surface as an
/// anonymous NaN in the residual stream.
#[test]
fn multilayer_names_a_zero_or_nan_checkpoint_input_scale() {
    use rand::{Rng, SeedableRng};
    let seed: u64 = rand::random();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let dir = tempfile::tempdir().unwrap();
    synth(
        dir.path(),
        &["--out", "ck", "--layers", "4", "--seed", &seed.to_string()],
    );
    let (layer, expert) = (rng.gen_range(1..4usize), rng.gen_range(0..16usize));
    // a zero gate_proj or up_proj alone is not in use: gs1 takes the larger of the two
    let (projs, v): (&[&str], f32) = match rng.gen_range(0..5) {
        0 => (&["down_proj"], 0.0),
        1 => (&["down_proj"], f32::NAN),
        2 => (&["gate_proj"], f32::NAN),
        3 => (&["up_proj"], f32::NAN),
        _ => (&["gate_proj", "up_proj"], 0.0),
    };
    for p in projs {
        set_scalar(
            &dir.path().join("ck"),
            &format!("model.layers.{layer}.mlp.experts.{expert}.{p}.input_scale"),
            v,
        );
    }
    let (code, text, _) = run(
        dir.path(),
        &[
            "multilayer",
            "--checkpoint",
            "ck",
            "--device",
            "cpu",
            "--tokens",
            "8",
            "--gs",
            "checkpoint",
        ],
    );
    let named = format!("layer {layer} expert {expert} {}", projs.join("/"));
    assert_eq!(code, 2, "seed {seed}: {named} = {v}: {text}");
    assert!(
        text.contains(&named) && text.contains(&format!("input_scale = {v}")),
        "seed {seed}: {named} = {v}: {text}"
    );
}

/// A NaN in a layer's post_attention_layernorm weight is bad input naming the tensor and
/// element; it used to surface as "NaN in the NVFP4 residual stream from layer L on".
#[test]
fn multilayer_names_a_nan_in_a_norm_weight() {
    use rand::{Rng, SeedableRng};
    let seed: u64 = rand::random();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let dir = tempfile::tempdir().unwrap();
    synth(
        dir.path(),
        &["--out", "ck", "--layers", "4", "--seed", &seed.to_string()],
    );
    let (layer, at) = (rng.gen_range(1..4usize), rng.gen_range(0..256usize));
    let name = format!("model.layers.{layer}.post_attention_layernorm.weight");
    let ck = dir.path().join("ck");
    let (file, mut b, entry, first) = locate(&ck, &name);
    assert_eq!(entry["dtype"], "BF16");
    let off = first + 2 * at;
    b[off..off + 2].copy_from_slice(&[0xC0, 0x7F]);
    std::fs::write(&file, b).unwrap();
    let (code, text, _) = run(
        dir.path(),
        &[
            "multilayer",
            "--checkpoint",
            "ck",
            "--device",
            "cpu",
            "--tokens",
            "8",
        ],
    );
    assert_eq!(code, 2, "seed {seed}: {name}[{at}]: {text}");
    assert!(
        text.contains(&format!("tensor `{name}`: element [{at}] is NaN")),
        "seed {seed}: {text}"
    );
}

/// `synth --plant bad-input-scale` (gate/up input_scale 1000x too small) as `dir/out`: the
/// planted expert.
fn synth_bad_input_scale(dir: &Path, out: &str, seed: &str) -> u64 {
    synth(
        dir,
        &["--out", out, "--plant", "bad-input-scale", "--seed", seed],
    );
    let planted: Value =
        serde_json::from_slice(&std::fs::read(dir.join(out).join("planted.json")).unwrap())
            .unwrap();
    planted["faults"][0]["expert"].as_u64().unwrap()
}

/// One expert's checkpoint input_scale 1000x too small (gate/up, planted; down, set here)
/// saturates that expert's activations: gs-sweep under `--gs checkpoint` names the expert
/// and the GEMM. It used to say only that the layer's gs loses cosine. One expert of 32
/// tokens moves the layer's cosine by only 0.011-0.032 (seeds measured), so the test asks
/// for a loss of 0.005, not the default 0.01 (at 100x, seed 25087's down lost 0.0089 and
/// passed).
#[test]
fn gs_sweep_names_the_expert_whose_input_scale_saturates() {
    let seed = rand::random::<u16>().to_string();
    let dir = tempfile::tempdir().unwrap();
    let e = synth_bad_input_scale(dir.path(), "ck", &seed);
    synth(dir.path(), &["--out", "down", "--seed", &seed]);
    let name = format!("model.layers.1.mlp.experts.{e}.down_proj.input_scale");
    let ck = dir.path().join("down");
    set_scalar(&ck, &name, scalar(&ck, &name) / 1000.0);
    for (ckpt, gemm) in [("ck", "gate/up"), ("down", "down")] {
        let (code, text, r) = run(
            dir.path(),
            &[
                "gs-sweep",
                "--checkpoint",
                ckpt,
                "--device",
                "cpu",
                "--tokens",
                "32",
                "--points",
                "5",
                "--gs",
                "checkpoint",
                "--max-loss",
                "0.005",
            ],
        );
        assert_eq!(code, 1, "seed {seed} {ckpt}: {text}");
        let f = r.unwrap()["failures"][0].as_str().unwrap().to_string();
        assert!(
            f.contains(&format!("expert {e} {gemm} input")),
            "seed {seed} {ckpt}: expert {e} {gemm}: {f}"
        );
    }
}

/// One expert's input_scale 1000x too small, on a layer whose cosine hides it (few of the
/// batch's tokens reach that expert; --max-loss 0.5 takes the layer's loss rule out): the
/// expert fails under the checkpoint's scales and passes under the calibrated ones, so the
/// gs is blamed and the expert named. The clean checkpoint passes the same check.
#[test]
fn gs_sweep_judges_each_expert_under_the_gs_in_use() {
    let seed = rand::random::<u16>().to_string();
    let dir = tempfile::tempdir().unwrap();
    synth(
        dir.path(),
        &[
            "--out",
            "ck",
            "--preset",
            "tiny-v4",
            "--plant",
            "bad-input-scale",
            "--seed",
            &seed,
        ],
    );
    synth(
        dir.path(),
        &["--out", "clean", "--preset", "tiny-v4", "--seed", &seed],
    );
    let planted: Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("ck/planted.json")).unwrap())
            .unwrap();
    let e = planted["faults"][0]["expert"].as_u64().unwrap();
    for (ckpt, want) in [("ck", 1), ("clean", 0)] {
        let (code, text, r) = run(
            dir.path(),
            &[
                "gs-sweep",
                "--checkpoint",
                ckpt,
                "--device",
                "cpu",
                "--points",
                "5",
                "--gs",
                "checkpoint",
                "--max-loss",
                "0.5",
                "--seed",
                &seed,
            ],
        );
        assert_eq!(code, want, "seed {seed} {ckpt}: {text}");
        let r = r.unwrap();
        assert_eq!(
            r["summary"]["experts"]["wrong_scale_experts"], want,
            "seed {seed} {ckpt}"
        );
        if want == 1 {
            assert_eq!(r["summary"]["cause"], "gs", "seed {seed}: {text}");
            let f = r["failures"].to_string();
            assert!(
                f.contains(&format!("expert {e}:")) && f.contains("calibrated"),
                "seed {seed}: expert {e}: {f}"
            );
        }
    }
}

/// config.json's num_hidden_layers ends the model before a layer holding experts, or its
/// moe_layer_freq makes that layer dense: an engine never runs those experts, so every command
/// taking a layer refuses it (exit 2 naming the field and the layer) as it does for
/// first_k_dense_replace. They used to run them and give a verdict on unused weights.
#[test]
fn a_layer_num_hidden_layers_or_moe_layer_freq_rules_out_is_refused() {
    use rand::{Rng, SeedableRng};
    let seed: u64 = rand::random();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let dir = tempfile::tempdir().unwrap();
    // tiny: 3 layers, layer 0 dense, experts in layers 1 and 2
    synth(dir.path(), &["--out", "ck", "--seed", &seed.to_string()]);
    let p = dir.path().join("ck/config.json");
    let mut c: Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    let (field, value, layer, left) = match rng.gen_range(0..2) {
        0 => ("num_hidden_layers", 2, 2, 1),
        _ => ("moe_layer_freq", 2, 1, 2),
    };
    c[field] = value.into();
    std::fs::write(&p, c.to_string()).unwrap();
    let l = layer.to_string();
    let (cmd, extra): (&str, Vec<&str>) = match rng.gen_range(0..3) {
        0 => ("layertest", vec!["--layer", &l]),
        1 => ("gs-sweep", vec!["--layer", &l, "--points", "3"]),
        _ => ("multilayer", vec!["--layers", "1..3"]),
    };
    let mut args = vec![
        cmd,
        "--checkpoint",
        "ck",
        "--device",
        "cpu",
        "--tokens",
        "8",
    ];
    args.extend(extra);
    let (code, text, _) = run(dir.path(), &args);
    assert_eq!(code, 2, "seed {seed} {cmd} {field}: {text}");
    for want in [
        format!("layer {layer} is not an MoE layer"),
        format!("{field} = {value}"),
        format!("MoE layers: {left}"),
    ] {
        assert!(
            text.contains(&want),
            "seed {seed} {cmd}: no `{want}` in {text}"
        );
    }
    // without a layer: only the one MoE layer left
    let (code, text, r) = run(
        dir.path(),
        &[
            "layertest",
            "--checkpoint",
            "ck",
            "--device",
            "cpu",
            "--tokens",
            "8",
        ],
    );
    assert_ne!(code, 2, "seed {seed} {field}: {text}");
    assert_eq!(r.unwrap()["summary"]["layer"], left, "seed {seed}: {text}");
}

/// One expert's weight_scale_2 zero, negative or not finite is bad input naming the layer,
/// expert, tensor and value for every command: an engine's alpha zeroes, flips or blows up
/// that expert's output. gs-sweep used to pass on a zero or negative one (the gs was fine).
#[test]
fn an_unusable_weight_scale_2_is_bad_input_for_every_command() {
    use rand::{Rng, SeedableRng};
    let seed: u64 = rand::random();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let dir = tempfile::tempdir().unwrap();
    synth(dir.path(), &["--out", "ck", "--seed", &seed.to_string()]);
    let (layer, e) = (rng.gen_range(1..3usize), rng.gen_range(0..16usize));
    let p = ["gate_proj", "up_proj", "down_proj"][rng.gen_range(0..3)];
    let name = format!("model.layers.{layer}.mlp.experts.{e}.{p}.weight_scale_2");
    let v = [0.0, -0.003, f32::NAN, f32::INFINITY][rng.gen_range(0..4)];
    set_scalar(&dir.path().join("ck"), &name, v);
    let l = layer.to_string();
    let (cmd, extra): (&str, Vec<&str>) = match rng.gen_range(0..3) {
        0 => ("layertest", vec!["--layer", &l]),
        1 => (
            "gs-sweep",
            vec!["--layer", &l, "--points", "3", "--gs", "checkpoint"],
        ),
        _ => ("multilayer", vec![]),
    };
    let mut args = vec![
        cmd,
        "--checkpoint",
        "ck",
        "--device",
        "cpu",
        "--tokens",
        "8",
    ];
    args.extend(extra);
    let (code, text, _) = run(dir.path(), &args);
    assert_eq!(code, 2, "seed {seed} {cmd} {name} = {v}: {text}");
    assert!(
        text.contains(&format!("tensor `{name}`"))
            && text.contains(&format!("weight_scale_2 = {v}")),
        "seed {seed} {cmd}: {text}"
    );
}

/// The F32 scalar `name` of a sharded synth checkpoint.
fn scalar(ck: &Path, name: &str) -> f32 {
    let (_, b, _, at) = locate(ck, name);
    f32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}

/// gs-sweep blames the activation gs only when it is the fault. One expert's weight_scale_2
/// 10x off leaves every gs far from the BF16 reference (best cosine ~0.6-0.8, a clean layer
/// ~0.98): the verdict says no gs fixes it (cause `not_gs`) and points at audit. It used to say
/// the gs in use "loses" against a gs that saturates that expert's inputs. So does a BF16
/// reference of other weights. Input scales 100x too small (gs 100x too large) are still a gs
/// fault, and a clean checkpoint passes.
#[test]
fn gs_sweep_blames_the_gs_only_when_some_gs_fixes_the_layer() {
    use rand::{Rng, SeedableRng};
    // TSEED=N reruns one seed
    let seed: u64 = std::env::var("TSEED")
        .map_or_else(|_| rand::random::<u16>().into(), |v| v.parse().unwrap());
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let dir = tempfile::tempdir().unwrap();
    let s = seed.to_string();
    // the busiest expert of layer 1: a fault there shows in the layer's output
    synth(
        dir.path(),
        &["--out", "p", "--plant", "bad-input-scale", "--seed", &s],
    );
    let planted: Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("p/planted.json")).unwrap()).unwrap();
    let e = planted["faults"][0]["expert"].as_u64().unwrap();
    let proj = ["gate_proj", "up_proj", "down_proj"][rng.gen_range(0..3)];
    for ck in ["clean", "gs", "not_gs", "ref"] {
        synth(dir.path(), &["--out", ck, "--seed", &s]);
    }
    // BF16 originals of other weights: the reference does not match the checkpoint
    synth(
        dir.path(),
        &["--out", "other", "--seed", &(seed + 1).to_string()],
    );
    for f in std::fs::read_dir(dir.path().join("other/bf16")).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, dir.path().join("ref/bf16").join(f.file_name().unwrap())).unwrap();
    }
    let ws2 = format!("model.layers.1.mlp.experts.{e}.{proj}.weight_scale_2");
    let not_gs = dir.path().join("not_gs");
    set_scalar(&not_gs, &ws2, scalar(&not_gs, &ws2) * 10.0);
    // the layer's input scales 100x too small (gs 100x too large, calibrated in the wrong
    // unit): activations saturate at 448 in every expert
    let gs = dir.path().join("gs");
    for x in 0..16 {
        for p in ["gate_proj", "up_proj", "down_proj"] {
            let inp = format!("model.layers.1.mlp.experts.{x}.{p}.input_scale");
            set_scalar(&gs, &inp, scalar(&gs, &inp) / 100.0);
        }
    }
    let no_gs = "no activation gs brings the layer near";
    for (ck, want_code, want_cause, want) in [
        ("not_gs", 1, "not_gs".into(), no_gs),
        ("ref", 1, "not_gs".into(), no_gs),
        ("gs", 1, "gs".into(), "gs `checkpoint` loses"),
        ("clean", 0, Value::Null, "within"),
    ] {
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
                "7",
                "--seed",
                &s,
                "--gs",
                "checkpoint",
            ],
        );
        let what = format!("seed {seed} {ck} (expert {e} {proj})");
        let r = r.unwrap();
        let sm = &r["summary"];
        // the clean checkpoint's input scales were calibrated on synth's own 8192-token batch:
        // now and then (seed 17868) a massive-activation token of this 32-token batch reaches
        // an expert it never reached there, its input runs past the scale (2.4x) and the
        // checkpoint's gs loses a little more than --max-loss (0.0119). That is a true
        // finding on this batch, not a false alarm, when the overshoot is named
        if ck == "clean" && code == 1 {
            let overshoot = sm["input_scale_saturate"]
                .as_array()
                .is_some_and(|v| v.iter().any(|x| x["ratio"].as_f64().unwrap() >= 2.0));
            let loss = sm["loss"].as_f64().unwrap();
            assert!(overshoot && loss < 0.03, "{what}: {text}");
            continue;
        }
        assert_eq!(code, want_code, "{what}: {text}");
        assert_eq!(sm["cause"], want_cause, "{what}: {sm}");
        assert!(sm["text"].as_str().unwrap().contains(want), "{what}: {sm}");
        let best = sm["best_cosine"].as_f64().unwrap();
        assert_eq!(best < 0.95, want == no_gs, "{what}: best cosine {best}");
        if want == no_gs {
            let f = r["failures"][0].as_str().unwrap();
            assert!(
                f.contains("`audit`") && f.contains("`compare-weights`") && !f.contains("loses"),
                "{what}: {f}"
            );
        }
    }
}

/// Checkpoint input scales holding their reciprocals (gs values, the quant direction, stored
/// where `input_scale = amax/2688` belongs) are named as such by gs-sweep and layertest
/// (cause `input_scale_reciprocal`), on a fresh random checkpoint whose input scales are
/// calibrated on the test's own real-like batch (a few massive channels, as DeepSeek's). The
/// calibrated checkpoint passes both without it, and input scales merely 100x too small (not
/// reciprocal) fail without it. Both commands used to name only each input's overshoot
/// ("down input 33.5x").
#[test]
fn an_input_scale_holding_its_reciprocal_is_named() {
    use nvfp4dbg::checkpoint::writer::{f32_bytes, write_file, TensorSpec};
    use rand::{Rng, SeedableRng};
    // TSEED=N reruns one seed
    let seed: u64 = std::env::var("TSEED")
        .map_or_else(|_| rand::random::<u16>().into(), |v| v.parse().unwrap());
    let s = seed.to_string();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (t, hsz) = (64, 256);
    let mut h = nvfp4dbg::moe::synthetic::moe_input(hsz, t, None, 1e-6, seed);
    for _ in 0..3 {
        let c = rng.gen_range(0..hsz);
        let m: f32 = rng.gen_range(100.0..800.0) * if rng.gen() { 1.0 } else { -1.0 };
        for r in 0..t {
            h[r * hsz + c] = nvfp4dbg::moe::forward::bf16(m * rng.gen_range(0.6..1.4));
        }
    }
    let spec = TensorSpec::new("hidden_states", safetensors::Dtype::F32, &[t, hsz]);
    write_file(&d.join("in.safetensors"), vec![(spec, f32_bytes(&h))], None).unwrap();
    for ck in ["cal", "recip", "small"] {
        synth(d, &["--out", ck, "--seed", &s]);
    }
    // calibrate on this batch, as the commands' `calibrated` source does
    let mc = nvfp4dbg::checkpoint::MoeCheckpoint::open(&d.join("cal")).unwrap();
    let layer = mc.load_layer(1).unwrap();
    let routing = nvfp4dbg::moe::route(&layer, &h, None).unwrap();
    let (a1, a2) = nvfp4dbg::moe::forward::expert_input_amax(&layer, &h, &routing).unwrap();
    let max = |a: &[Option<f32>]| a.iter().flatten().fold(0f32, |m, &v| m.max(v));
    let (m1, m2) = (max(&a1), max(&a2));
    for e in 0..layer.experts.len() {
        for (p, a) in [
            ("gate_proj", a1[e].unwrap_or(m1)),
            ("up_proj", a1[e].unwrap_or(m1)),
            ("down_proj", a2[e].unwrap_or(m2)),
        ] {
            let name = format!("model.layers.1.mlp.experts.{e}.{p}.input_scale");
            let c = a / 2688.0;
            set_scalar(&d.join("cal"), &name, c);
            set_scalar(&d.join("recip"), &name, 1.0 / c);
            set_scalar(&d.join("small"), &name, c / 100.0);
        }
    }
    for cmd in ["gs-sweep", "layertest"] {
        for (ck, want_code) in [("recip", 1), ("cal", 0), ("small", 1)] {
            let mut args = vec![
                cmd,
                "--checkpoint",
                ck,
                "--input",
                "in.safetensors",
                "--device",
                "cpu",
                "--gs",
                "checkpoint",
            ];
            if cmd == "gs-sweep" {
                args.extend(["--points", "5"]);
            }
            let (code, text, r) = run(d, &args);
            let what = format!("seed {seed} {cmd} {ck}");
            assert_eq!(code, want_code, "{what}: {text}");
            let sm = &r.unwrap()["summary"];
            let named = sm["cause"] == "input_scale_reciprocal";
            assert_eq!(named, ck == "recip", "{what}: {sm}");
            assert_eq!(
                sm["input_scale_reciprocal"].is_null(),
                ck != "recip",
                "{what}: {sm}"
            );
            if ck == "recip" {
                let head = sm["text"].as_str().unwrap();
                let x = &sm["input_scale_reciprocal"];
                let tensor = x["tensor"].as_str().unwrap();
                assert!(
                    head.contains("input_scale holds gs values (quant direction)")
                        && head.contains(tensor)
                        && tensor.starts_with("model.layers.1.mlp.experts.")
                        && tensor.ends_with("_proj.input_scale"),
                    "{what}: {head}"
                );
                let (st, cal) = (
                    x["stored"].as_f64().unwrap(),
                    x["calibrated"].as_f64().unwrap(),
                );
                assert!((st * cal - 1.0).abs() < 1e-3, "{what}: {x}");
            }
        }
    }
    // under another gs (gs-sweep's default) the checkpoint's reciprocals are still what an
    // engine takes: named in the JSON and in a note, the verdict left to the gs in use
    for ck in ["recip", "cal"] {
        let (_, text, r) = run(
            d,
            &[
                "gs-sweep",
                "--checkpoint",
                ck,
                "--input",
                "in.safetensors",
                "--device",
                "cpu",
                "--points",
                "5",
            ],
        );
        let what = format!("seed {seed} gs-sweep --gs default {ck}");
        let sm = &r.unwrap()["summary"];
        assert_eq!(sm["gs"], "default", "{what}: {sm}");
        assert_ne!(sm["cause"], "input_scale_reciprocal", "{what}: {sm}");
        let x = &sm["input_scale_reciprocal"];
        assert_eq!(x.is_null(), ck == "cal", "{what}: {sm}");
        assert_eq!(
            text.contains("The checkpoint's input scales"),
            ck == "recip",
            "{what}: {text}"
        );
        if ck == "recip" {
            let (st, cal) = (
                x["stored"].as_f64().unwrap(),
                x["calibrated"].as_f64().unwrap(),
            );
            assert!((st * cal - 1.0).abs() < 1e-3, "{what}: {x}");
        }
    }
    // reciprocals a batch of small activations survives (its numbers within --max-loss of
    // the best) are still named: gs-sweep passed them in silence
    let h3: Vec<f32> = nvfp4dbg::moe::synthetic::moe_input(hsz, t, None, 1e-6, seed ^ 1)
        .iter()
        .map(|v| nvfp4dbg::moe::forward::bf16(v * 3.0))
        .collect();
    let spec = TensorSpec::new("hidden_states", safetensors::Dtype::F32, &[t, hsz]);
    write_file(
        &d.join("in3.safetensors"),
        vec![(spec, f32_bytes(&h3))],
        None,
    )
    .unwrap();
    let routing = nvfp4dbg::moe::route(&layer, &h3, None).unwrap();
    let (a1, a2) = nvfp4dbg::moe::forward::expert_input_amax(&layer, &h3, &routing).unwrap();
    for e in 0..layer.experts.len() {
        for (p, a) in [
            ("gate_proj", a1[e].unwrap_or(max(&a1))),
            ("up_proj", a1[e].unwrap_or(max(&a1))),
            ("down_proj", a2[e].unwrap_or(max(&a2))),
        ] {
            let name = format!("model.layers.1.mlp.experts.{e}.{p}.input_scale");
            set_scalar(&d.join("recip"), &name, 2688.0 / a);
        }
    }
    let (code, text, r) = run(
        d,
        &[
            "gs-sweep",
            "--checkpoint",
            "recip",
            "--input",
            "in3.safetensors",
            "--device",
            "cpu",
            "--gs",
            "checkpoint",
            "--points",
            "5",
        ],
    );
    let sm = &r.unwrap()["summary"];
    assert!(
        sm["loss"].as_f64().unwrap() <= sm["max_loss"].as_f64().unwrap(),
        "seed {seed}: the batch does not survive the reciprocals: {sm}"
    );
    assert_eq!(code, 1, "seed {seed}: {text}");
    assert_eq!(sm["cause"], "input_scale_reciprocal", "seed {seed}: {sm}");
    // and so does layertest under them (gs-sweep's rule): it passed with the finding null
    let (code, text, r) = run(
        d,
        &[
            "layertest",
            "--checkpoint",
            "recip",
            "--input",
            "in3.safetensors",
            "--device",
            "cpu",
            "--gs",
            "checkpoint",
        ],
    );
    let sm = &r.unwrap()["summary"];
    assert_eq!(code, 1, "seed {seed} layertest: {text}");
    assert_eq!(sm["cause"], "input_scale_reciprocal", "seed {seed}: {sm}");
    let head = sm["text"].as_str().unwrap();
    assert!(
        head.contains("input_scale holds gs values (quant direction)")
            && head.contains("this batch passes under these scales"),
        "seed {seed}: {sm}"
    );
}

/// A walk through every MoE layer where the checkpoint and config.json disagree on them is
/// bad input naming the layer: a layer dropped from the middle, routed experts config.json's
/// `first_k_dense_replace` makes dense, a dense layer it makes MoE. The walk stepped over
/// such a layer and passed (exit 0) while an engine runs it on weights it cannot load.
#[test]
fn multilayer_refuses_a_walk_over_a_layer_config_json_and_the_checkpoint_disagree_on() {
    use rand::Rng;
    let seed: u64 = rand::random();
    let mut rng = <rand_chacha::ChaCha8Rng as rand::SeedableRng>::seed_from_u64(seed);
    let dir = tempfile::tempdir().unwrap();
    let s = (seed % 1000).to_string();
    synth(dir.path(), &["--out", "ck", "--layers", "6", "--seed", &s]);
    let run_ml = |ck: &str| {
        run(
            dir.path(),
            &[
                "multilayer",
                "--checkpoint",
                ck,
                "--device",
                "cpu",
                "--tokens",
                "8",
            ],
        )
    };
    let copy = |to: &str| {
        let to = dir.path().join(to);
        std::fs::create_dir_all(&to).unwrap();
        for e in std::fs::read_dir(dir.path().join("ck")).unwrap() {
            let e = e.unwrap();
            if e.file_type().unwrap().is_file() {
                std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
            }
        }
        to
    };
    // layer l (an interior MoE layer) dropped: its shard and its weight_map entries
    let l: usize = rng.gen_range(2..=4);
    let ck = copy("gap");
    let ix_path = ck.join("model.safetensors.index.json");
    let mut ix: Value = serde_json::from_slice(&std::fs::read(&ix_path).unwrap()).unwrap();
    let map = ix["weight_map"].as_object_mut().unwrap();
    let prefix = format!("model.layers.{l}.");
    let shard = map[&format!("{prefix}mlp.gate.weight")]
        .as_str()
        .unwrap()
        .to_string();
    map.retain(|k, _| !k.starts_with(&prefix));
    assert!(
        map.values().all(|v| v != &Value::from(shard.as_str())),
        "seed {seed}"
    );
    std::fs::remove_file(ck.join(&shard)).unwrap();
    std::fs::write(&ix_path, serde_json::to_vec(&ix).unwrap()).unwrap();
    let (code, text, _) = run_ml("gap");
    assert_eq!(code, 2, "seed {seed}, layer {l} dropped: {text}");
    assert!(
        text.contains(&format!("layer {l} holds no MoE tensors")) && text.contains("gap"),
        "seed {seed}: {text}"
    );
    // config.json's first_k_dense_replace: past MoE layers that hold experts, or before the
    // dense layer 0
    for (k, named) in [(rng.gen_range(2..=4usize), 1), (0, 0)] {
        let ck = copy(&format!("k{k}"));
        let mut c: Value =
            serde_json::from_slice(&std::fs::read(ck.join("config.json")).unwrap()).unwrap();
        c["first_k_dense_replace"] = k.into();
        std::fs::write(ck.join("config.json"), serde_json::to_vec(&c).unwrap()).unwrap();
        let (code, text, _) = run_ml(&format!("k{k}"));
        assert_eq!(code, 2, "seed {seed}, first_k_dense_replace {k}: {text}");
        assert!(
            text.contains(&format!("layer {named} "))
                && text.contains(&format!("first_k_dense_replace = {k}")),
            "seed {seed}: {text}"
        );
    }
    // the checkpoint as written walks and passes
    let (code, text, _) = run_ml("ck");
    assert_eq!(code, 0, "seed {seed}: {text}");
}

/// multilayer under `--gs checkpoint` names why a layer's expert fails when its checkpoint
/// input_scale is far off, as layertest does: 1000x too small saturates its inputs, 1e6x too
/// large flushes them to zero, for gate/up (gs1) or down_proj (gs2). It named the layer, the
/// expert and its cosine, not the cause; the per-layer JSON lists the input scale too.
#[test]
fn multilayer_names_saturation_or_flush_as_a_failing_experts_cause() {
    let seed = rand::random::<u16>().to_string();
    let dir = tempfile::tempdir().unwrap();
    let e = synth_bad_input_scale(dir.path(), "ck", &seed);
    let cases: [(&[&str], f32, &str, &str); 4] = [
        (
            &["gate_proj", "up_proj"],
            1e-3,
            "gate/up input blocks saturate",
            "input_scale_saturate",
        ),
        (
            &["down_proj"],
            1e-3,
            "its down_proj input saturates",
            "input_scale_saturate",
        ),
        (
            &["gate_proj", "up_proj"],
            1e6,
            "its blocks flush to zero",
            "input_scale_flush",
        ),
        (
            &["down_proj"],
            1e6,
            "its blocks flush to zero",
            "input_scale_flush",
        ),
    ];
    for (i, (projs, factor, cause, field)) in cases.into_iter().enumerate() {
        let out = format!("c{i}");
        synth(dir.path(), &["--out", &out, "--seed", &seed]);
        let ck = dir.path().join(&out);
        for p in projs {
            let name = format!("model.layers.1.mlp.experts.{e}.{p}.input_scale");
            set_scalar(&ck, &name, scalar(&ck, &name) * factor);
        }
        let (code, text, r) = run(
            dir.path(),
            &[
                "multilayer",
                "--checkpoint",
                &out,
                "--device",
                "cpu",
                "--gs",
                "checkpoint",
                "--seed",
                &seed,
            ],
        );
        assert_eq!(code, 1, "seed {seed} {projs:?} x{factor}: {text}");
        let r = r.unwrap();
        let head = format!("layer 1: expert {e}: ");
        let line = r["failures"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|v| v.as_str())
            .find(|m| m.starts_with(&head))
            .unwrap_or_else(|| panic!("seed {seed} {projs:?} x{factor}: no `{head}`: {text}"));
        assert!(
            line.contains(cause),
            "seed {seed} {projs:?} x{factor}: `{cause}` not in: {line}"
        );
        let row = &r["per_layer"][0];
        assert_eq!(row["layer"], 1, "seed {seed}");
        let listed = row[field]
            .as_array()
            .is_some_and(|v| v.iter().any(|x| x["expert"] == e));
        assert!(
            listed,
            "seed {seed} {projs:?} x{factor}: expert {e} not in {field}: {row}"
        );
    }
    // under the default gs (calibrated) the walk passes, and the layer's row still lists the
    // checkpoint's input_scale an engine takes (it was null unless an expert failed); the
    // clean checkpoint lists none on layer 1, and nothing near the planted 1000x past it (a
    // later layer's inputs carry the residual stream its scales were not calibrated on: 3x
    // on one expert's down input, seed 19391)
    synth(dir.path(), &["--out", "clean", "--seed", &seed]);
    for ck in ["ck", "clean"] {
        let (code, text, r) = run(
            dir.path(),
            &[
                "multilayer",
                "--checkpoint",
                ck,
                "--device",
                "cpu",
                "--seed",
                &seed,
            ],
        );
        assert_eq!(code, 0, "seed {seed} {ck}: {text}");
        let r = r.unwrap();
        for row in r["per_layer"].as_array().unwrap() {
            let list = |f: &str| {
                row[f]
                    .as_array()
                    .unwrap_or_else(|| panic!("seed {seed} {ck}: no {f} list: {row}"))
                    .clone()
            };
            let (sat, flush) = (list("input_scale_saturate"), list("input_scale_flush"));
            let ours = sat
                .iter()
                .any(|x| x["expert"] == e && x["gemm"] == "gate/up");
            let first = row["layer"] == 1;
            assert_eq!(ours, ck == "ck" && first, "seed {seed} {ck}: {row}");
            if ck == "clean" {
                let far = sat
                    .iter()
                    .chain(&flush)
                    .any(|x| x["ratio"].as_f64().unwrap() >= 10.0);
                assert!(!far, "seed {seed} clean: {row}");
                assert!(
                    !first || sat.is_empty() && flush.is_empty(),
                    "seed {seed}: {row}"
                );
            }
        }
    }
}
