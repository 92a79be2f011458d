//! CPU CI: every CUDA module compiles with NVRTC for Hopper (sm_90a) and Blackwell (sm_100a),
//! and defines the kernels the launch wrappers ask for. Needs libnvrtc and the CUDA headers,
//! which `.ci/compile-kernels` provides from NVIDIA's wheels; skips when
//! NVFP4DBG_NVRTC_CHECK is unset.

use nvfp4dbg::backend::cuda::nvrtc;

fn enabled() -> bool {
    if std::env::var_os("NVFP4DBG_NVRTC_CHECK").is_none() {
        eprintln!("kernels_compile: skipped (NVFP4DBG_NVRTC_CHECK unset; run .ci/compile-kernels)");
        return false;
    }
    true
}

#[test]
fn every_module_compiles_for_hopper_and_blackwell() {
    if !enabled() {
        return;
    }
    let (major, minor) = nvrtc::nvrtc_version().unwrap_or_else(|e| panic!("{e}"));
    eprintln!(
        "NVRTC {major}.{minor}, include dirs {:?}",
        nvrtc::include_dirs()
    );
    for arch in ["sm_90a", "sm_100a"] {
        let built = nvrtc::compile_all(arch).unwrap_or_else(|e| panic!("{arch}: {e}"));
        assert_eq!(built.len(), nvrtc::MODULES.len());
        for (file, size) in built {
            eprintln!("{arch}: {file}: {size} bytes of CUBIN");
        }
    }
}

#[test]
fn the_fp4_conversion_instruction_is_used_on_blackwell_only() {
    if !enabled() {
        return;
    }
    let on = |arch| {
        let ptx = nvrtc::compile_ptx(&nvrtc::QUANT, arch).unwrap_or_else(|e| panic!("{arch}: {e}"));
        ptx.contains("cvt.rn.satfinite.e2m1x2.f32")
    };
    assert!(on("sm_100a"), "sm_100a should convert to E2M1 in hardware");
    assert!(!on("sm_90a"), "sm_90a has no E2M1 conversion instruction");
}

#[test]
fn resource_report_has_no_spills() {
    if !enabled() {
        return;
    }
    for m in nvrtc::MODULES {
        let (_, log) = nvrtc::compile_cubin_with(m, "sm_90a", &["--ptxas-options=--verbose"])
            .unwrap_or_else(|e| panic!("{e}"));
        for line in log.lines().filter(|l| {
            l.contains("registers") || l.contains("spill") || l.contains("Compiling entry")
        }) {
            eprintln!("{}: {}", m.file, line.trim());
        }
        for line in log.lines().filter(|l| l.contains("spill stores")) {
            assert!(line.contains(" 0 bytes spill stores"), "{}: {line}", m.file);
        }
    }
}

#[test]
fn a_broken_module_reports_the_file_and_the_log() {
    if !enabled() {
        return;
    }
    let bad = nvrtc::KernelModule {
        file: "kernels/broken.cu",
        source: "extern \"C\" __global__ void k(float* x) { x[0] = undefined_name; }",
        kernels: &["k"],
    };
    let e = nvrtc::compile_cubin(&bad, "sm_90a")
        .expect_err("must not compile")
        .to_string();
    assert!(e.contains("kernels/broken.cu"), "{e}");
    assert!(e.contains("undefined_name"), "{e}");
}
