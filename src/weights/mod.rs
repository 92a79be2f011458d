//! `compare-weights` logic (H3): did the engine load what the checkpoint holds? Two weight
//! sets — checkpoint directories or single safetensors files (an engine's state-dict dump is
//! one) — are brought under shared names (HF-V3, native-V4 and vLLM-fused names detected;
//! `--strip-prefix` / `--map` renames), paired unit by unit, and compared: bytes first
//! (memory-mapped, memcmp speed), values after dequantization only where bytes differ.
//! A is the reference (the checkpoint), B the test (the engine's shard: TP and EP apply to B).

pub mod blocks;
pub mod compare;
pub mod derived;
pub mod diagnose;
pub mod engine;
pub mod fused;
pub mod inventory;
mod layer_shift;
pub mod layouts;
pub mod load;
mod merged;
pub mod rules;
pub mod view;

use crate::checkpoint::{Checkpoint, Naming, Proj, TensorSource};
use crate::error::Result;
use crate::moe::ep::{ExpertMap, Placement};
use compare::{AScalars, Status, UnitResult};
use diagnose::{Diagnosis, DiagnosisKind};
use engine::DiffEngine;
use inventory::{ExpertProj, Inventory, Source, Unit};
use layouts::SideName;
use load::{LoadError, Raw, SideRef};
use rayon::prelude::*;
use rules::{Renamed, Renames, Side};
use serde::Serialize;
use std::collections::{BTreeSet, HashMap, HashSet};
use std::path::Path;

#[derive(Clone, Debug)]
pub struct Options {
    pub renames: Renames,
    /// `(rank, size)`: B is tensor-parallel rank `rank` of `size`.
    pub tp: Option<(usize, usize)>,
    /// `(rank, size, placement)`: B holds expert-parallel rank `rank`'s experts.
    pub ep: Option<(usize, usize, Placement)>,
    pub min_cosine: f64,
}

/// The two weight sets, opened (memory-mapped, headers validated).
pub struct Inputs {
    pub a: Checkpoint,
    pub b: Checkpoint,
    /// Each side is a checkpoint directory (with its config.json), not an engine's dump:
    /// its block scales are linear (DESIGN §3).
    pub checkpoints: (bool, bool),
}

impl Inputs {
    /// Open both sides. A checkpoint directory's config.json is checked too: a broken one is
    /// bad input even though the comparison itself reads only tensors.
    pub fn open(a: &Path, b: &Path) -> Result<Inputs> {
        let open = |p: &Path| -> Result<Checkpoint> {
            let c = Checkpoint::open(p)?;
            if let Some(cfg) = c.config_path() {
                crate::checkpoint::config::check_config_file(&cfg, None)?;
            }
            // every byte of both sides is read (compared bitwise or dequantized)
            c.shards().iter().for_each(|f| f.advise_whole_reads());
            Ok(c)
        };
        let checkpoint = |p: &Path, c: &Checkpoint| p.is_dir() && c.config_path().is_some();
        let (ca, cb) = (open(a)?, open(b)?);
        Ok(Inputs {
            checkpoints: (checkpoint(a, &ca), checkpoint(b, &cb)),
            a: ca,
            b: cb,
        })
    }
}

/// The paired units, ready to compare.
pub struct Plan<'a> {
    opts: &'a Options,
    a: Renamed<'a>,
    b: Renamed<'a>,
    a_inv: Inventory,
    b_inv: Inventory,
    pairs: Vec<(String, String)>,
    missing: Vec<String>,
    extra: Vec<String>,
    skipped_ep: usize,
    diagnoses: Vec<Diagnosis>,
    notes: Vec<String>,
    a_scalars: HashMap<ExpertProj, AScalars>,
    checkpoints: (bool, bool),
}

