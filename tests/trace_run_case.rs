//! `nvfp4dbg run`: the case format, expectations that do and do not hold, malformed case files,
//! directories of cases.

#[path = "trace_util/mod.rs"]
mod util;

use std::path::Path;
use util::*;

fn write(dir: &Path, name: &str, text: &str) -> String {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p.to_string_lossy().to_string()
}

const NAN_SETUP: &str = r#"setup = [["synth-trace", "--out", "${WORK}/t", "--seed", "SEED", "--nan-at", "model.layers.0.self_attn.attn"]]"#;

fn nan_setup(seed: u64) -> String {
    NAN_SETUP.replace("SEED", &seed.to_string())
}

#[test]
fn expectations_that_hold_and_that_do_not() {
    let seed: u64 = rand::random();
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let setup = nan_setup(seed);
    // the fault is found and named: the case holds
    let good = write(d, "good.toml", &format!(
        "description = \"nan\"\ncommand = \"nan-locate\"\nargs = [\"${{WORK}}/t\"]\nexpect = \"fail\"\nexpect_mentions = ['\"module\": \"model.layers.0.self_attn.attn\"', '\"inputs_clean\": true']\n{setup}\n"));
    let o = nvfp4dbg(d, &["run", &good]);
    assert_eq!(o.code, 0, "seed {seed}\n{}", o.show());
    assert_eq!(o.json["cases"][0]["held"], true);
    assert_eq!(o.json["cases"][0]["got"], "fail");
    assert_eq!(
        o.json["cases"][0]["report"]["first_nonfinite"]["module"],
        "model.layers.0.self_attn.attn"
    );
    // the inner command's tables are shown for a single case
    assert!(o.stdout.contains("First non-finite value"), "{}", o.show());

    // expecting pass on a broken trace: the case is broken, exit 1
    let wrong = write(d, "wrong.toml", &format!(
        "description = \"x\"\ncommand = \"nan-locate\"\nargs = [\"${{WORK}}/t\"]\nexpect = \"pass\"\n{setup}\n"));
    let o = nvfp4dbg(d, &["run", &wrong]);
    assert_eq!(o.code, 1, "{}", o.show());
    assert_eq!(o.json["cases"][0]["held"], false);
    assert!(
        o.json["summary"]["text"]
            .as_str()
            .unwrap()
            .contains("expected pass, got fail"),
        "{}",
        o.show()
    );

    // the right verdict without naming the fault is not enough
    let vague = write(d, "vague.toml", &format!(
        "description = \"x\"\ncommand = \"nan-locate\"\nargs = [\"${{WORK}}/t\"]\nexpect = \"fail\"\nexpect_mentions = [\"model.layers.1.mlp.down_proj_NOT\", \"NaN\"]\n{setup}\n"));
    let o = nvfp4dbg(d, &["run", &vague]);
    assert_eq!(o.code, 1, "{}", o.show());
    assert_eq!(
        o.json["cases"][0]["missing_mentions"],
        serde_json::json!(["model.layers.1.mlp.down_proj_NOT"])
    );

    // expect = "error": bad input must be rejected, mentions match the message
    let err = write(d, "err.toml", "description = \"x\"\ncommand = \"nan-locate\"\nargs = [\"${WORK}\"]\nexpect = \"error\"\nexpect_mentions = [\"no trace files\"]\n");
    let o = nvfp4dbg(d, &["run", &err]);
    assert_eq!(o.code, 0, "{}", o.show());
    assert_eq!(o.json["cases"][0]["got"], "error");

    // a setup step that fails breaks the case, naming the step
    let bad_setup = write(d, "bad-setup.toml", "description = \"x\"\ncommand = \"nan-locate\"\nargs = [\"${WORK}/t\"]\nexpect = \"pass\"\nsetup = [[\"synth-trace\", \"--out\", \"${WORK}/t\", \"--nan-at\", \"no.such.module\"]]\n");
    let o = nvfp4dbg(d, &["run", &bad_setup]);
    assert_eq!(o.code, 1, "{}", o.show());
    let e = o.json["cases"][0]["error"].as_str().unwrap();
    assert!(
        e.contains("setup[0]") && e.contains("no.such.module"),
        "{}",
        o.show()
    );

    // flags the command does not have: the case is broken, loudly, not skipped
    let flags = write(d, "flags.toml", "description = \"x\"\ncommand = \"nan-locate\"\nargs = [\"--tokens\", \"3\"]\nexpect = \"pass\"\n");
    let o = nvfp4dbg(d, &["run", &flags]);
    assert_eq!(o.code, 1, "{}", o.show());
    assert!(
        o.json["cases"][0]["error"]
            .as_str()
            .unwrap()
            .contains("--tokens"),
        "{}",
        o.show()
    );

    // ... also when the case expects an error: a command line that does not parse rejected
    // nothing (it used to count as the expected exit 2)
    let flags_err = write(d, "flags-err.toml", "description = \"x\"\ncommand = \"nan-locate\"\nargs = [\"${WORK}\", \"--tokens\", \"3\"]\nexpect = \"error\"\nexpect_mentions = [\"--tokens\"]\n");
    let o = nvfp4dbg(d, &["run", &flags_err]);
    assert_eq!(o.code, 1, "{}", o.show());
    assert_eq!(o.json["cases"][0]["got"], "broken", "{}", o.show());
    assert_eq!(o.json["cases"][0]["held"], false, "{}", o.show());
    assert_eq!(o.json["summary"]["broken"], 1, "{}", o.show());
    assert!(
        o.json["summary"]["text"]
            .as_str()
            .unwrap()
            .contains("broken"),
        "{}",
        o.show()
    );

    // a case whose setup went wrong judged nothing, whatever it expects
    let setup_err = write(d, "setup-err.toml", "description = \"x\"\ncommand = \"nan-locate\"\nargs = [\"${WORK}/t\"]\nexpect = \"error\"\nexpect_mentions = [\"t\"]\nsetup = [[\"synth-trace\", \"--out\", \"${WORK}/t\", \"--nan-at\", \"no.such.module\"]]\n");
    let o = nvfp4dbg(d, &["run", &setup_err]);
    assert_eq!(o.code, 1, "{}", o.show());
    assert_eq!(o.json["cases"][0]["got"], "broken", "{}", o.show());
}

