//! `layertest`: is the MoE kernel math right on this layer? One MoE layer (router, routed
//! experts, shared experts) through the NVFP4 path against the BF16 reference, with the same
//! routing for both.

use super::common::{DeviceArgs, OutArgs, Steps};
use super::expert_check::{ExpertCheck, ExpertVerdict, DEFAULT_MIN_EXPERT_SLOTS};
use super::kernel::{self, KernelArgs};
use crate::backend::cuda::{moe::Nvfp4Forward, CudaBackend};
use crate::backend::{cpu::CpuBackend, Backend};
use crate::checkpoint::writer::{f32_bytes, i64_bytes, write_file, TensorSpec};
use crate::checkpoint::TensorFile;
use crate::error::{Error, Result};
use crate::metrics::Metrics;
use crate::moe::breakdown::{
    expert_input_blocks, per_expert, per_token, worst_first, ExpertMetrics, TokenMetrics,
};
use crate::moe::byok::{dump, routed_sum, Feeding};
use crate::moe::forward::BatchAmax;
use crate::moe::gs::{self, Calibration, GsSource, InputScaleReduce};
use crate::moe::parallel::run::{self as ep, EpDevices, EpOutput, EpRequest, ReduceMode};
use crate::moe::parallel::{self as par, Agreement, EpFault, Placement};
use crate::moe::synthetic::{Preset, SyntheticModel};
use crate::moe::{ActScales, MoeLayer, MoeOutput, Path as MoePath, Routing};
use crate::nvfp4::{BlockStats, Flavor};
use crate::report::{e, f, Report, Section, Verdict};
use safetensors::Dtype;
use serde::Serialize;
use serde_json::json;
use std::path::{Path, PathBuf};

/// Default `--min-cosine` of the layer against the BF16 reference. NVFP4 alone costs ~0.095
/// rel-L2 per quantized tensor, and a fully quantized MoE layer lands near 0.23 rel-L2
/// (cosine ≈ 1 − 0.23²/2 ≈ 0.974). 0.95 (rel-L2 ≈ 0.32, ~1.4x the expected error) passes
/// every healthy layer and fails a broken expert, a wrong gs or a NaN.
pub const DEFAULT_MIN_COSINE: f64 = 0.95;
/// Default `--min-expert-cosine`: one expert's output has two quantized GEMM pairs behind it
/// (rel-L2 ≈ 0.15-0.2, cosine ≈ 0.98); 0.90 (rel-L2 ≈ 0.45) is far outside that, while one
/// broken expert among many barely moves the layer cosine.
pub const DEFAULT_MIN_EXPERT_COSINE: f64 = 0.90;
/// One token's output against the reference: healthy tiny layers keep their worst token at
/// cosine 0.955-0.98 (16 to 4096 tokens, rel-L2 at most 0.31), well above 0.9.
pub const DEFAULT_MIN_TOKEN_COSINE: f64 = 0.90;
/// A correct GPU kernel against the CPU NVFP4 path computes the same function up to FP32
/// summation order (and `rcp` flavor): FlashInfer's kernel tests reach cosine ~0.999 against a
/// quantized reference; with identical quantization we demand 0.99999.
pub const KERNEL_CHECK_MIN_COSINE: f64 = 0.99999;
pub use crate::moe::byok::KERNEL_CHECK_MAX_MACS;

/// Where the layer and its input come from; shared by layertest, gs-sweep and multilayer.
#[derive(clap::Args, Debug, Clone)]
pub struct InputArgs {
    /// HF checkpoint directory (config.json + safetensors). Without it: the built-in synthetic
    /// `tiny` DeepSeek-V3-like model (hidden 256, 16 experts, top-4, seeded by --seed)
    #[arg(long, value_name = "DIR")]
    pub checkpoint: Option<PathBuf>,
    /// Tokens of synthetic input (default 64); with --input: use the first N rows
    #[arg(long, value_name = "T")]
    pub tokens: Option<usize>,
    /// safetensors file with `hidden_states` [T, hidden] (any float dtype) and optional
    /// `input_ids` [T] (needed by V4 hash layers)
    #[arg(long, value_name = "FILE")]
    pub input: Option<PathBuf>,
    /// Seed of the synthetic model and of synthetic activations
    #[arg(long, value_name = "S", default_value_t = 0)]
    pub seed: u64,
}

/// How the activation global scales are chosen.
#[derive(clap::Args, Debug, Clone)]
pub struct GsArgs {
    /// Activation global scale: checkpoint (input_scale), default (1/2688, amax 1), warmup
    /// (randn), calibrated (amax of this batch), dynamic (per batch), or a VALUE (gs, quant
    /// direction). Default: calibrated for layertest and multilayer, `default` for gs-sweep
    #[arg(long, value_name = "SOURCE", allow_negative_numbers = true)]
    pub gs: Option<GsSource>,
    /// per-expert input scales, or the layer-wide max (the smallest gs) for every expert
    #[arg(long, value_enum, value_name = "MODE", default_value = "per-expert")]
    pub input_scale_reduce: InputScaleReduce,
}

impl GsArgs {
    /// The activation scales of `layer` from `source`, calibrated on the batch of `amax` and
    /// its routing (the amax pass, shared with the scale findings).
    pub fn resolve(
        &self,
        source: GsSource,
        layer: &MoeLayer,
        input_ids: Option<&[i64]>,
        amax: &BatchAmax,
        seed: u64,
    ) -> Result<ActScales> {
        let cal = Calibration {
            hidden: amax.hidden(),
            input_ids,
            routing: Some(amax.routing()),
            amax: Some(amax),
        };
        gs::resolve(source, layer, self.input_scale_reduce, &cal, seed)
    }
}

/// Expert parallelism (shared by layertest, gs-sweep and multilayer).
#[derive(clap::Args, Debug, Clone)]
pub struct EpArgs {
    /// Shard the routed experts over N expert-parallel ranks: rank r holds only its experts
    /// (expert_map[global] = local | -1) and computes its share for every token, rank 0 adds the
    /// shared experts, the partial outputs are summed (all-reduce). Rank r runs on GPU r % G, or
    /// all ranks on the CPU. Equals --ep 1 up to FP32 summation order
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub ep: usize,
    /// How experts are spread over EP ranks: linear (contiguous blocks) or round-robin (e % N == r)
    #[arg(long, value_enum, value_name = "P", default_value = "linear")]
    pub placement: Placement,
    /// GPUs the EP ranks spread over, from --device cuda:D on (default: every GPU the driver
    /// sees, at most N)
    #[arg(long, value_name = "G")]
    pub ep_gpus: Option<usize>,
    /// How the partial outputs are summed: nccl (ranks on 2+ GPUs; NCCL_NVLS_ENABLE=0 is set,
    /// NVLink multicast is never used; NVFP4DBG_NCCL_LIB names libnccl.so.2 or its directory),
    /// host (in rank order), auto (nccl when usable, else host)
    #[arg(long, value_enum, value_name = "HOW", default_value = "auto")]
    pub ep_reduce: ReduceMode,
}

impl EpArgs {
    /// The devices: rank 0's is the one routing, the reference and the unsharded run use.
    pub fn open(&self, device: &DeviceArgs, quiet: bool) -> Result<EpDevices> {
        let d = EpDevices::open(&device.device, self.ep, self.ep_gpus)?;
        if d.fell_back_to_cpu && !quiet {
            super::common::say_cpu_fallback();
        }
        if self.ep_reduce == ReduceMode::Nccl && (self.ep < 2 || d.len() < 2) {
            return Err(Error::usage(format!(
                "--ep-reduce nccl needs --ep 2 or more with the ranks on two or more GPUs; \
                 --ep {} runs on {}",
                self.ep,
                d.names().join(", ")
            )));
        }
        Ok(d)
    }

    pub fn sharded(&self) -> bool {
        self.ep > 1
    }

    /// `(ranks, placement)` when sharded: what a plugin layer is split by.
    pub fn shard(&self) -> Option<(usize, Placement)> {
        self.sharded().then_some((self.ep, self.placement))
    }

    pub fn request(&self, fault: Option<EpFault>) -> EpRequest {
        EpRequest {
            size: self.ep,
            placement: self.placement,
            reduce: self.ep_reduce,
            fault,
        }
    }
}

/// The NVFP4 forward of `layer`: sharded over the EP ranks when `--ep` > 1 (with how it was
/// reduced), else on rank 0's device.
#[allow(clippy::too_many_arguments)]
pub fn nvfp4_forward(
    args: &EpArgs,
    dev: &EpDevices,
    layer: &MoeLayer,
    hidden: &[f32],
    routing: &Routing,
    scales: &ActScales,
    per_slot: bool,
) -> Result<(MoeOutput, Option<ep::ReduceInfo>)> {
    if !args.sharded() {
        let path = MoePath::Nvfp4 {
            scales,
            flavor: Flavor::Reference,
        };
        return Ok((
            dev.main()
                .moe_forward(layer, hidden, routing, &path, per_slot)?,
            None,
        ));
    }
    let r = ep::forward(
        dev,
        &args.request(None),
        layer,
        hidden,
        routing,
        scales,
        Flavor::Reference,
        per_slot,
    )?;
    Ok((
        MoeOutput {
            out: r.out,
            act_stats: r.act_stats,
            per_slot: r.per_slot,
        },
        Some(r.reduce),
    ))
}

/// How a sharded output compares with the unsharded run on rank 0's device (that run is
/// made here, with its per-slot rows for the bound).
pub fn check_unsharded(
    dev: &EpDevices,
    layer: &MoeLayer,
    hidden: &[f32],
    routing: &Routing,
    scales: &ActScales,
    sharded_out: &[f32],
) -> Result<Agreement> {
    let path = MoePath::Nvfp4 {
        scales,
        flavor: Flavor::Reference,
    };
    let one = dev
        .main()
        .moe_forward(layer, hidden, routing, &path, true)?;
    par::against_unsharded(sharded_out, &one, routing, layer.config.hidden_size)
}

/// The EP facts every command reports.
pub fn ep_json(args: &EpArgs, dev: &EpDevices, run: Option<&EpOutput>) -> serde_json::Value {
    ep_json_with(args, dev, run.map(|r| &r.reduce))
}

pub fn ep_json_with(
    args: &EpArgs,
    dev: &EpDevices,
    reduce: Option<&ep::ReduceInfo>,
) -> serde_json::Value {
    json!({
        "size": args.ep,
        "placement": args.placement,
        "devices": dev.names(),
        "reduce": reduce,
    })
}

/// A failure line when an EP output leaves the FP32-summation-order bound around `--ep 1`.
pub fn ep_disagreement(args: &EpArgs, a: &Agreement, hidden: usize, what: &str) -> Option<String> {
    (!a.within_bound).then(|| {
        format!(
            "EP {} ({}) {what} differs from the unsharded (--ep 1) run beyond FP32 summation order: \
             {} of {} values outside the bound, max |Δ| {} at {} ({}x the bound)",
            args.ep,
            args.placement.name(),
            a.outside_bound,
            a.len,
            e(a.max_abs_diff),
            at(a.max_abs_diff_index, hidden),
            e(a.max_bound_ratio)
        )
    })
}

