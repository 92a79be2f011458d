//! `bench`: how fast is the GPU path, against what this GPU can do? Times the floors (copy
//! bandwidth, cuBLAS BF16 GEMM), NVFP4 quantization, the grouped NVFP4 GEMMs at DeepSeek-V3
//! expert shapes (with a cuBLAS BF16 baseline), the GPU reductions and the whole MoE layer,
//! each against its floor. A benchmark, not a test: the verdict fails only when a run errors.

use super::common::OutArgs;
use crate::backend::DeviceRequest;
use crate::bench::{self, Figure, Outcome, Unit};
use crate::error::{Error, Result};
use crate::report::{Report, Section, Verdict};
use serde_json::{json, Map, Value};

#[derive(clap::Args, Debug)]
#[command(
    after_help = "Each figure: the median (and min) of many repeats timed with CUDA events \
after a warm-up of at least 100 ms (25 ms with --quick) of its own repeats, so that the clocks \
settle under its load (the cuBLAS ceilings: a few repeats, the higher reading), with inputs rotated through sets larger than the L2 (or the L2 flushed between \
repeats). Its floor is max(FLOPs / BF16 rate, bytes / copy bandwidth), both ceilings measured \
in the same run on this GPU, each before the figures it bounds (cuBLAS BF16 GEMM at 4096^3 and 8192^3, device-to-device copy counting bytes read + \
written); achieved/floor = floor / median (1 = speed of light). Bytes count each input read once \
and each output written once. The copy and the 4096^3 GEMM always run. Exit 0 unless a figure \
failed (1); no GPU or out of memory: 2."
)]
pub struct Args {
    /// cuda or cuda:N: the GPU to time (bench has nothing to time on the CPU)
    #[arg(long, value_name = "DEVICE", default_value = "cuda")]
    pub device: DeviceRequest,
    /// Fewer repeats and no 8192^3 GEMM (about a minute instead of two or three)
    #[arg(long)]
    pub quick: bool,
    /// Only these figures: names, groups (floors, quantize, gemm, reduce, layer) or name
    /// prefixes (gemm_decode), comma-separated
    #[arg(long, value_name = "NAME,...", value_delimiter = ',')]
    pub only: Option<Vec<String>>,
    #[command(flatten)]
    pub out_args: OutArgs,
}

pub fn run(args: &Args) -> Result<Report> {
    let ordinal = match args.device {
        DeviceRequest::Cpu => {
            return Err(Error::usage(
                "bench times the GPU kernels; --device cpu has nothing to time (run it on a \
                 GPU machine, --device cuda[:N])",
            ))
        }
        DeviceRequest::Auto => 0,
        DeviceRequest::Cuda(n) => n,
    };
    let quiet = args.out_args.quiet;
    let mut progress = |msg: &str| {
        if !quiet {
            eprintln!("bench: {msg}");
        }
    };
    let opts = bench::Options {
        ordinal,
        quick: args.quick,
        only: args.only.clone(),
    };
    let o = bench::run(&opts, &mut progress).map_err(|e| match e {
        Error::NoGpu(m) => Error::NoGpu(format!(
            "{m} (nvfp4dbg bench is a GPU benchmark: run it where cuda:{ordinal} is usable)"
        )),
        Error::GpuOom { step, what, advice } => Error::GpuOom {
            step,
            advice,
            what: format!(
                "{what} (the bench needs about 35 GB of GPU memory at its peak: a DeepSeek-V3 \
                 layer in NVFP4 and, for the cuBLAS baseline, its experts in BF16; \
                 --only floors,quantize,reduce needs under 5 GB)"
            ),
        },
        other => other,
    })?;
    Ok(report(&o))
}

fn ms(v: f64) -> String {
    if v < 0.1 {
        format!("{v:.4}")
    } else if v < 10.0 {
        format!("{v:.3}")
    } else {
        format!("{v:.1}")
    }
}

fn rate(v: f64, unit: Unit) -> String {
    match unit {
        Unit::GBps => format!("{v:.0} GB/s"),
        Unit::TFlops => format!("{v:.1} TFLOP/s"),
    }
}

fn opt(v: Option<f64>, f: impl Fn(f64) -> String) -> String {
    v.map_or_else(|| "-".into(), f)
}

fn short(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_string()
    } else {
        format!("{}…", s.chars().take(n).collect::<String>())
    }
}

fn group_title(g: &str) -> &'static str {
    match g {
        "floors" => "Floors: device-to-device copy and cuBLAS BF16 GEMM (the ceilings of every ratio)",
        "quantize" => "NVFP4 quantize of 8192x7168 BF16 activations",
        "gemm" => "Grouped NVFP4 GEMMs at DeepSeek-V3 expert shapes (H 7168, I 2048, 256 experts, top-8) and cuBLAS BF16 on the same problem",
        "reduce" => "GPU reductions over 64M f32",
        "layer" => "The whole MoE layer at DeepSeek-V3 dims (router, sort, quantize, GEMMs, shared expert, combine)",
        _ => "Other",
    }
}

