//! One benchmark figure: what was timed, the work it must do (FLOPs, bytes), the floor that
//! work implies on this device (METHOD: the larger of FLOPs over the BF16 matrix rate and
//! bytes over the copy bandwidth, both measured here), and achieved/floor.

use super::stats::Samples;
use serde::Serialize;
use serde_json::{Map, Value};

/// The two ceilings, measured on the device by the floor figures.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Floors {
    /// Device-to-device copy, bytes read + written per second, in GB/s (1e9).
    pub copy_gbps: f64,
    /// cuBLAS BF16 GEMM with FP32 accumulation, in TFLOP/s (1e12).
    pub bf16_tflops: f64,
}

/// The least work a figure must do: each input read once, each output written once.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Work {
    pub flops: f64,
    pub bytes: f64,
}

impl std::ops::Add for Work {
    type Output = Work;
    fn add(self, o: Work) -> Work {
        Work {
            flops: self.flops + o.flops,
            bytes: self.bytes + o.bytes,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Bound {
    Memory,
    Compute,
}

/// The fastest the work could run on this device.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Floor {
    pub ms: f64,
    pub bound: Bound,
    /// The formula with its numbers, for humans.
    pub formula: String,
}

/// Milliseconds to move `bytes` at `gbps` GB/s.
pub fn memory_ms(bytes: f64, gbps: f64) -> f64 {
    bytes / (gbps * 1e9) * 1e3
}

/// Milliseconds to do `flops` at `tflops` TFLOP/s.
pub fn compute_ms(flops: f64, tflops: f64) -> f64 {
    flops / (tflops * 1e12) * 1e3
}

/// `max(flops / bf16 rate, bytes / copy bandwidth)`.
pub fn floor(work: Work, floors: &Floors) -> Floor {
    let mem = memory_ms(work.bytes, floors.copy_gbps);
    let cmp = compute_ms(work.flops, floors.bf16_tflops);
    let (ms, bound) = if cmp > mem {
        (cmp, Bound::Compute)
    } else {
        (mem, Bound::Memory)
    };
    let formula = if work.flops > 0.0 {
        format!(
            "max({:.4e} FLOP / {:.1} TFLOP/s, {:.4e} B / {:.0} GB/s) = max({:.4}, {:.4}) ms",
            work.flops, floors.bf16_tflops, work.bytes, floors.copy_gbps, cmp, mem
        )
    } else {
        format!(
            "{:.4e} B / {:.0} GB/s = {:.4} ms",
            work.bytes, floors.copy_gbps, mem
        )
    };
    Floor { ms, bound, formula }
}

/// What a figure's headline number counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Unit {
    /// Bytes per second (1e9); compared with the copy bandwidth.
    #[serde(rename = "GB/s")]
    GBps,
    /// FLOPs per second (1e12); compared with the cuBLAS BF16 rate.
    #[serde(rename = "TFLOP/s")]
    TFlops,
}

impl Unit {
    pub fn label(self) -> &'static str {
        match self {
            Unit::GBps => "GB/s",
            Unit::TFlops => "TFLOP/s",
        }
    }
    /// The rate of `amount` (bytes or FLOPs) done in `ms`.
    pub fn rate(self, amount: f64, ms: f64) -> f64 {
        match self {
            Unit::GBps => amount / (ms * 1e-3) / 1e9,
            Unit::TFlops => amount / (ms * 1e-3) / 1e12,
        }
    }
    /// The device ceiling this unit is compared with.
    pub fn ceiling(self, floors: &Floors) -> f64 {
        match self {
            Unit::GBps => floors.copy_gbps,
            Unit::TFlops => floors.bf16_tflops,
        }
    }
    pub fn ceiling_name(self) -> &'static str {
        match self {
            Unit::GBps => "copy_d2d",
            Unit::TFlops => "cublas_bf16",
        }
    }
}