/// Everything `compare-weights` found.
#[derive(Clone, Debug, Serialize)]
pub struct Comparison {
    pub a_naming: Option<String>,
    pub b_naming: Option<String>,
    pub units: usize,
    /// Bitwise identical.
    pub equal: usize,
    /// The same values in other bytes (a swizzled reading, a convention, a dtype).
    pub equal_after_conversion: usize,
    /// `equal_after_conversion` by what the values are equal after.
    pub conversions: std::collections::BTreeMap<String, usize>,
    pub close: usize,
    pub mismatched: usize,
    /// A's experts that EP rank `r` does not hold (not expected in B).
    pub skipped_ep: usize,
    pub bytes: u64,
    pub mismatches: Vec<UnitResult>,
    /// Not bitwise identical but close: listed for the record.
    pub close_units: Vec<UnitResult>,
    pub missing: Vec<String>,
    pub extra: Vec<String>,
    pub diagnoses: Vec<Diagnosis>,
    pub notes: Vec<String>,
}

impl Comparison {
    pub fn passed(&self) -> bool {
        self.mismatched == 0
            && self.missing.is_empty()
            && self.extra.is_empty()
            && !self.diagnoses.iter().any(|d| d.fails)
    }
}

fn naming_name(inv: &Inventory) -> Option<String> {
    inv.naming.as_ref().map(|n| {
        let s = serde_json::to_value(n.scheme)
            .ok()
            .and_then(|v| v.as_str().map(String::from))
            .unwrap_or_default();
        format!("{s} (prefix `{}`)", n.prefix)
    })
}

/// Drop this process's mapping of a unit's own tensors, or of its slice of fused tensors (the
/// codes, the bulk; the scales other units share stay), so that the page tables stay at a few
/// units' size on a checkpoint of hundreds of GB, fused engine dumps included. (The teardown
/// then runs on the workers instead of at exit: no faster, measured on a 6.3 GB pair.)
fn release(src: &Renamed, s: &Source, loaded: Option<&Raw>) {
    let names: Vec<&str> = match s {
        Source::Linear(ln) => {
            let mut v = vec![ln.weight.as_str(), ln.weight_scale.as_str()];
            v.extend(ln.global_scale.as_deref());
            v.extend(ln.input_scale.as_deref());
            v
        }
        Source::Tensor(t) => vec![t.as_str()],
        Source::Incomplete { names, .. } => names.iter().map(String::as_str).collect(),
        // the merged tensor's other parts are still to compare
        Source::Merged(_) => vec![],
        Source::Fused(_) => {
            if let Some(Raw::Q(q)) = loaded {
                src.ckpt
                    .shards()
                    .iter()
                    .for_each(|f| f.release_bytes(q.packed.span()));
            }
            vec![]
        }
    };
    for n in names {
        if let Some((f, t)) = src.locate(n) {
            f.release(t);
        }
    }
}

/// Where a side holds a unit, as stored (a unit that could not be read is still named):
/// `…w13_weight[5] (gate)`, a linear's packed weight.
fn located(src: &Renamed, inv: &Inventory, s: &Source) -> String {
    match s {
        Source::Linear(ln) => src.original(&ln.weight).to_string(),
        Source::Tensor(t) => src.original(t).to_string(),
        Source::Incomplete { names, .. } => names
            .iter()
            .map(|n| src.original(n))
            .collect::<Vec<_>>()
            .join(", "),
        Source::Merged(m) => format!(
            "{} (part {} of {})",
            located(src, inv, &m.inner),
            m.part,
            m.parts
        ),
        Source::Fused(f) => {
            let w13 = f.proj != crate::checkpoint::Proj::Down;
            let w = inv
                .fused
                .get(&f.layer)
                .and_then(|fl| fl.member(w13, "weight"))
                .map_or_else(
                    || format!("layer {} fused", f.layer),
                    |n| src.original(n).to_string(),
                );
            let half = match f.proj {
                crate::checkpoint::Proj::Gate => " (gate)",
                crate::checkpoint::Proj::Up => " (up)",
                crate::checkpoint::Proj::Down => "",
            };
            format!("{w}[{}]{half}", f.index)
        }
    }
}