fn section(group: &str, figs: &[&Figure]) -> Section {
    let mut s = Section::new(
        group_title(group),
        &[
            "figure",
            "median ms",
            "min ms",
            "rate",
            "vs ceiling",
            "floor ms",
            "bound",
            "achieved/floor",
            "note",
        ],
    );
    for f in figs {
        let same_copy = f
            .details
            .get("over_copy_same_bytes")
            .and_then(|v| v.as_f64());
        let note = match (&f.error, f.speedup_vs_cublas_bf16, same_copy) {
            (Some(e), _, _) => format!("FAILED: {}", short(e, 60)),
            (None, Some(x), _) => format!("{x:.2}x cuBLAS BF16"),
            (None, None, Some(r)) => {
                let num = |k: &str| f.details.get(k).and_then(|v| v.as_f64());
                match (num("longer_over_copy"), num("longer_rows_factor")) {
                    (Some(l), Some(k)) => {
                        format!("{r:.2} of a copy of its bytes; {l:.2} of copy at {k}x the rows")
                    }
                    _ => format!("{r:.2} of a copy of its bytes"),
                }
            }
            _ => String::new(),
        };
        s.row(vec![
            f.name.clone(),
            opt(f.median_ms, ms),
            opt(f.min_ms, ms),
            opt(f.value, |v| rate(v, f.unit)),
            opt(f.ratio, |r| {
                format!(
                    "{r:.2} of {}",
                    if f.unit == Unit::GBps { "copy" } else { "BF16" }
                )
            }),
            opt(f.floor_ms, ms),
            f.floor_bound
                .map_or_else(|| "-".into(), |b| format!("{b:?}").to_lowercase()),
            opt(f.achieved_over_floor, |r| format!("{r:.2}")),
            note,
        ]);
    }
    s
}

