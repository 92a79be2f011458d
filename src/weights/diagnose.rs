//! Diagnoses that name the bug: per-unit issues grouped by layer (transposed, global-scale
//! convention flipped, vLLM's gate-only `w13_weight_scale_2`, swizzled scales), and, across
//! the experts of a layer whose values differ, what B holds instead: gate and up swapped in
//! an expert, the w13 halves in the other order for every expert, or another expert's weights
//! (a permutation). Experts are matched by fingerprints of their codes (a misplaced expert
//! moves bytes unchanged), with a cosine fallback for gate/up. Sampled fingerprints nominate
//! the matches; each one is confirmed on every byte before a diagnosis names it.

use super::compare::{
    aligned_q, fingerprint_as, fingerprint_own, holds_rows, holds_whole, own_q, passes_raw,
    same_part, Geom, IssueKind, Options, Part, Status, UnitResult,
};
use super::engine::DiffEngine;
use super::inventory::{expert_key, ExpertProj, Inventory};
use super::layouts::{self, Operand, SideName};
use super::load::{Raw, SideRef};
use super::view::{Depth, ScalesSeen};
use crate::checkpoint::Proj;
use crate::error::Result;
use rayon::prelude::*;
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DiagnosisKind {
    GateUpSwapped,
    /// Gate's and up's packed codes exchanged while their block scales stayed in place.
    GateUpCodesSwapped,
    W13OrderReversed,
    /// Fused w13 sharded over TP as one `[2I]` block instead of w1 and w3 separately.
    #[serde(rename = "w13_tp_split")]
    W13TpSplit,
    ExpertPermutation,
    Transposed,
    #[serde(rename = "scale_2_flipped")]
    Scale2Flipped,
    #[serde(rename = "scale_2_gate_only")]
    Scale2GateOnly,
    /// B's weight_scale_2 the max of A's over the layer's experts (one global scale for the
    /// fused tensor), or over gate and up of each expert (one w13 scale per expert).
    #[serde(rename = "scale_2_shared_max")]
    Scale2SharedMax,
    InputScaleFlipped,
    #[serde(rename = "scale_2_input_scale_swapped")]
    Scale2InputScaleSwapped,
    SwizzledScales,
    /// B holds another tensor-parallel rank's slice of A.
    TpRank,
    /// B's TP slice is cut along an axis its module is not split along.
    TpAxis,
    /// `--tp-rank/--tp-size` given, but B holds A's whole matrices, not one rank's slices.
    TpNotSharded,
    /// One fused tensor with the block scales of some experts swizzled and of others linear:
    /// a kernel reads one layout for the whole tensor.
    MixedScaleLayouts,
    EpShard,
    /// vLLM's load-time alphas / input_scale_quant disagree with the checkpoint's scales.
    DerivedScale,
    /// Packed bytes with the high and low nibble exchanged.
    NibblesSwapped,
    /// B's layer `l` holds A's layer `l + k`.
    LayerShift,
    /// B's experts are exactly another expert-parallel rank's set under the placement given.
    EpRank,
    /// B's global scales (weight_scale_2 / input_scale) are A's times or divided by the TP size.
    GlobalScaleScaledByTp,
    /// The same by the EP size.
    GlobalScaleScaledByEp,
    /// B's block scales A's shifted by one column, its codes right.
    ScalesShifted,
    /// An EP rank's per-expert scalars (`w13_weight_scale_2`, `w2_input_scale`, ...) kept for
    /// all experts while its weights hold only the rank's.
    EpScalarsUnsharded,
    /// Tensors missing from B that B holds under the same name with a prefix added or
    /// dropped (`model.` on some layers only): B's names follow no one rule.
    PrefixMismatch,
    /// A side's block scales are the other side's checkpoint's with the inverse of the 128x4
    /// swizzle applied (linear scales unswizzled as if they were swizzled).
    InverseSwizzle,
    /// B's float values are A's MXFP4 ones dequantized with the block scales misread
    /// (16-element blocks, or UE8M0 bytes read as E4M3).
    ScalesMisread,
    /// One side's float tensors are the unquantized weights the other's were quantized from
    /// (BF16 originals): the difference is quantization error, not a load error.
    UnquantizedSource,
}

#[derive(Clone, Debug, Serialize)]
pub struct Diagnosis {
    pub kind: DiagnosisKind,
    pub layer: Option<usize>,
    /// Experts concerned (global ids), when the diagnosis is about experts.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub experts: Vec<usize>,
    /// Tensors (units) concerned.
    pub tensors: usize,
    pub message: String,
    /// Does it fail the verdict (a bug), or describe a layout (a note)?
    pub fails: bool,
    /// The compared tensors (units) it names, where each is wrong by itself although its values
    /// compare equal (a layout odd one out, a whole tensor on a TP rank): a failing diagnosis
    /// files them under `mismatches` (DESIGN §6: CI reads problems there).
    #[serde(skip)]
    pub units: Vec<String>,
}

impl DiagnosisKind {
    /// Its name as the JSON report spells it (`mixed_scale_layouts`).
    pub fn name(self) -> String {
        serde_json::to_value(self)
            .ok()
            .and_then(|v| v.as_str().map(String::from))
            .unwrap_or_default()
    }
}

/// The units a failing diagnosis names that compared equal by themselves (a layout odd one
/// out, a whole tensor where a TP slice belongs) become mismatches, with the diagnosis as
/// their issue: CI scripts read problems under `mismatches` (DESIGN §6).
pub fn file_under_mismatches(results: &mut [UnitResult], diagnoses: &[Diagnosis]) {
    for d in diagnoses.iter().filter(|d| d.fails && !d.units.is_empty()) {
        let kind = match d.kind {
            DiagnosisKind::TpNotSharded => IssueKind::Shape,
            DiagnosisKind::MixedScaleLayouts
            | DiagnosisKind::InverseSwizzle
            | DiagnosisKind::ScalesShifted
            | DiagnosisKind::ScalesMisread => IssueKind::Scales,
            _ => IssueKind::Values,
        };
        let named = d.kind.name();
        let units: HashSet<&String> = d.units.iter().collect();
        for r in results
            .iter_mut()
            .filter(|r| r.status != Status::Mismatch && units.contains(&r.name))
        {
            r.status = Status::Mismatch;
            r.filed_by_diagnosis = true;
            r.issue(kind, format!("{named} (see diagnoses): {}", d.message));
        }
    }
}

/// " (expert(s) 3, 7)" after a diagnosis's count, or nothing where no expert is concerned.
fn experts_note(v: &[usize]) -> String {
    if v.is_empty() {
        String::new()
    } else {
        format!(" (expert(s) {})", list(v))
    }
}

fn list(v: &[usize]) -> String {
    const SHOW: usize = 12;
    let mut s: Vec<String> = v.iter().take(SHOW).map(|e| e.to_string()).collect();
    if v.len() > SHOW {
        s.push(format!("… ({} in all)", v.len()));
    }
    s.join(", ")
}

/// B compared as TP rank `rank` of `size`, but not one of its weight matrices is a slice:
/// every one has A's whole shape. Matrices engines replicate on every rank are not counted
/// (the MoE router's gate; the routed experts under expert parallelism).
pub fn tp_not_sharded(
    results: &[UnitResult],
    (rank, size): (usize, usize),
    ep: bool,
) -> Option<Diagnosis> {
    if results.iter().any(|r| r.a_shape != r.b_shape) {
        return None;
    }
    let router_gate = |n: &str| n.ends_with(".gate.weight") || n.ends_with(".gate");
    let whole: Vec<&UnitResult> = results
        .iter()
        .filter(|r| r.a_shape.len() >= 2 && !router_gate(&r.name) && !(ep && r.expert.is_some()))
        .collect();
    let first = whole.first()?;
    Some(Diagnosis {
        kind: DiagnosisKind::TpNotSharded,
        layer: None,
        experts: vec![],
        tensors: whole.len(),
        message: format!(
            "compared as TP rank {rank} of {size}, but none of B's {} weight matrices is a 1/{size} \
             slice: all have A's whole shape (e.g. `{}` {:?}). A TP rank that holds whole \
             column-parallel weights computes every output column and its all-reduce sums \
             {size} copies; if B is not one rank's dump, drop --tp-rank/--tp-size",
            whole.len(),
            first.name,
            first.b_shape
        ),
        fails: true,
        units: whole.iter().map(|r| r.name.clone()).collect(),
    })
}

