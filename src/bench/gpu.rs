//! The figures on the GPU. Each runner prepares its data (generated on the GPU, or on the host
//! with the fast generators of `synth`), times one region with `timer`, checks the output it
//! timed (finite, the planted NaN found, ...) and records a [`Measured`]. Out of memory or a
//! missing GPU library ends the whole bench (exit 2); any other error fails just its figure.

use super::figure::{Measured, Spec, Unit, Work};
use super::plan::{self, Selection};
use super::stats::{rotation_sets, Samples};
use super::timer::{self, TimeCfg};
use crate::backend::cuda::blas;
use crate::backend::cuda::device::{driver_err, quietly, Gpu, KArg};
use crate::backend::cuda::nvrtc::BENCH;
use crate::backend::cuda::quant::{enqueue_quantize_nvfp4, DevFp4, DevRows};
use crate::backend::cuda::reduce::{amax_into, CompareScratch};
use crate::error::{Error, Result};
use crate::nvfp4::layout::ScaleLayout;
use crate::nvfp4::Flavor;
use cudarc::driver::{result as drv, sys as drv_sys, CudaSlice, DeviceRepr, LaunchConfig};
use serde::Serialize;
use serde_json::{json, Map, Value};
use std::sync::Arc;

/// The device the bench ran on.
#[derive(Clone, Debug, Serialize)]
pub struct DeviceInfo {
    pub device: String,
    pub name: String,
    pub arch: String,
    pub multiprocessors: i32,
    pub l2_bytes: u64,
    pub memory_bytes: u64,
    pub driver_version: Option<i32>,
}

impl DeviceInfo {
    pub fn of(gpu: &Gpu) -> Result<DeviceInfo> {
        use drv_sys::CUdevice_attribute::*;
        let ctx = gpu.stream.context();
        let attr = |a| {
            ctx.attribute(a)
                .map_err(|e| driver_err("reading a device attribute", "-", e))
        };
        let driver_version = quietly(|| {
            let mut v = 0i32;
            unsafe { drv_sys::cuDriverGetVersion(&mut v) }
                .result()
                .ok()
                .map(|_| v)
        })
        .ok()
        .flatten();
        Ok(DeviceInfo {
            device: gpu.describe(),
            name: gpu.name.clone(),
            arch: gpu.arch.clone(),
            multiprocessors: attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
            l2_bytes: attr(CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)?.max(0) as u64,
            memory_bytes: gpu.mem_info()?.1 as u64,
            driver_version,
        })
    }
}

/// Errors that end the bench instead of one figure: the GPU is too small or not usable.
fn fatal(e: &Error) -> bool {
    matches!(e, Error::GpuOom { .. } | Error::NoGpu(_))
}

const THREADS: u32 = 256;
/// The L2 is flushed between decode repeats by reading this many bytes (at least; 4 L2s).
const FLUSH_MIN_BYTES: u64 = 256 << 20;
/// Elements of each tensor of the reduction figures (256 MB of f32).
const REDUCE_ELEMS: usize = 64 << 20;

fn grid(items: u64, max_blocks: u64) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (
            items.div_ceil(THREADS as u64).clamp(1, max_blocks) as u32,
            1,
            1,
        ),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn fill_bytes<T>(gpu: &Gpu, s: &CudaSlice<T>, seed: u64) -> Result<()> {
    let n = s.num_bytes() as u64;
    gpu.launch(
        &BENCH,
        "bench_fill_bytes",
        grid(n / 8 + 8, 8192),
        &[KArg::U64(gpu.ptr(s)), KArg::U64(n), KArg::U64(seed)],
    )
}

pub(super) fn fill_bf16(gpu: &Gpu, s: &CudaSlice<u16>, amp: f32, seed: u64) -> Result<()> {
    gpu.launch(
        &BENCH,
        "bench_fill_bf16",
        grid(s.len() as u64, 8192),
        &[
            KArg::U64(gpu.ptr(s)),
            KArg::U64(s.len() as u64),
            KArg::U64(seed),
            KArg::F32(amp),
        ],
    )
}

