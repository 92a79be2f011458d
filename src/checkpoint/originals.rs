//! `audit` against the BF16 originals a checkpoint ships (`DIR/bf16/`, as `synth` writes
//! them): every quantized linear with an original of its name is dequantized (DESIGN.md §2,
//! `(e2m1(q) · f32(s)) · weight_scale_2`) and compared with it (`metrics`: cosine, rel-L2) by
//! compare-weights' CPU engine, over zero-copy views of both maps (NVFP4 against BF16: one
//! fused pass, `weights::fused`).
//!
//! NVFP4 of real-looking weights keeps a cosine of ~0.99 with the original (rel-L2 ~0.1);
//! another matrix under the weight's name (gate and up exchanged, experts permuted, a weight
//! written from the wrong tensor) lands near 0 while its scales and statistics stay plausible,
//! so only this comparison sees it. A linear below `min_cosine`, or with a rel-L2 above the
//! noise that cosine allows (`metrics::max_rel_l2`: the right direction, the wrong
//! magnitude), is a finding, and its layer's other originals of that shape (and its own
//! projection in the other layers) are searched for the one it holds instead, to name the bug
//! ("gate_proj and up_proj swapped", "experts 3 and 5 swapped", "layers 1 and 2 swapped"). A
//! weight that dequantizes to NaN/Inf is left to the scale checks, which name the cause.
//!
//! Also findings: an original whose shape or dtype cannot be its weight's, and originals of
//! tensors the checkpoint does not hold.

use super::audit::{Finding, FindingKind};
use super::file::{decode_f32_into, is_float};
use super::formats::{Geometry, LinearNames};
use super::hf::Checkpoint;
use super::names::{split_layer, Key, Naming};
use super::source::TensorSource;
use crate::error::Result;
use crate::metrics::{self, max_rel_l2, Metrics};
use crate::weights::compare::{DView, Values};
use crate::weights::engine::{CpuDiff, DiffEngine};
use crate::weights::view::{Mat, QMatrix};
use rayon::prelude::*;
use serde::Serialize;
use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

/// Default `--min-original-cosine`: NVFP4 of DeepSeek-style weights keeps ~0.99 (synth
/// checkpoints: 0.9955-0.9961, rel-L2 <= 0.095, over every expert linear of the tiny and
/// tiny-v4 presets, seeds 1-3); a weight that holds another matrix gives ~0, one quantized
/// with a global scale 64x too small (synth's saturated-scales) ~0.74. At 0.95 the rel-L2
/// bound (`max_rel_l2`) is 0.33, 3.5x a healthy weight's.
pub const MIN_COSINE: f64 = 0.95;

/// Values of the weight read to nominate which other original it holds (a few rows).
const SAMPLE: usize = 2048;

/// Sample cosine a candidate needs to be compared in full.
const SCREEN: f64 = 0.5;

/// The comparison of one quantized linear with its BF16 original.
#[derive(Clone, Debug, Serialize)]
pub struct OriginalCheck {
    /// The original's shard.
    pub file: PathBuf,
    #[serde(flatten)]
    pub metrics: Metrics,
    /// Bytes of the original (the quantized ones are counted by the scan).
    #[serde(skip)]
    pub bytes: u64,
}

/// A cosine below `min`, NaN included (an original holding NaN/Inf).
fn below(v: f64, min: f64) -> bool {
    v.is_nan() || v < min
}

/// Does a comparison fail the cosine (or the rel-L2 that cosine allows)? A weight that
/// dequantizes to NaN/Inf does not count here: the scale checks name why.
pub fn fails(m: &Metrics, min_cosine: f64) -> bool {
    m.nan_count + m.inf_count == 0
        && (below(m.cosine, min_cosine) || m.rel_l2 > max_rel_l2(min_cosine))
}

/// The original of a quantized linear: `X.weight` (also for compressed-tensors'
/// `X.weight_packed`).
fn original_name(base: &str) -> String {
    format!("{base}.weight")
}

