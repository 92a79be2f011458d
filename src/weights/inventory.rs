//! What one side holds, under canonical names both sides share: every quantized linear is one
//! unit keyed by the HF name of its weight (`model.layers.3.mlp.experts.7.gate_proj.weight`),
//! whether it is a ModelOpt / compressed-tensors / MXFP4 triple, a BF16 tensor, or one
//! projection of one expert inside vLLM's fused `w13_weight` / `w2_weight`. Everything else is a
//! plain tensor unit.

use super::rules::Renamed;
use crate::checkpoint::formats::{find_linear, quantized_bases};
use crate::checkpoint::{Key, LinearNames, Naming, Proj, Scheme, TensorSource};
use crate::error::{Error, Result};
use crate::moe::ep::ExpertMap;
use std::collections::{BTreeMap, HashSet};

/// One projection of one expert in vLLM's fused tensors.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FusedSlice {
    pub layer: usize,
    pub proj: Proj,
    /// Position along the fused tensors' expert dim (a local id under EP).
    pub index: usize,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    /// A quantized linear as separate tensors.
    Linear(LinearNames),
    /// A slice of fused expert tensors.
    Fused(FusedSlice),
    /// One plain tensor (float or integer).
    Tensor(String),
    /// One part of a merged linear (`gate_up_proj`, `fused_qkv_a_proj`).
    Merged(super::merged::MergedPart),
    /// The side under test's quantized linear that lacks a member it cannot be read without
    /// (its packed weight or its block scales): the tensors it has, and what is missing.
    Incomplete { names: Vec<String>, problem: String },
}

/// A routed expert's projection: what cross-expert diagnoses group by.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ExpertProj {
    pub layer: usize,
    pub expert: usize,
    pub proj: Proj,
}

#[derive(Clone, Debug)]
pub struct Unit {
    pub key: String,
    pub source: Source,
    pub expert: Option<ExpertProj>,
}

/// The fused tensors of one layer.
#[derive(Clone, Debug)]
pub struct FusedLayer {
    pub layer: usize,
    /// Experts along dim 0.
    pub experts: usize,
    /// `w13_*` / `w2_*` names present, by member (`weight`, `weight_scale`, ...).
    pub w13: BTreeMap<String, String>,
    pub w2: BTreeMap<String, String>,
    /// Values vLLM derives at load time (`g1_alphas`, `w13_input_scale_quant`, ...), by name.
    pub derived: BTreeMap<String, String>,
    /// Global expert id of each index.
    pub global: Vec<usize>,
}

impl FusedLayer {
    pub fn member(&self, w13: bool, m: &str) -> Option<&str> {
        (if w13 { &self.w13 } else { &self.w2 })
            .get(m)
            .map(|s| s.as_str())
    }
}

#[derive(Debug)]
pub struct Inventory {
    pub naming: Option<Naming>,
    pub units: BTreeMap<String, Unit>,
    pub fused: BTreeMap<usize, FusedLayer>,
}

/// The canonical key of a routed expert projection's weight.
pub fn expert_key(layer: usize, expert: usize, proj: Proj) -> String {
    format!("{}.weight", Naming::hf_v3().expert(layer, expert, proj))
}

/// Fused members understood here: the ModelOpt set (and compressed-tensors' `weight_packed`,
/// `weight_global_scale`, `input_global_scale`).
const FUSED_MEMBERS: [&str; 8] = [
    "weight",
    "weight_packed",
    "blockscale_swizzled",
    "weight_scale",
    "weight_scale_2",
    "weight_global_scale",
    "input_scale",
    "input_global_scale",
];

/// Per-expert values vLLM's ModelOpt NVFP4 MoE computes after loading.
pub const DERIVED: [&str; 4] = [
    "g1_alphas",
    "g2_alphas",
    "w13_input_scale_quant",
    "w2_input_scale_quant",
];