/// What a unit that cannot be loaded holds, as its tensors' headers tell: the codes' shape
/// (one expert's rows of a fused tensor) and dtype, with the block scales' dtype, in the
/// report's terms (`U8 (nvfp4, scales F32)`).
fn held(side: &SideRef, s: &Source) -> Option<(Vec<usize>, String)> {
    use crate::nvfp4::Format;
    use safetensors::Dtype;
    let info = |n: &str| {
        side.src
            .tensor_info(n)
            .ok()
            .map(|t| (t.dtype, t.shape.clone()))
    };
    let quantized = |wd: Dtype, sd: Option<(Dtype, Vec<usize>)>, mxfp4: bool| {
        let format = if mxfp4 { Format::Mxfp4 } else { Format::Nvfp4 };
        match sd {
            Some((sd, _)) => compare::q_dtype(wd, format, sd),
            None => format!("{wd:?} ({}, no block scales)", format.name()),
        }
    };
    match s {
        Source::Tensor(n) => info(n).map(|(d, shape)| (shape, format!("{d:?}"))),
        Source::Linear(ln) => {
            let (wd, ws) = info(&ln.weight)?;
            let mxfp4 = ln.convention == crate::checkpoint::Convention::Mxfp4;
            Some((ws, quantized(wd, info(&ln.weight_scale), mxfp4)))
        }
        Source::Merged(m) => {
            let (mut shape, dtype) = held(side, &m.inner)?;
            if let Some(r) = shape.first_mut() {
                *r = m.rows;
            }
            Some((shape, dtype))
        }
        Source::Fused(f) => {
            let fl = side.inv.fused.get(&f.layer)?;
            let w13 = f.proj != Proj::Down;
            let (wd, ws) = info(fl.member(w13, "weight")?)?;
            let [e, r_all, c] = ws[..] else {
                return Some((ws, format!("{wd:?}")));
            };
            let shape = vec![if w13 { r_all / 2 } else { r_all }, c];
            if !matches!(wd, Dtype::U8 | Dtype::I8) {
                return Some((shape, format!("{wd:?}")));
            }
            let sd = fl.member(w13, "weight_scale").and_then(info);
            // as the loader tells them apart: E8M0 codes, or one byte per 32 elements
            let mxfp4 = sd.as_ref().is_some_and(|(d, s)| {
                *d == Dtype::F8_E8M0
                    || (*d == Dtype::U8 && s.iter().product::<usize>() == e * r_all * (2 * c / 32))
            });
            Some((shape, quantized(wd, sd, mxfp4)))
        }
        Source::Incomplete { .. } => None,
    }
}

/// Names a unit stands for in its side (for the missing / extra lists).
fn member_names(src: &Renamed, u: &Unit) -> Vec<String> {
    match &u.source {
        Source::Linear(ln) => {
            let mut v = vec![ln.weight.clone(), ln.weight_scale.clone()];
            v.extend(ln.global_scale.clone());
            v.extend(ln.input_scale.clone());
            v.into_iter()
                .map(|n| src.original(&n).to_string())
                .collect()
        }
        Source::Tensor(t) => vec![src.original(t).to_string()],
        Source::Incomplete { names, .. } => {
            names.iter().map(|n| src.original(n).to_string()).collect()
        }
        Source::Merged(m) => vec![format!("{} (part {} of {})", u.key, m.part, m.parts)],
        Source::Fused(f) => vec![format!(
            "{} (fused, layer {} index {})",
            u.key, f.layer, f.index
        )],
    }
}

