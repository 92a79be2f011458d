//! `audit`: a static scan of a checkpoint for the hazards that make an NVFP4 model return NaN
//! or garbage in an engine while every kernel test passes. Numerics and judgement only; the CLI
//! renders the result.
//!
//! What is a hazard (each one a [`Finding`] of [`Severity::Error`], each one exit 1):
//! - a global scale (`weight_scale_2`, `input_scale`, or their compressed-tensors reciprocals)
//!   that is NaN, infinite, zero or negative;
//! - E4M3 NaN codes (`0x7F`/`0xFF`) or negative values among the block scales;
//! - a block scale of zero (MXFP4: E8M0 code 0, 2^-127) over a block whose FP4 codes are not
//!   all ±0: its weights dequantize to 0 (a whole row: a dead output channel). Quantizers
//!   write scale 0 only over an all-zero block, whose codes are then ±0 (`rcp(0) = 0`), and
//!   that passes;
//! - finite scales whose product with a block's codes overflows f32 (`(e2m1 × s) ×
//!   weight_scale_2`; an E8M0 scale of 2^127): the block dequantizes to Inf;
//! - more than `saturation_limit` (default 1%) and more than [`SATURATED_HANDFUL`] of the block
//!   scales at 448. With the auto-scaled `gs = 2688/amax`, only blocks whose max is within ~3.6%
//!   of the tensor's amax round to 448 (432/448): a handful per tensor, far below 1% of the
//!   blocks of any real weight. More means a global scale too large: elements are clipped;
//! - gate/up (`w1`/`w3`) `weight_scale_2` of one expert that differ beyond vLLM's own
//!   `allclose` check (rtol 1e-5, atol 1e-8): vLLM's FusedMoE keeps only the gate's, so the up
//!   projection is silently rescaled;
//! - an `input_scale` more than `input_scale_outlier` (default 10) times the median of the
//!   same projection over the layer's experts, or less than the median over that factor.
//!   Engines that take the max over experts let one high outlier set the activation scale of
//!   all of them; engines that quantize per expert (`gs = 1/input_scale` of that expert, as
//!   `layertest --input-scale-reduce per-expert` does) clip a low one's activations;
//! - a `weight_scale_2` more than `weight_scale_outlier` (default 100) times the median of the
//!   same projection over the layer's experts, or less than the median over that factor: the
//!   experts' weight amaxes differ by a few x, so such a scale was corrupted or written for
//!   another tensor;
//! - a triple missing a member (weight, block scales, global scale; `input_scale` when other
//!   linears have one);
//! - a global scale that looks stored in the other convention's direction (ModelOpt
//!   `weight_scale_2 > 1`, compressed-tensors `weight_global_scale < 1`), or both stored and
//!   not reciprocal;
//! - a packed weight that is all zero (codes of magnitude 0 only: never-loaded memory);
//! - NVFP4 block scales all one value over at least [`UNIFORM_MIN_BLOCKS`] blocks (a
//!   quantizer that ignored each block's amax, or a constant-filled scale tensor);
//! - one bitwise-identical down-projection `input_scale` for every expert of a layer while
//!   another layer's experts hold their own (per-expert scales overwritten with one value);
//! - a packed weight or block-scale tensor byte-identical to another linear's (one expert's
//!   tensor written or loaded under another's name);
//! - NaN/Inf in any float tensor (routers, norms, biases, BF16 weights);
//! - a checkpoint directory holding quantized linears but no config.json (engines build the
//!   model from it; a single .safetensors file given as PATH needs none);
//! - config.json promising NVFP4 while no NVFP4 tensor exists, or NVFP4 tensors without a
//!   `quantization_config`, or under one of another method or algorithm (`quant_method: fp8`:
//!   engines pick their loader from it), or a group size other than 16;
//! - an exclude list (exclude_modules / ignore) covering quantized linears, or an NVFP4 config
//!   whose exclude list leaves out float (BF16/F16/F32) linears (not embeddings, heads or the
//!   router gate, which engines never quantize): engines build an NVFP4 layer there;
//! - an MoE layer's expert, shared-expert or router weight whose `[out, in]` is not what
//!   config.json's `hidden_size`, `moe_intermediate_size`, `n_shared_experts` and
//!   `n_routed_experts` make it (the engine builds the layer from config.json); a dense
//!   layer's MLP weight not what `intermediate_size` and `hidden_size` make it, or a dense MLP
//!   in a layer config.json makes MoE; layers past `num_hidden_layers` (+ MTP layers); layers
//!   up to `num_hidden_layers` that a whole model (one holding the embedding or lm_head) lacks,
//!   that an excerpt lacks between its first and last, or that hold no MLP or expert weights;
//! - a tensor a shard listed in `model.safetensors.index.json` stores but its `weight_map`
//!   leaves out (transformers loads by the weight_map and never sees it; vLLM, which reads
//!   every tensor of the listed shards, loads it);
//! - when the checkpoint ships BF16 originals (`DIR/bf16/`) and `originals` is on: a quantized
//!   linear whose dequantized weight is not its original (cosine below
//!   `min_original_cosine`, or the wrong magnitude), with the original it matches instead
//!   when its layer holds one; an original of another shape; an original of a tensor the
//!   checkpoint lacks (see `checkpoint::originals`);
//! - in an engine dump's vLLM-fused expert tensors (`w13_weight [E, 2I, H/2]`, `w2_weight`):
//!   each expert and each w13 half gets the block-scale and global-scale checks above, with
//!   its scales read linear or in the 128x4 swizzle their size shows (both where the size
//!   cannot tell: a zeroed or overflowing block must show under both), see [`fused`].
//!
//! Warnings ([`Severity::Warning`], reported, verdict still pass): a config.json field left out
//! whose default differs between the config classes engines read it with
//! (`config::ENGINE_DEFAULTS`: `routed_scaling_factor` is 2.5 in transformers' DeepseekV3Config,
//! 1.0 in DeepSeek-V2's configuration_deepseek.py); HF-style configs only (a native `dim`
//! config is read by DeepSeek's own inference code).
//!
//! - a triple whose members' shapes or dtypes cannot belong together (packed weight, block
//!   scales, global scales): named, and the rest of the checkpoint is still scanned.
//!
//! A file that cannot be read as safetensors, or a checkpoint directory that cannot be read,
//! is bad input (exit 2), not a finding.

mod fused;

use super::config::{exclude_pattern, ExcludeList, QuantMethod};
use super::file::{is_float, TensorFile, TensorInfo};
use super::formats::{self, Convention, LinearNames};
use super::hf::Checkpoint;
use super::names::Naming;
use super::originals::{self, OriginalCheck};
use super::source::TensorSource;
use crate::error::{Error, Result};
use crate::nvfp4::{e2m1, e4m3, ue8m0, Format, ScaleProblem};
use rayon::prelude::*;
use safetensors::Dtype;
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

/// Saturated block scales an auto-scaled tensor may have whatever its size (the blocks next to
/// its amax); only past this many does the fraction matter.
pub const SATURATED_HANDFUL: u64 = 8;

/// E2M1 magnitude index of 2.0: a block at 448 whose codes all stay at or below it holds no
/// element near the tensor's amax.
const SMALL_CODE: u8 = 4;

#[derive(Clone, Debug)]
pub struct AuditOptions {
    /// Fraction of block scales at 448 above which a tensor is flagged.
    pub saturation_limit: f64,
    /// `input_scale / median` above which an expert's input_scale is flagged.
    pub input_scale_outlier: f32,
    /// The same for `weight_scale_2` (the expert's weight amax / 2688: experts of one
    /// projection differ by a few x, not by this much).
    pub weight_scale_outlier: f32,
    /// Compare each quantized linear with its BF16 original when the checkpoint ships them.
    pub originals: bool,
    /// Cosine with the original below which a linear is flagged ([`originals::MIN_COSINE`]).
    pub min_original_cosine: f64,
}