/// B's weight_scale_2 (or input_scale) A's ×N or ÷N, N the TP (or EP) size, in every one of
/// the units where it differs (but a tenth): a replicated scalar divided (or multiplied) by
/// the rank count at load, as if it were a sum over the ranks, or a shard's partial amax.
pub fn global_scale_scaled(
    results: &[UnitResult],
    tp: Option<(usize, usize)>,
    ep: Option<usize>,
) -> Vec<Diagnosis> {
    let mut out = vec![];
    for (member, kind) in [
        ("weight_scale_2", IssueKind::Scale2),
        ("input_scale", IssueKind::InputScale),
    ] {
        let differ: Vec<(&UnitResult, f32, f32, &str)> = results
            .iter()
            .filter(|r| r.issues.iter().any(|i| i.kind == kind))
            .flat_map(|r| {
                r.scalars_differ
                    .iter()
                    .filter(|d| d.0 == member)
                    .map(move |d| (r, d.1, d.2, d.3.as_str()))
            })
            .collect();
        let sizes = [
            (tp.map(|t| t.1), "TP", DiagnosisKind::GlobalScaleScaledByTp),
            (ep, "EP", DiagnosisKind::GlobalScaleScaledByEp),
        ];
        for (n, what, dkind) in sizes {
            let Some(n) = n.filter(|&n| n > 1) else {
                continue;
            };
            if what == "EP" && tp.map(|t| t.1) == Some(n) {
                continue;
            }
            let near = |v: f64, w: f64| (v - w).abs() <= 1e-5 * w.abs();
            for (times, op) in [(false, "/"), (true, "×")] {
                let hit: Vec<&(&UnitResult, f32, f32, &str)> = differ
                    .iter()
                    .filter(|(_, a, b, _)| {
                        let (a, b) = (*a as f64, *b as f64);
                        if times {
                            near(b, a * n as f64)
                        } else {
                            near(b, a / n as f64)
                        }
                    })
                    .collect();
                if hit.len() < 2 || hit.len() * 10 < differ.len() * 9 {
                    continue;
                }
                let tensors: BTreeSet<String> = hit
                    .iter()
                    .map(|(_, _, _, t)| t.split('[').next().unwrap_or(t).to_string())
                    .collect();
                let units: Vec<&UnitResult> = hit.iter().map(|h| h.0).collect();
                let (layer, experts) = placed(&units);
                let tensors: Vec<String> = tensors.into_iter().map(|t| format!("`{t}`")).collect();
                let message = format!(
                    "{}B's {member} is A's {op} {n} for {} tensor(s){} ({}{}): a global scale {} the {what} size at \
                     load ({}): {} ×{}",
                    layer.map_or(String::new(), |l| format!("layer {l}: ")),
                    hit.len(),
                    if hit.len() < differ.len() {
                        format!(" of the {} whose {member} differs", differ.len())
                    } else {
                        String::new()
                    },
                    tensors.join(", "),
                    if experts.is_empty() {
                        String::new()
                    } else {
                        format!(", expert(s) {}", list(&experts))
                    },
                    if times { "multiplied by" } else { "divided by" },
                    if times {
                        "a replicated scalar summed over the ranks, as if each held a share"
                    } else {
                        "a replicated scalar split as if it were a per-rank share, or a per-shard amax"
                    },
                    if member == "input_scale" {
                        "the activations' quantization range is"
                    } else {
                        "every weight dequantizes"
                    },
                    if times {
                        format!("{n}")
                    } else {
                        format!("1/{n}")
                    }
                );
                out.push(Diagnosis {
                    kind: dkind,
                    layer,
                    experts,
                    tensors: hit.len(),
                    message,
                    fails: true,
                    units: vec![],
                });
            }
        }
    }
    out
}

/// B's weight_scale_2 the max of A's over a group of a layer's experts, where A's differ:
/// every expert's projection (gate and up together or each alone, down) holds one value,
/// the largest of A's (an engine that keeps one global scale for the fused expert tensor), or
/// gate and up of each expert hold the larger of the two (one `w13_weight_scale_2` per expert,
/// the smaller replaced). The codes and block scales are A's, so every expert below the max
/// dequantizes ×(max / its own). The up_proj that took its gate's value in such a layer is
/// named here, not as [`DiagnosisKind::Scale2GateOnly`] (which this drops for the layer).
/// The max is looked for over the experts compared (an EP rank's block), then over all of the
/// layer's experts in A (`a_layer`: A's weight_scale_2 of every expert projection of a layer):
/// an engine that took it on the full checkpoint before sharding across `ep` (rank, size)
/// holds a value from an expert outside the rank's block.
pub fn scale_2_shared_max(
    results: &[UnitResult],
    a_layer: &dyn Fn(usize) -> Vec<(ExpertProj, f32)>,
    ep: Option<(usize, usize)>,
    diagnoses: &mut Vec<Diagnosis>,
) {
    struct S<'a> {
        r: &'a UnitResult,
        e: ExpertProj,
        a: f32,
        b: f32,
    }
    // a weight_scale_2 off on a unit whose codes and block scales are A's (a unit holding
    // other rows, as a w13 split across TP as one block gives, is not explained by a max)
    let wrong = |s: &S| {
        let scale_2 = |k: &IssueKind| matches!(k, IssueKind::Scale2 | IssueKind::Scale2GateOnly);
        let scalar = |k: &IssueKind| {
            scale_2(k) || matches!(k, IssueKind::InputScale | IssueKind::InputScaleFlipped)
        };
        !super::compare::same_scale(s.a, s.b)
            && s.r.issues.iter().any(|i| scale_2(&i.kind))
            && s.r.issues.iter().all(|i| scalar(&i.kind))
    };
    let proj_name = |p: Proj| match p {
        Proj::Gate => "gate_proj",
        Proj::Up => "up_proj",
        Proj::Down => "down_proj",
    };
    let mut by_layer: BTreeMap<usize, Vec<S>> = BTreeMap::new();
    for r in results {
        if let (Some(e), Some((a, b))) = (r.expert, r.scales_2) {
            by_layer.entry(e.layer).or_default().push(S { r, e, a, b });
        }
    }
    let mut covered = BTreeSet::new();
    for (layer, units) in by_layer {
        if !units.iter().any(wrong) {
            continue;
        }
        // A's weight_scale_2 of all the layer's experts, read once it is needed
        let all_a: std::cell::OnceCell<Vec<(ExpertProj, f32)>> = std::cell::OnceCell::new();
        // one value for the whole group, the max of A's over the group's experts, or over all
        // of the layer's experts in A (taken before EP sharding): (what, its units)
        let shared = |group: &[&S], ps: &[Proj]| -> Option<String> {
            if group.len() < 2 || !group.iter().any(|s| wrong(s)) {
                return None;
            }
            let top = group.iter().max_by(|x, y| x.a.total_cmp(&y.a))?;
            let low = group.iter().map(|s| s.a).fold(f32::INFINITY, f32::min);
            let held: BTreeSet<usize> = group.iter().map(|s| s.e.expert).collect();
            let block = match ep {
                Some((r, _)) => format!(
                    "EP rank {r}'s experts {}",
                    list(&Vec::from_iter(held.iter().copied()))
                ),
                None => format!("the {} experts compared", held.len()),
            };
            if group.iter().all(|s| super::compare::same_scale(s.b, top.a)) {
                return Some(format!(
                    "{:e} (A's {low:e}..{:e}, the max over {block}: expert {}'s {})",
                    top.a,
                    top.a,
                    top.e.expert,
                    proj_name(top.e.proj)
                ));
            }
            let all = all_a.get_or_init(|| a_layer(layer));
            let (gtop, gv) = all
                .iter()
                .filter(|(e, _)| ps.contains(&e.proj))
                .max_by(|x, y| x.1.total_cmp(&y.1))?;
            let n = all
                .iter()
                .map(|(e, _)| e.expert)
                .collect::<BTreeSet<_>>()
                .len();
            let high = top.a;
            (!held.contains(&gtop.expert)
                && group.iter().all(|s| super::compare::same_scale(s.b, *gv)))
            .then(|| {
                format!(
                    "{gv:e}, the max over all {n} of the layer's experts in A: expert {}'s {}, \
                     outside {block} (theirs A's {low:e}..{high:e}; the max taken on the full \
                     checkpoint before the experts were sharded)",
                    gtop.expert,
                    proj_name(gtop.proj)
                )
            })
        };
        let of =
            |ps: &[Proj]| -> Vec<&S> { units.iter().filter(|s| ps.contains(&s.e.proj)).collect() };
        let mut parts: Vec<String> = vec![];
        let mut named: Vec<&S> = vec![];
        let w13 = of(&[Proj::Gate, Proj::Up]);
        if let Some(m) = shared(&w13, &[Proj::Gate, Proj::Up]) {
            parts.push(format!("{m} for every expert's gate_proj and up_proj"));
            named.extend(w13.iter().copied());
        } else {
            for p in [Proj::Gate, Proj::Up] {
                let g = of(&[p]);
                if let Some(m) = shared(&g, &[p]) {
                    parts.push(format!("{m} for every expert's {}", proj_name(p)));
                    named.extend(g.iter().copied());
                }
            }
        }
        let w13_named = !named.is_empty();
        let down = of(&[Proj::Down]);
        if let Some(m) = shared(&down, &[Proj::Down]) {
            parts.push(format!("{m} for every expert's down_proj"));
            named.extend(down.iter().copied());
        }
        let mut per_expert: Vec<String> = vec![];
        if !w13_named {
            // gate and up of each expert: both the larger of the two
            let mut halves: BTreeMap<usize, [Option<&S>; 2]> = BTreeMap::new();
            for s in &w13 {
                halves.entry(s.e.expert).or_default()[(s.e.proj == Proj::Up) as usize] = Some(*s);
            }
            let pairs: Vec<(&S, &S)> = halves
                .values()
                .filter_map(|h| Some((h[0]?, h[1]?)))
                .collect();
            let max_of_two = |(g, u): &(&S, &S)| {
                let m = g.a.max(u.a);
                super::compare::same_scale(g.b, m) && super::compare::same_scale(u.b, m)
            };
            // a gate raised to its up's: what only the max explains (an up raised to its
            // gate's alone is the gate-only w13 scale)
            let gate_raised = |(g, _): &(&S, &S)| wrong(g);
            if !pairs.is_empty() && pairs.iter().all(max_of_two) && pairs.iter().any(gate_raised) {
                let (g, u) = pairs
                    .iter()
                    .find(|p| gate_raised(p))
                    .copied()
                    .unwrap_or(pairs[0]);
                per_expert.push(format!(
                    "gate_proj and up_proj of each expert hold the larger of their two \
                     weight_scale_2 (one w13_weight_scale_2 per expert, the smaller replaced): \
                     e.g. expert {}: A's gate {:e}, up {:e}, B's both {:e}",
                    g.e.expert, g.a, u.a, g.b
                ));
                named.extend(w13.iter().copied());
            }
        }
        let named: Vec<&S> = named.into_iter().filter(|s| wrong(s)).collect();
        if named.is_empty() {
            continue;
        }
        covered.insert(layer);
        let worst = named
            .iter()
            .max_by(|x, y| (x.b / x.a).total_cmp(&(y.b / y.a)))
            .map(|s| {
                format!(
                    "up to ×{:.4} (expert {}'s {})",
                    s.b / s.a,
                    s.e.expert,
                    proj_name(s.e.proj)
                )
            })
            .unwrap_or_default();
        let experts: BTreeSet<usize> = named.iter().map(|s| s.e.expert).collect();
        let mut what: Vec<String> = vec![];
        if !parts.is_empty() {
            what.push(format!(
                "weight_scale_2 is the max over the layer's experts (one global scale for the \
                 fused tensor): B holds {}",
                parts.join("; ")
            ));
        }
        what.extend(per_expert);
        diagnoses.push(Diagnosis {
            kind: DiagnosisKind::Scale2SharedMax,
            layer: Some(layer),
            experts: experts.into_iter().collect(),
            tensors: named.len(),
            message: format!(
                "layer {layer}: {} tensor(s): {}; the codes and block scales are A's, so every \
                 expert below the max dequantizes ×(max / its own), {worst}",
                named.len(),
                what.join("; ")
            ),
            fails: true,
            units: vec![],
        });
    }
    diagnoses.retain(|d| {
        !(d.kind == DiagnosisKind::Scale2GateOnly && d.layer.is_some_and(|l| covered.contains(&l)))
    });
}