#[derive(clap::Args, Debug)]
#[command(
    after_help = "Thresholds: --min-cosine 0.95 against the BF16 reference (a healthy \
fully quantized MoE layer reaches ~0.974, i.e. ~0.23 rel-L2; NVFP4 alone costs ~0.095 rel-L2 per \
tensor); --min-expert-cosine 0.90 for each expert's own output, and rel-L2 <= 0.484 \
(sqrt(1/0.9^2 - 1): an output off by a factor keeps its cosine), over at least --min-expert-slots 3 \
token slots; below, the bar ramps from cosine 0.7 (rel-L2 1.02) on one slot (healthy single slots \
reach 0.78), an expert between its bar and --min-expert-cosine is too few tokens to judge; an \
expert whose output norm is off its reference's by more than 1.75x either way fails whatever its \
slots (healthy single slots stay within 0.68-1.48x; a scale off by 2 lands near 2x); on a GPU, the kernel must match \
the CPU NVFP4 path at cosine 0.99999. Any NaN/Inf fails. With --ep N the sharded output must \
equal the unsharded (--ep 1) one up to FP32 summation order: |ep - ep1| <= 2*g_K*(2*sum|w*y| + \
|out_ep1|)/(1 - g_K) elementwise, g_K = K*u/(1 - K*u), u = 2^-24 (only the order of the combine sum \
changes); --fault flips the expert-id convention on every rank and the report names the ranks that \
silently dropped tokens. --cuda-graph: the graph replay must equal the eager run bit for bit."
)]
pub struct Args {
    #[command(flatten)]
    pub input: InputArgs,
    /// MoE layer index (default: the first MoE layer)
    #[arg(long, value_name = "L")]
    pub layer: Option<usize>,
    #[command(flatten)]
    pub gs: GsArgs,
    /// Fail below this cosine of the layer output against the BF16 reference
    #[arg(long, value_name = "C", default_value_t = DEFAULT_MIN_COSINE, value_parser = super::common::cosine, allow_negative_numbers = true)]
    pub min_cosine: f64,
    /// Fail when one expert's own output falls below this cosine, or its rel-L2 exceeds
    /// sqrt(1/C^2 - 1) (an output off by a factor keeps its cosine)
    #[arg(long, value_name = "C", default_value_t = DEFAULT_MIN_EXPERT_COSINE, value_parser = super::common::cosine, allow_negative_numbers = true)]
    pub min_expert_cosine: f64,
    /// Judge an expert by --min-expert-cosine over at least N token slots: with fewer, NVFP4
    /// noise on one or two tokens reaches that bar, and the expert's bar ramps from cosine 0.7
    /// on one slot up to it (between the two: too few tokens to judge). 1 judges every expert
    /// by --min-expert-cosine
    #[arg(long, value_name = "N", default_value_t = DEFAULT_MIN_EXPERT_SLOTS)]
    pub min_expert_slots: usize,
    /// Fail when one token's output falls below this cosine, or its rel-L2 exceeds
    /// sqrt(1/C^2 - 1): the layer's cosine is dominated by its tokens of largest norm, and one
    /// token of huge norm (the MoE input is normalized per token: its RMSNorm skipped or broken) carries it past wrong others
    #[arg(long, value_name = "C", default_value_t = DEFAULT_MIN_TOKEN_COSINE, value_parser = super::common::cosine, allow_negative_numbers = true)]
    pub min_token_cosine: f64,
    /// Write nvfp4_out, reference_out (F32 [T, hidden]), topk_ids (I64 [T, K]) and
    /// topk_weights (F32 [T, K]) to this safetensors file
    #[arg(long, value_name = "FILE")]
    pub save_outputs: Option<PathBuf>,
    #[command(flatten)]
    pub ep: EpArgs,
    /// Run the EP ranks with the expert-id convention flipped as buggy engines did (needs
    /// --ep 2 or more): local-ids (handed local ids, taken for global: tokens silently dropped)
    /// or global-ids (handed global ids, used as local indices: wrong or missing experts)
    #[arg(long, value_enum, value_name = "FAULT")]
    pub fault: Option<EpFault>,
    /// Write each EP rank's routing dump (the topk_ids it was handed, topk_weights,
    /// hidden_states, input_ids; metadata ep_rank, ep_size, placement, ids) to DIR/rank{r}.safetensors,
    /// for `nvfp4dbg routing`
    #[arg(long, value_name = "DIR")]
    pub save_routing: Option<PathBuf>,
    /// Capture the NVFP4 layer forward in a CUDA graph, replay it and compare the replay with
    /// the eager run bit for bit (CUDA backend only; with --ep, the unsharded layer on rank 0's
    /// GPU)
    #[arg(long)]
    pub cuda_graph: bool,
    #[command(flatten)]
    pub kernel: KernelArgs,
    /// Write exactly what an MoE kernel of kernels/include/nvfp4dbg_moe.h receives
    /// (DIR/inputs.safetensors: the header's fields as tensors, its scalars as metadata) and what
    /// it must produce (DIR/expected.safetensors), for kernels that cannot be wrapped in a
    /// plugin: run yours on them and judge its output with `nvfp4dbg compare-outputs DIR FILE`.
    /// One rank holding every expert (global ids, identity expert_map), fixed --gs only; not
    /// with --ep
    #[arg(long, value_name = "DIR")]
    pub dump_inputs: Option<PathBuf>,
    #[command(flatten)]
    pub device: DeviceArgs,
    #[command(flatten)]
    pub out_args: OutArgs,
}

// ---------------------------------------------------------------------------------------
// Shared with gs-sweep and multilayer: the model, the input batch.

/// The model a command runs on.
pub enum Model {
    Synthetic(SyntheticModel),
    Checkpoint {
        dir: PathBuf,
        ckpt: Box<crate::checkpoint::MoeCheckpoint>,
    },
}

impl Model {
    pub fn open(input: &InputArgs) -> Result<Model> {
        match &input.checkpoint {
            None => Ok(Model::Synthetic(SyntheticModel::new(
                Preset::Tiny,
                input.seed,
            ))),
            Some(dir) => Ok(Model::Checkpoint {
                dir: dir.clone(),
                ckpt: Box::new(crate::checkpoint::MoeCheckpoint::open(dir)?),
            }),
        }
    }

    /// Indices of the MoE layers.
    pub fn moe_layers(&self) -> Vec<usize> {
        match self {
            Model::Synthetic(m) => {
                (m.config.first_k_dense_replace..m.config.num_hidden_layers).collect()
            }
            Model::Checkpoint { ckpt, .. } => ckpt.moe_layers(),
        }
    }

    /// Is `l` an MoE layer an engine runs? Bad input naming why not (for a checkpoint: no
    /// expert tensors, or config.json's `first_k_dense_replace` making it dense). The one check
    /// of every command taking a layer, before anything is loaded.
    pub fn check_layer(&self, l: usize) -> Result<()> {
        match self {
            Model::Checkpoint { ckpt, .. } => ckpt.check_layer(l),
            Model::Synthetic(_) if self.moe_layers().contains(&l) => Ok(()),
            Model::Synthetic(_) => Err(Error::usage(format!(
                "layer {l} is not an MoE layer of {} (MoE layers: {})",
                self.describe(),
                ranges(&self.moe_layers())
            ))),
        }
    }

    pub fn layer(&self, l: usize) -> Result<MoeLayer> {
        self.check_layer(l)?;
        match self {
            Model::Synthetic(m) => m.moe_layer(l),
            Model::Checkpoint { ckpt, .. } => ckpt.load_layer(l),
        }
    }

    /// `--layer` once checked, or the first MoE layer (never one config.json makes dense).
    pub fn pick_layer(&self, layer: Option<usize>) -> Result<usize> {
        if let Some(l) = layer {
            self.check_layer(l)?;
            return Ok(l);
        }
        if let (None, Model::Checkpoint { ckpt, .. }) = (self.moe_layers().first(), self) {
            // experts that config.json rules out past first_k_dense_replace: its own words
            if let Some(&l) = ckpt
                .expert_layers()
                .iter()
                .find(|&&l| l >= self.config().first_k_dense_replace)
            {
                ckpt.check_layer(l)?;
            }
        }
        self.moe_layers().first().copied().ok_or_else(|| {
            let dense = match self {
                Model::Checkpoint { ckpt, .. } => ckpt.dense_by_config(),
                Model::Synthetic(_) => vec![],
            };
            let why = if dense.is_empty() {
                String::new()
            } else {
                format!(
                    ": its routed experts sit in layers {} only, which config.json's \
                     first_k_dense_replace = {} makes dense MLPs",
                    ranges(&dense),
                    self.config().first_k_dense_replace
                )
            };
            Error::usage(format!("{} has no MoE layer{why}", self.describe()))
        })
    }

    pub fn describe(&self) -> String {
        match self {
            Model::Synthetic(m) => format!(
                "built-in synthetic `{}` model (seed {})",
                m.preset.name(),
                m.seed
            ),
            Model::Checkpoint { dir, .. } => dir.display().to_string(),
        }
    }

    /// The checkpoint tensor holding expert `e`'s input scale for projection `proj` (an index
    /// into [`gs::PROJS`]) in layer `l`, as the checkpoint spells it (`input_scale`, or
    /// compressed-tensors' `input_global_scale`); for the synthetic model its HF name.
    pub fn input_scale_name(&self, l: usize, e: usize, proj: usize) -> String {
        use crate::checkpoint::names::Proj;
        let p = [Proj::Gate, Proj::Up, Proj::Down][proj.min(2)];
        match self {
            Model::Synthetic(_) => {
                format!("model.layers.{l}.mlp.experts.{e}.{}.input_scale", p.hf())
            }
            Model::Checkpoint { ckpt, .. } => {
                let base = ckpt.naming.expert(l, e, p);
                crate::checkpoint::formats::find_linear(&ckpt.ckpt, &base)
                    .ok()
                    .flatten()
                    .and_then(|n| n.input_scale)
                    .unwrap_or_else(|| format!("{base}.input_scale"))
            }
        }
    }

    /// Layer `l`'s checkpoint input scales that read as their own reciprocals against this
    /// batch ([`gs::reciprocal_input_scales`] on `amax`, the per-expert amax of the batch's
    /// GEMM inputs, [`crate::moe::forward::expert_input_amax`]): the sentence and the JSON
    /// `input_scale_reciprocal` that layertest and gs-sweep report.
    pub fn reciprocal_input_scales(
        &self,
        l: usize,
        layer: &MoeLayer,
        amax: &(
            crate::moe::forward::ExpertAmax,
            crate::moe::forward::ExpertAmax,
        ),
    ) -> Option<(String, serde_json::Value)> {
        let (a1, a2) = amax;
        gs::reciprocal_input_scales(layer, a1, a2).map(|r| {
            let text = r.text(&|e, p| self.input_scale_name(l, e, p));
            let report = json!({
                "tensor": self.input_scale_name(l, r.worst.expert, r.worst.proj),
                "stored": r.worst.stored,
                "calibrated": r.worst.calibrated,
                "matched": r.matched,
                "judged": r.judged,
                "text": text,
            });
            (text, report)
        })
    }

    pub fn is_synthetic(&self) -> bool {
        matches!(self, Model::Synthetic(_))
    }

    /// The MoE dims (known before any layer is loaded).
    pub fn config(&self) -> &crate::moe::MoeConfig {
        match self {
            Model::Synthetic(m) => &m.config,
            Model::Checkpoint { ckpt, .. } => &ckpt.config.moe,
        }
    }

    /// Does layer `l` load its experts' BF16 originals (f32 in memory)?
    pub fn ships_originals(&self, l: usize) -> bool {
        match self {
            Model::Synthetic(_) => false,
            Model::Checkpoint { ckpt, .. } => ckpt.ships_originals(l),
        }
    }
}

/// Layer `l` and its input batch, with the GPU room checked before anything large is made:
/// up front when the token count is known without reading `--input`, else once it is read.
/// `normed`: the synthetic batch is the MoE-block input through the layer's norm (else the raw
/// residual stream, for multilayer); `per_slot` as for [`check_room`].
pub fn layer_and_batch(
    model: &Model,
    l: usize,
    input: &InputArgs,
    devices: &EpDevices,
    per_slot: bool,
    normed: bool,
) -> Result<(MoeLayer, Batch)> {
    let up_front = tokens_up_front(input);
    let originals = model.ships_originals(l);
    if let Some(t) = up_front {
        check_room(devices, model.config(), originals, t, per_slot)?;
    }
    let layer = model.layer(l)?;
    let c = &layer.config;
    let norm = normed.then_some((layer.norm_weight.as_deref(), c.rms_norm_eps));
    let batch = load_batch(input, c.hidden_size, layer.token_vocab(), norm)?;
    if let Some(path) = &input.input {
        check_hash_ids(path, &layer, batch.input_ids.as_deref())?;
    }
    if up_front.is_none() {
        check_room(devices, c, originals, batch.tokens, per_slot)?;
    }
    Ok((layer, batch))
}

/// A V4 hash layer routes by `tid2eid[input_ids]`: an `--input` without `input_ids`, or with
/// ids past the table, is bad input in that file (the router's own message cannot name it).
fn check_hash_ids(path: &Path, layer: &MoeLayer, ids: Option<&[i64]>) -> Result<()> {
    if !layer.is_hash_layer() {
        return Ok(());
    }
    let l = layer.index;
    let Some(ids) = ids else {
        return Err(Error::bad_tensor(
            path,
            "input_ids",
            format!(
                "missing: MoE layer {l} is a hash layer (routes by tid2eid[input_ids]), so the \
                 token ids [tokens] must come with hidden_states"
            ),
        ));
    };
    let vocab = layer.token_vocab();
    if let Some((t, id)) = ids
        .iter()
        .enumerate()
        .find(|(_, &id)| id < 0 || id as usize >= vocab)
    {
        return Err(Error::bad_tensor(
            path,
            "input_ids",
            format!(
                "input_ids[{t}] = {id} is outside the vocabulary of MoE layer {l}'s tid2eid \
                 table (0..{vocab})"
            ),
        ));
    }
    Ok(())
}

/// Tokens of the batch when known without reading it: synthetic input, or `--tokens`.
fn tokens_up_front(input: &InputArgs) -> Option<usize> {
    match &input.input {
        None => Some(input.tokens.unwrap_or(DEFAULT_TOKENS)),
        Some(_) => input.tokens,
    }
}

