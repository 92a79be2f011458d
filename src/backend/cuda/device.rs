//! The GPU handle: probe (never panics), context + one stream, the lazily compiled module
//! cache, cuBLAS, device memory helpers and kernel launches. Every CUDA call is checked and
//! every error names the kernel (or the step) it came from.

use super::nvrtc::{self, KernelModule};
use super::watchdog::{self, Watchdog};
use crate::error::{Error, Result};
use cudarc::cublas::{result::CublasError, sys as cublas_sys, CudaBlas};
use cudarc::driver::{
    result as drv, sys as drv_sys, CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream,
    DevicePtr, DeviceRepr, DriverError, LaunchConfig, PushKernelArg, ValidAsZeroBits,
};
use cudarc::nvrtc::Ptx;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// Run `f`, turning a panic (cudarc panics when a library or a symbol is missing) into `Err`.
pub(crate) fn quietly<T>(f: impl FnOnce() -> T) -> std::result::Result<T, String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).map_err(|p| {
        p.downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "panic in the CUDA library loader".into())
    })
}

fn driver_what(e: &DriverError) -> String {
    // the names come from libcuda; never let a missing library turn an error into a panic
    let name = quietly(|| e.error_name().map(|s| s.to_string_lossy().into_owned()))
        .ok()
        .and_then(|r| r.ok())
        .unwrap_or_else(|| format!("{:?}", e.0));
    let text = quietly(|| e.error_string().map(|s| s.to_string_lossy().into_owned()))
        .ok()
        .and_then(|r| r.ok())
        .unwrap_or_default();
    if text.is_empty() {
        name
    } else {
        format!("{name}: {text}")
    }
}

/// A driver error during `step` in `kernel`; out-of-memory becomes `GpuOom` (with advice).
pub(crate) fn driver_err(step: &str, kernel: &str, e: DriverError) -> Error {
    if e.0 == drv_sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
        let step = if kernel == "-" {
            step.to_string()
        } else {
            format!("{step} ({kernel})")
        };
        Error::gpu_oom(step, driver_what(&e))
    } else {
        Error::Cuda {
            step: step.to_string(),
            kernel: kernel.to_string(),
            what: driver_what(&e),
        }
    }
}

pub(crate) fn cublas_err(step: &str, kernel: &str, e: CublasError) -> Error {
    if e.0 == cublas_sys::cublasStatus_t::CUBLAS_STATUS_ALLOC_FAILED {
        Error::gpu_oom(format!("{step} ({kernel})"), format!("{:?}", e.0))
    } else {
        Error::Cuda {
            step: step.to_string(),
            kernel: kernel.to_string(),
            what: format!("{:?}", e.0),
        }
    }
}

/// Is a usable GPU there? Checks the driver and NVRTC libraries load, the driver
/// initializes, and device `ordinal` exists with compute capability 8.0 or newer (the
/// kernels use BF16 `mma.sync`). Never panics.
pub fn probe(ordinal: usize) -> Result<(i32, i32)> {
    quietly(|| probe_inner(ordinal))
        .unwrap_or_else(|p| Err(Error::NoGpu(format!("loading the CUDA libraries: {p}"))))
}