/// Group per-unit issues and layout notes into diagnoses, one per (kind, layer, side).
/// Missing tensors that B holds under a prefix added (`model.` + name) or dropped: one
/// diagnosis per (direction, prefix), naming the layers. A prefix on every name is a naming
/// (matched before this); here only some names carry it.
pub fn prefix_mismatch(missing: &[String], extra: &[String]) -> Vec<Diagnosis> {
    // (prefix, added in B?) -> (pairs, layers)
    let mut found: BTreeMap<(String, bool), (usize, BTreeSet<usize>)> = BTreeMap::new();
    let layer_of = |n: &str| {
        let (_, rest) = n.split_once("layers.")?;
        rest.split('.').next()?.parse::<usize>().ok()
    };
    for (longer, shorter, added) in [(extra, missing, true), (missing, extra, false)] {
        let short: BTreeSet<&str> = shorter.iter().map(String::as_str).collect();
        for n in longer {
            let hit = n
                .match_indices('.')
                .map(|(i, _)| (&n[..=i], &n[i + 1..]))
                .find(|(_, rest)| short.contains(rest));
            if let Some((prefix, rest)) = hit {
                let e = found.entry((prefix.to_string(), added)).or_default();
                e.0 += 1;
                e.1.extend(layer_of(rest));
            }
        }
    }
    found
        .into_iter()
        .map(|((prefix, added), (n, layers))| {
            let layers: Vec<usize> = layers.into_iter().collect();
            let at = if layers.is_empty() {
                String::new()
            } else {
                format!(" (layer(s) {})", list(&layers))
            };
            let how = if added { "added in B" } else { "dropped in B" };
            Diagnosis {
                kind: DiagnosisKind::PrefixMismatch,
                layer: (layers.len() == 1).then(|| layers[0]),
                experts: vec![],
                tensors: n,
                message: format!(
                    "{n} tensor(s) missing from B are in B under the same name with the prefix \
                     `{prefix}` {how}{at}: B's names carry the prefix on some tensors only, and \
                     an engine maps names by one rule, so these are never loaded where they \
                     belong (a renaming applied to part of the model?)"
                ),
                fails: true,
                units: vec![],
            }
        })
        .collect()
}

