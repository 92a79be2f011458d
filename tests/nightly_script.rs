//! `.ci/gpu-nightly` on stand-in binaries (shell scripts, no GPU): a test or a case run that
//! hangs is stopped at its time limit and reported as such, and the other tests still run; a
//! test that needs two GPUs is listed as not run on one, never as passed.
//! (Not named gpu_*: the nightly packages and runs those.)

use std::path::Path;
use std::process::Command;
use std::time::Instant;

fn write_exe(path: &Path, body: &str) {
    std::fs::write(path, format!("#!/usr/bin/env bash\n{body}")).unwrap();
    let mut perm = std::fs::metadata(path).unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perm, 0o755);
    std::fs::set_permissions(path, perm).unwrap();
}

/// A package dir whose `gpu_fake` lists `passes`, `hangs` and `all_reduce_over_two_gpus`
/// (which passes wherever it runs), an `nvfp4dbg` whose `run cases/` hangs when `cases_hang`
/// (else reports no cases), and an `nvidia-smi` on PATH listing `gpus` GPUs.
fn stand_ins(dir: &Path, cases_hang: bool, gpus: usize) {
    let bin = dir.join("bin");
    let path = dir.join("path");
    std::fs::create_dir_all(&bin).unwrap();
    std::fs::create_dir_all(&path).unwrap();
    write_exe(
        &bin.join("gpu_fake"),
        r#"case "$*" in
  *--list*) printf 'passes: test\nhangs: test\nall_reduce_over_two_gpus: test\n' ;;
  *"--exact passes"*|*"--exact all_reduce_over_two_gpus"*) echo "test result: ok. 1 passed; 0 failed" ;;
  *"--exact hangs"*) exec sleep 60 ;;
esac
"#,
    );
    let run = if cases_hang {
        "exec sleep 60"
    } else {
        r#"while [ $# -gt 0 ]; do [ "$1" = --json ] && echo '{"cases": []}' > "$2"; shift; done"#
    };
    write_exe(&bin.join("nvfp4dbg"), run);
    let smi: String = (0..gpus)
        .map(|g| format!("echo 'GPU {g}: stand-in'\n"))
        .collect();
    write_exe(&path.join("nvidia-smi"), &smi);
}

/// Runs the nightly on the stand-ins with 2-second limits: (exit code, summary.json, seconds).
fn nightly(dir: &Path) -> (i32, serde_json::Value, f64) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join(".ci/gpu-nightly");
    let reports = dir.join("reports");
    let path = format!(
        "{}:{}",
        dir.join("path").display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let t0 = Instant::now();
    let out = Command::new("bash")
        .arg(&script)
        .arg(dir.join("bin"))
        .env("PATH", path)
        .env("NVFP4DBG_REPORTS", &reports)
        .env("NVFP4DBG_TEST_TIMEOUT_S", "2")
        .env("NVFP4DBG_CASES_TIMEOUT_S", "2")
        .output()
        .expect("bash runs .ci/gpu-nightly");
    let secs = t0.elapsed().as_secs_f64();
    let text = std::fs::read_to_string(reports.join("summary.json")).unwrap_or_else(|e| {
        panic!(
            "no summary.json ({e}); stdout:\n{}\nstderr:\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (
        out.status.code().unwrap_or(-1),
        serde_json::from_str(&text).unwrap(),
        secs,
    )
}

/// The status the nightly's summary gives test `name`.
fn status(summary: &serde_json::Value, name: &str) -> serde_json::Value {
    summary["tests"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == name)
        .unwrap_or_else(|| panic!("{name} missing: {summary}"))["status"]
        .clone()
}

#[test]
fn a_hung_test_is_stopped_reported_and_the_rest_still_run() {
    let dir = tempfile::tempdir().unwrap();
    stand_ins(dir.path(), false, 1);
    let (rc, summary, secs) = nightly(dir.path());
    assert_eq!(rc, 1, "{summary}");
    assert_eq!(summary["verdict"], "fail");
    assert_eq!(status(&summary, "passes"), "passed");
    assert_eq!(status(&summary, "hangs"), "timeout");
    assert!(
        secs < 30.0,
        "the hang was not stopped: {secs:.1} s (the stand-in sleeps 60 s)"
    );
    let log = std::fs::read_to_string(dir.path().join("reports/tests/gpu_fake.hangs.log")).unwrap();
    assert!(log.contains("stopped after 2 s"), "{log}");
    let junit = std::fs::read_to_string(dir.path().join("reports/junit.xml")).unwrap();
    assert!(
        junit.contains(r#"<failure message="test timeout"/>"#),
        "{junit}"
    );
}

#[test]
fn hung_cases_are_stopped_and_reported() {
    let dir = tempfile::tempdir().unwrap();
    stand_ins(dir.path(), true, 1);
    let (rc, summary, secs) = nightly(dir.path());
    assert_eq!(rc, 1, "{summary}");
    let error = summary["summary"]["cases_error"]
        .as_str()
        .unwrap_or_default();
    assert!(error.contains("stopped after 2 s"), "{summary}");
    assert!(secs < 40.0, "the cases' hang was not stopped: {secs:.1} s");
}

#[test]
fn a_two_gpu_test_is_not_run_on_one_gpu_and_runs_on_two() {
    for gpus in [1, 2] {
        let dir = tempfile::tempdir().unwrap();
        stand_ins(dir.path(), false, gpus);
        let (_, summary, _) = nightly(dir.path());
        let want = if gpus == 1 { "not-run" } else { "passed" };
        assert_eq!(
            status(&summary, "all_reduce_over_two_gpus"),
            want,
            "{gpus} GPUs: {summary}"
        );
        assert_eq!(
            summary["summary"]["tests_not_run"],
            if gpus == 1 { 1 } else { 0 },
            "{summary}"
        );
        // the hung test still fails the run: a test not run changes no other verdict
        assert_eq!(summary["verdict"], "fail");
        let md = std::fs::read_to_string(dir.path().join("reports/summary.md")).unwrap();
        let junit = std::fs::read_to_string(dir.path().join("reports/junit.xml")).unwrap();
        if gpus == 1 {
            assert!(md.contains("1/3 passed, 1 not run (need 2 GPUs)"), "{md}");
            assert!(
                junit.contains(r#"<skipped message="needs 2 GPUs"/>"#),
                "{junit}"
            );
        } else {
            assert!(md.contains("2/3 passed;"), "{md}");
        }
    }
}
