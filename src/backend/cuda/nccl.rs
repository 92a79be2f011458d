//! NCCL all-reduce across the GPUs of one host, for expert parallelism (`--ep N` with ranks on
//! two or more GPUs): one communicator per GPU, created in this process with
//! `ncclCommInitAll`, and one grouped in-place `ncclAllReduce` (f32 sum) on each GPU's stream.
//!
//! libnccl is loaded at run time, never linked. Where from, in this order:
//! 1. `NVFP4DBG_NCCL_LIB`: the library file, or a directory holding `libnccl.so.2` (when set,
//!    nothing else is tried);
//! 2. `libnccl.so.2` / `libnccl.so` on the loader's path (`LD_LIBRARY_PATH`, ldconfig);
//! 3. the NCCL that PyTorch's pip wheels ship: `python3` is asked where the `nvidia.nccl` (and
//!    `torch`) packages are, and their `lib/` is tried;
//! 4. `/usr/lib/x86_64-linux-gnu`, `/usr/lib64`, `/usr/local/cuda/lib64`.
//!
//! Why not cudarc's `nccl` module: cudarc 0.19 looks for `libnccl.so` and `libnccl.so.{1,9..13}`,
//! never NCCL's real soname `libnccl.so.2` (the only name the wheel ships), so it cannot find
//! PyTorch's NCCL even on `LD_LIBRARY_PATH`, and its `Comm` panics in `Drop` when an abort
//! fails. The nine entry points are resolved here instead; a missing library or symbol is an
//! error that says where we looked, never a panic.
//!
//! NVLink SHARP / multicast (NVLS) is never used: `NCCL_NVLS_ENABLE=0` is set in the process
//! environment before the first communicator is created (the machines this runs on forbid
//! multicast, and plain ring/tree all-reduce is all a debugging tool needs).
//!
//! A collective that never completes (a peer that did not launch) would hang the process:
//! completion is polled with a deadline ([`ALL_REDUCE_TIMEOUT`]) and the communicators are
//! aborted when it passes.

use super::device::{driver_err, quietly, Gpu};
use crate::error::{Error, Result};
use cudarc::driver::{result as drv, sys as drv_sys, DriverError};
use std::ffi::{c_char, c_int, c_void, CStr};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// How long an all-reduce may take before the communicators are aborted.
pub const ALL_REDUCE_TIMEOUT: Duration = Duration::from_secs(120);

/// `ncclFloat32` and `ncclSum` (stable since NCCL 2.0).
const NCCL_FLOAT32: c_int = 7;
const NCCL_SUM: c_int = 0;
const NCCL_SUCCESS: c_int = 0;
const NCCL_IN_PROGRESS: c_int = 7;

type FnGetVersion = unsafe extern "C" fn(*mut c_int) -> c_int;
type FnCommInitAll = unsafe extern "C" fn(*mut *mut c_void, c_int, *const c_int) -> c_int;
type FnAllReduce = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    *mut c_void,
    *mut c_void,
) -> c_int;
type FnGroup = unsafe extern "C" fn() -> c_int;
type FnComm = unsafe extern "C" fn(*mut c_void) -> c_int;
type FnErrorString = unsafe extern "C" fn(c_int) -> *const c_char;
type FnAsyncError = unsafe extern "C" fn(*mut c_void, *mut c_int) -> c_int;

/// The loaded library (kept loaded for the life of the process).
pub struct Nccl {
    /// Where it was loaded from.
    pub path: String,
    /// `2.27.3`.
    pub version: String,
    init_all: FnCommInitAll,
    all_reduce: FnAllReduce,
    group_start: FnGroup,
    group_end: FnGroup,
    destroy: FnComm,
    abort: FnComm,
    error_string: FnErrorString,
    async_error: FnAsyncError,
}

#[cfg(target_os = "linux")]
mod dl {
    use std::ffi::{c_char, c_int, c_void, CStr, CString};

    extern "C" {
        fn dlopen(filename: *const c_char, flag: c_int) -> *mut c_void;
        fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
        fn dlerror() -> *mut c_char;
    }
    const RTLD_NOW: c_int = 2;