/// Room for the layer and the forwards of `tokens` tokens, checked before minutes go into
/// loading: host memory for the layer's weights as loaded (and, on the CPU, the forwards), and
/// on a GPU its memory. Not enough is bad input (exit 2) naming what takes the room.
fn check_room(
    devices: &EpDevices,
    c: &crate::moe::MoeConfig,
    originals: bool,
    tokens: usize,
    per_slot: bool,
) -> Result<()> {
    use crate::backend::cpu;
    use crate::backend::cuda::budget;
    let what = format!(
        "the forward of {tokens} tokens through one MoE layer (hidden {}, {} experts, top-{})",
        c.hidden_size, c.n_routed_experts, c.num_experts_per_tok
    );
    let weights = cpu::layer_host_bytes(c, originals);
    let on_cpu = devices.cuda_main().is_none();
    let host_need = weights
        + match on_cpu {
            true => cpu::forward_host_bytes(c, tokens, per_slot),
            false => 0,
        };
    if let Some(free) = host_available_bytes().filter(|&free| host_need > free) {
        let of_them = match originals {
            true => format!(
                ", {:.2} GB of them the experts' BF16 originals under bf16/, held as f32",
                (weights - cpu::layer_host_bytes(c, false)) as f64 / 1e9
            ),
            false => String::new(),
        };
        let advice = match weights > free {
            true => "run on a machine with more memory".to_string(),
            false => format!(
                "try fewer --tokens (each costs about {:.2} MB)",
                (cpu::forward_host_bytes(c, 2, per_slot) - cpu::forward_host_bytes(c, 1, per_slot))
                    as f64
                    / 1e6
            ),
        };
        return Err(Error::usage(format!(
            "{what} needs at least {:.2} GB of host memory (the layer's weights as loaded: {:.2} \
             GB{of_them}); {:.2} GB are available: {advice}",
            host_need as f64 / 1e9,
            weights as f64 / 1e9,
            free as f64 / 1e9,
        )));
    }
    let Some(cuda) = devices.cuda_main() else {
        return Ok(());
    };
    let need = budget::layer_pair_bytes(c, tokens, false, per_slot);
    let per = budget::per_token_bytes(c, per_slot);
    budget::check_free(
        cuda.gpu(),
        need,
        &format!("{what} on {}", cuda.gpu().describe()),
    )
    .map_err(|e| {
        e.advise_oom(format!(
            "Try fewer --tokens (each costs about {:.2} MB on the GPU; the weights {:.2} GB), \
             or --device cpu",
            per as f64 / 1e6,
            need.saturating_sub(per * tokens as u64) as f64 / 1e9
        ))
    })
}

/// Host memory available now (`MemAvailable` of /proc/meminfo); `None` where it cannot be read.
fn host_available_bytes() -> Option<u64> {
    let m = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kb = m
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))?
        .trim()
        .strip_suffix("kB")?
        .trim()
        .parse::<u64>()
        .ok()?;
    Some(kb * 1024)
}

/// `1, 3..5` for `[1, 3, 4, 5]`.
pub fn ranges(v: &[usize]) -> String {
    let mut out: Vec<String> = vec![];
    let mut i = 0;
    while i < v.len() {
        let mut j = i;
        while j + 1 < v.len() && v[j + 1] == v[j] + 1 {
            j += 1;
        }
        out.push(if i == j {
            v[i].to_string()
        } else {
            format!("{}..={}", v[i], v[j])
        });
        i = j + 1;
    }
    if out.is_empty() {
        "none".into()
    } else {
        out.join(", ")
    }
}

/// A batch of layer inputs.
pub struct Batch {
    /// `[tokens, hidden]`, BF16-exact.
    pub hidden: Vec<f32>,
    pub input_ids: Option<Vec<i64>>,
    pub tokens: usize,
    /// Where it came from, in words.
    pub origin: String,
}

pub const DEFAULT_TOKENS: usize = 64;

/// The batch a command runs on: `--input`, or synthetic activations. `norm` selects what the
/// synthetic batch is: the MoE-block input through this norm weight (`Some`), or the raw
/// residual stream (`None`, for multilayer).
pub fn load_batch(
    input: &InputArgs,
    hidden: usize,
    vocab: usize,
    norm: Option<(Option<&[f32]>, f32)>,
) -> Result<Batch> {
    use crate::moe::synthetic;
    // activations come from their own stream, not the model's calibration batch
    let seed = input.seed ^ 0x5eed_ac71;
    match &input.input {
        Some(path) => {
            let (mut h, mut ids, rows) = read_input(path, hidden, input.tokens)?;
            let tokens = match input.tokens {
                None => rows,
                Some(t) if t <= rows && t > 0 => t,
                Some(0) => return Err(Error::usage("--tokens must be at least 1")),
                Some(t) => {
                    return Err(Error::usage(format!(
                        "--tokens {t}: {} holds {rows} tokens",
                        path.display()
                    )))
                }
            };
            h.truncate(tokens * hidden);
            // padding only (or a capture of the wrong tensor): the layer maps zeros to zeros,
            // NVFP4 and BF16 alike, and would pass at cosine 1 having tested nothing
            if h.iter().all(|&v| v == 0.0) {
                return Err(Error::bad_tensor(
                    path,
                    "hidden_states",
                    format!(
                        "all zeros in the {tokens} token(s) used: nothing to test (padding rows \
                         only, or the capture took the wrong tensor or step)"
                    ),
                ));
            }
            if let Some(i) = ids.as_mut() {
                i.truncate(tokens);
            }
            // the layer input of an engine is BF16
            h.iter_mut()
                .for_each(|v| *v = crate::moe::forward::bf16(*v));
            Ok(Batch {
                hidden: h,
                input_ids: ids,
                tokens,
                origin: format!("{} ({tokens} tokens)", path.display()),
            })
        }
        None => {
            let tokens = input.tokens.unwrap_or(DEFAULT_TOKENS);
            if tokens == 0 {
                return Err(Error::usage("--tokens must be at least 1"));
            }
            let h = match norm {
                Some((w, eps)) => synthetic::moe_input(hidden, tokens, w, eps, seed),
                None => synthetic::residual_stream(hidden, tokens, seed),
            };
            Ok(Batch {
                hidden: h,
                input_ids: Some(synthetic::input_ids(vocab.max(1), tokens, seed)),
                tokens,
                origin: format!(
                    "synthetic activations ({tokens} tokens, seed {}: student-t tails, outlier channels, massive-activation tokens)",
                    input.seed
                ),
            })
        }
    }
}

type InputTensors = (Vec<f32>, Option<Vec<i64>>, usize);

/// Read `hidden_states` `[T, hidden]` and optional `input_ids` `[T]` from a safetensors file,
/// through the checkpoint reader: its header parser keeps memory bounded on a header that
/// lists a million tensors.
pub fn read_input(path: &Path, hidden: usize, take: Option<usize>) -> Result<InputTensors> {
    let file = TensorFile::open(path)?;
    let hs = file.get("hidden_states").ok_or_else(|| {
        Error::bad_tensor(
            path,
            "hidden_states",
            "missing: expected hidden_states [tokens, hidden]",
        )
    })?;
    let shape = hs.shape.clone();
    if shape.len() != 2 || shape[1] != hidden || shape[0] == 0 {
        return Err(Error::bad_tensor(
            path,
            "hidden_states",
            format!("shape {shape:?}, expected [tokens, {hidden}] (the layer's hidden_size)"),
        ));
    }
    let rows = shape[0];
    // decode only the rows --tokens uses: a capture of a million tokens is not read whole
    let used = take.filter(|&t| t > 0 && t <= rows).unwrap_or(rows);
    let h = file.to_f32_prefix("hidden_states", used * hidden)?;
    let ids = match file.get("input_ids") {
        None => None,
        Some(t) => {
            let ok_shape = t.shape == [rows] || t.shape == [1, rows];
            if !ok_shape {
                return Err(Error::bad_tensor(
                    path,
                    "input_ids",
                    format!(
                        "shape {:?}, expected [{rows}] (one id per hidden_states row)",
                        t.shape
                    ),
                ));
            }
            Some(decode_int(t.dtype, file.slice(t)).ok_or_else(|| {
                Error::bad_tensor(
                    path,
                    "input_ids",
                    format!("dtype {:?}: expected I64 or I32", t.dtype),
                )
            })?)
        }
    };
    Ok((h, ids, rows))
}

fn decode_int(d: Dtype, b: &[u8]) -> Option<Vec<i64>> {
    Some(match d {
        Dtype::I64 => b
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
            .collect(),
        Dtype::I32 => b
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64)
            .collect(),
        _ => return None,
    })
}

/// `(token, channel)` of a flat index into `[T, hidden]`.
pub fn at(idx: Option<usize>, hidden: usize) -> String {
    match idx {
        Some(i) => format!("token {} channel {}", i / hidden, i % hidden),
        None => "-".into(),
    }
}

/// H2 before anything downstream: NaN/Inf already in the input hidden states explain whatever
/// follows them. The failure line, if any, and the counts for the JSON report
/// (`input_nonfinite`).
///
/// Finite values beyond `sqrt(f32::MAX)` count too: the experts' `silu(gate) · up` is quadratic
/// in the input, so such a value overflows f32 in any precision the layer runs in, the
/// reference included, and the NaN/Inf that follow are the input's, not a global scale's or a
/// weight's (`overflow_count`, `max_abs`).
pub fn input_nonfinite(hidden: &[f32], hsz: usize) -> (Option<String>, serde_json::Value) {
    let (nan, inf, first_nan, first_inf) = crate::metrics::nonfinite(hidden);
    let first = first_nan.into_iter().chain(first_inf).min();
    let limit = f32::MAX.sqrt();
    let (mut huge, mut first_huge, mut max_abs) = (0u64, None, 0f32);
    for (i, v) in hidden.iter().enumerate() {
        if v.is_finite() && v.abs() > limit {
            huge += 1;
            first_huge.get_or_insert(i);
            max_abs = max_abs.max(v.abs());
        }
    }
    let line = if nan + inf > 0 {
        Some(format!(
            "the input hidden states already hold {nan} NaN and {inf} Inf (first at {}): they \
             come from upstream (attention or an earlier layer), not from these MoE layers; \
             `nan-locate` on a trace finds where",
            at(first, hsz)
        ))
    } else if huge > 0 {
        Some(format!(
            "the input hidden states hold {huge} value(s) beyond sqrt(f32 max) = {limit:.3e} (up to {max_abs:.3e}, \
             first at {}): the experts' silu(gate)·up is quadratic in them and overflows f32 in any precision, \
             the reference's included; they come from upstream (attention or an earlier layer: a blown-up \
             residual), not from these MoE layers or their scales",
            at(first_huge, hsz)
        ))
    } else {
        None
    };
    let counts = json!({"nan_count": nan, "inf_count": inf, "first_index": first,
                        "overflow_count": huge, "max_abs": max_abs});
    (line, counts)
}

/// How far (output norm, x the median token's) a token carrying most of the layer's energy must
/// stand out to be named as an input problem: a SwiGLU output grows with the square of its
/// input, so 10x is an input row ~3x the median's, far past RMSNorm-ed tokens' spread.
const DOMINANT_NORM_RATIO: f64 = 10.0;

/// A per-token failure (see [`token_failure`]).
pub struct TokenFailure {
    /// The failure line.
    pub line: String,
    /// The token that carries most (> 50%) of the reference output's energy, if one does, or
    /// else the few tokens of outsized norm (see `outliers`) that carry it together: an input
    /// problem, not the layer's. Empty when none do.
    pub dominant: Vec<usize>,
    /// The tokens below the bar, worst first.
    pub bad: Vec<usize>,
    /// Tokens whose reference output norm is at least 10x the median token's, ascending:
    /// inputs of a magnitude RMSNorm-ed MoE inputs do not have.
    pub outliers: Vec<usize>,
}