fn probe_inner(ordinal: usize) -> Result<(i32, i32)> {
    if !unsafe { drv_sys::is_culib_present() } {
        return Err(Error::NoGpu(
            "libcuda.so (the NVIDIA driver) cannot be loaded; is this a GPU machine?".into(),
        ));
    }
    if !nvrtc::nvrtc_present() {
        return Err(Error::NoGpu(
            "libnvrtc.so (CUDA 13 NVRTC) cannot be loaded: put the CUDA toolkit's lib64 on \
             LD_LIBRARY_PATH"
                .into(),
        ));
    }
    drv::init().map_err(|e| Error::NoGpu(format!("cuInit failed: {}", driver_what(&e))))?;
    let n = drv::device::get_count()
        .map_err(|e| Error::NoGpu(format!("cuDeviceGetCount: {}", driver_what(&e))))?;
    if n <= 0 {
        return Err(Error::NoGpu("the driver sees no CUDA device".into()));
    }
    if ordinal >= n as usize {
        return Err(Error::NoGpu(format!(
            "cuda:{ordinal} asked for, but the driver sees {n} device(s) (cuda:0..cuda:{})",
            n - 1
        )));
    }
    let dev = drv::device::get(ordinal as i32)
        .map_err(|e| Error::NoGpu(format!("cuDeviceGet({ordinal}): {}", driver_what(&e))))?;
    let attr = |a| unsafe { drv::device::get_attribute(dev, a) };
    use drv_sys::CUdevice_attribute::*;
    let major = attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
        .map_err(|e| Error::NoGpu(driver_what(&e)))?;
    let minor = attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
        .map_err(|e| Error::NoGpu(driver_what(&e)))?;
    if major < 8 {
        return Err(Error::NoGpu(format!(
            "cuda:{ordinal} has compute capability {major}.{minor}; the kernels need 8.0 or newer"
        )));
    }
    Ok((major, minor))
}

/// A kernel argument, by value (device pointers are passed as `u64`).
#[derive(Clone, Copy, Debug)]
pub enum KArg {
    U64(u64),
    U32(u32),
    I32(i32),
    F32(f32),
}
impl From<u64> for KArg {
    fn from(v: u64) -> Self {
        KArg::U64(v)
    }
}
impl From<u32> for KArg {
    fn from(v: u32) -> Self {
        KArg::U32(v)
    }
}
impl From<i32> for KArg {
    fn from(v: i32) -> Self {
        KArg::I32(v)
    }
}
impl From<f32> for KArg {
    fn from(v: f32) -> Self {
        KArg::F32(v)
    }
}

/// cuBLAS with its own workspace, so that its calls can be captured in a CUDA graph.
pub(crate) struct Blas {
    pub(crate) blas: std::mem::ManuallyDrop<CudaBlas>,
    _workspace: CudaSlice<u8>,
    stream: Arc<CudaStream>,
}

impl Drop for Blas {
    fn drop(&mut self) {
        // cudarc unwraps cublasDestroy; once a kernel fault (an illegal address) has poisoned
        // the context that could turn the reported CUDA error into a panic on the way out, so
        // a dead context's handle is leaked instead.
        let poisoned = self.stream.synchronize().is_err();
        // SAFETY: taken once, here, and never used again
        let blas = unsafe { std::mem::ManuallyDrop::take(&mut self.blas) };
        if poisoned {
            std::mem::forget(blas);
        }
    }
}

const BLAS_WORKSPACE: usize = 32 << 20;

/// One GPU: a context, one non-blocking stream that all work goes to (so ordering is the
/// stream's, and a forward can be captured into a graph) but the independent work
/// [`Gpu::fork_side`] puts on a second one, the module cache and cuBLAS.
pub struct Gpu {
    pub ordinal: usize,
    pub name: String,
    pub compute_capability: (i32, i32),
    /// The NVRTC target, e.g. `sm_90a`.
    pub arch: String,
    pub(crate) stream: Arc<CudaStream>,
    ctx: Arc<CudaContext>,
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
    funcs: Mutex<HashMap<&'static str, CudaFunction>>,
    /// [`Gpu::persistent_grid`]'s answers by (kernel, threads, shared memory).
    grids: Mutex<HashMap<(&'static str, u32, u32), LaunchConfig>>,
    blas: Mutex<Option<Arc<Blas>>>,
    /// The side stream and its own cuBLAS handle ([`Gpu::fork_side`]), made at first use.
    side: Mutex<Option<(Arc<CudaStream>, Arc<Blas>)>>,
    /// Set while [`Gpu::fork_side`] enqueues: launches, fills and cuBLAS go to the side stream.
    on_side: AtomicBool,
    /// Kernels launched since the last synchronization, to name them in an async error.
    pending: Mutex<Vec<&'static str>>,
    /// `NVFP4DBG_CUDA_SYNC=1`: synchronize after every launch to pin an error on its kernel.
    sync_each: bool,
    pub(crate) capturing: AtomicBool,
    /// Watches the host's waits for the GPU: a kernel that never ends is exit 2 naming the
    /// step and the kernels in flight, not a hang (src/backend/cuda/watchdog.rs).
    watchdog: Arc<Watchdog>,
}

impl Drop for Gpu {
    fn drop(&mut self) {
        // the context's teardown waits for the GPU's work: wait here first, under the
        // watchdog, so a kernel that never ends is still reported; then its thread ends
        let _ = self.sync("releasing the GPU");
        self.watchdog.stop();
    }
}

impl Gpu {
    pub fn open(ordinal: usize) -> Result<Arc<Gpu>> {
        let cc = probe(ordinal)?;
        quietly(|| Self::open_inner(ordinal, cc))
            .unwrap_or_else(|p| Err(Error::NoGpu(format!("opening cuda:{ordinal}: {p}"))))
    }