    fn last_error() -> String {
        // SAFETY: dlerror returns a thread-local, NUL-terminated message or null.
        let p = unsafe { dlerror() };
        if p.is_null() {
            "unknown dlopen error".into()
        } else {
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        }
    }

    /// `dlopen(name, RTLD_NOW)`; the handle is never closed.
    pub fn open(name: &str) -> Result<usize, String> {
        let c = CString::new(name).map_err(|_| format!("`{name}`: NUL in the path"))?;
        // SAFETY: a valid C string; loading runs the library's initializers, which is what
        // loading NCCL means.
        let h = unsafe { dlopen(c.as_ptr(), RTLD_NOW) };
        if h.is_null() {
            Err(last_error())
        } else {
            Ok(h as usize)
        }
    }

    pub fn sym(handle: usize, name: &str) -> Result<*mut c_void, String> {
        let c = CString::new(name).map_err(|_| "NUL in a symbol name".to_string())?;
        // SAFETY: handle came from dlopen and is never closed.
        let p = unsafe { dlsym(handle as *mut c_void, c.as_ptr()) };
        if p.is_null() {
            Err(format!("symbol `{name}` missing: {}", last_error()))
        } else {
            Ok(p)
        }
    }
}

#[cfg(not(target_os = "linux"))]
mod dl {
    use std::ffi::c_void;
    pub fn open(_: &str) -> Result<usize, String> {
        Err("NCCL is loaded on Linux only".into())
    }
    pub fn sym(_: usize, _: &str) -> Result<*mut c_void, String> {
        Err("NCCL is loaded on Linux only".into())
    }
}

/// Resolve `name` in `handle` as a function pointer of type `F`.
///
/// # Safety
/// `F` must be the C signature of `name`.
unsafe fn function<F: Copy>(handle: usize, name: &str) -> std::result::Result<F, String> {
    let p = dl::sym(handle, name)?;
    debug_assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<*mut c_void>());
    // SAFETY: the caller names the right signature; function and data pointers have the same
    // size on every platform CUDA runs on.
    Ok(unsafe { std::mem::transmute_copy::<*mut c_void, F>(&p) })
}

impl Nccl {
    fn load_from(path: &str) -> std::result::Result<Nccl, String> {
        let h = dl::open(path)?;
        // SAFETY: the signatures below are NCCL's (nccl.h, unchanged since 2.4).
        unsafe {
            let get_version: FnGetVersion = function(h, "ncclGetVersion")?;
            let mut v: c_int = 0;
            let rc = get_version(&mut v);
            if rc != NCCL_SUCCESS {
                return Err(format!("ncclGetVersion returned {rc}"));
            }
            Ok(Nccl {
                path: path.to_string(),
                version: format!("{}.{}.{}", v / 10000, (v / 100) % 100, v % 100),
                init_all: function(h, "ncclCommInitAll")?,
                all_reduce: function(h, "ncclAllReduce")?,
                group_start: function(h, "ncclGroupStart")?,
                group_end: function(h, "ncclGroupEnd")?,
                destroy: function(h, "ncclCommDestroy")?,
                abort: function(h, "ncclCommAbort")?,
                error_string: function(h, "ncclGetErrorString")?,
                async_error: function(h, "ncclCommGetAsyncError")?,
            })
        }
    }

    fn describe(&self, rc: c_int) -> String {
        // SAFETY: ncclGetErrorString returns a static string (or null on a foreign build).
        let p = unsafe { (self.error_string)(rc) };
        let text = if p.is_null() {
            String::new()
        } else {
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        };
        format!("ncclResult {rc} ({text})")
    }

    fn check(&self, rc: c_int, step: &str, call: &str) -> Result<()> {
        if rc == NCCL_SUCCESS {
            Ok(())
        } else {
            Err(Error::Cuda {
                step: step.into(),
                kernel: call.into(),
                what: self.describe(rc),
            })
        }
    }
}