pub(super) fn fill_f32(gpu: &Gpu, s: &CudaSlice<f32>, amp: f32, seed: u64) -> Result<()> {
    gpu.launch(
        &BENCH,
        "bench_fill_f32",
        grid(s.len() as u64, 8192),
        &[
            KArg::U64(gpu.ptr(s)),
            KArg::U64(s.len() as u64),
            KArg::U64(seed),
            KArg::F32(amp),
        ],
    )
}

/// The median time of `bench_quantize_traffic` over the rotating inputs of the quantize
/// figure (`n` BF16 values each): the quantizer's bytes moved the way the grid quantizer
/// moves them, with no arithmetic.
fn quantize_traffic(
    gpu: &Gpu,
    cfg: &timer::TimeCfg,
    bufs: &[(CudaSlice<u16>, DevFp4)],
    n: usize,
) -> Result<f64> {
    let groups = (n / 64) as u64;
    let codes = alloc::<u8>(gpu, n / 2, "the traffic kernel's codes")?;
    let scales = alloc::<u8>(gpu, n / 16, "the traffic kernel's scales")?;
    let (c, s) = (gpu.ptr(&codes), gpu.ptr(&scales));
    let samples = timer::time_plain(gpu, cfg, "the quantizer's traffic alone", &mut |i| {
        gpu.launch(
            &BENCH,
            "bench_quantize_traffic",
            grid(groups, u64::MAX),
            &[
                KArg::U64(gpu.ptr(&bufs[i % bufs.len()].0)),
                KArg::U64(groups),
                KArg::U64(c),
                KArg::U64(s),
            ],
        )
    })?;
    Ok(samples.median())
}

/// Rows of the quantize figure's activations the longer run takes, as a multiple.
const LONGER_ROWS: usize = 4;

/// The reference quantizer and the driver's copy of the same bytes at `LONGER_ROWS` times the
/// figure's rows (one input set, itself 4x past the L2): the rate a longer launch streams at,
/// so that what a launch pays once (its ramp-up and drain) separates from what it pays per
/// byte. (quantize ms, copy ms).
fn quantize_longer(
    gpu: &Gpu,
    cfg: &timer::TimeCfg,
    gs: &CudaSlice<f32>,
    (rows, cols): (usize, usize),
    amp: f32,
    seed: u64,
) -> Result<(f64, f64)> {
    let (rows, n) = (LONGER_ROWS * rows, LONGER_ROWS * rows * cols);
    let x = alloc::<u16>(gpu, n, "the longer run's activations")?;
    fill_bf16(gpu, &x, amp, seed)?;
    let out = DevFp4::alloc_nvfp4(gpu, rows, cols, ScaleLayout::Linear)?;
    let what = format!("quantize at {LONGER_ROWS}x the rows");
    let q = timer::time_plain(gpu, cfg, &what, &mut |_| {
        enqueue_quantize_nvfp4(gpu, DevRows::Bf16(&x), gs, Flavor::Reference, &out)
    })?;
    // half the quantizer's bytes, read + written: a prefix of the activations
    let half = (n * 2 + n / 2 + n / 16) / 2;
    let dst = alloc::<u8>(gpu, half, "the longer copy's destination")?;
    let (s, d, cu) = (gpu.ptr(&x), gpu.ptr(&dst), gpu.stream.cu_stream());
    let c = timer::time_plain(gpu, cfg, "copy at the longer run's bytes", &mut |_| {
        unsafe { drv::memcpy_dtod_async(d, s, half, cu) }
            .map_err(|e| driver_err("cuMemcpyDtoDAsync", "-", e))
    })?;
    Ok((q.median(), c.median()))
}

