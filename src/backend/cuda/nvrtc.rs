//! The kernel sources (embedded with `include_str!`) and their run-time compilation to CUBIN
//! with NVRTC, for the architecture of the device at hand (`sm_90a` on Hopper, `sm_100a` on
//! B200). Nothing here needs a GPU: CPU CI compiles every module for both targets.

use crate::error::{Error, Result};
use cudarc::nvrtc::sys as nv;
use std::ffi::{c_char, CStr, CString};
use std::path::PathBuf;

/// One `kernels/*.cu` file: its name (for errors), its source and the kernels it defines.
#[derive(Debug)]
pub struct KernelModule {
    pub file: &'static str,
    pub source: &'static str,
    pub kernels: &'static [&'static str],
}

/// The header every module includes, handed to NVRTC by name (no include path needed for it).
pub const COMMON_HEADER: (&str, &str) = (
    "nvfp4dbg_common.cuh",
    include_str!("../../../kernels/nvfp4dbg_common.cuh"),
);

pub const QUANT: KernelModule = KernelModule {
    file: "kernels/quant.cu",
    source: include_str!("../../../kernels/quant.cu"),
    kernels: &[
        "nvfp4_quantize_f32",
        "nvfp4_quantize_f32_scatter_reference",
        "nvfp4_quantize_f32_scatter_cuda_fast",
        "nvfp4_quantize_bf16",
        "mxfp4_quantize_f32",
        "mxfp4_quantize_bf16",
        "scales_swizzle",
        "scales_unswizzle",
        "count_flips",
    ],
};

pub const REDUCE: KernelModule = KernelModule {
    file: "kernels/reduce.cu",
    source: include_str!("../../../kernels/reduce.cu"),
    kernels: &["compare_partial", "compare_final", "amax_f32"],
};

pub const ROUTER: KernelModule = KernelModule {
    file: "kernels/router.cu",
    source: include_str!("../../../kernels/router.cu"),
    kernels: &["router_topk", "router_topk_keys8", "router_topk_keys16"],
};

pub const MOE: KernelModule = KernelModule {
    file: "kernels/moe.cu",
    source: include_str!("../../../kernels/moe.cu"),
    kernels: &[
        "moe_chunk_counts",
        "moe_offsets",
        "moe_scatter",
        "moe_gemm_nvfp4",
        "moe_gemm_gate_up_nvfp4",
        "dynamic_gs_from_amax",
        "broadcast_f32",
        "moe_combine",
        "moe_combine_f32",
        "gather_rows_bf16",
        "swiglu_bf16",
    ],
};

/// Dequantization to f32 for compare-weights' GPU diff.
pub const DEQUANT: KernelModule = KernelModule {
    file: "kernels/dequant.cu",
    source: include_str!("../../../kernels/dequant.cu"),
    kernels: &["dequant_fp4", "decode_f32", "first_index_at_max"],
};

pub const MOE_DECODE: KernelModule = KernelModule {
    file: "kernels/moe_decode.cu",
    source: include_str!("../../../kernels/moe_decode.cu"),
    kernels: &[
        "moe_decode_nvfp4",
        "moe_decode_gate_up_nvfp4",
        "moe_decode_nvfp4_rows",
        "moe_decode_gate_up_nvfp4_rows",
        "decode_tiles",
    ],
};

/// The prefill grouped GEMM on Hopper's warpgroup MMA (sm_90a; a trap elsewhere).
pub const MOE_GEMM_SM90: KernelModule = KernelModule {
    file: "kernels/moe_gemm_sm90.cu",
    source: include_str!("../../../kernels/moe_gemm_sm90.cu"),
    kernels: &[
        "moe_gemm_nvfp4_sm90",
        "moe_gemm_gate_up_nvfp4_sm90",
        "moe_gemm_nvfp4_sm90rs",
        "moe_gemm_gate_up_nvfp4_sm90rs",
        "moe_rows_bf16_rs",
    ],
};

/// Synthetic data on the GPU and the non-finite scan, for `nvfp4dbg bench`.
pub const BENCH: KernelModule = KernelModule {
    file: "kernels/bench.cu",
    source: include_str!("../../../kernels/bench.cu"),
    kernels: &[
        "bench_fill_bytes",
        "bench_fill_bf16",
        "bench_fill_f32",
        "bench_nonfinite_scan_f32",
    ],
};

/// Every module, in the order the compile check reports them.
pub const MODULES: &[&KernelModule] = &[
    &QUANT,
    &REDUCE,
    &ROUTER,
    &MOE,
    &MOE_DECODE,
    &MOE_GEMM_SM90,
    &BENCH,
    &DEQUANT,
];