/// Directories where Python packages keep NCCL (`nvidia/nccl/lib`, `torch/lib`), asked of
/// `python3` (or `python`) without importing torch. At most a few seconds; silent on failure.
fn python_lib_dirs() -> Vec<PathBuf> {
    // (a raw string: Python needs the indentation that `\` line continuations would eat)
    const SNIPPET: &str = r#"
import importlib.util as u, os
for name in ('nvidia.nccl', 'torch'):
    try:
        s = u.find_spec(name)
    except Exception:
        s = None
    if s is None:
        continue
    for d in (s.submodule_search_locations or [os.path.dirname(s.origin or '')]):
        print(os.path.join(d, 'lib'))
"#;
    for exe in ["python3", "python"] {
        let child = std::process::Command::new(exe)
            .args(["-c", SNIPPET])
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn();
        let Ok(mut child) = child else { continue };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            match child.try_wait() {
                Ok(Some(_)) => break,
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                _ => {
                    let _ = child.kill();
                    let _ = child.wait();
                    break;
                }
            }
        }
        let mut text = String::new();
        if let Some(mut out) = child.stdout.take() {
            use std::io::Read;
            let _ = out.read_to_string(&mut text);
        }
        let dirs: Vec<PathBuf> = text
            .lines()
            .map(|l| PathBuf::from(l.trim()))
            .filter(|p| p.is_dir())
            .collect();
        if !dirs.is_empty() {
            return dirs;
        }
    }
    vec![]
}

fn lib_in(dir: &Path) -> Vec<String> {
    ["libnccl.so.2", "libnccl.so"]
        .iter()
        .map(|n| dir.join(n))
        .filter(|p| p.is_file())
        .map(|p| p.display().to_string())
        .collect()
}

fn load() -> std::result::Result<Nccl, String> {
    if let Some(v) = std::env::var_os("NVFP4DBG_NCCL_LIB") {
        let p = PathBuf::from(&v);
        let files = if p.is_dir() {
            lib_in(&p)
        } else {
            vec![p.display().to_string()]
        };
        let Some(f) = files.first() else {
            return Err(format!(
                "NVFP4DBG_NCCL_LIB={}: no libnccl.so.2 in that directory",
                p.display()
            ));
        };
        return Nccl::load_from(f).map_err(|e| format!("NVFP4DBG_NCCL_LIB={f}: {e}"));
    }
    let mut tried: Vec<String> = vec![];
    for name in ["libnccl.so.2", "libnccl.so"] {
        match Nccl::load_from(name) {
            Ok(n) => return Ok(n),
            Err(e) => tried.push(format!("{name}: {e}")),
        }
    }
    let mut dirs = python_lib_dirs();
    dirs.extend(
        [
            "/usr/lib/x86_64-linux-gnu",
            "/usr/lib64",
            "/usr/local/cuda/lib64",
            "/usr/local/cuda/targets/x86_64-linux/lib",
        ]
        .iter()
        .map(PathBuf::from),
    );
    for d in dirs {
        for f in lib_in(&d) {
            match Nccl::load_from(&f) {
                Ok(n) => return Ok(n),
                Err(e) => tried.push(format!("{f}: {e}")),
            }
        }
    }
    Err(format!(
        "libnccl.so.2 not found (tried the loader path, python3's nvidia.nccl / torch packages and \
         the system library directories; set NVFP4DBG_NCCL_LIB to the library or its directory){}",
        if tried.is_empty() {
            String::new()
        } else {
            format!(": {}", tried.join("; "))
        }
    ))
}

/// The NCCL library, loaded once; `Err` says where it was looked for. Never panics.
pub fn library() -> std::result::Result<&'static Nccl, String> {
    static LIB: OnceLock<std::result::Result<Nccl, String>> = OnceLock::new();
    LIB.get_or_init(|| quietly(load).unwrap_or_else(Err))
        .as_ref()
        .map_err(|e| e.clone())
}