/// The longer run's details: its time, the driver's copy of its bytes, and what it gives
/// against copy_d2d (`copy_gbps`): the longer run's ratio and the marginal one, the extra
/// bytes over the extra time, which no per-launch cost enters.
fn longer_details(
    d: &mut Map<String, Value>,
    bytes: f64,
    ms: f64,
    longer_ms: f64,
    longer_copy_ms: f64,
    copy_gbps: Option<f64>,
) {
    let k = LONGER_ROWS as f64;
    d.insert("longer_rows_factor".into(), json!(LONGER_ROWS));
    d.insert("longer_ms".into(), json!(longer_ms));
    d.insert("longer_copy_same_bytes_ms".into(), json!(longer_copy_ms));
    d.insert(
        "longer_over_copy_same_bytes".into(),
        json!(longer_copy_ms / longer_ms),
    );
    if let Some(g) = copy_gbps {
        // GB/s = bytes / ms / 1e6
        let floor_ms = |b: f64| b / (g * 1e6);
        d.insert(
            "longer_over_copy".into(),
            json!(floor_ms(k * bytes) / longer_ms),
        );
        if longer_ms > ms {
            d.insert(
                "marginal_over_copy".into(),
                json!(floor_ms((k - 1.0) * bytes) / (longer_ms - ms)),
            );
        }
    }
}

/// Set `out` to {0, 0, none, none} for [`scan`].
fn scan_reset(gpu: &Gpu, out: &CudaSlice<u64>) -> Result<()> {
    let p = gpu.ptr(out);
    gpu.fill_raw(p, 16, 0, "the scan counters")?;
    gpu.fill_raw(p + 16, 16, 0xFF, "the scan indices")
}

/// The non-finite scan of `x[..n]` into `out` (reset first).
fn scan(gpu: &Gpu, x: u64, n: u64, out: &CudaSlice<u64>, sms: u64) -> Result<()> {
    gpu.launch(
        &BENCH,
        "bench_nonfinite_scan_f32",
        grid(n.div_ceil(4), sms.max(1) * 8),
        &[KArg::U64(x), KArg::U64(n), KArg::U64(gpu.ptr(out))],
    )
}

pub(super) fn alloc<T: DeviceRepr>(gpu: &Gpu, n: usize, what: &str) -> Result<CudaSlice<T>> {
    gpu.alloc::<T>(n, what)
}

pub(super) fn details(pairs: &[(&str, Value)]) -> Map<String, Value> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect()
}

/// What the bench needs everywhere: the device, the timing settings, the results so far.
pub struct Runner<'a> {
    pub(super) gpu: Arc<Gpu>,
    cfg: TimeCfg,
    quick: bool,
    pub(super) seed: u64,
    info: DeviceInfo,
    sel: &'a Selection,
    progress: &'a mut dyn FnMut(&str),
    pub measured: Vec<Measured>,
    /// Read to evict the L2 between repeats (clean lines: no write-back during the timing).
    flush: Option<(CudaSlice<f32>, CudaSlice<u64>)>,
}

impl<'a> Runner<'a> {
    pub fn new(
        gpu: Arc<Gpu>,
        quick: bool,
        seed: u64,
        sel: &'a Selection,
        progress: &'a mut dyn FnMut(&str),
    ) -> Result<Runner<'a>> {
        let info = DeviceInfo::of(&gpu)?;
        Ok(Runner {
            gpu,
            cfg: TimeCfg::new(quick),
            quick,
            seed,
            info,
            sel,
            progress,
            measured: Vec::new(),
            flush: None,
        })
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    pub fn cfg(&self) -> &TimeCfg {
        &self.cfg
    }

    pub(super) fn say(&mut self, msg: &str) {
        (self.progress)(msg);
    }

    pub(super) fn wants(&self, name: &str) -> bool {
        self.sel.wants(name)
    }

    /// Keep the outcome of one figure; out-of-memory and a missing GPU end the bench.
    pub(super) fn record(&mut self, spec: Spec, r: Result<Samples>) -> Result<()> {
        match r {
            Ok(s) => {
                let v = spec.unit.rate(spec.amount, s.median());
                self.say(&format!(
                    "{}: {v:.1} {} (median {:.4} ms, min {:.4} ms, {} repeats)",
                    spec.name,
                    spec.unit.label(),
                    s.median(),
                    s.min(),
                    s.len()
                ));
                self.measured.push(Measured {
                    spec,
                    outcome: Ok(s),
                });
                Ok(())
            }
            Err(e) if fatal(&e) => Err(e),
            Err(e) => {
                self.say(&format!("{}: FAILED: {e}", spec.name));
                self.measured.push(Measured {
                    spec,
                    outcome: Err(e.to_string()),
                });
                Ok(())
            }
        }
    }