/// The linear as compare-weights views it: packed codes and linear block scales in the maps.
fn qmatrix<'a>(
    ck: &'a Checkpoint,
    ln: &LinearNames,
    g: Geometry,
    scale_2: f32,
) -> Result<Option<QMatrix<'a>>> {
    let packed = ck.bytes(&ln.weight)?;
    let scales = ck.bytes(&ln.weight_scale)?;
    Ok(
        Mat::dense(packed, g.rows, g.cols / 2).map(|packed| QMatrix {
            format: g.format,
            rows: g.rows,
            cols: g.cols,
            packed,
            scales: Cow::Borrowed(scales),
            scale_2,
        }),
    )
}

/// A 2-D float original of `[rows, cols]` (None for another shape or dtype).
fn original_view<'a>(
    orig: &'a Checkpoint,
    name: &str,
    rows: usize,
    cols: usize,
) -> Option<DView<'a>> {
    let (f, t) = orig.locate(name)?;
    if !is_float(t.dtype) || t.shape != [rows, cols] {
        return None;
    }
    let es = (t.dtype.bitsize() / 8).max(1);
    Mat::dense(f.slice(t), rows, cols * es).map(|mat| DView {
        mat,
        dtype: t.dtype,
    })
}

/// A path as the user sees it: relative to the checkpoint directory when inside it.
fn shown(ck: &Checkpoint, p: &Path) -> String {
    p.strip_prefix(ck.dir()).unwrap_or(p).display().to_string()
}

/// "layer 1 expert 2 gate_proj", "layer 3 shared expert w1", or the base name.
fn who(naming: Option<&Naming>, base: &str) -> String {
    let proj = base.rsplit('.').next().unwrap_or(base);
    match naming.and_then(|n| n.parse(&original_name(base))) {
        Some(Key::Expert { layer, expert, .. }) => format!("layer {layer} expert {expert} {proj}"),
        Some(Key::SharedExpert { layer, .. }) => format!("layer {layer} shared expert {proj}"),
        _ => format!("`{base}`"),
    }
}

/// Compare one quantized linear with its original, when the checkpoint ships one. The
/// finding is an original that cannot be this weight (shape, dtype); the metrics go back to
/// the caller, which hands the failing ones to [`diagnose`].
pub fn check(
    ck: &Checkpoint,
    orig: &Checkpoint,
    naming: Option<&Naming>,
    ln: &LinearNames,
    g: Geometry,
    scale_2: f32,
) -> Result<(Option<OriginalCheck>, Vec<Finding>)> {
    let name = original_name(&ln.base);
    let Some((of, ot)) = orig.locate(&name) else {
        return Ok((None, vec![]));
    };
    let Some(view) = original_view(orig, &name, g.rows, g.cols) else {
        let transposed = if ot.shape == [g.cols, g.rows] {
            " (transposed: [in, out])"
        } else {
            ""
        };
        let finding = Finding {
            tensor: ln.weight.clone(),
            file: ck.file_of(&ln.weight).to_path_buf(),
            kind: FindingKind::OriginalShapeMismatch,
            detail: format!(
                "{}: its BF16 original `{name}` in `{}` is {:?} {:?}{transposed}, the quantized weight in `{}` is [{}, {}] (packed [{}, {}]): the original was written for another tensor, or the weight was",
                who(naming, &ln.base),
                shown(ck, of.path()),
                ot.dtype,
                ot.shape,
                shown(ck, ck.file_of(&ln.weight)),
                g.rows,
                g.cols,
                g.rows,
                g.cols / 2
            ),
        };
        return Ok((None, vec![finding]));
    };
    let Some(q) = qmatrix(ck, ln, g, scale_2)? else {
        return Ok((None, vec![]));
    };
    of.prefetch(ot);
    let m = CpuDiff.metrics(&Values::D(view), &Values::Q(&q))?;
    of.release(ot);
    let bytes = ot.nbytes() as u64;
    Ok((
        m.map(|metrics| OriginalCheck {
            file: of.path().to_path_buf(),
            metrics,
            bytes,
        }),
        vec![],
    ))
}