impl<'a> Plan<'a> {
    pub fn new(inputs: &'a Inputs, opts: &'a Options) -> Result<Plan<'a>> {
        let a = Renamed::new(&inputs.a, &opts.renames, Side::A)?;
        let b = Renamed::new(&inputs.b, &opts.renames, Side::B)?;
        let a_inv = Inventory::build(&a, None, true)?;
        let mut notes = vec![];
        let mut diagnoses = vec![];
        let map = match opts.ep {
            Some((rank, size, placement)) => {
                let e = inputs
                    .a
                    .config()
                    .ok()
                    .map(|c| c.moe.n_routed_experts)
                    .unwrap_or_else(|| a_inv.expert_count());
                Some(ExpertMap::new(e, rank, size, placement)?)
            }
            None => None,
        };
        let mut b_inv = Inventory::build(&b, map.as_ref(), false)?;
        notes.extend(merged::split(&mut b_inv, &a_inv, &a, &b, opts.tp));
        if let Some(m) = &map {
            notes.push(format!(
                "B is EP rank {} of {} ({}): experts {} of {}",
                m.ep_rank,
                m.ep_size,
                m.placement.name(),
                m.describe_owned(),
                m.num_experts
            ));
            for fl in b_inv.fused.values() {
                diagnoses.extend(ep_scalars_unsharded(&b, fl, m));
                if fl.experts != m.num_local() {
                    diagnoses.push(Diagnosis {
                        kind: DiagnosisKind::EpShard,
                        layer: Some(fl.layer),
                        experts: vec![],
                        tensors: 1,
                        message: format!(
                            "layer {}: B's fused tensors hold {} experts; EP rank {} of {} ({}) holds {} of the {} experts",
                            fl.layer,
                            fl.experts,
                            m.ep_rank,
                            m.ep_size,
                            m.placement.name(),
                            m.num_local(),
                            m.num_experts
                        ),
                        fails: true,
                        units: vec![],
                    });
                }
            }
        } else {
            let e_a = a_inv.expert_count();
            for fl in b_inv.fused.values() {
                if fl.experts < e_a {
                    notes.push(format!(
                        "layer {}: B's fused tensors hold {} of A's {e_a} experts: an expert-parallel shard? pass --ep-rank/--ep-size",
                        fl.layer, fl.experts
                    ));
                }
                // SGLang's shared-expert fusion: the shared expert is fused index E, after
                // the E routed experts, and B has no `shared_experts` of its own
                if fl.experts != e_a + 1 {
                    continue;
                }
                let mut moved = 0;
                for proj in [Proj::Gate, Proj::Up, Proj::Down] {
                    let from = inventory::expert_key(fl.layer, e_a, proj);
                    let to = format!("{}.weight", Naming::hf_v3().shared_expert(fl.layer, proj));
                    if !a_inv.units.contains_key(&to)
                        || a_inv.units.contains_key(&from)
                        || b_inv.units.contains_key(&to)
                    {
                        continue;
                    }
                    if let Some(mut u) = b_inv.units.remove(&from) {
                        u.key = to.clone();
                        u.expert = None;
                        b_inv.units.insert(to, u);
                        moved += 1;
                    }
                }
                if moved > 0 {
                    notes.push(format!(
                        "layer {}: B's fused expert index {e_a} compared as A's shared expert \
                         (SGLang's shared-expert fusion appends it to the {e_a} routed experts)",
                        fl.layer
                    ));
                }
            }
        }
        if let Some((r, n)) = opts.tp {
            notes.push(format!("B is TP rank {r} of {n}: column-parallel tensors compared against A's row slice, row-parallel against its column slice"));
        }
        let mut pairs = vec![];
        let mut missing = vec![];
        let mut extra = vec![];
        let mut skipped_ep = 0;
        // an expert's members B's fused tensors of its layer lack: B holding `w13_weight_scale`
        // but not `w13_weight` is missing the packed weight only
        let absent = |ua: &Unit| -> Vec<String> {
            let names = member_names(&a, ua);
            let Some((fl, w13)) = ua.expert.and_then(|e| {
                let fl = b_inv.fused.get(&e.layer)?;
                Some((fl, e.proj != Proj::Down))
            }) else {
                return names;
            };
            names
                .into_iter()
                .filter(|n| fl.member(w13, n.rsplit('.').next().unwrap_or(n)).is_none())
                .collect()
        };
        for (k, ua) in &a_inv.units {
            if b_inv.units.contains_key(k) {
                pairs.push((k.clone(), k.clone()));
            } else if let (Some(m), Some(e)) = (&map, ua.expert) {
                if m.owns(e.expert as i64) {
                    missing.extend(absent(ua));
                } else {
                    skipped_ep += 1;
                }
            } else {
                missing.extend(absent(ua));
            }
        }
        for (k, ub) in &b_inv.units {
            if !a_inv.units.contains_key(k) {
                extra.extend(member_names(&b, ub));
                if let (Some(m), Some(e)) = (&map, ub.expert) {
                    if !m.owns(e.expert as i64) {
                        notes.push(format!(
                            "B holds expert {} (`{k}`), which EP rank {} does not own",
                            e.expert, m.ep_rank
                        ));
                    }
                }
            }
        }
        // a name both sides hold (B's input_scale left under its name while the rest of its
        // linear was renamed) is neither missing nor extra: its linear's other members are
        let both: HashSet<String> = {
            let m: HashSet<&String> = missing.iter().collect();
            extra.iter().filter(|n| m.contains(n)).cloned().collect()
        };
        missing.retain(|n| !both.contains(n));
        extra.retain(|n| !both.contains(n));
        // A's global scales per expert projection: the fused-w13 checks compare B's one value
        // with A's gate and up
        let a_ref = SideRef {
            src: &a,
            inv: &a_inv,
            label: "A",
            swizzled: &load::NONE_SWIZZLED,
        };
        let a_scalars: HashMap<ExpertProj, AScalars> = if b_inv.fused.is_empty() {
            HashMap::new()
        } else {
            a_inv
                .units
                .values()
                .filter_map(|u| {
                    let e = u.expert?;
                    match a_ref.load(&u.source).ok()? {
                        Raw::Q(q) => Some((
                            e,
                            AScalars {
                                scale_2: q.scale_2,
                                input_scale: q.input_scale,
                            },
                        )),
                        Raw::D(_) => None,
                    }
                })
                .collect()
        };
        for fl in b_inv.fused.values() {
            derived::check(&b, fl, &a_scalars, &mut diagnoses, &mut notes);
        }
        Ok(Plan {
            opts,
            a,
            b,
            a_inv,
            b_inv,
            pairs,
            missing,
            extra,
            skipped_ep,
            diagnoses,
            notes,
            a_scalars,
            checkpoints: inputs.checkpoints,
        })
    }

    /// Units to compare (for a progress bar).
    pub fn len(&self) -> usize {
        self.pairs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pairs.is_empty()
    }

    /// Compare every pair, values diffed by `engine`; `tick` is called once per unit done
    /// (from worker threads). Err only when the engine fails (a GPU error, out of memory).
    pub fn run(self, engine: &dyn DiffEngine, tick: &(dyn Fn() + Sync)) -> Result<Comparison> {
        let a = SideRef {
            src: &self.a,
            inv: &self.a_inv,
            label: "A",
            swizzled: &load::NONE_SWIZZLED,
        };
        let b = SideRef {
            src: &self.b,
            inv: &self.b_inv,
            label: "B",
            swizzled: &load::NONE_SWIZZLED,
        };
        let copts = compare::Options {
            tp: self.opts.tp,
            ep: self.opts.ep,
            min_cosine: self.opts.min_cosine,
        };
        let lookup = |e: ExpertProj| self.a_scalars.get(&e).copied();
        let compare_pair =
            |a: &SideRef, b: &SideRef, ka: &String, kb: &String| -> Result<UnitResult> {
                let (ua, ub) = (&self.a_inv.units[ka], &self.b_inv.units[kb]);
                let (la, lb) = (a.load(&ua.source), b.load(&ub.source));
                let r = match (&la, &lb) {
                    (Ok(ra), Ok(rb)) => {
                        compare::compare(ka, ua.expert, ra, rb, &copts, &lookup, engine)?
                    }
                    (ra, rb) => {
                        let mut u = UnitResult::new(ka, ua.expert);
                        u.a = located(&self.a, &self.a_inv, &ua.source);
                        u.b = located(&self.b, &self.b_inv, &ub.source);
                        // a side that could not be loaded says what its headers hold
                        (u.a_shape, u.a_dtype) = match &la {
                            Ok(r) => compare::shape_and_dtype(r),
                            Err(_) => held(a, &ua.source).unwrap_or_default(),
                        };
                        (u.b_shape, u.b_dtype) = match &lb {
                            Ok(r) => compare::shape_and_dtype(r),
                            Err(_) => held(b, &ub.source).unwrap_or_default(),
                        };
                        for (side, r) in [("A", ra.as_ref().err()), ("B", rb.as_ref().err())] {
                            if let Some(e) = r {
                                u.issue(e.issue_kind(), format!("{side}: {e}"));
                            }
                        }
                        // B's incomplete linear: A's members it has no counterpart for
                        if let Source::Incomplete { names, .. } = &ub.source {
                            let has = |m: &str| {
                                let tail = m.rsplit('.').next().unwrap_or(m);
                                names.iter().any(|n| n.rsplit('.').next() == Some(tail))
                            };
                            u.missing_members = member_names(&self.a, ua)
                                .into_iter()
                                .filter(|m| !has(m))
                                .collect();
                        }
                        // B's fused tensor without its block scales: A's it has none for
                        if let (Source::Fused(_), Err(LoadError::Missing(_)), Source::Linear(ln)) =
                            (&ub.source, &lb, &ua.source)
                        {
                            u.missing_members = vec![self.a.original(&ln.weight_scale).to_string()];
                        }
                        u.status = Status::Mismatch;
                        u
                    }
                };
                // the page cache keeps the bytes; unmapping them keeps this process's page
                // tables at one unit's size on a checkpoint of hundreds of GB
                release(&self.a, &ua.source, la.as_ref().ok());
                release(&self.b, &ub.source, lb.as_ref().ok());
                Ok(r)
            };
        let mut results: Vec<UnitResult> = self
            .pairs
            .par_iter()
            .map(|(ka, kb)| {
                let r = compare_pair(&a, &b, ka, kb);
                tick();
                r
            })
            .collect::<Result<_>>()?;
        // an operand of a side read swizzled and none of it linear: its units that matched
        // under neither reading (gate and up swapped, another expert's weights: the nearer of
        // two wrong readings says nothing) are read swizzled too, so that what they hold can
        // be named
        layouts::settle_open(&mut results);
        let (a_swizzled, b_swizzled) = (
            layouts::swizzled_tensors(&results, SideName::A),
            layouts::swizzled_tensors(&results, SideName::B),
        );
        let a = SideRef {
            swizzled: &a_swizzled,
            ..a
        };
        let b = SideRef {
            swizzled: &b_swizzled,
            ..b
        };
        let again: Vec<usize> = (0..results.len())
            .filter(|&i| rereads(&results[i], &a_swizzled, &b_swizzled))
            .collect();
        let redone: Vec<UnitResult> = again
            .par_iter()
            .map(|&i| compare_pair(&a, &b, &self.pairs[i].0, &self.pairs[i].1))
            .collect::<Result<_>>()?;
        for (i, r) in again.into_iter().zip(redone) {
            results[i] = r;
        }
        layouts::settle_open(&mut results);
        let mut diagnoses = self.diagnoses;
        // the diagnoses across units first: one that explains a unit's issue (w13 split
        // across TP as one block, for what looked like another rank's slice) re-files it
        let mut across = diagnose::cross_expert(
            &mut results,
            &a,
            &b,
            &self.a_inv,
            &self.b_inv,
            &copts,
            engine,
        )?;
        across.extend(diagnose::dense_gate_up_swapped(
            &mut results,
            &a,
            &b,
            &self.a_inv,
            &self.b_inv,
            &copts,
            engine,
        )?);
        diagnoses.extend(diagnose::from_units(&results, self.checkpoints));
        // A's weight_scale_2 of every expert of a layer, the ones B's EP rank does not hold too
        let a_layer = |layer: usize| -> Vec<(ExpertProj, f32)> {
            self.a_inv
                .units
                .values()
                .filter_map(|u| {
                    let e = u.expert.filter(|e| e.layer == layer)?;
                    let v = match self.a_scalars.get(&e) {
                        Some(s) => s.scale_2,
                        None => a.scale_2(&u.source),
                    };
                    Some((e, v?))
                })
                .collect()
        };
        diagnose::scale_2_shared_max(
            &results,
            &a_layer,
            self.opts.ep.map(|(r, n, _)| (r, n)),
            &mut diagnoses,
        );
        diagnoses.extend(diagnose::global_scale_scaled(
            &results,
            self.opts.tp,
            self.opts.ep.map(|e| e.1),
        ));
        if let Some(tp) = self.opts.tp {
            diagnoses.extend(diagnose::tp_not_sharded(
                &results,
                tp,
                self.opts.ep.is_some(),
            ));
        }
        diagnoses.extend(across);
        diagnoses.extend(layer_shift::layer_shift(&mut results, &a, &b, self.opts.tp));
        let mut missing = self.missing;
        let mut extra = self.extra;
        for r in &results {
            missing.extend(r.missing_members.iter().cloned());
            extra.extend(r.extra_members.iter().cloned());
        }
        diagnoses.extend(diagnose::prefix_mismatch(&missing, &extra));
        diagnose::file_under_mismatches(&mut results, &diagnoses);
        let mut notes = self.notes;
        let tp_notes: BTreeSet<&String> = results
            .iter()
            .flat_map(|r| r.notes.iter())
            .filter(|n| n.starts_with("B is TP"))
            .collect();
        if !tp_notes.is_empty() {
            notes.push(format!(
                "{} tensors compared as TP slices of A",
                results
                    .iter()
                    .filter(|r| r.notes.iter().any(|n| n.starts_with("B is TP")))
                    .count()
            ));
        }
        notes.extend(scale_dtype_note(&results));
        let count = |s: Status| results.iter().filter(|r| r.status == s).count();
        let (equal, equal_after_conversion, close, mismatched) = (
            count(Status::Equal),
            count(Status::EqualAfterConversion),
            count(Status::Close),
            count(Status::Mismatch),
        );
        let mut conversions = std::collections::BTreeMap::new();
        for why in results.iter().filter_map(|r| r.equal_after.as_ref()) {
            *conversions.entry(why.clone()).or_insert(0) += 1;
        }
        let bytes = results.iter().map(|r| r.bytes).sum();
        let units = results.len();
        let (mismatches, rest): (Vec<UnitResult>, Vec<UnitResult>) = results
            .into_iter()
            .partition(|r| r.status == Status::Mismatch);
        let close_units = rest
            .into_iter()
            .filter(|r| r.status == Status::Close)
            .collect();
        Ok(Comparison {
            a_naming: naming_name(&self.a_inv),
            b_naming: naming_name(&self.b_inv),
            units,
            equal,
            equal_after_conversion,
            conversions,
            close,
            mismatched,
            skipped_ep: self.skipped_ep,
            bytes,
            mismatches,
            close_units,
            missing,
            extra,
            diagnoses,
            notes,
        })
    }

    /// Total tensors on each side (for the summary).
    pub fn tensor_counts(&self) -> (usize, usize) {
        (self.a.tensor_names().count(), self.b.tensor_names().count())
    }
}