/// Tokens whose own output misses `min_cosine` (or the rel-L2 that cosine allows an error
/// orthogonal to it) while the layer as a whole may pass: a whole-tensor cosine is a
/// norm-weighted mean, and one token of huge norm carries it. `tokens` worst first;
/// `reference` `[T, hidden]` names the token that dominates the layer's cosine, and `input`
/// `[T, hidden]` (the layer's input) how far its input norm is from the median token's: the
/// output of a SwiGLU MoE grows with the square of its input, so the output's ratio
/// overstates the input's (a 50x input row is a ~2500x output row).
pub fn token_failure(
    tokens: &[TokenMetrics],
    reference: &[f32],
    input: &[f32],
    hsz: usize,
    (bar, min_cosine): (&str, f64),
    layer_cosine: f64,
) -> Option<TokenFailure> {
    let max_rel = (1.0 / (min_cosine * min_cosine) - 1.0).sqrt();
    let bad: Vec<_> = tokens
        .iter()
        .filter(|t| below(t.metrics.cosine, min_cosine) || t.metrics.rel_l2 > max_rel)
        .collect();
    let worst = bad.first()?;
    let sq = |x: &[f32]| -> Vec<f64> {
        x.chunks(hsz.max(1))
            .map(|r| r.iter().map(|&v| v as f64 * v as f64).sum())
            .collect()
    };
    let median_of = |v: &[f64]| {
        let mut s = v.to_vec();
        s.sort_by(f64::total_cmp);
        s.get(s.len() / 2).copied().unwrap_or(0.0)
    };
    let ratio = |a: f64, m: f64| {
        if m > 0.0 {
            (a / m).sqrt()
        } else {
            f64::INFINITY
        }
    };
    let energy = sq(reference);
    let total: f64 = energy.iter().sum();
    let (big, e_big) = energy
        .iter()
        .copied()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .unwrap_or((0, 0.0));
    let median = median_of(&energy);
    // it must also stand out of the other tokens: in a batch of one or two tokens, or of a
    // few tokens of ordinary spread, some token always carries half the energy
    let others: Vec<f64> = (energy.iter().enumerate())
        .filter(|&(i, _)| i != big)
        .map(|(_, &e)| e)
        .collect();
    let dominant = (total > 0.0
        && e_big / total > 0.5
        && !others.is_empty()
        && ratio(e_big, median_of(&others)) >= DOMINANT_NORM_RATIO)
        .then_some(big);
    let outliers: Vec<usize> = (0..energy.len())
        .filter(|&i| ratio(energy[i], median) >= DOMINANT_NORM_RATIO)
        .collect();
    // several such tokens (none carrying half alone) set the global scales as one does
    let e_out: f64 = outliers.iter().map(|&i| energy[i]).sum();
    let group = (dominant.is_none()
        && outliers.len() > 1
        && 2 * outliers.len() < energy.len()
        && e_out / total > 0.5)
        .then(|| outliers.clone());
    let dominated = if let Some(g) = &group {
        let in_sq = sq(input);
        let in_median = median_of(&in_sq);
        let (lo, hi) = g.iter().fold((f64::INFINITY, 0f64), |(lo, hi), &i| {
            let r = in_sq.get(i).map_or(f64::NAN, |&v| ratio(v, in_median));
            (lo.min(r), hi.max(r))
        });
        let which: Vec<String> = g.iter().map(|i| i.to_string()).collect();
        let (lo, hi) = (format!("{lo:.3e}x"), format!("{hi:.3e}x"));
        let span = if lo == hi { lo } else { format!("{lo}-{hi}") };
        format!(
            "; tokens {} (output norm 10x the median token's or more; their input rows' norms \
             {span} the median token's) carry {:.1}% of the reference output's \
             energy together, so the layer's cosine is mostly theirs: tokens of that magnitude \
             (the MoE input is RMSNorm-ed per token: its norm skipped or broken upstream?) also \
             set the activation global scales of their experts",
            which.join(", "),
            100.0 * e_out / total
        )
    } else if dominant.is_some() {
        let in_sq = sq(input);
        let in_norm = match in_sq.get(big) {
            Some(&v) => format!(
                "; its input row's norm is {:.3e}x the median token's",
                ratio(v, median_of(&in_sq))
            ),
            None => String::new(),
        };
        format!(
            "; token {big} carries {:.1}% of the reference output's energy (output norm {:.3e}x the median token's{in_norm}), so the \
             layer's cosine is mostly its own: a token of that magnitude (the MoE input is RMSNorm-ed per token: its norm skipped or broken upstream?) also \
             sets the activation global scales of its experts",
            100.0 * e_big / total,
            ratio(e_big, median)
        )
    } else {
        String::new()
    };
    let line = format!(
        "{} of {} tokens fall below {bar} {min_cosine} (or beyond rel-L2 {max_rel:.3}) although the \
         layer scores cosine {}: worst token {}, cosine {}, rel-L2 {}{dominated}",
        bad.len(),
        tokens.len(),
        f(layer_cosine, 4),
        worst.token,
        f(worst.metrics.cosine, 4),
        f(worst.metrics.rel_l2, 3),
    );
    Some(TokenFailure {
        line,
        dominant: group.unwrap_or_else(|| dominant.into_iter().collect()),
        bad: bad.iter().map(|t| t.token).collect(),
        outliers,
    })
}

/// The bar [`token_failure`] judges tokens at, with its flag: `--min-token-cosine`, or the
/// layer's own `--min-cosine` where the layer failed and that bar is higher (one token of huge
/// norm at cosine 0.90 fails a 0.95 layer and passes a 0.9 token bar: it went unnamed).
pub fn token_bar(
    layer_failed: bool,
    min_cosine: f64,
    min_token_cosine: f64,
) -> (&'static str, f64) {
    if layer_failed && min_cosine > min_token_cosine {
        ("--min-cosine", min_cosine)
    } else {
        ("--min-token-cosine", min_token_cosine)
    }
}

/// A cosine below a threshold; NaN counts as below.
pub fn below(v: f64, min: f64) -> bool {
    v.is_nan() || v < min
}

