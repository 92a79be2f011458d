//! "Bring your own kernel": the user's NVFP4 MoE kernel as a shared library speaking the C ABI of
//! `kernels/include/nvfp4dbg_moe.h`. [`Plugin::load`] opens it and checks the ABI (no GPU
//! needed, so a wrong plugin is named before anything else happens); [`Plugin::forward`] lays a
//! layer's inputs out on the GPU as the header says, poisons the output with NaN, calls the
//! plugin on our stream and waits with a deadline.
//!
//! Every failure names the plugin's path: a missing symbol, another ABI version, a non-zero
//! return, a CUDA error after the call (a sticky illegal address included). A plugin that never
//! finishes cannot be cancelled (CUDA has no way to kill a running kernel, and tearing the
//! context down would wait on it): past the deadline the process exits with 2 instead of hanging.
//! A sticky CUDA error (illegal address) likewise exits at once with 2: the context is
//! unusable and its teardown (cuBLAS handles included) would fail.

use super::device::{driver_err, Gpu};
use crate::error::{Error, Result};
use crate::moe::ep::check::IdSpace;
use crate::moe::ep::ExpertMap;
use crate::moe::{MoeLayer, Routing};
use crate::nvfp4::layout::{swizzle, ScaleLayout};
use crate::nvfp4::Format;
use cudarc::driver::sys as drv_sys;
use std::ffi::{c_char, c_void, CStr};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// `NVFP4DBG_MOE_ABI_VERSION` of kernels/include/nvfp4dbg_moe.h.
pub const ABI_VERSION: u32 = 1;

/// How long a plugin call may run before the process gives up on it (override with
/// `NVFP4DBG_PLUGIN_TIMEOUT_S`).
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);

/// `nvfp4dbg_moe_args`, field for field (the header is the contract; a layout test below pins
/// the offsets a C compiler gives them).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct MoeArgs {
    pub abi_version: u32,
    pub struct_size: u32,
    pub tokens: i64,
    pub hidden: i64,
    pub intermediate: i64,
    pub num_experts: i64,
    pub num_local_experts: i64,
    pub top_k: i64,
    pub swiglu_limit: f32,
    pub has_swiglu_limit: i32,
    pub hidden_states: u64,
    pub a1_gscale: u64,
    pub a2_gscale: u64,
    pub w1: u64,
    pub w3: u64,
    pub w2: u64,
    pub w1_scale: u64,
    pub w3_scale: u64,
    pub w2_scale: u64,
    pub scale_layout: i32,
    pub output_dtype: i32,
    pub w1_scale_2: u64,
    pub w3_scale_2: u64,
    pub w2_scale_2: u64,
    pub topk_ids: u64,
    pub topk_weights: u64,
    pub expert_map: u64,
    pub id_convention: i32,
    pub ep_rank: i32,
    pub ep_size: i32,
    pub reserved0: i32,
    pub output: u64,
    pub workspace: u64,
    pub workspace_bytes: u64,
}

/// The plugin's output element type (`nvfp4dbg_dtype`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum OutDtype {
    F32,
    Bf16,
}

type ForwardFn = unsafe extern "C" fn(*const MoeArgs, *mut c_void) -> i32;
type WorkspaceFn = unsafe extern "C" fn(*const MoeArgs) -> u64;
type TextFn = unsafe extern "C" fn() -> *const c_char;

/// A loaded plugin; the library stays open as long as this lives.
pub struct Plugin {
    pub path: PathBuf,
    pub name: String,
    pub scale_layout: ScaleLayout,
    /// What the ids handed to the plugin are (`nvfp4dbg_id_convention`): global (it applies
    /// `expert_map`) or local (`expert_map` applied, -1 for other ranks' experts).
    pub ids: IdSpace,
    pub output_dtype: OutDtype,
    forward: ForwardFn,
    workspace_size: Option<WorkspaceFn>,
    last_error: Option<TextFn>,
    /// Never closed: the function pointers above point into it, and unloading a library that
    /// carries its own (static) CUDA runtime tears that runtime down under a live context.
    _lib: std::mem::ManuallyDrop<libloading::Library>,
}

impl std::fmt::Debug for Plugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Plugin({}, {})", self.path.display(), self.name)
    }
}

