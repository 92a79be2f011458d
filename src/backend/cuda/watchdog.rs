//! The hang watchdog of one GPU. CUDA cannot cancel a running kernel, and any blocking call
//! behind one (a synchronize, a copy from pageable memory, the driver's own teardown at exit)
//! waits forever with it. So a thread watches the host's waits for the GPU: each one arms it
//! ([`Watchdog::waiting`]) for as long as it blocks, and one that lasts `limit` is reported
//! with its step and the kernels in flight, and ends the process (exit 2) without running
//! exit handlers (`NVFP4DBG_KERNEL_TIMEOUT_S`, default 600 s). Only blocked time counts: host
//! work between a launch and its wait never fires it.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// `NVFP4DBG_KERNEL_TIMEOUT_S` (default 600 s; the longest wait of a DeepSeek-V3 layer at
/// 4096 tokens is well under a second).
pub(crate) fn limit_from_env() -> Duration {
    std::env::var("NVFP4DBG_KERNEL_TIMEOUT_S")
        .ok()
        .and_then(|v| v.parse::<f64>().ok())
        .filter(|v| *v > 0.0)
        .map_or(Duration::from_secs(600), Duration::from_secs_f64)
}

/// Ends the process at once with `code`: no exit handlers, no destructors. After a hang the
/// CUDA driver's exit-time teardown would wait forever on the kernel that never ends.
pub(crate) fn exit_now(code: i32) -> ! {
    extern "C" {
        fn _exit(status: std::ffi::c_int) -> !;
    }
    // SAFETY: _exit takes any status and never returns.
    unsafe { _exit(code) }
}

/// What the host is waiting for.
struct Wait {
    since: Instant,
    step: String,
    kernels: Vec<&'static str>,
}

#[derive(Default)]
struct State {
    wait: Option<Wait>,
    /// The GPU is gone: the thread ends.
    stopped: bool,
}

pub(crate) struct Watchdog {
    state: Mutex<State>,
    wake: Condvar,
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Fired once a wait has blocked `limit`: (limit, the step, the kernels in flight).
pub(crate) type Fire = Box<dyn FnOnce(Duration, &str, &[&'static str]) + Send>;

/// Armed while it lives ([`Watchdog::waiting`]).
pub(crate) struct Waiting<'a>(&'a Watchdog);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        lock(&self.0.state).wait = None;
        self.0.wake.notify_one();
    }
}

impl Watchdog {
    /// A watchdog whose thread calls `fire` once a wait has blocked for `limit`. Without a
    /// thread (the OS refused one) it never fires: no watchdog, no panic.
    pub(crate) fn start(limit: Duration, fire: Fire) -> Arc<Watchdog> {
        let w = Arc::new(Watchdog {
            state: Mutex::new(State::default()),
            wake: Condvar::new(),
        });
        let watched = w.clone();
        let _ = std::thread::Builder::new()
            .name("nvfp4dbg-watchdog".into())
            .spawn(move || watched.watch(limit, fire));
        w
    }

    /// The host blocks on the GPU for `step`, with `kernels` in flight, until the guard drops.
    pub(crate) fn waiting(&self, step: &str, kernels: Vec<&'static str>) -> Waiting<'_> {
        lock(&self.state).wait = Some(Wait {
            since: Instant::now(),
            step: step.to_string(),
            kernels,
        });
        self.wake.notify_one();
        Waiting(self)
    }

    /// The GPU is released: the thread ends without firing.
    pub(crate) fn stop(&self) {
        lock(&self.state).stopped = true;
        self.wake.notify_one();
    }

    fn watch(&self, limit: Duration, fire: Fire) {
        let mut s = lock(&self.state);
        loop {
            if s.stopped {
                return;
            }
            let since = s.wait.as_ref().map(|w| w.since);
            s = match since {
                None => self.wake.wait(s).unwrap_or_else(|p| p.into_inner()),
                Some(t0) if t0.elapsed() >= limit => {
                    let w = s.wait.take().expect("checked above");
                    drop(s);
                    return fire(limit, &w.step, &w.kernels);
                }
                Some(t0) => {
                    let left = limit.saturating_sub(t0.elapsed());
                    match self.wake.wait_timeout(s, left) {
                        Ok((g, _)) => g,
                        Err(p) => p.into_inner().0,
                    }
                }
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    type Fired = (String, Vec<&'static str>);

    fn watchdog(limit_ms: u64) -> (Arc<Watchdog>, mpsc::Receiver<Fired>) {
        let (tx, rx) = mpsc::channel();
        let fire: Fire = Box::new(move |_, step, k| {
            let _ = tx.send((step.to_string(), k.to_vec()));
        });
        (Watchdog::start(Duration::from_millis(limit_ms), fire), rx)
    }

    #[test]
    fn a_wait_that_blocks_past_the_limit_fires_with_its_step_and_kernels() {
        let (w, rx) = watchdog(50);
        let _blocked = w.waiting(
            "copying the output back",
            vec!["router_topk", "moe_combine"],
        );
        let (step, kernels) = rx.recv_timeout(Duration::from_secs(5)).expect("it fired");
        assert_eq!(step, "copying the output back");
        assert_eq!(kernels, ["router_topk", "moe_combine"]);
    }

    #[test]
    fn only_blocked_time_counts() {
        let (w, rx) = watchdog(150);
        // waits shorter than the limit, host work between them far longer
        for _ in 0..5 {
            drop(w.waiting("a short wait", vec!["moe_combine"]));
            std::thread::sleep(Duration::from_millis(100));
        }
        assert!(rx.recv_timeout(Duration::from_millis(400)).is_err());
        // a wait that blocks: the limit counts from its start
        let _blocked = w.waiting("a long wait", vec!["moe_gemm"]);
        let (step, _) = rx.recv_timeout(Duration::from_secs(5)).expect("it fired");
        assert_eq!(step, "a long wait");
    }

    #[test]
    fn a_stopped_watchdog_never_fires() {
        let (w, rx) = watchdog(50);
        let _blocked = w.waiting("releasing the GPU", vec![]);
        w.stop();
        assert!(rx.recv_timeout(Duration::from_millis(300)).is_err());
    }

    #[test]
    fn the_limit_comes_from_the_environment_or_is_ten_minutes() {
        // read here without setting it (tests run in parallel): the default, or what the
        // runner set
        let l = limit_from_env();
        assert!(l > Duration::ZERO);
        if std::env::var_os("NVFP4DBG_KERNEL_TIMEOUT_S").is_none() {
            assert_eq!(l, Duration::from_secs(600));
        }
    }
}