/// Percent of `n` in `of`.
pub fn pct(n: u64, of: u64) -> f64 {
    if of == 0 {
        0.0
    } else {
        100.0 * n as f64 / of as f64
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct BlockSummary {
    pub blocks: u64,
    pub saturated: u64,
    pub flushed: u64,
    pub nan_scales: u64,
    pub saturated_pct: f64,
    pub flushed_pct: f64,
}

pub fn block_summary(s: &BlockStats) -> BlockSummary {
    BlockSummary {
        blocks: s.blocks,
        saturated: s.saturated,
        flushed: s.flushed,
        nan_scales: s.nan_scales,
        saturated_pct: pct(s.saturated, s.blocks),
        flushed_pct: pct(s.flushed, s.blocks),
    }
}

/// JSON-friendly description of a set of scales.
pub fn scales_json(source: GsSource, reduce: InputScaleReduce, s: &ActScales) -> serde_json::Value {
    match gs::summary(s) {
        Some((g1, g2)) => json!({
            "source": source.to_string(),
            "input_scale_reduce": reduce.to_string(),
            "gs1": {"min": g1[0], "median": g1[1], "max": g1[2]},
            "gs2": {"min": g2[0], "median": g2[1], "max": g2[2]},
        }),
        None => json!({"source": "dynamic", "input_scale_reduce": reduce.to_string()}),
    }
}

fn scales_text(source: GsSource, s: &ActScales) -> String {
    match gs::summary(s) {
        Some((g1, g2)) if g1[0] == g1[2] && g2[0] == g2[2] && g1[0] == g2[0] => {
            format!("{source}: gs {} for every GEMM", e(g1[0] as f64))
        }
        Some((g1, g2)) => format!(
            "{source}: gs1 {}..{} (median {}), gs2 {}..{} (median {})",
            e(g1[0] as f64),
            e(g1[2] as f64),
            e(g1[1] as f64),
            e(g2[0] as f64),
            e(g2[2] as f64),
            e(g2[1] as f64)
        ),
        None => format!("{source}: per batch, 2688 / amax of each GEMM input"),
    }
}

/// The `metrics` table rows (one shared look for every command).
pub fn metrics_section(title: &str, m: &Metrics, hidden: usize) -> Section {
    Section::kv(
        title,
        &[
            ("cosine", f(m.cosine, 6)),
            ("rel_l2", f(m.rel_l2, 4)),
            ("sqnr_db", f(m.sqnr_db, 2)),
            (
                "max_abs_err",
                format!(
                    "{} at {}",
                    e(m.max_abs_err),
                    at(m.max_abs_err_index, hidden)
                ),
            ),
            (
                "nan_count",
                format!("{} (first at {})", m.nan_count, at(m.first_nan, hidden)),
            ),
            (
                "inf_count",
                format!("{} (first at {})", m.inf_count, at(m.first_inf, hidden)),
            ),
        ],
    )
}

// ---------------------------------------------------------------------------------------

#[derive(Serialize)]
struct KernelCheck {
    backend: String,
    done: bool,
    reason: Option<String>,
    min_cosine: f64,
    metrics: Option<Metrics>,
    pass: Option<bool>,
}

pub fn run(args: &Args) -> Result<Report> {
    if args.fault.is_some() && !args.ep.sharded() {
        return Err(Error::usage(
            "--fault flips the expert-id convention between EP ranks: it needs --ep 2 or more \
             (with one rank, local and global ids are the same)",
        ));
    }
    if args.dump_inputs.is_some() && args.ep.sharded() {
        return Err(Error::usage(
            "--dump-inputs writes one rank's inputs holding every expert (global ids, identity \
             expert_map); it does not write the per-rank views of --ep N. Drop --ep to dump, or \
             pass your kernel as --kernel PATH.so, which runs it as every rank",
        ));
    }
    // a plugin that is not one is named before any device work
    let plugin = args.kernel.load()?;
    let devices = args.ep.open(&args.device, args.out_args.quiet)?;
    let plugin_gpu = match &plugin {
        Some(p) => Some(kernel::plugin_gpu(
            p,
            devices.cuda_main(),
            &devices.main().name(),
        )?),
        None => None,
    };
    if args.cuda_graph && devices.cuda_main().is_none() {
        return Err(Error::usage(format!(
            "--cuda-graph captures the layer's CUDA kernels in a CUDA graph; the {} backend has no \
             graphs: use --device cuda",
            devices.main().name()
        )));
    }
    let backend = devices.main();
    let model = Model::open(&args.input)?;
    let l = model.pick_layer(args.layer)?;
    // a DeepSeek-V3 layer on the CPU runs a minute or more: say which part
    let steps = Steps::new(
        5 + u64::from(args.ep.sharded()) + u64::from(plugin.is_some()),
        args.out_args.quiet,
    );
    steps.next(&format!("loading layer {l}"));
    let (layer, batch) = layer_and_batch(&model, l, &args.input, &devices, true, true)?;
    let c = &layer.config;
    let (hsz, k) = (c.hidden_size, c.num_experts_per_tok);
    let ids = batch.input_ids.as_deref();

    // one routing for both paths: routing differences are the `routing` command's business
    steps.next("routing, gs");
    let routing = backend.route(&layer, &batch.hidden, ids)?;
    let source = args.gs.gs.unwrap_or(GsSource::Calibrated);
    let amax = BatchAmax::new(&layer, &batch.hidden, &routing);
    let scales = args
        .gs
        .resolve(source, &layer, ids, &amax, args.input.seed)?;
    if plugin.is_some() || args.dump_inputs.is_some() {
        kernel::fixed_scales(&scales)?;
    }
    let nvfp4_path = MoePath::Nvfp4 {
        scales: &scales,
        flavor: Flavor::Reference,
    };
    // the unsharded NVFP4 run: the result without EP, and what EP must reproduce
    steps.next("NVFP4 layer");
    let nv1 = backend.moe_forward(&layer, &batch.hidden, &routing, &nvfp4_path, true)?;
    let ep_run = if args.ep.sharded() {
        steps.next(&format!("EP {} ranks", args.ep.ep));
        let req = args.ep.request(args.fault);
        let run = ep::forward(
            &devices,
            &req,
            &layer,
            &batch.hidden,
            &routing,
            &scales,
            Flavor::Reference,
            true,
        )?;
        let clean = match args.fault {
            Some(_) => Some(ep::forward(
                &devices,
                &args.ep.request(None),
                &layer,
                &batch.hidden,
                &routing,
                &scales,
                Flavor::Reference,
                false,
            )?),
            None => None,
        };
        let agreement = par::against_unsharded(&run.out, &nv1, &routing, hsz)?;
        let vs_unsharded = crate::metrics::compare(&run.out, &nv1.out);
        let ranks = ep::summarize_ranks(&run, clean.as_ref(), &routing, c.n_routed_experts);
        Some(EpResult {
            run,
            agreement,
            vs_unsharded,
            ranks,
        })
    } else {
        None
    };
    let nv = match &ep_run {
        Some(x) => MoeOutput {
            out: x.run.out.clone(),
            act_stats: x.run.act_stats,
            per_slot: x.run.per_slot.clone(),
        },
        None => nv1.clone(),
    };
    steps.next("BF16 reference");
    let rf = backend.moe_forward(&layer, &batch.hidden, &routing, &MoePath::Reference, true)?;
    let m = backend.compare(&nv.out, &rf.out)?;
    let (ref_nan, ref_inf, ref_first_nan, _) = crate::metrics::nonfinite(&rf.out);

    let (nv_slots, rf_slots) = (slots(&nv)?, slots(&rf)?);
    let shared = if plugin.is_some() || args.dump_inputs.is_some() {
        kernel::shared_out(backend, &layer, &batch.hidden, &routing)?
    } else {
        vec![]
    };
    let byok = match (&plugin, plugin_gpu) {
        (Some(p), Some(cuda)) => {
            steps.next("your kernel");
            let ep = args.ep.shard();
            let theirs = kernel::run_plugin(p, cuda, &layer, &batch.hidden, &routing, &scales, ep)?;
            let feeding = Feeding {
                layout: Some(p.scale_layout),
                ep,
            };
            let (j, note) = kernel::judge_plugin(
                &theirs,
                &nv1,
                &rf.out,
                &shared,
                &layer,
                &batch.hidden,
                &routing,
                &scales,
                feeding,
                args.min_cosine,
            )?;
            let local = kernel::localize_plugin(&theirs, &nv1, &routing, hsz, &j);
            Some((j, note, local))
        }
        _ => None,
    };
    if let Some(dir) = &args.dump_inputs {
        let (gs1, gs2) = kernel::fixed_scales(&scales)?;
        let expected = dump::Expected {
            reference_out: rf.out.clone(),
            nvfp4_out: nv1.out.clone(),
            nvfp4_routed: routed_sum(slots(&nv1)?, &routing, hsz),
            shared_out: shared.clone(),
        };
        dump::write(
            dir,
            &layer,
            &batch.hidden,
            &routing,
            gs1,
            gs2,
            &expected,
            &format!(
                "layertest layer {l} of {}, {}",
                model.describe(),
                batch.origin
            ),
        )?;
    }
    let check = ExpertCheck {
        min_cosine: args.min_expert_cosine,
        min_slots: args.min_expert_slots,
    };
    let mut experts = per_expert(&routing, nv_slots, rf_slots, hsz, c.n_routed_experts);
    experts.sort_by(|a, b| worst_first(&a.metrics, &b.metrics));
    // an expert off by a factor has a fine cosine: failing ones first, then those too few
    // tokens reached to judge, or the table (8 rows) and summary.worst_expert would not show them
    experts.sort_by_key(|x| match x.metrics.nan_count + x.metrics.inf_count {
        0 => match check.judge(x) {
            ExpertVerdict::Fail(_) => 1,
            ExpertVerdict::TooFewSlots => 2,
            ExpertVerdict::Pass => 3,
        },
        _ => 0,
    });
    let input_blocks =
        expert_input_blocks(&routing, &batch.hidden, hsz, c.n_routed_experts, &scales);
    let experts: Vec<ExpertRow> = experts
        .into_iter()
        .map(|m| ExpertRow {
            gate_up_input: block_summary(&input_blocks.get(m.expert).copied().unwrap_or_default()),
            verdict: match (m.metrics.nan_count + m.metrics.inf_count, check.judge(&m)) {
                (0, ExpertVerdict::Pass) => "pass",
                (0, ExpertVerdict::TooFewSlots) => "too-few-slots",
                _ => "fail",
            },
            m,
        })
        .collect();
    let too_few: Vec<String> = experts
        .iter()
        .filter(|x| x.verdict == "too-few-slots")
        .map(|x| check.too_few_line(&x.m))
        .collect();
    let mut tokens = per_token(&nv.out, &rf.out, hsz);
    tokens.sort_by(|a, b| worst_first(&a.metrics, &b.metrics));

    // the kernel check is about the kernels: the unsharded GPU run against the CPU
    steps.next("kernel check");
    let kernel = kernel_check(backend, &layer, &batch.hidden, &routing, &nvfp4_path, &nv1)?;
    let graph = match devices.cuda_main() {
        Some(cuda) if args.cuda_graph => {
            Some(graph_check(cuda, &layer, &batch.hidden, &routing, &scales)?)
        }
        _ => None,
    };

    if let Some(p) = &args.save_outputs {
        save_outputs(
            p,
            &nv.out,
            &rf.out,
            &routing.topk_ids,
            &routing.topk_weights,
            batch.tokens,
            hsz,
            routing.top_k,
        )?;
    }
    let dumps = match &args.save_routing {
        Some(dir) => save_routing(
            dir,
            &args.ep,
            args.fault,
            &layer,
            &batch,
            &routing,
            ep_run.as_ref().map(|x| &x.run),
        )?,
        None => vec![],
    };

    // ---- verdict ----
    let mut failures: Vec<String> = vec![];
    let (in_bad, in_json) = input_nonfinite(&batch.hidden, hsz);
    failures.extend(in_bad);
    let input_lines = failures.len();
    if let Some(x) = &ep_run {
        failures.extend(ep_failures(&args.ep, args.fault, x, hsz));
    }
    if let Some(g) = graph.as_ref().filter(|g| !g.graph_replay_bitwise_equal) {
        failures.push(format!(
            "CUDA graph replay differs from the eager run: {} of {} output values (first at {}), \
             activation statistics {}",
            g.differing,
            g.len,
            at(g.first_differing_index, hsz),
            if g.act_stats_equal { "equal" } else { "differ" }
        ));
    }
    if m.nan_count > 0 {
        failures.push(format!(
            "NaN in the NVFP4 output: {} values, first at {}",
            m.nan_count,
            at(m.first_nan, hsz)
        ));
    }
    if m.inf_count > 0 {
        failures.push(format!(
            "Inf in the NVFP4 output: {} values, first at {}",
            m.inf_count,
            at(m.first_inf, hsz)
        ));
    }
    for x in &experts {
        if let Some(line) = ExpertCheck::nonfinite(&x.m) {
            match nonfinite_weights(&layer, x.m.expert) {
                // its weights hold the NaN: that, not the output it spreads to, leads
                Some(w) => failures.insert(input_lines, format!("{line}{w}")),
                None => failures.push(format!("{line}{}", x.cause())),
            }
        }
    }
    failures.extend(unreached_nonfinite_experts(&layer, &[&routing]));
    if nv.act_stats.nan_scales > 0 {
        failures.push(format!(
            "{} activation block scales are NaN (a NaN input, a NaN/Inf global scale, or NaN out of the gate/up GEMM)",
            nv.act_stats.nan_scales
        ));
    }
    if ref_nan + ref_inf > 0 {
        failures.push(format!(
            "the BF16 reference itself has {ref_nan} NaN and {ref_inf} Inf (first NaN at {}): bad input or bad reference weights",
            at(ref_first_nan, hsz)
        ));
    }
    // a failing expert's down_proj input the scales saturate: `cause` (its gate/up blocks)
    // cannot show it
    // and the checkpoint input_scales in use far above what their amax needs: the flush
    // counterpart, under global-max one expert's value that every expert takes; and the
    // checkpoint's input scales judged whatever the gs in use (an engine takes them), for the
    // JSON and a note: one amax pass for all of it
    let failing = experts.iter().any(|x| check.failure(&x.m).is_some());
    let findings = if ScaleFindings::wanted(&layer, failing) {
        Some(ScaleFindings::of(
            &layer,
            &amax,
            &scales,
            source,
            args.gs.input_scale_reduce,
        )?)
    } else {
        None
    };
    let expert_lines = failures.len();
    for x in &experts {
        if let Some(msg) = check.failure(&x.m) {
            let why = findings
                .as_ref()
                .map_or(String::new(), |s| s.cause(x.m.expert, &x.gate_up_input));
            failures.push(msg + &why);
        }
    }
    // under global-max the expert whose input_scale flushes every expert's inputs is not
    // among those failing for it (or not first): it leads their lines
    // (only then: the verdict on the scales in use stays with the experts' numbers)
    let layer_max = findings.iter().filter(|_| failing);
    for line in layer_max.flat_map(|s| s.layer_max_lines()).rev() {
        failures.insert(expert_lines, line);
    }
    if m.nan_count + m.inf_count == 0 && below(m.cosine, args.min_cosine) {
        failures.push(format!(
            "cosine {} < --min-cosine {} (rel-L2 {})",
            f(m.cosine, 4),
            args.min_cosine,
            f(m.rel_l2, 3)
        ));
    }
    if m.nan_count + m.inf_count == 0 {
        let failed = below(m.cosine, args.min_cosine);
        let bar = token_bar(failed, args.min_cosine, args.min_token_cosine);
        if let Some(t) = token_failure(&tokens, &rf.out, &batch.hidden, hsz, bar, m.cosine) {
            match t.dominant.is_empty() {
                // one token of huge norm (or a few) is the input's problem, and what the expert
                // and layer failures above follow from: it leads (after NaN/Inf in the input)
                false => failures.insert(input_lines, t.line),
                true => failures.push(t.line),
            }
        }
    }
    if kernel.pass == Some(false) {
        failures.push(format!(
            "kernel check: {} NVFP4 output vs the CPU NVFP4 path: cosine {} < {}",
            kernel.backend,
            kernel
                .metrics
                .as_ref()
                .map_or("NaN".into(), |m| f(m.cosine, 7)),
            KERNEL_CHECK_MIN_COSINE
        ));
    }
    if let Some((b, local)) = byok
        .as_ref()
        .and_then(|(j, _, local)| j.blame().map(|b| (b, local)))
    {
        let who = plugin.as_ref().map_or(String::new(), |p| {
            format!("kernel plugin {} ({})", p.path.display(), p.name)
        });
        // where it deviates, when no known bug explains it (as compare-outputs says it)
        let b = match local {
            Some(l) => format!("{b}; {}", l.text),
            None => b,
        };
        // the plugin's verdict first: it is what --kernel asked about
        failures.insert(0, format!("{who}: {b}"));
    }
    // checkpoint input scales that read as their own reciprocals, whatever the gs in use (an
    // engine takes them): under --gs checkpoint the cause behind the expert failures above
    // (their inputs saturate or flush), named first after the input's problems, and a failure
    // of its own where this batch survives them (gs-sweep's rule); under another gs a note
    let reciprocal = findings
        .as_ref()
        .and_then(|s| model.reciprocal_input_scales(l, &layer, &s.amax));
    let reciprocal_in_use = reciprocal
        .as_ref()
        .filter(|_| source == GsSource::Checkpoint);
    if let Some((t, _)) = reciprocal_in_use {
        if failures.is_empty() {
            failures.push(format!(
                "{t}; this batch passes under these scales, batches of other amax will not"
            ));
        } else {
            let at = failures
                .iter()
                .position(|x| x.starts_with("expert ") || x.starts_with("cosine "))
                .unwrap_or(failures.len())
                .min(failures.len());
            failures.insert(at.max(input_lines.min(failures.len())), t.clone());
        }
    }
    let pass = failures.is_empty();
    let headline = if pass {
        // native V4 experts are MXFP4
        let fmt = layer.experts.first().map_or("NVFP4".to_string(), |e| {
            e.w1.weight.format.name().to_uppercase()
        });
        format!(
            "layer {l}: {fmt} matches the BF16 reference within {fmt} error (cosine {}, rel-L2 {}, {} tokens, gs {source}){}",
            f(m.cosine, 4),
            f(m.rel_l2, 3),
            batch.tokens,
            match too_few.len() {
                0 => String::new(),
                n => format!(
                    "; {n} expert{} too few tokens reached to judge",
                    if n == 1 { "" } else { "s" }
                ),
            }
        )
    } else if failures.len() == 1 {
        format!("layer {l}: {}", failures[0])
    } else {
        format!(
            "layer {l}: {} (and {} more problems)",
            failures[0],
            failures.len() - 1
        )
    };

    let summary = json!({
        "cosine": m.cosine,
        "rel_l2": m.rel_l2,
        "sqnr_db": m.sqnr_db,
        "max_abs_err": m.max_abs_err,
        "nan_count": m.nan_count,
        "inf_count": m.inf_count,
        "min_cosine": args.min_cosine,
        "min_expert_cosine": args.min_expert_cosine,
        "min_expert_slots": args.min_expert_slots,
        "min_token_cosine": args.min_token_cosine,
        "experts_too_few_slots": too_few.len(),
        "layer": l,
        "tokens": batch.tokens,
        "gs": source.to_string(),
        "device": backend.name(),
        "model": model.describe(),
        "cause": reciprocal_in_use.map(|_| "input_scale_reciprocal"),
        "input_scale_reciprocal": reciprocal.as_ref().map(|(_, j)| j),
        "input_scale_flush": findings.as_ref().and_then(|s| s.flush_json()),
        "input_scale_saturate": findings.as_ref().and_then(|s| s.saturate_json()),
        "worst_expert": experts.first().map(|x| json!({"expert": x.m.expert, "cosine": x.m.metrics.cosine, "slots": x.m.slots})),
        "ep": args.ep.ep,
        "ep_within_bound": ep_run.as_ref().map(|x| x.agreement.within_bound),
        "dropped_by_rank": ep_run.as_ref().map(|x| dropped_by_rank(&x.ranks)),
        "graph_replay_bitwise_equal": graph.as_ref().map(|g| g.graph_replay_bitwise_equal),
        "kernel": plugin.as_ref().map_or("builtin".to_string(), |p| p.path.display().to_string()),
        "kernel_pass": byok.as_ref().map(|(j, _, _)| j.pass()),
        "kernel_diagnosis": byok.as_ref().and_then(|(j, _, _)| j.diagnosis),
        "kernel_localization": byok.as_ref().and_then(|(_, _, l)| l.as_ref()),
        "dump_inputs": args.dump_inputs.as_ref().map(|d| d.display().to_string()),
    });

    let mut setup = Section::kv(
        format!("layertest: MoE layer {l}"),
        &[
            ("model", model.describe()),
            ("input", batch.origin.clone()),
            (
                "layer",
                format!(
                    "hidden {}, {} experts top-{k}, moe_intermediate {}, {:?} scoring{}{}",
                    hsz,
                    c.n_routed_experts,
                    c.moe_intermediate_size,
                    c.scoring_func,
                    if layer.is_hash_layer() {
                        ", hash routing (tid2eid)"
                    } else {
                        ""
                    },
                    c.swiglu_limit
                        .map_or(String::new(), |v| format!(", swiglu_limit {v}"))
                ),
            ),
            ("activation gs", scales_text(source, &scales)),
            ("device", backend.name()),
        ],
    );
    if layer.experts.iter().all(|x| x.w1.original.is_some()) {
        setup.row(vec!["reference weights".into(), "BF16 originals".into()]);
    } else {
        setup.row(vec![
            "reference weights".into(),
            "dequantized from the checkpoint".into(),
        ]);
    }

    let st = block_summary(&nv.act_stats);
    let blocks = Section::kv(
        "Activation blocks (NVFP4 path, all expert GEMM inputs)",
        &[
            ("blocks", st.blocks.to_string()),
            (
                "saturated (scale at 448)",
                format!("{} ({:.2}%)", st.saturated, st.saturated_pct),
            ),
            (
                "flushed to zero",
                format!("{} ({:.2}%)", st.flushed, st.flushed_pct),
            ),
            ("NaN scales", st.nan_scales.to_string()),
        ],
    );

    let mut report = Report::new("layertest", Verdict::from_pass(pass), headline)
        .summary(summary)
        .with(
            "layer_config",
            json!({
                "hidden_size": hsz,
                "moe_intermediate_size": c.moe_intermediate_size,
                "n_routed_experts": c.n_routed_experts,
                "top_k": k,
                "scoring_func": c.scoring_func,
                "hash_layer": layer.is_hash_layer(),
                "swiglu_limit": c.swiglu_limit,
                "reference_weights": if layer.experts.iter().all(|x| x.w1.original.is_some()) { "bf16-originals" } else { "dequantized" },
            }),
        )
        .with("metrics", &m)
        .with(
            "reference_nonfinite",
            json!({"nan_count": ref_nan, "inf_count": ref_inf}),
        )
        .with("input_nonfinite", &in_json)
        .with("act_stats", &st)
        .with(
            "gs",
            scales_json(source, args.gs.input_scale_reduce, &scales),
        )
        .with("worst_experts", &experts[..experts.len().min(8)])
        .with("worst_tokens", &tokens[..tokens.len().min(8)])
        .with("kernel_check", &kernel)
        .with("experts_too_few_slots", &too_few)
        .with("failures", &failures)
        .section(setup)
        .section(metrics_section("NVFP4 vs BF16 reference", &m, hsz))
        .section(blocks)
        .section(expert_table(&experts))
        .section(token_table(&tokens));
    if let Some(x) = &ep_run {
        let mut j = ep_json(&args.ep, &devices, Some(&x.run));
        j["fault"] = json!(args.fault);
        j["tolerance"] = json!(par::tolerance_text(routing.top_k));
        j["agreement"] = json!(x.agreement);
        j["vs_unsharded"] = json!(x.vs_unsharded);
        j["act_stats_match_unsharded"] = json!(nv.act_stats == nv1.act_stats);
        j["dropped_by_rank"] = dropped_by_rank(&x.ranks);
        j["ranks"] = json!(x.ranks);
        j["routing_dumps"] = json!(dumps);
        report = report
            .with("ep", j)
            .section(ep_section(&args.ep, args.fault, x, hsz))
            .section(rank_table(&x.ranks));
    } else if !dumps.is_empty() {
        report = report.with("ep", json!({"size": 1, "routing_dumps": dumps}));
    }
    if let Some(g) = &graph {
        report = report.with("cuda_graph", g).section(Section::kv(
            "CUDA graph (replay vs eager, bit for bit)",
            &[
                ("replays", g.replays.to_string()),
                (
                    "graph_replay_bitwise_equal",
                    g.graph_replay_bitwise_equal.to_string(),
                ),
                (
                    "differing values",
                    format!(
                        "{} of {} (first at {})",
                        g.differing,
                        g.len,
                        at(g.first_differing_index, hsz)
                    ),
                ),
                ("activation statistics equal", g.act_stats_equal.to_string()),
            ],
        ));
    }
    if kernel.done || kernel.reason.is_some() {
        report = report.section(Section::kv(
            "Kernel check (GPU NVFP4 vs CPU NVFP4)",
            &[
                ("backend", kernel.backend.clone()),
                (
                    "result",
                    match (&kernel.metrics, &kernel.reason) {
                        (Some(m), _) => format!(
                            "cosine {} rel-L2 {} NaN {} (threshold {KERNEL_CHECK_MIN_COSINE})",
                            f(m.cosine, 7),
                            e(m.rel_l2),
                            m.nan_count
                        ),
                        (None, Some(r)) => format!("skipped: {r}"),
                        _ => "-".into(),
                    },
                ),
            ],
        ));
    }
    if let Some((j, note, _)) = &byok {
        let who = plugin.as_ref().map_or("builtin".into(), |p| {
            format!("{} ({})", p.path.display(), p.name)
        });
        report = report.with("kernel", kernel::json(plugin.as_ref(), j, note.as_deref()));
        for s in kernel::sections(j, &who, note.as_deref(), hsz) {
            report = report.section(s);
        }
    }
    // the checkpoint's input scales an engine takes, named beside the verdict on the gs in use
    let recip = reciprocal.as_ref().filter(|_| reciprocal_in_use.is_none());
    if let Some(s) =
        ScaleFindings::checkpoint_section(findings.as_ref(), recip.map(|r| r.0.as_str()))
    {
        report = report.section(s);
    }
    if !too_few.is_empty() {
        let mut s = Section::new("Experts too few tokens reached to judge", &["note"]);
        for x in &too_few {
            s.row(vec![x.clone()]);
        }
        report = report.section(s);
    }
    if !failures.is_empty() {
        let mut s = Section::new("Failures", &["problem"]);
        for x in &failures {
            s.row(vec![x.clone()]);
        }
        report = report.section(s);
    }
    Ok(report)
}

/// A sharded run and how it compares with the unsharded one.
struct EpResult {
    run: EpOutput,
    agreement: Agreement,
    vs_unsharded: Metrics,
    ranks: Vec<ep::RankSummary>,
}

/// `{rank: dropped (token, slot) pairs}` for the ranks that dropped any.
fn dropped_by_rank(ranks: &[ep::RankSummary]) -> serde_json::Value {
    let m: serde_json::Map<String, serde_json::Value> = ranks
        .iter()
        .filter(|r| r.slots.dropped > 0)
        .map(|r| (r.rank.to_string(), json!(r.slots.dropped)))
        .collect();
    serde_json::Value::Object(m)
}

fn share_text(r: &ep::RankSummary) -> String {
    r.share.as_ref().map_or(String::new(), |m| {
        format!(
            ", its share's cosine vs the correct share {}",
            f(m.cosine, 4)
        )
    })
}

/// The EP problems, worst first: a flipped id convention names itself and the ranks it hurt.
fn ep_failures(a: &EpArgs, fault: Option<EpFault>, x: &EpResult, h: usize) -> Vec<String> {
    let mut out = vec![];
    let ag = &x.agreement;
    if !ag.within_bound {
        let mut hurt: Vec<String> = vec![];
        for r in &x.ranks {
            let s = &r.slots;
            if s.dropped > 0 {
                hurt.push(format!(
                    "rank {} silently dropped {} of its {} (token, slot) pairs{}",
                    r.rank,
                    s.dropped,
                    s.owned,
                    share_text(r)
                ));
            }
            if s.wrong_expert > 0 {
                hurt.push(format!(
                    "rank {} ran {} of its pairs on the wrong expert",
                    r.rank, s.wrong_expert
                ));
            }
            if s.spurious > 0 {
                hurt.push(format!(
                    "rank {} computed {} pairs of other ranks' experts with its own experts",
                    r.rank, s.spurious
                ));
            }
        }
        let effect = format!(
            "the EP output vs --ep 1: cosine {}, max |Δ| {} ({}x the FP32 summation-order bound)",
            f(x.vs_unsharded.cosine, 4),
            e(ag.max_abs_diff),
            e(ag.max_bound_ratio)
        );
        match fault {
            Some(flt) => {
                let convention = match flt {
                    EpFault::LocalIds => "local ids taken as global ids",
                    EpFault::GlobalIds => "global ids taken as local ids",
                };
                out.push(format!(
                    "EP {} ({}): {convention} — every rank is {}: {}; {effect}",
                    a.ep,
                    a.placement.name(),
                    flt.describe(),
                    if hurt.is_empty() {
                        "no rank dropped or misrouted a pair".to_string()
                    } else {
                        hurt.join("; ")
                    }
                ));
            }
            None => {
                let mut msg = ep_disagreement(a, ag, h, "output").unwrap_or_default();
                if !hurt.is_empty() {
                    msg.push_str(&format!(" ({})", hurt.join("; ")));
                }
                out.push(msg);
            }
        }
    }
    if x.run.reduce.consistent_across_gpus == Some(false) {
        out.push(
            "the NCCL all-reduce left different sums on the GPUs: every rank must end with the same output"
                .into(),
        );
    }
    out
}

fn ep_section(a: &EpArgs, fault: Option<EpFault>, x: &EpResult, h: usize) -> Section {
    let ag = &x.agreement;
    let r = &x.run.reduce;
    Section::kv(
        format!("Expert parallelism: EP {} ({})", a.ep, a.placement.name()),
        &[
            (
                "id convention",
                match fault {
                    Some(flt) => {
                        format!("FLIPPED ({}): every rank is {}", flt.name(), flt.describe())
                    }
                    None => "global ids, expert_map applied on each rank".into(),
                },
            ),
            (
                "all-reduce",
                match (&r.nccl_version, &r.note) {
                    (Some(v), _) => format!("NCCL {v} over {} GPUs", r.devices),
                    (None, Some(n)) => format!("host, rank order ({n})"),
                    (None, None) => format!("host, rank order ({} device(s))", r.devices),
                },
            ),
            (
                "vs --ep 1",
                format!(
                    "{}: {} of {} values differ, max |Δ| {} at {}, {}x the bound",
                    if ag.bitwise_equal {
                        "bitwise equal"
                    } else if ag.within_bound {
                        "within FP32 summation order"
                    } else {
                        "OUTSIDE FP32 summation order"
                    },
                    ag.differing,
                    ag.len,
                    e(ag.max_abs_diff),
                    at(ag.max_abs_diff_index, h),
                    e(ag.max_bound_ratio)
                ),
            ),
            ("cosine vs --ep 1", f(x.vs_unsharded.cosine, 6)),
        ],
    )
}

fn rank_table(ranks: &[ep::RankSummary]) -> Section {
    let mut s = Section::new(
        "EP ranks",
        &[
            "rank",
            "device",
            "experts",
            "handed",
            "taken as",
            "owned",
            "computed",
            "dropped",
            "wrong expert",
            "spurious",
            "share cosine",
            "routing findings",
        ],
    );
    for r in ranks {
        let kinds: Vec<String> = r
            .routing_findings
            .iter()
            .map(|x| {
                serde_json::to_value(x.kind)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_string))
                    .unwrap_or_default()
            })
            .collect();
        s.row(vec![
            r.rank.to_string(),
            r.device.clone(),
            r.experts.clone(),
            json!(r.handed).as_str().unwrap_or("").to_string(),
            json!(r.taken_as).as_str().unwrap_or("").to_string(),
            r.slots.owned.to_string(),
            r.slots.computed.to_string(),
            r.slots.dropped.to_string(),
            r.slots.wrong_expert.to_string(),
            r.slots.spurious.to_string(),
            r.share.as_ref().map_or("-".into(), |m| f(m.cosine, 4)),
            if kinds.is_empty() {
                "-".into()
            } else {
                kinds.join(", ")
            },
        ]);
    }
    s
}