/// CUDA devices the driver sees. Never panics; no driver is an error.
pub fn visible_gpus() -> Result<usize> {
    quietly(|| -> Result<usize> {
        // SAFETY: only asks whether libcuda loads.
        if !unsafe { drv_sys::is_culib_present() } {
            return Err(Error::NoGpu(
                "libcuda.so (the NVIDIA driver) cannot be loaded; is this a GPU machine?".into(),
            ));
        }
        drv::init().map_err(|e| driver_err("cuInit", "-", e))?;
        let n = drv::device::get_count().map_err(|e| driver_err("cuDeviceGetCount", "-", e))?;
        Ok(n.max(0) as usize)
    })
    .map_err(Error::NoGpu)?
}

/// The value `NCCL_NVLS_ENABLE` had before we set it to 0, when it was something else.
fn disable_nvls() -> Option<String> {
    let before = std::env::var("NCCL_NVLS_ENABLE").ok();
    if before.as_deref() != Some("0") {
        // Set before any communicator exists; NCCL reads it at init.
        std::env::set_var("NCCL_NVLS_ENABLE", "0");
    }
    before.filter(|v| v != "0")
}

/// One communicator per GPU of this process.
pub struct Comms {
    lib: &'static Nccl,
    comms: Vec<*mut c_void>,
    pub ordinals: Vec<usize>,
    /// `NCCL_NVLS_ENABLE` was set to something else and has been overridden.
    pub nvls_override: Option<String>,
    aborted: std::cell::Cell<bool>,
}

impl Comms {
    /// Communicators for `gpus` (distinct devices, at least 2).
    pub fn new(gpus: &[&Gpu]) -> Result<Comms> {
        // before NCCL is even loaded: it reads its environment once
        let nvls_override = disable_nvls();
        let lib = library().map_err(Error::NoGpu)?;
        let ordinals: Vec<usize> = gpus.iter().map(|g| g.ordinal).collect();
        let mut sorted = ordinals.clone();
        sorted.sort_unstable();
        sorted.dedup();
        if sorted.len() != ordinals.len() || ordinals.len() < 2 {
            return Err(Error::usage(format!(
                "NCCL all-reduce needs two or more distinct GPUs, got {ordinals:?}"
            )));
        }
        let devs: Vec<c_int> = ordinals.iter().map(|&o| o as c_int).collect();
        let mut comms: Vec<*mut c_void> = vec![std::ptr::null_mut(); devs.len()];
        let rc = quietly(|| unsafe {
            // SAFETY: comms has room for devs.len() handles; devs are valid ordinals.
            (lib.init_all)(comms.as_mut_ptr(), devs.len() as c_int, devs.as_ptr())
        })
        .map_err(|p| Error::Cuda {
            step: "creating NCCL communicators".into(),
            kernel: "ncclCommInitAll".into(),
            what: p,
        });
        let rebound = rebind_first(gpus);
        lib.check(rc?, "creating NCCL communicators", "ncclCommInitAll")?;
        rebound?;
        if comms.iter().any(|c| c.is_null()) {
            return Err(Error::Cuda {
                step: "creating NCCL communicators".into(),
                kernel: "ncclCommInitAll".into(),
                what: "returned success but a null communicator".into(),
            });
        }
        Ok(Comms {
            lib,
            comms,
            ordinals,
            nvls_override,
            aborted: std::cell::Cell::new(false),
        })
    }

    pub fn version(&self) -> &str {
        &self.lib.version
    }

    pub fn library_path(&self) -> &str {
        &self.lib.path
    }

    fn abort_all(&self) {
        if self.aborted.replace(true) {
            return;
        }
        for &c in &self.comms {
            // SAFETY: a communicator from ncclCommInitAll, aborted once.
            let _ = quietly(|| unsafe { (self.lib.abort)(c) });
        }
    }

    /// Sum `partials[g]` (on the host, one per GPU, in [`Comms::new`]'s order) over the GPUs
    /// with one grouped in-place `ncclAllReduce`; returns every GPU's copy of the sum.
    pub fn all_reduce_sum(&self, gpus: &[&Gpu], partials: &[Vec<f32>]) -> Result<Vec<Vec<f32>>> {
        let r = self.all_reduce_inner(gpus, partials);
        let b = rebind_first(gpus);
        let out = r?;
        b?;
        Ok(out)
    }