/// A linear whose comparison with its original failed, as [`diagnose`] needs it.
pub struct Failing {
    pub names: LinearNames,
    pub geometry: Geometry,
    pub scale_2: f32,
    pub check: OriginalCheck,
}

/// Which original a failing weight holds instead: its name and the full comparison.
type Match = Option<(String, Metrics)>;

/// Every original of the same shape as `f`'s weight that could be the one it holds: the
/// expert's other projections, the same projection of the layer's other experts and of the
/// same expert in the other layers (or the shared expert's other projections).
fn candidates(
    orig: &Checkpoint,
    naming: &Naming,
    experts: &BTreeMap<usize, BTreeSet<usize>>,
    f: &Failing,
) -> Vec<String> {
    let own = original_name(&f.names.base);
    let mut out = vec![];
    match naming.parse(&own) {
        Some(Key::Expert {
            layer,
            expert,
            proj,
            ..
        }) => {
            for p in super::names::Proj::ALL.into_iter().filter(|&p| p != proj) {
                out.push(original_name(&naming.expert(layer, expert, p)));
            }
            for &e in experts.get(&layer).into_iter().flatten() {
                if e != expert {
                    out.push(original_name(&naming.expert(layer, e, proj)));
                }
            }
            for (&l, es) in experts {
                if l != layer && es.contains(&expert) {
                    out.push(original_name(&naming.expert(l, expert, proj)));
                }
            }
        }
        Some(Key::SharedExpert { layer, proj, .. }) => {
            for p in super::names::Proj::ALL.into_iter().filter(|&p| p != proj) {
                out.push(original_name(&naming.shared_expert(layer, p)));
            }
        }
        _ => {}
    }
    let (rows, cols) = (f.geometry.rows, f.geometry.cols);
    out.retain(|c| original_view(orig, c, rows, cols).is_some());
    out
}

/// Look for the original `f`'s weight holds: nominate by the cosine of the first rows (a
/// couple of thousand values: a wrong candidate's is ~0 ± 0.03), confirm in full.
fn find_match(
    ck: &Checkpoint,
    orig: &Checkpoint,
    naming: &Naming,
    experts: &BTreeMap<usize, BTreeSet<usize>>,
    f: &Failing,
    min_cosine: f64,
) -> Result<Match> {
    let Some(q) = qmatrix(ck, &f.names, f.geometry, f.scale_2)? else {
        return Ok(None);
    };
    let (rows, cols) = (q.rows, q.cols);
    let r = SAMPLE.div_ceil(cols.max(1)).clamp(1, rows.max(1)).min(rows);
    let Some(head) = q.rows_slice(0, r) else {
        return Ok(None);
    };
    let xs = head.dequantize();
    let mut nominated: Vec<(f64, String)> = vec![];
    let mut cs = vec![0f32; xs.len()];
    for c in candidates(orig, naming, experts, f) {
        let Some(v) = original_view(orig, &c, rows, cols) else {
            continue;
        };
        let es = v.es();
        let bytes = &v.mat.rows_bytes(0, r);
        if !decode_f32_into(v.dtype, &bytes[..xs.len() * es], &mut cs) {
            continue;
        }
        let cos = metrics::compare(&xs, &cs).cosine;
        if cos >= SCREEN {
            nominated.push((cos, c));
        }
    }
    nominated.sort_by(|a, b| b.0.total_cmp(&a.0).then_with(|| a.1.cmp(&b.1)));
    for (_, c) in nominated.into_iter().take(2) {
        let Some(v) = original_view(orig, &c, rows, cols) else {
            continue;
        };
        if let Some(m) = CpuDiff.metrics(&Values::D(v), &Values::Q(&q))? {
            if !fails(&m, min_cosine) && m.nan_count + m.inf_count == 0 {
                return Ok(Some((c, m)));
            }
        }
    }
    Ok(None)
}