/// `checkpoints`: A, B is a checkpoint directory, whose block scales are linear (DESIGN §3):
/// where the other side is not, its scales read swizzled are the other side's with the
/// inverse swizzle applied.
pub fn from_units(results: &[UnitResult], checkpoints: (bool, bool)) -> Vec<Diagnosis> {
    // two checkpoints: either may be the one a converter swizzled
    let checkpoint = |side: SideName| match side {
        SideName::A => checkpoints.0 && !checkpoints.1,
        SideName::B => checkpoints.1 && !checkpoints.0,
    };
    // (kind, layer, side of a layout note) → (experts, tensors named, an example message)
    type Group = (BTreeSet<usize>, Vec<String>, String);
    type Key = (DiagnosisKind, Option<usize>, Option<SideName>);
    let mut groups: BTreeMap<Key, Group> = BTreeMap::new();
    for r in results {
        let layer = r.expert.map(|e| e.layer);
        let mut kinds: Vec<(DiagnosisKind, Option<SideName>, String)> = r
            .issues
            .iter()
            .filter_map(|i| {
                let k = match i.kind {
                    IssueKind::Transposed => DiagnosisKind::Transposed,
                    IssueKind::Scale2Flipped => DiagnosisKind::Scale2Flipped,
                    IssueKind::Scale2GateOnly => DiagnosisKind::Scale2GateOnly,
                    IssueKind::InputScaleFlipped => DiagnosisKind::InputScaleFlipped,
                    IssueKind::NibblesSwapped => DiagnosisKind::NibblesSwapped,
                    IssueKind::Scale2InputScaleSwapped => DiagnosisKind::Scale2InputScaleSwapped,
                    IssueKind::TpRank => DiagnosisKind::TpRank,
                    IssueKind::TpAxis => DiagnosisKind::TpAxis,
                    IssueKind::ScalesShifted => DiagnosisKind::ScalesShifted,
                    IssueKind::ScalesMisread => DiagnosisKind::ScalesMisread,
                    IssueKind::UnquantizedSource => DiagnosisKind::UnquantizedSource,
                    _ => return None,
                };
                Some((k, None, i.message.clone()))
            })
            .collect();
        for side in [SideName::A, SideName::B] {
            if r.scales(side) == Some(super::view::ScalesSeen::Swizzled) {
                if checkpoint(side) {
                    let example = format!("`{}`", r.label(side.other()));
                    kinds.push((DiagnosisKind::InverseSwizzle, Some(side), example));
                } else {
                    kinds.push((DiagnosisKind::SwizzledScales, Some(side), String::new()));
                }
            }
        }
        for (k, side, msg) in kinds {
            let g = groups
                .entry((k, layer, side))
                .or_insert_with(|| (BTreeSet::new(), vec![], msg));
            g.1.push(r.name.clone());
            if let Some(e) = r.expert {
                g.0.insert(e.expert);
            }
        }
    }
    let mut out: Vec<Diagnosis> = groups
        .into_iter()
        .map(|((kind, layer, side), (experts, units, example))| {
            let experts: Vec<usize> = experts.into_iter().collect();
            let n = units.len();
            let where_ = match layer {
                Some(l) => format!("layer {l}: "),
                None => String::new(),
            };
            let message = match kind {
                DiagnosisKind::Transposed => format!("{where_}{n} tensor(s) stored transposed; e.g. {example}"),
                DiagnosisKind::Scale2Flipped => format!(
                    "{where_}{n} tensor(s) hold their global scale in the other direction (weight_scale_2 = amax/2688 vs compressed-tensors' gs = 1/weight_scale_2) than their names say; e.g. {example}"
                ),
                DiagnosisKind::Scale2GateOnly => format!(
                    "{where_}the up_proj of {n} expert(s) ({}) uses the gate's weight_scale_2: vLLM keeps one w13_weight_scale_2 per expert (w1's); e.g. {example}",
                    list(&experts)
                ),
                DiagnosisKind::Scale2InputScaleSwapped => format!(
                    "{where_}{n} tensor(s) hold input_scale where weight_scale_2 belongs and weight_scale_2 where input_scale belongs; e.g. {example}"
                ),
                DiagnosisKind::TpRank => format!(
                    "{where_}{n} tensor(s) hold another TP rank's slice of A; e.g. {example}"
                ),
                DiagnosisKind::ScalesShifted => format!(
                    "{where_}{n} tensor(s) hold their block scales one column off{}; e.g. {example}",
                    experts_note(&experts)
                ),
                DiagnosisKind::TpAxis => format!(
                    "{where_}{n} tensor(s) split across TP along the wrong axis; e.g. {example}"
                ),
                DiagnosisKind::ScalesMisread => format!(
                    "{where_}{n} tensor(s) dequantized from A's MXFP4 with the block scales misread{}; e.g. {example}",
                    experts_note(&experts)
                ),
                DiagnosisKind::UnquantizedSource => format!(
                    "{where_}{n} float tensor(s){} are the unquantized weights the other side's \
                     were quantized from (BF16 originals): an engine that ran them ran BF16, not \
                     this checkpoint's NVFP4; to judge a checkpoint against its originals run \
                     `audit`; e.g. {example}",
                    experts_note(&experts)
                ),
                DiagnosisKind::InputScaleFlipped => format!(
                    "{where_}{n} tensor(s) hold their input scale in the other direction (input_scale vs its reciprocal gs) than their names say; e.g. {example}"
                ),
                DiagnosisKind::NibblesSwapped => format!(
                    "{where_}{n} tensor(s) hold their FP4 codes nibble-swapped (element 2i in the high nibble){}; e.g. {example}",
                    experts_note(&experts)
                ),
                DiagnosisKind::SwizzledScales => format!(
                    "{where_}{}'s block scales of {n} tensor(s) are in the 128x4 swizzled layout (kernel layout); compared after unswizzling",
                    side.map_or("B", SideName::label)
                ),
                DiagnosisKind::InverseSwizzle => {
                    let (ck, other) = side.map_or(("A", "B"), |s| (s.label(), s.other().label()));
                    format!(
                        "{where_}{other}'s block scales of {n} tensor(s){} are {ck}'s with the inverse \
                         of the 128x4 swizzle applied (linear scales unswizzled as if they were \
                         swizzled): they match only with {ck}'s read swizzled, and {ck} is a \
                         checkpoint, whose block scales are linear (DESIGN §3); no kernel reads \
                         them right; e.g. {example}",
                        experts_note(&experts)
                    )
                }
                _ => example,
            };
            Diagnosis {
                kind,
                layer,
                fails: kind != DiagnosisKind::SwizzledScales,
                units,
                experts,
                tensors: n,
                message,
            }
        })
        .collect();
    out.extend(mixed_scale_layouts(results, checkpoint));
    out
}

/// A side whose block scales are in both layouts within one operand (its routed experts'
/// w13, their w2, its other quantized linears): each unit compares fine after its own
/// reading, but a side holds one layout — a checkpoint linear scales (DESIGN §3), an engine's
/// dump the swizzle its kernels read — and a kernel reads one layout for every expert, so the
/// odd ones out are read wrong. A side swizzled throughout is a layout (a note); a mix fails.
/// A checkpoint side's units read swizzled are named as the other side's inverse swizzle
/// ([`DiagnosisKind::InverseSwizzle`]), not as a mix of this side's.
fn mixed_scale_layouts(
    results: &[UnitResult],
    checkpoint: impl Fn(SideName) -> bool,
) -> Vec<Diagnosis> {
    let groups = layouts::groups(results);
    let mut out: Vec<Diagnosis> = groups
        .values()
        .filter(|g| g.mixed() && !checkpoint(g.side))
        .map(mixed_diagnosis)
        .collect();
    for operand in [Operand::W13, Operand::W2, Operand::Other] {
        let pair = (
            groups.get(&(SideName::A, operand)),
            groups.get(&(SideName::B, operand)),
        );
        if let (Some(a), Some(b)) = pair {
            out.extend(
                one_side_mixes(a, b).filter(|_| a.swizzled.is_empty() || !checkpoint(SideName::A)),
            );
        }
    }
    out
}

/// Two engine dumps' fused tensors that agree as stored except for some units, where one
/// side's block scales are the swizzle of the other's: one side mixes layouts, and nothing
/// tells which (their layout is whatever each engine's kernels read), so both readings are
/// named.
fn one_side_mixes(a: &layouts::Group, b: &layouts::Group) -> Option<Diagnosis> {
    if a.mixed() || b.mixed() || a.same.is_empty() {
        return None;
    }
    let diverging: Vec<&UnitResult> = a.swizzled.iter().chain(&a.linear).copied().collect();
    let first = diverging.first()?;
    let a_swizzled = first.scales(SideName::A) == Some(super::view::ScalesSeen::Swizzled);
    let (in_a, in_b) = if a_swizzled {
        ("in the 128x4 swizzled layout", "linear")
    } else {
        ("linear", "in the 128x4 swizzled layout")
    };
    let (odd_if_linear, odd_if_swizzled) = if a_swizzled { ("A", "B") } else { ("B", "A") };
    let (layer, experts) = placed(&diverging);
    Some(Diagnosis {
        kind: DiagnosisKind::MixedScaleLayouts,
        layer,
        tensors: diverging.len(),
        message: format!(
            "{}in the {}, the block scales of {} are {in_a} in A and {in_b} in B, while the other {} \
             tensor(s) are equal as stored: one side mixes layouts — {odd_if_linear}'s if the \
             others are linear, {odd_if_swizzled}'s if they are swizzled (both are engine dumps' \
             fused tensors, whose layout nothing else tells) — and a kernel reads one layout for \
             the whole tensor",
            layer.map_or(String::new(), |l| format!("layer {l}: ")),
            a.operand.describe(),
            units_named(&diverging, SideName::A),
            a.same.len(),
        ),
        experts,
        fails: true,
        units: diverging.iter().map(|r| r.name.clone()).collect(),
    })
}