    fn open_inner(ordinal: usize, cc: (i32, i32)) -> Result<Arc<Gpu>> {
        let ctx = CudaContext::new(ordinal).map_err(|e| {
            Error::NoGpu(format!(
                "creating a context on cuda:{ordinal}: {}",
                driver_what(&e)
            ))
        })?;
        // The main stream carries everything but what Gpu::fork_side puts on the side
        // stream, ordered by explicit events; no automatic cross-stream events (they would
        // also break graph capture).
        unsafe { ctx.disable_event_tracking() };
        // the main stream at the highest priority, so that the side stream's kernels
        // (Gpu::fork_side) get only the multiprocessors the main one leaves idle
        let (_, highest) = ctx
            .bind_to_thread()
            .and_then(|_| cudarc::driver::result::stream::get_priority_range())
            .map_err(|e| driver_err("reading the stream priority range", "-", e))?;
        let stream = ctx
            .new_stream_with_priority(highest)
            .map_err(|e| driver_err("creating a stream", "-", e))?;
        let name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        Ok(Arc::new(Gpu {
            ordinal,
            name,
            compute_capability: cc,
            arch: nvrtc::arch_for(cc.0, cc.1),
            stream,
            ctx,
            modules: Mutex::new(HashMap::new()),
            funcs: Mutex::new(HashMap::new()),
            grids: Mutex::new(HashMap::new()),
            blas: Mutex::new(None),
            side: Mutex::new(None),
            on_side: AtomicBool::new(false),
            pending: Mutex::new(Vec::new()),
            sync_each: std::env::var("NVFP4DBG_CUDA_SYNC").is_ok_and(|v| v == "1"),
            capturing: AtomicBool::new(false),
            watchdog: Watchdog::start(
                watchdog::limit_from_env(),
                Box::new(move |limit, step, kernels| {
                    eprintln!(
                        "nvfp4dbg: error: hang during {step} on cuda:{ordinal} (kernel \
                         `{}`): waited {:.0} s for the GPU (NVFP4DBG_KERNEL_TIMEOUT_S); a \
                         GPU kernel cannot be cancelled, exiting (rerun with \
                         NVFP4DBG_CUDA_SYNC=1 to pin the kernel)",
                        kernel_label(kernels),
                        limit.as_secs_f64()
                    );
                    watchdog::exit_now(2)
                }),
            ),
        }))
    }

    pub fn describe(&self) -> String {
        format!("cuda:{} ({}, {})", self.ordinal, self.name, self.arch)
    }

    /// Make this GPU's context current on the calling thread (a plugin's CUDA runtime calls
    /// run in whatever context is current).
    pub(crate) fn bind_to_thread(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| driver_err("binding the CUDA context to the thread", "-", e))
    }