/// `--cuda-graph`: the NVFP4 forward captured in a CUDA graph, replayed, against its eager run.
#[derive(Serialize)]
struct GraphCheck {
    device: String,
    replays: usize,
    len: usize,
    graph_replay_bitwise_equal: bool,
    /// Output values whose bits differ from the eager run (over all replays, the worst).
    differing: usize,
    first_differing_index: Option<usize>,
    act_stats_equal: bool,
}

fn graph_check(
    cuda: &CudaBackend,
    layer: &MoeLayer,
    hidden: &[f32],
    routing: &Routing,
    scales: &ActScales,
) -> Result<GraphCheck> {
    const REPLAYS: usize = 2;
    let mut fwd = Nvfp4Forward::new(
        cuda.gpu(),
        layer,
        routing.tokens,
        scales,
        Flavor::Reference,
        false,
    )?;
    fwd.set_hidden(hidden)?;
    fwd.set_routing(layer, routing)?;
    let eager = fwd.run()?;
    let graph = fwd.capture()?;
    let mut check = GraphCheck {
        device: cuda.name(),
        replays: REPLAYS,
        len: eager.out.len(),
        graph_replay_bitwise_equal: true,
        differing: 0,
        first_differing_index: None,
        act_stats_equal: true,
    };
    for _ in 0..REPLAYS {
        let replay = graph.run()?;
        let (n, first) = par::bits_differing(&replay.out, &eager.out);
        if n > check.differing {
            check.differing = n;
            check.first_differing_index = first;
        }
        check.act_stats_equal &= replay.act_stats == eager.act_stats;
    }
    check.graph_replay_bitwise_equal = check.differing == 0 && check.act_stats_equal;
    Ok(check)
}