fn mixed_diagnosis(g: &layouts::Group) -> Diagnosis {
    let (odd, odd_swizzled) = g.odd_ones_out();
    let (layer, experts) = placed(odd);
    let side = g.side.label();
    let (odd_layout, rest_layout) = if odd_swizzled {
        ("in the 128x4 swizzled layout", "linear")
    } else {
        ("linear", "in the 128x4 swizzled layout")
    };
    let rest = if odd_swizzled { &g.linear } else { &g.swizzled };
    Diagnosis {
        kind: DiagnosisKind::MixedScaleLayouts,
        layer,
        tensors: odd.len(),
        message: format!(
            "{}{side}'s {} hold block scales in both layouts: {} {odd_layout}, the other {} \
             tensor(s) {rest_layout}. Each side holds one layout (a checkpoint linear scales, an \
             engine's dump the swizzle its kernels read) and a kernel reads one layout for the \
             whole tensor, so the odd ones out are read wrong (a converter or loader path that \
             swizzles only some?)",
            layer.map_or(String::new(), |l| format!("layer {l}: ")),
            g.operand.describe(),
            units_named(odd, g.side),
            rest.len(),
        ),
        experts,
        fails: true,
        units: odd.iter().map(|r| r.name.clone()).collect(),
    }
}

/// The one layer the units' experts lie in (none when they span several), and those experts.
fn placed(units: &[&UnitResult]) -> (Option<usize>, Vec<usize>) {
    let layers: BTreeSet<usize> = units
        .iter()
        .filter_map(|r| r.expert.map(|e| e.layer))
        .collect();
    let experts: BTreeSet<usize> = units
        .iter()
        .filter_map(|r| r.expert.map(|e| e.expert))
        .collect();
    let layer = match (layers.len(), layers.first()) {
        (1, Some(&l)) => Some(l),
        _ => None,
    };
    (layer, experts.into_iter().collect())
}

/// "layer 1 expert(s) 4, 7 (`…w13_weight`)" per layer and stored tensor, or the tensors'
/// names outside the routed experts.
fn units_named(units: &[&UnitResult], side: SideName) -> String {
    let mut by_tensor: BTreeMap<(Option<usize>, &str), BTreeSet<usize>> = BTreeMap::new();
    let mut others: Vec<&str> = vec![];
    for r in units {
        match r.expert {
            Some(e) => {
                // a fused tensor is named once; a linear's own weight name says nothing more
                let fused = r.stored(side)
                    != (match side {
                        SideName::A => r.a.as_str(),
                        SideName::B => r.b.as_str(),
                    });
                let t = if fused { r.stored(side) } else { "" };
                by_tensor
                    .entry((Some(e.layer), t))
                    .or_default()
                    .insert(e.expert);
            }
            None => others.push(r.stored(side)),
        }
    }
    let mut parts: Vec<String> = by_tensor
        .into_iter()
        .map(|((l, t), es)| {
            let es: Vec<usize> = es.into_iter().collect();
            format!(
                "layer {} expert(s) {}{}",
                l.unwrap_or_default(),
                list(&es),
                if t.is_empty() {
                    String::new()
                } else {
                    format!(" (`{t}`)")
                }
            )
        })
        .collect();
    const SHOW: usize = 6;
    parts.extend(others.iter().take(SHOW).map(|t| format!("`{t}`")));
    if others.len() > SHOW {
        parts.push(format!("… ({} tensors in all)", others.len()));
    }
    parts.join("; ")
}