    /// Record the same error for several figures (their shared set-up failed).
    pub(super) fn record_all(&mut self, specs: Vec<Spec>, e: Error) -> Result<()> {
        if fatal(&e) {
            return Err(e);
        }
        for s in specs {
            self.record(s, Err(Error::usage(e.to_string())))?;
        }
        Ok(())
    }

    pub(super) fn spec(&self, name: String, group: &'static str, what: String, unit: Unit) -> Spec {
        Spec {
            name,
            group,
            what,
            unit,
            amount: 0.0,
            work: Work::default(),
            baseline: None,
            details: Map::new(),
        }
    }

    pub(super) fn flush_buffers(&mut self) -> Result<()> {
        if self.flush.is_none() {
            let bytes = FLUSH_MIN_BYTES.max(4 * self.info.l2_bytes);
            let n = (bytes / 4) as usize;
            let x = alloc::<f32>(&self.gpu, n, "the L2 flush buffer")?;
            fill_f32(&self.gpu, &x, 1.0, self.seed ^ 0xF1)?;
            let out = alloc::<u64>(&self.gpu, 4, "the L2 flush counters")?;
            self.flush = Some((x, out));
        }
        Ok(())
    }

    /// Enqueue a read of the flush buffer: evicts the L2 (clean lines) and keeps the GPU busy
    /// while the host enqueues the timed work, so no launch latency lands inside the events.
    pub(super) fn enqueue_flush(&self) -> Result<()> {
        let Some((x, out)) = &self.flush else {
            return Err(Error::usage(
                "internal: the L2 flush buffer was not allocated",
            ));
        };
        scan(
            &self.gpu,
            self.gpu.ptr(x),
            x.len() as u64,
            out,
            self.info.multiprocessors as u64,
        )
    }

    // ---------------------------------------------------------------- floors

    pub fn copy(&mut self) -> Result<()> {
        let bytes: usize = if self.quick { 1 << 30 } else { 2 << 30 };
        let mut spec = self.spec(
            plan::COPY.into(),
            "floors",
            format!(
                "cuMemcpyDtoDAsync of {} MiB; bytes read + written",
                bytes >> 20
            ),
            Unit::GBps,
        );
        spec.amount = 2.0 * bytes as f64;
        spec.work.bytes = spec.amount;
        let gpu = self.gpu.clone();
        let cfg = self.cfg;
        let r = (|| {
            let src = alloc::<u8>(&gpu, bytes, "the copy source")?;
            let dst = alloc::<u8>(&gpu, bytes, "the copy destination")?;
            fill_bytes(&gpu, &src, self.seed)?;
            let (s, d) = (gpu.ptr(&src), gpu.ptr(&dst));
            let cu = gpu.stream.cu_stream();
            let samples = timer::time_plain(&gpu, &cfg, plan::COPY, &mut |_| {
                unsafe { drv::memcpy_dtod_async(d, s, bytes, cu) }
                    .map_err(|e| driver_err("cuMemcpyDtoDAsync", "-", e))
            })?;
            // the copy happened: the last 64 KiB agree
            let tail = bytes - (64 << 10)..bytes;
            let a = download_range(&gpu, &src, tail.clone(), "the copy source")?;
            let b = download_range(&gpu, &dst, tail, "the copy destination")?;
            if a != b {
                return Err(Error::usage("the copy destination differs from the source"));
            }
            Ok(samples)
        })();
        self.record(spec, r)
    }