/// How a figure is defined, before it runs.
#[derive(Clone, Debug)]
pub struct Spec {
    pub name: String,
    pub group: &'static str,
    pub what: String,
    pub unit: Unit,
    /// What the headline rate counts (bytes or FLOPs); may be less than `work` (decode counts
    /// only the FP4 weight bytes).
    pub amount: f64,
    pub work: Work,
    /// The figure this one's speed-up is measured against (same problem, cuBLAS BF16).
    pub baseline: Option<String>,
    pub details: Map<String, Value>,
}

/// A spec and what became of it.
#[derive(Clone, Debug)]
pub struct Measured {
    pub spec: Spec,
    pub outcome: std::result::Result<Samples, String>,
}

/// One row of the results, as the JSON holds it.
#[derive(Clone, Debug, Serialize)]
pub struct Figure {
    pub name: String,
    pub group: &'static str,
    pub what: String,
    pub unit: Unit,
    /// The rate at the median time.
    pub value: Option<f64>,
    /// The rate at the fastest repeat.
    pub value_best: Option<f64>,
    pub median_ms: Option<f64>,
    pub min_ms: Option<f64>,
    pub mean_ms: Option<f64>,
    pub reps: usize,
    pub amount: f64,
    pub flops: f64,
    pub bytes: f64,
    pub floor_ms: Option<f64>,
    pub floor_bound: Option<Bound>,
    pub floor_formula: Option<String>,
    /// `floor_ms / median_ms`: 1 is the speed of light.
    pub achieved_over_floor: Option<f64>,
    /// `value` over the ceiling of its unit (`ratio_to`).
    pub ratio: Option<f64>,
    pub ratio_to: &'static str,
    /// `baseline median / this median` (how much faster than cuBLAS BF16 on the same problem).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub speedup_vs_cublas_bf16: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub baseline: Option<String>,
    pub details: Map<String, Value>,
    pub error: Option<String>,
}

/// A figure's rate at its median time; `None` where it failed.
fn median_rate(m: &Measured) -> Option<f64> {
    m.outcome
        .as_ref()
        .ok()
        .map(|s| m.spec.unit.rate(m.spec.amount, s.median()))
}

/// The copy bandwidth (GB/s), once `copy_d2d` has run.
pub fn copy_gbps(measured: &[Measured]) -> Option<f64> {
    measured
        .iter()
        .find(|m| m.spec.name == super::plan::COPY)
        .and_then(median_rate)
}

/// The ceilings from the floor figures: the copy's median rate, and the best median rate of
/// the cuBLAS BF16 GEMMs. `None` when a floor did not run.
pub fn floors_from(measured: &[Measured]) -> Option<Floors> {
    let copy = copy_gbps(measured)?;
    let square = |name: &str| {
        super::plan::CUBLAS_SIZES
            .iter()
            .any(|m| super::plan::cublas_name(*m) == name)
    };
    let bf16 = measured
        .iter()
        .filter(|m| square(&m.spec.name))
        .filter_map(median_rate)
        .fold(None, |a: Option<f64>, r| Some(a.map_or(r, |a| a.max(r))))?;
    Some(Floors {
        copy_gbps: copy,
        bf16_tflops: bf16,
    })
}

