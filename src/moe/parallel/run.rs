//! EP ranks on devices: one backend (context) and one thread per GPU, rank r on device
//! `r % devices` (so N ranks also run on one GPU, or on the CPU), and the all-reduce of their
//! partial outputs: NCCL across two or more GPUs, else a host sum in fixed rank order.

use super::{
    effective_per_slot, plan_rank, rank_layer, stats_minus, stats_plus, sum_in_rank_order, EpFault,
    Placement, RankPlan,
};
use crate::backend::cpu::CpuBackend;
use crate::backend::cuda::{nccl, CudaBackend};
use crate::backend::{Backend, DeviceRequest};
use crate::error::{Error, Result};
use crate::metrics::Metrics;
use crate::moe::ep::check::{self, Expectations, Finding, IdSpace, Ids};
use crate::moe::ep::ExpertMap;
use crate::moe::{ActScales, MoeLayer, Path, Routing};
use crate::nvfp4::{BlockStats, Flavor};
use serde::Serialize;
use std::cell::OnceCell;

/// `--ep-reduce`: how the partial outputs are summed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum ReduceMode {
    /// NCCL when the ranks span two or more GPUs and libnccl loads, else the host
    #[default]
    Auto,
    /// Always on the host, in rank order
    Host,
    /// NCCL; an error when it cannot be used
    Nccl,
}

/// What an EP run shards and how.
#[derive(Clone, Copy, Debug)]
pub struct EpRequest {
    pub size: usize,
    pub placement: Placement,
    pub reduce: ReduceMode,
    pub fault: Option<EpFault>,
}

enum Devices {
    Cpu(CpuBackend),
    Cuda(Vec<CudaBackend>),
}

/// The devices the ranks run on.
pub struct EpDevices {
    // first: fields drop in order, and the NCCL communicators must go before the contexts
    comms: OnceCell<std::result::Result<nccl::Comms, String>>,
    devices: Devices,
    /// `--device` was not given and no GPU was usable: the CPU runs instead.
    pub fell_back_to_cpu: bool,
}

impl EpDevices {
    /// Open the devices of `ranks` ranks: the CPU, or `gpus` GPUs (default: every GPU the
    /// driver sees, at most one per rank) starting at `--device cuda:D`: device j is
    /// `cuda:((D + j) mod visible)`.
    pub fn open(req: &DeviceRequest, ranks: usize, gpus: Option<usize>) -> Result<EpDevices> {
        if ranks == 0 {
            return Err(Error::usage("--ep must be at least 1"));
        }
        let cuda_start = match req {
            DeviceRequest::Cpu => None,
            DeviceRequest::Cuda(d) => Some(*d),
            DeviceRequest::Auto => CudaBackend::probe().ok().map(|_| 0),
        };
        let Some(start) = cuda_start else {
            if let Some(g) = gpus {
                return Err(Error::usage(format!(
                    "--ep-gpus {g} spreads ranks over GPUs: it needs --device cuda (the CPU backend runs every rank itself)"
                )));
            }
            return Ok(EpDevices {
                devices: Devices::Cpu(CpuBackend::new()),
                fell_back_to_cpu: *req == DeviceRequest::Auto,
                comms: OnceCell::new(),
            });
        };
        let first = CudaBackend::open(start)?;
        let visible = if ranks > 1 || gpus.is_some_and(|g| g > 1) {
            nccl::visible_gpus()?
        } else {
            1
        };
        let want = match gpus {
            Some(0) => return Err(Error::usage("--ep-gpus must be at least 1")),
            Some(g) if g > visible => {
                return Err(Error::usage(format!(
                    "--ep-gpus {g}: the driver sees {visible} GPU(s)"
                )))
            }
            Some(g) => g,
            None => visible,
        }
        .min(ranks)
        .max(1);
        let mut list = vec![first];
        for j in 1..want {
            list.push(CudaBackend::open((start + j) % visible.max(1))?);
        }
        Ok(EpDevices {
            devices: Devices::Cuda(list),
            fell_back_to_cpu: false,
            comms: OnceCell::new(),
        })
    }