/// Cross-expert diagnoses for the layers where some expert's values differ. Messages of the
/// explained units get the explanation appended.
pub fn cross_expert(
    results: &mut [UnitResult],
    a: &SideRef,
    b: &SideRef,
    a_inv: &Inventory,
    b_inv: &Inventory,
    opts: &Options,
    engine: &dyn DiffEngine,
) -> Result<Vec<Diagnosis>> {
    let (tp, min_cosine) = (opts.tp, opts.min_cosine);
    let by_key: HashMap<String, usize> = results
        .iter()
        .enumerate()
        .map(|(i, r)| (r.name.clone(), i))
        .collect();
    let bad = |r: &UnitResult| r.issues.iter().any(|i| i.kind == IssueKind::Values);
    let layers: BTreeSet<usize> = results
        .iter()
        .filter(|r| bad(r))
        .filter_map(|r| r.expert.map(|e| e.layer))
        .collect();
    let mut out = vec![];
    for layer in layers {
        let units_of = |inv: &Inventory| -> Vec<(ExpertProj, super::inventory::Source)> {
            inv.units
                .values()
                .filter_map(|u| {
                    u.expert
                        .filter(|e| e.layer == layer)
                        .map(|e| (e, u.source.clone()))
                })
                .collect()
        };
        let b_units = units_of(b_inv);
        let a_units = units_of(a_inv);
        // B fingerprints (sampled) and per-projection geometry
        // a sample is one fingerprint: the codes, whatever the scales' layout
        let fp_b: HashMap<ExpertProj, (u64, Geom)> = b_units
            .par_iter()
            .filter_map(|(e, s)| {
                let (fps, g) = fingerprint_own(&b.load(s).ok()?, Depth::Sample)?;
                Some((*e, (*fps.first()?, g)))
            })
            .collect();
        let mut geom: HashMap<Proj, Geom> = HashMap::new();
        for (e, (_, g)) in &fp_b {
            geom.entry(e.proj).or_insert_with(|| g.clone());
        }
        // A fingerprints cut to B's geometry (gate and up share one)
        let fp_a_at = |e: &ExpertProj, s: &super::inventory::Source, depth| {
            fingerprint_as(&a.load(s).ok()?, geom.get(&e.proj)?, tp, depth)
        };
        let fp_a: HashMap<ExpertProj, u64> = a_units
            .par_iter()
            .filter_map(|(e, s)| Some((*e, fp_a_at(e, s, Depth::Sample)?)))
            .collect();
        let bad_set: std::collections::HashSet<ExpertProj> = results
            .iter()
            .filter(|r| bad(r))
            .filter_map(|r| r.expert)
            .collect();
        let is_bad = |e: &ExpertProj| bad_set.contains(e);
        let b_experts: BTreeSet<usize> = fp_b.keys().map(|e| e.expert).collect();
        let ep = |expert, proj| ExpertProj {
            layer,
            expert,
            proj,
        };
        let src_of = |units: &[(ExpertProj, super::inventory::Source)], e: ExpertProj| {
            units.iter().find(|(x, _)| *x == e).map(|(_, s)| s.clone())
        };
        // B's unit `bx` holds exactly A's unit `ax`: what equal samples nominate, confirmed
        // on every byte
        let holds = |bx: ExpertProj, ax: ExpertProj| {
            let (Some(sb), Some(sa)) = (src_of(&b_units, bx), src_of(&a_units, ax)) else {
                return false;
            };
            matches!((a.load(&sa), b.load(&sb)), (Ok(ra), Ok(rb)) if holds_whole(&ra, &rb, tp))
        };

        // gate and up swapped
        let mut swapped: Vec<usize> = vec![];
        let with_w13: Vec<usize> = b_experts
            .iter()
            .copied()
            .filter(|&e| {
                fp_b.contains_key(&ep(e, Proj::Gate)) && fp_b.contains_key(&ep(e, Proj::Up))
            })
            .collect();
        for &e in &with_w13 {
            let (g, u) = (ep(e, Proj::Gate), ep(e, Proj::Up));
            if !(is_bad(&g) && is_bad(&u)) {
                continue;
            }
            let by_fp = matches!(
                (fp_b.get(&g), fp_b.get(&u), fp_a.get(&g), fp_a.get(&u)),
                (Some((bg, _)), Some((bu, _)), Some(ag), Some(au)) if bg == au && bu == ag && ag != au
            ) && holds(g, u)
                && holds(u, g);
            let pair = |ax: ExpertProj, bx: ExpertProj| -> Result<bool> {
                let (Some(sa), Some(sb)) = (src_of(&a_units, ax), src_of(&b_units, bx)) else {
                    return Ok(false);
                };
                let (Ok(ra), Ok(rb)) = (a.load(&sa), b.load(&sb)) else {
                    return Ok(false);
                };
                passes_raw(&ra, &rb, tp, engine, min_cosine)
            };
            let by_cosine = !by_fp && pair(u, g)? && pair(g, u)?;
            if by_fp || by_cosine {
                swapped.push(e);
            }
        }
        if !swapped.is_empty() {
            let all = swapped.len() == with_w13.len() && swapped.len() >= 2;
            let (kind, message) = if all {
                (
                    DiagnosisKind::W13OrderReversed,
                    format!(
                        "layer {layer}: gate/up order reversed in w13 for all {} experts: B's gate holds A's up_proj \
                         (w3) and B's up holds A's gate_proj (w1) — w13 = [w3; w1] where [w1; w3] is expected \
                         (FlashInfer / TRT-LLM kernels take [w3; w1], vLLM's fused MoE [w1; w3])",
                        swapped.len()
                    ),
                )
            } else {
                (
                    DiagnosisKind::GateUpSwapped,
                    format!(
                        "layer {layer}: gate and up swapped in expert(s) {}: B's gate_proj is A's up_proj and vice versa",
                        list(&swapped)
                    ),
                )
            };
            for &e in &swapped {
                for p in [Proj::Gate, Proj::Up] {
                    annotate(results, &by_key, ep(e, p), &message);
                }
            }
            out.push(Diagnosis {
                kind,
                layer: Some(layer),
                tensors: swapped.len() * 2,
                experts: swapped.clone(),
                message,
                fails: true,
                units: vec![],
            });
        }

        // gate's and up's packed codes exchanged, their block scales not (a loader that maps
        // `weight` and `weight_scale` to w13's halves by different shard ids): B's gate has
        // A's up codes under A's gate scales, and the reverse (same geometry only)
        let mut codes_swapped: Vec<usize> = vec![];
        for &e in with_w13.iter().filter(|e| !swapped.contains(e)) {
            let (g, u) = (ep(e, Proj::Gate), ep(e, Proj::Up));
            if !(is_bad(&g) && is_bad(&u)) || tp.is_some_and(|(_, n)| n > 1) {
                continue;
            }
            let (Some(ag), Some(au), Some(bg), Some(bu)) = (
                src_of(&a_units, g).and_then(|s| a.load(&s).ok()),
                src_of(&a_units, u).and_then(|s| a.load(&s).ok()),
                src_of(&b_units, g).and_then(|s| b.load(&s).ok()),
                src_of(&b_units, u).and_then(|s| b.load(&s).ok()),
            ) else {
                continue;
            };
            // the codes first: on experts whose values differ they differ at the first bytes
            if same_part(&au, &bg, Part::Codes)
                && same_part(&ag, &bu, Part::Codes)
                && same_part(&ag, &bg, Part::Scales)
                && same_part(&au, &bu, Part::Scales)
            {
                codes_swapped.push(e);
            }
        }
        if !codes_swapped.is_empty() {
            let message = format!(
                "layer {layer}: gate and up packed codes swapped in expert(s) {}, their block scales not: B's gate_proj holds \
                 A's up_proj codes under A's gate_proj block scales, and the reverse (a loader that maps `weight` and \
                 `weight_scale` to the halves of w13 by different shard ids)",
                list(&codes_swapped)
            );
            for &e in &codes_swapped {
                for p in [Proj::Gate, Proj::Up] {
                    annotate(results, &by_key, ep(e, p), &message);
                }
            }
            out.push(Diagnosis {
                kind: DiagnosisKind::GateUpCodesSwapped,
                layer: Some(layer),
                tensors: codes_swapped.len() * 2,
                experts: codes_swapped.clone(),
                message,
                fails: true,
                units: vec![],
            });
        }

        // w13 split across TP ranks as one [2I] block: rank r's 2I/n rows of [w1; w3] cut in
        // half, not w1's and w3's own slices (its gate and up then hold the wrong rows)
        if let Some((r, n)) = tp.filter(|&(_, n)| n > 1) {
            let mut split: Vec<usize> = vec![];
            let mut tensors = 0;
            // B's rows a projection (I/n)
            let mut ip_seen = 0;
            // a half that reads as another rank's slice of its own projection (at TP > 2
            // the block's rows can be one) is explained here too
            let tp_rank_issue = |x: ExpertProj| {
                by_key
                    .get(&expert_key(x.layer, x.expert, x.proj))
                    .is_some_and(|&i| {
                        results[i]
                            .issues
                            .iter()
                            .any(|i| i.kind == IssueKind::TpRank)
                    })
            };
            let mut refiled: Vec<ExpertProj> = vec![];
            for &e in &with_w13 {
                let bad_projs: Vec<Proj> = [Proj::Gate, Proj::Up]
                    .into_iter()
                    .filter(|&p| is_bad(&ep(e, p)) || tp_rank_issue(ep(e, p)))
                    .collect();
                let mut holds_block_rows = |p: Proj| -> Option<bool> {
                    let rb = b.load(&src_of(&b_units, ep(e, p))?).ok()?;
                    let ip = match &rb {
                        super::load::Raw::Q(q) => q.rows(),
                        super::load::Raw::D(_) => return None,
                    };
                    ip_seen = ip;
                    let start = r * 2 * ip + if p == Proj::Up { ip } else { 0 };
                    let (from, r0) = if start < n * ip {
                        (Proj::Gate, start)
                    } else {
                        (Proj::Up, start - n * ip)
                    };
                    let ra = a.load(&src_of(&a_units, ep(e, from))?).ok()?;
                    Some(holds_rows(&ra, &rb, r0))
                };
                if !bad_projs.is_empty()
                    && bad_projs.iter().all(|&p| holds_block_rows(p) == Some(true))
                {
                    split.push(e);
                    tensors += bad_projs.len();
                    refiled.extend(bad_projs.iter().map(|&p| ep(e, p)));
                }
            }
            for x in refiled {
                if let Some(&i) = by_key.get(&expert_key(x.layer, x.expert, x.proj)) {
                    for issue in results[i].issues.iter_mut() {
                        if issue.kind == IssueKind::TpRank {
                            issue.kind = IssueKind::Values;
                        }
                    }
                }
            }
            if !split.is_empty() {
                let ip = ip_seen;
                let message = format!(
                    "layer {layer}: w13 of expert(s) {} split across the {n} TP ranks as one [2I] block: rank {r}'s gate and up \
                     are rows {}..{} and {}..{} of [w1; w3], where rows {}..{} of w1 and of w3 belong (shard gate and up separately)",
                    list(&split),
                    r * 2 * ip,
                    r * 2 * ip + ip,
                    r * 2 * ip + ip,
                    (r + 1) * 2 * ip,
                    r * ip,
                    (r + 1) * ip
                );
                for &e in &split {
                    for p in [Proj::Gate, Proj::Up] {
                        annotate(results, &by_key, ep(e, p), &message);
                    }
                }
                out.push(Diagnosis {
                    kind: DiagnosisKind::W13TpSplit,
                    layer: Some(layer),
                    tensors,
                    experts: split,
                    message,
                    fails: true,
                    units: vec![],
                });
            }
        }

        // another expert's weights
        let mut by_fp_a: HashMap<(u64, Proj), BTreeSet<usize>> = HashMap::new();
        for (e, fp) in &fp_a {
            by_fp_a.entry((*fp, e.proj)).or_default().insert(e.expert);
        }
        let mut perm: Vec<(usize, usize)> = vec![];
        for &e in &b_experts {
            if swapped.contains(&e) {
                continue;
            }
            let projs: Vec<Proj> = Proj::ALL
                .into_iter()
                .filter(|&p| fp_b.contains_key(&ep(e, p)))
                .collect();
            if !projs.iter().any(|&p| is_bad(&ep(e, p))) {
                continue;
            }
            let mut cand: Option<BTreeSet<usize>> = None;
            for &p in &projs {
                let s = fp_b
                    .get(&ep(e, p))
                    .and_then(|(fp, _)| by_fp_a.get(&(*fp, p)))
                    .cloned()
                    .unwrap_or_default();
                cand = Some(match cand {
                    None => s,
                    Some(c) => c.intersection(&s).copied().collect(),
                });
            }
            let other = cand
                .unwrap_or_default()
                .into_iter()
                .find(|&x| x != e && projs.iter().all(|&p| holds(ep(e, p), ep(x, p))));
            if let Some(other) = other {
                perm.push((e, other));
            }
        }
        if !perm.is_empty() {
            let offsets: BTreeSet<i64> = perm.iter().map(|&(e, o)| o as i64 - e as i64).collect();
            let a_count = a_units.iter().map(|(e, _)| e.expert + 1).max().unwrap_or(0);
            let ep_held = ep_rank_held(&perm, &b_experts, opts.ep, a_count);
            let shown: Vec<String> = perm
                .iter()
                .take(12)
                .map(|(e, o)| format!("{e}←{o}"))
                .collect();
            let mut message = format!(
                "layer {layer}: {} expert(s) of B hold another expert of A (B's expert ← A's expert): {}{}",
                perm.len(),
                shown.join(", "),
                if perm.len() > 12 { ", …" } else { "" }
            );
            // an A expert held by two B experts (its own slot too, or two misplaced ones):
            // one loaded twice and another never, not a reordering
            let mut held_by: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
            for &(e, o) in &perm {
                held_by.entry(o).or_default().push(e);
            }
            for (o, bs) in held_by.iter_mut() {
                if b_experts.contains(o) && !Proj::ALL.iter().any(|&p| is_bad(&ep(*o, p))) {
                    bs.push(*o);
                }
                bs.sort_unstable();
            }
            let dup: Vec<String> = held_by
                .iter()
                .filter(|(_, bs)| bs.len() > 1)
                .map(|(o, bs)| format!("A's expert {o} is in B's experts {}", list(bs)))
                .collect();
            let held: BTreeSet<usize> = held_by.keys().copied().collect();
            let lost: Vec<usize> = perm
                .iter()
                .map(|&(e, _)| e)
                .filter(|e| !held.contains(e))
                .collect();
            if let Some(h) = &ep_held {
                message = h.message(layer, &perm);
            } else if !dup.is_empty() {
                message.push_str(&format!(
                    "; {}: loaded twice, and A's expert(s) {} in no slot of B (an expert id mapped \
                     many-to-one by the loader, or a redundant-expert slot filled from the wrong id)",
                    dup.join(", "),
                    if lost.is_empty() {
                        "-".to_string()
                    } else {
                        list(&lost)
                    }
                ));
            } else if let Some(absent) = (!lost.is_empty())
                .then(|| {
                    // A's experts B should hold (its EP rank's, or all) and does not: listed
                    // missing, but held one slot early when a dropped expert shifted the rest
                    let a_experts: BTreeSet<usize> =
                        a_units.iter().map(|(e, _)| e.expert).collect();
                    let map = opts.ep.and_then(|(r, n, p)| {
                        crate::moe::ep::ExpertMap::new(a_experts.len(), r, n, p).ok()
                    });
                    a_experts
                        .into_iter()
                        .filter(|&x| map.as_ref().is_none_or(|m| m.owns(x as i64)))
                        .filter(|x| !b_experts.contains(x))
                        .collect::<Vec<usize>>()
                })
                .filter(|absent| !absent.is_empty() && absent.iter().all(|x| held.contains(x)))
            {
                let slots: Vec<usize> = absent
                    .iter()
                    .filter_map(|x| held_by.get(x).and_then(|bs| bs.first().copied()))
                    .collect();
                message.push_str(&format!(
                    "; A's expert(s) {} in no slot of B and the experts after it one slot early: a \
                     dropped expert shifted the rest (B holds {} experts), so A's expert(s) {} \
                     listed missing are held, in B's expert(s) {}",
                    list(&lost),
                    b_experts.len(),
                    list(&absent),
                    list(&slots)
                ));
            } else if let (true, 1, Some(&off)) =
                (perm.len() >= 2, offsets.len(), offsets.iter().next())
            {
                message.push_str(&format!(
                    "; every one is off by {off}: B's expert e holds A's expert e{off:+} — an expert id offset \
                     (a rank's first expert or the id base miscounted), neither another EP rank's experts nor \
                     local ids read as global ones"
                ));
            } else if let Some((stride, c)) = strided(&perm) {
                message.push_str(&format!(
                    "; every one is A's expert {stride}·e{}: a strided (round-robin) expert placement read as \
                     contiguous (linear) — pass --placement round-robin, or the engine's expert placement differs from its loader's",
                    if c == 0 { String::new() } else { format!("{c:+}") }
                ));
            } else if let Some((stride, c)) = strided(&swapped_pairs(&perm)) {
                // B's expert s·o + c holds A's expert o: B's ids are strided, A's contiguous
                let o = if c == 0 {
                    format!("e/{stride}")
                } else {
                    format!("(e{:+})/{stride}", -c)
                };
                message.push_str(&format!(
                    "; every one is A's expert {o}: a contiguous (linear) expert placement read as \
                     strided (round-robin) — pass --placement linear, or the engine's expert placement differs from its loader's"
                ));
            }
            for &(e, o) in &perm {
                for p in Proj::ALL {
                    let (sb, sa, so) = (
                        src_of(&b_units, ep(e, p)),
                        src_of(&a_units, ep(e, p)),
                        src_of(&a_units, ep(o, p)),
                    );
                    if let (Some(sb), Some(sa), Some(so)) = (sb, sa, so) {
                        let unit = by_key.get(&expert_key(layer, e, p)).copied();
                        if let (Some(i), Ok(rb), Ok(ra), Ok(ro)) =
                            (unit, b.load(&sb), a.load(&sa), a.load(&so))
                        {
                            reread_swizzled(&mut results[i], &ra, &rb, &ro, tp, engine)?;
                        }
                    }
                    annotate(
                        results,
                        &by_key,
                        ep(e, p),
                        &format!("B's expert {e} holds A's expert {o}"),
                    );
                }
            }
            out.push(Diagnosis {
                kind: match ep_held {
                    Some(EpHeld { rank: Some(_), .. }) => DiagnosisKind::EpRank,
                    _ => DiagnosisKind::ExpertPermutation,
                },
                layer: Some(layer),
                experts: perm.iter().map(|&(e, _)| e).collect(),
                tensors: perm.len(),
                message,
                fails: true,
                units: vec![],
            });
        }
    }
    Ok(out)
}

