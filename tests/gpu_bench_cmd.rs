//! `nvfp4dbg bench --quick --json` on a GPU: every figure is there, ran without error, and
//! has finite, positive numbers and a floor; the floors are plausible; --only restricts.

use serde_json::Value;
mod common;

use common::binary;
use std::process::Command;

/// Every figure of `--quick` (all but the 8192^3 GEMM).
const QUICK_FIGURES: &[&str] = &[
    "copy_d2d",
    "cublas_bf16_4096",
    "quantize_bf16_reference",
    "quantize_bf16_cuda_fast",
    "gemm_prefill_4096_gate_up",
    "gemm_prefill_4096_down",
    "gemm_prefill_4096",
    "cublas_bf16_experts_4096",
    "gemm_decode_1",
    "cublas_bf16_experts_1",
    "gemm_decode_8",
    "cublas_bf16_experts_8",
    "gemm_decode_64",
    "cublas_bf16_experts_64",
    "reduce_compare",
    "reduce_nan_scan",
    "reduce_amax",
    "layer_16_eager",
    "layer_16_graph",
    "layer_4096_eager",
    "layer_4096_graph",
];

fn run(args: &[&str]) -> (Value, String, String) {
    let tmp = tempfile::tempdir().unwrap();
    let json = tmp.path().join("bench.json");
    let bin = binary();
    eprintln!("running {} bench {args:?}", bin.display());
    let o = Command::new(&bin)
        .arg("bench")
        .args(args)
        .args(["--json", json.to_str().unwrap(), "--no-report-dir"])
        .current_dir(tmp.path())
        .output()
        .expect("run nvfp4dbg");
    let stdout = String::from_utf8_lossy(&o.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(
        o.status.code(),
        Some(0),
        "bench {args:?} failed\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    let text = std::fs::read_to_string(&json).unwrap_or_else(|e| panic!("{e}\n{stderr}"));
    (serde_json::from_str(&text).unwrap(), stdout, stderr)
}

fn num(v: &Value, key: &str, fig: &str) -> f64 {
    let x = v[key]
        .as_f64()
        .unwrap_or_else(|| panic!("{fig}: `{key}` is {:?}", v[key]));
    assert!(x.is_finite() && x > 0.0, "{fig}: `{key}` = {x}");
    x
}

#[test]
#[ignore = "needs a GPU (.ci/gpu-nightly)"]
fn quick_bench_reports_every_figure_with_its_floor() {
    let (j, stdout, stderr) = run(&["--quick"]);
    eprintln!("{stdout}");
    assert_eq!(j["command"], "bench");
    assert_eq!(j["verdict"], "pass", "{stderr}");
    assert_eq!(j["settings"]["quick"], true);
    let results = j["results"].as_array().expect("results");
    let names: Vec<&str> = results.iter().filter_map(|r| r["name"].as_str()).collect();
    assert_eq!(names, QUICK_FIGURES, "figures or their order changed");
    let copy = num(&j["floors"], "copy_gbps", "floors");
    let bf16 = num(&j["floors"], "bf16_tflops", "floors");
    // any GPU the kernels run on (sm_80+) copies faster than 100 GB/s and multiplies BF16
    // faster than 10 TFLOP/s; faster than 50 TB/s or 20 PFLOP/s is a counting bug
    assert!((100.0..50_000.0).contains(&copy), "copy {copy} GB/s");
    assert!((10.0..20_000.0).contains(&bf16), "bf16 {bf16} TFLOP/s");
    assert!(num(&j["device"], "l2_bytes", "device") > 1e6);
    for r in results {
        let n = r["name"].as_str().unwrap();
        assert!(r["error"].is_null(), "{n}: {}", r["error"]);
        for k in [
            "value",
            "value_best",
            "median_ms",
            "min_ms",
            "mean_ms",
            "amount",
            "bytes",
            "floor_ms",
            "achieved_over_floor",
            "ratio",
        ] {
            num(r, k, n);
        }
        assert!(
            r["reps"].as_u64().unwrap() >= 5,
            "{n}: {} repeats",
            r["reps"]
        );
        assert!(num(r, "min_ms", n) <= num(r, "median_ms", n), "{n}");
        assert!(num(r, "value_best", n) >= num(r, "value", n), "{n}");
        let unit = r["unit"].as_str().unwrap();
        assert!(unit == "GB/s" || unit == "TFLOP/s", "{n}: unit {unit}");
        assert_eq!(
            r["ratio_to"],
            if unit == "GB/s" {
                "copy_d2d"
            } else {
                "cublas_bf16"
            },
            "{n}"
        );
        // beating the floor by 2x means the floor formula undercounts the work
        let aof = num(r, "achieved_over_floor", n);
        assert!(aof < 2.0, "{n}: achieved/floor {aof}");
        let formula = r["floor_formula"].as_str().unwrap_or("");
        assert!(formula.contains("GB/s"), "{n}: floor formula {formula:?}");
        // the table row is on stdout
        assert!(stdout.contains(n), "{n} missing from the table");
    }
    // FLOP-counted figures carry FLOPs; the speed-ups over cuBLAS BF16 exist
    for n in ["cublas_bf16_4096", "gemm_prefill_4096", "layer_4096_graph"] {
        let r = results.iter().find(|r| r["name"] == n).unwrap();
        num(r, "flops", n);
    }
    for t in [1, 8, 64] {
        let n = format!("gemm_decode_{t}");
        let r = results.iter().find(|r| r["name"] == n.as_str()).unwrap();
        num(r, "speedup_vs_cublas_bf16", &n);
        assert!(
            r["details"]["touched_experts"].as_u64().unwrap() >= 8,
            "{n}"
        );
    }
    let r = results
        .iter()
        .find(|r| r["name"] == "gemm_prefill_4096")
        .unwrap();
    num(r, "speedup_vs_cublas_bf16", "gemm_prefill_4096");
    assert_eq!(r["details"]["touched_experts"], 256);
    assert!(j["summary"]["achieved_over_floor"]["layer_16_graph"].is_number());
    assert!(stderr.contains("bench: "), "progress goes to stderr");
}

#[test]
#[ignore = "needs a GPU (.ci/gpu-nightly)"]
fn only_runs_the_asked_figures_and_the_floors() {
    let (j, _, _) = run(&["--quick", "--only", "reduce_nan_scan", "--quiet"]);
    let names: Vec<&str> = j["results"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|r| r["name"].as_str())
        .collect();
    assert_eq!(names, ["copy_d2d", "cublas_bf16_4096", "reduce_nan_scan"]);
    assert_eq!(j["verdict"], "pass");
}