/// The per-expert scalars of an EP rank's fused layer with one entry per global expert while
/// its weights hold the rank's experts only: kept whole where they should have been narrowed
/// to the rank's experts, so a kernel that indexes them by local id reads other experts'.
fn ep_scalars_unsharded(
    b: &Renamed,
    fl: &inventory::FusedLayer,
    m: &ExpertMap,
) -> Option<Diagnosis> {
    use crate::checkpoint::TensorSource;
    if fl.experts != m.num_local() || m.num_local() == m.num_experts {
        return None;
    }
    let members = [
        "weight_scale_2",
        "weight_global_scale",
        "input_scale",
        "input_global_scale",
    ];
    let whole: Vec<String> = [true, false]
        .into_iter()
        .flat_map(|w13| members.iter().filter_map(move |mm| fl.member(w13, mm)))
        .filter_map(|n| {
            let info = b.tensor_info(n).ok()?;
            (info.shape.first() == Some(&m.num_experts))
                .then(|| format!("`{}` {:?}", b.original(n), info.shape))
        })
        .collect();
    if whole.is_empty() {
        return None;
    }
    let owned = m.local_to_global();
    let first = owned.first().copied().unwrap_or(0);
    Some(Diagnosis {
        kind: DiagnosisKind::EpScalarsUnsharded,
        layer: Some(fl.layer),
        experts: vec![],
        tensors: whole.len(),
        message: format!(
            "layer {}: B's {} hold one entry per global expert ({}), while its fused weights hold EP rank {}'s \
             {} experts {} ({}): the per-expert scalars were kept for all experts instead of narrowed to \
             the rank's — indexed by local id, B's expert {first} (local 0) reads global expert 0's scales",
            fl.layer,
            whole.join(", "),
            m.num_experts,
            m.ep_rank,
            m.num_local(),
            m.describe_owned(),
            m.placement.name(),
        ),
        fails: true,
        units: vec![],
    })
}

