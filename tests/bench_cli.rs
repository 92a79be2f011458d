//! `nvfp4dbg bench` on the CPU: it is a GPU benchmark, so every way of running it without a
//! usable GPU ends in exit 2 with a message that says so, never a panic and never a report.

use std::process::Command;

struct Out {
    code: i32,
    stdout: String,
    stderr: String,
}

fn bench(dir: &std::path::Path, args: &[&str]) -> Out {
    let o = Command::new(env!("CARGO_BIN_EXE_nvfp4dbg"))
        .arg("bench")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("run nvfp4dbg");
    Out {
        code: o.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
    }
}

fn show(o: &Out) -> String {
    format!(
        "exit {}\nstdout:\n{}\nstderr:\n{}",
        o.code, o.stdout, o.stderr
    )
}

#[test]
fn device_cpu_is_a_usage_error() {
    let tmp = tempfile::tempdir().unwrap();
    let json = tmp.path().join("bench.json");
    let o = bench(
        tmp.path(),
        &["--device", "cpu", "--json", json.to_str().unwrap()],
    );
    assert_eq!(o.code, 2, "{}", show(&o));
    assert!(
        o.stderr.contains("--device cpu has nothing to time"),
        "{}",
        show(&o)
    );
    assert!(!o.stderr.contains("internal error"), "{}", show(&o));
    assert!(!json.exists(), "no report on a usage error");
    assert!(!tmp.path().join("reports").exists());
}

#[test]
fn a_missing_gpu_is_exit_2_naming_the_device() {
    // cuda:4096 exists nowhere: no driver here, too few devices on a GPU machine
    let tmp = tempfile::tempdir().unwrap();
    let json = tmp.path().join("bench.json");
    let o = bench(
        tmp.path(),
        &[
            "--device",
            "cuda:4096",
            "--quick",
            "--json",
            json.to_str().unwrap(),
        ],
    );
    assert_eq!(o.code, 2, "{}", show(&o));
    assert!(o.stderr.contains("no usable CUDA device"), "{}", show(&o));
    assert!(o.stderr.contains("GPU benchmark"), "{}", show(&o));
    assert!(!o.stderr.contains("internal error"), "{}", show(&o));
    assert!(!json.exists());
}

#[test]
fn unknown_figures_are_refused_before_touching_the_gpu() {
    let tmp = tempfile::tempdir().unwrap();
    let o = bench(tmp.path(), &["--only", "gemm,no_such_figure", "--quiet"]);
    assert_eq!(o.code, 2, "{}", show(&o));
    assert!(o.stderr.contains("`no_such_figure`"), "{}", show(&o));
    // the message lists what exists
    assert!(o.stderr.contains("gemm_decode_64"), "{}", show(&o));
    assert!(o.stderr.contains("layer_4096_graph"), "{}", show(&o));
}

#[test]
fn help_explains_the_floors() {
    let tmp = tempfile::tempdir().unwrap();
    let o = bench(tmp.path(), &["--help"]);
    assert_eq!(o.code, 0, "{}", show(&o));
    for w in [
        "--quick",
        "--only",
        "--device",
        "--json",
        "achieved/floor",
        "bytes / copy bandwidth",
    ] {
        assert!(o.stdout.contains(w), "`{w}` missing:\n{}", o.stdout);
    }
    // a GPU benchmark: its default device is the GPU, with no CPU fallback promised
    assert!(o.stdout.contains("[default: cuda]"), "{}", o.stdout);
    assert!(!o.stdout.contains("else cpu"), "{}", o.stdout);
}