/// What B's experts hold when, taken together, they are a set EP names: another rank's
/// experts under the placement given, or global ids `0..n` (local ids read as global ones).
struct EpHeld {
    /// B compared as this rank (its map)...
    map: crate::moe::ep::ExpertMap,
    /// ... holds rank `rank`'s experts, slot for slot.
    rank: Option<crate::moe::ep::ExpertMap>,
    /// B's slot `l` holds A's expert `l`.
    local_ids: bool,
}

impl EpHeld {
    fn message(&self, layer: usize, perm: &[(usize, usize)]) -> String {
        let m = &self.map;
        let held: Vec<usize> = perm.iter().map(|&(_, o)| o).collect();
        let (bs, os): (Vec<usize>, Vec<usize>) = perm.iter().copied().unzip();
        let pairs = format!(
            "B's expert(s) {} hold A's expert(s) {}",
            list(&bs),
            list(&os)
        );
        let local = format!(
            "global ids 0..{}, which is what local expert ids read as global ids give (the dump \
             indexed by local id, read as global, or the loader took slot l's weights from \
             checkpoint expert l)",
            held.len()
        );
        match &self.rank {
            Some(k) => format!(
                "layer {layer}: B holds EP rank {}'s experts {}, not rank {}'s {} ({} placement, {} ranks): \
                 {pairs} — the engine loaded another rank's experts, or the dump is rank {}'s (--ep-rank {}){}",
                k.ep_rank,
                k.describe_owned(),
                m.ep_rank,
                m.describe_owned(),
                m.placement.name(),
                m.ep_size,
                k.ep_rank,
                k.ep_rank,
                if self.local_ids {
                    format!("; rank {}'s experts are {local}", k.ep_rank)
                } else {
                    String::new()
                }
            ),
            None => format!(
                "layer {layer}: B's experts, EP rank {}'s {} ({} placement), hold A's experts \
                 0..{} in slot order: {pairs} — {local}",
                m.ep_rank,
                m.describe_owned(),
                m.placement.name(),
                held.len()
            ),
        }
    }
}

