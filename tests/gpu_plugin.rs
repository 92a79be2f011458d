//! "Bring your own kernel" on a GPU: kernels/examples/moe_reference_plugin.cu built with nvcc
//! (the reference and its buggy twins) and run through `--kernel`. The reference passes and
//! agrees with the built-in kernel (also sharded over EP ranks, and under gs-sweep and
//! multilayer); each twin fails with its bug named; a crash and an error return are exit 2
//! naming the plugin, never a hang.
//!
//! The sources are embedded in this test binary (the GPU machine runs it without the repo);
//! nvcc comes from `NVCC`, the PATH or /usr/local/cuda/bin. Without nvcc the test fails.

mod common;

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

const HEADER: &str = include_str!("../kernels/include/nvfp4dbg_moe.h");
const PLUGIN: &str = include_str!("../kernels/examples/moe_reference_plugin.cu");

/// Build every variant in parallel: 0 = reference, 1..=5 the twins (NVFP4DBG_BUG), 6 = the
/// reference writing a BF16 output. Returns their paths.
fn build_plugins(dir: &Path) -> Vec<PathBuf> {
    std::fs::create_dir_all(dir.join("include")).unwrap();
    std::fs::write(dir.join("include/nvfp4dbg_moe.h"), HEADER).unwrap();
    let src = dir.join("moe_reference_plugin.cu");
    std::fs::write(&src, PLUGIN).unwrap();
    let jobs: Vec<_> = (0..=6)
        .map(|bug| {
            let out = dir.join(format!("plugin_bug{bug}.so"));
            let (src, inc, o) = (src.clone(), dir.join("include"), out.clone());
            let h = std::thread::spawn(move || {
                Command::new(common::nvcc())
                    .args(["-O3", "-arch=sm_90a", "-shared", "-Xcompiler", "-fPIC"])
                    .arg(if bug == 6 {
                        "-DNVFP4DBG_OUT_BF16".to_string()
                    } else {
                        format!("-DNVFP4DBG_BUG={bug}")
                    })
                    .arg("-I")
                    .arg(inc)
                    .arg(src)
                    .arg("-o")
                    .arg(o)
                    .output()
                    .expect("nvcc must be installed on the GPU machine (or set NVCC)")
            });
            (out, h)
        })
        .collect();
    jobs.into_iter()
        .map(|(out, h)| {
            let r = h.join().unwrap();
            assert!(
                r.status.success(),
                "nvcc {}: {}",
                out.display(),
                String::from_utf8_lossy(&r.stderr)
            );
            out
        })
        .collect()
}

/// (exit code, stdout + stderr, JSON report) of `nvfp4dbg CMD ARGS`, with a plugin hang cut
/// at 60 s.
fn run(cmd: &str, args: &[&str]) -> (i32, String, Option<Value>) {
    let all: Vec<&str> = std::iter::once(cmd).chain(args.iter().copied()).collect();
    common::run_json_env(&all, &[("NVFP4DBG_PLUGIN_TIMEOUT_S", "60")])
}

#[test]
#[ignore = "needs a GPU and nvcc (.ci/gpu-nightly)"]
fn plugins_are_judged_and_their_bugs_named() {
    let tmp = tempfile::tempdir().unwrap();
    let so = build_plugins(tmp.path());
    let p = |b: usize| so[b].to_str().unwrap().to_string();
    let seed = rand::random::<u16>().to_string();
    let base = [
        "--device",
        "cuda",
        "--tokens",
        "64",
        "--seed",
        seed.as_str(),
    ];
    let lt = |extra: &[&str]| {
        let args: Vec<&str> = base.iter().copied().chain(extra.iter().copied()).collect();
        run("layertest", &args)
    };

    // the reference plugin passes and agrees with the built-in kernel, with and without EP
    for ep in ["1", "2"] {
        let (code, text, r) = lt(&["--kernel", &p(0), "--ep", ep]);
        let what = format!("seed {seed} reference plugin --ep {ep}");
        assert_eq!(code, 0, "{what}: {text}");
        let r = r.unwrap();
        let j = &r["kernel"]["judgement"];
        assert_eq!(r["summary"]["kernel_pass"], true, "{what}: {r}");
        assert!(
            j["theirs_vs_ours"]["cosine"].as_f64().unwrap() >= 0.99999,
            "{what}: {j}"
        );
        assert!(text.contains("theirs vs ours"), "{what}: {text}");
    }

    // a BF16 output (as engines write) is widened and still agrees within the threshold
    let (code, text, r) = lt(&["--kernel", &p(6)]);
    assert_eq!(code, 0, "seed {seed} BF16-output plugin: {text}");
    assert_eq!(r.unwrap()["kernel"]["plugin"]["output_dtype"], "bf16");

    // each buggy twin fails and the report names its bug
    for (bug, ep, name) in [
        (2, "1", "gate-up-swapped"),
        (3, "1", "swizzled-scales-read-linear"),
        (1, "2", "local-ids-read-as-global"),
    ] {
        let (code, text, r) = lt(&["--kernel", &p(bug), "--ep", ep]);
        let what = format!("seed {seed} NVFP4DBG_BUG={bug} --ep {ep}");
        assert_eq!(code, 1, "{what}: {text}");
        let r = r.unwrap();
        assert_eq!(
            r["summary"]["kernel_diagnosis"], name,
            "{what}: {}",
            r["kernel"]
        );
        assert!(
            text.contains("the bug is in the kernel under test"),
            "{what}: {text}"
        );
    }
    // local ids read as global cannot show with one rank: every id is its own global id
    let (code, text, _) = lt(&["--kernel", &p(1)]);
    assert_eq!(code, 0, "seed {seed} NVFP4DBG_BUG=1 --ep 1: {text}");

    // a crash (illegal address) and an error return: exit 2 naming the plugin, no hang
    let (code, text, _) = lt(&["--kernel", &p(4)]);
    assert_eq!(code, 2, "crash plugin: {text}");
    assert!(
        text.contains(&p(4)) && text.contains("CUDA error in the plugin"),
        "{text}"
    );
    let (code, text, _) = lt(&["--kernel", &p(5)]);
    assert_eq!(code, 2, "error plugin: {text}");
    assert!(
        text.contains(&p(5)) && text.contains("returned 7"),
        "{text}"
    );
    assert!(
        text.contains("refuses to run"),
        "last_error is reported: {text}"
    );

    // gs-sweep and multilayer run the plugin in place of the built-in kernel: same verdicts
    let (good, twin) = (p(0), p(2));
    for cmd in ["gs-sweep", "multilayer"] {
        let args: Vec<&str> = base.iter().copied().chain(["--gs", "calibrated"]).collect();
        let (b_code, b_text, _) = run(cmd, &args);
        let with: Vec<&str> = args
            .iter()
            .copied()
            .chain(["--kernel", good.as_str()])
            .collect();
        let (code, text, r) = run(cmd, &with);
        assert_eq!(
            code, b_code,
            "{cmd} seed {seed}: builtin {b_text}\nplugin {text}"
        );
        assert_eq!(r.unwrap()["summary"]["kernel"], good.as_str());
        let with: Vec<&str> = args
            .iter()
            .copied()
            .chain(["--kernel", twin.as_str()])
            .collect();
        let (code, text, _) = run(cmd, &with);
        assert!(
            code == 0 || code == 1,
            "{cmd} with the gate/up twin: {text}"
        );
    }
}