    /// (free, total) device memory in bytes.
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        self.ctx
            .mem_get_info()
            .map_err(|e| driver_err("cuMemGetInfo", "-", e))
    }

    /// The device's multiprocessor count.
    pub(crate) fn multiprocessors(&self) -> Result<i32> {
        use drv_sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT;
        self.ctx
            .attribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| driver_err("reading the multiprocessor count", "-", e))
    }

    /// A persistent grid for `kernel`: as many CTAs of `threads` threads and `smem` bytes of
    /// dynamic shared memory as are resident at once on all multiprocessors (at least one).
    pub(crate) fn persistent_grid(
        &self,
        module: &'static KernelModule,
        kernel: &'static str,
        threads: u32,
        smem: u32,
    ) -> Result<LaunchConfig> {
        if let Some(g) = lock(&self.grids).get(&(kernel, threads, smem)) {
            return Ok(*g);
        }
        let f = self.func(module, kernel)?;
        allow_dynamic_smem(&f, kernel, smem)?;
        let per_sm = f
            .occupancy_max_active_blocks_per_multiprocessor(threads, smem as usize, None)
            .map_err(|e| driver_err("cuOccupancyMaxActiveBlocksPerMultiprocessor", kernel, e))?;
        let sms = self.multiprocessors()?;
        let grid = LaunchConfig {
            grid_dim: ((per_sm.max(1) * sms.max(1) as u32), 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: smem,
        };
        lock(&self.grids).insert((kernel, threads, smem), grid);
        Ok(grid)
    }

    /// The kernel `name` of `module`, compiling and loading the module on first use.
    pub(crate) fn func(
        &self,
        module: &'static KernelModule,
        name: &'static str,
    ) -> Result<CudaFunction> {
        if let Some(f) = lock(&self.funcs).get(name) {
            return Ok(f.clone());
        }
        let m = {
            let mut mods = lock(&self.modules);
            match mods.get(module.file) {
                Some(m) => m.clone(),
                None => {
                    let (cubin, cached) = nvrtc::cached_cubin(module, &self.arch)?;
                    let m = match (self.ctx.load_module(Ptx::from_binary(cubin)), cached) {
                        (Ok(m), _) => m,
                        // a cached CUBIN the driver refuses: forget it and compile anew
                        (Err(_), Some(path)) => {
                            nvrtc::forget_cached(&path);
                            let cubin = nvrtc::compile_cubin(module, &self.arch)?;
                            self.ctx
                                .load_module(Ptx::from_binary(cubin))
                                .map_err(|e| driver_err("loading the CUBIN", module.file, e))?
                        }
                        (Err(e), None) => {
                            return Err(driver_err("loading the CUBIN", module.file, e))
                        }
                    };
                    mods.insert(module.file, m.clone());
                    m
                }
            }
        };
        let f = m
            .load_function(name)
            .map_err(|e| driver_err(&format!("finding the kernel in {}", module.file), name, e))?;
        lock(&self.funcs).insert(name, f.clone());
        Ok(f)
    }

    /// Launch `kernel` on the stream. Errors name the kernel; asynchronous faults surface at
    /// the next [`Gpu::sync`], which names the kernels launched since.
    pub(crate) fn launch(
        &self,
        module: &'static KernelModule,
        kernel: &'static str,
        cfg: LaunchConfig,
        args: &[KArg],
    ) -> Result<()> {
        self.launch_inner(module, kernel, cfg, args, false)
    }

    /// [`Gpu::launch`] with programmatic dependent launch (sm_90 and newer): the kernel's CTAs
    /// may start while the kernel before it on the stream still runs, and the kernel itself
    /// waits (`griddepcontrol.wait`) before it reads anything that kernel writes. Only for
    /// kernels written that way (kernels/moe_decode.cu, `pdl_wait`). `NVFP4DBG_PDL=0` launches
    /// them plainly (to measure one against the other on the same build).
    pub(crate) fn launch_early(
        &self,
        module: &'static KernelModule,
        kernel: &'static str,
        cfg: LaunchConfig,
        args: &[KArg],
    ) -> Result<()> {
        static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        let off = *OFF.get_or_init(|| std::env::var("NVFP4DBG_PDL").is_ok_and(|v| v == "0"));
        let early = !off && self.compute_capability.0 >= 9;
        self.launch_inner(module, kernel, cfg, args, early)
    }

    fn launch_inner(
        &self,
        module: &'static KernelModule,
        kernel: &'static str,
        cfg: LaunchConfig,
        args: &[KArg],
        early: bool,
    ) -> Result<()> {
        let f = self.func(module, kernel)?;
        super::fault::before_launch(self, kernel)?;
        if cfg.grid_dim.0 == 0 || cfg.grid_dim.1 == 0 || cfg.grid_dim.2 == 0 {
            return Ok(());
        }
        if cfg.grid_dim.1 > 65535 || cfg.grid_dim.2 > 65535 || cfg.grid_dim.0 > i32::MAX as u32 {
            return Err(Error::Cuda {
                step: "kernel launch".into(),
                kernel: kernel.into(),
                what: format!("grid {:?} is larger than CUDA allows", cfg.grid_dim),
            });
        }
        allow_dynamic_smem(&f, kernel, cfg.shared_mem_bytes)?;
        if early {
            self.launch_programmatic(&f, cfg, args)
                .map_err(|e| driver_err("kernel launch (programmatic)", kernel, e))?;
        } else {
            let stream = self.work_stream();
            let mut b = stream.launch_builder(&f);
            for a in args {
                match a {
                    KArg::U64(v) => b.arg(v),
                    KArg::U32(v) => b.arg(v),
                    KArg::I32(v) => b.arg(v),
                    KArg::F32(v) => b.arg(v),
                };
            }
            unsafe { b.launch(cfg) }.map_err(|e| driver_err("kernel launch", kernel, e))?;
        }
        lock(&self.pending).push(kernel);
        if self.sync_each && !self.capturing.load(Ordering::Relaxed) {
            self.sync(kernel)?;
        }
        Ok(())
    }

    /// cuLaunchKernelEx with the programmatic-stream-serialization attribute (cudarc's launch
    /// builder has no launch attributes).
    fn launch_programmatic(
        &self,
        f: &CudaFunction,
        cfg: LaunchConfig,
        args: &[KArg],
    ) -> std::result::Result<(), DriverError> {
        use drv_sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        // each argument in its own 8-byte slot; the kernel reads its own size from the start
        let mut slots: Vec<u64> = args
            .iter()
            .map(|a| match *a {
                KArg::U64(v) => v,
                KArg::U32(v) => v as u64,
                KArg::I32(v) => v as u32 as u64,
                KArg::F32(v) => v.to_bits() as u64,
            })
            .collect();
        let mut params: Vec<*mut std::ffi::c_void> = slots
            .iter_mut()
            .map(|s| s as *mut u64 as *mut std::ffi::c_void)
            .collect();
        // SAFETY: a plain C struct; all-zero is its empty value
        let mut attr: drv_sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let config = drv_sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.work_stream().cu_stream(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        self.ctx.bind_to_thread()?;
        // SAFETY: `params` points at `slots`, one per kernel parameter in order, both alive
        // until the call returns (the driver copies the values at launch)
        unsafe {
            drv_sys::cuLaunchKernelEx(
                &config,
                f.cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
            .result()
        }
    }

    /// An error of a stream operation (allocation, fill, copy). A fault inside a kernel still in
    /// flight is sticky and surfaces at whatever call comes next, so anything but out-of-memory
    /// is charged to the kernels launched since the last sync.
    fn stream_err(&self, step: &str, e: DriverError) -> Error {
        if e.0 == drv_sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
            return driver_err(step, "-", e);
        }
        driver_err(step, &kernel_label(&distinct(&lock(&self.pending))), e)
    }

    /// The host blocks on the GPU for `step` until the guard drops: the watchdog ends the
    /// process if that lasts NVFP4DBG_KERNEL_TIMEOUT_S.
    fn waiting(&self, step: &str) -> watchdog::Waiting<'_> {
        self.watchdog.waiting(step, distinct(&lock(&self.pending)))
    }

    /// Wait for the stream; an error names the kernels launched since the last sync. (A wait
    /// that never ends is the watchdog's: see [`Gpu::waiting`].)
    pub fn sync(&self, step: &str) -> Result<()> {
        let side = lock(&self.side).as_ref().map(|(s, _)| s.clone());
        let blocked = self.waiting(step);
        let r = side
            .map_or(Ok(()), |s| s.synchronize())
            .and_then(|_| self.stream.synchronize());
        drop(blocked);
        let kernels = std::mem::take(&mut *lock(&self.pending));
        r.map_err(|e| {
            driver_err(
                &format!("{step} (an asynchronous fault in one of these kernels; rerun with NVFP4DBG_CUDA_SYNC=1 to pin it)"),
                &kernel_label(&distinct(&kernels)),
                e,
            )
        })
    }

    /// Allocate `n` elements, filled with 0xFF bytes (NaN for f32/bf16) so that anything a
    /// kernel fails to write shows up.
    pub fn alloc<T: DeviceRepr>(&self, n: usize, what: &str) -> Result<CudaSlice<T>> {
        super::fault::before_alloc(what)?;
        let mut s = unsafe { self.stream.alloc::<T>(n.max(1)) }
            .map_err(|e| self.stream_err(&format!("allocating {what}"), e))?;
        self.fill(&mut s, 0xFF, what)?;
        Ok(s)
    }

    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        n: usize,
        what: &str,
    ) -> Result<CudaSlice<T>> {
        super::fault::before_alloc(what)?;
        self.stream
            .alloc_zeros::<T>(n.max(1))
            .map_err(|e| self.stream_err(&format!("allocating {what}"), e))
    }

    /// Set every byte of `s` to `byte`.
    pub fn fill<T>(&self, s: &mut CudaSlice<T>, byte: u8, what: &str) -> Result<()> {
        let bytes = s.num_bytes();
        let ptr = self.ptr(s);
        unsafe { drv::memset_d8_async(ptr, byte, bytes, self.stream.cu_stream()) }
            .map_err(|e| self.stream_err(&format!("filling {what}"), e))
    }

    /// Set `bytes` bytes at device address `ptr` to `byte` (stream-ordered; capturable).
    pub(crate) fn fill_raw(&self, ptr: u64, bytes: usize, byte: u8, what: &str) -> Result<()> {
        unsafe { drv::memset_d8_async(ptr, byte, bytes, self.work_stream().cu_stream()) }
            .map_err(|e| self.stream_err(&format!("filling {what}"), e))
    }

    pub fn upload<T: DeviceRepr>(&self, host: &[T], what: &str) -> Result<CudaSlice<T>> {
        if host.is_empty() {
            return self.alloc(0, what);
        }
        super::fault::before_alloc(what)?;
        let step = format!("copying {what} to the GPU");
        // from pageable memory the copy may wait for the stream's earlier work
        let _blocked = self.waiting(&step);
        self.stream
            .clone_htod(host)
            .map_err(|e| self.stream_err(&step, e))
    }

    /// Copy `host` to device address `dst` (which must hold it). The copy from pageable
    /// memory returns once the data is on its way, so `host` may be dropped right after.
    pub(crate) fn upload_raw<T: DeviceRepr>(
        &self,
        host: &[T],
        dst: u64,
        capacity: usize,
        what: &str,
    ) -> Result<()> {
        if host.len() > capacity {
            return Err(Error::Cuda {
                step: format!("copying {what} to the GPU"),
                kernel: "-".into(),
                what: format!("{} elements do not fit in {capacity}", host.len()),
            });
        }
        if host.is_empty() {
            return Ok(());
        }
        let step = format!("copying {what} to the GPU");
        let _blocked = self.waiting(&step);
        unsafe { drv::memcpy_htod_async(dst, host, self.stream.cu_stream()) }
            .map_err(|e| self.stream_err(&step, e))
    }

    /// Copy `host` into the start of `dst`.
    pub fn upload_into<T: DeviceRepr>(
        &self,
        host: &[T],
        dst: &mut CudaSlice<T>,
        at: usize,
        what: &str,
    ) -> Result<()> {
        if host.is_empty() {
            return Ok(());
        }
        if at + host.len() > dst.len() {
            return Err(Error::Cuda {
                step: format!("copying {what} to the GPU"),
                kernel: "-".into(),
                what: format!(
                    "{} elements at {at} do not fit in {}",
                    host.len(),
                    dst.len()
                ),
            });
        }
        let mut view = dst.slice_mut(at..at + host.len());
        let step = format!("copying {what} to the GPU");
        let _blocked = self.waiting(&step);
        self.stream
            .memcpy_htod(host, &mut view)
            .map_err(|e| self.stream_err(&step, e))
    }

    /// Copy the first `n` elements back (waits for the stream; reports pending faults).
    pub fn download<T: DeviceRepr + Clone + Default>(
        &self,
        s: &CudaSlice<T>,
        n: usize,
        what: &str,
    ) -> Result<Vec<T>> {
        self.sync(&format!("the work before copying {what} back"))?;
        if n == 0 {
            return Ok(Vec::new());
        }
        let view = s.slice(0..n);
        let v = self
            .stream
            .clone_dtoh(&view)
            .map_err(|e| self.stream_err(&format!("copying {what} back"), e))?;
        self.sync(&format!("copying {what} back"))?;
        Ok(v)
    }

    /// The raw device address of `s` (kernels take plain pointers).
    pub fn ptr<T>(&self, s: &CudaSlice<T>) -> u64 {
        let (p, _guard) = s.device_ptr(&self.stream);
        p
    }

    pub(crate) fn blas(&self) -> Result<Arc<Blas>> {
        if self.on_side.load(Ordering::Relaxed) {
            if let Some((_, b)) = lock(&self.side).as_ref() {
                return Ok(b.clone());
            }
        }
        let mut g = lock(&self.blas);
        if let Some(b) = g.as_ref() {
            return Ok(b.clone());
        }
        let b = self.new_blas(self.stream.clone())?;
        *g = Some(b.clone());
        Ok(b)
    }

    /// A cuBLAS handle on `stream` with its own workspace (two handles sharing one workspace
    /// on two streams would race). The workspace is allocated on the main stream: a side
    /// stream uses it only after [`Gpu::fork_side`]'s wait on the main stream.
    fn new_blas(&self, stream: Arc<CudaStream>) -> Result<Arc<Blas>> {
        let present = quietly(|| unsafe { cublas_sys::is_culib_present() }).unwrap_or(false);
        if !present {
            return Err(Error::NoGpu(
                "libcublas.so (CUDA 13 cuBLAS) cannot be loaded: put the CUDA toolkit's lib64 \
                 on LD_LIBRARY_PATH"
                    .into(),
            ));
        }
        let blas = quietly(|| CudaBlas::new(stream.clone()))
            .map_err(|p| Error::NoGpu(format!("libcublas: {p}")))?
            .map_err(|e| cublas_err("creating the cuBLAS handle", "cublas", e))?;
        let ws = self.zeros::<u8>(BLAS_WORKSPACE, "the cuBLAS workspace")?;
        let wsp = self.ptr(&ws);
        unsafe {
            cublas_sys::cublasSetWorkspace_v2(*blas.handle(), wsp as *mut _, BLAS_WORKSPACE)
                .result()
                .map_err(|e| cublas_err("setting the cuBLAS workspace", "cublas", e))?;
        }
        Ok(Arc::new(Blas {
            blas: std::mem::ManuallyDrop::new(blas),
            _workspace: ws,
            stream,
        }))
    }

    /// The stream launches, fills and cuBLAS calls go to: the side stream inside
    /// [`Gpu::fork_side`], else the main one.
    fn work_stream(&self) -> Arc<CudaStream> {
        if self.on_side.load(Ordering::Relaxed) {
            if let Some((s, _)) = lock(&self.side).as_ref() {
                return s.clone();
            }
        }
        self.stream.clone()
    }

    /// Enqueue `enqueue`'s launches, fills and cuBLAS calls on a second stream that first
    /// waits for everything on the main stream so far; the main stream goes on without
    /// waiting for them until [`Gpu::join_side`]. For independent work that can fill the
    /// multiprocessors the main stream's kernels leave idle (the shared expert beside the
    /// routed ones). Inside a stream capture the wait and the join are graph edges. The side
    /// stream and its cuBLAS handle are made at the first call, which must not be inside a
    /// capture (a forward is captured after an eager warm-up).
    pub(crate) fn fork_side(&self, enqueue: impl FnOnce() -> Result<()>) -> Result<()> {
        let side = {
            let mut g = lock(&self.side);
            match g.as_ref() {
                Some((s, _)) => s.clone(),
                None => {
                    if self.capturing.load(Ordering::Relaxed) {
                        return Err(Error::usage(
                            "internal: the side stream is first used inside a graph capture",
                        ));
                    }
                    // the lowest priority (the driver's default)
                    let s = self
                        .ctx
                        .new_stream()
                        .map_err(|e| driver_err("creating the side stream", "-", e))?;
                    let b = self.new_blas(s.clone())?;
                    *g = Some((s.clone(), b));
                    s
                }
            }
        };
        side.join(&self.stream)
            .map_err(|e| driver_err("the side stream waiting for the main one", "-", e))?;
        self.on_side.store(true, Ordering::Relaxed);
        let r = enqueue();
        self.on_side.store(false, Ordering::Relaxed);
        r
    }

    /// The main stream waits for everything enqueued on the side stream so far.
    pub(crate) fn join_side(&self) -> Result<()> {
        let side = lock(&self.side).as_ref().map(|(s, _)| s.clone());
        match side {
            Some(s) => self
                .stream
                .join(&s)
                .map_err(|e| driver_err("the main stream waiting for the side one", "-", e)),
            None => Ok(()),
        }
    }
}

