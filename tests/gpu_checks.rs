//! The exhaustive checks of tools/checks/*.cu, built with nvcc for this GPU and run: each
//! compares a fast device function of kernels/nvfp4dbg_common.cuh with the reference form it
//! replaces on every f32 input it can see, and prints "mismatches 0 of N".
//!
//! - `expf_cr_fast.cu`: `expf_cr` (SwiGLU's and the router's exp, EXPF_CR_FAST) against
//!   `(float)exp((double)x)` on all 2^32 bit patterns;
//! - `e4m3_hw_encode.cu`: the hardware E4M3 conversion against the reference encoder on every
//!   non-NaN f32 <= 448;
//! - `swiglu16.cu`: `swiglu16` (the register-A gate/up epilogue's SwiGLU, 16 at a time)
//!   against `swiglu` value by value, every f32 as the gate, with and without swiglu_limit;
//! - `swiglu_nvfp4.cu`: `swiglu_nvfp4_16` (that epilogue's SwiGLU and NVFP4 block together,
//!   fast values where no scale or code can change) against `swiglu16` then the block, every
//!   f32 as a gate in blocks of 16, and its error bound on every gate of its domain.
//!
//! The sources are embedded (the GPU machine runs this binary without the repo); nvcc comes
//! from `NVCC`, /usr/local/cuda/bin or the PATH. Without nvcc or a GPU the test fails.

mod common;
mod gpu_common;

use std::process::Command;

/// The headers the checks include, written beside them.
const HEADERS: &[(&str, &str)] = &[
    (
        "nvfp4dbg_common.cuh",
        include_str!("../kernels/nvfp4dbg_common.cuh"),
    ),
    (
        "exhaustive.cuh",
        include_str!("../tools/checks/exhaustive.cuh"),
    ),
];
const CHECKS: &[(&str, &str)] = &[
    (
        "expf_cr_fast",
        include_str!("../tools/checks/expf_cr_fast.cu"),
    ),
    (
        "e4m3_hw_encode",
        include_str!("../tools/checks/e4m3_hw_encode.cu"),
    ),
    ("swiglu16", include_str!("../tools/checks/swiglu16.cu")),
    (
        "swiglu_nvfp4",
        include_str!("../tools/checks/swiglu_nvfp4.cu"),
    ),
];

#[test]
#[ignore = "needs a GPU and nvcc (.ci/gpu-nightly)"]
fn fast_device_functions_equal_their_reference_on_every_input() {
    let arch = gpu_common::gpu().arch.clone();
    // a variant's knobs, as the kernels get them (NVFP4DBG_NVRTC_DEFINES)
    let defines = nvfp4dbg::backend::cuda::nvrtc::tuning_defines();
    let dir = tempfile::tempdir().unwrap();
    for (name, text) in HEADERS {
        std::fs::write(dir.path().join(name), text).unwrap();
    }
    for (name, src) in CHECKS {
        let cu = dir.path().join(format!("{name}.cu"));
        let exe = dir.path().join(name);
        std::fs::write(&cu, src).unwrap();
        let built = Command::new(common::nvcc())
            .arg(format!("-arch={arch}"))
            .args(&defines)
            .args(["-O3", "--fmad=false", "-I"])
            .arg(dir.path())
            .arg(&cu)
            .arg("-o")
            .arg(&exe)
            .output()
            .expect("nvcc must be installed on the GPU machine (or set NVCC)");
        assert!(
            built.status.success(),
            "nvcc {name}.cu: {}",
            String::from_utf8_lossy(&built.stderr)
        );
        let ran = Command::new(&exe).output().unwrap();
        let out = String::from_utf8_lossy(&ran.stdout);
        eprintln!("{name} ({arch} {defines:?}): {}", out.trim());
        assert!(
            ran.status.success() && out.starts_with("mismatches 0 of "),
            "{name}: exit {:?} (1: a mismatch, 2: a CUDA call failed), {out}{}",
            ran.status.code(),
            String::from_utf8_lossy(&ran.stderr)
        );
    }
}