/// One rank's routing dump, for `nvfp4dbg routing`.
#[derive(Serialize)]
struct RoutingDumpFile {
    rank: usize,
    file: String,
    /// The command that checks it.
    command: String,
}

/// Write each rank's routing dump: the ids it was handed (its kernel's view), the weights,
/// the layer input. Without EP, rank 0 of 1 gets the router's output.
fn save_routing(
    dir: &Path,
    a: &EpArgs,
    fault: Option<EpFault>,
    layer: &MoeLayer,
    batch: &Batch,
    routing: &Routing,
    run: Option<&EpOutput>,
) -> Result<Vec<RoutingDumpFile>> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let (t, k, h) = (routing.tokens, routing.top_k, layer.config.hidden_size);
    let e = layer.config.n_routed_experts;
    let global: Vec<i64> = routing.topk_ids.iter().map(|&v| v as i64).collect();
    let views: Vec<(usize, &[i64], crate::moe::ep::check::IdSpace)> = match run {
        Some(r) => r
            .ranks
            .iter()
            .map(|x| {
                (
                    x.rank(),
                    x.plan.handed.as_slice(),
                    x.plan.convention.taken_as,
                )
            })
            .collect(),
        None => vec![(0, global.as_slice(), crate::moe::ep::check::IdSpace::Global)],
    };
    let size = if run.is_some() { a.ep } else { 1 };
    let mut out = vec![];
    for (rank, ids, space) in views {
        let file = dir.join(format!("rank{rank}.safetensors"));
        let space_name = json!(space).as_str().unwrap_or("global").to_string();
        let mut meta = std::collections::BTreeMap::new();
        meta.insert("layer".to_string(), layer.index.to_string());
        meta.insert("ep_rank".to_string(), rank.to_string());
        meta.insert("ep_size".to_string(), size.to_string());
        meta.insert("placement".to_string(), a.placement.name().to_string());
        meta.insert("ids".to_string(), space_name.clone());
        meta.insert("num_experts".to_string(), e.to_string());
        meta.insert(
            "fault".to_string(),
            fault.map_or("none".to_string(), |f| f.name().to_string()),
        );
        let mut tensors = vec![
            (
                TensorSpec::new("topk_ids", Dtype::I64, &[t, k]),
                i64_bytes(ids),
            ),
            (
                TensorSpec::new("topk_weights", Dtype::F32, &[t, k]),
                f32_bytes(&routing.topk_weights),
            ),
            (
                TensorSpec::new("hidden_states", Dtype::F32, &[t, h]),
                f32_bytes(&batch.hidden),
            ),
        ];
        if let Some(ids) = batch.input_ids.as_deref().filter(|v| v.len() == t) {
            tensors.push((
                TensorSpec::new("input_ids", Dtype::I64, &[t]),
                i64_bytes(ids),
            ));
        }
        write_file(&file, tensors, Some(meta))?;
        out.push(RoutingDumpFile {
            rank,
            file: file.display().to_string(),
            command: format!(
                "nvfp4dbg routing {} --num-experts {e} --ep-rank {rank} --ep-size {size} --placement {} --ids {space_name}",
                file.display(),
                a.placement.name()
            ),
        });
    }
    Ok(out)
}

pub(crate) fn slots(o: &MoeOutput) -> Result<&[f32]> {
    o.per_slot
        .as_deref()
        .ok_or_else(|| Error::usage("internal: the backend returned no per-slot outputs"))
}

/// On a GPU, re-run the NVFP4 path on the CPU (same routing, same scales) when the layer is
/// small enough, and compare: this isolates the kernel from quantization error.
fn kernel_check(
    backend: &dyn Backend,
    layer: &MoeLayer,
    hidden: &[f32],
    routing: &crate::moe::Routing,
    path: &MoePath,
    nv: &MoeOutput,
) -> Result<KernelCheck> {
    let name = backend.name();
    let mut kc = KernelCheck {
        backend: name.clone(),
        done: false,
        reason: None,
        min_cosine: KERNEL_CHECK_MIN_COSINE,
        metrics: None,
        pass: None,
    };
    if name == "cpu" {
        return Ok(kc);
    }
    let macs = crate::moe::byok::routed_macs(&layer.config, routing);
    if macs > KERNEL_CHECK_MAX_MACS {
        kc.reason = Some(format!(
            "{macs:.1e} multiply-adds on the CPU is too many (limit {KERNEL_CHECK_MAX_MACS:.0e}); use fewer --tokens"
        ));
        return Ok(kc);
    }
    let cpu = CpuBackend::new().moe_forward(layer, hidden, routing, path, false)?;
    let m = crate::metrics::compare(&nv.out, &cpu.out);
    kc.pass = Some(m.passes(KERNEL_CHECK_MIN_COSINE));
    kc.metrics = Some(m);
    kc.done = true;
    Ok(kc)
}

/// One expert's error and what its gate/up input blocks went through.
#[derive(Serialize)]
struct ExpertRow {
    #[serde(flatten)]
    m: ExpertMetrics,
    gate_up_input: BlockSummary,
    /// `pass`, `fail`, or `too-few-slots` (misses --min-expert-cosine on fewer than
    /// --min-expert-slots slots, within NVFP4 noise there).
    verdict: &'static str,
}

impl ExpertRow {
    /// A likely cause, in words, when the activation blocks point at one.
    fn cause(&self) -> String {
        blocks_cause(&self.gate_up_input)
    }
}

/// `; N% of its gate/up input blocks saturate (scale 448) ...` or `... flush to zero ...`
/// when one expert's gate/up input blocks `b` point at its gs1.
fn blocks_cause(b: &BlockSummary) -> String {
    if b.saturated_pct >= 20.0 {
        format!(
            "; {:.0}% of its gate/up input blocks saturate (scale 448): its activation global scale (gs1) is too large for its inputs",
            b.saturated_pct
        )
    } else if b.flushed_pct >= 20.0 {
        format!(
            "; {:.0}% of its gate/up input blocks flush to zero: its activation global scale (gs1) is too small",
            b.flushed_pct
        )
    } else {
        String::new()
    }
}

/// The experts no token of the batch reaches (in any of `routings`) whose own weights hold
/// NaN block scale codes or a non-finite `weight_scale_2`, one failure line each: the batch's
/// output cannot show them, but every token an engine routes there comes out NaN (a small
/// batch reaches a fraction of 256 experts).
pub fn unreached_nonfinite_experts(layer: &MoeLayer, routings: &[&Routing]) -> Vec<String> {
    use rayon::prelude::*;
    let mut reached = vec![false; layer.experts.len()];
    for id in routings.iter().flat_map(|r| &r.topk_ids) {
        if let Some(x) = usize::try_from(*id).ok().and_then(|i| reached.get_mut(i)) {
            *x = true;
        }
    }
    let lines: Vec<Option<String>> = (0..layer.experts.len())
        .into_par_iter()
        .map(|e| match reached[e] {
            true => None,
            false => nonfinite_weights(layer, e).map(|w| {
                format!(
                    "expert {e} (no token of this batch reaches it){w}; every token routed \
                     there comes out NaN"
                )
            }),
        })
        .collect();
    lines.into_iter().flatten().collect()
}

/// `: its gate_proj ...` when expert `expert`'s own weights hold NaN block scale codes or a
/// non-finite `weight_scale_2`: the NaN it produces comes from the checkpoint, not the kernel.
pub fn nonfinite_weights(layer: &MoeLayer, expert: usize) -> Option<String> {
    let ex = layer.experts.get(expert)?;
    let mut parts: Vec<String> = vec![];
    for (proj, lin) in [
        ("gate_proj", &ex.w1),
        ("up_proj", &ex.w3),
        ("down_proj", &ex.w2),
    ] {
        let w = &lin.weight;
        let nan = |c: u8| match w.format {
            crate::nvfp4::Format::Nvfp4 => crate::nvfp4::e4m3::is_nan(c),
            crate::nvfp4::Format::Mxfp4 => c == 0xFF,
        };
        let count = w.scales.iter().filter(|&&c| nan(c)).count();
        if let Some(i) = w.scales.iter().position(|&c| nan(c)) {
            let per_row = (w.cols / w.format.block()).max(1);
            parts.push(format!(
                "its {proj} holds {count} NaN block scale code{} (first at row {}, block {})",
                if count == 1 { "" } else { "s" },
                i / per_row,
                i % per_row
            ));
        }
        if !w.scale_2.is_finite() {
            parts.push(format!("its {proj} weight_scale_2 is {}", w.scale_2));
        }
    }
    (!parts.is_empty()).then(|| {
        format!(
            ": {}: the NaN comes from the checkpoint's weights, not the kernel (`nvfp4dbg audit` lists every one)",
            parts.join(", ")
        )
    })
}

/// What the activation scales in use do to the experts' inputs, from one CPU pass over them
/// ([`crate::moe::forward::expert_input_amax`]): the GEMM inputs whose gs saturates them
/// ([`gs::overshoots`]) and, under `--gs checkpoint`, the input scales in use at least
/// [`gs::MIN_FLUSH_RATIO`] above what their amax needs ([`gs::input_scales_too_large`]):
/// the cause layertest and multilayer name in a failing expert's line. Their JSON
/// `input_scale_saturate` and `input_scale_flush` (gs-sweep's too) judge the checkpoint's
/// `input_scale`s the same way under every gs source: they are what the engine will use.
pub struct ScaleFindings {
    pub over: Vec<gs::GsOvershoot>,
    pub too_large: Vec<gs::InputScaleTooLarge>,
    /// The per-expert amax of the GEMM inputs (before W1/W3, before W2) they come from.
    pub amax: (
        crate::moe::forward::ExpertAmax,
        crate::moe::forward::ExpertAmax,
    ),
    /// The checkpoint's `input_scale`s judged against that amax, whatever the gs in use:
    /// the GEMM inputs `1/input_scale` saturates, and the input scales that flush theirs;
    /// `None` when the layer's experts carry no usable input scales.
    checkpoint: Option<(Vec<gs::GsOvershoot>, Vec<gs::InputScaleTooLarge>)>,
}

impl ScaleFindings {
    /// The findings of `scales` (from `source`, reduced by `reduce`) on `layer`'s experts fed
    /// `hidden` through `routing`.
    pub fn of(
        layer: &MoeLayer,
        amax: &BatchAmax,
        scales: &ActScales,
        source: GsSource,
        reduce: InputScaleReduce,
    ) -> Result<Self> {
        let (a1, a2) = amax.get()?.clone();
        let too_large = |reduce| -> Vec<gs::InputScaleTooLarge> {
            gs::input_scales_too_large(layer, reduce, &a1, &a2)
                .into_iter()
                .filter(|o| o.layer_ratio >= gs::MIN_FLUSH_RATIO)
                .collect()
        };
        let over = gs::overshoots(scales, &a1, &a2);
        let (in_use, checkpoint) = match source {
            GsSource::Checkpoint => {
                let t = too_large(reduce);
                (t.clone(), Some((over.clone(), t)))
            }
            // another gs in use: the checkpoint's input scales, as the engine will take them
            // (none to judge where they are missing or unusable: `audit` names those)
            _ => (
                vec![],
                gs::checkpoint_scales(layer, reduce)
                    .ok()
                    .map(|s| (gs::overshoots(&s, &a1, &a2), too_large(reduce))),
            ),
        };
        Ok(ScaleFindings {
            over,
            too_large: in_use,
            amax: (a1, a2),
            checkpoint,
        })
    }

    /// Whether to judge the scales on `layer`: wherever its experts carry checkpoint input
    /// scales (an engine takes them whatever gs the run uses), else only for the cause of a
    /// failing expert.
    pub fn wanted(layer: &MoeLayer, failing: bool) -> bool {
        failing
            || layer.experts.iter().any(|x| {
                [&x.w1, &x.w3, &x.w2]
                    .iter()
                    .any(|q| q.input_scale.is_some())
            })
    }