/// Turn measurements into figures: rates, floors, ratios and speed-ups.
pub fn assemble(measured: &[Measured], floors: Option<&Floors>) -> Vec<Figure> {
    let median_of = |name: &str| {
        measured
            .iter()
            .find(|m| m.spec.name == name)
            .and_then(|m| m.outcome.as_ref().ok())
            .map(|s| s.median())
    };
    measured
        .iter()
        .map(|m| {
            let s = &m.spec;
            let ok = m.outcome.as_ref().ok();
            let median = ok.map(|x| x.median());
            let value = median.map(|t| s.unit.rate(s.amount, t));
            let fl = floors.map(|f| floor(s.work, f));
            Figure {
                name: s.name.clone(),
                group: s.group,
                what: s.what.clone(),
                unit: s.unit,
                value,
                value_best: ok.map(|x| s.unit.rate(s.amount, x.min())),
                median_ms: median,
                min_ms: ok.map(|x| x.min()),
                mean_ms: ok.map(|x| x.mean()),
                reps: ok.map_or(0, |x| x.len()),
                amount: s.amount,
                flops: s.work.flops,
                bytes: s.work.bytes,
                achieved_over_floor: match (&fl, median) {
                    (Some(f), Some(t)) => Some(f.ms / t),
                    _ => None,
                },
                floor_ms: fl.as_ref().map(|f| f.ms),
                floor_bound: fl.as_ref().map(|f| f.bound),
                floor_formula: fl.map(|f| f.formula),
                ratio: match (value, floors) {
                    (Some(v), Some(f)) => Some(v / s.unit.ceiling(f)),
                    _ => None,
                },
                ratio_to: s.unit.ceiling_name(),
                speedup_vs_cublas_bf16: match (&s.baseline, median) {
                    (Some(b), Some(t)) => median_of(b).map(|tb| tb / t),
                    _ => None,
                },
                baseline: s.baseline.clone(),
                details: s.details.clone(),
                error: m.outcome.as_ref().err().cloned(),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::plan::{cublas_name, COPY};

    fn spec(name: &str, unit: Unit, amount: f64, work: Work) -> Spec {
        Spec {
            name: name.into(),
            group: "test",
            what: String::new(),
            unit,
            amount,
            work,
            baseline: None,
            details: Map::new(),
        }
    }

    fn ok(ms: &[f64]) -> std::result::Result<Samples, String> {
        Ok(Samples::new(ms.to_vec()).unwrap())
    }

    #[test]
    fn floor_takes_the_larger_of_compute_and_memory() {
        let f = Floors {
            copy_gbps: 4000.0,
            bf16_tflops: 800.0,
        };
        // 8192^3 GEMM: 1.1e12 FLOP -> 1.374 ms; 512 MB -> 0.134 ms
        let w = Work {
            flops: 2.0 * 8192f64.powi(3),
            bytes: 512e6,
        };
        let fl = floor(w, &f);
        assert_eq!(fl.bound, Bound::Compute);
        assert!((fl.ms - 2.0 * 8192f64.powi(3) / 800e12 * 1e3).abs() < 1e-12);
        assert!(fl.formula.contains("TFLOP/s"), "{}", fl.formula);
        // a copy of 4 GB (read + write): 1 ms
        let fl = floor(
            Work {
                flops: 0.0,
                bytes: 4e9,
            },
            &f,
        );
        assert_eq!(fl.bound, Bound::Memory);
        assert!((fl.ms - 1.0).abs() < 1e-12);
        assert!(!fl.formula.contains("FLOP"), "{}", fl.formula);
        assert_eq!(memory_ms(4.3e9, 4300.0), 1.0);
        assert_eq!(compute_ms(7.8e11, 780.0), 1.0);
    }

    #[test]
    fn units_convert_bytes_and_flops() {
        assert!((Unit::GBps.rate(4e9, 1.0) - 4000.0).abs() < 1e-9);
        assert!((Unit::TFlops.rate(1e12, 2.0) - 500.0).abs() < 1e-9);
        assert_eq!(
            serde_json::to_value(Unit::GBps).unwrap(),
            Value::String("GB/s".into())
        );
    }

    #[test]
    fn floors_come_from_the_copy_and_the_best_cublas_gemm() {
        let copy_bytes = 2.0 * (1u64 << 30) as f64;
        let (m4096, m8192) = (cublas_name(4096), cublas_name(8192));
        let flops = |m: f64| 2.0 * m * m * m;
        let ms = vec![
            Measured {
                spec: spec(COPY, Unit::GBps, copy_bytes, Work::default()),
                outcome: ok(&[0.6, 0.5, 0.55]),
            },
            Measured {
                spec: spec(&m4096, Unit::TFlops, flops(4096.0), Work::default()),
                outcome: ok(&[0.2]),
            },
            Measured {
                spec: spec(&m8192, Unit::TFlops, flops(8192.0), Work::default()),
                outcome: ok(&[1.4]),
            },
        ];
        // the per-expert cuBLAS baselines are no ceiling, however fast
        let mut ms = ms;
        ms.push(Measured {
            spec: spec("cublas_bf16_experts_8", Unit::GBps, 1e12, Work::default()),
            outcome: ok(&[0.001]),
        });
        let f = floors_from(&ms).unwrap();
        assert!((f.copy_gbps - copy_bytes / 0.55e-3 / 1e9).abs() < 1e-6);
        let r4 = flops(4096.0) / 0.2e-3 / 1e12;
        let r8 = flops(8192.0) / 1.4e-3 / 1e12;
        assert!((f.bf16_tflops - r4.max(r8)).abs() < 1e-6);
        // without the copy (or any GEMM) there are no floors
        assert!(floors_from(&ms[1..]).is_none());
        assert!(floors_from(&ms[..1]).is_none());
        assert!(floors_from(&[ms[0].clone(), ms[3].clone()]).is_none());
        // a failed GEMM does not count
        let mut broken = ms.clone();
        broken[1].outcome = Err("boom".into());
        let f2 = floors_from(&broken).unwrap();
        assert!((f2.bf16_tflops - r8).abs() < 1e-6);
    }

    #[test]
    fn figures_get_rates_ratios_and_speedups() {
        let floors = Floors {
            copy_gbps: 4000.0,
            bf16_tflops: 800.0,
        };
        let w = Work {
            flops: 1e9,
            bytes: 2e9,
        };
        let mut nv = spec("gemm_decode_8", Unit::GBps, 1.5e9, w);
        nv.baseline = Some("cublas_bf16_experts_8".into());
        let cb = spec("cublas_bf16_experts_8", Unit::GBps, 6e9, w);
        let broken = spec("layer_16_graph", Unit::GBps, 1.0, w);
        let ms = vec![
            Measured {
                spec: nv,
                outcome: ok(&[1.0, 0.9, 1.1]),
            },
            Measured {
                spec: cb,
                outcome: ok(&[3.0, 3.2]),
            },
            Measured {
                spec: broken,
                outcome: Err("CUDA error".into()),
            },
        ];
        let figs = assemble(&ms, Some(&floors));
        let f = &figs[0];
        assert_eq!(f.median_ms, Some(1.0));
        assert_eq!(f.min_ms, Some(0.9));
        assert!((f.value.unwrap() - 1500.0).abs() < 1e-9);
        assert!((f.value_best.unwrap() - 1.5e9 / 0.9e-3 / 1e9).abs() < 1e-9);
        // floor: bytes 2e9 at 4000 GB/s = 0.5 ms > 1e9 FLOP at 800 TFLOP/s
        assert!((f.floor_ms.unwrap() - 0.5).abs() < 1e-12);
        assert_eq!(f.floor_bound, Some(Bound::Memory));
        assert!((f.achieved_over_floor.unwrap() - 0.5).abs() < 1e-12);
        assert!((f.ratio.unwrap() - 1500.0 / 4000.0).abs() < 1e-12);
        assert_eq!(f.ratio_to, "copy_d2d");
        assert!((f.speedup_vs_cublas_bf16.unwrap() - 3.1).abs() < 1e-12);
        assert_eq!(figs[1].speedup_vs_cublas_bf16, None);
        let e = &figs[2];
        assert_eq!(e.error.as_deref(), Some("CUDA error"));
        assert_eq!(e.value, None);
        assert_eq!(e.reps, 0);
        assert!(
            e.floor_ms.is_some(),
            "the floor is known even when the run failed"
        );
        // without floors: rates, no ratios
        let figs = assemble(&ms, None);
        assert!(figs[0].value.is_some() && figs[0].ratio.is_none());
        assert!(figs[0].floor_ms.is_none() && figs[0].achieved_over_floor.is_none());
    }
}
