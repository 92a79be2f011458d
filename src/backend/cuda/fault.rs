//! Fault injection, for showing that each GPU failure the tool can meet ends as a clear
//! `Error` (exit 2 naming the step and the kernel) rather than a hang or a panic. Hidden: set
//! by `NVFP4DBG_FAULT` (docs/dev-faults.md), absent from `--help`.
//!
//! - `compile[:FILE]`: NVRTC compiles a broken source for module FILE (every module when no
//!   FILE is given), so the error carries the module and NVRTC's log;
//! - `illegal-address[:KERNEL]`: before KERNEL (the first kernel launched when none is given), a
//!   one-thread kernel writes 4 TiB past the end of a buffer: the sticky fault surfaces at
//!   the next launch or synchronization, as any fault inside a kernel does;
//! - `oom[:WHAT]`: the first device allocation whose description contains WHAT (any when
//!   none is given) fails as cuMemAlloc does when memory runs out;
//! - `hang[:KERNEL]`: before KERNEL (the first kernel launched when none is given), a
//!   one-thread kernel spins forever, as a kernel with a deadlock does: the next wait for the
//!   GPU gives up after `NVFP4DBG_KERNEL_TIMEOUT_S` and exits 2 naming the kernels in flight.

use super::device::{driver_err, Gpu, KArg};
use super::nvrtc::KernelModule;
use crate::error::{Error, Result};
use cudarc::driver::{sys::CUresult, DriverError, LaunchConfig};
use std::borrow::Cow;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

pub const ENV: &str = "NVFP4DBG_FAULT";

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fault {
    Compile(Option<String>),
    IllegalAddress(Option<String>),
    Oom(Option<String>),
    Hang(Option<String>),
}

impl Fault {
    pub fn parse(s: &str) -> std::result::Result<Fault, String> {
        let (kind, target) = match s.split_once(':') {
            Some((k, t)) if !t.is_empty() => (k, Some(t.to_string())),
            Some((k, _)) => (k, None),
            None => (s, None),
        };
        // a misspelt kernel would never fire and pass for a clean run
        let kernel = |t: Option<String>| match t {
            Some(k)
                if !super::nvrtc::MODULES
                    .iter()
                    .any(|m| m.kernels.contains(&k.as_str())) =>
            {
                Err(format!("{ENV}={s}: no kernel `{k}` in kernels/*.cu"))
            }
            t => Ok(t),
        };
        match kind {
            "compile" => Ok(Fault::Compile(target)),
            "illegal-address" => kernel(target).map(Fault::IllegalAddress),
            "hang" => kernel(target).map(Fault::Hang),
            "oom" => Ok(Fault::Oom(target)),
            _ => Err(format!(
                "{ENV}={s}: expected compile[:FILE], illegal-address[:KERNEL], hang[:KERNEL] or oom[:WHAT]"
            )),
        }
    }
}

/// The fault `NVFP4DBG_FAULT` asks for, read once; an unknown value is a usage error at the
/// first hook it reaches, so a typo cannot pass for a clean run.
pub fn active() -> Result<Option<&'static Fault>> {
    static FAULT: OnceLock<std::result::Result<Option<Fault>, String>> = OnceLock::new();
    match FAULT.get_or_init(|| match std::env::var(ENV) {
        Ok(v) if !v.is_empty() => Fault::parse(&v).map(Some),
        _ => Ok(None),
    }) {
        Ok(f) => Ok(f.as_ref()),
        Err(e) => Err(Error::usage(e.clone())),
    }
}

/// The source NVRTC compiles for `module`: its own, or under `compile` a broken one.
pub(crate) fn source(module: &KernelModule) -> Result<Cow<'static, str>> {
    match active()? {
        Some(Fault::Compile(t)) if t.as_deref().is_none_or(|f| f == module.file) => {
            Ok(Cow::Owned(broken_source(module)))
        }
        _ => Ok(Cow::Borrowed(module.source)),
    }
}

/// `module`'s source with one line NVRTC rejects (an undeclared identifier), so the log names
/// the file and line like a real mistake would.
pub fn broken_source(module: &KernelModule) -> String {
    format!(
        "{}\n// {ENV}=compile\n__device__ int nvfp4dbg_fault() {{ return nvfp4dbg_injected_compile_fault; }}\n",
        module.source
    )
}

const FAULT_KERNEL: &str = "nvfp4dbg_injected_illegal_address";
const HANG_KERNEL: &str = "nvfp4dbg_injected_hang";

