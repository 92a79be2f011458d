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

/// The trace cases must name the module the fault was planted in, not merely mention it: the
/// same case with the fault moved to a neighbouring module must not hold (their module-name
/// mentions also appear in the report's table of calls around the fault).
#[test]
fn trace_cases_do_not_hold_with_the_fault_moved_to_a_neighbour() {
    let seed: u64 = rand::random::<u64>() % 1_000_000;
    let cases: [(&str, &str, &[&str]); 4] = [
        (
            "nan-locate-attn-nan.toml",
            "model.layers.1.self_attn.attn",
            &[
                "model.layers.1.self_attn.v_proj",
                "model.layers.1.self_attn.o_proj",
            ],
        ),
        (
            "nan-locate-mlp-inf.toml",
            "model.layers.0.mlp.act_fn",
            &[
                "model.layers.0.mlp.gate_up_proj",
                "model.layers.0.mlp.down_proj",
            ],
        ),
        (
            "bisect-diverge.toml",
            "model.layers.1.mlp.down_proj",
            &["model.layers.1.mlp.act_fn", "model.layers.1.mlp"],
        ),
        (
            "bisect-nan.toml",
            "model.layers.0.self_attn.attn",
            &[
                "model.layers.0.self_attn.v_proj",
                "model.layers.0.self_attn.o_proj",
            ],
        ),
    ];
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("cases");
    let tmp = tempfile::tempdir().unwrap();
    for (case, planted, neighbours) in cases {
        let text = std::fs::read_to_string(dir.join(case)).unwrap();
        let text = with_seed(&text, seed);
        let flag = format!("\"--nan-at\", \"{planted}\"");
        let flag = if text.contains(&flag) {
            flag
        } else if text.contains(&format!("\"--inf-at\", \"{planted}\"")) {
            format!("\"--inf-at\", \"{planted}\"")
        } else {
            format!("\"--perturb\", \"{planted}\"")
        };
        assert!(text.contains(&flag), "{case}: no {flag}");
        let held = |name: &str, text: &str| {
            let path = tmp.path().join(name);
            std::fs::write(&path, text).unwrap();
            let out = Command::new(env!("CARGO_BIN_EXE_nvfp4dbg"))
                .current_dir(tmp.path())
                .arg("run")
                .arg(&path)
                .args(["--no-report-dir", "--quiet"])
                .output()
                .expect("run nvfp4dbg");
            out.status.code() == Some(0)
        };
        assert!(held(case, &text), "seed {seed}: {case} does not hold");
        for (i, n) in neighbours.iter().enumerate() {
            let moved = text.replace(&flag, &flag.replace(planted, n));
            assert!(
                !held(&format!("{i}-{case}"), &moved),
                "seed {seed}: {case} still holds with the fault planted in {n}"
            );
        }
    }
}

/// `text` with the value after every `"--seed", ` replaced by `seed`.
fn with_seed(text: &str, seed: u64) -> String {
    let key = "\"--seed\", \"";
    let mut out = String::new();
    let mut rest = text;
    while let Some(i) = rest.find(key) {
        out.push_str(&rest[..i + key.len()]);
        rest = &rest[i + key.len()..];
        out.push_str(&seed.to_string());
        rest = &rest[rest.find('"').expect("closing quote")..];
    }
    out.push_str(rest);
    out
}
