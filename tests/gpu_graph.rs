//! `layertest --cuda-graph` on a GPU: the NVFP4 layer forward captured in a CUDA graph and
//! replayed must equal its eager run bit for bit (fixed and per-batch dynamic scales). On the
//! CPU backend the flag is a usage error (that part runs in CPU CI too).

use serde_json::Value;
mod common;

/// (exit code, stdout + stderr, JSON report) of `layertest ARGS`.
fn layertest(args: &[&str]) -> (i32, String, Option<Value>) {
    let mut all = vec!["layertest"];
    all.extend_from_slice(args);
    common::run_json(&all)
}

#[test]
#[ignore = "needs a GPU (.ci/gpu-nightly)"]
fn graph_replay_equals_the_eager_run_bit_for_bit() {
    let seed = rand::random::<u16>().to_string();
    for gs in ["calibrated", "dynamic"] {
        let what = format!("seed {seed} --gs {gs}");
        let (code, text, r) = layertest(&[
            "--device",
            "cuda",
            "--cuda-graph",
            "--tokens",
            "64",
            "--seed",
            &seed,
            "--gs",
            gs,
        ]);
        eprintln!("{text}");
        assert_eq!(code, 0, "{what}:\n{text}");
        let r = r.unwrap_or_else(|| panic!("{what}: no JSON report"));
        assert_eq!(r["verdict"], "pass", "{what}");
        let g = &r["cuda_graph"];
        assert_eq!(g["graph_replay_bitwise_equal"], true, "{what}: {g}");
        assert_eq!(g["differing"], 0, "{what}: {g}");
        assert!(g["first_differing_index"].is_null(), "{what}: {g}");
        assert_eq!(g["act_stats_equal"], true, "{what}: {g}");
        assert!(g["replays"].as_u64().unwrap() >= 1, "{what}");
        assert_eq!(
            g["len"],
            64 * 256,
            "{what}: the built-in model's [T, hidden]"
        );
        assert!(g["device"].as_str().unwrap().starts_with("cuda:"), "{what}");
        assert_eq!(r["summary"]["graph_replay_bitwise_equal"], true, "{what}");
        // the kernels still match the CPU NVFP4 path
        assert_eq!(
            r["kernel_check"]["pass"], true,
            "{what}: {}",
            r["kernel_check"]
        );
        assert!(text.contains("CUDA graph"), "{what}: the table is printed");
    }
}

#[test]
fn cuda_graph_on_the_cpu_backend_is_a_usage_error() {
    let (code, text, _) = layertest(&["--device", "cpu", "--cuda-graph", "--tokens", "4"]);
    assert_eq!(code, 2, "{text}");
    assert!(
        text.contains("--cuda-graph") && text.contains("--device cuda"),
        "{text}"
    );
}
