//! `synth` driven through the real binary: the files it writes, their names and dtypes, and
//! every planted fault.

use safetensors::{Dtype, SafeTensors};
use serde_json::Value;
use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

fn run(dir: &Path, args: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_nvfp4dbg"))
        .current_dir(dir)
        .args(args)
        .args(["--no-report-dir", "--quiet"])
        .output()
        .expect("run nvfp4dbg");
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    (out.status.code().unwrap_or(-1), text)
}

fn json(p: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(p).unwrap_or_else(|e| panic!("{}: {e}", p.display())))
        .unwrap()
}

/// Every tensor of an index, with its file opened and checked against the map.
fn check_index(dir: &Path) -> BTreeSet<String> {
    let idx = json(&dir.join("model.safetensors.index.json"));
    let map = idx["weight_map"].as_object().unwrap();
    let files: BTreeSet<&str> = map.values().map(|v| v.as_str().unwrap()).collect();
    let mut seen = BTreeSet::new();
    let mut total = 0u64;
    for f in files {
        let bytes = std::fs::read(dir.join(f)).unwrap();
        total += bytes.len() as u64;
        let st = SafeTensors::deserialize(&bytes).unwrap();
        for (name, _) in st.tensors() {
            assert_eq!(
                map.get(&name).and_then(|v| v.as_str()),
                Some(f),
                "{name} in {f} but not in the index"
            );
            seen.insert(name);
        }
    }
    assert_eq!(seen.len(), map.len(), "index lists tensors no shard holds");
    assert_eq!(idx["metadata"]["total_size"].as_u64(), Some(total));
    seen
}

fn tensor_info(dir: &Path, name: &str) -> (Dtype, Vec<usize>, Vec<u8>) {
    let idx = json(&dir.join("model.safetensors.index.json"));
    let f = idx["weight_map"][name]
        .as_str()
        .unwrap_or_else(|| panic!("{name} not in the index"));
    let bytes = std::fs::read(dir.join(f)).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor(name).unwrap();
    (t.dtype(), t.shape().to_vec(), t.data().to_vec())
}