/// A reading of a failing weight's bytes that [`repaired`] tries against its own original.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Repair {
    /// The two FP4 codes of every byte exchanged: packed with element `2i` in the high
    /// nibble (DESIGN.md §2: the low one).
    Nibbles,
    /// The block scales read as the 128x4 swizzled layout the kernels take (checkpoints hold
    /// them linear `[N, K/16]`).
    Unswizzled,
}

impl Repair {
    const ALL: [Repair; 2] = [Repair::Nibbles, Repair::Unswizzled];

    fn verdict(self, cosine: f64) -> String {
        match self {
            Repair::Nibbles => format!(
                "; with the two FP4 codes of every byte exchanged it matches its original (cosine {cosine:.4}): the nibble order is swapped - element 2i belongs in the low nibble, 2i+1 in the high one (the packer or the loader uses the other order)"
            ),
            Repair::Unswizzled => format!(
                "; with its block scales read as the kernels' 128x4 swizzled layout it matches its original (cosine {cosine:.4}): the block scales were stored swizzled, while checkpoints hold them linear [N, K/16] (a kernel-side tensor written back to the checkpoint)"
            ),
        }
    }
}

/// The comparison of a failing weight, read as `repair` says, with its own original, when it
/// passes so.
fn repaired(
    ck: &Checkpoint,
    orig: &Checkpoint,
    f: &Failing,
    min_cosine: f64,
    repair: Repair,
) -> Result<Option<Metrics>> {
    let g = f.geometry;
    let packed = ck.bytes(&f.names.weight)?;
    let scales = ck.bytes(&f.names.weight_scale)?;
    let kb = g.cols / g.format.block().max(1);
    let (packed, scales): (Cow<[u8]>, Cow<[u8]>) = match repair {
        Repair::Nibbles => (
            Cow::Owned(packed.par_iter().map(|b| b.rotate_left(4)).collect()),
            Cow::Borrowed(scales),
        ),
        Repair::Unswizzled => {
            if scales.len() != crate::nvfp4::layout::swizzled_len(g.rows, kb) {
                return Ok(None);
            }
            let linear = crate::nvfp4::layout::unswizzle(scales, g.rows, kb);
            // identical in both layouts: nothing to tell
            if linear.as_slice() == scales {
                return Ok(None);
            }
            (Cow::Borrowed(packed), Cow::Owned(linear))
        }
    };
    let (Some(packed), Some(view)) = (
        Mat::dense(&packed, g.rows, g.cols / 2),
        original_view(orig, &original_name(&f.names.base), g.rows, g.cols),
    ) else {
        return Ok(None);
    };
    let q = QMatrix {
        format: g.format,
        rows: g.rows,
        cols: g.cols,
        packed,
        scales,
        scale_2: f.scale_2,
    };
    Ok(CpuDiff
        .metrics(&Values::D(view), &Values::Q(&q))?
        .filter(|m| !fails(m, min_cosine)))
}

