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

/// Spills accepted on purpose, with the reason (the down decode GEMM's 8-byte pass-level spill
/// at three CTAs per SM went with four, which fits in 64 registers).
const ALLOWED_SPILLS: &[(&str, u32)] = &[
    // the 160-token tile's 160 accumulators: a few set-up values (the output pointer, alpha's
    // inputs) go to the stack before the K loop and come back after it, none inside
    ("moe_gemm_nvfp4_sm90rs", 16),
    ("moe_gemm_gate_up_nvfp4_sm90rs", 16),
];

#[test]
fn resource_report_has_no_spills() {
    if !enabled() {
        return;
    }
    for m in nvrtc::MODULES {
        let (cubin, log) = nvrtc::compile_cubin_with(m, "sm_90a", &["--ptxas-options=--verbose"])
            .unwrap_or_else(|e| panic!("{e}"));
        // NVFP4DBG_DUMP_CUBIN=DIR keeps the CUBINs, for reading the SASS (nvdisasm)
        if let Some(dir) = std::env::var_os("NVFP4DBG_DUMP_CUBIN") {
            let stem = m
                .file
                .trim_start_matches("kernels/")
                .trim_end_matches(".cu");
            let path = std::path::Path::new(&dir).join(format!("{stem}.sm_90a.cubin"));
            std::fs::write(&path, &cubin).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        }
        for line in log.lines().filter(|l| {
            l.contains("registers")
                || l.contains("spill")
                || l.contains("Compiling entry")
                || l.contains("Potential Performance Loss")
        }) {
            eprintln!("{}: {}", m.file, line.trim());
        }
        assert_spills_allowed(m.file, &log);
    }
}