    pub fn len(&self) -> usize {
        match &self.devices {
            Devices::Cpu(_) => 1,
            Devices::Cuda(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Device `j` as a backend.
    fn backend(&self, j: usize) -> Option<&(dyn Backend + Sync)> {
        match &self.devices {
            Devices::Cpu(c) => (j == 0).then_some(c as &(dyn Backend + Sync)),
            Devices::Cuda(v) => v.get(j).map(|c| c as &(dyn Backend + Sync)),
        }
    }

    /// The device of rank 0: routing, the reference and the unsharded run go there.
    pub fn main(&self) -> &dyn Backend {
        match &self.devices {
            Devices::Cpu(c) => c,
            Devices::Cuda(v) => match v.first() {
                Some(c) => c,
                None => unreachable_cpu(),
            },
        }
    }

    /// GPU device `j`, when the ranks run on GPUs.
    fn cuda(&self, j: usize) -> Option<&CudaBackend> {
        match &self.devices {
            Devices::Cpu(_) => None,
            Devices::Cuda(v) => v.get(j),
        }
    }

    /// The GPU of rank 0, when the ranks run on GPUs.
    pub fn cuda_main(&self) -> Option<&CudaBackend> {
        match &self.devices {
            Devices::Cpu(_) => None,
            Devices::Cuda(v) => v.first(),
        }
    }

    /// Device names, in device order.
    pub fn names(&self) -> Vec<String> {
        (0..self.len())
            .filter_map(|j| self.backend(j).map(|b| b.name()))
            .collect()
    }

    /// The device of rank `r`.
    pub fn device_of(&self, r: usize) -> usize {
        r % self.len().max(1)
    }

    fn comms(&self) -> Option<&std::result::Result<nccl::Comms, String>> {
        let Devices::Cuda(v) = &self.devices else {
            return None;
        };
        if v.len() < 2 {
            return None;
        }
        Some(self.comms.get_or_init(|| {
            let gpus: Vec<&crate::backend::cuda::Gpu> =
                v.iter().map(|b| b.gpu().as_ref()).collect();
            nccl::Comms::new(&gpus).map_err(|e| e.to_string())
        }))
    }
}

/// A CPU stand-in for the impossible case of a CUDA device list without devices (open()
/// always puts one there); never reached, but never a panic either.
fn unreachable_cpu() -> &'static CpuBackend {
    static CPU: CpuBackend = CpuBackend;
    &CPU
}

/// How the partial outputs were summed.
#[derive(Clone, Debug, Serialize)]
pub struct ReduceInfo {
    /// `host` (rank order) or `nccl`.
    pub method: String,
    /// Devices the ranks ran on.
    pub devices: usize,
    pub nccl_version: Option<String>,
    pub nccl_library: Option<String>,
    /// Why the host summed (NCCL unusable), or an environment override.
    pub note: Option<String>,
    /// Every GPU holds the same sum after the all-reduce.
    pub consistent_across_gpus: Option<bool>,
    /// Largest difference of the NCCL sum from the host sum in rank order (both are sums of
    /// the same partials; only the order differs).
    pub nccl_vs_host_max_abs_diff: Option<f64>,
}

/// One rank's result.
#[derive(Clone, Debug)]
pub struct RankOutput {
    pub plan: RankPlan,
    pub device: String,
    /// Its partial output `[T, hidden]`.
    pub partial: Vec<f32>,
    /// Its activation blocks (the null expert's taken out).
    pub act_stats: BlockStats,
    per_slot: Option<Vec<f32>>,
}

impl RankOutput {
    pub fn rank(&self) -> usize {
        self.plan.map.ep_rank
    }
}

/// The sharded NVFP4 forward.
#[derive(Clone, Debug)]
pub struct EpOutput {
    /// The all-reduced output `[T, hidden]`.
    pub out: Vec<f32>,
    pub act_stats: BlockStats,
    /// `[T*K, hidden]`: what the run effectively used for each slot (0 where nobody computed it).
    pub per_slot: Option<Vec<f32>>,
    pub ranks: Vec<RankOutput>,
    pub reduce: ReduceInfo,
}

/// What every rank needs.
struct Job<'a> {
    layer: &'a MoeLayer,
    hidden: &'a [f32],
    routing: &'a Routing,
    scales: &'a ActScales,
    flavor: Flavor,
    per_slot: bool,
}

fn run_rank(backend: &dyn Backend, job: &Job, plan: RankPlan) -> Result<RankOutput> {
    let rl = rank_layer(job.layer, &plan, job.routing, job.scales, job.hidden)?;
    let path = Path::Nvfp4 {
        scales: &rl.scales,
        flavor: job.flavor,
    };
    let o = backend.moe_forward(&rl.layer, job.hidden, &rl.routing, &path, job.per_slot)?;
    let act_stats = stats_minus(&o.act_stats, &rl.null_stats(job.hidden));
    Ok(RankOutput {
        plan,
        device: backend.name(),
        partial: o.out,
        act_stats,
        per_slot: o.per_slot,
    })
}

/// Run `plans` (rank order) on their devices: one thread per device, a device's ranks in
/// rank order.
fn run_ranks(dev: &EpDevices, job: &Job, plans: Vec<RankPlan>) -> Result<Vec<RankOutput>> {
    let n_dev = dev.len().max(1);
    let mut per_dev: Vec<Vec<RankPlan>> = (0..n_dev).map(|_| vec![]).collect();
    for p in plans {
        let d = dev.device_of(p.map.ep_rank);
        per_dev[d].push(p);
    }
    // plain Sync references: EpDevices itself (with its NCCL handles) stays on this thread
    let mut devices: Vec<(&(dyn Backend + Sync), Option<&CudaBackend>)> = vec![];
    for d in 0..n_dev {
        let b = dev
            .backend(d)
            .ok_or_else(|| Error::usage(format!("internal: no EP device {d}")))?;
        devices.push((b, dev.cuda(d)));
    }
    let devices = &devices;
    let run_device = |d: usize, plans: Vec<RankPlan>| -> Result<Vec<RankOutput>> {
        let (backend, cuda) = devices[d];
        if let Some(c) = cuda {
            // a fresh thread has no current context; raw driver calls need one
            c.gpu().stream.context().bind_to_thread().map_err(|e| {
                crate::backend::cuda::device::driver_err("binding the GPU to its EP thread", "-", e)
            })?;
        }
        plans
            .into_iter()
            .map(|p| run_rank(backend, job, p))
            .collect()
    };
    let run_device = &run_device;
    let results: Vec<Result<Vec<RankOutput>>> = if n_dev == 1 {
        per_dev
            .into_iter()
            .enumerate()
            .map(|(d, p)| run_device(d, p))
            .collect()
    } else {
        std::thread::scope(|s| {
            let handles: Vec<_> = per_dev
                .into_iter()
                .enumerate()
                .map(|(d, p)| (d, s.spawn(move || run_device(d, p))))
                .collect();
            handles
                .into_iter()
                .map(|(d, h)| {
                    h.join().unwrap_or_else(|_| {
                        Err(Error::usage(format!(
                            "internal: the thread of EP device {d} panicked"
                        )))
                    })
                })
                .collect()
        })
    };
    let mut out = vec![];
    for r in results {
        out.extend(r?);
    }
    out.sort_by_key(|r| r.rank());
    Ok(out)
}

/// Sum the partials: NCCL across GPUs (each GPU first sums its own ranks in rank order) or
/// the host in rank order.
fn reduce(
    dev: &EpDevices,
    mode: ReduceMode,
    ranks: &[RankOutput],
) -> Result<(Vec<f32>, ReduceInfo)> {
    let all: Vec<&[f32]> = ranks.iter().map(|r| r.partial.as_slice()).collect();
    let host = || sum_in_rank_order(&all);
    let mut info = ReduceInfo {
        method: "host".into(),
        devices: dev.len(),
        nccl_version: None,
        nccl_library: None,
        note: None,
        consistent_across_gpus: None,
        nccl_vs_host_max_abs_diff: None,
    };
    if mode == ReduceMode::Host {
        return Ok((host(), info));
    }
    let comms = match dev.comms() {
        Some(Ok(c)) => c,
        Some(Err(why)) => {
            if mode == ReduceMode::Nccl {
                return Err(Error::NoGpu(format!("--ep-reduce nccl: {why}")));
            }
            info.note = Some(format!("NCCL unusable, summed on the host: {why}"));
            return Ok((host(), info));
        }
        None => {
            if mode == ReduceMode::Nccl {
                return Err(Error::usage(format!(
                    "--ep-reduce nccl needs the ranks on two or more GPUs; they run on {}",
                    dev.names().join(", ")
                )));
            }
            return Ok((host(), info));
        }
    };
    let Devices::Cuda(backends) = &dev.devices else {
        return Ok((host(), info));
    };
    let gpus: Vec<&crate::backend::cuda::Gpu> = backends.iter().map(|b| b.gpu().as_ref()).collect();
    let per_gpu: Vec<Vec<f32>> = (0..gpus.len())
        .map(|d| {
            let mine: Vec<&[f32]> = ranks
                .iter()
                .filter(|r| dev.device_of(r.rank()) == d)
                .map(|r| r.partial.as_slice())
                .collect();
            sum_in_rank_order(&mine)
        })
        .collect();
    let copies = comms.all_reduce_sum(&gpus, &per_gpu)?;
    let first = copies.first().cloned().unwrap_or_default();
    let consistent = copies
        .iter()
        .all(|c| super::count_differing(c, &first).0 == 0);
    let h = host();
    let diff = first
        .iter()
        .zip(&h)
        .map(|(&a, &b)| (a as f64 - b as f64).abs())
        .fold(0f64, |m, d| if d.is_nan() || d > m { d } else { m });
    info.method = "nccl".into();
    info.nccl_version = Some(comms.version().to_string());
    info.nccl_library = Some(comms.library_path().to_string());
    info.consistent_across_gpus = Some(consistent);
    info.nccl_vs_host_max_abs_diff = Some(diff);
    if let Some(v) = &comms.nvls_override {
        info.note = Some(format!(
            "NCCL_NVLS_ENABLE was {v}; set to 0 (NVLink multicast is never used)"
        ));
    }
    Ok((first, info))
}

/// The NVFP4 forward of `layer` sharded over `req.size` ranks, on `dev`: every rank computes
/// its share for all tokens (with `req.fault`'s flipped id convention when set), the
/// partials are all-reduced. `routing` holds global ids.
#[allow(clippy::too_many_arguments)]
pub fn forward(
    dev: &EpDevices,
    req: &EpRequest,
    layer: &MoeLayer,
    hidden: &[f32],
    routing: &Routing,
    scales: &ActScales,
    flavor: Flavor,
    per_slot: bool,
) -> Result<EpOutput> {
    let e = layer.config.n_routed_experts;
    let maps = ExpertMap::all_ranks(e, req.size, req.placement)?;
    let plans: Vec<RankPlan> = maps
        .into_iter()
        .map(|m| plan_rank(routing, m, req.fault))
        .collect();
    let job = Job {
        layer,
        hidden,
        routing,
        scales,
        flavor,
        per_slot,
    };
    let ranks = run_ranks(dev, &job, plans)?;
    let (out, reduce) = reduce(dev, req.reduce, &ranks)?;
    let act_stats = ranks
        .iter()
        .fold(BlockStats::default(), |a, r| stats_plus(&a, &r.act_stats));
    let per_slot = if per_slot {
        let plans: Vec<&RankPlan> = ranks.iter().map(|r| &r.plan).collect();
        let rows: Vec<&[f32]> = ranks
            .iter()
            .map(|r| r.per_slot.as_deref().unwrap_or(&[]))
            .collect();
        Some(effective_per_slot(&plans, &rows, layer.config.hidden_size))
    } else {
        None
    };
    Ok(EpOutput {
        out,
        act_stats,
        per_slot,
        ranks,
        reduce,
    })
}

/// One rank, for reports.
#[derive(Clone, Debug, Serialize)]
pub struct RankSummary {
    pub rank: usize,
    pub device: String,
    /// The experts it holds: `[8, 16)` or `{e : e % 4 == 1}`.
    pub experts: String,
    pub num_local: usize,
    /// The id convention it was handed, and what its kernel took the ids for.
    pub handed: IdSpace,
    pub taken_as: IdSpace,
    pub slots: super::RankSlots,
    /// Its partial output against its correct share (the clean run's partial), under a fault.
    pub share: Option<Metrics>,
    /// What `routing` finds in the ids this rank was handed, read the way its kernel reads them.
    pub routing_findings: Vec<Finding>,
}

/// Per-rank summaries of `run` (global `routing` of `num_experts` experts); `clean` is the
/// same run with the right convention, to measure each rank's share against.
pub fn summarize_ranks(
    run: &EpOutput,
    clean: Option<&EpOutput>,
    routing: &Routing,
    num_experts: usize,
) -> Vec<RankSummary> {
    let maps: Vec<ExpertMap> = run.ranks.iter().map(|r| r.plan.map.clone()).collect();
    let exp = Expectations {
        num_experts,
        top_k: Some(routing.top_k),
        norm_topk_prob: None,
        routed_scaling_factor: None,
    };
    run.ranks
        .iter()
        .map(|r| {
            let p = &r.plan;
            let ids = Ids {
                tokens: routing.tokens,
                top_k: routing.top_k,
                ids: &p.handed,
                weights: &routing.topk_weights,
            };
            let space = p.convention.taken_as;
            let mut o = check::check_ids(&ids, &exp, space, Some(&p.map));
            o.extend(check::check_ep_ids(&ids, &maps, r.rank(), space).0);
            RankSummary {
                rank: r.rank(),
                device: r.device.clone(),
                experts: p.map.describe_owned(),
                num_local: p.map.num_local(),
                handed: p.convention.handed,
                taken_as: space,
                slots: p.slots.clone(),
                share: clean
                    .and_then(|c| c.ranks.iter().find(|x| x.rank() == r.rank()))
                    .map(|c| crate::metrics::compare(&r.partial, &c.partial)),
                routing_findings: o.findings,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::moe::synthetic::{Preset, SyntheticModel};

    #[test]
    fn cpu_devices_run_every_rank_and_sum_on_the_host() {
        let seed: u64 = rand::random();
        let m = SyntheticModel::new(Preset::Tiny, seed);
        let layer = m.moe_layer(1).unwrap();
        let (x, ids) = m.activations(1, 8, seed);
        let r = crate::moe::route(&layer, &x, Some(&ids)).unwrap();
        let dev = EpDevices::open(&DeviceRequest::Cpu, 4, None).unwrap();
        assert_eq!(dev.len(), 1);
        assert!(dev.cuda_main().is_none());
        let req = EpRequest {
            size: 4,
            placement: Placement::Linear,
            reduce: ReduceMode::Auto,
            fault: None,
        };
        let s = ActScales::Dynamic;
        let o = forward(&dev, &req, &layer, &x, &r, &s, Flavor::Reference, true).unwrap();
        assert_eq!(o.ranks.len(), 4);
        assert_eq!(o.reduce.method, "host");
        assert!(o.ranks.iter().enumerate().all(|(i, rk)| rk.rank() == i));
        assert_eq!(o.per_slot.as_ref().unwrap().len(), r.topk_ids.len() * 256);
        // NCCL cannot be asked for on the CPU
        let req = EpRequest {
            reduce: ReduceMode::Nccl,
            ..req
        };
        let e = forward(&dev, &req, &layer, &x, &r, &s, Flavor::Reference, false).unwrap_err();
        assert!(e.to_string().contains("two or more GPUs"), "{e}");
        // --ep-gpus is for GPUs
        assert!(EpDevices::open(&DeviceRequest::Cpu, 2, Some(2)).is_err());
        assert!(EpDevices::open(&DeviceRequest::Cpu, 0, None).is_err());
    }
}