    pub fn cublas_square(&mut self, m: usize) -> Result<()> {
        let name = plan::cublas_name(m);
        if !self.wants(&name) {
            return Ok(());
        }
        let (mm, m3) = ((m * m) as f64, (m as f64).powi(3));
        let per_set = (m * m * 2 * 3) as u64;
        let sets = rotation_sets(per_set, self.info.l2_bytes, 8);
        let mut spec = self.spec(
            name.clone(),
            "floors",
            format!("cuBLAS GEMM {m}x{m}x{m}, BF16 in and out, FP32 accumulate, random data; {sets} rotating input sets"),
            Unit::TFlops,
        );
        spec.amount = 2.0 * m3;
        spec.work = Work {
            flops: 2.0 * m3,
            bytes: 3.0 * mm * 2.0,
        };
        spec.details = details(&[("m", json!(m)), ("sets", json!(sets))]);
        let gpu = self.gpu.clone();
        // The ceiling after the short warm-up only: with 100 ms of it this GEMM (then FP32 out)
        // read 643 / 661 TFLOP/s at 4096^3 / 8192^3 (s12e) where torch's BF16 GEMMs read 782 /
        // 785 in the same lease; the short warm-up's 762 is the one closer to what the device
        // does, and a ceiling set too high only makes every ratio against it more modest. BF16
        // out since session 37, as torch's: the FP32 output's bytes held it ~4% under torch's
        // rate in the same lease (s37b: 751.9 against 781.5 TFLOP/s).
        let cfg = TimeCfg {
            warmup_ms: 0.0,
            ..self.cfg
        };
        let seed = self.seed;
        let r = (|| {
            let mut bufs = Vec::with_capacity(sets);
            for s in 0..sets {
                let a = alloc::<u16>(&gpu, m * m, "GEMM A")?;
                let b = alloc::<u16>(&gpu, m * m, "GEMM B")?;
                let c = alloc::<u16>(&gpu, m * m, "GEMM C")?;
                fill_bf16(&gpu, &a, 1.0, seed ^ (2 * s as u64 + 1))?;
                fill_bf16(&gpu, &b, 1.0, seed ^ (2 * s as u64 + 2))?;
                bufs.push((gpu.ptr(&a), gpu.ptr(&b), gpu.ptr(&c), a, b, c));
            }
            let samples = timer::time_plain(&gpu, &cfg, &name, &mut |i| {
                let (a, b, c, ..) = &bufs[i % sets];
                blas::gemm_bf16(&gpu, m, m, m, *a, *b, *c, blas::Out::Bf16, "the bench GEMM")
            })?;
            let c = gpu.download(&bufs[0].5, 4096, "the GEMM output")?;
            let c: Vec<f32> = c
                .iter()
                .map(|v| half::bf16::from_bits(*v).to_f32())
                .collect();
            if c.iter().any(|v| !v.is_finite()) || c.iter().all(|v| *v == 0.0) {
                return Err(Error::usage(
                    "the cuBLAS GEMM output is not finite or all zero",
                ));
            }
            Ok(samples)
        })();
        self.record(spec, r)
    }

    // ---------------------------------------------------------------- quantize

