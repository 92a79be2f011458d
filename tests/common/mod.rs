//! Helpers shared by integration tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

/// Run every `cases/<prefix>*.toml` through `nvfp4dbg run` (the project's one case runner):
/// each must hold (verdict == expect, every promised mention in the report). Returns how many.
pub fn cases_hold(prefix: &str) -> usize {
    let cases = Path::new(env!("CARGO_MANIFEST_DIR")).join("cases");
    let mut n = 0;
    for entry in std::fs::read_dir(&cases).unwrap() {
        let path = entry.unwrap().path();
        let fname = path.file_name().unwrap().to_str().unwrap().to_string();
        if !(fname.starts_with(prefix) && fname.ends_with(".toml")) {
            continue;
        }
        n += 1;
        let dir = tempfile::tempdir().unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_nvfp4dbg"))
            .arg("run")
            .arg(&path)
            .arg("--no-report-dir")
            .arg("--quiet")
            .current_dir(dir.path())
            .output()
            .unwrap();
        assert_eq!(
            out.status.code(),
            Some(0),
            "{fname} does not hold\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    n
}

/// The binary: `NVFP4DBG_BIN`, else the `nvfp4dbg` packaged next to this test executable
/// (.ci/gpu-nightly puts both in one folder on the GPU machine), else cargo's build.
pub fn binary() -> PathBuf {
    if let Some(p) = std::env::var_os("NVFP4DBG_BIN") {
        // the commands run in temporary directories: a relative path must not break them
        return std::fs::canonicalize(&p).unwrap_or_else(|_| p.into());
    }
    let sibling = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(|d| d.join("nvfp4dbg")))
        .filter(|p| p.is_file());
    sibling.unwrap_or_else(|| env!("CARGO_BIN_EXE_nvfp4dbg").into())
}

/// Run [`binary()`] with `args` plus `--json` in a fresh temporary folder: (exit code, stdout +
/// stderr, the JSON report when one was written).
pub fn run_json(args: &[&str]) -> (i32, String, Option<serde_json::Value>) {
    run_json_env(args, &[])
}

/// [`run_json`] with environment variables set for the run.
pub fn run_json_env(
    args: &[&str],
    envs: &[(&str, &str)],
) -> (i32, String, Option<serde_json::Value>) {
    let tmp = tempfile::tempdir().unwrap();
    let json = tmp.path().join("report.json");
    let bin = binary();
    eprintln!("running {} {args:?}", bin.display());
    let o = Command::new(&bin)
        .args(args)
        .args([
            "--json",
            json.to_str().unwrap(),
            "--no-report-dir",
            "--quiet",
        ])
        .envs(envs.iter().copied())
        .current_dir(tmp.path())
        .output()
        .expect("run nvfp4dbg");
    let text =
        String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr);
    let report = std::fs::read_to_string(&json)
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok());
    (o.status.code().unwrap_or(-1), text, report)
}

/// nvcc for the GPU tests that build CUDA programs: `NVCC`, else /usr/local/cuda/bin/nvcc,
/// else the PATH's.
pub fn nvcc() -> PathBuf {
    if let Some(p) = std::env::var_os("NVCC") {
        return p.into();
    }
    let local = PathBuf::from("/usr/local/cuda/bin/nvcc");
    if local.is_file() {
        return local;
    }
    PathBuf::from("nvcc")
}