#[test]
fn malformed_case_files_exit_2_naming_file_and_key() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let base = "description = \"x\"\ncommand = \"nan-locate\"\nexpect = \"pass\"\n";
    let bad = [
        ("unknown-key.toml", format!("{base}argz = []\n"), "argz"),
        (
            "missing-key.toml",
            "description = \"x\"\nexpect = \"pass\"\n".to_string(),
            "command",
        ),
        (
            "unknown-command.toml",
            base.replace("nan-locate", "nan-locat"),
            "nan-locat",
        ),
        (
            "nested-run.toml",
            base.replace("nan-locate", "run"),
            "`run`",
        ),
        (
            "bad-var.toml",
            format!("{base}args = [\"${{WROK}}/t\"]\n"),
            "args[0]",
        ),
        (
            "bad-expect.toml",
            base.replace("\"pass\"", "\"passes\""),
            "passes",
        ),
        (
            "bad-setup.toml",
            format!("{base}setup = [[\"synthz\"]]\n"),
            "setup[0][0]",
        ),
        (
            "error-without-mentions.toml",
            base.replace("\"pass\"", "\"error\""),
            "expect_mentions",
        ),
        (
            "empty-setup.toml",
            format!("{base}setup = [[]]\n"),
            "setup[0]",
        ),
        (
            "not-toml.toml",
            "description = \n".to_string(),
            "not-toml.toml",
        ),
        // a case writes only under its ${WORK}: checked before anything runs
        (
            "setup-writes-outside.toml",
            format!(
                "{base}setup = [[\"synth-trace\", \"--out\", {:?}]]\n",
                d.join("escaped-trace")
            ),
            "setup[0]",
        ),
        (
            "setup-writes-case-dir.toml",
            format!("{base}setup = [[\"quantize\", \"${{CASE_DIR}}/in.safetensors\", \"${{CASE_DIR}}/out.safetensors\"]]\n"),
            "${CASE_DIR}/out.safetensors",
        ),
        (
            "json-escapes-work.toml",
            format!("{base}args = [\"${{WORK}}\", \"--json\", \"${{WORK}}/../escaped.json\"]\n"),
            "args",
        ),
        (
            "relative-json.toml",
            format!("{base}args = [\"${{WORK}}\", \"--json\", \"escaped.json\"]\n"),
            "outside ${WORK}",
        ),
    ];
    for (name, text, key) in &bad {
        let p = write(d, name, text);
        let o = nvfp4dbg(d, &["run", &p]);
        assert_eq!(o.code, 2, "{name}\n{}", o.show());
        assert!(
            o.stderr.contains(name) && o.stderr.contains(key),
            "{name}: wants {key}\n{}",
            o.show()
        );
    }
    for escaped in ["escaped-trace", "escaped.json", "out.safetensors"] {
        assert!(!d.join(escaped).exists(), "{escaped} was written");
    }
    // in a directory, one malformed file stops the run before anything runs
    let dir = d.join("dir");
    std::fs::create_dir(&dir).unwrap();
    write(
        &dir,
        "a.toml",
        "description = \"x\"\ncommand = \"nan-locate\"\nargs = [\"${WORK}\"]\nexpect = \"error\"\nexpect_mentions = [\"no trace files\"]\n",
    );
    write(&dir, "b.toml", &format!("{base}oops = 1\n"));
    let o = nvfp4dbg(d, &["run", dir.to_str().unwrap()]);
    assert_eq!(o.code, 2, "{}", o.show());
    assert!(
        o.stderr.contains("b.toml") && o.stderr.contains("oops"),
        "{}",
        o.show()
    );
    let empty = d.join("empty");
    std::fs::create_dir(&empty).unwrap();
    assert_eq!(nvfp4dbg(d, &["run", empty.to_str().unwrap()]).code, 2);
    assert_eq!(nvfp4dbg(d, &["run", "nope.toml"]).code, 2);
    let o = nvfp4dbg(
        d,
        &[
            "run",
            dir.join("a.toml").to_str().unwrap(),
            "--device",
            "tpu",
        ],
    );
    assert_eq!(o.code, 2, "{}", o.show());
}