/// One finding per failing linear: where it is, how far off, and — when its layer holds the
/// original it matches instead, or it matches its own when its bytes are read another way
/// (nibbles swapped, block scales swizzled) — the likely bug.
pub fn diagnose(
    ck: &Checkpoint,
    orig: &Checkpoint,
    failing: &[Failing],
    min_cosine: f64,
) -> Result<Vec<Finding>> {
    if failing.is_empty() {
        return Ok(vec![]);
    }
    let naming = Naming::detect(ck.names());
    let mut experts: BTreeMap<usize, BTreeSet<usize>> = BTreeMap::new();
    if let Some(n) = &naming {
        for name in orig.names() {
            if let Some(Key::Expert { layer, expert, .. }) = n.parse(name) {
                experts.entry(layer).or_default().insert(expert);
            }
        }
    }
    let matches: Vec<Match> = failing
        .par_iter()
        .map(|f| match &naming {
            Some(n) => find_match(ck, orig, n, &experts, f, min_cosine),
            None => Ok(None),
        })
        .collect::<Result<_>>()?;
    // the first reading of its bytes that makes a weight matching no other original its own
    let swapped: Vec<Option<(Repair, Metrics)>> = failing
        .par_iter()
        .zip(&matches)
        .map(|(f, m)| {
            if m.is_some() || !below(f.check.metrics.cosine, min_cosine) {
                return Ok(None);
            }
            for r in Repair::ALL {
                if let Some(mm) = repaired(ck, orig, f, min_cosine, r)? {
                    return Ok(Some((r, mm)));
                }
            }
            Ok(None)
        })
        .collect::<Result<_>>()?;
    // original a failing weight holds -> whose it is
    let held: HashMap<String, &str> = failing
        .iter()
        .zip(&matches)
        .filter_map(|(f, m)| {
            m.as_ref()
                .map(|(c, _)| (original_name(&f.names.base), c.as_str()))
        })
        .collect();
    let n = naming.as_ref();
    let mut out = vec![];
    for ((f, m), sw) in failing.iter().zip(&matches).zip(&swapped) {
        let base = &f.names.base;
        let own = original_name(base);
        let c = &f.check.metrics;
        // the metrics count NaN/Inf on the quantized side: a NaN cosine without them is the
        // original's NaN/Inf, an infinite rel-L2 (‖w − o‖/‖o‖) an all-zero original
        let clean_q = c.nan_count + c.inf_count == 0;
        let original_broken = if clean_q && c.rel_l2.is_infinite() {
            ": the BF16 original is all zeros, the quantized weight is not: the original is broken, not the quantization"
        } else if clean_q && c.cosine.is_nan() {
            ": the BF16 original itself holds NaN/Inf (the dequantized weight is finite): the original is broken, not the quantization"
        } else {
            ""
        };
        let mut detail = if below(c.cosine, min_cosine) {
            format!(
                "{}: dequantized, cosine {:.4} with its BF16 original (rel-L2 {:.3}; --min-original-cosine {min_cosine}){original_broken}",
                who(n, base),
                c.cosine,
                c.rel_l2
            )
        } else {
            format!(
                "{}: dequantized, rel-L2 {:.3} from its BF16 original at cosine {:.4}, more than the {:.3} that --min-original-cosine {min_cosine} allows: the weight has the wrong magnitude (a weight_scale_2 off by a factor?)",
                who(n, base),
                c.rel_l2,
                c.cosine,
                max_rel_l2(min_cosine)
            )
        };
        detail += &format!(
            " [`{}` vs `{}`]",
            shown(ck, ck.file_of(&f.names.weight)),
            shown(ck, &f.check.file)
        );
        match m {
            Some((other, mm)) => {
                let ob = other.strip_suffix(".weight").unwrap_or(other);
                // does the weight that original belongs to hold this one's?
                let mutual = held.get(other.as_str()) == Some(&own.as_str());
                let (pk, ok) = (
                    n.and_then(|n| n.parse(&own)),
                    n.and_then(|n| n.parse(other)),
                );
                let leaf = |b: &str| b.rsplit('.').next().unwrap_or(b).to_string();
                let (this_p, that_p) = (leaf(base), leaf(ob));
                let verdict = match (&pk, &ok) {
                    (
                        Some(Key::Expert {
                            layer: l,
                            expert: e,
                            ..
                        }),
                        Some(Key::Expert { layer: l2, .. }),
                    ) if l != l2 => {
                        if mutual {
                            format!(
                                "layers {} and {} swapped (expert {e} {this_p})",
                                l.min(l2),
                                l.max(l2)
                            )
                        } else {
                            format!("it holds layer {l2}'s expert {e} {that_p}: layer ids shifted at conversion?")
                        }
                    }
                    (Some(Key::Expert { expert: e, .. }), Some(Key::Expert { expert: e2, .. }))
                        if e != e2 =>
                    {
                        if mutual {
                            format!("experts {} and {} swapped ({this_p})", e.min(e2), e.max(e2))
                        } else {
                            format!("it holds expert {e2}'s {that_p}: expert ids shifted or permuted at conversion?")
                        }
                    }
                    _ if mutual => {
                        // in the layer's order: gate, up, down
                        let (a, b) = match (&pk, &ok) {
                            (
                                Some(Key::Expert { proj: p, .. }),
                                Some(Key::Expert { proj: q, .. }),
                            )
                            | (
                                Some(Key::SharedExpert { proj: p, .. }),
                                Some(Key::SharedExpert { proj: q, .. }),
                            ) if q < p => (&that_p, &this_p),
                            _ => (&this_p, &that_p),
                        };
                        format!("{a} and {b} swapped")
                    }
                    _ => format!("{that_p}'s weights written under {this_p}'s name?"),
                };
                detail += &format!(
                    "; it matches the original of {} instead (cosine {:.4}){}: {verdict}",
                    who(n, ob),
                    mm.cosine,
                    if mutual {
                        ", and that one's weight matches this original"
                    } else {
                        ""
                    }
                );
            }
            None if sw.is_some() => {
                if let Some((r, mm)) = sw {
                    detail += &r.verdict(mm.cosine);
                }
            }
            None if below(c.cosine, min_cosine) && original_broken.is_empty() => {
                detail += "; it matches no other original of its shape in its layer, nor its own in another layer: corrupted codes or block scales, or a weight quantized from another tensor";
            }
            None => {}
        }
        out.push(Finding {
            tensor: f.names.weight.clone(),
            file: ck.file_of(&f.names.weight).to_path_buf(),
            kind: FindingKind::OriginalMismatch,
            detail,
        });
    }
    Ok(out)
}