/// Every member name a quantized linear may have (ModelOpt, compressed-tensors, MXFP4).
const LINEAR_MEMBERS: [&str; 8] = [
    "weight",
    "weight_packed",
    "weight_scale",
    "scale",
    "weight_scale_2",
    "weight_global_scale",
    "input_scale",
    "input_global_scale",
];

/// Canonical name of a tensor that is not a quantized linear's member.
fn canonical(naming: Option<&Naming>, name: &str) -> (String, Option<ExpertProj>) {
    let hf = Naming::hf_v3();
    let Some(n) = naming else {
        return (name.to_string(), None);
    };
    // a name of the side's own scheme, or (a dump whose loader renamed only some tensors) of
    // the HF one
    if let Some(k) = n.parse(name).or_else(|| hf.parse(name)) {
        return match k {
            Key::Expert {
                layer,
                expert,
                proj,
                member,
            } => (
                format!("{}.{member}", hf.expert(layer, expert, proj)),
                (member == "weight").then_some(ExpertProj {
                    layer,
                    expert,
                    proj,
                }),
            ),
            Key::SharedExpert {
                layer,
                proj,
                member,
            } => (format!("{}.{member}", hf.shared_expert(layer, proj)), None),
            Key::DenseMlp {
                layer,
                proj,
                member,
            } => (format!("{}.{member}", hf.dense_mlp(layer, proj)), None),
            Key::RouterWeight { layer } => (hf.router_weight(layer), None),
            Key::RouterBias { layer } => (hf.router_bias(layer), None),
            Key::Tid2eid { layer } => (hf.tid2eid(layer), None),
            Key::Norm { layer } => (hf.norm(layer), None),
            Key::Fused { layer, w13, member } => (hf.fused(layer, w13, &member), None),
        };
    }
    // other tensors keep their name, under the HF prefix
    match name.strip_prefix(n.prefix.as_str()) {
        Some(rest) if n.prefix != hf.prefix && !name.starts_with(hf.prefix.as_str()) => {
            (format!("{}{rest}", hf.prefix), None)
        }
        _ => (name.to_string(), None),
    }
}