/// The NVRTC target for a compute capability: the arch-specific variant (`sm_90a`,
/// `sm_100a`) where one exists, since wgmma / the FP4 conversion need it.
pub fn arch_for(major: i32, minor: i32) -> String {
    match (major, minor) {
        (9, 0) | (10, 0) | (10, 3) | (12, 0) | (12, 1) => format!("sm_{major}{minor}a"),
        _ => format!("sm_{major}{minor}"),
    }
}

/// Where cuda_bf16.h / cuda_fp8.h / cuda_fp4.h (and CCCL) live: `NVFP4DBG_CUDA_INCLUDE`
/// (a `:`-separated list), else `/usr/local/cuda/include` and its `cccl/` subfolder.
pub fn include_dirs() -> Vec<PathBuf> {
    match std::env::var_os("NVFP4DBG_CUDA_INCLUDE") {
        Some(v) if !v.is_empty() => std::env::split_paths(&v).collect(),
        _ => {
            let base = PathBuf::from("/usr/local/cuda/include");
            let cccl = base.join("cccl");
            let mut v = vec![base];
            if cccl.is_dir() {
                v.push(cccl);
            }
            v
        }
    }
}

/// The options every module is compiled with. No fast math: the quantizer's reference
/// flavor is defined by single IEEE f32 operations, so no FMA contraction, no FTZ, IEEE
/// division and square root.
pub fn compile_options(arch: &str) -> Vec<String> {
    let mut o = vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".to_string(),
        "--fmad=false".to_string(),
        "--ftz=false".to_string(),
        "--prec-div=true".to_string(),
        "--prec-sqrt=true".to_string(),
        "-default-device".to_string(),
        "-lineinfo".to_string(),
    ];
    for d in include_dirs() {
        o.push(format!("--include-path={}", d.display()));
    }
    o.extend(tuning_defines());
    o
}