impl Default for AuditOptions {
    fn default() -> Self {
        AuditOptions {
            saturation_limit: 0.01,
            input_scale_outlier: 10.0,
            weight_scale_outlier: 100.0,
            originals: true,
            min_original_cosine: originals::MIN_COSINE,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FindingKind {
    NonfiniteGlobalScale,
    NonpositiveGlobalScale,
    NanBlockScales,
    NegativeBlockScales,
    SaturatedBlockScales,
    GateUpScaleMismatch,
    InputScaleOutlier,
    WeightScaleOutlier,
    MissingMember,
    ConventionSuspect,
    ConflictingGlobalScales,
    AllZeroWeight,
    NonfiniteValues,
    ConfigMismatch,
    BlockScaleDtype,
    DuplicateTensor,
    UnindexedTensor,
    OriginalMismatch,
    OriginalShapeMismatch,
    OrphanOriginal,
    UniformBlockScales,
    CopyOfAnotherTensor,
    SharedInputScale,
    DefaultsDisagree,
    /// An MoE layer no engine can run as config.json describes it: its router (weight,
    /// selection bias, hash table) or shared expert missing or misshapen.
    BrokenLayer,
    /// Block scales zero (MXFP4: E8M0 code 0, 2^-127) over blocks whose FP4 codes are not
    /// all ±0: weights (often whole output channels) dequantize to 0.
    ZeroBlockScales,
    /// A checkpoint directory with quantized linears and no config.json: no engine loads it.
    MissingConfig,
    /// Finite scales whose product with a block's codes overflows f32: the block dequantizes
    /// to Inf.
    NonfiniteDequant,
    /// A `*.safetensors` file next to the index that the index does not list: its tensors the
    /// `weight_map` names nowhere are loaded by no engine; a `model.safetensors` there is what
    /// transformers loads instead of the index.
    UnlistedShard,
    /// Block scales at 448 over blocks whose FP4 codes are all small (|code| ≤ 2): a quantizer
    /// writes 448 only over the blocks next to the tensor's amax, whose codes reach 6.
    OversizedBlockScales,
    /// A triple whose members' dtypes or shapes cannot belong together (a packed weight that
    /// is not `[N, K/2]`, block scales not `[N, K/16]`, a global scale that is not one float):
    /// no engine loads it. The linear is not scanned further; the rest of the checkpoint is.
    Misshapen,
}

/// Errors fail the audit (exit 1); warnings are reported and leave the verdict pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Severity {
    Error,
    Warning,
}

impl FindingKind {
    pub fn severity(self) -> Severity {
        match self {
            // engines may agree by chance: a hazard only where they read different defaults
            FindingKind::DefaultsDisagree => Severity::Warning,
            _ => Severity::Error,
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            FindingKind::NonfiniteGlobalScale => "non-finite global scale",
            FindingKind::NonpositiveGlobalScale => "zero/negative global scale",
            FindingKind::NanBlockScales => "NaN block scales",
            FindingKind::NegativeBlockScales => "negative block scales",
            FindingKind::SaturatedBlockScales => "saturated block scales",
            FindingKind::GateUpScaleMismatch => "gate/up weight_scale_2 mismatch",
            FindingKind::InputScaleOutlier => "input_scale outlier",
            FindingKind::WeightScaleOutlier => "weight_scale_2 outlier",
            FindingKind::MissingMember => "missing member",
            FindingKind::ConventionSuspect => "convention confusion",
            FindingKind::ConflictingGlobalScales => "conflicting global scales",
            FindingKind::AllZeroWeight => "all-zero weight",
            FindingKind::NonfiniteValues => "NaN/Inf values",
            FindingKind::ConfigMismatch => "config mismatch",
            FindingKind::BlockScaleDtype => "block scales of the wrong dtype or shape",
            FindingKind::DuplicateTensor => "differing copy in another shard",
            FindingKind::UnindexedTensor => "not in the index's weight_map",
            FindingKind::OriginalMismatch => "differs from its BF16 original",
            FindingKind::OriginalShapeMismatch => "BF16 original of another shape or dtype",
            FindingKind::OrphanOriginal => "BF16 original without its tensor",
            FindingKind::UniformBlockScales => "every block scale identical",
            FindingKind::CopyOfAnotherTensor => "same bytes as another linear's",
            FindingKind::SharedInputScale => "one input_scale for every expert",
            FindingKind::DefaultsDisagree => "left to engines' differing defaults",
            FindingKind::BrokenLayer => "MoE layer an engine cannot build",
            FindingKind::ZeroBlockScales => "zero block scales over non-zero codes",
            FindingKind::MissingConfig => "no config.json",
            FindingKind::NonfiniteDequant => "weights dequantize to Inf",
            FindingKind::UnlistedShard => "shard the index does not list",
            FindingKind::OversizedBlockScales => "block scale 448 over small codes",
            FindingKind::Misshapen => "shape/dtype error",
        }
    }
}

#[derive(Clone, Debug)]
pub struct Finding {
    pub tensor: String,
    pub file: PathBuf,
    pub kind: FindingKind,
    pub detail: String,
}

impl Finding {
    pub fn severity(&self) -> Severity {
        self.kind.severity()
    }
}

/// As the derive would, with the kind's severity next to it.
impl Serialize for Finding {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let mut st = s.serialize_struct("Finding", 5)?;
        st.serialize_field("tensor", &self.tensor)?;
        st.serialize_field("file", &self.file)?;
        st.serialize_field("kind", &self.kind)?;
        st.serialize_field("severity", &self.severity())?;
        st.serialize_field("detail", &self.detail)?;
        st.end()
    }
}

/// What the scan saw of one quantized linear.
#[derive(Clone, Debug, Serialize)]
pub struct LinearStats {
    pub base: String,
    pub file: PathBuf,
    pub convention: Convention,
    pub format: Format,
    /// `[out, in]` of the unpacked weight.
    pub shape: [usize; 2],
    /// Dequant direction (converted from `weight_global_scale` when that is what is stored).
    pub weight_scale_2: Option<f32>,
    pub input_scale: Option<f32>,
    pub blocks: u64,
    pub saturated: u64,
    pub saturated_fraction: f64,
    pub nan_scales: u64,
    pub negative_scales: u64,
    pub zero_scales: u64,
    pub max_block_scale: f32,
    /// Against the BF16 original, when there is one (and `originals` is on).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub original: Option<OriginalCheck>,
    /// (tensor, [`fingerprint`]) of the packed weight and of the block scales, for
    /// [`copied_tensors`]; a tensor of one repeated byte has none (it has findings of its own).
    #[serde(skip)]
    pub fingerprints: Vec<(String, u64)>,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct AuditResult {
    pub path: PathBuf,
    pub tensors: usize,
    pub linears: Vec<LinearStats>,
    /// vLLM-fused expert tensors (`w13_weight`, `w2_weight` of an engine dump) scanned per
    /// expert.
    pub fused_tensors: usize,
    pub float_tensors: usize,
    /// Every byte read, the originals' included.
    pub bytes_scanned: u64,
    /// The originals directory compared against (None: none shipped, or `originals` off).
    pub originals: Option<PathBuf>,
    /// Of `bytes_scanned`, the originals' (`cat DIR/*.safetensors DIR/bf16/*.safetensors`
    /// reads the same total when every tensor is scanned).
    pub original_bytes: u64,
    pub findings: Vec<Finding>,
}

impl AuditResult {
    /// Distinct tensor names with at least one error.
    pub fn hazardous_tensors(&self) -> BTreeSet<&str> {
        self.errors().map(|f| f.tensor.as_str()).collect()
    }
    /// The findings that fail the audit.
    pub fn errors(&self) -> impl Iterator<Item = &Finding> {
        self.findings
            .iter()
            .filter(|f| f.severity() == Severity::Error)
    }
    pub fn warnings(&self) -> impl Iterator<Item = &Finding> {
        self.findings
            .iter()
            .filter(|f| f.severity() == Severity::Warning)
    }
}

/// Work items: one per quantized linear, one per other tensor worth scanning.
enum Item {
    Linear(LinearNames, usize),
    Values(String),
}

const MEMBER_SUFFIXES: [&str; 7] = [
    ".weight_scale_2",
    ".weight_global_scale",
    ".input_global_scale",
    ".weight_packed",
    ".weight_scale",
    ".input_scale",
    ".scale",
];

fn base_of(name: &str) -> Option<(&str, &str)> {
    MEMBER_SUFFIXES
        .iter()
        .find_map(|s| name.strip_suffix(s).map(|b| (b, &s[1..])))
}

/// Is the block-scale candidate `X.weight_scale` / `X.scale` an FP4 block scale (2-D FP8, or
/// its bytes as U8, which `formats` reads as E4M3 / E8M0 as the other commands do)?
fn is_block_scale(t: &TensorInfo) -> bool {
    t.shape.len() == 2 && matches!(t.dtype, Dtype::F8_E4M3 | Dtype::F8_E8M0 | Dtype::U8)
}

pub fn audit(
    ck: &Checkpoint,
    opts: &AuditOptions,
    on_tensors: &(dyn Fn(u64) + Sync),
) -> Result<AuditResult> {
    let mut findings: Vec<Finding> = vec![];
    let finding = |t: &str, kind: FindingKind, detail: String| Finding {
        tensor: t.to_string(),
        file: ck.file_of(t).to_path_buf(),
        kind,
        detail,
    };

    // 1. group NVFP4 members by base; complete pairs become linears, incomplete ones findings
    let mut bases: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for n in ck.names() {
        if let Some((b, m)) = base_of(n) {
            bases.entry(b).or_default().insert(m);
        }
    }
    let mut items: Vec<Item> = vec![];
    let mut in_linear: BTreeSet<String> = BTreeSet::new();
    for (base, members) in &bases {
        let m = |s: &str| format!("{base}.{s}");
        let packed = ck
            .locate(&m("weight"))
            .is_some_and(|(_, t)| matches!(t.dtype, Dtype::U8 | Dtype::I8))
            || members.contains("weight_packed");
        let block = ["weight_scale", "scale"]
            .iter()
            .any(|s| members.contains(s) && ck.info(&m(s)).is_ok_and(is_block_scale));
        let global = members.contains("weight_scale_2") || members.contains("weight_global_scale");
        let weight_exists = ck.contains(&m("weight")) || members.contains("weight_packed");
        // block scales under another FP8 format: the bytes may be right, but whatever reads
        // them by their dtype decodes other values; the linear is not read further
        let e5m2 = ["weight_scale", "scale"].iter().map(|s| m(s)).find(|n| {
            ck.info(n)
                .is_ok_and(|t| t.shape.len() == 2 && t.dtype == Dtype::F8_E5M2)
        });
        if let (true, Some(sn)) = (packed, e5m2) {
            findings.push(Finding {
                tensor: sn.clone(),
                file: ck.file_of(&sn).to_path_buf(),
                kind: FindingKind::BlockScaleDtype,
                detail: "NVFP4 block scales stored as F8_E5M2: whatever reads them by their dtype \
                         (torch, a kernel picked by dtype) decodes other values than the E4M3 \
                         codes they should be (the byte 0x38, 1.0 as E4M3, is 0.5 as E5M2); store \
                         them as F8_E4M3. This linear is not scanned further"
                    .into(),
            });
            for mem in members.iter() {
                in_linear.insert(m(mem));
            }
            continue;
        }
        // block scales of another dtype or rank (F32/BF16/F16, flattened, [1, N, K/16]): name
        // them as such; they are not missing, and the packed weight is still packed
        let odd = ["weight_scale", "scale"]
            .iter()
            .filter(|s| members.contains(*s))
            .map(|s| m(s))
            .find(|n| ck.info(n).is_ok_and(|t| !is_block_scale(t)));
        if let (true, false, Some(sn)) = (packed, block, odd) {
            let wn = if members.contains("weight_packed") {
                m("weight_packed")
            } else {
                m("weight")
            };
            let st = ck.info(&sn)?;
            let mxfp4 = sn.ends_with(".scale") && !global;
            let (dtype, fmt, fname) = if mxfp4 {
                ("F8_E8M0", Format::Mxfp4, "MXFP4")
            } else {
                ("F8_E4M3", Format::Nvfp4, "NVFP4")
            };
            let want = match ck.info(&wn).map(|w| w.shape.as_slice()) {
                Ok(&[rows, half]) => format!("[{rows}, {}]", 2 * half / fmt.block()),
                _ => format!("[N, K/{}]", fmt.block()),
            };
            let got_dims = st
                .shape
                .iter()
                .map(|d| d.to_string())
                .collect::<Vec<_>>()
                .join(", ");
            findings.push(Finding {
                tensor: sn.clone(),
                file: ck.file_of(&sn).to_path_buf(),
                kind: FindingKind::BlockScaleDtype,
                detail: format!(
                    "{} is {:?} [{got_dims}], expected {dtype} {want} ({} block scales of the packed weight `{wn}`): engines cannot load it as block scales. This linear is not scanned further",
                    sn.rsplit('.').next().unwrap_or("weight_scale"),
                    st.dtype,
                    fname
                ),
            });
            for mem in members.iter() {
                in_linear.insert(m(mem));
            }
            continue;
        }
        if packed && block {
            let ln = formats::find_linear(ck, base)?.ok_or_else(|| {
                Error::bad_tensor(
                    ck.file_of(&m("weight")),
                    &m("weight"),
                    "internal: not a linear",
                )
            })?;
            if let Err(e) = formats::check_linear(ck, &ln) {
                findings.push(misshapen(e)?);
                for mem in members.iter() {
                    in_linear.insert(m(mem));
                }
                continue;
            }
            let n = 2 + ln.global_scale.is_some() as usize + ln.input_scale.is_some() as usize;
            for t in [&ln.weight, &ln.weight_scale]
                .into_iter()
                .chain(ln.global_scale.iter())
                .chain(ln.input_scale.iter())
            {
                in_linear.insert(t.clone());
            }
            items.push(Item::Linear(ln, n));
        } else if block && weight_exists {
            // a float weight next to NVFP4 block scales cannot belong together (bad input);
            // an FP8 weight with E8M0 block scales is simply not FP4
            if let Err(e) = formats::find_linear(ck, base) {
                findings.push(misshapen(e)?);
                for mem in members.iter() {
                    in_linear.insert(m(mem));
                }
            }
        } else if block {
            let s = if members.contains("weight_scale") {
                m("weight_scale")
            } else {
                m("scale")
            };
            findings.push(Finding {
                tensor: m("weight"),
                file: ck.file_of(&s).to_path_buf(),
                kind: FindingKind::MissingMember,
                detail: format!("missing: block scales `{s}` without their packed weight"),
            });
        } else if packed && global {
            findings.push(Finding {
                tensor: m("weight_scale"),
                file: ck.file_of(&m("weight")).to_path_buf(),
                kind: FindingKind::MissingMember,
                detail: "missing: a packed FP4 weight and its global scale without block scales"
                    .into(),
            });
        } else if global && !weight_exists {
            let g = if members.contains("weight_scale_2") {
                m("weight_scale_2")
            } else {
                m("weight_global_scale")
            };
            findings.push(finding(
                &g,
                FindingKind::MissingMember,
                "a global scale without packed weight and block scales".into(),
            ));
        }
    }
    in_linear.extend(fused::members(ck));
    for n in ck.names() {
        if in_linear.contains(n) {
            continue;
        }
        let t = ck.info(n)?;
        if is_float(t.dtype) && t.numel() > 0 {
            items.push(Item::Values(n.to_string()));
        }
    }
    let float_tensors = items
        .iter()
        .filter(|i| matches!(i, Item::Values(_)))
        .count();

    // 2. scan, in parallel, straight from the maps
    let naming = Naming::detect(ck.names());
    type Scanned = Result<(Option<LinearStats>, Vec<Finding>, u64)>;
    let scanned: Vec<Scanned> = items
        .par_iter()
        .map(|it| {
            let r = match it {
                Item::Linear(ln, n) => {
                    scan_linear(ck, ln, opts, naming.as_ref()).map(|(s, f, b)| (Some(s), f, b, *n))
                }
                Item::Values(name) => scan_values(ck, name).map(|(f, b)| (None, f, b, 1)),
            };
            r.map(|(s, f, b, n)| {
                on_tensors(n as u64);
                (s, f, b)
            })
        })
        .collect();
    let mut linears = vec![];
    let mut bytes_scanned = 0;
    for r in scanned {
        let (s, f, b) = r?;
        linears.extend(s);
        findings.extend(f);
        bytes_scanned += b;
    }

    // 3. across linears
    cross_checks(ck, &linears, opts, &mut findings);
    copied_tensors(ck, &linears, opts.min_original_cosine, &mut findings)?;
    fused::gate_up_scales(ck, &mut findings)?;
    let fused = fused::experts(ck, opts, &mut findings)?;
    let fused_tensors = fused.len();
    layer_structure(ck, &mut findings);
    let fused_nvfp4 = fused.iter().filter(|f| f.format == Format::Nvfp4).count();
    bytes_scanned += fused.iter().map(|f| f.bytes).sum::<u64>();
    config_checks(ck, &linears, fused_nvfp4, &mut findings)?;
    // a misshapen router is named once, against config.json
    let config_named: BTreeSet<String> = findings
        .iter()
        .filter(|f| f.kind == FindingKind::ConfigMismatch)
        .map(|f| f.tensor.clone())
        .collect();
    findings.retain(|f| f.kind != FindingKind::BrokenLayer || !config_named.contains(&f.tensor));
    duplicate_copies(ck, &mut findings)?;
    unindexed_tensors(ck, &mut findings);
    unlisted_shards(ck, &mut findings);
    let compared = ck.originals().filter(|_| opts.originals);
    let mut original_bytes = 0;
    if let Some(o) = compared {
        originals::orphans(ck, o, &mut findings);
        original_bytes = linears
            .iter()
            .filter_map(|l| l.original.as_ref())
            .map(|c| c.bytes)
            .sum();
        bytes_scanned += original_bytes;
        let mut failing = vec![];
        for l in &linears {
            let Some(c) = l.original.as_ref() else {
                continue;
            };
            if !originals::fails(&c.metrics, opts.min_original_cosine) {
                continue;
            }
            let Some(names) = formats::find_linear(ck, &l.base)? else {
                continue;
            };
            failing.push(originals::Failing {
                names,
                geometry: formats::Geometry {
                    format: l.format,
                    rows: l.shape[0],
                    cols: l.shape[1],
                },
                scale_2: l.weight_scale_2.unwrap_or(1.0),
                check: c.clone(),
            });
        }
        findings.extend(originals::diagnose(
            ck,
            o,
            &failing,
            opts.min_original_cosine,
        )?);
    }

    findings.sort_by(|a, b| (&a.tensor, a.kind).cmp(&(&b.tensor, b.kind)));
    Ok(AuditResult {
        path: ck.path().to_path_buf(),
        tensors: ck.names().count(),
        linears,
        fused_tensors,
        float_tensors,
        bytes_scanned,
        originals: compared.map(|o| o.path().to_path_buf()),
        original_bytes,
        findings,
    })
}

/// A triple's shape or dtype error as a finding on the tensor it names; any other error
/// (the file cannot be read) stays bad input.
fn misshapen(e: Error) -> Result<Finding> {
    match e {
        Error::BadTensor { file, tensor, what } => Ok(Finding {
            tensor,
            file,
            kind: FindingKind::Misshapen,
            detail: format!("{what}: no engine loads this linear; it is not scanned further"),
        }),
        e => Err(e),
    }
}

fn scalar_checks(name: &str, file: &std::path::Path, what: &str, v: f32, out: &mut Vec<Finding>) {
    let f = |kind, detail| Finding {
        tensor: name.to_string(),
        file: file.to_path_buf(),
        kind,
        detail,
    };
    match ScaleProblem::of(v) {
        None => {}
        Some(ScaleProblem::NotFinite) => out.push(f(
            FindingKind::NonfiniteGlobalScale,
            format!("{what} = {v}: every output of this linear becomes NaN/Inf"),
        )),
        Some(ScaleProblem::Zero | ScaleProblem::Negative) => out.push(f(
            FindingKind::NonpositiveGlobalScale,
            format!("{what} = {v}: a global scale must be positive (zero flushes, negative flips the sign)"),
        )),
        // the other direction (gs = 1/weight_scale_2, or weight_scale_2 = 1/weight_global_scale)
        Some(ScaleProblem::ReciprocalOverflows) => out.push(f(
            FindingKind::NonfiniteGlobalScale,
            format!("{what} = {v:e}: its reciprocal, the other direction engines compute from it, overflows to inf"),
        )),
    }
}

/// The direction a stored global scale is in, by its own name: `*_global_scale` is
/// compressed-tensors' quant direction, `weight_scale_2` / `input_scale` ModelOpt's dequant
/// direction, whichever convention the linear's other members follow (MXFP4 stays MXFP4).
fn by_name(ln: &LinearNames, member: &str) -> Convention {
    match ln.convention {
        Convention::Mxfp4 => Convention::Mxfp4,
        _ if member.ends_with("global_scale") => Convention::CompressedTensors,
        _ => Convention::Modelopt,
    }
}

fn scan_linear(
    ck: &Checkpoint,
    ln: &LinearNames,
    opts: &AuditOptions,
    naming: Option<&Naming>,
) -> Result<(LinearStats, Vec<Finding>, u64)> {
    let g = formats::check_linear(ck, ln)?;
    let (wf, wi) = ck.find(&ln.weight)?;
    let (sf, si) = ck.find(&ln.weight_scale)?;
    let scales = sf.slice(si);
    let packed = wf.slice(wi);
    let mut out = vec![];
    let file = |n: &str| ck.file_of(n).to_path_buf();

    // block scales
    let kb = g.cols / g.format.block();
    let sc = scan_scales(g.format, scales);
    if sc.nan > 0 {
        let i = sc.first_nan.unwrap_or(0);
        out.push(Finding {
            tensor: ln.weight_scale.clone(),
            file: file(&ln.weight_scale),
            kind: FindingKind::NanBlockScales,
            detail: format!(
                "{} of {} block scales are NaN codes (first at row {}, block {}): {}; the blocks dequantize to NaN",
                sc.nan,
                scales.len(),
                i / kb.max(1),
                i % kb.max(1),
                match g.format {
                    Format::Nvfp4 => "E4M3 0x7F/0xFF, what a plain cast past 448 makes",
                    Format::Mxfp4 => "E8M0 0xFF, the format's one NaN code (no exponent: a scale written as -1 or 0xFF fill, never a power of two)",
                }
            ),
        });
    }
    if sc.negative > 0 {
        out.push(Finding {
            tensor: ln.weight_scale.clone(),
            file: file(&ln.weight_scale),
            kind: FindingKind::NegativeBlockScales,
            detail: format!(
                "{} block scales are negative: their blocks flip sign",
                sc.negative
            ),
        });
    }
    let frac = if scales.is_empty() {
        0.0
    } else {
        sc.saturated as f64 / scales.len() as f64
    };
    if g.format == Format::Nvfp4 && frac > opts.saturation_limit && sc.saturated > SATURATED_HANDFUL
    {
        out.push(Finding {
            tensor: ln.weight_scale.clone(),
            file: file(&ln.weight_scale),
            kind: FindingKind::SaturatedBlockScales,
            detail: format!(
                "{:.2}% of block scales are at 448 (limit {:.2}%): the global scale is too large for this weight, its elements are clipped{}",
                100.0 * frac,
                100.0 * opts.saturation_limit,
                if sc.saturated == scales.len() as u64 {
                    " (every block: also what a quantizer that ignored each block's amax and wrote one scale for all writes)"
                } else {
                    ""
                }
            ),
        });
    }
    if g.format == Format::Nvfp4 && si.dtype == Dtype::U8 {
        out.push(Finding {
            tensor: ln.weight_scale.clone(),
            file: file(&ln.weight_scale),
            kind: FindingKind::BlockScaleDtype,
            detail: format!(
                "NVFP4 block scales stored as U8 {:?} (read here as E4M3 bytes): a loader that copies them by value into its float8_e4m3fn parameter (torch copy_) turns byte 0x38 (1.0) into 56.0; store them as F8_E4M3",
                si.shape
            ),
        });
    }
    if !packed.is_empty() && packed.par_iter().all(|&b| b & 0x77 == 0) {
        out.push(Finding {
            tensor: ln.weight.clone(),
            file: file(&ln.weight),
            kind: FindingKind::AllZeroWeight,
            detail: "every FP4 code is ±0: never-written or zero-initialized memory".into(),
        });
    }
    // what the scales make of the codes: zeroed blocks, blocks that overflow to Inf
    let stored_ws2 = formats::weight_scale_2(ck, ln)?;
    // a second pass over the scales only when one of them can be either (the largest scale
    // bounds every product; a healthy tensor has no zero scale, or a few over zero blocks)
    let may_overflow =
        stored_ws2.is_finite() && !((e2m1::MAX * sc.max) * stored_ws2.abs()).is_finite();
    let bv = if sc.zero > 0 || may_overflow {
        block_values(g.format, g.cols, scales, packed, stored_ws2)
    } else {
        BlockValues::default()
    };
    let at = |i: usize| format!("row {}, block {}", i / kb.max(1), i % kb.max(1));
    // a 448 scale is what a quantizer writes over the blocks next to the tensor's amax
    // (round to nearest: 448 stands for ≥ 432, so the block's largest code is 6); one over
    // codes all ≤ 2 does not belong to them (a corrupted scale byte, scales of other codes)
    let saturation_named = out
        .iter()
        .any(|f| f.kind == FindingKind::SaturatedBlockScales);
    if g.format == Format::Nvfp4
        && sc.saturated > 0
        && !saturation_named
        && packed.len() == scales.len() * 8
    {
        let small = |i: usize| {
            packed[i * 8..i * 8 + 8]
                .iter()
                .all(|&b| b & 0x7 <= SMALL_CODE && (b >> 4) & 0x7 <= SMALL_CODE)
        };
        let hits: Vec<usize> = positions(scales, e4m3::MAX_CODE)
            .into_iter()
            .filter(|&i| small(i))
            .collect();
        if let Some(&first) = hits.first() {
            out.push(Finding {
                tensor: ln.weight_scale.clone(),
                file: file(&ln.weight_scale),
                kind: FindingKind::OversizedBlockScales,
                detail: format!(
                    "{} block scale(s) at 448 over blocks whose FP4 codes are all |q| ≤ 2 (first at {}): a quantizer writes 448 only over blocks that reach the tensor's amax, whose largest code is 6, so these scales do not belong to their codes (a corrupted scale byte, or scales stored in another order or layout)",
                    hits.len(),
                    at(first)
                ),
            });
        }
    }
    if bv.dead > 0 {
        let (zero, quantizers) = match g.format {
            Format::Nvfp4 => (
                "zero",
                "a quantizer writes scale 0 only over an all-zero block (rcp(0) = 0 makes every code ±0)",
            ),
            Format::Mxfp4 => (
                "E8M0 code 0 (2^-127: |w| ≤ 6·2^-127, zero to any engine)",
                "a quantizer writes code 0 only over an all-zero block (its codes ±0); real weights sit ~2^-10, a hundred binades above",
            ),
        };
        out.push(Finding {
            tensor: ln.weight_scale.clone(),
            file: file(&ln.weight_scale),
            kind: FindingKind::ZeroBlockScales,
            detail: format!(
                "{} of {} block scales are {zero} over blocks whose FP4 codes are not all ±0 (first at {}{}): those weights dequantize to 0; {quantizers}, so these scales were zeroed after quantization",
                bv.dead,
                scales.len(),
                at(bv.first_dead.unwrap_or(0)),
                match bv.dead_rows {
                    0 => String::new(),
                    1 => "; 1 whole row: a dead output channel".into(),
                    n => format!("; {n} whole rows: dead output channels"),
                }
            ),
        });
    }
    if bv.overflow > 0 {
        let i = bv.first_overflow.unwrap_or(0);
        let s = g.format.decode_scale(scales[i]).abs();
        // E4M3 block scales stop at 448: an NVFP4 overflow is its global scale's doing
        let (tensor, product) = match (&ln.global_scale, g.format) {
            (Some(gn), Format::Nvfp4) => (
                gn.clone(),
                format!("code × block scale × weight_scale_2 (up to 6 × {s} × {stored_ws2:e})"),
            ),
            _ => (
                ln.weight_scale.clone(),
                format!("code × block scale (up to 6 × {s:e})"),
            ),
        };
        out.push(Finding {
            tensor: tensor.clone(),
            file: file(&tensor),
            kind: FindingKind::NonfiniteDequant,
            detail: format!(
                "{} of {} blocks dequantize to Inf (first at {}): {product} overflows f32 (max {:e}); every output this linear computes from them is Inf/NaN",
                bv.overflow,
                scales.len(),
                at(i),
                f32::MAX
            ),
        });
    }
    // all zero over non-zero codes is the finding above
    if g.format == Format::Nvfp4 && sc.nan == 0 && bv.dead == 0 {
        if let Some(detail) = uniform_block_scales(scales) {
            out.push(Finding {
                tensor: ln.weight_scale.clone(),
                file: file(&ln.weight_scale),
                kind: FindingKind::UniformBlockScales,
                detail,
            });
        }
    }
    let fingerprints = [(&ln.weight, packed), (&ln.weight_scale, scales)]
        .into_iter()
        .filter_map(|(n, b)| fingerprint(b).map(|h| (n.clone(), h)))
        .collect();

    // global scales
    let mut weight_scale_2 = None;
    match &ln.global_scale {
        Some(gn) => {
            let stored = ck.scalar_f32(gn)?;
            let what = gn.rsplit('.').next().unwrap_or("weight_scale_2");
            scalar_checks(gn, &file(gn), what, stored, &mut out);
            if let Some(s) = formats::convention_suspicion(by_name(ln, gn), stored, sc.max) {
                out.push(Finding {
                    tensor: gn.clone(),
                    file: file(gn),
                    kind: FindingKind::ConventionSuspect,
                    detail: s,
                });
            }
            weight_scale_2 = Some(formats::weight_scale_2(ck, ln)?);
            // both conventions stored: they must be reciprocals
            let other = if gn.ends_with("weight_scale_2") {
                format!("{}.weight_global_scale", ln.base)
            } else {
                format!("{}.weight_scale_2", ln.base)
            };
            if ck.contains(&other) {
                let o = ck.scalar_f32(&other)?;
                // NaN products count as not reciprocal
                let reciprocal = (o * stored - 1.0).abs() <= 1e-5;
                if !reciprocal {
                    out.push(Finding {
                        tensor: other.clone(),
                        file: file(&other),
                        kind: FindingKind::ConflictingGlobalScales,
                        detail: format!(
                            "`{gn}` = {stored:e} and `{other}` = {o:e} are both stored but not reciprocals (product {:e}): loaders disagree on which to use",
                            o * stored
                        ),
                    });
                }
            }
        }
        None if g.format == Format::Nvfp4 => out.push(Finding {
            tensor: ln.global_scale_name(),
            file: file(&ln.weight),
            kind: FindingKind::MissingMember,
            detail:
                "an NVFP4 weight without its global scale (weight_scale_2 / weight_global_scale)"
                    .into(),
        }),
        None => {}
    }
    let mut input_scale = None;
    if let Some(i) = &ln.input_scale {
        let stored = ck.scalar_f32(i)?;
        let what = i.rsplit('.').next().unwrap_or("input_scale");
        scalar_checks(i, &file(i), what, stored, &mut out);
        if let Some(s) = formats::input_scale_suspicion(by_name(ln, i), stored) {
            out.push(Finding {
                tensor: i.clone(),
                file: file(i),
                kind: FindingKind::ConventionSuspect,
                detail: s,
            });
        }
        input_scale = formats::input_scale(ck, ln)?;
    }
    // the BF16 original: the quantized bytes are still mapped; an NVFP4 weight without its
    // global scale has a finding of its own and nothing to dequantize with
    let mut original = None;
    if let (true, Some(o)) = (opts.originals, ck.originals()) {
        let scale_2 = match g.format {
            Format::Mxfp4 => Some(1.0),
            Format::Nvfp4 => weight_scale_2,
        };
        if let Some(s2) = scale_2 {
            let (c, f) = originals::check(ck, o, naming, ln, g, s2)?;
            original = c;
            out.extend(f);
        }
    }
    let bytes = (packed.len() + scales.len()) as u64;
    wf.release(wi);
    sf.release(si);
    Ok((
        LinearStats {
            base: ln.base.clone(),
            file: file(&ln.weight),
            convention: ln.convention,
            format: g.format,
            shape: [g.rows, g.cols],
            weight_scale_2,
            input_scale,
            blocks: scales.len() as u64,
            saturated: sc.saturated,
            saturated_fraction: frac,
            nan_scales: sc.nan,
            negative_scales: sc.negative,
            zero_scales: sc.zero,
            max_block_scale: sc.max,
            original,
            fingerprints,
        },
        out,
        bytes,
    ))
}

/// Block scales a tensor needs before one value over all of them is a finding: the blocks
/// of a real weight have amaxes spread over several E4M3 steps (a synth expert's 2048 block
/// scales take 30-37 distinct values), so only a tiny tensor can be uniform by chance.
const UNIFORM_MIN_BLOCKS: usize = 64;

/// Every NVFP4 block scale one value (NaN codes excluded: they are findings of their own):
/// a quantizer that ignored each block's amax and wrote one per-tensor scale, or a scale
/// tensor filled with a constant.
fn uniform_block_scales(scales: &[u8]) -> Option<String> {
    let (&b, rest) = scales.split_first()?;
    // every block at 448 is the saturation finding's (a global scale far too large, or this)
    if scales.len() < UNIFORM_MIN_BLOCKS
        || b & 0x7F == e4m3::MAX_CODE
        || rest.par_iter().any(|&x| x != b)
    {
        return None;
    }
    Some(format!(
        "all {} block scales are the same E4M3 value {} (0x{b:02x}): a quantizer that ignored each block's amax (one scale for the whole tensor, so blocks of small values lose their codes), or a scale tensor filled with a constant",
        scales.len(),
        e4m3::decode(b)
    ))
}

/// Bytes hashed at each end of a tensor for [`fingerprint`] (equal fingerprints are
/// confirmed on every byte).
const PRINT_BYTES: usize = 4096;

/// A hash of a tensor's length and its first and last [`PRINT_BYTES`] bytes; None for one
/// repeated byte (all-zero or uniform tensors are findings of their own, not copies).
fn fingerprint(b: &[u8]) -> Option<u64> {
    let (&first, _) = b.split_first()?;
    if b.par_iter().all(|&x| x == first) {
        return None;
    }
    // compare-weights' fingerprint; its length counts both pieces, so add the tensor's own
    let mut h = crate::weights::view::Fingerprint::new();
    h.update(&b[..b.len().min(PRINT_BYTES)]);
    h.update(&b[b.len().saturating_sub(PRINT_BYTES)..]);
    h.update(&(b.len() as u64).to_le_bytes());
    Some(h.finish())
}

/// Packed weights or block scales byte-identical to another linear's: real experts never
/// share a byte pattern of that size, so one of them was written from the other's tensor
/// (a converter or loader that indexed the wrong expert). Each copy is named with the others;
/// when the BF16 originals were compared and only some of the copies' linears fail theirs
/// (below `min_original_cosine`), only those are named: they hold the others' tensor.
fn copied_tensors(
    ck: &Checkpoint,
    linears: &[LinearStats],
    min_original_cosine: f64,
    out: &mut Vec<Finding>,
) -> Result<()> {
    let mut by_print: BTreeMap<u64, Vec<&str>> = BTreeMap::new();
    // tensor -> does its linear fail its BF16 original (None: not compared)
    let mut fails_original: BTreeMap<&str, Option<bool>> = BTreeMap::new();
    for l in linears {
        for (n, h) in &l.fingerprints {
            by_print.entry(*h).or_default().push(n);
            let f = l
                .original
                .as_ref()
                .map(|c| originals::fails(&c.metrics, min_original_cosine));
            fails_original.insert(n, f);
        }
    }
    for names in by_print.values().filter(|v| v.len() > 1) {
        // equal fingerprints, confirmed on every byte
        let mut groups: Vec<Vec<&str>> = vec![];
        for &n in names {
            let b = ck.bytes(n)?;
            match groups
                .iter_mut()
                .find(|g| ck.bytes(g[0]).is_ok_and(|x| x == b))
            {
                Some(g) => g.push(n),
                None => groups.push(vec![n]),
            }
        }
        for g in groups.iter().filter(|g| g.len() > 1) {
            let fails = |n: &str| fails_original.get(n).copied().flatten();
            // the originals tell the copy from its source when some fail and some pass
            let told = g.iter().any(|&n| fails(n) == Some(true))
                && g.iter().any(|&n| fails(n) == Some(false));
            for &n in g {
                if told && fails(n) != Some(true) {
                    continue;
                }
                let others: Vec<String> = g
                    .iter()
                    .filter(|&&o| o != n)
                    .map(|o| format!("`{o}` ({})", ck.file_of(o).display()))
                    .collect();
                let what = if is_block_scale_name(n) {
                    "block scales (weight_scale)"
                } else {
                    "packed FP4 codes"
                };
                let verdict = if told {
                    format!("its linear fails its BF16 original while the other's matches: it holds the other's {what}, written or loaded from the wrong index")
                } else {
                    "one of them holds the other expert's (or projection's) tensor, written or loaded from the wrong index".into()
                };
                out.push(Finding {
                    tensor: n.to_string(),
                    file: ck.file_of(n).to_path_buf(),
                    kind: FindingKind::CopyOfAnotherTensor,
                    detail: format!(
                        "its {what} are byte-identical to those of {}: {verdict}; distinct weights never share {} bytes",
                        others.join(", "),
                        ck.bytes(n)?.len()
                    ),
                });
            }
        }
    }
    Ok(())
}

fn is_block_scale_name(n: &str) -> bool {
    n.ends_with(".weight_scale") || n.ends_with(".scale")
}

#[derive(Default, Clone, Copy)]
struct ScaleScan {
    nan: u64,
    first_nan: Option<usize>,
    negative: u64,
    saturated: u64,
    zero: u64,
    max: f32,
}

fn scan_scales(format: Format, scales: &[u8]) -> ScaleScan {
    const CHUNK: usize = 1 << 16;
    scales
        .par_chunks(CHUNK)
        .enumerate()
        .map(|(ci, c)| {
            let mut s = scan_scale_chunk(format, c);
            if s.nan > 0 {
                s.first_nan = c
                    .iter()
                    .position(|&b| scale_is_nan(format, b))
                    .map(|i| ci * CHUNK + i);
            }
            s
        })
        .reduce(ScaleScan::default, |a, b| ScaleScan {
            nan: a.nan + b.nan,
            first_nan: match (a.first_nan, b.first_nan) {
                (Some(x), Some(y)) => Some(x.min(y)),
                (x, y) => x.or(y),
            },
            negative: a.negative + b.negative,
            saturated: a.saturated + b.saturated,
            zero: a.zero + b.zero,
            max: a.max.max(b.max),
        })
}

/// What the scales make of the codes, block by block ([`block_values`]).
#[derive(Default, Clone, Copy, Debug, PartialEq)]
struct BlockValues {
    /// Blocks whose scale is zero (E8M0: code 0) while a code has a non-zero magnitude.
    dead: u64,
    /// Rows (output channels) where every block is dead.
    dead_rows: u64,
    first_dead: Option<usize>,
    /// Blocks whose largest code × scale × `scale_2` is not finite (NaN scales excluded).
    overflow: u64,
    first_overflow: Option<usize>,
}

/// Blocks of a packed FP4 weight (`cols` unpacked, scales linear `[rows, cols/block]`) whose
/// scale kills non-zero codes (`dead`: a zero scale, or E8M0 code 0) or whose dequantized
/// values `(e2m1(q) × s) × scale_2` overflow f32. A quantizer writes scale 0 only over an
/// all-zero block: with `rcp(0) = 0` every code is ±0 (DESIGN §2). Only the blocks whose
/// scale can be either are looked at, so a healthy tensor costs one pass over its scales.
fn block_values(
    format: Format,
    cols: usize,
    scales: &[u8],
    packed: &[u8],
    scale_2: f32,
) -> BlockValues {
    let block = format.block();
    let kb = cols / block;
    if kb == 0 || packed.len() != scales.len() * block / 2 {
        return BlockValues::default();
    }
    let is_zero = |b: u8| scale_is_zero(format, b);
    // a non-finite scale_2 is a finding of its own (every block would be named here)
    let ws2 = if scale_2.is_finite() {
        scale_2.abs()
    } else {
        0.0
    };
    let overflows = |b: u8, code: f32| overflows(format, b, code, ws2);
    let max_code = |k: usize, r: usize| {
        let at = (r * kb + k) * block / 2;
        packed[at..at + block / 2]
            .iter()
            .map(|&b| (b & 0x7).max((b >> 4) & 0x7))
            .max()
            .unwrap_or(0)
    };
    let suspect = Suspects::new(format, ws2);
    scales
        .par_chunks(kb)
        .enumerate()
        .map(|(r, row)| {
            let mut v = BlockValues::default();
            if !suspect.any(row) {
                return v;
            }
            // the suspects' codes asked for together, before any is waited on: each is a
            // read from memory, and one at a time was most of `audit`'s time where 1% of the
            // blocks had a zero scale
            #[cfg(target_arch = "x86_64")]
            for (k, _) in row.iter().enumerate().filter(|(_, &b)| suspect.is(b)) {
                let at = (r * kb + k) * block / 2;
                // SAFETY: a prefetch reads nothing and never faults; `at` is within `packed`
                unsafe {
                    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
                    _mm_prefetch::<_MM_HINT_T0>(packed.as_ptr().add(at) as *const i8)
                };
            }
            for (k, &b) in row.iter().enumerate() {
                if !suspect.is(b) {
                    continue;
                }
                let (zero, over) = (is_zero(b), overflows(b, e2m1::MAX));
                let q = max_code(k, r);
                if zero && q != 0 {
                    v.dead += 1;
                    v.first_dead.get_or_insert(r * kb + k);
                }
                if over && overflows(b, e2m1::VALUES[q as usize]) {
                    v.overflow += 1;
                    v.first_overflow.get_or_insert(r * kb + k);
                }
            }
            v.dead_rows = (v.dead == kb as u64) as u64;
            v
        })
        .reduce(BlockValues::default, |a, b| BlockValues {
            dead: a.dead + b.dead,
            dead_rows: a.dead_rows + b.dead_rows,
            first_dead: a.first_dead.or(b.first_dead),
            overflow: a.overflow + b.overflow,
            first_overflow: a.first_overflow.or(b.first_overflow),
        })
}

/// The block scale codes [`block_values`] looks under, tabled once per tensor. Both tests
/// (zero; the largest code times the scale overflows) depend on the magnitude alone, and
/// overflowing is monotone in it, so the codes are also a byte form (magnitude 0, or at least
/// `from` and not NaN) that a row is checked against in vector compares, 16 to 64 scales an
/// instruction; where the table is not that form, every row is looked at scale by scale.
struct Suspects {
    table: [bool; 256],
    /// The magnitude bits (NVFP4 ignores the sign) and the NaN magnitude.
    mask: u8,
    nan: u8,
    /// The smallest non-zero suspect magnitude (`nan` when none).
    from: u8,
    /// `table` is the byte form.
    exact: bool,
}

impl Suspects {
    /// A block is looked at when its scale is zero or its largest possible value overflows
    /// under `ws2` (the two tests a scale were ~80% of `audit`'s time on a 3 GB checkpoint).
    fn new(format: Format, ws2: f32) -> Suspects {
        let (mask, nan) = match format {
            Format::Nvfp4 => (0x7F, 0x7F),
            Format::Mxfp4 => (0xFF, ue8m0::NAN),
        };
        let table: [bool; 256] = std::array::from_fn(|b| {
            scale_is_zero(format, b as u8) || overflows(format, b as u8, e2m1::MAX, ws2)
        });
        let from = (1..nan).find(|&m| table[m as usize]).unwrap_or(nan);
        let mut s = Suspects {
            table,
            mask,
            nan,
            from,
            exact: true,
        };
        s.exact = (0..=255u8).all(|b| s.table[b as usize] == s.form(b));
        s
    }