    fn all_reduce_inner(&self, gpus: &[&Gpu], partials: &[Vec<f32>]) -> Result<Vec<Vec<f32>>> {
        if self.aborted.get() {
            return Err(Error::Cuda {
                step: "NCCL all-reduce".into(),
                kernel: "ncclAllReduce".into(),
                what: "the communicators were aborted by an earlier failure".into(),
            });
        }
        let n = partials.first().map_or(0, |p| p.len());
        if gpus.len() != self.comms.len()
            || partials.len() != self.comms.len()
            || partials.iter().any(|p| p.len() != n)
            || gpus
                .iter()
                .zip(&self.ordinals)
                .any(|(g, &o)| g.ordinal != o)
        {
            return Err(Error::usage(
                "internal: NCCL all-reduce given buffers that do not match its communicators",
            ));
        }
        if n == 0 {
            return Ok(vec![vec![]; gpus.len()]);
        }
        let mut bufs = Vec::with_capacity(gpus.len());
        for (g, p) in gpus.iter().zip(partials) {
            bufs.push(g.upload(p, "the EP partial output")?);
        }
        let step = "NCCL all-reduce of the EP partial outputs";
        let lib = self.lib;
        // SAFETY: the group brackets every call; buffers hold n f32 on each comm's device and
        // the streams belong to those devices.
        let rc_start = quietly(|| unsafe { (lib.group_start)() }).unwrap_or(-1);
        lib.check(rc_start, step, "ncclGroupStart")?;
        let mut first_err: Option<Error> = None;
        for ((g, buf), &comm) in gpus.iter().zip(&bufs).zip(&self.comms) {
            let ptr = g.ptr(buf) as *mut c_void;
            let stream = g.stream.cu_stream() as *mut c_void;
            let rc = quietly(|| unsafe {
                (lib.all_reduce)(ptr, ptr, n, NCCL_FLOAT32, NCCL_SUM, comm, stream)
            })
            .unwrap_or(-1);
            if let Err(e) = lib.check(rc, step, "ncclAllReduce") {
                first_err.get_or_insert(e);
            }
        }
        let rc_end = quietly(|| unsafe { (lib.group_end)() }).unwrap_or(-1);
        if rc_end != NCCL_IN_PROGRESS {
            if let Err(e) = lib.check(rc_end, step, "ncclGroupEnd") {
                first_err.get_or_insert(e);
            }
        }
        if let Some(e) = first_err {
            self.abort_all();
            return Err(e);
        }
        self.wait(gpus, step)?;
        let mut out = Vec::with_capacity(gpus.len());
        for (g, b) in gpus.iter().zip(&bufs) {
            out.push(g.download(b, n, "the all-reduced EP output")?);
        }
        Ok(out)
    }

    /// Poll every stream until the collective is done, an error shows, or the deadline passes.
    fn wait(&self, gpus: &[&Gpu], step: &str) -> Result<()> {
        let deadline = Instant::now() + ALL_REDUCE_TIMEOUT;
        for (g, &comm) in gpus.iter().zip(&self.comms) {
            g.stream
                .context()
                .bind_to_thread()
                .map_err(|e| driver_err(step, "ncclAllReduce", e))?;
            loop {
                let stream = g.stream.cu_stream();
                // SAFETY: a live stream of the bound context.
                let q = quietly(|| unsafe { drv_sys::cuStreamQuery(stream) })
                    .unwrap_or(drv_sys::CUresult::CUDA_ERROR_UNKNOWN);
                match q {
                    drv_sys::CUresult::CUDA_SUCCESS => break,
                    drv_sys::CUresult::CUDA_ERROR_NOT_READY => {}
                    other => {
                        self.abort_all();
                        return Err(driver_err(step, "ncclAllReduce", DriverError(other)));
                    }
                }
                let mut async_rc: c_int = NCCL_SUCCESS;
                // SAFETY: a live communicator; async_rc is a valid out pointer.
                let rc = quietly(|| unsafe { (self.lib.async_error)(comm, &mut async_rc) })
                    .unwrap_or(-1);
                let bad = if rc != NCCL_SUCCESS {
                    Some(rc)
                } else if async_rc != NCCL_SUCCESS && async_rc != NCCL_IN_PROGRESS {
                    Some(async_rc)
                } else {
                    None
                };
                if let Some(rc) = bad {
                    self.abort_all();
                    return Err(Error::Cuda {
                        step: step.into(),
                        kernel: "ncclAllReduce".into(),
                        what: format!("on cuda:{}: {}", g.ordinal, self.lib.describe(rc)),
                    });
                }
                if Instant::now() > deadline {
                    self.abort_all();
                    return Err(Error::Cuda {
                        step: step.into(),
                        kernel: "ncclAllReduce".into(),
                        what: format!(
                            "not done after {} s on cuda:{}; the communicators were aborted",
                            ALL_REDUCE_TIMEOUT.as_secs(),
                            g.ordinal
                        ),
                    });
                }
                std::thread::sleep(Duration::from_micros(200));
            }
            g.sync(step)?;
        }
        Ok(())
    }
}

