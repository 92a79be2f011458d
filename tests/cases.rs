//! Every `cases/*.toml` present must hold: each runs through the real binary
//! (`nvfp4dbg run CASE --device …`) and must exit 0. Cases are found at test time, so cases other
//! commands add later are covered without touching this file; a case whose command is not
//! built yet, or whose flags the command does not accept, fails here, loudly, by name.
//!
//! `NVFP4DBG_CASES_DEVICE` picks the device (default `cpu`: this is the CPU suite; the GPU
//! nightly runs `nvfp4dbg run cases/ --device cuda`).

use std::path::{Path, PathBuf};
use std::process::Command;

fn case_files() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("cases");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("cases/ exists")
        .map(|e| e.expect("read cases/").path())
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .collect();
    files.sort();
    files
}

#[test]
fn every_case_in_cases_dir_holds() {
    let files = case_files();
    assert!(!files.is_empty(), "no cases/*.toml found");
    let device = std::env::var("NVFP4DBG_CASES_DEVICE").unwrap_or_else(|_| "cpu".into());
    let tmp = tempfile::tempdir().unwrap();
    let mut broken = Vec::new();
    for (i, f) in files.iter().enumerate() {
        let json = tmp.path().join(format!("{i}.json"));
        let out = Command::new(env!("CARGO_BIN_EXE_nvfp4dbg"))
            .current_dir(tmp.path())
            .arg("run")
            .arg(f)
            .args(["--device", &device, "--no-report-dir", "--quiet", "--json"])
            .arg(&json)
            .output()
            .expect("run nvfp4dbg");
        let code = out.status.code().unwrap_or(-1);
        // exit 0 and the report agreeing: the case held
        let held = std::fs::read_to_string(&json)
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .and_then(|v| v["cases"][0]["held"].as_bool())
            .unwrap_or(false);
        let name = f.file_name().unwrap().to_string_lossy().to_string();
        eprintln!("{name}: exit {code}{}", if held { " (holds)" } else { "" });
        if code != 0 || !held {
            broken.push(format!(
                "{name}: exit {code}\n--- stdout\n{}\n--- stderr\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ));
        }
    }
    assert!(
        broken.is_empty(),
        "{} of {} cases do not hold:\n\n{}",
        broken.len(),
        files.len(),
        broken.join("\n\n")
    );
}