fn report(o: &Outcome) -> Report {
    let failed: Vec<&str> = o
        .figures
        .iter()
        .filter(|f| f.error.is_some())
        .map(|f| f.name.as_str())
        .collect();
    let n = o.figures.len();
    let floors = match &o.floors {
        Some(f) => format!(
            "copy {:.0} GB/s, cuBLAS BF16 {:.1} TFLOP/s",
            f.copy_gbps, f.bf16_tflops
        ),
        None => "floors unavailable (a floor figure failed)".into(),
    };
    let headline = if failed.is_empty() {
        let layer = o
            .figures
            .iter()
            .rfind(|f| f.group == "layer" && f.median_ms.is_some())
            .map(|f| {
                format!(
                    "; {} {} ms ({} of floor)",
                    f.name,
                    opt(f.median_ms, ms),
                    opt(f.achieved_over_floor, |r| format!("{r:.2}"))
                )
            })
            .unwrap_or_default();
        format!(
            "{n} figures in {:.0} s on {}: {floors}{layer}",
            o.seconds, o.device.device
        )
    } else {
        format!(
            "{} of {n} figures failed ({}) on {}; {floors}",
            failed.len(),
            failed.join(", "),
            o.device.device
        )
    };
    let verdict = Verdict::from_pass(failed.is_empty());
    let at_floor: Map<String, Value> = o
        .figures
        .iter()
        .map(|f| (f.name.clone(), json!(f.achieved_over_floor)))
        .collect();
    let mut r = Report::new("bench", verdict, headline)
        .summary(json!({
            "figures": n,
            "failed": failed.len(),
            "failed_figures": failed,
            "seconds": o.seconds,
            "device": o.device.device,
            "quick": o.settings.quick,
            "copy_gbps": o.floors.map(|f| f.copy_gbps),
            "bf16_tflops": o.floors.map(|f| f.bf16_tflops),
            "achieved_over_floor": at_floor,
        }))
        .with("device", &o.device)
        .with("floors", o.floors)
        .with("settings", &o.settings)
        .with("results", &o.figures);
    let mut device = vec![
        ("device", o.device.device.clone()),
        ("multiprocessors", o.device.multiprocessors.to_string()),
        ("L2", format!("{} MiB", o.device.l2_bytes >> 20)),
        (
            "memory",
            format!(
                "{:.1} GiB",
                o.device.memory_bytes as f64 / (1u64 << 30) as f64
            ),
        ),
    ];
    if let Some(v) = o.device.driver_version {
        device.push((
            "driver (CUDA API)",
            format!("{}.{}", v / 1000, (v % 1000) / 10),
        ));
    }
    device.push(("ceilings", floors));
    r = r.section(Section::kv("Device", &device));
    for g in bench::plan::GROUPS {
        let figs: Vec<&Figure> = o.figures.iter().filter(|f| f.group == g).collect();
        if !figs.is_empty() {
            r = r.section(section(g, &figs));
        }
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::figure::{assemble, floors_from, Measured, Spec, Work};
    use crate::bench::stats::Samples;
    use crate::bench::{plan, DeviceInfo, Settings};
    use rand::{Rng, SeedableRng};

    /// Every figure of the catalogue with random times (one of them failed, optionally).
    fn outcome(seed: u64, fail: Option<&str>) -> Outcome {
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let measured: Vec<Measured> = plan::catalog(false)
            .into_iter()
            .map(|(name, group)| {
                let unit = if name.starts_with("cublas_bf16_") && !name.contains("experts") {
                    Unit::TFlops
                } else {
                    Unit::GBps
                };
                let work = Work {
                    flops: r.gen_range(1e9..1e12),
                    bytes: r.gen_range(1e6..1e10),
                };
                let amount = if unit == Unit::TFlops {
                    work.flops
                } else {
                    work.bytes
                };
                let outcome = if fail == Some(name.as_str()) {
                    Err("CUDA error during kernel launch (kernel `k`): boom".to_string())
                } else {
                    Ok(Samples::new((0..7).map(|_| r.gen_range(0.05..5.0)).collect()).unwrap())
                };
                Measured {
                    spec: Spec {
                        baseline: name
                            .starts_with("gemm_decode_")
                            .then(|| name.replace("gemm_decode_", "cublas_bf16_experts_")),
                        name,
                        group,
                        what: "test".into(),
                        unit,
                        amount,
                        work,
                        details: Default::default(),
                    },
                    outcome,
                }
            })
            .collect();
        let floors = floors_from(&measured);
        Outcome {
            device: DeviceInfo {
                device: "cuda:0 (Test GPU, sm_90a)".into(),
                name: "Test GPU".into(),
                arch: "sm_90a".into(),
                multiprocessors: 132,
                l2_bytes: 60 << 20,
                memory_bytes: 141 << 30,
                driver_version: Some(13000),
            },
            figures: assemble(&measured, floors.as_ref()),
            floors,
            settings: Settings {
                quick: false,
                warmup: 3,
                warmup_ms: 100.0,
                min_reps: 10,
                max_reps: 300,
                budget_ms_per_figure: 1500.0,
                seed: 1,
                selected: vec![],
            },
            seconds: 12.5,
        }
    }

    #[test]
    fn the_report_has_every_figure_in_json_and_on_the_terminal() {
        let seed: u64 = rand::random();
        let o = outcome(seed, None);
        let rep = report(&o);
        assert_eq!(rep.verdict, Verdict::Pass, "seed {seed}");
        let j = rep.to_json();
        assert_eq!(j["command"], "bench");
        assert_eq!(j["verdict"], "pass");
        assert!(j["summary"]["copy_gbps"].as_f64().unwrap() > 0.0);
        assert!(j["summary"]["bf16_tflops"].as_f64().unwrap() > 0.0);
        assert_eq!(j["summary"]["failed"], 0);
        let results = j["results"].as_array().unwrap();
        assert_eq!(results.len(), plan::catalog(false).len());
        let text = rep.to_terminal();
        for r in results {
            let n = r["name"].as_str().unwrap();
            assert!(text.contains(n), "seed {seed}: {n} not in the table");
            for k in [
                "value",
                "median_ms",
                "min_ms",
                "floor_ms",
                "achieved_over_floor",
                "ratio",
            ] {
                let v = r[k].as_f64().unwrap_or(f64::NAN);
                assert!(v.is_finite() && v > 0.0, "seed {seed}: {n}.{k} = {}", r[k]);
            }
            assert!(r["error"].is_null());
            assert!(j["summary"]["achieved_over_floor"][n].is_number(), "{n}");
        }
        let d = results
            .iter()
            .find(|r| r["name"] == "gemm_decode_8")
            .unwrap();
        assert!(d["speedup_vs_cublas_bf16"].as_f64().unwrap() > 0.0);
        assert!(text.contains("x cuBLAS BF16"), "{text}");
        assert!(text.contains("PASS: 22 figures"), "{text}");
        assert_eq!(j["device"]["l2_bytes"], 60 << 20);
        assert!(rep.to_markdown().contains("| gemm_prefill_4096 |"));
    }

    #[test]
    fn a_failed_figure_fails_the_verdict_and_is_named() {
        let seed: u64 = rand::random();
        let rep = report(&outcome(seed, Some("layer_16_graph")));
        assert_eq!(rep.verdict, Verdict::Fail);
        let j = rep.to_json();
        assert_eq!(j["summary"]["failed"], 1);
        assert_eq!(j["summary"]["failed_figures"][0], "layer_16_graph");
        let r = j["results"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["name"] == "layer_16_graph")
            .unwrap();
        assert!(r["error"].as_str().unwrap().contains("boom"));
        assert!(r["value"].is_null() && r["median_ms"].is_null());
        assert!(rep.to_terminal().contains("FAILED: CUDA error"));
        assert!(rep.headline.contains("layer_16_graph"), "{}", rep.headline);
        // a failed floor leaves the ratios empty and says so
        let rep = report(&outcome(seed, Some("copy_d2d")));
        let j = rep.to_json();
        assert!(j["floors"].is_null());
        assert!(j["results"][3]["ratio"].is_null());
        assert!(
            rep.headline.contains("floors unavailable"),
            "{}",
            rep.headline
        );
    }
}