/// NCCL switches the calling thread's current device; the first GPU (rank 0's, which the
/// command goes on using, with raw driver calls that need a current context) is made current
/// again.
fn rebind_first(gpus: &[&Gpu]) -> Result<()> {
    match gpus.first() {
        Some(g) => g
            .stream
            .context()
            .bind_to_thread()
            .map_err(|e| driver_err("making the first GPU current again after NCCL", "-", e)),
        None => Ok(()),
    }
}

impl Drop for Comms {
    fn drop(&mut self) {
        if self.aborted.get() {
            return;
        }
        for &c in &self.comms {
            // SAFETY: a communicator from ncclCommInitAll, destroyed once; errors are ignored
            // (nothing to do about them while dropping).
            let _ = quietly(|| unsafe { (self.lib.destroy)(c) });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_is_an_error_not_a_panic() {
        // An explicit path that is not NCCL: the loader says so, naming it.
        let dir = tempfile::tempdir().unwrap();
        let fake = dir.path().join("libnccl.so.2");
        std::fs::write(&fake, b"not a library").unwrap();
        let e = Nccl::load_from(&fake.display().to_string()).err().unwrap();
        assert!(!e.is_empty());
        assert!(lib_in(dir.path()).contains(&fake.display().to_string()));
        assert!(lib_in(&dir.path().join("nope")).is_empty());
    }

    #[test]
    fn nccl_errors_come_back_as_errors() {
        // Only where libnccl is found (a GPU box, or NVFP4DBG_NCCL_LIB): communicators over
        // devices that do not exist fail with NCCL's own message, through our signatures.
        let Ok(lib) = library() else { return };
        let devs: [c_int; 2] = [4096, 4097];
        let mut comms = [std::ptr::null_mut::<c_void>(); 2];
        let rc =
            quietly(|| unsafe { (lib.init_all)(comms.as_mut_ptr(), 2, devs.as_ptr()) }).unwrap();
        let e = lib
            .check(rc, "test", "ncclCommInitAll")
            .unwrap_err()
            .to_string();
        eprintln!("{e}");
        assert!(
            e.contains("ncclCommInitAll") && e.contains("ncclResult"),
            "{e}"
        );
    }

    #[test]
    fn looking_for_nccl_and_gpus_never_panics() {
        // CPU CI: no libnccl, no driver: errors that say where we looked; on a GPU box, Ok
        eprintln!("NCCL: {:?}", library().map(|l| (&l.path, &l.version)));
        match library() {
            Ok(l) => assert!(l.version.starts_with('2'), "{}", l.version),
            Err(e) => assert!(
                e.contains("NVFP4DBG_NCCL_LIB") || e.contains("libnccl"),
                "{e}"
            ),
        }
        match visible_gpus() {
            Ok(n) => assert!(n > 0),
            Err(e) => assert!(matches!(e, Error::NoGpu(_)), "{e}"),
        }
    }
}
