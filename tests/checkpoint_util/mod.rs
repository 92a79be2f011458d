//! Helpers shared by the checkpoint / quantize / audit / bad-input integration tests.
#![allow(dead_code)]

use nvfp4dbg::checkpoint::writer::{bf16_bytes, f32_bytes, write_file, TensorSpec};
use nvfp4dbg::checkpoint::Dtype;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, StandardNormal};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_nvfp4dbg")
}

/// Run the real binary with `args` (quiet, no report directory).
pub fn run(args: &[&str]) -> Output {
    Command::new(bin())
        .args(args)
        .args(["--quiet", "--no-report-dir"])
        .env("NO_COLOR", "1")
        .output()
        .expect("spawn nvfp4dbg")
}

pub fn code(o: &Output) -> i32 {
    o.status.code().unwrap_or(-1)
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).to_string()
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).to_string()
}

pub fn p(path: &Path) -> &str {
    path.to_str().expect("utf-8 temp path")
}

/// A seeded rng; the seed is printed so a failure can be replayed.
pub fn rng(what: &str) -> (u64, rand_chacha::ChaCha8Rng) {
    let seed: u64 = std::env::var("NVFP4DBG_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    eprintln!("{what}: seed {seed} (NVFP4DBG_SEED={seed} to replay)");
    (seed, rand_chacha::ChaCha8Rng::seed_from_u64(seed))
}

/// Weight-like values: normal, per-row magnitude spread over decades, BF16-exact.
pub fn weights(r: &mut impl Rng, rows: usize, cols: usize) -> Vec<f32> {
    let mut v = Vec::with_capacity(rows * cols);
    for _ in 0..rows {
        let s = 10f32.powf(r.gen_range(-3.0..0.5));
        for _ in 0..cols {
            let x: f32 = StandardNormal.sample(r);
            v.push(half::bf16::from_f32(x * s).to_f32());
        }
    }
    v
}

pub fn bf16(name: &str, shape: &[usize], v: &[f32]) -> (TensorSpec, Vec<u8>) {
    (TensorSpec::new(name, Dtype::BF16, shape), bf16_bytes(v))
}

pub fn f32t(name: &str, shape: &[usize], v: &[f32]) -> (TensorSpec, Vec<u8>) {
    (TensorSpec::new(name, Dtype::F32, shape), f32_bytes(v))
}

pub fn write(path: &Path, tensors: Vec<(TensorSpec, Vec<u8>)>) {
    write_file(path, tensors, None).expect("write test file");
}

/// Every file under `dir` with its bytes (sorted by path), to prove inputs are untouched.
pub fn snapshot(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out = vec![];
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        if d.is_file() {
            out.push((d.clone(), std::fs::read(&d).unwrap()));
            continue;
        }
        for e in std::fs::read_dir(&d).unwrap() {
            stack.push(e.unwrap().path());
        }
    }
    out.sort();
    out
}

/// `synth --out dir --seed seed` (tiny preset: MoE layers 1 and 2, 16 experts, BF16 originals
/// under dir/bf16/) with `extra` arguments.
/// The `.safetensors` files of a directory, sorted.
pub fn shards(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    v.sort();
    v
}

pub fn synth(dir: &Path, seed: u64, extra: &[&str]) {
    let seed = seed.to_string();
    let mut args = vec!["synth", "--out", p(dir), "--seed", &seed];
    args.extend_from_slice(extra);
    let o = run(&args);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
}

/// Add a shard `file` holding `tensors` to the sharded checkpoint `dir`, and its names to the
/// index.
pub fn add_shard(dir: &Path, file: &str, tensors: Vec<(TensorSpec, Vec<u8>)>) {
    let ip = dir.join("model.safetensors.index.json");
    let mut idx: serde_json::Value = serde_json::from_slice(&std::fs::read(&ip).unwrap()).unwrap();
    let map = idx["weight_map"].as_object_mut().unwrap();
    for (s, _) in &tensors {
        map.insert(s.name.clone(), file.into());
    }
    std::fs::write(&ip, idx.to_string()).unwrap();
    write(&dir.join(file), tensors);
}

/// The exclude list (exclude_modules) of config.json in `dir` and of its hf_quant_config.json.
pub fn exclude_lists(dir: &Path) -> (Vec<String>, Vec<String>) {
    let read = |f: &str, key: &str| -> Vec<String> {
        let v: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join(f)).unwrap()).unwrap();
        serde_json::from_value(v[key]["exclude_modules"].clone()).unwrap()
    };
    (
        read("config.json", "quantization_config"),
        read("hf_quant_config.json", "quantization"),
    )
}

/// A small DeepSeek-style config.json (no shared expert: the fixtures hold none).
pub fn config_json(h: usize, i: usize, e: usize, k: usize, layers: usize) -> serde_json::Value {
    serde_json::json!({
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "hidden_size": h, "moe_intermediate_size": i, "intermediate_size": 4 * i,
        "n_routed_experts": e, "num_experts_per_tok": k, "n_shared_experts": 0,
        "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
        "norm_topk_prob": true, "first_k_dense_replace": 0, "num_hidden_layers": layers,
        "rms_norm_eps": 1e-6, "vocab_size": 1000
    })
}

/// Can python3 with numpy and ml_dtypes run the golden script?
pub fn python_with_ml_dtypes() -> Option<String> {
    let py = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    let ok = Command::new(&py)
        .args(["-c", "import numpy, ml_dtypes"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    ok.then_some(py)
}

pub fn golden_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tools/golden/make_golden.py")
}
