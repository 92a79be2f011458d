//! Helpers shared by the trace integration tests: drive the real binary, write trace files.
#![allow(dead_code)]

use nvfp4dbg::checkpoint::writer::{bf16_bytes, f32_bytes, write_file, TensorSpec};
use safetensors::Dtype;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

pub struct Out {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
    /// The `--json` report, when the command wrote one.
    pub json: Value,
}

impl Out {
    pub fn show(&self) -> String {
        format!(
            "exit {}\n--- stdout\n{}\n--- stderr\n{}",
            self.code, self.stdout, self.stderr
        )
    }
}

/// Run `nvfp4dbg ARGS --json … --no-report-dir --quiet` in `cwd`.
pub fn nvfp4dbg(cwd: &Path, args: &[&str]) -> Out {
    let json = cwd.join(format!("report-{}.json", rand::random::<u64>()));
    let out = Command::new(env!("CARGO_BIN_EXE_nvfp4dbg"))
        .current_dir(cwd)
        .args(args)
        .arg("--json")
        .arg(&json)
        .args(["--no-report-dir", "--quiet"])
        .output()
        .expect("run nvfp4dbg");
    let report = std::fs::read_to_string(&json)
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or(Value::Null);
    let _ = std::fs::remove_file(&json);
    Out {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into(),
        stderr: String::from_utf8_lossy(&out.stderr).into(),
        json: report,
    }
}

/// One tensor of a hand-written trace file, stored as `dtype` (F32, BF16, or I64 / I32 for
/// whole numbers).
pub struct T<'a> {
    pub name: &'a str,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

pub fn t<'a>(name: &'a str, shape: &[usize], data: Vec<f32>) -> T<'a> {
    T {
        name,
        dtype: Dtype::F32,
        shape: shape.to_vec(),
        data,
    }
}

/// Write `dir/NNNNNN-module.safetensors`.
pub fn write_call(
    dir: &Path,
    counter: u64,
    module: &str,
    tensors: Vec<T>,
    meta: &[(&str, &str)],
) -> std::path::PathBuf {
    let path = dir.join(format!("{counter:06}-{module}.safetensors"));
    let specs = tensors
        .into_iter()
        .map(|t| {
            let bytes = match t.dtype {
                Dtype::BF16 => bf16_bytes(&t.data),
                // ids: the values are whole numbers
                Dtype::I64 => t
                    .data
                    .iter()
                    .flat_map(|&v| (v as i64).to_le_bytes())
                    .collect(),
                Dtype::I32 => t
                    .data
                    .iter()
                    .flat_map(|&v| (v as i32).to_le_bytes())
                    .collect(),
                _ => f32_bytes(&t.data),
            };
            (TensorSpec::new(t.name, t.dtype, &t.shape), bytes)
        })
        .collect();
    let meta: BTreeMap<String, String> = meta
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    write_file(&path, specs, (!meta.is_empty()).then_some(meta)).expect("write trace file");
    path
}

/// A seeded random vector in [-1, 1) (never all zeros).
pub fn randv(rng: &mut rand_chacha::ChaCha8Rng, n: usize) -> Vec<f32> {
    use rand::Rng;
    (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect()
}

pub fn rng(seed: u64) -> rand_chacha::ChaCha8Rng {
    use rand::SeedableRng;
    rand_chacha::ChaCha8Rng::seed_from_u64(seed)
}
