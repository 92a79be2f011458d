//! Timing on the GPU with CUDA events (METHOD): warm-up first (module loads, NVRTC, cuBLAS
//! handles stay out of the numbers, and the GPU's clocks settle under the figure's own load),
//! then many repeats, each between its own pair of events on the one stream, with an untimed
//! setup step before each (rotating the inputs).

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
    /// Warm-up repeats continue until they have run this long (ms), as triton's `do_bench`
    /// warms up by time: a figure is timed at the clocks its own load settles to, not those
    /// the figure before it left (the BF16 quantizer right after the cuBLAS ceilings read
    /// 1.2-12.6% slower than its other flavor right after it in s12b-s12d, 0.9-5.9% with this
    /// warm-up in s12e-s12f: BENCHMARKS.md, session 12). What the 8192^3 ceiling leaves
    /// outlasts it (session 13): the bench times that ceiling after the memory-bound figures.
    pub warmup_ms: f64,
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
                warmup_ms: 25.0,
                min_reps: 5,
                max_reps: 40,
                budget_ms: 250.0,
            }
        } else {
            TimeCfg {
                warmup: 3,
                warmup_ms: 100.0,
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

/// Time `body(i)`; `setup(i)` runs before each repeat, outside the events. The first
/// `cfg.warmup` repeats are timed one by one to size the run to the budget, then more run in
/// batches until the warm-up has lasted `cfg.warmup_ms`; all are discarded.
pub fn time(
    gpu: &Gpu,
    cfg: &TimeCfg,
    what: &str,
    setup: &mut dyn FnMut(usize) -> Result<()>,
    body: &mut dyn FnMut(usize) -> Result<()>,
) -> Result<Samples> {
    let (w0, w1) = (event(gpu)?, event(gpu)?);
    let mut estimate = f64::NAN;
    let (mut i, mut warm_ms) = (0, 0.0);
    while i < cfg.warmup.max(1) {
        setup(i)?;
        record(gpu, &w0)?;
        body(i)?;
        record(gpu, &w1)?;
        gpu.sync(&format!("warming up {what}"))?;
        estimate = elapsed(&w0, &w1)?;
        // the first repeat carries the lazy set-up (module loads, handles)
        if i > 0 {
            warm_ms += estimate;
        }
        i += 1;
    }
    while warm_ms < cfg.warmup_ms && estimate > 0.0 {
        let n = warmup_batch(cfg.warmup_ms - warm_ms, estimate);
        record(gpu, &w0)?;
        for _ in 0..n {
            setup(i)?;
            body(i)?;
            i += 1;
        }
        record(gpu, &w1)?;
        gpu.sync(&format!("warming up {what}"))?;
        warm_ms += elapsed(&w0, &w1)?;
    }
    let first = i;
    let reps = reps_for(cfg.budget_ms, estimate, cfg.min_reps, cfg.max_reps);
    let mut marks = Vec::with_capacity(reps);
    for _ in 0..reps {
        marks.push((event(gpu)?, event(gpu)?));
    }
    for (i, (a, b)) in marks.iter().enumerate() {
        let r = first + i;
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

/// Repeats of `estimate_ms` each for `left_ms` more of warm-up (at least 1, at most 10 000).
fn warmup_batch(left_ms: f64, estimate_ms: f64) -> usize {
    (left_ms / estimate_ms).ceil().clamp(1.0, 10_000.0) as usize
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_warmup_batch_covers_what_is_left_within_bounds() {
        assert_eq!(warmup_batch(100.0, 0.045), 2223);
        assert_eq!(warmup_batch(100.0, 8.5), 12);
        assert_eq!(warmup_batch(0.01, 8.5), 1);
        assert_eq!(warmup_batch(100.0, 1e-6), 10_000);
        let (full, quick) = (TimeCfg::new(false), TimeCfg::new(true));
        assert!(full.warmup_ms > quick.warmup_ms && quick.warmup_ms > 0.0);
    }
}