    pub fn quantize(&mut self) -> Result<()> {
        let flavors: Vec<Flavor> = [Flavor::Reference, Flavor::CudaFast]
            .into_iter()
            .filter(|f| self.wants(&plan::quantize_name(*f)))
            .collect();
        if flavors.is_empty() {
            return Ok(());
        }
        let (rows, cols) = plan::QUANT_SHAPE;
        let n = rows * cols;
        let bytes = (n * 2 + n / 2 + n / 16) as f64;
        let sets = rotation_sets(bytes as u64, self.info.l2_bytes, 8);
        let amp = 4.0f32;
        // headroom: the largest block scale is 224, nothing saturates at 448
        let gs = 2688.0 / (2.0 * amp);
        let specs: Vec<Spec> = flavors
            .iter()
            .map(|f| {
                let mut s = self.spec(
                    plan::quantize_name(*f),
                    "quantize",
                    format!(
                        "NVFP4 quantize of [{rows}, {cols}] BF16 activations ({} flavor), linear E4M3 scales; bytes = BF16 read + codes and scales written; {sets} rotating input sets",
                        match f {
                            Flavor::Reference => "reference",
                            Flavor::CudaFast => "cuda-fast (rcp.approx.ftz)",
                        }
                    ),
                    Unit::GBps,
                );
                s.amount = bytes;
                s.work.bytes = bytes;
                s.details = details(&[
                    ("rows", json!(rows)),
                    ("cols", json!(cols)),
                    ("gs", json!(gs)),
                    ("sets", json!(sets)),
                ]);
                s
            })
            .collect();
        let gpu = self.gpu.clone();
        let prepared = (|| {
            let gs_dev = gpu.upload(&[gs], "the global scale")?;
            let mut v = Vec::with_capacity(sets);
            for s in 0..sets {
                let x = alloc::<u16>(&gpu, n, "the activations")?;
                fill_bf16(&gpu, &x, amp, self.seed ^ (0x51 + s as u64))?;
                let out = DevFp4::alloc_nvfp4(&gpu, rows, cols, ScaleLayout::Linear)?;
                v.push((x, out));
            }
            Ok((gs_dev, v))
        })();
        let (gs_dev, bufs) = match prepared {
            Ok(p) => p,
            Err(e) => return self.record_all(specs, e),
        };
        // The copy floor at this size: a kernel moving 150 MB pays its ramp-up and tail, which
        // the 2 GiB copy_d2d spreads over 28x the bytes. cuMemcpyDtoDAsync of half the bytes
        // (read + written = the quantizer's), from one input set into the next (none with a
        // single set: source and destination would overlap).
        let cfg = self.cfg;
        let same_copy = (sets > 1)
            .then(|| {
                timer::time_plain(&gpu, &cfg, "copy at the quantizer's bytes", &mut |i| {
                    let (s, d) = (&bufs[i % sets].0, &bufs[(i + 1) % sets].0);
                    let (s, d) = (gpu.ptr(s), gpu.ptr(d));
                    let cu = gpu.stream.cu_stream();
                    unsafe { drv::memcpy_dtod_async(d, s, bytes as usize / 2, cu) }
                        .map_err(|e| driver_err("cuMemcpyDtoDAsync", "-", e))
                })
            })
            .and_then(|r| r.ok())
            .map(|s| s.median());
        // and a kernel with the quantizer's reads and writes but none of its arithmetic
        let traffic = quantize_traffic(&gpu, &cfg, &bufs, n).ok();
        let longer = flavors
            .contains(&Flavor::Reference)
            .then(|| quantize_longer(&gpu, &cfg, &gs_dev, (rows, cols), amp, self.seed ^ 0x5F).ok())
            .flatten();
        let copy_gbps = super::figure::copy_gbps(&self.measured);
        for (flavor, mut spec) in flavors.into_iter().zip(specs) {
            let r = (|| {
                let samples = timer::time_plain(&gpu, &cfg, &spec.name, &mut |i| {
                    let (x, out) = &bufs[i % sets];
                    enqueue_quantize_nvfp4(&gpu, DevRows::Bf16(x), &gs_dev, flavor, out)
                })?;
                if let Some(c) = same_copy {
                    spec.details.insert("copy_same_bytes_ms".into(), json!(c));
                    spec.details
                        .insert("over_copy_same_bytes".into(), json!(c / samples.median()));
                }
                if let Some(c) = traffic {
                    spec.details.insert("traffic_only_ms".into(), json!(c));
                    spec.details
                        .insert("over_traffic_only".into(), json!(c / samples.median()));
                }
                if let (Some((q, c)), Flavor::Reference) = (longer, flavor) {
                    longer_details(&mut spec.details, bytes, samples.median(), q, c, copy_gbps);
                }
                for (_, out) in &bufs {
                    let st = out.block_stats(&gpu)?;
                    if st.nan_scales > 0 || st.blocks == 0 || st.saturated > 0 {
                        return Err(Error::usage(format!(
                            "the quantized activations look wrong: {} blocks, {} NaN scales, {} saturated",
                            st.blocks, st.nan_scales, st.saturated
                        )));
                    }
                }
                Ok(samples)
            })();
            self.record(spec, r)?;
        }
        Ok(())
    }

    // ---------------------------------------------------------------- reductions