/// Raise `f`'s dynamic shared memory limit to `smem` where it is above the default 48 KB (a
/// launch, or an occupancy query, asks for that much).
fn allow_dynamic_smem(f: &CudaFunction, kernel: &str, smem: u32) -> Result<()> {
    use drv_sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
    if smem > 48 * 1024 {
        f.set_attribute(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32)
            .map_err(|e| driver_err("raising the dynamic shared memory limit", kernel, e))?;
    }
    Ok(())
}

/// A poisoned lock only means another thread panicked mid-update of a cache; the maps stay
/// consistent (each insert is one call), so keep going.
/// The kernels of `launched`, each once, in launch order.
fn distinct(launched: &[&'static str]) -> Vec<&'static str> {
    let mut names = Vec::new();
    for &k in launched {
        if !names.contains(&k) {
            names.push(k);
        }
    }
    names
}

/// Kernel names as an error gives them: `a | b`, or `-` for none.
fn kernel_label(names: &[&str]) -> String {
    if names.is_empty() {
        "-".to_string()
    } else {
        names.join(" | ")
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A 1-D launch of `n` threads in blocks of `threads`.
pub(crate) fn grid_1d(n: u64, threads: u32) -> Result<LaunchConfig> {
    let blocks = n.div_ceil(threads as u64);
    if blocks > i32::MAX as u64 {
        return Err(Error::usage(format!(
            "{n} elements is more than one kernel launch covers"
        )));
    }
    Ok(LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probing_without_a_gpu_is_an_error_not_a_panic() {
        // CPU CI has no driver: NoGpu with a message; on a GPU machine, a bogus ordinal.
        match probe(4096) {
            Err(Error::NoGpu(msg)) => assert!(!msg.is_empty()),
            other => panic!("expected NoGpu, got {other:?}"),
        }
    }

    #[test]
    fn oom_becomes_gpu_oom_with_the_step() {
        let e = driver_err(
            "allocating x",
            "k",
            DriverError(drv_sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY),
        );
        assert!(matches!(e, Error::GpuOom { .. }), "{e}");
        assert!(e.to_string().contains("allocating x"));
        let e = driver_err(
            "kernel launch",
            "moe_combine",
            DriverError(drv_sys::CUresult::CUDA_ERROR_INVALID_VALUE),
        );
        assert!(e.to_string().contains("moe_combine"), "{e}");
    }
}