static FAULT_MODULE: KernelModule = KernelModule {
    file: "nvfp4dbg_fault.cu",
    source: r#"
// NVFP4DBG_FAULT=illegal-address: one store 4 TiB past a one-element buffer
extern "C" __global__ void nvfp4dbg_injected_illegal_address(float* buf) {
    buf[1ull << 40] = 1.0f;
}
// NVFP4DBG_FAULT=hang: waits for a flag that nothing sets (the buffer is zero)
extern "C" __global__ void nvfp4dbg_injected_hang(const volatile int* flag) {
    while (*flag == 0) __nanosleep(1000);
}
"#,
    kernels: &[FAULT_KERNEL, HANG_KERNEL],
};

/// Called by every launch before `kernel` goes out: under `illegal-address` or `hang`
/// launches the faulting kernel once, at the chosen kernel.
pub(crate) fn before_launch(gpu: &Gpu, kernel: &str) -> Result<()> {
    static FIRED: AtomicBool = AtomicBool::new(false);
    let (inject, target) = match active()? {
        Some(Fault::IllegalAddress(t)) => (FAULT_KERNEL, t),
        Some(Fault::Hang(t)) => (HANG_KERNEL, t),
        _ => return Ok(()),
    };
    if kernel == inject
        || target.as_deref().is_some_and(|k| k != kernel)
        || FIRED.swap(true, Ordering::Relaxed)
    {
        return Ok(());
    }
    let buf = gpu.zeros::<i32>(1, "the injected fault's buffer")?;
    let cfg = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (1, 1, 1),
        shared_mem_bytes: 0,
    };
    let launched = gpu.launch(&FAULT_MODULE, inject, cfg, &[KArg::U64(gpu.ptr(&buf))]);
    // kept: freeing it must not wait on the kernel (4 bytes, once per process)
    std::mem::forget(buf);
    launched
}

/// Called by every device allocation: under `oom` fails the chosen one as the driver does.
pub(crate) fn before_alloc(what: &str) -> Result<()> {
    static FIRED: AtomicBool = AtomicBool::new(false);
    let Some(Fault::Oom(t)) = active()? else {
        return Ok(());
    };
    if t.as_deref().is_some_and(|w| !what.contains(w)) || FIRED.swap(true, Ordering::Relaxed) {
        return Ok(());
    }
    Err(driver_err(
        &format!("allocating {what} ({ENV}=oom)"),
        "-",
        DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_parse_and_typos_are_refused() {
        assert_eq!(Fault::parse("compile"), Ok(Fault::Compile(None)));
        assert_eq!(
            Fault::parse("compile:moe.cu"),
            Ok(Fault::Compile(Some("moe.cu".into())))
        );
        assert_eq!(
            Fault::parse("illegal-address:router_topk"),
            Ok(Fault::IllegalAddress(Some("router_topk".into())))
        );
        assert_eq!(Fault::parse("oom:"), Ok(Fault::Oom(None)));
        assert_eq!(
            Fault::parse("hang:moe_combine"),
            Ok(Fault::Hang(Some("moe_combine".into())))
        );
        assert_eq!(Fault::parse("hang"), Ok(Fault::Hang(None)));
        // the register-A prefill GEMMs (the layer's prefill kernels on an H200) are targets too
        assert_eq!(
            Fault::parse("hang:moe_gemm_gate_up_nvfp4_sm90rs"),
            Ok(Fault::Hang(Some("moe_gemm_gate_up_nvfp4_sm90rs".into())))
        );
        let e = Fault::parse("hang:moe_combin").unwrap_err();
        assert!(e.contains("no kernel `moe_combin`"), "{e}");
        let e = Fault::parse("illegal_address").unwrap_err();
        assert!(e.contains("NVFP4DBG_FAULT=illegal_address"), "{e}");
        let e = Fault::parse("illegal-address:moe_gemm_nvfp5").unwrap_err();
        assert!(e.contains("no kernel `moe_gemm_nvfp5`"), "{e}");
    }

    #[test]
    fn the_broken_source_keeps_the_module_and_adds_one_bad_line() {
        let m = &super::super::nvrtc::QUANT;
        let s = broken_source(m);
        assert!(s.starts_with(m.source));
        assert!(s.ends_with("return nvfp4dbg_injected_compile_fault; }\n"));
    }

    /// Out of memory, real or injected, is `GpuOom` with the step and the advice.
    #[test]
    fn an_injected_oom_reads_like_a_real_one() {
        let e = driver_err(
            "allocating expert gate_proj codes (NVFP4DBG_FAULT=oom)",
            "-",
            DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY),
        );
        assert!(matches!(e, Error::GpuOom { .. }), "{e}");
        let m = e.to_string();
        assert!(
            m.contains("expert gate_proj codes") && m.contains("--device cpu"),
            "{m}"
        );
    }
}