    pub fn reductions(&mut self) -> Result<()> {
        let n = REDUCE_ELEMS;
        let gpu = self.gpu.clone();
        let cfg = self.cfg;
        let sms = self.info.multiprocessors as u64;
        if self.wants(plan::REDUCE_COMPARE) {
            let sets = rotation_sets((2 * n * 4) as u64, self.info.l2_bytes, 4);
            let mut spec = self.spec(
                plan::REDUCE_COMPARE.into(),
                "reduce",
                format!("compare (cosine, rel-L2, SQNR, max abs err, NaN/Inf counts; deterministic two-pass f64 reduction) of two [{n}] f32 tensors; bytes = both read; {sets} rotating input sets"),
                Unit::GBps,
            );
            spec.amount = (2 * n * 4) as f64;
            spec.work.bytes = spec.amount;
            spec.details = details(&[("elements", json!(n)), ("sets", json!(sets))]);
            let r = (|| {
                let scratch = CompareScratch::new(&gpu, n)?;
                let mut bufs = Vec::with_capacity(sets);
                for s in 0..sets {
                    let t = alloc::<f32>(&gpu, n, "the test tensor")?;
                    let r = alloc::<f32>(&gpu, n, "the reference tensor")?;
                    fill_f32(&gpu, &t, 1.0, self.seed ^ (0xC0 + 2 * s as u64))?;
                    fill_f32(&gpu, &r, 1.0, self.seed ^ (0xC1 + 2 * s as u64))?;
                    bufs.push((t, r));
                }
                let samples = timer::time_plain(&gpu, &cfg, plan::REDUCE_COMPARE, &mut |i| {
                    let (t, r) = &bufs[i % sets];
                    scratch.enqueue(&gpu, t, r)
                })?;
                let m = scratch.metrics(&gpu)?;
                // independent uniform tensors: cosine near 0, rel-L2 near sqrt(2)
                if m.nan_count != 0 || !m.cosine.is_finite() || m.cosine.abs() > 0.01 {
                    return Err(Error::usage(format!(
                        "the comparison of independent random tensors gave cosine {}, {} NaN",
                        m.cosine, m.nan_count
                    )));
                }
                Ok(samples)
            })();
            self.record(spec, r)?;
        }
        let want_scan = self.wants(plan::REDUCE_NAN_SCAN);
        let want_amax = self.wants(plan::REDUCE_AMAX);
        if !(want_scan || want_amax) {
            return Ok(());
        }
        // one NaN and one Inf planted; both scans must find them
        let (p_nan, p_inf) = (n / 3 + 7, n / 5 + 3);
        let prepared = (|| {
            let x = alloc::<f32>(&gpu, n, "the scanned tensor")?;
            fill_f32(&gpu, &x, 1.0, self.seed ^ 0x5CA)?;
            plant(&gpu, &x, p_nan, f32::NAN)?;
            plant(&gpu, &x, p_inf, f32::INFINITY)?;
            Ok(x)
        })();
        let x = match prepared {
            Ok(x) => x,
            Err(e) => {
                let mut specs = Vec::new();
                if want_scan {
                    specs.push(self.scan_spec(n));
                }
                if want_amax {
                    specs.push(self.amax_spec(n));
                }
                return self.record_all(specs, e);
            }
        };
        if want_scan {
            let spec = self.scan_spec(n);
            let r = (|| {
                let out = alloc::<u64>(&gpu, 4, "the scan result")?;
                let samples = timer::time(
                    &gpu,
                    &cfg,
                    plan::REDUCE_NAN_SCAN,
                    &mut |_| scan_reset(&gpu, &out),
                    &mut |_| scan(&gpu, gpu.ptr(&x), n as u64, &out, sms),
                )?;
                let got = gpu.download(&out, 4, "the scan result")?;
                let want = [1, 1, p_nan as u64, p_inf as u64];
                if got != want {
                    return Err(Error::usage(format!(
                        "the non-finite scan found {got:?} (NaN count, Inf count, first NaN, first Inf), planted {want:?}"
                    )));
                }
                Ok(samples)
            })();
            self.record(spec, r)?;
        }
        if want_amax {
            let spec = self.amax_spec(n);
            let r = (|| {
                let out = alloc::<u32>(&gpu, 1, "the amax")?;
                let samples = timer::time(
                    &gpu,
                    &cfg,
                    plan::REDUCE_AMAX,
                    &mut |_| gpu.fill_raw(gpu.ptr(&out), 4, 0, "the amax"),
                    &mut |_| amax_into(&gpu, gpu.ptr(&x), n as u64, gpu.ptr(&out)),
                )?;
                let got = gpu.download(&out, 1, "the amax")?;
                if got.first() != Some(&0x7FC0_0000) {
                    return Err(Error::usage(format!(
                        "amax of a tensor with a planted NaN gave bits {got:#x?}, expected the NaN 0x7fc00000"
                    )));
                }
                Ok(samples)
            })();
            self.record(spec, r)?;
        }
        Ok(())
    }