#[test]
fn a_directory_runs_every_case_with_a_summary() {
    let seed: u64 = rand::random();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cases");
    std::fs::create_dir(&dir).unwrap();
    // material committed next to the case, reached through ${CASE_DIR}
    let cfg = nvfp4dbg::trace::synthetic::SynthTraceConfig {
        seed,
        ..Default::default()
    };
    nvfp4dbg::trace::synthetic::write_trace(&dir.join("data/clean"), &cfg).unwrap();
    write(&dir, "1-committed.toml", "description = \"x\"\ncommand = \"nan-locate\"\nargs = [\"${CASE_DIR}/data/clean\"]\nexpect = \"pass\"\n");
    write(&dir, "2-setup.toml", &format!("description = \"x\"\ncommand = \"nan-locate\"\nargs = [\"${{WORK}}/t\"]\nexpect = \"fail\"\n{}\n", nan_setup(seed)));
    write(&dir, "3-broken.toml", "description = \"x\"\ncommand = \"nan-locate\"\nargs = [\"${CASE_DIR}/data/clean\"]\nexpect = \"fail\"\n");
    let o = nvfp4dbg(tmp.path(), &["run", dir.to_str().unwrap(), "--keep-work"]);
    let ctx = format!("seed {seed}\n{}", o.show());
    assert_eq!(o.code, 1, "{ctx}");
    assert_eq!(o.json["summary"]["cases"], 3, "{ctx}");
    assert_eq!(o.json["summary"]["held"], 2, "{ctx}");
    assert_eq!(o.json["summary"]["not_held"], 1, "{ctx}");
    // it ran and judged (pass where fail was expected): not held, but not broken
    assert_eq!(o.json["summary"]["broken"], 0, "{ctx}");
    let cases = o.json["cases"].as_array().unwrap();
    assert_eq!(
        cases
            .iter()
            .map(|c| c["held"].as_bool().unwrap())
            .collect::<Vec<_>>(),
        [true, true, false],
        "{ctx}"
    );
    assert!(o.stdout.contains("3-broken.toml"), "{ctx}");
    assert!(
        o.json["summary"]["text"]
            .as_str()
            .unwrap()
            .contains("1 of 3 cases did not hold: 3-broken.toml"),
        "{ctx}"
    );
    // --keep-work keeps ${WORK} with what setup wrote
    let work = Path::new(cases[1]["work"].as_str().unwrap());
    assert!(work.join("t").is_dir(), "{ctx}");
    std::fs::remove_dir_all(work.parent().unwrap()).unwrap();
}

#[test]
fn a_directory_of_device_cases_says_the_cpu_fallback_once() {
    let seed: u64 = rand::random::<u64>() % 1000;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cases");
    std::fs::create_dir(&dir).unwrap();
    // each case opens its device itself (no --device): on a machine without a GPU each falls
    // back to the CPU, and the note about it is for the run, not for every case
    for i in 0..3 {
        write(&dir, &format!("{i}-layertest.toml"), &format!(
            "description = \"x\"\ncommand = \"layertest\"\nargs = [\"--checkpoint\", \"${{WORK}}/ckpt\", \"--tokens\", \"16\", \"--seed\", \"{}\"]\nexpect = \"pass\"\nsetup = [[\"synth\", \"--out\", \"${{WORK}}/ckpt\", \"--preset\", \"tiny\", \"--seed\", \"{}\"]]\n",
            seed + i, seed + i
        ));
    }
    // not through `nvfp4dbg()`, whose --quiet silences the note
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_nvfp4dbg"))
        .current_dir(tmp.path())
        .args(["run", dir.to_str().unwrap(), "--no-report-dir"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    let ctx = format!("seed {seed}\n--- stderr\n{stderr}");
    assert_eq!(o.status.code(), Some(0), "{ctx}");
    let fell_back = nvfp4dbg::backend::open(&nvfp4dbg::backend::DeviceRequest::Auto)
        .map(|b| b.name() == "cpu")
        .unwrap_or(true);
    let said = stderr.matches("no usable GPU found").count();
    assert_eq!(said, usize::from(fell_back), "{ctx}");
}