impl Inventory {
    /// Inventory of `src`. `ep` maps fused indices to global expert ids (the side is an EP
    /// shard); without it index = global id. `strict`: a quantized linear missing its packed
    /// weight or block scales is bad input (the reference); else it is a unit of its own,
    /// compared as missing those members (the side under test: a loader that dropped one).
    pub fn build(src: &Renamed, ep: Option<&ExpertMap>, strict: bool) -> Result<Inventory> {
        let naming = Naming::detect(src.tensor_names());
        let mut units: BTreeMap<String, Unit> = BTreeMap::new();
        let mut consumed: HashSet<String> = HashSet::new();
        let insert = |units: &mut BTreeMap<String, Unit>, u: Unit, from: &str| -> Result<()> {
            if let Some(prev) = units.get(&u.key) {
                return Err(Error::bad_tensor(
                    src.file_of(from),
                    src.original(from),
                    format!(
                        "stands for `{}`, which {} stands for as well",
                        u.key,
                        describe(&prev.source)
                    ),
                ));
            }
            units.insert(u.key.clone(), u);
            Ok(())
        };

        // fused expert tensors
        let mut fused: BTreeMap<usize, FusedLayer> = BTreeMap::new();
        if let Some(n) = naming.as_ref().filter(|n| n.scheme == Scheme::VllmFused) {
            for name in src.tensor_names() {
                if let Some(Key::Fused { layer, w13, member }) = n.parse(name) {
                    if !FUSED_MEMBERS.contains(&member.as_str()) {
                        continue;
                    }
                    let fl = fused.entry(layer).or_insert_with(|| FusedLayer {
                        layer,
                        experts: 0,
                        w13: BTreeMap::new(),
                        w2: BTreeMap::new(),
                        derived: BTreeMap::new(),
                        global: vec![],
                    });
                    let m = match member.as_str() {
                        "weight_packed" => "weight",
                        // vLLM's name for the swizzled copy it keeps after loading
                        "blockscale_swizzled" => "weight_scale",
                        m => m,
                    };
                    (if w13 { &mut fl.w13 } else { &mut fl.w2 })
                        .insert(m.to_string(), name.to_string());
                    consumed.insert(name.to_string());
                }
            }
            // what vLLM derives from the scales at load time (checked in `derived`)
            for name in src.tensor_names() {
                let Some((_, layer, rest)) = crate::checkpoint::names::split_layer(name) else {
                    continue;
                };
                let Some(d) = rest.strip_prefix("mlp.experts.") else {
                    continue;
                };
                if let (Some(fl), true) = (fused.get_mut(&layer), DERIVED.contains(&d)) {
                    fl.derived.insert(d.to_string(), name.to_string());
                    consumed.insert(name.to_string());
                }
            }
            for fl in fused.values_mut() {
                let weight = fl.w13.get("weight").or(fl.w2.get("weight")).cloned();
                let Some(w) = weight else { continue };
                let info = src.tensor_info(&w)?;
                let e = info.shape.first().copied().unwrap_or(0);
                if info.shape.len() != 3 {
                    return Err(Error::bad_tensor(
                        src.file_of(&w),
                        src.original(&w),
                        format!(
                            "fused expert weight of shape {:?}: expected [experts, rows, cols]",
                            info.shape
                        ),
                    ));
                }
                fl.experts = e;
                fl.global = match ep {
                    Some(m) => (0..e)
                        .map(|i| m.global(i as i64).unwrap_or(usize::MAX))
                        .collect(),
                    None => (0..e).collect(),
                };
                for (w13, projs) in [
                    (true, &[Proj::Gate, Proj::Up][..]),
                    (false, &[Proj::Down][..]),
                ] {
                    let prefix = if w13 { "w13" } else { "w2" };
                    let Some(wname) = fl.member(w13, "weight") else {
                        // the reference's block scales without their packed weight
                        if let (true, Some(sname)) = (strict, fl.member(w13, "weight_scale")) {
                            return Err(Error::bad_tensor(
                                src.file_of(sname),
                                src.original(sname),
                                format!("fused block scales without their packed weight `{prefix}_weight`"),
                            ));
                        }
                        continue;
                    };
                    let packed = matches!(
                        src.tensor_info(wname)?.dtype,
                        safetensors::Dtype::U8 | safetensors::Dtype::I8
                    );
                    if strict && packed && fl.member(w13, "weight_scale").is_none() {
                        return Err(Error::bad_tensor(
                            src.file_of(wname),
                            src.original(wname),
                            format!(
                                "packed FP4 weight without block scales (`{prefix}_weight_scale` missing)"
                            ),
                        ));
                    }
                    for index in 0..e {
                        let g = fl.global[index];
                        for &proj in projs {
                            let key = if g == usize::MAX {
                                // an index beyond this rank's experts: keep it visible as extra
                                // (gate and up of a w13 index each, or the two collide)
                                let base = format!(
                                    "{}[{index}]",
                                    Naming::hf_v3().fused(fl.layer, w13, "weight")
                                );
                                if w13 {
                                    format!("{base}.{}", proj.hf())
                                } else {
                                    base
                                }
                            } else {
                                expert_key(fl.layer, g, proj)
                            };
                            let from = fl.member(w13, "weight").unwrap_or_default().to_string();
                            insert(
                                &mut units,
                                Unit {
                                    key,
                                    source: Source::Fused(FusedSlice {
                                        layer: fl.layer,
                                        proj,
                                        index,
                                    }),
                                    expert: (g != usize::MAX).then_some(ExpertProj {
                                        layer: fl.layer,
                                        expert: g,
                                        proj,
                                    }),
                                },
                                &from,
                            )?;
                        }
                    }
                }
            }
        }

        // quantized linears stored as triples, and packed weights whose block scales are gone
        // (found by their global scale: not a float tensor to compare as such)
        let mut bases = quantized_bases(src);
        bases.extend(src.tensor_names().filter_map(|n| {
            let base = n
                .strip_suffix(".weight_scale_2")
                .or_else(|| n.strip_suffix(".weight_global_scale"))?;
            let packed = src
                .tensor_info(&format!("{base}.weight"))
                .is_ok_and(|t| matches!(t.dtype, safetensors::Dtype::U8 | safetensors::Dtype::I8));
            packed.then(|| base.to_string())
        }));
        bases.sort();
        bases.dedup();
        for base in bases {
            if consumed.contains(&format!("{base}.weight_scale")) {
                continue;
            }
            let ln = match find_linear(src, &base) {
                Ok(Some(ln)) => ln,
                Ok(None) => continue,
                Err(e) if strict => return Err(e),
                Err(e) => {
                    let names: Vec<String> = LINEAR_MEMBERS
                        .iter()
                        .map(|m| format!("{base}.{m}"))
                        .filter(|n| src.contains(n))
                        .collect();
                    let Some(from) = names.first().cloned() else {
                        return Err(e);
                    };
                    consumed.extend(names.iter().cloned());
                    let (key, expert) = canonical(naming.as_ref(), &format!("{base}.weight"));
                    let problem = match e {
                        Error::BadTensor { tensor, what, .. } => format!("`{tensor}`: {what}"),
                        e => e.to_string(),
                    };
                    insert(
                        &mut units,
                        Unit {
                            key,
                            source: Source::Incomplete { names, problem },
                            expert,
                        },
                        &from,
                    )?;
                    continue;
                }
            };
            let (key, expert) = canonical(naming.as_ref(), &ln.weight_name_as_weight());
            for m in ln.members() {
                consumed.insert(m.to_string());
            }
            let from = ln.weight.clone();
            insert(
                &mut units,
                Unit {
                    key,
                    source: Source::Linear(ln),
                    expert,
                },
                &from,
            )?;
        }

        // everything else
        for name in src.tensor_names() {
            if consumed.contains(name) {
                continue;
            }
            let (key, expert) = canonical(naming.as_ref(), name);
            insert(
                &mut units,
                Unit {
                    key,
                    source: Source::Tensor(name.to_string()),
                    expert,
                },
                name,
            )?;
        }
        Ok(Inventory {
            naming,
            units,
            fused,
        })
    }