    fn scan_spec(&self, n: usize) -> Spec {
        let mut s = self.spec(
            plan::REDUCE_NAN_SCAN.into(),
            "reduce",
            format!("non-finite scan (NaN and Inf counts, first index of each) of [{n}] f32, 16-byte loads; bytes = the tensor read"),
            Unit::GBps,
        );
        s.amount = (n * 4) as f64;
        s.work.bytes = s.amount;
        s.details = details(&[("elements", json!(n))]);
        s
    }

    fn amax_spec(&self, n: usize) -> Spec {
        let mut s = self.spec(
            plan::REDUCE_AMAX.into(),
            "reduce",
            format!("NaN-propagating amax of [{n}] f32 (kernels/reduce.cu amax_f32, the dynamic-gs pass); bytes = the tensor read"),
            Unit::GBps,
        );
        s.amount = (n * 4) as f64;
        s.work.bytes = s.amount;
        s.details = details(&[("elements", json!(n))]);
        s
    }
}

/// Write one value at element `idx` of `s`.
fn plant(gpu: &Gpu, s: &CudaSlice<f32>, idx: usize, v: f32) -> Result<()> {
    if idx >= s.len() {
        return Err(Error::usage("internal: planted value out of range"));
    }
    gpu.upload_raw(&[v], gpu.ptr(s) + 4 * idx as u64, 1, "a planted value")?;
    gpu.sync("planting a value")
}

/// Elements `range` of `s`, back on the host (waits for the stream).
fn download_range<T: DeviceRepr + Clone + Default>(
    gpu: &Gpu,
    s: &CudaSlice<T>,
    range: std::ops::Range<usize>,
    what: &str,
) -> Result<Vec<T>> {
    if range.end > s.len() || range.start > range.end {
        return Err(Error::usage(format!(
            "internal: {what}: range out of bounds"
        )));
    }
    gpu.sync(&format!("the work before copying {what} back"))?;
    let v = gpu
        .stream
        .clone_dtoh(&s.slice(range))
        .map_err(|e| driver_err(&format!("copying {what} back"), "-", e))?;
    gpu.sync(&format!("copying {what} back"))?;
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longer_run_separates_the_per_launch_cost_from_the_rate() {
        // a kernel of 4 us per launch plus bytes at 0.95 of a 4000 GB/s copy
        let (g, bytes, k) = (4000.0, 150e6, LONGER_ROWS as f64);
        let at = |b: f64| 0.004 + b / (0.95 * g * 1e6);
        let mut d = Map::new();
        longer_details(&mut d, bytes, at(bytes), at(k * bytes), 0.5, Some(g));
        let num = |k: &str| d[k].as_f64().unwrap();
        assert!((num("marginal_over_copy") - 0.95).abs() < 1e-9);
        let longer = k * bytes / (g * 1e6) / at(k * bytes);
        assert!((num("longer_over_copy") - longer).abs() < 1e-12 && longer < 0.95);
        assert!((num("longer_over_copy_same_bytes") - 0.5 / at(k * bytes)).abs() < 1e-12);
        assert_eq!(num("longer_rows_factor"), k);
        // without the copy figure, no ratio against it
        let mut d = Map::new();
        longer_details(&mut d, bytes, 1.0, 2.0, 1.5, None);
        assert!(!d.contains_key("marginal_over_copy") && d.contains_key("longer_ms"));
    }
}