/// A unit to compare again under its operand's swizzled reading: it matched under neither
/// reading of a side's scales whose size fits both, and that side's operand reads swizzled.
fn rereads(r: &UnitResult, a: &BTreeSet<String>, b: &BTreeSet<String>) -> bool {
    let undecided = |side: SideName, set: &BTreeSet<String>| {
        r.scales(side) == Some(view::ScalesSeen::Ambiguous) && set.contains(r.stored(side))
    };
    r.status == Status::Mismatch && (undecided(SideName::A, a) || undecided(SideName::B, b))
}

/// One note per (B dtype, A dtype) of block scales that compare equal as codes but are stored
/// in another dtype.
fn scale_dtype_note(results: &[UnitResult]) -> Vec<String> {
    use safetensors::Dtype;
    type Seen = (String, usize, bool);
    let mut seen: std::collections::BTreeMap<String, Seen> = Default::default();
    for (a, b, name) in results
        .iter()
        .filter_map(|r| r.scale_dtype_differs.as_ref())
    {
        let e4m3 = [*a, *b].contains(&Dtype::F8_E4M3);
        let e = seen
            .entry(format!("{b:?} where A's are {a:?}"))
            .or_insert_with(|| (name.clone(), 0, e4m3));
        e.1 += 1;
    }
    seen.into_iter()
        .map(|(dtypes, (example, n, e4m3))| {
            format!(
                "B's block scales are {dtypes} ({n} unit{}, e.g. `{example}`): compared as the \
                 same codes byte for byte, but a loader that copies them by value (torch copy_) \
                 where it should reinterpret them (.view) changes every code{}",
                if n == 1 { "" } else { "s" },
                if e4m3 {
                    " (the e4m3 byte 0x38, 1.0, becomes 56.0)"
                } else {
                    ""
                }
            )
        })
        .collect()
}