/// Every kernel in ptxas' verbose `log` spills at most its ALLOWED_SPILLS bytes.
fn assert_spills_allowed(what: &str, log: &str) {
    // ptxas names the kernel ("Compiling entry function 'K'"), then its spills
    let mut kernel = "";
    for line in log.lines() {
        if let Some(k) = line.split("Compiling entry function '").nth(1) {
            kernel = k.split('\'').next().unwrap_or("");
        }
        if let Some((before, _)) = line.split_once(" bytes spill stores") {
            let bytes: u32 = before
                .rsplit(' ')
                .next()
                .and_then(|b| b.parse().ok())
                .unwrap_or(u32::MAX);
            let allowed = ALLOWED_SPILLS
                .iter()
                .find(|(k, _)| *k == kernel)
                .map_or(0, |(_, b)| *b);
            assert!(bytes <= allowed, "{what}: {kernel}: {line}");
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

/// The SASS of `kernel` in `cubin`, by nvdisasm (NVFP4DBG_NVDISASM: `.ci/compile-kernels`
/// installs it from NVIDIA's wheel).
fn sass_of(nvdisasm: &str, cubin: &[u8], kernel: &str) -> String {
    let dir = std::env::temp_dir().join(format!("nvfp4dbg-sass-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("module.cubin");
    std::fs::write(&path, cubin).unwrap();
    let out = std::process::Command::new(nvdisasm)
        .arg("-c")
        .arg(&path)
        .output()
        .unwrap_or_else(|e| panic!("running {nvdisasm}: {e}"));
    assert!(
        out.status.success(),
        "nvdisasm: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    // a function's section starts at its `.text.NAME:` label and ends at the next section
    let start = text
        .find(&format!(".text.{kernel}:"))
        .unwrap_or_else(|| panic!("{kernel} not in the SASS"));
    let rest = &text[start..];
    let end = rest[1..].find("\t.section").map_or(rest.len(), |i| i + 1);
    rest[..end].to_string()
}

fn nvdisasm_path() -> String {
    let Some(nvdisasm) = std::env::var_os("NVFP4DBG_NVDISASM") else {
        panic!("NVFP4DBG_NVDISASM unset: .ci/compile-kernels installs nvdisasm and sets it");
    };
    nvdisasm.to_string_lossy().into_owned()
}

/// ptxas may serialize warpgroup MMAs without a word (a `WARPGROUP.DEPBAR.LE gsb0, 0x0` after
/// each one): the register-A prefill kernels then run a third slower (BENCHMARKS.md, session 7).
/// Their K loops must keep MMA groups in flight, waits down to 0 only at the loops' ends: two
/// groups at tile widths 32, 64, 96 and 128 tokens, one at 144 (the gate/up only) and 160
/// (their accumulators leave room for no more A fragments).
#[test]
fn the_register_a_prefill_keeps_its_mmas_in_flight() {
    if !enabled() {
        return;
    }
    let nvdisasm = nvdisasm_path();
    let cubin =
        nvrtc::compile_cubin(&nvrtc::MOE_GEMM_SM90, "sm_90a").unwrap_or_else(|e| panic!("{e}"));
    // per tile width: 2 chunks x 8 k16 steps x 2 m-blocks, one wait per step
    let steps = 2 * 8;
    for (kernel, widths, wide) in [
        ("moe_gemm_nvfp4_sm90rs", 5, 1),
        ("moe_gemm_gate_up_nvfp4_sm90rs", 6, 2),
    ] {
        let sass = sass_of(&nvdisasm, &cubin, kernel);
        let mmas = sass.matches("HGMMA").count();
        // the groups a wait leaves in flight: the immediate after `gsb0, `
        let waits = |n: &str| {
            sass.split("WARPGROUP.DEPBAR.LE gsb0, ")
                .skip(1)
                .filter(|rest| rest.split([' ', ';']).next() == Some(n))
                .count()
        };
        let (drained, one, two) = (waits("0x0"), waits("0x1"), waits("0x2"));
        eprintln!(
            "{kernel}: {mmas} HGMMA, waits to 2 / 1 / 0 in flight: {two} / {one} / {drained}"
        );
        assert_eq!(mmas, widths * steps * 2, "{kernel}: HGMMA count");
        assert!(
            drained <= widths && two == (widths - wide) * steps && one == wide * steps,
            "{kernel}: ptxas serialized the MMAs ({drained} waits to 0, {one} to 1, {two} to 2, {mmas} HGMMA)"
        );
    }
}

/// The warpgroup MMAs that follow a TMA issue (`UTMALDG`) with no `WARPSYNC` or `BAR.SYNC`
/// between them, in SASS order: the TMA issues counted, and the offending MMAs.
fn mmas_after_refill(sass: &str) -> (usize, Vec<String>) {
    let (mut issues, mut bad, mut pending) = (0, Vec::new(), false);
    for line in sass.lines() {
        if line.contains("UTMALDG") {
            issues += 1;
            pending = true;
        } else if line.contains("WARPSYNC") || line.contains("BAR.SYNC") {
            pending = false;
        } else if pending && line.contains("HGMMA") {
            pending = false;
            bad.push(line.trim().to_string());
        }
    }
    (issues, bad)
}

#[test]
fn the_refill_check_finds_an_mma_left_to_an_implicit_reconvergence() {
    // session 16's hanging build (b2f8762), as nvdisasm printed its down GEMM, abridged
    let hung = "BSSY B1, `(.L_x_1032) ;\nHGMMA.64x32x16.F32 R24, R72, gdesc[UR12], R24 ;\n\
        @!P5 SYNCS.ARRIVE.TRANS64.A1T0 RZ, [R139+URZ+0x28a20], RZ ;\n@P0 BRA `(.L_x_1033) ;\n\
        SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R83+URZ+0x28a20], R138 ;\nUTMALDG.2D [UR8], [UR12] ;\n\
        @P0 BRA.U.ANY `(.L_x_1037) ;\nBSYNC B1 ;\nWARPGROUP.ARRIVE ;\n\
        HGMMA.64x32x16.F32 R24, R80, gdesc[UR12], R24 ;\n";
    let (issues, bad) = mmas_after_refill(hung);
    assert_eq!((issues, bad.len()), (1, 1), "{bad:?}");
    // the same with the __syncwarp after the refill
    let fixed = hung.replace("BSYNC B1 ;", "BSYNC B1 ;\nWARPSYNC.ALL ;");
    assert!(mmas_after_refill(&fixed).1.is_empty());
}

/// Thread 0 refills the token ring in the middle of a chunk's warpgroup MMAs (rs_chunk, step
/// 4); the MMAs are `.aligned`, so its warp must be whole again before the next one. Session
/// 16's build b2f8762 left that to a BSSY / BSYNC pair opened before the chunk's MMAs at one
/// site of the down GEMM (the 32-token tiles), and its layer hung there (s17a: cuda-gdb found
/// thread 0's warp waiting at that HGMMA, the other warps at the loop's final barrier). Every
/// MMA after a TMA issue must come after a WARPSYNC (the kernel's __syncwarp) or a barrier,
/// in the default build and in the knobs' variant build.
#[test]
fn the_register_a_refills_reconverge_before_the_next_mma() {
    if !enabled() {
        return;
    }
    let nvdisasm = nvdisasm_path();
    for defines in [&[][..], SM90_VARIANT] {
        let (cubin, _) = nvrtc::compile_cubin_with(&nvrtc::MOE_GEMM_SM90, "sm_90a", defines)
            .unwrap_or_else(|e| panic!("{defines:?}: {e}"));
        for kernel in ["moe_gemm_nvfp4_sm90rs", "moe_gemm_gate_up_nvfp4_sm90rs"] {
            let (issues, bad) = mmas_after_refill(&sass_of(&nvdisasm, &cubin, kernel));
            eprintln!(
                "{kernel} {defines:?}: {issues} TMA issues, {} MMAs left unreconverged",
                bad.len()
            );
            assert!(issues > 0, "{kernel}: no TMA issue in the SASS");
            assert!(
                bad.is_empty(),
                "{kernel} {defines:?}: MMAs after a refill without a WARPSYNC: {bad:?}"
            );
        }
    }
}

/// The register-A kernels' tuning knobs (kernels/moe_gemm_sm90.cu, `#ifndef`) set the other
/// way, as a device script's A/B sets them through NVFP4DBG_NVRTC_DEFINES: they build without
/// spills too (a variant that does not build would waste a lease).
const SM90_VARIANT: &[&str] = &[
    "-DRS_F16=0",
    "-DRS_INFLIGHT=1",
    "-DRS_N144_DOWN=1",
    "-DRS_N144_GATE_UP=0",
    "-DRS_L2_AHEAD_DOWN=0",
    "-DRS_L2_AHEAD_GATE_UP=4",
    "-DRS_L2_AHEAD_NARROW=-1",
    "-DRS_SWIGLU16=0",
    "-DRS_SWIGLU_NVFP4=0",
    "-DRS_N96=0",
    "-DRS_N48=1",
    "-DR_STAGES=5",
    "-DRS_WG=1",
    "-DEXPF_CR_BITS=0",
];

#[test]
fn the_register_a_variants_compile() {
    if !enabled() {
        return;
    }
    let mut options = SM90_VARIANT.to_vec();
    options.push("--ptxas-options=--verbose");
    let (_, log) = nvrtc::compile_cubin_with(&nvrtc::MOE_GEMM_SM90, "sm_90a", &options)
        .unwrap_or_else(|e| panic!("{SM90_VARIANT:?}: {e}"));
    let what = format!("{} {}", nvrtc::MOE_GEMM_SM90.file, SM90_VARIANT.join(" "));
    assert_spills_allowed(&what, &log);
}

/// The register-A gate/up epilogue's SwiGLU takes exp's table-driven fast path inline and
/// CUDA's double exp out of line (kernels/nvfp4dbg_common.cuh EXPF_CR_FAST). Inlined at each of
/// its 264 call sites (half a tile width's tokens per thread, widths 32, 64, 128, 144, 160), the
/// double exp made the kernel 53 768 SASS instructions with 7392 DFMA, and 14% of its stall
/// samples waited for instructions (BENCHMARKS.md, session 12); the fast path has 8 DFMA.
#[test]
fn the_gate_up_epilogue_keeps_the_double_exp_out_of_line() {
    if !enabled() {
        return;
    }
    let cubin =
        nvrtc::compile_cubin(&nvrtc::MOE_GEMM_SM90, "sm_90a").unwrap_or_else(|e| panic!("{e}"));
    let sass = sass_of(&nvdisasm_path(), &cubin, "moe_gemm_gate_up_nvfp4_sm90rs");
    let sites = [32, 64, 128, 144, 160].iter().sum::<usize>() / 2;
    let dfma = sass.matches("DFMA").count();
    eprintln!("moe_gemm_gate_up_nvfp4_sm90rs: {dfma} DFMA for {sites} SwiGLU sites");
    assert!(
        dfma <= 9 * sites,
        "{dfma} DFMA for {sites} SwiGLU sites: CUDA's double exp is inlined again"
    );
}