    #[inline(always)]
    fn form(&self, b: u8) -> bool {
        let m = b & self.mask;
        (m == 0) | ((m >= self.from) & (m != self.nan))
    }

    #[inline(always)]
    fn is(&self, b: u8) -> bool {
        self.table[b as usize]
    }

    /// Some scale of `row` is a suspect (branch-free over the row: it vectorizes).
    fn any(&self, row: &[u8]) -> bool {
        !self.exact || row.iter().fold(0u8, |a, &b| a | u8::from(self.form(b))) != 0
    }
}

/// Where `code` sits in `bytes`, in order: pieces on the cores, 64 bytes at a time in vector
/// compares, for a code that is rare (a filter a byte, for the few 448 scales, was two thirds
/// of `audit`'s time on a healthy 8.8 GB checkpoint).
fn positions(bytes: &[u8], code: u8) -> Vec<usize> {
    const PIECE: usize = 1 << 16;
    bytes
        .par_chunks(PIECE)
        .enumerate()
        .flat_map_iter(|(p, piece)| {
            piece
                .chunks(64)
                .enumerate()
                .filter(|(_, c)| c.iter().fold(false, |a, &b| a | (b == code)))
                .flat_map(move |(j, c)| {
                    (0..c.len())
                        .filter(move |&i| c[i] == code)
                        .map(move |i| p * PIECE + j * 64 + i)
                })
        })
        .collect()
}

/// A zero block scale (E8M0: code 0, 2^-127, what quantizers write over an all-zero block).
fn scale_is_zero(format: Format, b: u8) -> bool {
    match format {
        Format::Nvfp4 => b & 0x7F == 0,
        Format::Mxfp4 => b == 0,
    }
}

/// `(code × |scale b|) × ws2` is not finite, the scale not NaN.
fn overflows(format: Format, b: u8, code: f32, ws2: f32) -> bool {
    !scale_is_nan(format, b) && !((code * format.decode_scale(b).abs()) * ws2).is_finite()
}

fn scale_is_nan(format: Format, b: u8) -> bool {
    match format {
        Format::Nvfp4 => e4m3::is_nan(b),
        Format::Mxfp4 => b == ue8m0::NAN,
    }
}

/// One chunk's counts (no first NaN index): branch-free, with byte counters over pieces of at
/// most 255 scales, so that the compiler vectorizes it (a branch and u64 counters per scale
/// held `audit` to ~12 instructions a scale, half of `cat`'s speed on a 3 GB checkpoint).
/// Negative, saturated, zero and the maximum count only non-NaN scales; MXFP4 scales
/// (UE8M0, unsigned) count only NaN, zero (code 0, 2^-127: the smallest, what quantizers
/// write for an all-zero block) and the maximum.
fn scan_scale_chunk(format: Format, c: &[u8]) -> ScaleScan {
    // the same code in 512- or 256-bit registers where the CPU has them
    #[cfg(target_arch = "x86_64")]
    {
        if crate::weights::blocks::avx512bw() {
            // SAFETY: the CPU supports AVX-512 F/BW, checked just above
            return unsafe { scan_scale_chunk_avx512(format, c) };
        }
        if std::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2, checked just above
            return unsafe { scan_scale_chunk_avx2(format, c) };
        }
    }
    scan_scale_chunk_body(format, c)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn scan_scale_chunk_avx512(format: Format, c: &[u8]) -> ScaleScan {
    scan_scale_chunk_body(format, c)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn scan_scale_chunk_avx2(format: Format, c: &[u8]) -> ScaleScan {
    scan_scale_chunk_body(format, c)
}

#[inline(always)]
fn scan_scale_chunk_body(format: Format, c: &[u8]) -> ScaleScan {
    let mut s = ScaleScan::default();
    let mut maxc = 0u8;
    for piece in c.chunks(255) {
        let (mut nan, mut neg, mut sat, mut zero) = (0u8, 0u8, 0u8, 0u8);
        match format {
            Format::Nvfp4 => {
                for &b in piece {
                    let mag = b & 0x7F;
                    let is_nan = mag == 0x7F;
                    nan += is_nan as u8;
                    neg += (b > 0x80 && !is_nan) as u8;
                    sat += (mag == e4m3::MAX_CODE) as u8;
                    zero += (mag == 0) as u8;
                    maxc = maxc.max(if is_nan { 0 } else { mag });
                }
            }
            Format::Mxfp4 => {
                for &b in piece {
                    let is_nan = b == ue8m0::NAN;
                    nan += is_nan as u8;
                    zero += (b == 0) as u8;
                    maxc = maxc.max(if is_nan { 0 } else { b });
                }
            }
        }
        s.nan += nan as u64;
        s.negative += neg as u64;
        s.saturated += sat as u64;
        s.zero += zero as u64;
    }
    s.max = format.decode_scale(maxc);
    s
}

/// How many of `h` have every bit of `mask` set (an all-ones exponent). Counted in u16 lanes
/// over pieces short enough not to wrap: a u64 count per element keeps the compiler to two
/// lanes per vector and ran at a fifth of the memory bandwidth.
fn count_masked_u16(h: &[u16], mask: u16) -> u64 {
    h.chunks(u16::MAX as usize)
        .map(|c| c.iter().fold(0u16, |n, &v| n + ((v & mask) == mask) as u16) as u64)
        .sum()
}

/// NaN/Inf count and first index of a float tensor, from its bits. The count is a plain
/// vectorizable sum; the first index is looked for only in chunks that have one.
pub fn count_nonfinite(d: Dtype, bytes: &[u8]) -> (u64, Option<usize>) {
    use super::file::{as_u16s, as_u32s};
    const CHUNK: usize = 1 << 16;
    let Some(size) = super::file::elem_size(d) else {
        return (0, None);
    };
    let bad = move |e: &[u8]| -> bool {
        match d {
            Dtype::BF16 => u16::from_le_bytes([e[0], e[1]]) & 0x7F80 == 0x7F80,
            Dtype::F16 => u16::from_le_bytes([e[0], e[1]]) & 0x7C00 == 0x7C00,
            Dtype::F32 => u32::from_le_bytes([e[0], e[1], e[2], e[3]]) & 0x7F80_0000 == 0x7F80_0000,
            Dtype::F64 => {
                let mut a = [0u8; 8];
                a.copy_from_slice(e);
                !f64::from_le_bytes(a).is_finite()
            }
            Dtype::F8_E4M3 => e4m3::is_nan(e[0]),
            Dtype::F8_E5M2 => e[0] & 0x7C == 0x7C,
            _ => false,
        }
    };
    let count = move |c: &[u8]| -> u64 {
        match (d, as_u16s(c), as_u32s(c)) {
            (Dtype::BF16, Some(h), _) => count_masked_u16(h, 0x7F80),
            (Dtype::F16, Some(h), _) => count_masked_u16(h, 0x7C00),
            (Dtype::F32, _, Some(w)) => w
                .iter()
                .fold(0u32, |n, &v| n + ((v & 0x7F80_0000) == 0x7F80_0000) as u32)
                as u64,
            (Dtype::F8_E4M3, _, _) => c
                .chunks(u8::MAX as usize)
                .map(|s| s.iter().fold(0u8, |n, &v| n + ((v & 0x7F) == 0x7F) as u8) as u64)
                .sum(),
            _ => c.chunks_exact(size).map(|e| bad(e) as u64).sum(),
        }
    };
    bytes
        .par_chunks(CHUNK * size)
        .enumerate()
        .map(|(ci, c)| {
            let n = count(c);
            let first = if n > 0 {
                c.chunks_exact(size).position(bad).map(|i| ci * CHUNK + i)
            } else {
                None
            };
            (n, first)
        })
        .reduce(
            || (0, None),
            |a, b| {
                (
                    a.0 + b.0,
                    match (a.1, b.1) {
                        (Some(x), Some(y)) => Some(x.min(y)),
                        (x, y) => x.or(y),
                    },
                )
            },
        )
}

fn index_str(shape: &[usize], mut i: usize) -> String {
    let mut idx = vec![0; shape.len()];
    for (k, &d) in shape.iter().enumerate().rev() {
        if d > 0 {
            idx[k] = i % d;
            i /= d;
        }
    }
    format!("{idx:?}")
}

fn scan_values(ck: &Checkpoint, name: &str) -> Result<(Vec<Finding>, u64)> {
    let (f, t): (&TensorFile, &TensorInfo) = ck.find(name)?;
    f.prefetch(t);
    let b = f.slice(t);
    let (n, first) = count_nonfinite(t.dtype, b);
    f.release(t);
    let mut out = vec![];
    if n > 0 {
        out.push(Finding {
            tensor: name.to_string(),
            file: f.path().to_path_buf(),
            kind: FindingKind::NonfiniteValues,
            detail: format!(
                "{n} of {} values are NaN/Inf (first at {})",
                t.numel(),
                index_str(&t.shape, first.unwrap_or(0))
            ),
        });
    }
    Ok((out, b.len() as u64))
}

/// `...experts.7.gate_proj` → (`...experts.*.gate_proj`, 7): the expert-group key.
fn expert_group(base: &str) -> Option<(String, usize)> {
    let at = base.find(".experts.")? + ".experts.".len();
    let rest = &base[at..];
    let digits = rest.bytes().take_while(|b| b.is_ascii_digit()).count();
    let e = rest[..digits].parse().ok()?;
    Some((format!("{}*{}", &base[..at], &rest[digits..]), e))
}

/// A layer-wide `member` next to an expert's (`...experts.input_scale` or
/// `...experts.{proj}.input_scale` beside `...experts.3.{proj}`), when the checkpoint holds one.
fn layer_wide(ck: &Checkpoint, base: &str, member: &str) -> Option<String> {
    let at = base.find(".experts.")? + ".experts".len();
    let proj = base.rsplit('.').next()?;
    [
        format!("{}.{member}", &base[..at]),
        format!("{}.{proj}.{member}", &base[..at]),
    ]
    .into_iter()
    .find(|n| ck.contains(n))
}

/// Experts of a layer needed before one input_scale over all of them says anything.
const SHARED_INPUT_SCALE_MIN_EXPERTS: usize = 4;

/// A layer whose experts all hold one bitwise-identical down-projection input_scale, while
/// the experts of another layer each hold their own (calibrated per expert): this layer's
/// per-expert scales were overwritten with one value (one expert's broadcast, or a calibration
/// not run per expert). Only the down projection: its input is each expert's own SwiGLU
/// output, whose amax differs per expert, while the gate/up input's amax is often one
/// massive-activation token's that every expert saw (synth's tiny-v4 layer 0: one gate/up
/// input_scale for all 16 experts, healthy). A checkpoint exported with one scale per layer
/// everywhere (synced amax) is consistent and not flagged.
fn shared_input_scales(ck: &Checkpoint, linears: &[LinearStats], out: &mut Vec<Finding>) {
    let mut groups: BTreeMap<String, Vec<(usize, &LinearStats, f32)>> = BTreeMap::new();
    let down = |base: &str| base.ends_with(".down_proj") || base.ends_with(".w2");
    for l in linears.iter().filter(|l| down(&l.base)) {
        if let (Some((g, e)), Some(s)) = (expert_group(&l.base), l.input_scale) {
            if s.is_finite() && s > 0.0 {
                groups.entry(g).or_default().push((e, l, s));
            }
        }
    }
    let distinct = |v: &[(usize, &LinearStats, f32)]| {
        v.iter()
            .map(|x| x.2.to_bits())
            .collect::<BTreeSet<_>>()
            .len()
    };
    let proj_of = |g: &str| g.rsplit('.').next().unwrap_or(g).to_string();
    for (g, v) in &groups {
        if v.len() < SHARED_INPUT_SCALE_MIN_EXPERTS || distinct(v) != 1 {
            continue;
        }
        let Some((pg, pv)) = groups.iter().find(|(o, ov)| {
            proj_of(o) == proj_of(g)
                && ov.len() >= SHARED_INPUT_SCALE_MIN_EXPERTS
                && distinct(ov) > 1
        }) else {
            continue;
        };
        let &(_, l, s) = v.iter().min_by_key(|x| x.0).unwrap_or(&v[0]);
        let member = match l.convention {
            Convention::CompressedTensors => "input_global_scale",
            _ => "input_scale",
        };
        let t = format!("{}.{member}", l.base);
        out.push(Finding {
            tensor: t.clone(),
            file: ck.file_of(&t).to_path_buf(),
            kind: FindingKind::SharedInputScale,
            detail: format!(
                "all {} experts of `{g}` hold the same input_scale {s:e}, while the experts of `{pg}` each hold their own ({} distinct values over {}): this layer's per-expert activation scales were overwritten with one value (one expert's broadcast to all, or a calibration not run per expert); engines that quantize each expert's activations with its own gs = 1/input_scale use a scale calibrated for none of them",
                v.len(),
                distinct(pv),
                pv.len()
            ),
        });
    }
}

/// vLLM's check: `torch.allclose(w1, w3)` with its defaults.
fn allclose(a: f32, b: f32) -> bool {
    (a - b).abs() <= 1e-8 + 1e-5 * b.abs()
}

fn cross_checks(
    ck: &Checkpoint,
    linears: &[LinearStats],
    opts: &AuditOptions,
    out: &mut Vec<Finding>,
) {
    let by_base: BTreeMap<&str, &LinearStats> =
        linears.iter().map(|l| (l.base.as_str(), l)).collect();
    // gate/up weight_scale_2 of one expert (and of shared experts / dense MLPs alike)
    for l in linears {
        let Some(up) = super::names::up_sibling(&l.base) else {
            continue;
        };
        let Some(u) = by_base.get(up.as_str()) else {
            continue;
        };
        let (Some(a), Some(b)) = (l.weight_scale_2, u.weight_scale_2) else {
            continue;
        };
        // non-finite and non-positive scales are findings of their own (a ratio to 0 says
        // nothing more)
        let usable = |x: f32| x.is_finite() && x > 0.0;
        if usable(a) && usable(b) && !allclose(b, a) {
            // the member the up projection stores (compressed-tensors: its reciprocal)
            let t = [".weight_scale_2", ".weight_global_scale"]
                .iter()
                .map(|m| format!("{up}{m}"))
                .find(|t| ck.contains(t))
                .unwrap_or_else(|| format!("{up}.weight_scale_2"));
            out.push(Finding {
                tensor: t.clone(),
                file: ck.file_of(&t).to_path_buf(),
                kind: FindingKind::GateUpScaleMismatch,
                detail: format!(
                    "{}{b:e} vs the gate's {a:e} (ratio {:.4}): vLLM keeps only the gate's weight_scale_2 for the fused w13, so this projection is scaled by {:.4}",
                    if t.ends_with("weight_global_scale") {
                        "weight_scale_2 = 1/weight_global_scale: "
                    } else {
                        ""
                    },
                    b / a,
                    a / b
                ),
            });
        }
    }
    // missing input_scale where other linears have one
    let any_input = linears.iter().any(|l| l.input_scale.is_some());
    if any_input {
        for l in linears
            .iter()
            .filter(|l| l.input_scale.is_none() && l.format == Format::Nvfp4)
        {
            let member = match l.convention {
                Convention::CompressedTensors => "input_global_scale",
                _ => "input_scale",
            };
            let t = format!("{}.{member}", l.base);
            let mut detail = "missing, while other quantized linears have an input_scale: the engine falls back to a default activation scale here".to_string();
            if let Some(one) = layer_wide(ck, &l.base, member) {
                detail += &format!("; the layer stores one `{one}` for all its experts instead, which a per-expert loader never reads");
            }
            out.push(Finding {
                tensor: t,
                file: l.file.clone(),
                kind: FindingKind::MissingMember,
                detail,
            });
        }
    }
    shared_input_scales(ck, linears, out);
    // global-scale outliers across the experts of a layer
    scale_outliers(
        ck,
        linears,
        Member::InputScale,
        opts.input_scale_outlier,
        out,
    );
    scale_outliers(
        ck,
        linears,
        Member::WeightScale2,
        opts.weight_scale_outlier,
        out,
    );
}

/// The global scales `scale_outliers` compares across a layer's experts.
#[derive(Clone, Copy)]
enum Member {
    InputScale,
    WeightScale2,
}

/// Each expert's `member` more than `factor` times the median of the same projection over
/// its layer's experts, or less than the median over that factor (layers of 3 or more
/// experts; non-finite and non-positive scales are findings of their own).
fn scale_outliers(
    ck: &Checkpoint,
    linears: &[LinearStats],
    member: Member,
    factor: f32,
    out: &mut Vec<Finding>,
) {
    let (name, kind) = match member {
        Member::InputScale => ("input_scale", FindingKind::InputScaleOutlier),
        Member::WeightScale2 => ("weight_scale_2", FindingKind::WeightScaleOutlier),
    };
    let value = |l: &LinearStats| {
        match member {
            Member::InputScale => l.input_scale,
            Member::WeightScale2 => l.weight_scale_2,
        }
        .filter(|s| s.is_finite() && *s > 0.0)
    };
    let mut groups: BTreeMap<String, Vec<(&LinearStats, f32)>> = BTreeMap::new();
    for l in linears {
        if let (Some((g, _)), Some(s)) = (expert_group(&l.base), value(l)) {
            groups.entry(g).or_default().push((l, s));
        }
    }
    for (g, ls) in groups {
        if ls.len() < 3 {
            continue;
        }
        let mut v: Vec<f32> = ls.iter().map(|&(_, s)| s).collect();
        v.sort_by(f32::total_cmp);
        let median = if v.len() % 2 == 1 {
            v[v.len() / 2]
        } else {
            0.5 * (v[v.len() / 2 - 1] + v[v.len() / 2])
        };
        for (l, s) in ls {
            let detail = match member {
                _ if s <= factor * median && s * factor >= median => continue,
                Member::InputScale if s > median => format!(
                    "{s:e} is {:.1}x the median {median:e} of `{g}.input_scale`: engines that take the max over experts give every expert's activations a {:.1}x coarser scale",
                    f64::from(s) / f64::from(median),
                    f64::from(s) / f64::from(median)
                ),
                Member::InputScale => format!(
                    "{s:e} is 1/{:.1} of the median {median:e} of `{g}.input_scale`: engines that quantize each expert's activations with its own gs = 1/input_scale saturate this expert's block scales at 448 (clipped activations); engines that take the max over experts are unaffected",
                    f64::from(median) / f64::from(s)
                ),
                Member::WeightScale2 => format!(
                    "{s:e} is {} the median {median:e} of `{g}.weight_scale_2`: this expert's dequantized weights are that far off its siblings' (a global scale corrupted, or written for another tensor)",
                    // in f64: the ratio of two f32 scales can overflow f32 (1e36 over 3e-4)
                    if s > median {
                        format!("{:.3e}x", f64::from(s) / f64::from(median))
                    } else {
                        format!("1/{:.3e} of", f64::from(median) / f64::from(s))
                    }
                ),
            };
            // the member the linear stores (compressed-tensors: the reciprocal)
            let (t, detail) = match l.convention {
                Convention::CompressedTensors => {
                    let stored = match member {
                        Member::InputScale => "input_global_scale",
                        Member::WeightScale2 => "weight_global_scale",
                    };
                    (
                        format!("{}.{stored}", l.base),
                        format!("{name} = 1/{stored}: {detail}"),
                    )
                }
                _ => (format!("{}.{name}", l.base), detail),
            };
            out.push(Finding {
                tensor: t.clone(),
                file: ck.file_of(&t).to_path_buf(),
                kind,
                detail,
            });
        }
    }
}

/// Every MoE layer as `layertest` builds it, short of its routed experts
/// ([`super::model::MoeCheckpoint::check_structure`]): a missing or misshapen router weight,
/// selection bias, hash table or shared expert. A checkpoint that does not open as a DeepSeek
/// MoE model (no config.json, no expert tensors, a vLLM dump) is not looked at here; a tensor
/// already named by a finding (a NaN in the router weight) is not named twice.
fn layer_structure(ck: &Checkpoint, out: &mut Vec<Finding>) {
    let Ok(mc) = super::model::MoeCheckpoint::open(ck.path()) else {
        return;
    };
    for layer in mc.moe_layers() {
        let (file, tensor, detail) = match mc.check_structure(layer) {
            Ok(()) => continue,
            Err(Error::BadTensor { file, tensor, what }) => (file, tensor, what),
            Err(Error::BadFile { file, what }) => (file, String::new(), what),
            Err(e) => (ck.path().to_path_buf(), String::new(), e.to_string()),
        };
        if out.iter().any(|f| !tensor.is_empty() && f.tensor == tensor) {
            continue;
        }
        out.push(Finding {
            tensor,
            file,
            kind: FindingKind::BrokenLayer,
            detail: format!("layer {layer}: {detail}"),
        });
    }
}

/// Tensors a listed shard stores that the index's `weight_map` leaves out: transformers
/// loads by the weight_map and leaves that parameter as initialized (or fails on a strict
/// load); vLLM, which reads every tensor of every listed shard, loads it. The two engines then
/// run different models.
fn unindexed_tensors(ck: &Checkpoint, out: &mut Vec<Finding>) {
    let Some(index) = ck.index_path() else {
        return;
    };
    let file_name = |p: &std::path::Path| {
        p.file_name()
            .map_or_else(|| p.display().to_string(), |n| n.to_string_lossy().into())
    };
    for (name, shard) in ck.unindexed_tensors() {
        out.push(Finding {
            tensor: name.to_string(),
            file: shard.path().to_path_buf(),
            kind: FindingKind::UnindexedTensor,
            detail: format!(
                "stored in `{}`, but `{}`'s weight_map does not name it: transformers loads by the weight_map and never sees it (the parameter keeps its initialized values); vLLM, which reads every tensor of every listed shard, loads it",
                file_name(shard.path()),
                file_name(index)
            ),
        });
    }
}

/// `*.safetensors` files beside the index that it does not list. vLLM and SGLang load only
/// the files the `weight_map` names and transformers loads by the `weight_map`, so tensors such
/// a file holds and the `weight_map` names nowhere are loaded by no engine (an index written
/// without its last shard). A `model.safetensors` there is worse: transformers loads that
/// single file instead of the index, vLLM the index's shards, so the two load different
/// weights. Files whose tensors the index all places elsewhere are stale copies every engine
/// skips; unreadable ones too (no engine opens them), `model.safetensors` aside.
fn unlisted_shards(ck: &Checkpoint, out: &mut Vec<Finding>) {
    let Some(index) = ck.index_path() else {
        return;
    };
    let name_of = |p: &std::path::Path| {
        p.file_name()
            .map_or_else(|| p.display().to_string(), |n| n.to_string_lossy().into())
    };
    let index_name = name_of(index);
    for path in ck.unlisted_files() {
        let file = name_of(path);
        let single = file == super::hf::SINGLE_FILE;
        let opened = TensorFile::open(path);
        let (held, missing): (usize, Vec<String>) = match &opened {
            Ok(f) => (
                f.names().count(),
                f.names()
                    .filter(|n| !ck.contains(n))
                    .map(str::to_string)
                    .collect(),
            ),
            Err(_) => (0, vec![]),
        };
        let detail = if single {
            format!(
                "`{file}` lies beside `{index_name}`, which does not list it: transformers loads this single file and ignores the index ({}), vLLM loads the {} shard(s) the index lists and skips it, so the two engines load different weights; remove the file or the index",
                match &opened {
                    Ok(_) => format!(
                        "{held} tensor(s) here against the index's {}",
                        ck.names().count()
                    ),
                    Err(e) => format!("here it is unreadable: {e}"),
                },
                ck.shards().len()
            )
        } else if !missing.is_empty() {
            format!(
                "`{file}` lies beside `{index_name}`, which does not list it, and holds {} of its {held} tensor(s) that the weight_map names nowhere (first `{}`): no engine loads them (vLLM and transformers load only the shards the index lists), so those parameters keep their initialized values; the index was written without this shard",
                missing.len(),
                missing[0]
            )
        } else {
            continue;
        };
        out.push(Finding {
            tensor: missing.first().cloned().unwrap_or(file),
            file: path.clone(),
            kind: FindingKind::UnlistedShard,
            detail,
        });
    }
}

/// A tensor stored in two shards with different contents: the index names one copy, but
/// engines that load every tensor of every listed shard take whichever they read last.
fn duplicate_copies(ck: &Checkpoint, out: &mut Vec<Finding>) -> Result<()> {
    for (name, stray) in ck.shadowed_copies() {
        let (f, t) = ck.find(name)?;
        let s = stray.info(name)?;
        if t.dtype == s.dtype && t.shape == s.shape && f.slice(t) == stray.slice(s) {
            continue;
        }
        let file_name = |p: &std::path::Path| {
            p.file_name()
                .map_or_else(|| p.display().to_string(), |n| n.to_string_lossy().into())
        };
        out.push(Finding {
            tensor: name.to_string(),
            file: stray.path().to_path_buf(),
            kind: FindingKind::DuplicateTensor,
            detail: format!(
                "a second, different copy ({:?} {:?}) is stored in `{}`; the index names the one in `{}`: engines that load every tensor of every listed shard (vLLM, transformers) keep whichever shard they read last",
                s.dtype,
                s.shape,
                file_name(stray.path()),
                file_name(f.path())
            ),
        });
    }
    Ok(())
}

/// `fused_nvfp4`: vLLM-fused NVFP4 expert tensors (an engine dump's), which count as NVFP4
/// linears against the quantization config.
fn config_checks(
    ck: &Checkpoint,
    linears: &[LinearStats],
    fused_nvfp4: usize,
    out: &mut Vec<Finding>,
) -> Result<()> {
    let Some(p) = ck.config_path() else {
        // a single .safetensors file needs no config; a directory is what engines load
        if ck.is_dir() && !linears.is_empty() {
            let hq = ck.dir().join(super::hf::HF_QUANT_CONFIG_FILE).is_file();
            out.push(Finding {
                tensor: super::hf::CONFIG_FILE.into(),
                file: ck.dir().join(super::hf::CONFIG_FILE),
                kind: FindingKind::MissingConfig,
                detail: format!(
                    "a checkpoint directory with {} quantized linears but no {}{}: engines (vLLM, SGLang, TensorRT-LLM, transformers) build the model from it and cannot load this directory; the checks against it (layer shapes, quantization_config) were skipped",
                    linears.len(),
                    super::hf::CONFIG_FILE,
                    if hq {
                        format!(" (only {})", super::hf::HF_QUANT_CONFIG_FILE)
                    } else {
                        String::new()
                    }
                ),
            });
        }
        return Ok(());
    };
    // broken JSON or nonsense MoE fields are bad input; a dense model's config is only read
    // for its quantization part
    let layers_hint = super::names::Naming::detect(ck.names()).map(|n| {
        super::names::layers_present(&n, ck.names())
            .last()
            .map_or(0, |l| l + 1)
    });
    let (moe, quant) = super::config::check_config_file(&p, layers_hint)?;
    if let Some(cfg) = &moe {
        unstated_fields(cfg, out);
        missing_experts(ck, &cfg.moe, out);
        shapes_against_config(ck, &cfg.moe, out)?;
        dense_mlps_against_config(ck, &cfg.moe, &p, out)?;
        layers_against_config(ck, &cfg.moe, &p, out)?;
        router_bias_against_topk_method(ck, cfg, &p, out);
    }
    let nvfp4 = linears.iter().filter(|l| l.format == Format::Nvfp4).count() + fused_nvfp4;
    let file = p.clone();
    let mut push = |detail: String| {
        out.push(Finding {
            tensor: "quantization_config".into(),
            file: file.clone(),
            kind: FindingKind::ConfigMismatch,
            detail,
        })
    };
    match &quant {
        None if nvfp4 > 0 => push(format!(
            "{nvfp4} NVFP4 linears but no quantization_config (config.json or hf_quant_config.json): engines load them as plain weights"
        )),
        Some(q) if q.format() == Some(Format::Nvfp4) && nvfp4 == 0 => push(format!(
            "{} promises NVFP4 (quant_method {}) but the checkpoint holds no NVFP4 linear (its 2-D weights: {}): engines' NVFP4 loader looks for packed codes and block scales that are not there",
            q.source.display(),
            q.method.name(),
            weight_dtypes(ck)
        )),
        Some(q) if q.format() == Some(Format::Nvfp4) && q.group_size.is_some_and(|g| g != 16) => push(format!(
            "NVFP4 with group_size {}: NVFP4 blocks are 16",
            q.group_size.unwrap_or(0)
        )),
        // another algorithm promised (FP8, MXFP4, ...): engines pick that one's loader and
        // kernels for these linears (ModelOpt's MIXED_PRECISION names its algos per layer)
        Some(q)
            if nvfp4 > 0
                && q.format() != Some(Format::Nvfp4)
                && q.algo.as_deref().is_some_and(|a| !a.to_ascii_uppercase().contains("MIXED")) =>
        {
            push(format!(
                "{} promises quant_algo {} but the checkpoint holds {nvfp4} NVFP4 linears: engines load them with the {} method",
                q.source.display(),
                q.algo.as_deref().unwrap_or("?"),
                q.algo.as_deref().unwrap_or("?")
            ))
        }
        // a method of another format and no algorithm (DeepSeek's FP8 `quant_method: fp8`,
        // AWQ, GPTQ, ...): engines pick that method's loader
        Some(q) if nvfp4 > 0 && q.format().is_none() && q.algo.is_none() => push(format!(
            "{} states quant_method \"{}\" and no NVFP4 algorithm, but the checkpoint holds {nvfp4} NVFP4 linears (packed uint8 E2M1 codes, F8_E4M3 block scales of 16, a global scale each: weight_scale_2 or weight_global_scale): engines pick the {} loader from quant_method and load these bytes as garbage",
            q.source.display(),
            q.method.name(),
            q.method.name()
        )),
        _ => {}
    }
    // config.json's quantization_config wins, in vLLM and transformers; TensorRT-LLM reads
    // ModelOpt's hf_quant_config.json: when both are there they must promise the same
    let hq = p.with_file_name(super::hf::HF_QUANT_CONFIG_FILE);
    let mut hq_findings: Vec<String> = vec![];
    if let Some(q) = quant.as_ref().filter(|q| q.source != hq && hq.is_file()) {
        let mut push_hq = |detail: String| hq_findings.push(detail);
        let parsed = super::file::read_regular(&hq)
            .and_then(|t| super::config::parse_hf_quant_config(&hq, &t));
        match parsed {
            Err(e) => push_hq(format!(
                "unreadable ({e}) while config.json holds a quantization_config: TensorRT-LLM reads this file"
            )),
            Ok(h) => {
                let algo = |c: &super::config::QuantConfig| {
                    c.algo.as_deref().map(str::to_ascii_uppercase)
                };
                let mut differ = vec![];
                let (ha, qa) = (algo(&h), algo(q));
                // only what both files state: a quantization_config without quant_algo
                // leaves it to the other file, it does not contradict it
                let algos_differ = ha.is_some() && qa.is_some() && ha != qa;
                let formats_differ =
                    matches!((h.format(), q.format()), (Some(x), Some(y)) if x != y);
                if formats_differ || algos_differ {
                    differ.push(format!(
                        "quant_algo {} here, {} in config.json",
                        h.algo.as_deref().unwrap_or("-"),
                        q.algo.as_deref().unwrap_or("-")
                    ));
                }
                if let (Some(a), Some(b)) = (h.group_size, q.group_size) {
                    if a != b {
                        differ.push(format!("group_size {a} here, {b} in config.json"));
                    }
                }
                if !differ.is_empty() {
                    push_hq(format!(
                        "contradicts config.json's quantization_config: {}; engines that read this file \
                         (TensorRT-LLM) load the checkpoint otherwise than those that read config.json (vLLM, \
                         transformers){}",
                        differ.join(", "),
                        if nvfp4 > 0 {
                            format!("; the tensors hold {nvfp4} NVFP4 linears (blocks of 16)")
                        } else {
                            String::new()
                        }
                    ));
                }
            }
        }
    }
    // quantized linears the config leaves unquantized: engines that honor exclude_modules /
    // ignore build a plain layer there and load the packed codes as its weight (or fail on
    // the shape); one finding per pattern
    if let Some(q) = &quant {
        for pat in &q.exclude_modules {
            let Some(re) = exclude_pattern(pat) else {
                continue;
            };
            let hit: Vec<&str> = linears
                .iter()
                .filter(|l| !l.base.contains('[') && re.is_match(&l.base))
                .map(|l| l.base.as_str())
                .collect();
            if let Some(first) = hit.first() {
                push(format!(
                    "`{pat}` in the exclude list (exclude_modules / ignore) of {} covers {} quantized linear(s), first `{first}`: \
                     engines that honor it build an unquantized layer there and load the packed FP4 codes as its weight, or fail on the shape",
                    q.source.display(),
                    hit.len()
                ));
            }
        }
    }
    // the converse: float linears the config does not exclude; engines that honor the list
    // build an NVFP4 layer for each and find a float [N, K] where packed codes belong
    if let Some(q) = quant
        .as_ref()
        .filter(|q| nvfp4 > 0 && q.format() == Some(Format::Nvfp4))
    {
        if let Some(detail) = float_linears_not_excluded(ck, q) {
            push(detail);
        }
    }
    // the method names the loader, and each loader looks for its own member names
    if let Some(q) = &quant {
        let count = |c: Convention| {
            linears
                .iter()
                .filter(|l| l.format == Format::Nvfp4 && l.convention == c)
                .count()
        };
        let (mine, theirs, names) = match q.method {
            QuantMethod::Modelopt => (
                "modelopt",
                count(Convention::CompressedTensors),
                "compressed-tensors names (weight_global_scale / weight_packed, reciprocal global scales), which ModelOpt's loader does not read",
            ),
            QuantMethod::CompressedTensors => (
                "compressed-tensors",
                count(Convention::Modelopt),
                "ModelOpt names (weight_scale_2 / input_scale, dequant-direction global scales), which the compressed-tensors loader does not read",
            ),
            QuantMethod::Other(_) => ("", 0, ""),
        };
        if theirs > 0 {
            push(format!(
                "quant_method {mine}, but {theirs} NVFP4 linears use {names}"
            ));
        }
    }
    out.extend(hq_findings.into_iter().map(|detail| Finding {
        tensor: "quantization".into(),
        file: hq.clone(),
        kind: FindingKind::ConfigMismatch,
        detail,
    }));
    Ok(())
}

/// Most module names a finding lists.
const NAMES_SHOWN: usize = 5;

/// Float (BF16/F16/F32) linears of a checkpoint whose config promises NVFP4 and does not
/// exclude them: engines that honor exclude_modules / ignore build an NVFP4 layer for each
/// and find a float [N, K] where packed U8 [N, K/2] codes and block scales belong.
fn float_linears_not_excluded(ck: &Checkpoint, q: &super::config::QuantConfig) -> Option<String> {
    let excluded = ExcludeList::new(&q.exclude_modules);
    let mut modules: Vec<&str> = ck
        .names()
        .filter_map(|n| super::quantize::float_matrix_module(n, ck.info(n).ok()?))
        .filter(|m| !super::names::never_quantized(m) && !excluded.covers(m))
        .collect();
    modules.sort_unstable();
    if modules.is_empty() {
        return None;
    }
    let shown: Vec<String> = modules
        .iter()
        .take(NAMES_SHOWN)
        .map(|m| format!("`{m}`"))
        .collect();
    let more = match modules.len().saturating_sub(NAMES_SHOWN) {
        0 => String::new(),
        k => format!(" and {k} more"),
    };
    Some(format!(
        "{} promises NVFP4 but its exclude list (exclude_modules / ignore) does not cover {} float (BF16/F16/F32) linear(s): {}{more}; \
         engines that honor the list build an NVFP4 layer for each and find a float [N, K] weight where packed U8 [N, K/2] codes and block scales belong \
         (a load error, or garbage): exclude them, or quantize them",
        q.source.display(),
        modules.len(),
        shown.join(", ")
    ))
}

/// The dtypes of a checkpoint's 2-D `*.weight` tensors with their counts (`BF16 x 3, U8 x 1`).
fn weight_dtypes(ck: &Checkpoint) -> String {
    let mut by: BTreeMap<String, usize> = BTreeMap::new();
    for n in ck.names().filter(|n| n.ends_with(".weight")) {
        if let Ok(t) = ck.info(n) {
            if t.shape.len() == 2 {
                *by.entry(format!("{:?}", t.dtype)).or_default() += 1;
            }
        }
    }
    if by.is_empty() {
        return "none".into();
    }
    by.iter()
        .map(|(d, c)| format!("{d} x {c}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Fields config.json leaves out whose defaults differ between the config classes engines read
/// it with (`config::ENGINE_DEFAULTS`): two engines then run different MoE layers from one
/// checkpoint, and this tool a third when its own default is neither.
fn unstated_fields(cfg: &super::config::ModelConfig, out: &mut Vec<Finding>) {
    for u in &cfg.unstated {
        let Some(d) = u.defaults() else { continue };
        out.push(Finding {
            tensor: u.field.to_string(),
            file: cfg.path.clone(),
            kind: FindingKind::DefaultsDisagree,
            detail: format!(
                "config.json does not state {}, and engines default it differently: transformers' DeepseekV3Config to {}, DeepSeek-V3's configuration_deepseek.py to {}, DeepSeek-V2's (model_type deepseek_v2) to {}; audit used {}. Engines that load this config with different classes compute different MoE outputs from the same weights: state it",
                u.field, d.transformers_v3, d.deepseek_v3, d.deepseek_v2, u.used
            ),
        });
    }
}

/// Expert, shared-expert and router weights whose `[out, in]` is not what config.json's
/// dims make it (an engine builds its layers from config.json and then loads these tensors into
/// them: a crash at load at best, silently misread weights at worst). One finding per MoE layer
/// and role (routed gate/up, routed down, shared gate/up, shared down, router), naming the
/// first tensor and counting the others, so a model of 61 layers x 256 experts stays readable.
fn shapes_against_config(
    ck: &Checkpoint,
    cfg: &crate::moe::config::MoeConfig,
    out: &mut Vec<Finding>,
) -> Result<()> {
    use super::names::{Key, Naming, Proj, Scheme};
    let Some(n) = Naming::detect(ck.names()) else {
        return Ok(());
    };
    if n.scheme == Scheme::VllmFused {
        return Ok(());
    }
    let (h, i, e) = (
        cfg.hidden_size,
        cfg.moe_intermediate_size,
        cfg.n_routed_experts,
    );
    let i_s = i * cfg.n_shared_experts;
    // (layer, role) -> (what config.json gives, first offending tensor and its shape, count)
    type Bad = (String, String, [usize; 2], usize);
    let mut bad: BTreeMap<(usize, &'static str), Bad> = BTreeMap::new();
    for name in ck.names() {
        let Some(key) = n.parse(name) else { continue };
        let (role, want, dims) = match &key {
            Key::Expert { proj, member, .. } if member == "weight" || member == "weight_packed" => {
                match proj {
                    Proj::Down => (
                        "routed down",
                        [h, i],
                        "[hidden_size, moe_intermediate_size]",
                    ),
                    _ => (
                        "routed gate/up",
                        [i, h],
                        "[moe_intermediate_size, hidden_size]",
                    ),
                }
            }
            Key::SharedExpert { proj, member, .. }
                if member == "weight" || member == "weight_packed" =>
            {
                match proj {
                    Proj::Down => (
                        "shared down",
                        [h, i_s],
                        "[hidden_size, moe_intermediate_size x n_shared_experts]",
                    ),
                    _ => (
                        "shared gate/up",
                        [i_s, h],
                        "[moe_intermediate_size x n_shared_experts, hidden_size]",
                    ),
                }
            }
            Key::RouterWeight { .. } => ("router", [e, h], "[n_routed_experts, hidden_size]"),
            _ => continue,
        };
        let layer = key.layer();
        if !cfg.is_moe_layer(layer) {
            continue;
        }
        let Some(got) = logical_shape(ck, name)? else {
            continue;
        };
        if got == want {
            continue;
        }
        let entry = bad
            .entry((layer, role))
            .or_insert_with(|| (format!("{dims} = {want:?}"), name.to_string(), got, 0));
        entry.3 += 1;
    }
    for ((layer, role), (want, first, got, count)) in bad {
        let others = match count {
            1 => String::new(),
            2 => format!(" (and 1 more {role} weight of the layer)"),
            c => format!(" (and {} more {role} weights of the layer)", c - 1),
        };
        out.push(Finding {
            tensor: first.clone(),
            file: ck.file_of(&first).to_path_buf(),
            kind: FindingKind::ConfigMismatch,
            detail: format!(
                "layer {layer} {role} weight is [out, in] = {got:?}, config.json gives {want}{others}"
            ),
        });
    }
    Ok(())
}

/// The layer index of a tensor named `{prefix}layers.{l}.…` (or `layers.{l}.…`).
fn layer_of(name: &str) -> Option<usize> {
    let at = if name.starts_with("layers.") {
        0
    } else {
        name.find(".layers.")? + 1
    };
    let (l, _) = name[at..].strip_prefix("layers.")?.split_once('.')?;
    l.parse().ok()
}

/// `(layer, is_down)` of a dense MLP's weight: `{prefix}layers.{l}.mlp.{gate,up,down}_proj.weight`
/// (HF) or `layers.{l}.ffn.{w1,w3,w2}.weight` (native), also as `weight_packed`.
fn dense_mlp_weight(name: &str) -> Option<(usize, bool)> {
    let l = layer_of(name)?;
    let (_, rest) = name.split_once(&format!("layers.{l}."))?;
    let rest = rest
        .strip_suffix(".weight")
        .or_else(|| rest.strip_suffix(".weight_packed"))?;
    let down = match rest {
        "mlp.gate_proj" | "mlp.up_proj" | "ffn.w1" | "ffn.w3" => false,
        "mlp.down_proj" | "ffn.w2" => true,
        _ => return None,
    };
    Some((l, down))
}

/// Dense MLP weights against config.json: in the first `first_k_dense_replace` layers their
/// `[out, in]` must be what `intermediate_size` and `hidden_size` make it; in an MoE layer
/// there must be none (config.json's `first_k_dense_replace` is off: the engine builds routed
/// experts there and finds a dense MLP). One finding per layer and role.
fn dense_mlps_against_config(
    ck: &Checkpoint,
    cfg: &crate::moe::config::MoeConfig,
    config: &std::path::Path,
    out: &mut Vec<Finding>,
) -> Result<()> {
    let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
    // MoE every n-th layer only (moe_layer_freq > 1): the dense ones in between are not
    // told apart here
    let raw: serde_json::Value = super::file::read_regular(config)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default();
    let interleaved = raw
        .get("moe_layer_freq")
        .and_then(|v| v.as_u64())
        .is_some_and(|f| f > 1);
    // (layer, role) -> (first tensor, its shape, count)
    let mut bad: BTreeMap<(usize, &'static str), (String, [usize; 2], usize)> = BTreeMap::new();
    let mut in_moe: BTreeMap<usize, String> = BTreeMap::new();
    for name in ck.names() {
        let Some((layer, down)) = dense_mlp_weight(name) else {
            continue;
        };
        if layer >= cfg.num_hidden_layers {
            continue;
        }
        if cfg.is_moe_layer(layer) {
            if !interleaved {
                in_moe.entry(layer).or_insert_with(|| name.to_string());
            }
            continue;
        }
        let (role, want) = if down {
            ("down", [h, i])
        } else {
            ("gate/up", [i, h])
        };
        let Some(got) = logical_shape(ck, name)? else {
            continue;
        };
        if got != want {
            let e = bad
                .entry((layer, role))
                .or_insert_with(|| (name.to_string(), got, 0));
            e.2 += 1;
        }
    }
    for ((layer, role), (first, got, count)) in bad {
        let (want, dims) = if role == "down" {
            ([h, i], "[hidden_size, intermediate_size]")
        } else {
            ([i, h], "[intermediate_size, hidden_size]")
        };
        let more = if count > 1 { " (and its sibling)" } else { "" };
        out.push(Finding {
            tensor: first.clone(),
            file: ck.file_of(&first).to_path_buf(),
            kind: FindingKind::ConfigMismatch,
            detail: format!(
                "layer {layer} dense MLP {role} weight is [out, in] = {got:?}, config.json gives {dims} = {want:?}{more}: the engine builds the layer from config.json and cannot load it"
            ),
        });
    }
    for (layer, first) in in_moe {
        out.push(Finding {
            tensor: first.clone(),
            file: config.to_path_buf(),
            kind: FindingKind::ConfigMismatch,
            detail: format!(
                "layer {layer} holds a dense MLP (`{first}`), but config.json's first_k_dense_replace = {} makes it an MoE layer: the engine builds a router and routed experts there and finds none",
                cfg.first_k_dense_replace
            ),
        });
    }
    Ok(())
}

/// Routers' `e_score_correction_bias` under a `topk_method` that does not use it: DeepSeek-V3
/// is trained to pick experts on `score + bias` (`noaux_tc`); an engine that follows a stated
/// `greedy` (or any other method) builds routers without the bias, drops the checkpoint's
/// and picks other experts, with no error. (The reverse, `noaux_tc` without a bias, is bad
/// input everywhere.)
fn router_bias_against_topk_method(
    ck: &Checkpoint,
    cfg: &super::config::ModelConfig,
    config: &std::path::Path,
    out: &mut Vec<Finding>,
) {
    let Some(method) = cfg.topk_method.as_deref() else {
        return;
    };
    if method == "noaux_tc" {
        return;
    }
    let biases: Vec<&str> = ck
        .names()
        .filter(|n| n.ends_with("e_score_correction_bias"))
        .collect();
    let Some(first) = biases.first() else {
        return;
    };
    out.push(Finding {
        tensor: first.to_string(),
        file: config.to_path_buf(),
        kind: FindingKind::ConfigMismatch,
        detail: format!(
            "config.json states topk_method = \"{method}\", which picks experts on the router's scores alone, but the checkpoint holds {} e_score_correction_bias tensor(s) (`{first}`, ...): engines that follow config.json build routers without the bias, drop these and route tokens to other experts than the model was trained with (DeepSeek-V3 routes with noaux_tc: score + bias)",
            biases.len()
        ),
    });
}

/// The layers the checkpoint holds against config.json's `num_hidden_layers` (plus
/// `num_nextn_predict_layers`, DeepSeek's MTP layers stored after the last one, extra rather
/// than promised): a layer past them is never built (its weights are dropped); a layer config.json
/// promises that the checkpoint lacks, or holds without MLP weights, is built and run on
/// uninitialized weights. A checkpoint that holds the embedding or the output head is a whole
/// model and must hold every layer; an excerpt (a few layers to debug with) only those between
/// its first and last.
fn layers_against_config(
    ck: &Checkpoint,
    cfg: &crate::moe::config::MoeConfig,
    config: &std::path::Path,
    out: &mut Vec<Finding>,
) -> Result<()> {
    // the language model's layers only (a vision tower's `...layers.N.` are not its)
    let Some(prefix) = layers_prefix(ck) else {
        return Ok(());
    };
    let own = format!("{prefix}layers.");
    // layer -> does it hold MLP (or expert) weights
    let mut present: BTreeMap<usize, bool> = BTreeMap::new();
    for name in ck.names().filter(|name| name.starts_with(&own)) {
        let Some((l, rest)) = name[own.len()..].split_once('.') else {
            continue;
        };
        let Ok(l) = l.parse::<usize>() else { continue };
        *present.entry(l).or_default() |= is_mlp_weight(rest);
    }
    let Some((&last, _)) = present.last_key_value() else {
        return Ok(());
    };
    let raw: serde_json::Value = super::file::read_regular(config)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default();
    let nextn = raw
        .get("num_nextn_predict_layers")
        .and_then(|v| v.as_u64())
        .unwrap_or(0) as usize;
    let built = cfg.num_hidden_layers;
    let mtp = if nextn > 0 {
        format!(" (+ {nextn} MTP)")
    } else {
        String::new()
    };
    let mut push = |detail: String| {
        out.push(Finding {
            tensor: "num_hidden_layers".into(),
            file: config.to_path_buf(),
            kind: FindingKind::ConfigMismatch,
            detail,
        })
    };
    if last >= built + nextn {
        let past: Vec<String> = present
            .keys()
            .filter(|&&l| l >= built + nextn)
            .map(|l| l.to_string())
            .collect();
        push(format!(
            "num_hidden_layers = {built}{mtp}, but the checkpoint holds layer(s) {} past it: the engine never builds them and drops their weights",
            past.join(", ")
        ));
    }
    let whole = is_whole_model(ck);
    let first = present.keys().next().copied().unwrap_or(0);
    let absent: Vec<usize> = (0..built)
        .filter(|l| !present.contains_key(l) && (whole || (first..last).contains(l)))
        .collect();
    let uninitialized = "engines build every layer up to num_hidden_layers and run these on uninitialized (vLLM) or randomly initialized (transformers) weights";
    let mut missing = |detail: String| {
        out.push(Finding {
            tensor: "num_hidden_layers".into(),
            file: config.to_path_buf(),
            kind: FindingKind::MissingMember,
            detail,
        })
    };
    if !absent.is_empty() {
        let why = if whole {
            "it holds the embedding or the output head, so it is a whole model, not an excerpt of some layers".to_string()
        } else {
            format!("between layers {first} and {last}, which it holds")
        };
        missing(format!(
            "num_hidden_layers = {built}{mtp}, but the checkpoint holds no weights for {} ({why}): {uninitialized}",
            layer_ranges(&absent)
        ));
    }
    let any_mlp = present.values().any(|&m| m);
    let mlp_less: Vec<usize> = present
        .iter()
        .filter(|&(&l, &m)| l < built && !m && any_mlp)
        .map(|(&l, _)| l)
        .collect();
    if !mlp_less.is_empty() {
        missing(format!(
            "{} of num_hidden_layers = {built} {} tensors but no MLP or expert weights (a router at most), while other layers hold theirs: {uninitialized}",
            layer_ranges(&mlp_less),
            if mlp_less.len() > 1 { "hold" } else { "holds" }
        ));
    }
    Ok(())
}

/// The prefix of the language model's `layers.{l}.`: the experts' ([`Naming::detect`]), else,
/// in a checkpoint without experts (one cut before its first MoE layer), the one most MLP
/// tensors share.
fn layers_prefix(ck: &Checkpoint) -> Option<String> {
    if let Some(n) = Naming::detect(ck.names()) {
        return Some(n.prefix);
    }
    let mut votes: BTreeMap<&str, usize> = BTreeMap::new();
    for (prefix, _, rest) in ck.names().filter_map(super::names::split_layer) {
        if is_mlp_weight(rest) {
            *votes.entry(prefix).or_default() += 1;
        }
    }
    votes
        .into_iter()
        .max_by_key(|&(_, n)| n)
        .map(|(p, _)| p.to_string())
}

/// Under `layers.{l}.`: an MLP's or an expert's tensor (dense MLP, routed and shared experts,
/// vLLM's fused expert tensors), not the router's.
fn is_mlp_weight(rest: &str) -> bool {
    let Some(m) = rest
        .strip_prefix("mlp.")
        .or_else(|| rest.strip_prefix("ffn."))
    else {
        return false;
    };
    !(m.starts_with("gate.") || m.starts_with("tid2eid"))
}

/// A whole model's checkpoint holds the embedding or the output head (HF `embed_tokens` /
/// `lm_head`, native `embed` / `head`) outside its layers (an MTP layer holds its own).
fn is_whole_model(ck: &Checkpoint) -> bool {
    ck.names().filter(|n| layer_of(n).is_none()).any(|n| {
        n.contains("embed_tokens.")
            || n.starts_with("lm_head.")
            || n.starts_with("embed.")
            || n.starts_with("head.")
    })
}

/// `[2, 3, 4, 6]` → `layers 2-4, 6`; `[4]` → `layer 4`.
fn layer_ranges(v: &[usize]) -> String {
    let mut runs: Vec<String> = vec![];
    let mut i = 0;
    while i < v.len() {
        let mut j = i;
        while j + 1 < v.len() && v[j + 1] == v[j] + 1 {
            j += 1;
        }
        runs.push(if i == j {
            v[i].to_string()
        } else {
            format!("{}-{}", v[i], v[j])
        });
        i = j + 1;
    }
    let plural = if v.len() > 1 { "layers" } else { "layer" };
    format!("{plural} {}", runs.join(", "))
}

/// `[out, in]` of a 2-D weight as the layer uses it: packed FP4 bytes hold two values each
/// (a U8/I8 weight with block scales beside it), any other 2-D tensor is taken as stored.
/// None for tensors of another rank (the tensor checks report those).
fn logical_shape(ck: &Checkpoint, name: &str) -> Result<Option<[usize; 2]>> {
    let t = ck.info(name)?;
    let &[rows, cols] = t.shape.as_slice() else {
        return Ok(None);
    };
    let base = name
        .strip_suffix(".weight_packed")
        .or_else(|| name.strip_suffix(".weight"))
        .unwrap_or(name);
    // U8 weights are packed FP4 whatever their scales (missing, of another dtype or rank:
    // findings of their own); an I8 one when a quantization member sits beside it
    let packed = name.ends_with(".weight_packed")
        || t.dtype == Dtype::U8
        || (t.dtype == Dtype::I8
            && [
                "weight_scale",
                "scale",
                "weight_scale_2",
                "weight_global_scale",
            ]
            .iter()
            .any(|s| ck.contains(&format!("{base}.{s}"))));
    Ok(Some([rows, if packed { 2 * cols } else { cols }]))
}

/// Experts config.json promises that a layer's names do not show.
fn missing_experts(ck: &Checkpoint, cfg: &crate::moe::config::MoeConfig, out: &mut Vec<Finding>) {
    use super::names::{inventory, Naming, Proj, Scheme};
    let e_count = cfg.n_routed_experts;
    let Some(n) = Naming::detect(ck.names()) else {
        return;
    };
    if n.scheme == Scheme::VllmFused {
        return;
    }
    for (l, inv) in inventory(&n, ck.names()) {
        if inv.experts.is_empty() {
            continue;
        }
        if l < cfg.first_k_dense_replace {
            let e0 = inv.experts.iter().next().copied().unwrap_or(0);
            out.push(Finding {
                tensor: format!("{}.weight", n.expert(l, e0, Proj::Gate)),
                file: ck.path().to_path_buf(),
                kind: FindingKind::ConfigMismatch,
                detail: format!(
                    "layer {l} holds {} routed experts, but config.json's first_k_dense_replace = {} makes it a dense MLP: engines build a dense layer there and cannot load them",
                    inv.experts.len(),
                    cfg.first_k_dense_replace
                ),
            });
            continue;
        }
        let missing: Vec<usize> = (0..e_count).filter(|e| !inv.experts.contains(e)).collect();
        if let Some(&e0) = missing.first() {
            out.push(Finding {
                tensor: format!("{}.weight", n.expert(l, e0, Proj::Gate)),
                file: ck.path().to_path_buf(),
                kind: FindingKind::MissingMember,
                detail: format!(
                    "layer {l} lacks {} of the n_routed_experts = {e_count} experts of config.json (first: expert {e0})",
                    missing.len()
                ),
            });
        }
        if let Some(&extra) = inv.experts.iter().find(|&&e| e >= e_count) {
            out.push(Finding {
                tensor: format!("{}.weight", n.expert(l, extra, Proj::Gate)),
                file: ck.path().to_path_buf(),
                kind: FindingKind::MissingMember,
                detail: format!("expert {extra} of layer {l} is past n_routed_experts = {e_count} of config.json"),
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expert_groups_and_siblings() {
        assert_eq!(
            expert_group("model.layers.3.mlp.experts.17.gate_proj"),
            Some(("model.layers.3.mlp.experts.*.gate_proj".into(), 17))
        );
        assert_eq!(
            expert_group("model.layers.3.mlp.shared_experts.gate_proj"),
            None
        );
        assert_eq!(index_str(&[3, 4], 7), "[1, 3]");
        assert_eq!(layer_ranges(&[30, 31, 32, 60]), "layers 30-32, 60");
        assert_eq!(layer_ranges(&[2, 4]), "layers 2, 4");
        assert_eq!(layer_ranges(&[4]), "layer 4");
        assert!(is_mlp_weight("mlp.experts.3.down_proj.weight_scale"));
        assert!(is_mlp_weight("mlp.gate_proj.weight") && is_mlp_weight("ffn.w1.weight"));
        assert!(!is_mlp_weight("mlp.gate.weight") && !is_mlp_weight("self_attn.o_proj.weight"));
    }

    #[test]
    fn scale_scan_counts_as_one_scale_at_a_time() {
        use rand::{Rng, SeedableRng};
        let seed: u64 = rand::random();
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        for format in [Format::Nvfp4, Format::Mxfp4] {
            // past one 64 Ki chunk, so that the chunks' first NaN indices meet in the reduce
            let n = r.gen_range(70_000..200_000);
            let mut b: Vec<u8> = (0..n).map(|_| r.gen_range(0x20..0x70u8)).collect();
            // every class at least once (a random draw of classes once planted only 0x7D, no
            // class at all, 1 run in ~300), then a few more; NaN codes in the second chunk
            // only (or none)
            let classes = [0x00, 0x80, 0x7E, 0xFE, 0x81, 0xB0, 0x7D];
            for k in 0..classes.len() + r.gen_range(0..50) {
                let i = r.gen_range(0..n);
                b[i] = classes[if k < classes.len() {
                    k
                } else {
                    r.gen_range(0..7)
                }];
            }
            let nans = r.gen_range(0..4);
            for _ in 0..nans {
                b[r.gen_range(65_536..n)] = [0x7F, 0xFF][r.gen_range(0..2)];
            }
            let mut want = ScaleScan::default();
            let mut maxc = 0u8;
            for (i, &x) in b.iter().enumerate() {
                if scale_is_nan(format, x) {
                    want.nan += 1;
                    want.first_nan.get_or_insert(i);
                    continue;
                }
                if format == Format::Nvfp4 {
                    let mag = x & 0x7F;
                    want.negative += (x & 0x80 != 0 && mag != 0) as u64;
                    want.saturated += (mag == e4m3::MAX_CODE) as u64;
                    want.zero += (mag == 0) as u64;
                    maxc = maxc.max(mag);
                } else {
                    // E8M0 code 0 is 2^-127: counted as zero
                    want.zero += (x == 0) as u64;
                    maxc = maxc.max(x);
                }
            }
            let got = scan_scales(format, &b);
            let key = |s: &ScaleScan| (s.nan, s.first_nan, s.negative, s.saturated, s.zero);
            assert_eq!(
                key(&got),
                key(&want),
                "seed {seed}: {format:?}, {n} scales, {nans} NaN codes"
            );
            assert_eq!(
                got.max.to_bits(),
                format.decode_scale(maxc).to_bits(),
                "seed {seed}"
            );
            assert!(want.negative + want.zero + want.saturated > 0 || format == Format::Mxfp4);
        }
    }

    #[test]
    fn nonfinite_counts_every_float_dtype() {
        let mut r = rand::thread_rng();
        use rand::Rng;
        let n = r.gen_range(10..70000);
        let at = r.gen_range(0..n);
        let mut v: Vec<f32> = (0..n).map(|_| r.gen_range(-1.0..1.0)).collect();
        v[at] = f32::INFINITY;
        let b = crate::checkpoint::writer::bf16_bytes(&v);
        assert_eq!(count_nonfinite(Dtype::BF16, &b), (1, Some(at)));
        let b = crate::checkpoint::writer::f32_bytes(&v);
        assert_eq!(count_nonfinite(Dtype::F32, &b), (1, Some(at)));
        v[at] = 0.5;
        let b = crate::checkpoint::writer::f32_bytes(&v);
        assert_eq!(count_nonfinite(Dtype::F32, &b), (0, None));
        assert_eq!(
            count_nonfinite(Dtype::F8_E4M3, &[0x7E, 0xFF, 0x7F]),
            (2, Some(1))
        );
    }

    /// `block_values` against a plain per-element dequantization: a block is dead when its
    /// scale is zero (E8M0 code 0) and one of its codes is not ±0, overflowing when one of its
    /// dequantized values is not finite (NaN scales aside).
    #[test]
    fn block_values_match_a_plain_dequantization() {
        use rand::{Rng, SeedableRng};
        let seed: u64 = rand::random();
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        for format in [Format::Nvfp4, Format::Mxfp4] {
            let block = format.block();
            let (rows, kb) = (r.gen_range(1..40), r.gen_range(1..6));
            let cols = kb * block;
            let mut packed: Vec<u8> = (0..rows * cols / 2).map(|_| r.gen()).collect();
            let mut scales: Vec<u8> = (0..rows * kb).map(|_| r.gen()).collect();
            // some all-±0 blocks, some zero scales, a whole dead row
            for _ in 0..r.gen_range(1..8) {
                let b = r.gen_range(0..rows * kb);
                packed[b * block / 2..(b + 1) * block / 2]
                    .iter_mut()
                    .for_each(|x| *x &= 0x88);
            }
            for _ in 0..r.gen_range(1..8) {
                scales[r.gen_range(0..rows * kb)] = 0;
            }
            let dead_row = r.gen_range(0..rows);
            scales[dead_row * kb..(dead_row + 1) * kb].fill(0);
            packed[dead_row * cols / 2..(dead_row + 1) * cols / 2]
                .iter_mut()
                .for_each(|x| *x |= 0x11);
            let ws2 = match format {
                Format::Nvfp4 => [1e-3f32, 1e36, 3e35][r.gen_range(0..3)],
                Format::Mxfp4 => 1.0,
            };
            let mut want = BlockValues::default();
            for row in 0..rows {
                let mut row_dead = 0;
                for k in 0..kb {
                    let b = row * kb + k;
                    let s = scales[b];
                    let codes: Vec<f32> = (0..block)
                        .map(|j| {
                            let byte = packed[b * block / 2 + j / 2];
                            let c = if j % 2 == 0 { byte & 0xF } else { byte >> 4 };
                            e2m1::VALUES[(c & 7) as usize]
                        })
                        .collect();
                    let zero = match format {
                        Format::Nvfp4 => s & 0x7F == 0,
                        Format::Mxfp4 => s == 0,
                    };
                    if zero && codes.iter().any(|&c| c != 0.0) {
                        want.dead += 1;
                        row_dead += 1;
                        want.first_dead.get_or_insert(b);
                    }
                    let sv = format.decode_scale(s).abs();
                    if !scale_is_nan(format, s)
                        && codes.iter().any(|&c| !((c * sv) * ws2).is_finite())
                    {
                        want.overflow += 1;
                        want.first_overflow.get_or_insert(b);
                    }
                }
                want.dead_rows += (row_dead == kb) as u64;
            }
            let got = block_values(format, cols, &scales, &packed, ws2);
            assert_eq!(
                got, want,
                "seed {seed}: {format:?} {rows}x{cols}, ws2 {ws2}"
            );
            assert!(got.dead > 0 && got.dead_rows > 0, "seed {seed}");
        }
    }

    /// `positions` against a filter a byte, over several pieces and a ragged end.
    #[test]
    fn positions_are_every_place_of_the_code_in_order() {
        use rand::{Rng, SeedableRng};
        let seed: u64 = rand::random();
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let n = r.gen_range(200_000..300_000);
        let mut bytes: Vec<u8> = (0..n).map(|_| r.gen_range(0..0x7E)).collect();
        for _ in 0..r.gen_range(1..200) {
            let at = r.gen_range(0..n);
            bytes[at] = 0x7E;
        }
        let want: Vec<usize> = (0..n).filter(|&i| bytes[i] == 0x7E).collect();
        assert_eq!(positions(&bytes, 0x7E), want, "seed {seed}");
    }

    /// The scales `block_values` looks under are a byte form (so rows are checked in vector
    /// compares) under any global scale, and a row holds one exactly when it holds a suspect.
    #[test]
    fn suspect_scales_are_a_byte_form_under_every_global_scale() {
        use rand::{Rng, SeedableRng};
        let seed: u64 = rand::random();
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let mut ws2s = vec![
            0.0,
            f32::MIN_POSITIVE / 4.0,
            1e-3,
            1.0,
            1e36,
            3e35,
            f32::MAX,
        ];
        ws2s.extend((0..200).map(|_| f32::from_bits(r.gen_range(0..0x7F80_0000u32))));
        for format in [Format::Nvfp4, Format::Mxfp4] {
            for &ws2 in &ws2s {
                let s = Suspects::new(format, ws2);
                let what = format!("seed {seed}: {format:?}, ws2 {ws2:e}");
                assert!(s.exact, "{what}");
                for b in 0..=255u8 {
                    let want = scale_is_zero(format, b) || overflows(format, b, e2m1::MAX, ws2);
                    assert_eq!(s.is(b), want, "{what}, scale {b:#04x}");
                }
                // a row of healthy scales with at most one suspect somewhere
                let healthy: Vec<u8> = (0..=255u8).filter(|&b| !s.is(b)).collect();
                let mut row: Vec<u8> = (0..r.gen_range(1..300))
                    .map(|_| healthy[r.gen_range(0..healthy.len())])
                    .collect();
                assert!(!s.any(&row), "{what}: {row:?}");
                let b = r.gen();
                let at = r.gen_range(0..row.len());
                row[at] = b;
                assert_eq!(s.any(&row), s.is(b), "{what}, scale {b:#04x}");
            }
        }
    }
}
