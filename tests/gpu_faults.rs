//! GPU faults end as exit 2 naming the step and the kernel: never a hang, never a panic.
//! Each fault is injected through the hidden `NVFP4DBG_FAULT` (docs/dev-faults.md) into a real
//! `layertest --device cuda:0` run: a kernel that does not compile, an illegal address inside
//! a kernel, a kernel that never ends, an allocation that runs out of memory. GPU tests are #[ignore] (.ci/gpu-nightly
//! runs them); the compile fault also runs without a GPU where NVRTC is available
//! (`.ci/compile-kernels`).

mod common;

use common::binary;
use nvfp4dbg::backend::cuda::nvrtc;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A run that is still going after this long is a hang (the fault-free run takes seconds).
const HANG: Duration = Duration::from_secs(180);

/// (exit code, stdout + stderr) of `nvfp4dbg layertest --device cuda:0 ARGS` under `env`.
fn layertest(env: &[(&str, &str)], args: &[&str]) -> (i32, String) {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out.txt");
    let err = tmp.path().join("err.txt");
    let bin = binary();
    eprintln!("running {env:?} {} layertest {args:?}", bin.display());
    let mut child = Command::new(&bin)
        .arg("layertest")
        .args(["--device", "cuda:0", "--quiet", "--no-report-dir"])
        .args(args)
        .envs(env.iter().copied())
        .current_dir(tmp.path())
        .stdout(Stdio::from(std::fs::File::create(&out).unwrap()))
        .stderr(Stdio::from(std::fs::File::create(&err).unwrap()))
        .spawn()
        .expect("run nvfp4dbg");
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > HANG {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{env:?} layertest {args:?}: still running after {HANG:?} (a hang)");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let text = std::fs::read_to_string(&out).unwrap() + &std::fs::read_to_string(&err).unwrap();
    eprintln!(
        "exit {:?} after {:?}:\n{text}",
        status.code(),
        start.elapsed()
    );
    (status.code().unwrap_or(-1), text)
}

/// Exit 2, the error line names a step and a kernel, nothing panicked.
fn assert_clean_gpu_error(code: i32, text: &str, what: &str) {
    assert_eq!(code, 2, "{what}: {text}");
    assert!(text.contains("nvfp4dbg: error:"), "{what}: {text}");
    for bad in ["panicked at", "internal error", "RUST_BACKTRACE"] {
        assert!(
            !text.contains(bad),
            "{what}: `{bad}` in the output:\n{text}"
        );
    }
}

/// `CUDA error during STEP (kernel `KERNEL`)`: the step and the kernel it names.
fn step_and_kernel(text: &str) -> (String, String) {
    let at = text
        .find("CUDA error during ")
        .unwrap_or_else(|| panic!("no `CUDA error during` in:\n{text}"));
    let rest = &text[at + "CUDA error during ".len()..];
    let k = rest
        .find(" (kernel `")
        .unwrap_or_else(|| panic!("no kernel named in:\n{text}"));
    let kernel = &rest[k + " (kernel `".len()..];
    let kernel = &kernel[..kernel.find('`').unwrap()];
    (rest[..k].to_string(), kernel.to_string())
}

#[test]
#[ignore = "GPU: run by .ci/gpu-nightly"]
fn a_kernel_that_does_not_compile_names_the_module_and_the_nvrtc_log() {
    // every module broken: the first one compiled is reported
    let (code, text) = layertest(&[("NVFP4DBG_FAULT", "compile")], &[]);
    assert_clean_gpu_error(code, &text, "compile");
    let (step, kernel) = step_and_kernel(&text);
    assert!(step.starts_with("NVRTC compile for sm_"), "{step}");
    assert!(
        nvrtc::MODULES.iter().any(|m| m.file == kernel),
        "`{kernel}` is not one of the modules"
    );
    // NVRTC's log, with the file and line of the bad line
    assert!(
        text.contains("nvfp4dbg_injected_compile_fault") && text.contains(&format!("{kernel}(")),
        "{text}"
    );
    assert!(
        text.contains("--device cpu"),
        "the CPU path is not offered: {text}"
    );

    // only the MoE module broken: the router and quantizer compile, the MoE GEMMs do not
    let file = nvrtc::MOE.file;
    let (code, text) = layertest(&[("NVFP4DBG_FAULT", &format!("compile:{file}"))], &[]);
    assert_clean_gpu_error(code, &text, "compile:moe");
    assert_eq!(step_and_kernel(&text).1, file, "{text}");
}

#[test]
#[ignore = "GPU: run by .ci/gpu-nightly"]
fn an_illegal_address_inside_a_kernel_is_a_clean_error() {
    // as it happens in the field: the fault surfaces at whatever comes next on the stream (a
    // launch, a copy, a sync: CUDA's illegal address; a cuBLAS call: its execution failure)
    let (code, text) = layertest(&[("NVFP4DBG_FAULT", "illegal-address")], &[]);
    assert_clean_gpu_error(code, &text, "illegal-address");
    let (step, kernel) = step_and_kernel(&text);
    assert!(
        text.contains("CUDA_ERROR_ILLEGAL_ADDRESS") || text.contains("CUBLAS_STATUS_"),
        "{text}"
    );
    assert!(
        !step.is_empty() && !kernel.is_empty() && kernel != "-",
        "{text}"
    );

    // NVFP4DBG_CUDA_SYNC=1 pins the fault on the kernel that made it
    let (code, text) = layertest(
        &[
            ("NVFP4DBG_FAULT", "illegal-address"),
            ("NVFP4DBG_CUDA_SYNC", "1"),
        ],
        &[],
    );
    assert_clean_gpu_error(code, &text, "illegal-address, synchronous");
    assert!(text.contains("CUDA_ERROR_ILLEGAL_ADDRESS"), "{text}");
    assert_eq!(
        step_and_kernel(&text).1,
        "nvfp4dbg_injected_illegal_address",
        "{text}"
    );

    // at a chosen kernel deep in the forward (the combine after the expert GEMMs, which run
    // on every arch and batch size; the GEMM kernels themselves depend on both), under
    // --cuda-graph as well
    let gemm = "moe_combine";
    assert!(nvrtc::MOE.kernels.contains(&gemm));
    for extra in [&[][..], &["--cuda-graph"][..]] {
        let fault = format!("illegal-address:{gemm}");
        let (code, text) = layertest(&[("NVFP4DBG_FAULT", &fault)], extra);
        assert_clean_gpu_error(code, &text, &format!("{fault} {extra:?}"));
        let (_, kernel) = step_and_kernel(&text);
        assert!(
            text.contains("CUDA_ERROR_ILLEGAL_ADDRESS") || text.contains("CUBLAS_STATUS_"),
            "{text}"
        );
        assert!(kernel != "-", "{text}");
    }
}

#[test]
#[ignore = "GPU: run by .ci/gpu-nightly"]
fn a_kernel_that_never_ends_is_a_clean_error_not_a_hang() {
    // the watchdog ends the run once the host has waited NVFP4DBG_KERNEL_TIMEOUT_S for the GPU
    // (a synchronize, a copy behind the kernel), naming the step and the kernels in flight; at
    // the first kernel, at one deep in the forward, and under --cuda-graph
    for (fault, extra) in [
        ("hang", &[][..]),
        ("hang:moe_combine", &[][..]),
        ("hang:moe_combine", &["--cuda-graph"][..]),
    ] {
        let start = Instant::now();
        let (code, text) = layertest(
            &[
                ("NVFP4DBG_FAULT", fault),
                ("NVFP4DBG_KERNEL_TIMEOUT_S", "5"),
            ],
            extra,
        );
        let took = start.elapsed();
        assert_clean_gpu_error(code, &text, &format!("{fault} {extra:?}"));
        assert!(
            text.contains("error: hang during ") && text.contains("waited 5 s for the GPU"),
            "{fault} {extra:?}: {text}"
        );
        if extra.is_empty() {
            assert!(
                text.contains("nvfp4dbg_injected_hang"),
                "{fault}: the kernels in flight are not named: {text}"
            );
        }
        assert!(
            took < Duration::from_secs(90),
            "{fault} {extra:?}: {took:?}"
        );
    }
}

#[test]
#[ignore = "GPU: run by .ci/gpu-nightly"]
fn out_of_memory_is_gpu_oom_with_advice() {
    for (fault, names) in [
        ("oom", "allocating"),
        ("oom:expert", "expert"),
        ("oom:router logits", "router logits"),
    ] {
        let (code, text) = layertest(&[("NVFP4DBG_FAULT", fault)], &[]);
        assert_clean_gpu_error(code, &text, fault);
        assert!(
            text.contains("out of GPU memory during allocating") && text.contains(names),
            "{fault}: {text}"
        );
        assert!(
            text.contains("CUDA_ERROR_OUT_OF_MEMORY") && text.contains("--device cpu"),
            "{fault}: {text}"
        );
    }
}

#[test]
#[ignore = "GPU: run by .ci/gpu-nightly"]
fn a_misspelled_fault_is_a_usage_error_not_a_clean_run() {
    let (code, text) = layertest(&[("NVFP4DBG_FAULT", "illegal_address")], &[]);
    assert_clean_gpu_error(code, &text, "typo");
    assert!(text.contains("NVFP4DBG_FAULT=illegal_address"), "{text}");
}

/// Without a GPU: the compile fault through NVRTC alone (libnvrtc and the CUDA headers from
/// `.ci/compile-kernels`; skipped when NVFP4DBG_NVRTC_CHECK is unset). The fault is read from
/// the environment once per process, so the check runs in a child: this test binary again.
#[test]
fn the_compile_fault_names_the_module_and_the_log_without_a_gpu() {
    const CHILD: &str = "NVFP4DBG_FAULT_TEST_CHILD";
    let file = nvrtc::MOE.file;
    if std::env::var_os(CHILD).is_some() {
        for arch in ["sm_90a", "sm_100a"] {
            // another module still compiles...
            nvrtc::compile_cubin(&nvrtc::ROUTER, arch).unwrap_or_else(|e| panic!("{e}"));
            // ...the broken one is an error naming it, the arch and NVRTC's log
            let e = nvrtc::compile_cubin(&nvrtc::MOE, arch).expect_err("broken source compiled");
            let m = e.to_string();
            eprintln!("{m}");
            assert!(
                m.contains(&format!("NVRTC compile for {arch}"))
                    && m.contains(&format!("(kernel `{file}`)"))
                    && m.contains("nvfp4dbg_injected_compile_fault")
                    && m.contains(&format!("{file}(")),
                "{m}"
            );
        }
        return;
    }
    if std::env::var_os("NVFP4DBG_NVRTC_CHECK").is_none() {
        eprintln!("skipped (NVFP4DBG_NVRTC_CHECK unset; run .ci/compile-kernels)");
        return;
    }
    let o = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "the_compile_fault_names_the_module_and_the_log_without_a_gpu",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, "1")
        .env("NVFP4DBG_FAULT", format!("compile:{file}"))
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success() && text.contains("1 passed"), "{text}");
}
