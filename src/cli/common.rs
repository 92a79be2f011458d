//! Flags every command shares, and the progress bar.

use crate::backend::{self, Backend, DeviceRequest};
use crate::error::Result;
use crate::report::Outputs;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;
use std::path::PathBuf;

#[derive(clap::Args, Debug, Clone)]
pub struct OutArgs {
    /// Write the JSON report (top-level command, verdict, summary, and the command's own keys)
    /// to this path; `-` writes it to stdout and the table to stderr
    #[arg(long, value_name = "PATH")]
    pub json: Option<PathBuf>,
    /// Directory for report.json, report.md and plots
    #[arg(long, value_name = "DIR", default_value = "reports")]
    pub report_dir: PathBuf,
    /// Do not write the report directory
    #[arg(long)]
    pub no_report_dir: bool,
    /// No progress bars
    #[arg(long, short)]
    pub quiet: bool,
}

impl OutArgs {
    pub fn outputs(&self) -> Outputs {
        Outputs {
            json: self.json.clone(),
            report_dir: (!self.no_report_dir).then(|| self.report_dir.clone()),
            quiet: self.quiet,
        }
    }
}

#[derive(clap::Args, Debug, Clone)]
pub struct DeviceArgs {
    /// cpu, cuda or cuda:N (default: cuda:0 when a GPU is usable, else cpu)
    #[arg(long, value_name = "DEVICE", default_value = "auto")]
    pub device: DeviceRequest,
}

impl DeviceArgs {
    /// Open the backend; when the GPU was not asked for explicitly and is missing, say on
    /// stderr that the CPU reference runs instead.
    pub fn open(&self, quiet: bool) -> Result<Box<dyn Backend>> {
        let b = backend::open(&self.device)?;
        if self.device == DeviceRequest::Auto && b.name() == "cpu" && !quiet {
            say_cpu_fallback();
        }
        Ok(b)
    }
}

/// Tell stderr, once a process (`run cases/` opens a device per case), that the CPU
/// reference runs because no GPU was found.
pub fn say_cpu_fallback() {
    static SAID: std::sync::Once = std::sync::Once::new();
    SAID.call_once(|| {
        eprintln!("nvfp4dbg: no usable GPU found; running on the CPU backend (the reference)")
    });
}

/// A cosine threshold (`--min-cosine` and the like): a finite number in [-1, 1]; anything else
/// is a usage error (exit 2) before the command runs.
pub fn cosine(s: &str) -> std::result::Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && (-1.0..=1.0).contains(&v) => Ok(v),
        Ok(_) => Err(format!("{s}: a cosine lies in [-1, 1]")),
        Err(_) => Err(format!("`{s}` is not a number")),
    }
}

/// A cosine loss: finite, in [0, 2] (a cosine moves within [-1, 1]).
pub fn cosine_loss(s: &str) -> std::result::Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && (0.0..=2.0).contains(&v) => Ok(v),
        Ok(_) => Err(format!("{s}: a loss of cosine lies in [0, 2]")),
        Err(_) => Err(format!("`{s}` is not a number")),
    }
}

/// A factor: finite and above 0.
pub fn factor(s: &str) -> std::result::Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        Ok(_) => Err(format!("{s}: a factor is finite and above 0")),
        Err(_) => Err(format!("`{s}` is not a number")),
    }
}

/// The points of a sweep: at least 2 (its two ends).
pub fn sweep_points(s: &str) -> std::result::Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(v) if (2..=1000).contains(&v) => Ok(v),
        Ok(v) if v < 2 => Err(format!("{s}: a sweep has at least 2 points (its two ends)")),
        // each point runs the whole layer
        Ok(_) => Err(format!(
            "{s}: at most 1000 points (each runs the whole layer)"
        )),
        Err(_) => Err(format!("`{s}` is not a whole number")),
    }
}

/// The steps of a long command whose parts have no count of their own (load the layer, run the
/// NVFP4 path, run the reference...): one bar, each [`Steps::next`] naming the step that starts,
/// the clock ticking while a step runs. Cleared when dropped.
pub struct Steps(ProgressBar);

impl Steps {
    pub fn new(len: u64, quiet: bool) -> Steps {
        let pb = progress(len, "", quiet);
        // steps take unequal times: no eta
        if let Ok(st) = ProgressStyle::with_template("[{bar:16}] {pos}/{len} {msg} {elapsed}") {
            pb.set_style(st.progress_chars("=> "));
        }
        pb.enable_steady_tick(std::time::Duration::from_millis(250));
        Steps(pb)
    }

    /// The step before is done; `what` starts.
    pub fn next(&self, what: &str) {
        if !self.0.message().is_empty() {
            self.0.inc(1);
        }
        self.0.set_message(what.to_string());
    }
}

impl Drop for Steps {
    fn drop(&mut self) {
        self.0.finish_and_clear();
    }
}

/// A progress bar on stderr, hidden when stderr is not a terminal or with `--quiet`.
pub fn progress(len: u64, what: &str, quiet: bool) -> ProgressBar {
    let pb = ProgressBar::new(len);
    if quiet
        || !std::io::stderr().is_terminal()
        || std::env::var_os("TERM").is_some_and(|t| t == "dumb")
    {
        pb.set_draw_target(ProgressDrawTarget::hidden());
    }
    let color = std::env::var_os("NO_COLOR").is_none();
    let tmpl = if color {
        "{msg:>12.cyan} [{bar:32}] {pos}/{len} {elapsed_precise} eta {eta}"
    } else {
        "{msg:>12} [{bar:32}] {pos}/{len} {elapsed_precise} eta {eta}"
    };
    if let Ok(st) = ProgressStyle::with_template(tmpl) {
        pb.set_style(st.progress_chars("=> "));
    }
    pb.set_message(what.to_string());
    pb
}