    /// Largest routed-expert id + 1 (0 without experts).
    pub fn expert_count(&self) -> usize {
        self.units
            .values()
            .filter_map(|u| u.expert.map(|e| e.expert + 1))
            .max()
            .unwrap_or(0)
    }
}

fn describe(s: &Source) -> String {
    match s {
        Source::Linear(l) => format!("`{}`", l.weight),
        Source::Fused(f) => format!("fused expert index {} of layer {}", f.index, f.layer),
        Source::Tensor(t) => format!("`{t}`"),
        Source::Incomplete { names, .. } => format!("`{}`", names.join("`, `")),
        Source::Merged(m) => format!("part {} of {}", m.part, describe(&m.inner)),
    }
}

/// Small helpers over the checkpoint reader's `LinearNames`.
pub trait LinearNamesExt {
    /// `{base}.weight`, whatever the packed weight is called (`weight_packed`).
    fn weight_name_as_weight(&self) -> String;
    /// Every member tensor name.
    fn members(&self) -> Vec<&str>;
}

impl LinearNamesExt for LinearNames {
    fn weight_name_as_weight(&self) -> String {
        format!("{}.weight", self.base)
    }
    fn members(&self) -> Vec<&str> {
        let mut v = vec![self.weight.as_str(), self.weight_scale.as_str()];
        v.extend(self.global_scale.as_deref());
        v.extend(self.input_scale.as_deref());
        v
    }
}