#[test]
fn tiny_checkpoint_has_the_hf_layout() {
    let seed = rand::random::<u16>().to_string();
    let dir = tempfile::tempdir().unwrap();
    let (code, text) = run(dir.path(), &["synth", "--out", "ck", "--seed", &seed]);
    assert_eq!(code, 0, "{text}");
    let ck = dir.path().join("ck");
    let cfg = json(&ck.join("config.json"));
    for (k, v) in [
        ("hidden_size", 256),
        ("moe_intermediate_size", 128),
        ("n_routed_experts", 16),
        ("num_experts_per_tok", 4),
        ("n_group", 4),
        ("topk_group", 2),
        ("n_shared_experts", 1),
        ("first_k_dense_replace", 1),
        ("num_hidden_layers", 3),
    ] {
        assert_eq!(cfg[k], v, "config.json {k}");
    }
    assert_eq!(cfg["scoring_func"], "sigmoid");
    assert_eq!(cfg["routed_scaling_factor"], 2.5);
    assert_eq!(cfg["rms_norm_eps"], 1e-6);
    assert_eq!(cfg["quantization_config"]["quant_method"], "modelopt");
    assert_eq!(cfg["quantization_config"]["quant_algo"], "NVFP4");
    assert_eq!(cfg["quantization_config"]["group_size"], 16);
    assert_eq!(
        json(&ck.join("hf_quant_config.json"))["quantization"]["quant_algo"],
        "NVFP4"
    );

    let names = check_index(&ck);
    let originals = check_index(&ck.join("bf16"));
    assert_eq!(originals.len(), 2 * 16 * 3);
    let e = "model.layers.1.mlp.experts.5";
    for p in ["gate_proj", "up_proj", "down_proj"] {
        for s in ["weight", "weight_scale", "weight_scale_2", "input_scale"] {
            assert!(names.contains(&format!("{e}.{p}.{s}")), "{e}.{p}.{s}");
        }
        assert!(originals.contains(&format!("{e}.{p}.weight")));
    }
    for n in [
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.post_attention_layernorm.weight",
        "model.layers.2.mlp.gate.weight",
        "model.layers.2.mlp.gate.e_score_correction_bias",
        "model.layers.2.mlp.shared_experts.down_proj.weight",
    ] {
        assert!(names.contains(n), "{n}");
    }
    let (dt, shape, _) = tensor_info(&ck, &format!("{e}.gate_proj.weight"));
    assert_eq!((dt, shape), (Dtype::U8, vec![128, 128]));
    let (dt, shape, _) = tensor_info(&ck, &format!("{e}.down_proj.weight_scale"));
    assert_eq!((dt, shape), (Dtype::F8_E4M3, vec![256, 8]));
    let (dt, shape, _) = tensor_info(&ck, &format!("{e}.up_proj.weight_scale_2"));
    assert_eq!((dt, shape), (Dtype::F32, vec![]));
    let (dt, shape, _) = tensor_info(&ck, "model.layers.1.mlp.gate.weight");
    assert_eq!((dt, shape), (Dtype::BF16, vec![16, 256]));
    // gate and up share weight_scale_2, as ModelOpt exports fused gate/up
    let ws = |p: &str| tensor_info(&ck, &format!("{e}.{p}.weight_scale_2")).2;
    assert_eq!(ws("gate_proj"), ws("up_proj"));
    // input_scale = amax / 2688 of synthetic activations: a plausible, positive value
    let is = tensor_info(&ck, &format!("{e}.gate_proj.input_scale")).2;
    let is = f32::from_le_bytes([is[0], is[1], is[2], is[3]]);
    assert!(is > 1.0 / 2688.0 && is < 1.0, "input_scale {is}");
    assert_eq!(
        json(&ck.join("planted.json"))["faults"]
            .as_array()
            .unwrap()
            .len(),
        0
    );
    // same seed, same bytes
    let (code, _) = run(dir.path(), &["synth", "--out", "ck2", "--seed", &seed]);
    assert_eq!(code, 0);
    let f = "model-00002-of-00003.safetensors";
    assert_eq!(
        std::fs::read(ck.join(f)).unwrap(),
        std::fs::read(dir.path().join("ck2").join(f)).unwrap()
    );
}

#[test]
fn v4_presets_use_native_names_and_hash_tables() {
    let dir = tempfile::tempdir().unwrap();
    let (code, text) = run(dir.path(), &["synth", "--out", "v4", "--preset", "tiny-v4"]);
    assert_eq!(code, 0, "{text}");
    let ck = dir.path().join("v4");
    let names = check_index(&ck);
    assert!(names.contains("layers.0.ffn.experts.0.w1.weight"));
    assert!(names.contains("layers.0.ffn.experts.0.w2.input_scale"));
    assert!(names.contains("layers.1.ffn.gate.bias"));
    assert!(names.contains("layers.2.ffn_norm.weight"));
    assert!(names.contains("layers.0.ffn.shared_experts.w3.weight"));
    assert!(!names.iter().any(|n| n.starts_with("model.")));
    let (dt, shape, _) = tensor_info(&ck, "layers.0.ffn.gate.tid2eid");
    assert_eq!((dt, shape), (Dtype::I64, vec![1000, 4]));
    assert!(!names.contains("layers.1.ffn.gate.tid2eid"));
    let cfg = json(&ck.join("config.json"));
    assert_eq!(cfg["scoring_func"], "sqrtsoftplus");
    assert_eq!(cfg["num_hash_layers"], 1);
    assert_eq!(cfg["swiglu_limit"], 10.0);
}