/// Originals of tensors the checkpoint does not hold (neither the float weight nor a
/// quantized linear of that name): dropped or renamed at conversion, so the engine has no
/// weight for them. One finding per layer, naming the first and counting the others. An
/// expert's original beside an engine dump's fused `experts.w13_weight` / `experts.w2_weight`
/// is held there (not compared: the fused scan reads no originals).
pub fn orphans(ck: &Checkpoint, orig: &Checkpoint, out: &mut Vec<Finding>) {
    let fused = |n: &str| {
        n.find(".experts.").is_some_and(|i| {
            let experts = &n[..i + ".experts.".len()];
            ["w13_weight", "w2_weight"]
                .iter()
                .any(|w| ck.contains(&format!("{experts}{w}")))
        })
    };
    let held = |n: &str| {
        ck.contains(n)
            || n.strip_suffix(".weight")
                .is_some_and(|b| ck.contains(&format!("{b}.weight_packed")))
            || fused(n)
    };
    let mut by_layer: BTreeMap<Option<usize>, Vec<&str>> = BTreeMap::new();
    for n in orig.names().filter(|n| !held(n)) {
        by_layer
            .entry(split_layer(n).map(|(_, l, _)| l))
            .or_default()
            .push(n);
    }
    let naming = Naming::detect(orig.names());
    for (layer, names) in by_layer {
        let first = names[0];
        let more = match (names.len(), layer) {
            (1, _) => String::new(),
            (k, Some(l)) => format!(" (and {} more originals of layer {l})", k - 1),
            (k, None) => format!(" (and {} more originals outside the layers)", k - 1),
        };
        let what = match naming.as_ref().and_then(|n| n.parse(first)) {
            Some(Key::Expert { .. } | Key::SharedExpert { .. }) => format!(
                "{}: ",
                who(
                    naming.as_ref(),
                    first.strip_suffix(".weight").unwrap_or(first)
                )
            ),
            _ => String::new(),
        };
        out.push(Finding {
            tensor: first.to_string(),
            file: orig.file_of(first).to_path_buf(),
            kind: FindingKind::OrphanOriginal,
            detail: format!(
                "{what}a BF16 original in `{}` for a tensor the checkpoint does not hold (no `{first}`, quantized or not){more}: dropped or renamed at conversion, so an engine has no weight for it",
                shown(ck, orig.file_of(first))
            ),
        });
    }
}