fn text(p: *const c_char) -> Option<String> {
    // SAFETY: the plugin returns a NUL-terminated string it owns (or NULL), per the header.
    (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

impl Plugin {
    /// Open `path` and check it speaks this ABI. Needs no GPU.
    pub fn load(path: &Path) -> Result<Plugin> {
        let bad = |what: String| Error::bad_file(path, format!("MoE kernel plugin: {what}"));
        if !path.is_file() {
            return Err(bad(
                "no such file (--kernel takes builtin or the path of a .so)".into(),
            ));
        }
        // A bare file name would make dlopen search the library path: always load this file.
        let full = if path.is_absolute() {
            path.to_path_buf()
        } else {
            std::env::current_dir()
                .map_err(|e| Error::io(path, e))?
                .join(path)
        };
        // SAFETY: loading a library runs its initializers; that is what --kernel asks for.
        let lib = unsafe { libloading::Library::new(&full) }
            .map_err(|e| bad(format!("cannot be loaded: {e}")))?;
        let sym = |name: &str| -> Result<*const c_void> {
            // SAFETY: only the address is taken here; its type is the header's.
            unsafe { lib.get::<*const c_void>(name.as_bytes()) }
                .map(|s| *s)
                .map_err(|_| {
                    bad(format!(
                        "symbol `{name}` missing: not a plugin of kernels/include/nvfp4dbg_moe.h \
                         (export it with extern \"C\")"
                    ))
                })
        };
        let opt = |name: &str| -> Option<*const c_void> {
            // SAFETY: as above.
            unsafe { lib.get::<*const c_void>(name.as_bytes()) }
                .ok()
                .map(|s| *s)
                .filter(|p| !p.is_null())
        };
        let version_fn = sym("nvfp4dbg_moe_abi_version")?;
        // SAFETY: the header declares `uint32_t nvfp4dbg_moe_abi_version(void)`.
        let version =
            unsafe { std::mem::transmute::<*const c_void, extern "C" fn() -> u32>(version_fn)() };
        if version != ABI_VERSION {
            return Err(bad(format!(
                "built against ABI version {version}; this nvfp4dbg speaks version {ABI_VERSION}: \
                 rebuild it against kernels/include/nvfp4dbg_moe.h"
            )));
        }
        // SAFETY: the header's signature.
        let forward = unsafe {
            std::mem::transmute::<*const c_void, ForwardFn>(sym("nvfp4dbg_moe_forward")?)
        };
        let query = |name: &str| -> Option<i32> {
            // SAFETY: the header declares `int32_t name(void)`.
            opt(name).map(|p| unsafe {
                std::mem::transmute::<*const c_void, extern "C" fn() -> i32>(p)()
            })
        };
        // an optional query's answer: an index into `options` (absent = 0)
        let choose = |name: &str, options: &[&str]| -> Result<usize> {
            let v = query(name).unwrap_or(0);
            usize::try_from(v)
                .ok()
                .filter(|&i| i < options.len())
                .ok_or_else(|| {
                    let expected: Vec<String> = options
                        .iter()
                        .enumerate()
                        .map(|(i, o)| format!("{i} ({o})"))
                        .collect();
                    bad(format!(
                        "{name}() = {v}: expected {}",
                        expected.join(" or ")
                    ))
                })
        };
        let scale_layout = [ScaleLayout::Linear, ScaleLayout::Swizzled]
            [choose("nvfp4dbg_moe_scale_layout", &["linear", "128x4 swizzled"])?];
        let ids = [IdSpace::Global, IdSpace::Local]
            [choose("nvfp4dbg_moe_id_convention", &["global", "local"])?];
        let output_dtype =
            [OutDtype::F32, OutDtype::Bf16][choose("nvfp4dbg_moe_output_dtype", &["f32", "bf16"])?];
        // SAFETY: the header's signatures.
        let as_text = |p: *const c_void| unsafe { std::mem::transmute::<*const c_void, TextFn>(p) };
        let name = opt("nvfp4dbg_moe_name")
            .and_then(|p| text(unsafe { as_text(p)() }))
            .unwrap_or_else(|| {
                path.file_name().map_or(path.display().to_string(), |n| {
                    n.to_string_lossy().into_owned()
                })
            });
        let workspace_size = opt("nvfp4dbg_moe_workspace_size")
            .map(|p| unsafe { std::mem::transmute::<*const c_void, WorkspaceFn>(p) });
        let last_error = opt("nvfp4dbg_moe_last_error").map(as_text);
        Ok(Plugin {
            path: path.to_path_buf(),
            name,
            scale_layout,
            ids,
            output_dtype,
            forward,
            workspace_size,
            last_error,
            _lib: std::mem::ManuallyDrop::new(lib),
        })
    }

    fn fail(&self, what: impl Into<String>) -> Error {
        Error::bad_file(&self.path, format!("MoE kernel plugin: {}", what.into()))
    }

    /// The routed experts' weighted sum `[tokens, hidden]` (f32) of `layer` on `hidden` with
    /// `routing` (global ids), as rank `map.ep_rank` of `map.ep_size` computes it (`None`: one
    /// rank, every expert). `gs1` / `gs2` are per global expert, quant direction.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        gpu: &Gpu,
        layer: &MoeLayer,
        hidden: &[f32],
        routing: &Routing,
        gs1: &[f32],
        gs2: &[f32],
        map: Option<&ExpertMap>,
    ) -> Result<Vec<f32>> {
        let inputs = Inputs::build(
            layer,
            hidden,
            routing,
            gs1,
            gs2,
            map,
            self.scale_layout,
            self.ids,
        )?;
        let up8 = |v: &[u8], what: &str| gpu.upload(v, what);
        let upf = |v: &[f32], what: &str| gpu.upload(v, what);
        let d_hidden = gpu.upload(&inputs.hidden_bf16, "plugin hidden_states")?;
        let d_gs1 = upf(&inputs.a1_gscale, "plugin a1_gscale")?;
        let d_gs2 = upf(&inputs.a2_gscale, "plugin a2_gscale")?;
        let [q1, q3, q2] = &inputs.codes;
        let [s1, s3, s2] = &inputs.scales;
        let [ws1, ws3, ws2] = &inputs.scale_2;
        let (d_q1, d_q3, d_q2) = (
            up8(q1, "plugin w1")?,
            up8(q3, "plugin w3")?,
            up8(q2, "plugin w2")?,
        );
        let (d_s1, d_s3, d_s2) = (
            up8(s1, "plugin w1_scale")?,
            up8(s3, "plugin w3_scale")?,
            up8(s2, "plugin w2_scale")?,
        );
        let (d_ws1, d_ws3, d_ws2) = (
            upf(ws1, "plugin w1_scale_2")?,
            upf(ws3, "plugin w3_scale_2")?,
            upf(ws2, "plugin w2_scale_2")?,
        );
        let d_ids = gpu.upload(&inputs.topk_ids, "plugin topk_ids")?;
        let d_w = upf(&routing.topk_weights, "plugin topk_weights")?;
        let d_map = gpu.upload(&inputs.expert_map, "plugin expert_map")?;
        let (t, h) = (routing.tokens, layer.config.hidden_size);
        // Gpu::alloc fills with 0xFF bytes: NaN in f32 and in BF16, the poison the header promises
        let out_bytes = t
            * h
            * if self.output_dtype == OutDtype::F32 {
                4
            } else {
                2
            };
        let d_out = gpu.alloc::<u8>(out_bytes, "plugin output")?;

        let mut args = inputs.args;
        args.output_dtype = self.output_dtype as i32;
        let ws_bytes = match self.workspace_size {
            // SAFETY: dims and enums set, pointers NULL, as the header asks.
            Some(f) => unsafe { f(&args) },
            None => 0,
        };
        if ws_bytes > (1u64 << 40) {
            return Err(self.fail(format!(
                "nvfp4dbg_moe_workspace_size() asks for {ws_bytes} bytes"
            )));
        }
        let d_ws = gpu.alloc::<u8>(ws_bytes as usize, "plugin workspace")?;
        args.hidden_states = gpu.ptr(&d_hidden);
        args.a1_gscale = gpu.ptr(&d_gs1);
        args.a2_gscale = gpu.ptr(&d_gs2);
        args.w1 = gpu.ptr(&d_q1);
        args.w3 = gpu.ptr(&d_q3);
        args.w2 = gpu.ptr(&d_q2);
        args.w1_scale = gpu.ptr(&d_s1);
        args.w3_scale = gpu.ptr(&d_s3);
        args.w2_scale = gpu.ptr(&d_s2);
        args.w1_scale_2 = gpu.ptr(&d_ws1);
        args.w3_scale_2 = gpu.ptr(&d_ws3);
        args.w2_scale_2 = gpu.ptr(&d_ws2);
        args.topk_ids = gpu.ptr(&d_ids);
        args.topk_weights = gpu.ptr(&d_w);
        args.expert_map = gpu.ptr(&d_map);
        args.output = gpu.ptr(&d_out);
        args.workspace = if ws_bytes == 0 { 0 } else { gpu.ptr(&d_ws) };
        args.workspace_bytes = ws_bytes;

        // our own work done (and its faults ours) before the plugin's starts
        gpu.sync("laying out the plugin's inputs")?;
        gpu.bind_to_thread()?;
        let stream = gpu.stream.cu_stream();
        // SAFETY: every pointer in `args` is a live device allocation of the size the header
        // states, owned here until after the stream is drained below.
        let rc = unsafe { (self.forward)(&args, stream as *mut c_void) };
        if rc != 0 {
            // SAFETY: the header's optional query.
            let msg = self.last_error.and_then(|f| text(unsafe { f() }));
            let what = format!(
                "nvfp4dbg_moe_forward returned {rc}{}",
                msg.filter(|m| !m.is_empty())
                    .map_or(String::new(), |m| format!(": {m}"))
            );
            // drain what it may have enqueued before failing, so its error stays its own
            self.wait(stream, &what);
            return Err(self.fail(what));
        }
        self.wait(stream, "");
        let raw = gpu.download(&d_out, out_bytes, "the plugin's output")?;
        Ok(match self.output_dtype {
            OutDtype::F32 => raw
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            OutDtype::Bf16 => raw
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
        })
    }

    /// A fault that leaves the CUDA context unusable (a sticky error, a kernel that never
    /// ends): tearing the context down could itself fail or wait forever, so the process
    /// exits here (2), naming the plugin.
    fn fatal(&self, what: &str) -> ! {
        eprintln!(
            "nvfp4dbg: error: {}: MoE kernel plugin ({}): {what}",
            self.path.display(),
            self.name
        );
        // no exit handlers: the driver's teardown would wait on a kernel that never ends
        super::watchdog::exit_now(2)
    }

    /// Wait for the stream with a deadline, polling: a fault in the plugin's kernels is the
    /// plugin's, named with its path (`before`: what already went wrong, for the message).
    fn wait(&self, stream: drv_sys::CUstream, before: &str) {
        let before = if before.is_empty() {
            String::new()
        } else {
            format!("{before}; ")
        };
        let limit = std::env::var("NVFP4DBG_PLUGIN_TIMEOUT_S")
            .ok()
            .and_then(|v| v.parse::<f64>().ok())
            .filter(|v| *v > 0.0)
            .map_or(DEFAULT_TIMEOUT, Duration::from_secs_f64);
        let start = Instant::now();
        let mut nap = Duration::from_micros(50);
        loop {
            // SAFETY: a live stream of our context.
            let r = unsafe { drv_sys::cuStreamQuery(stream) };
            match r {
                drv_sys::CUresult::CUDA_SUCCESS => return,
                drv_sys::CUresult::CUDA_ERROR_NOT_READY => {}
                e => {
                    let err = driver_err("-", "-", cudarc::driver::DriverError(e));
                    let what = match err {
                        Error::Cuda { what, .. } | Error::GpuOom { what, .. } => what,
                        other => other.to_string(),
                    };
                    self.fatal(&format!(
                        "{before}CUDA error in the plugin's kernels: {what}; the CUDA context is \
                         unusable after this, exiting (rerun under compute-sanitizer to find the \
                         faulting access)"
                    ));
                }
            }
            if start.elapsed() > limit {
                // no way to cancel a running kernel, and context teardown would wait on it
                self.fatal(&format!(
                    "{before}still running after {:.0} s (NVFP4DBG_PLUGIN_TIMEOUT_S): a hang in \
                     the plugin's kernels; exiting",
                    limit.as_secs_f64()
                ));
            }
            std::thread::sleep(nap);
            nap = (nap * 2).min(Duration::from_millis(20));
        }
    }
}

/// A layer's inputs laid out on the host exactly as the header describes them.
pub struct Inputs {
    /// Dims and enums filled, pointers 0.
    pub args: MoeArgs,
    /// `[T, H]` BF16 bits.
    pub hidden_bf16: Vec<u16>,
    /// `[L]` each.
    pub a1_gscale: Vec<f32>,
    pub a2_gscale: Vec<f32>,
    /// w1, w3, w2 codes, `[L, out, in/2]`.
    pub codes: [Vec<u8>; 3],
    /// w1, w3, w2 block scales in the layout asked for.
    pub scales: [Vec<u8>; 3],
    /// w1, w3, w2 `weight_scale_2`, `[L]`.
    pub scale_2: [Vec<f32>; 3],
    /// `[T, K]` in the convention asked for.
    pub topk_ids: Vec<i32>,
    /// `[E]`.
    pub expert_map: Vec<i32>,
    /// `local_to_global[l]`.
    pub local_to_global: Vec<usize>,
}

impl Inputs {
    #[allow(clippy::too_many_arguments)]
    pub fn build(
        layer: &MoeLayer,
        hidden: &[f32],
        routing: &Routing,
        gs1: &[f32],
        gs2: &[f32],
        map: Option<&ExpertMap>,
        layout: ScaleLayout,
        ids: IdSpace,
    ) -> Result<Inputs> {
        let c = &layer.config;
        let (h, i, e, k, t) = (
            c.hidden_size,
            c.moe_intermediate_size,
            c.n_routed_experts,
            routing.top_k,
            routing.tokens,
        );
        layer.validate()?;
        crate::moe::forward::check_routing(layer, routing, t)?;
        if hidden.len() != t * h {
            return Err(Error::usage(format!(
                "plugin inputs: {} hidden values for {t} tokens x {h}",
                hidden.len()
            )));
        }
        if gs1.len() != e || gs2.len() != e {
            return Err(Error::usage(format!(
                "plugin inputs: {} gs1 / {} gs2 values for {e} experts",
                gs1.len(),
                gs2.len()
            )));
        }
        if let Some(x) = layer
            .experts
            .iter()
            .find(|x| x.w1.weight.format != Format::Nvfp4)
        {
            return Err(Error::usage(format!(
                "--kernel runs NVFP4 plugins; this layer's experts are {}",
                x.w1.weight.format.name()
            )));
        }
        let (local_to_global, expert_map): (Vec<usize>, Vec<i32>) = match map {
            Some(m) => (m.local_to_global().to_vec(), m.expert_map().to_vec()),
            None => ((0..e).collect(), (0..e as i32).collect()),
        };
        let n_local = local_to_global.len();
        let mut codes: [Vec<u8>; 3] = Default::default();
        let mut scales: [Vec<u8>; 3] = Default::default();
        let mut scale_2: [Vec<f32>; 3] = Default::default();
        for &g in &local_to_global {
            let x = &layer.experts[g];
            for (j, q) in [&x.w1, &x.w3, &x.w2].into_iter().enumerate() {
                let w = &q.weight;
                codes[j].extend_from_slice(&w.packed);
                match layout {
                    ScaleLayout::Linear => scales[j].extend_from_slice(&w.scales),
                    ScaleLayout::Swizzled => {
                        scales[j].extend(swizzle(&w.scales, w.rows, w.cols / 16))
                    }
                }
                scale_2[j].push(w.scale_2);
            }
        }
        let topk_ids: Vec<i32> = routing
            .topk_ids
            .iter()
            .map(|&g| match ids {
                IdSpace::Global => g,
                IdSpace::Local => expert_map[g as usize],
            })
            .collect();
        let args = MoeArgs {
            abi_version: ABI_VERSION,
            struct_size: std::mem::size_of::<MoeArgs>() as u32,
            tokens: t as i64,
            hidden: h as i64,
            intermediate: i as i64,
            num_experts: e as i64,
            num_local_experts: n_local as i64,
            top_k: k as i64,
            swiglu_limit: c.swiglu_limit.unwrap_or(0.0),
            has_swiglu_limit: i32::from(c.swiglu_limit.is_some()),
            hidden_states: 0,
            a1_gscale: 0,
            a2_gscale: 0,
            w1: 0,
            w3: 0,
            w2: 0,
            w1_scale: 0,
            w3_scale: 0,
            w2_scale: 0,
            scale_layout: match layout {
                ScaleLayout::Linear => 0,
                ScaleLayout::Swizzled => 1,
            },
            output_dtype: 0,
            w1_scale_2: 0,
            w3_scale_2: 0,
            w2_scale_2: 0,
            topk_ids: 0,
            topk_weights: 0,
            expert_map: 0,
            id_convention: match ids {
                IdSpace::Global => 0,
                IdSpace::Local => 1,
            },
            ep_rank: map.map_or(0, |m| m.ep_rank as i32),
            ep_size: map.map_or(1, |m| m.ep_size as i32),
            reserved0: 0,
            output: 0,
            workspace: 0,
            workspace_bytes: 0,
        };
        Ok(Inputs {
            args,
            hidden_bf16: hidden
                .iter()
                .map(|&v| half::bf16::from_f32(v).to_bits())
                .collect(),
            a1_gscale: local_to_global.iter().map(|&g| gs1[g]).collect(),
            a2_gscale: local_to_global.iter().map(|&g| gs2[g]).collect(),
            codes,
            scales,
            scale_2,
            topk_ids,
            expert_map,
            local_to_global,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn args_layout_has_no_hidden_padding() {
        // the header orders fields so that a C compiler inserts no padding: the Rust struct is
        // the plain sum of its fields (tests/plugin_cli.rs checks offsets against cc)
        assert_eq!(
            std::mem::size_of::<MoeArgs>(),
            8 + 6 * 8 + 8 + 9 * 8 + 8 + 6 * 8 + 4 * 4 + 3 * 8
        );
    }

    #[test]
    fn inputs_are_laid_out_as_the_header_says() {
        use crate::moe::ep::Placement;
        use crate::moe::synthetic::{Preset, SyntheticModel};
        use crate::nvfp4::layout::swizzled_len;
        let seed: u64 = rand::random();
        let m = SyntheticModel::new(Preset::Tiny, seed);
        let layer = m.moe_layer(1).unwrap();
        let (x, ids) = m.activations(1, 6, seed);
        let r = crate::moe::route(&layer, &x, Some(&ids)).unwrap();
        let c = &layer.config;
        let (h, i, e) = (c.hidden_size, c.moe_intermediate_size, c.n_routed_experts);
        let gs1: Vec<f32> = (0..e).map(|v| 100.0 + v as f32).collect();
        let gs2: Vec<f32> = (0..e).map(|v| 200.0 + v as f32).collect();
        let map = ExpertMap::new(e, 1, 3, Placement::RoundRobin).unwrap();
        for (layout, space) in [
            (ScaleLayout::Swizzled, IdSpace::Local),
            (ScaleLayout::Linear, IdSpace::Global),
        ] {
            let inp = Inputs::build(&layer, &x, &r, &gs1, &gs2, Some(&map), layout, space).unwrap();
            let l2g = map.local_to_global();
            assert_eq!(inp.local_to_global, l2g);
            assert_eq!(inp.args.num_local_experts as usize, l2g.len());
            assert_eq!((inp.args.ep_rank, inp.args.ep_size), (1, 3));
            assert_eq!(
                inp.args.scale_layout,
                (layout == ScaleLayout::Swizzled) as i32
            );
            assert_eq!(inp.args.id_convention, (space == IdSpace::Local) as i32);
            assert_eq!(inp.expert_map, map.expert_map());
            let per_scales = match layout {
                ScaleLayout::Linear => i * h / 16,
                ScaleLayout::Swizzled => swizzled_len(i, h / 16),
            };
            for (l, &g) in l2g.iter().enumerate() {
                let w1 = &layer.experts[g].w1.weight;
                assert_eq!(
                    inp.codes[0][l * i * h / 2..(l + 1) * i * h / 2],
                    w1.packed[..]
                );
                let sc = &inp.scales[0][l * per_scales..(l + 1) * per_scales];
                match layout {
                    ScaleLayout::Linear => assert_eq!(sc, &w1.scales[..]),
                    ScaleLayout::Swizzled => assert_eq!(sc, &swizzle(&w1.scales, i, h / 16)[..]),
                }
                assert_eq!(inp.scale_2[2][l], layer.experts[g].w2.weight.scale_2);
                assert_eq!((inp.a1_gscale[l], inp.a2_gscale[l]), (gs1[g], gs2[g]));
            }
            for (&handed, &g) in inp.topk_ids.iter().zip(&r.topk_ids) {
                let want = match space {
                    IdSpace::Global => g,
                    IdSpace::Local => map.local(g as i64).map_or(-1, |v| v as i32),
                };
                assert_eq!(handed, want, "seed {seed}");
            }
            assert_eq!(inp.hidden_bf16.len(), x.len());
        }
    }

    #[test]
    fn a_missing_file_is_named() {
        let e = Plugin::load(Path::new("/nonexistent/x.so")).unwrap_err();
        assert!(e.to_string().contains("/nonexistent/x.so"), "{e}");
    }
}