/// `perm` (B's expert → A's expert it holds) against the EP ranks: every one of B's experts,
/// slot by slot, is another rank's expert at that slot, or A's expert with the slot's local id.
fn ep_rank_held(
    perm: &[(usize, usize)],
    b_experts: &BTreeSet<usize>,
    ep: Option<(usize, usize, crate::moe::ep::Placement)>,
    num_experts: usize,
) -> Option<EpHeld> {
    use crate::moe::ep::ExpertMap;
    let (r, n, placement) = ep?;
    let map = ExpertMap::new(num_experts, r, n, placement).ok()?;
    let by_b: BTreeMap<usize, usize> = perm.iter().copied().collect();
    if by_b.len() != perm.len() || b_experts.len() != map.num_local() || perm.len() < 2 {
        return None;
    }
    let holds: Vec<usize> = map
        .local_to_global()
        .iter()
        .map(|g| by_b.get(g).copied())
        .collect::<Option<_>>()?;
    let local_ids = holds.iter().enumerate().all(|(l, &o)| l == o);
    let rank = (0..n)
        .filter(|&k| k != r)
        .filter_map(|k| ExpertMap::new(num_experts, k, n, placement).ok())
        .find(|k| k.local_to_global() == holds.as_slice());
    (rank.is_some() || local_ids).then_some(EpHeld {
        map,
        rank,
        local_ids,
    })
}

/// Gate and up swapped outside the routed experts (the shared expert's, a dense MLP's,
/// merged into one `gate_up_proj` or not): B's gate holds A's up and B's up A's gate, with
/// or without TP. The routed experts' are named by [`cross_expert`].
pub fn dense_gate_up_swapped(
    results: &mut [UnitResult],
    a: &SideRef,
    b: &SideRef,
    a_inv: &Inventory,
    b_inv: &Inventory,
    opts: &Options,
    engine: &dyn DiffEngine,
) -> Result<Vec<Diagnosis>> {
    let bad = |r: &UnitResult| r.issues.iter().any(|i| i.kind == IssueKind::Values);
    let by_name: HashMap<String, usize> = results
        .iter()
        .enumerate()
        .map(|(i, r)| (r.name.clone(), i))
        .collect();
    let mut out = vec![];
    for i in 0..results.len() {
        let r = &results[i];
        if r.expert.is_some() || !bad(r) {
            continue;
        }
        let Some(up_name) = [(".gate_proj.", ".up_proj."), (".w1.", ".w3.")]
            .iter()
            .find(|(g, _)| r.name.contains(g))
            .map(|(g, u)| r.name.replacen(g, u, 1))
        else {
            continue;
        };
        let Some(&j) = by_name.get(&up_name).filter(|&&j| bad(&results[j])) else {
            continue;
        };
        let (gate, up) = (&results[i].name, &results[j].name);
        let (Some(ag), Some(au), Some(bg), Some(bu)) = (
            load_unit(a, a_inv, gate),
            load_unit(a, a_inv, up),
            load_unit(b, b_inv, gate),
            load_unit(b, b_inv, up),
        ) else {
            continue;
        };
        let swapped = (holds_whole(&au, &bg, opts.tp) && holds_whole(&ag, &bu, opts.tp))
            || (passes_raw(&au, &bg, opts.tp, engine, opts.min_cosine)?
                && passes_raw(&ag, &bu, opts.tp, engine, opts.min_cosine)?);
        if !swapped {
            continue;
        }
        let (bg_at, bu_at) = (
            results[i].stored(SideName::B).to_string(),
            results[j].stored(SideName::B).to_string(),
        );
        let layer = crate::checkpoint::names::split_layer(gate).map(|(_, l, _)| l);
        let module = gate
            .rsplit_once(if gate.contains(".gate_proj.") {
                ".gate_proj."
            } else {
                ".w1."
            })
            .map_or(gate.as_str(), |(m, _)| m)
            .to_string();
        let (gp, upn) = if gate.contains(".gate_proj.") {
            ("gate_proj", "up_proj")
        } else {
            ("w1", "w3")
        };
        let message = if bg_at == bu_at {
            format!(
                "{}gate and up swapped in `{module}`: B's merged `{bg_at}` is [{upn}; {gp}] where [{gp}; {upn}] belongs \
                 — B's {gp} part holds A's {upn} and its {upn} part A's {gp}{}",
                layer.map_or(String::new(), |l| format!("layer {l}: ")),
                opts.tp
                    .filter(|t| t.1 > 1)
                    .map_or(String::new(), |(r, n)| format!(" (TP rank {r} of {n}'s rows of each)"))
            )
        } else {
            format!(
                "{}gate and up swapped in `{module}`: B's `{bg_at}` holds A's {upn} and `{bu_at}` A's {gp}",
                layer.map_or(String::new(), |l| format!("layer {l}: ")),
            )
        };
        for k in [i, j] {
            if let Some(issue) = results[k]
                .issues
                .iter_mut()
                .find(|i| i.kind == IssueKind::Values)
            {
                issue
                    .message
                    .push_str(&format!(" — gate and up swapped in `{module}`"));
            }
        }
        out.push(Diagnosis {
            kind: DiagnosisKind::GateUpSwapped,
            layer,
            experts: vec![],
            tensors: 2,
            message,
            fails: true,
            units: vec![],
        });
    }
    Ok(out)
}

fn load_unit<'s>(side: &SideRef<'s>, inv: &Inventory, key: &str) -> Option<super::load::Raw<'s>> {
    side.load(&inv.units.get(key)?.source).ok()
}

/// `(s, c)` when every pair `(e, o)` has `o = s·e + c` with an integer stride `s ≥ 2`: B's
/// experts `e` of a contiguous block hold A's every `s`-th expert.
fn strided(perm: &[(usize, usize)]) -> Option<(i64, i64)> {
    let [(e1, o1), (e2, o2), ..] = perm[..] else {
        return None;
    };
    let (de, d_o) = (e2 as i64 - e1 as i64, o2 as i64 - o1 as i64);
    if de == 0 || d_o % de != 0 || d_o / de < 2 {
        return None;
    }
    let s = d_o / de;
    let c = o1 as i64 - s * e1 as i64;
    perm.iter()
        .all(|&(e, o)| o as i64 == s * e as i64 + c)
        .then_some((s, c))
}

/// `(o, e)` for every `(e, o)`.
fn swapped_pairs(perm: &[(usize, usize)]) -> Vec<(usize, usize)> {
    perm.iter().map(|&(e, o)| (o, e)).collect()
}

/// B's unit holds A's expert `held` only with its block scales read in the 128x4 swizzle,
/// its layout decided nowhere else (every expert of the operand mismatching: another EP
/// rank's, permuted): its metrics against A's unit of its own name are taken in that layout
/// too. They were B's swizzled scales read as linear.
fn reread_swizzled(
    r: &mut UnitResult,
    a: &Raw,
    b: &Raw,
    held: &Raw,
    tp: Option<(usize, usize)>,
    engine: &dyn DiffEngine,
) -> Result<()> {
    let (Raw::Q(qb), Raw::Q(qh)) = (b, held) else {
        return Ok(());
    };
    if r.b_scales != Some(ScalesSeen::Ambiguous) {
        return Ok(());
    }
    let mut swz = qb.clone();
    swz.scales.tensor_swizzled = true;
    // the swizzled reading holds A's expert, the stored one does not
    let decided = (|| {
        let (stored, swizzled) = (own_q(qb)?, own_q(&swz)?);
        let h = aligned_q(qh, (stored.rows, stored.cols), tp)?;
        (swizzled.same_codes(&h) && !stored.same_codes(&h)).then_some(stored.cols)
    })();
    let Some(cols) = decided else {
        return Ok(());
    };
    let swz = Raw::Q(swz);
    if let Some(m) = super::compare::metrics_raw(a, &swz, tp, engine)? {
        r.read_swizzled(SideName::B);
        r.notes.push(layouts::swizzle_note(Some(SideName::B)));
        if let Some(issue) = r.issues.iter_mut().find(|i| i.kind == IssueKind::Values) {
            issue.message = super::compare::values_differ(&m, cols);
        }
        r.metrics = Some(m);
    }
    Ok(())
}

fn annotate(results: &mut [UnitResult], by_key: &HashMap<String, usize>, e: ExpertProj, why: &str) {
    if let Some(&i) = by_key.get(&expert_key(e.layer, e.expert, e.proj)) {
        if let Some(issue) = results[i]
            .issues
            .iter_mut()
            .find(|i| i.kind == IssueKind::Values)
        {
            issue.message.push_str(&format!(" — {why}"));
        }
    }
}