    /// The section "The checkpoint's input scales (what an engine takes)" of layertest and
    /// gs-sweep: [`checkpoint_notes`](Self::checkpoint_notes) of `findings`, `None` when empty.
    pub fn checkpoint_section(
        findings: Option<&Self>,
        reciprocal: Option<&str>,
    ) -> Option<Section> {
        let notes = findings.map_or(vec![], |s| s.checkpoint_notes(reciprocal));
        (!notes.is_empty()).then(|| {
            Section::kv(
                "The checkpoint's input scales (what an engine takes)",
                &notes,
            )
        })
    }

    /// The text notes on the checkpoint's input scales, whatever the gs in use: `reciprocal`
    /// (the sentence of [`Model::reciprocal_input_scales`], where not already a failure), then
    /// the (up to three) worst GEMM inputs `1/input_scale` saturates and input scales that
    /// flush theirs, each naming the expert, the projections and the stored value.
    pub fn checkpoint_notes(&self, reciprocal: Option<&str>) -> Vec<(&'static str, String)> {
        let mut out = vec![];
        if let Some(t) = reciprocal {
            out.push((
                "input_scale",
                format!("{t}; `--gs checkpoint` runs the layer under them"),
            ));
        }
        let Some((over, too_large)) = &self.checkpoint else {
            return out;
        };
        let over = over.iter().filter(|o| o.ratio >= gs::MIN_OVERSHOOT_RATIO);
        for o in over.take(3) {
            let projs = match o.gemm {
                "down" => "down_proj",
                _ => "gate_proj/up_proj",
            };
            out.push((
                "saturates",
                format!(
                    "expert {} {projs} input_scale {}: its gs {} is {}x the {} its amax allows \
                     (blocks saturate at 448)",
                    o.expert,
                    e(1.0 / o.gs as f64),
                    e(o.gs as f64),
                    f(o.ratio as f64, 1),
                    e(o.fits as f64)
                ),
            ));
        }
        for o in too_large.iter().take(3) {
            out.push((
                "flushes",
                format!("{}: its blocks flush to zero", o.describe()),
            ));
        }
        out
    }

    /// Why `expert` fails, in words, where its inputs show it: its gate/up input blocks
    /// `gate_up` saturated or flushed, its inputs' gs past what their amax allows, its
    /// checkpoint input_scale flushing them (`""` when none).
    pub fn cause(&self, expert: usize, gate_up: &BlockSummary) -> String {
        let blocks = blocks_cause(gate_up);
        let named = !blocks.is_empty();
        let flush: String = self
            .too_large
            .iter()
            .filter(|o| o.expert == expert && !o.sets_layer_max)
            .map(|o| format!("; {}: its blocks flush to zero", o.describe()))
            .collect();
        blocks + &input_cause(&self.over, expert, named) + &flush
    }

    /// Under `--input-scale-reduce global-max`, one line per expert whose input_scale is the
    /// layer-wide max that flushes every expert's inputs: they lead the failing experts'.
    pub fn layer_max_lines(&self) -> Vec<String> {
        self.too_large
            .iter()
            .filter(|o| o.sets_layer_max)
            .map(|o| {
                format!(
                    "{}: the {} input blocks of every expert flush to zero under it",
                    o.describe(),
                    o.gemm
                )
            })
            .collect()
    }

    /// JSON `input_scale_flush`: the checkpoint input scales that flush their inputs, worst
    /// first, whatever the gs in use; `None` when the checkpoint carries none to judge.
    pub fn flush_json(&self) -> Option<serde_json::Value> {
        self.checkpoint.as_ref().map(|(_, t)| json!(t))
    }

    /// JSON `input_scale_saturate`: the expert GEMM inputs whose gs, `1/input_scale` of the
    /// checkpoint, is at least [`gs::MIN_OVERSHOOT_RATIO`] past what their amax allows, worst
    /// first, whatever the gs in use; `None` when the checkpoint carries none to judge.
    pub fn saturate_json(&self) -> Option<serde_json::Value> {
        self.checkpoint.as_ref().map(|(over, _)| {
            let v: Vec<&gs::GsOvershoot> = over
                .iter()
                .filter(|o| o.ratio >= gs::MIN_OVERSHOOT_RATIO)
                .collect();
            json!(v)
        })
    }
}

/// `; its down_proj input saturates: ...` when `expert`'s gs2 is at least twice what the
/// amax of its SwiGLU output allows (see [`gs::overshoots`]), and the same for its gate/up
/// input (gs1) unless `gate_up_named` (its saturated blocks already named it): one expert's
/// `input_scale` 100x too small saturates only its input blocks of large values, which on
/// real activations (a few massive channels) can stay under the share `cause` names.
fn input_cause(over: &[gs::GsOvershoot], expert: usize, gate_up_named: bool) -> String {
    let mut out = String::new();
    for (gemm, what, proj) in [
        ("gate/up", "gate/up", "gate_proj/up_proj"),
        ("down", "down_proj", "down_proj"),
    ] {
        if gemm == "gate/up" && gate_up_named {
            continue;
        }
        if let Some(o) = over
            .iter()
            .find(|o| o.expert == expert && o.gemm == gemm && o.ratio >= gs::MIN_OVERSHOOT_RATIO)
        {
            out += &format!(
                "; its {what} input saturates: gs{} {} is {}x the {} its amax allows (a {proj} input_scale too small?)",
                if gemm == "down" { 2 } else { 1 },
                e(o.gs as f64),
                f(o.ratio as f64, 1),
                e(o.fits as f64)
            );
        }
    }
    out
}

fn expert_table(experts: &[ExpertRow]) -> Section {
    let mut s = Section::new(
        "Worst experts (unweighted expert output, NVFP4 vs reference)",
        &[
            "expert",
            "slots",
            "cosine",
            "rel_l2",
            "max_abs_err",
            "NaN",
            "Inf",
            "gate/up input saturated %",
            "verdict",
        ],
    );
    for r in experts.iter().take(5) {
        let x = &r.m;
        s.row(vec![
            x.expert.to_string(),
            x.slots.to_string(),
            f(x.metrics.cosine, 5),
            f(x.metrics.rel_l2, 4),
            e(x.metrics.max_abs_err),
            x.metrics.nan_count.to_string(),
            x.metrics.inf_count.to_string(),
            format!("{:.1}", r.gate_up_input.saturated_pct),
            r.verdict.replace('-', " "),
        ]);
    }
    s
}

fn token_table(tokens: &[TokenMetrics]) -> Section {
    let mut s = Section::new(
        "Worst tokens",
        &["token", "cosine", "rel_l2", "max_abs_err", "NaN", "Inf"],
    );
    for x in tokens.iter().take(5) {
        s.row(vec![
            x.token.to_string(),
            f(x.metrics.cosine, 5),
            f(x.metrics.rel_l2, 4),
            e(x.metrics.max_abs_err),
            x.metrics.nan_count.to_string(),
            x.metrics.inf_count.to_string(),
        ]);
    }
    s
}

#[allow(clippy::too_many_arguments)]
fn save_outputs(
    path: &Path,
    nv: &[f32],
    rf: &[f32],
    ids: &[i32],
    w: &[f32],
    t: usize,
    h: usize,
    k: usize,
) -> Result<()> {
    let ids64: Vec<i64> = ids.iter().map(|&v| v as i64).collect();
    write_file(
        path,
        vec![
            (
                TensorSpec::new("nvfp4_out", Dtype::F32, &[t, h]),
                f32_bytes(nv),
            ),
            (
                TensorSpec::new("reference_out", Dtype::F32, &[t, h]),
                f32_bytes(rf),
            ),
            (
                TensorSpec::new("topk_ids", Dtype::I64, &[t, k]),
                i64_bytes(&ids64),
            ),
            (
                TensorSpec::new("topk_weights", Dtype::F32, &[t, k]),
                f32_bytes(w),
            ),
        ],
        None,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::moe::synthetic::{Preset, SyntheticModel};
    use crate::nvfp4::Fp4Tensor;

    // guards: `--input` with `--tokens N` decoded the whole hidden_states (a 4 GiB capture
    // used for 8 tokens took 12.6 GB of RAM, and aborted under a memory limit)
    #[test]
    fn read_input_decodes_only_the_rows_used() {
        use rand::{Rng, SeedableRng};
        let seed = rand::random::<u64>();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let (rows, hidden, take) = (1usize << 22, 256usize, 8usize);
        let head: Vec<f32> = (0..take * hidden)
            .map(|_| rng.gen_range(-4.0f32..4.0))
            .collect();
        let header = format!(
            r#"{{"hidden_states":{{"dtype":"F32","shape":[{rows},{hidden}],"data_offsets":[0,{}]}}}}"#,
            rows * hidden * 4
        );
        let mut hb = header.into_bytes();
        hb.resize(hb.len().next_multiple_of(8), b' ');
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("huge.safetensors");
        let mut bytes = (hb.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(&hb);
        bytes.extend(head.iter().flat_map(|v| v.to_le_bytes()));
        std::fs::write(&path, &bytes).unwrap();
        // the rest of the 4 GiB tensor is a hole: sparse on disk, never decoded
        let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        f.set_len((8 + hb.len() + rows * hidden * 4) as u64)
            .unwrap();
        let (h, ids, n) = read_input(&path, hidden, Some(take)).unwrap();
        assert_eq!(n, rows, "seed {seed}");
        assert!(ids.is_none());
        assert_eq!(h, head, "seed {seed}");
    }

    /// A stand-in GPU: the CPU result, optionally with an error on one value, under a CUDA name.
    struct FakeGpu {
        perturb: bool,
    }

    impl Backend for FakeGpu {
        fn name(&self) -> String {
            "cuda:0 (fake)".into()
        }
        fn route(
            &self,
            l: &MoeLayer,
            h: &[f32],
            ids: Option<&[i64]>,
        ) -> Result<crate::moe::Routing> {
            CpuBackend::new().route(l, h, ids)
        }
        fn moe_forward(
            &self,
            l: &MoeLayer,
            h: &[f32],
            r: &crate::moe::Routing,
            p: &MoePath,
            per_slot: bool,
        ) -> Result<MoeOutput> {
            let mut o = CpuBackend::new().moe_forward(l, h, r, p, per_slot)?;
            if self.perturb {
                // a kernel that drops one expert slot of token 0
                let hsz = l.config.hidden_size;
                let ps = o
                    .per_slot
                    .clone()
                    .unwrap_or_else(|| vec![0.0; o.out.len() * r.top_k]);
                for j in 0..hsz {
                    o.out[j] -= r.topk_weights[0] * ps.get(j).copied().unwrap_or(1.0);
                }
            }
            Ok(o)
        }
        fn quantize(
            &self,
            x: &[f32],
            r: usize,
            c: usize,
            gs: f32,
            f: Flavor,
        ) -> Result<(Fp4Tensor, BlockStats)> {
            CpuBackend::new().quantize(x, r, c, gs, f)
        }
        fn compare(&self, t: &[f32], r: &[f32]) -> Result<Metrics> {
            Ok(crate::metrics::compare(t, r))
        }
    }

    #[test]
    fn kernel_check_compares_a_gpu_against_the_cpu_nvfp4_path() {
        let seed: u64 = rand::random();
        let m = SyntheticModel::new(Preset::Tiny, seed);
        let layer = m.moe_layer(1).unwrap();
        let (x, ids) = m.activations(1, 8, seed);
        let r = crate::moe::route(&layer, &x, Some(&ids)).unwrap();
        let s = ActScales::Dynamic;
        let p = MoePath::Nvfp4 {
            scales: &s,
            flavor: Flavor::Reference,
        };
        for perturb in [false, true] {
            let gpu = FakeGpu { perturb };
            let nv = gpu.moe_forward(&layer, &x, &r, &p, true).unwrap();
            let kc = kernel_check(&gpu, &layer, &x, &r, &p, &nv).unwrap();
            assert!(kc.done, "seed {seed}");
            assert_eq!(kc.pass, Some(!perturb), "seed {seed}: {:?}", kc.metrics);
        }
        // the CPU backend is the reference: nothing to check
        let cpu = CpuBackend::new();
        let nv = cpu.moe_forward(&layer, &x, &r, &p, false).unwrap();
        let kc = kernel_check(&cpu, &layer, &x, &r, &p, &nv).unwrap();
        assert!(!kc.done && kc.reason.is_none());
        // too large for the CPU: skipped, saying why
        let mut big = r.clone();
        big.tokens = 1 << 30;
        let kc = kernel_check(&FakeGpu { perturb: false }, &layer, &x, &big, &p, &nv).unwrap();
        assert!(!kc.done && kc.reason.is_some_and(|w| w.contains("--tokens")));
    }

    #[test]
    fn ranges_are_compact() {
        assert_eq!(ranges(&[1, 2, 3, 5, 7, 8]), "1..=3, 5, 7..=8");
        assert_eq!(ranges(&[]), "none");
    }
}