/// `NVFP4DBG_NVRTC_DEFINES="-DDEC_DOWN_MIN_BLOCKS=2 ..."`: macro overrides for the tuning constants
/// a kernel leaves open (`#ifndef`), to sweep one in a single benchmark session. Only `-D`
/// options are taken; anything else in the variable is ignored.
pub fn tuning_defines() -> Vec<String> {
    std::env::var("NVFP4DBG_NVRTC_DEFINES")
        .map(|v| {
            v.split_whitespace()
                .filter(|d| d.starts_with("-D") && d.len() > 2)
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default()
}

/// The value of `-DNAME=V` in `defines` (the format of NVFP4DBG_NVRTC_DEFINES, which
/// `compile_options` hands to NVRTC: whitespace-separated `-D` options), the last one if
/// repeated.
pub(crate) fn define_value(defines: &str, name: &str) -> Option<u64> {
    defines
        .split_whitespace()
        .filter_map(|d| d.strip_prefix("-D")?.strip_prefix(name)?.strip_prefix('='))
        .filter_map(|v| v.parse().ok())
        .next_back()
}

/// The value of `-DNAME=V` in NVFP4DBG_NVRTC_DEFINES: a tuning knob that the host side must
/// follow (a launch's shared memory, a bench's output check).
pub(crate) fn tuning_define(name: &str) -> Option<u64> {
    define_value(
        &std::env::var("NVFP4DBG_NVRTC_DEFINES").unwrap_or_default(),
        name,
    )
}

/// Is libnvrtc loadable? Never panics (cudarc panics when it is not).
pub fn nvrtc_present() -> bool {
    super::device::quietly(|| unsafe { nv::is_culib_present() }).unwrap_or(false)
}

/// NVRTC's version, e.g. (13, 0).
pub fn nvrtc_version() -> Result<(i32, i32)> {
    require_nvrtc()?;
    let (mut major, mut minor) = (0, 0);
    let r = super::device::quietly(|| unsafe { nv::nvrtcVersion(&mut major, &mut minor) })
        .map_err(|p| Error::NoGpu(format!("libnvrtc: {p}")))?;
    check(r, "nvrtcVersion", "-")?;
    Ok((major, minor))
}

fn require_nvrtc() -> Result<()> {
    if nvrtc_present() {
        Ok(())
    } else {
        Err(Error::NoGpu(
            "libnvrtc.so (CUDA 13 NVRTC) cannot be loaded: put the CUDA toolkit's lib64 \
             (or the nvidia-cuda-nvrtc wheel's nvidia/cu13/lib) on LD_LIBRARY_PATH"
                .into(),
        ))
    }
}

fn nvrtc_err_string(r: nv::nvrtcResult) -> String {
    let p = unsafe { nv::nvrtcGetErrorString(r) };
    if p.is_null() {
        format!("{r:?}")
    } else {
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}

fn check(r: nv::nvrtcResult, step: &str, file: &str) -> Result<()> {
    if r == nv::nvrtcResult::NVRTC_SUCCESS {
        Ok(())
    } else {
        Err(Error::Cuda {
            step: step.to_string(),
            kernel: file.to_string(),
            what: nvrtc_err_string(r),
        })
    }
}

/// Destroys the program on every path out of `compile_cubin`.
struct Program(nv::nvrtcProgram);
impl Drop for Program {
    fn drop(&mut self) {
        if !self.0.is_null() {
            unsafe {
                nv::nvrtcDestroyProgram(&mut self.0);
            }
        }
    }
}

/// Compile one module for `arch` and return its PTX (to check which instructions a target
/// gets, e.g. the FP4 conversion on sm_100a).
pub fn compile_ptx(module: &KernelModule, arch: &str) -> Result<String> {
    require_nvrtc()?;
    super::device::quietly(|| compile_inner(module, arch, true, &[]).map(|(b, _)| b))
        .unwrap_or_else(|p| {
            Err(Error::Cuda {
                step: format!("NVRTC compile for {arch}"),
                kernel: module.file.to_string(),
                what: format!("libnvrtc failed: {p}"),
            })
        })
        .map(|b| {
            String::from_utf8_lossy(&b)
                .trim_end_matches('\0')
                .to_string()
        })
}

/// Compile one module to a CUBIN for `arch` (e.g. `sm_90a`). The compile log is the error
/// message on failure, with the module's file name.
pub fn compile_cubin(module: &KernelModule, arch: &str) -> Result<Vec<u8>> {
    compile_cubin_with(module, arch, &[]).map(|(c, _)| c)
}

/// [`compile_cubin`] through the on-disk cache (`cubin_cache`): the CUBIN and, when it came
/// from the cache, its path (forget it with [`forget_cached`] if the driver refuses it).
pub fn cached_cubin(module: &KernelModule, arch: &str) -> Result<(Vec<u8>, Option<PathBuf>)> {
    require_nvrtc()?;
    let (major, minor) = nvrtc_version()?;
    let source = super::fault::source(module)?;
    let options = compile_options(arch).join("\n");
    let version = format!("NVRTC {major}.{minor}");
    let key = super::cubin_cache::digest(&[
        module.file.as_bytes(),
        source.as_bytes(),
        COMMON_HEADER.1.as_bytes(),
        options.as_bytes(),
        version.as_bytes(),
    ]);
    let stem = module
        .file
        .trim_start_matches("kernels/")
        .trim_end_matches(".cu");
    let dir = super::cubin_cache::dir();
    super::cubin_cache::get_or_compile(dir.as_deref(), &format!("{stem}.{arch}"), &key, || {
        compile_cubin(module, arch)
    })
}

/// Drop a cached CUBIN (one the driver would not load).
pub fn forget_cached(path: &std::path::Path) {
    super::cubin_cache::forget(path)
}

/// [`compile_cubin`] with extra NVRTC options (e.g. `--ptxas-options=--verbose` for the
/// register / spill report); also returns the compile log.
pub fn compile_cubin_with(
    module: &KernelModule,
    arch: &str,
    extra: &[&str],
) -> Result<(Vec<u8>, String)> {
    require_nvrtc()?;
    super::device::quietly(|| compile_inner(module, arch, false, extra)).unwrap_or_else(|p| {
        Err(Error::Cuda {
            step: format!("NVRTC compile for {arch}"),
            kernel: module.file.to_string(),
            what: format!("libnvrtc failed: {p}"),
        })
    })
}

fn compile_inner(
    module: &KernelModule,
    arch: &str,
    want_ptx: bool,
    extra: &[&str],
) -> Result<(Vec<u8>, String)> {
    let cstr = |s: &str, what: &str| {
        CString::new(s).map_err(|_| Error::Cuda {
            step: "NVRTC program".into(),
            kernel: module.file.into(),
            what: format!("{what} contains a NUL byte"),
        })
    };
    let src = cstr(&super::fault::source(module)?, "source")?;
    let name = cstr(module.file, "name")?;
    let hdr_src = cstr(COMMON_HEADER.1, "header")?;
    let hdr_name = cstr(COMMON_HEADER.0, "header name")?;
    let headers = [hdr_src.as_ptr()];
    let header_names = [hdr_name.as_ptr()];
    let mut prog = Program(std::ptr::null_mut());
    check(
        unsafe {
            nv::nvrtcCreateProgram(
                &mut prog.0,
                src.as_ptr(),
                name.as_ptr(),
                1,
                headers.as_ptr(),
                header_names.as_ptr(),
            )
        },
        "nvrtcCreateProgram",
        module.file,
    )?;
    let mut opts = compile_options(arch);
    opts.extend(extra.iter().map(|s| s.to_string()));
    let c_opts = opts
        .iter()
        .map(|o| cstr(o, "option"))
        .collect::<Result<Vec<_>>>()?;
    let ptrs: Vec<*const c_char> = c_opts.iter().map(|o| o.as_ptr()).collect();
    let r = unsafe { nv::nvrtcCompileProgram(prog.0, ptrs.len() as i32, ptrs.as_ptr()) };
    if r != nv::nvrtcResult::NVRTC_SUCCESS {
        let log = program_log(&prog);
        return Err(Error::Cuda {
            step: format!("NVRTC compile for {arch} ({})", opts.join(" ")),
            kernel: module.file.to_string(),
            what: format!("{}\n{log}", nvrtc_err_string(r)),
        });
    }
    if want_ptx {
        let mut size = 0usize;
        check(
            unsafe { nv::nvrtcGetPTXSize(prog.0, &mut size) },
            "nvrtcGetPTXSize",
            module.file,
        )?;
        let mut ptx = vec![0u8; size];
        check(
            unsafe { nv::nvrtcGetPTX(prog.0, ptx.as_mut_ptr() as *mut c_char) },
            "nvrtcGetPTX",
            module.file,
        )?;
        return Ok((ptx, String::new()));
    }
    let mut size = 0usize;
    check(
        unsafe { nv::nvrtcGetCUBINSize(prog.0, &mut size) },
        "nvrtcGetCUBINSize",
        module.file,
    )?;
    if size == 0 {
        return Err(Error::Cuda {
            step: format!("NVRTC compile for {arch}"),
            kernel: module.file.to_string(),
            what: "empty CUBIN (was a virtual compute_ target given?)".into(),
        });
    }
    let mut cubin = vec![0u8; size];
    check(
        unsafe { nv::nvrtcGetCUBIN(prog.0, cubin.as_mut_ptr() as *mut c_char) },
        "nvrtcGetCUBIN",
        module.file,
    )?;
    Ok((cubin, program_log(&prog)))
}

fn program_log(prog: &Program) -> String {
    let mut size = 0usize;
    if unsafe { nv::nvrtcGetProgramLogSize(prog.0, &mut size) } != nv::nvrtcResult::NVRTC_SUCCESS
        || size == 0
    {
        return String::new();
    }
    let mut buf = vec![0u8; size];
    if unsafe { nv::nvrtcGetProgramLog(prog.0, buf.as_mut_ptr() as *mut c_char) }
        != nv::nvrtcResult::NVRTC_SUCCESS
    {
        return String::new();
    }
    String::from_utf8_lossy(&buf)
        .trim_end_matches('\0')
        .to_string()
}

/// Does the CUBIN define `kernel`? (`extern "C"` names appear verbatim, NUL-delimited, in its string table.)
pub fn cubin_defines(cubin: &[u8], kernel: &str) -> bool {
    let needle: Vec<u8> = std::iter::once(0)
        .chain(kernel.bytes())
        .chain(std::iter::once(0))
        .collect();
    cubin.windows(needle.len()).any(|w| w == needle.as_slice())
}

/// Compile every module for `arch` and check each defines its kernels; returns
/// (file, CUBIN size) per module. Used by the CPU CI compile check.
pub fn compile_all(arch: &str) -> Result<Vec<(&'static str, usize)>> {
    let mut out = Vec::new();
    for m in MODULES {
        let cubin = compile_cubin(m, arch)?;
        for k in m.kernels {
            if !cubin_defines(&cubin, k) {
                return Err(Error::Cuda {
                    step: format!("NVRTC compile for {arch}"),
                    kernel: k.to_string(),
                    what: format!("{} compiled but does not define this kernel", m.file),
                });
            }
        }
        out.push((m.file, cubin.len()));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arch_specific_targets_where_they_exist() {
        assert_eq!(arch_for(9, 0), "sm_90a");
        assert_eq!(arch_for(10, 0), "sm_100a");
        assert_eq!(arch_for(8, 9), "sm_89");
        assert_eq!(arch_for(8, 0), "sm_80");
    }

    #[test]
    fn kernel_names_are_found_whole() {
        let blob = b"\0.text.moe_combine\0moe_combine\0xmoe_gemm\0";
        assert!(cubin_defines(blob, "moe_combine"));
        assert!(!cubin_defines(blob, "moe_gemm"));
        assert!(!cubin_defines(blob, "combine"));
    }

    #[test]
    fn every_launched_kernel_is_listed_in_its_module() {
        for m in MODULES {
            for k in m.kernels {
                let decl = format!("void {k}(");
                let decl2 = format!("\n{k}(");
                assert!(
                    m.source.contains(&decl) || m.source.contains(&decl2),
                    "{}: no `{k}` in the source",
                    m.file
                );
            }
        }
    }

    #[test]
    fn options_never_enable_fast_math() {
        let o = compile_options("sm_90a").join(" ");
        assert!(
            o.contains("--fmad=false")
                && o.contains("--ftz=false")
                && o.contains("--prec-div=true")
        );
        assert!(!o.contains("use_fast_math"));
    }
}
