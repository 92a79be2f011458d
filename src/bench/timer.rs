//! Timing on the GPU with CUDA events (METHOD): warm-up first (module loads, NVRTC, cuBLAS
//! handles stay out of the numbers), then many repeats, each between its own pair of events
//! on the one stream, with an untimed setup step before each (rotating the inputs).

use super::stats::{reps_for, Samples};
use crate::backend::cuda::device::driver_err;
use crate::backend::cuda::Gpu;
use crate::error::Result;
use cudarc::driver::{sys as drv_sys, CudaEvent, CudaGraph};
use std::sync::atomic::Ordering;

/// Repeats and budget of one figure.
#[derive(Clone, Copy, Debug)]
pub struct TimeCfg {
    pub warmup: usize,
    pub min_reps: usize,
    pub max_reps: usize,
    /// Time the repeats of one figure aim to take.
    pub budget_ms: f64,
}

impl TimeCfg {
    pub fn new(quick: bool) -> TimeCfg {
        if quick {
            TimeCfg {
                warmup: 2,
                min_reps: 5,
                max_reps: 40,
                budget_ms: 250.0,
            }
        } else {
            TimeCfg {
                warmup: 3,
                min_reps: 10,
                max_reps: 300,
                budget_ms: 1500.0,
            }
        }
    }
}

fn event(gpu: &Gpu) -> Result<CudaEvent> {
    gpu.stream
        .context()
        .new_event(Some(drv_sys::CUevent_flags::CU_EVENT_DEFAULT))
        .map_err(|e| driver_err("creating a timing event", "-", e))
}

fn record(gpu: &Gpu, ev: &CudaEvent) -> Result<()> {
    ev.record(&gpu.stream)
        .map_err(|e| driver_err("recording a timing event", "-", e))
}

fn elapsed(a: &CudaEvent, b: &CudaEvent) -> Result<f64> {
    a.elapsed_ms(b)
        .map(f64::from)
        .map_err(|e| driver_err("reading a timing event", "-", e))
}

/// Time `body(i)`; `setup(i)` runs before each repeat, outside the events. Warm-up repeats
/// are timed one by one to size the run to the budget, then discarded.
pub fn time(
    gpu: &Gpu,
    cfg: &TimeCfg,
    what: &str,
    setup: &mut dyn FnMut(usize) -> Result<()>,
    body: &mut dyn FnMut(usize) -> Result<()>,
) -> Result<Samples> {
    let (w0, w1) = (event(gpu)?, event(gpu)?);
    let mut estimate = f64::NAN;
    for i in 0..cfg.warmup.max(1) {
        setup(i)?;
        record(gpu, &w0)?;
        body(i)?;
        record(gpu, &w1)?;
        gpu.sync(&format!("warming up {what}"))?;
        estimate = elapsed(&w0, &w1)?;
    }
    let reps = reps_for(cfg.budget_ms, estimate, cfg.min_reps, cfg.max_reps);
    let mut marks = Vec::with_capacity(reps);
    for _ in 0..reps {
        marks.push((event(gpu)?, event(gpu)?));
    }
    for (i, (a, b)) in marks.iter().enumerate() {
        let r = cfg.warmup + i;
        setup(r)?;
        record(gpu, a)?;
        body(r)?;
        record(gpu, b)?;
    }
    gpu.sync(&format!("timing {what}"))?;
    let ms = marks
        .iter()
        .map(|(a, b)| elapsed(a, b))
        .collect::<Result<Vec<f64>>>()?;
    Samples::new(ms)
}

/// Time `body(i)` with no setup.
pub fn time_plain(
    gpu: &Gpu,
    cfg: &TimeCfg,
    what: &str,
    body: &mut dyn FnMut(usize) -> Result<()>,
) -> Result<Samples> {
    time(gpu, cfg, what, &mut |_| Ok(()), body)
}

/// Capture what `enqueue` launches into a CUDA graph (run it once eagerly first, so that
/// module loads and cuBLAS set-up happen outside the capture).
pub fn capture(
    gpu: &Gpu,
    what: &str,
    enqueue: &mut dyn FnMut() -> Result<()>,
) -> Result<CudaGraph> {
    enqueue()?;
    gpu.sync(&format!("the eager run before capturing {what}"))?;
    gpu.capturing.store(true, Ordering::Relaxed);
    let r = (|| {
        gpu.stream
            .begin_capture(drv_sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| driver_err("beginning stream capture", what, e))?;
        let enq = enqueue();
        let graph = gpu
            .stream
            .end_capture(drv_sys::CUgraphInstantiate_flags(0))
            .map_err(|e| driver_err("ending stream capture", what, e));
        enq?;
        graph?.ok_or_else(|| crate::error::Error::Cuda {
            step: "stream capture".into(),
            kernel: what.into(),
            what: "the capture produced no graph".into(),
        })
    })();
    gpu.capturing.store(false, Ordering::Relaxed);
    r
}

/// Launch a captured graph on the stream.
pub fn replay(graph: &CudaGraph, what: &str) -> Result<()> {
    graph
        .launch()
        .map_err(|e| driver_err("replaying a graph", what, e))
}