#[test]
fn every_fault_is_planted_and_recorded() {
    let dir = tempfile::tempdir().unwrap();
    let faults = [
        "nan-block-scale",
        "bad-input-scale",
        "ws2-mismatch",
        "saturated-scales",
        "missing-tensor",
        "swap-gate-up",
    ];
    let mut args = vec!["synth", "--out", "ck"];
    for (i, f) in faults.iter().enumerate() {
        args.push("--plant");
        args.push(Box::leak(
            format!("{f}@{}:{}", 1 + i % 2, i).into_boxed_str(),
        ));
    }
    let (code, text) = run(dir.path(), &args);
    assert_eq!(code, 0, "{text}");
    let ck = dir.path().join("ck");
    let planted = json(&ck.join("planted.json"));
    let list = planted["faults"].as_array().unwrap();
    assert_eq!(list.len(), faults.len());
    for (i, f) in faults.iter().enumerate() {
        let p = list
            .iter()
            .find(|p| p["fault"] == *f)
            .unwrap_or_else(|| panic!("{f} not recorded"));
        assert_eq!(p["layer"], 1 + i % 2, "{f}");
        assert_eq!(p["expert"], i, "{f}");
        assert!(!p["tensors"].as_array().unwrap().is_empty());
    }
    let e = |l: usize, x: usize, rest: &str| format!("model.layers.{l}.mlp.experts.{x}.{rest}");
    // nan-block-scale@1:0 → 0x7F in the first gate block scale
    assert_eq!(
        tensor_info(&ck, &e(1, 0, "gate_proj.weight_scale")).2[0] & 0x7F,
        0x7F
    );
    // bad-input-scale@2:1 → 1000x smaller than its down_proj neighbour's scale of scale
    let f32_of = |n: &str| {
        let b = tensor_info(&ck, n).2;
        f32::from_le_bytes([b[0], b[1], b[2], b[3]])
    };
    let bad = f32_of(&e(2, 1, "gate_proj.input_scale"));
    let good = f32_of(&e(2, 2, "gate_proj.input_scale"));
    assert!(bad * 100.0 < good, "{bad} vs {good}");
    // ws2-mismatch@1:2
    assert_ne!(
        f32_of(&e(1, 2, "gate_proj.weight_scale_2")),
        f32_of(&e(1, 2, "up_proj.weight_scale_2"))
    );
    // saturated-scales@2:3: most gate block scales at 448 (0x7E)
    let sc = tensor_info(&ck, &e(2, 3, "gate_proj.weight_scale")).2;
    assert!(sc.iter().filter(|&&c| c == 0x7E).count() * 2 > sc.len());
    // missing-tensor@1:4: gone from the shard and the index
    let names = check_index(&ck);
    assert!(!names.contains(&e(1, 4, "down_proj.weight_scale")));
    assert!(names.contains(&e(1, 4, "down_proj.weight")));
    // swap-gate-up@2:5: the NVFP4 gate is what the BF16 up original quantizes to, not the gate
    let (_, _, gate_q) = tensor_info(&ck, &e(2, 5, "gate_proj.weight"));
    let (_, _, up_q) = tensor_info(&ck, &e(2, 5, "up_proj.weight"));
    assert_ne!(gate_q, up_q);
    let (code, text) = run(
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
    assert_eq!(code, 2, "missing tensor must be bad input: {text}");
    assert!(text.contains("weight_scale"), "{text}");
}

#[test]
fn refuses_bad_requests() {
    let dir = tempfile::tempdir().unwrap();
    let (code, _) = run(dir.path(), &["synth", "--out", "ck"]);
    assert_eq!(code, 0);
    let (code, text) = run(dir.path(), &["synth", "--out", "ck"]);
    assert_eq!(code, 2, "{text}");
    assert!(text.contains("--force"), "{text}");
    let (code, _) = run(
        dir.path(),
        &["synth", "--out", "ck", "--force", "--seed", "3"],
    );
    assert_eq!(code, 0);
    for bad in [
        vec!["synth", "--out", "x", "--plant", "bogus"],
        vec!["synth", "--out", "x", "--plant", "nan-block-scale@0"],
        vec!["synth", "--out", "x", "--plant", "nan-block-scale@1:99"],
        vec!["synth", "--out", "x", "--preset", "dsv9"],
        vec!["synth", "--out", "x", "--layers", "1"],
        vec!["synth", "--out", "x", "--layers", "129"],
    ] {
        let (code, text) = run(dir.path(), &bad);
        assert_eq!(code, 2, "{bad:?}: {text}");
    }
}
