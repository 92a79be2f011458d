//! Comparing one unit across the two sides: shapes (TP shards, transposes), dtypes, bitwise
//! identity of codes and scales, global scales (with the conventions and vLLM's fused
//! `w13_weight_scale_2`), and — when the bytes differ — metrics after dequantization, computed
//! in chunks so that a multi-GB tensor never sits in memory as f32.

use super::blocks::{self, BlockCount};
use super::engine::DiffEngine;
use super::inventory::ExpertProj;
use super::layouts::{self, Reading, Readings, SideName};
use super::load::{DRaw, LoadError, QRaw, Raw, Shared};
use super::view::{Depth, Mat, QMatrix, Scales, ScalesSeen};
use crate::checkpoint::file::decode_f32_into;
use crate::checkpoint::Proj;
use crate::error::Result;
use crate::metrics::{Accum, Metrics};
use crate::nvfp4::layout::{layout_by_cosines, swizzled_len, unswizzle, ScaleLayout};
use crate::nvfp4::{dequantize_row, e2m1, e4m3, ue8m0, Format};
use rayon::prelude::*;
use safetensors::Dtype;
use serde::Serialize;

/// Elements per work item of a metric computation.
const CHUNK: usize = 1 << 16;

#[derive(Clone, Copy, Debug)]
pub struct Options {
    /// `(rank, size)`: B is tensor-parallel shard `rank` of `size`.
    pub tp: Option<(usize, usize)>,
    /// `(rank, size, placement)`: B holds expert-parallel rank `rank`'s experts.
    pub ep: Option<(usize, usize, crate::moe::ep::Placement)>,
    /// Values that are not bitwise identical still pass above this cosine.
    pub min_cosine: f64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// Bitwise identical.
    Equal,
    /// The same values, but the bytes differ: one side's block scales read in the 128x4
    /// swizzle, global scales stored in the other convention (up to the ulp its reciprocal
    /// costs), or another dtype holding the same values. `UnitResult::equal_after` says which.
    EqualAfterConversion,
    /// Not bitwise identical, but the dequantized values agree above `min_cosine`.
    Close,
    Mismatch,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum IssueKind {
    Unreadable,
    Format,
    Shape,
    Transposed,
    Dtype,
    Scales,
    Values,
    #[serde(rename = "scale_2")]
    Scale2,
    #[serde(rename = "scale_2_flipped")]
    Scale2Flipped,
    #[serde(rename = "scale_2_gate_only")]
    Scale2GateOnly,
    InputScale,
    InputScaleFlipped,
    MissingMember,
    /// B's packed bytes are A's with the two nibbles of each byte exchanged.
    NibblesSwapped,
    /// B's weight_scale_2 is A's input_scale and B's input_scale A's weight_scale_2.
    #[serde(rename = "scale_2_input_scale_swapped")]
    Scale2InputScaleSwapped,
    /// B is another TP rank's slice of A.
    TpRank,
    /// B's packed codes are A's (its TP slice), its block scales A's shifted by one column.
    ScalesShifted,
    /// B is a 1/size slice of A along an axis its module is not split along under TP (a
    /// row-parallel `down_proj` cut along its output rows, a replicated norm cut at all).
    TpAxis,
    /// B (a float tensor) holds A's MXFP4 values dequantized with the block scales misread:
    /// applied to 16-element blocks, or their UE8M0 bytes read as E4M3.
    ScalesMisread,
    /// The float side holds the unquantized weights the quantized side was made from: they
    /// quantize back to its codes under its own block scales.
    UnquantizedSource,
}

#[derive(Clone, Debug, Serialize)]
pub struct Issue {
    pub kind: IssueKind,
    pub message: String,
}

#[derive(Clone, Debug, Serialize)]
pub struct UnitResult {
    /// Canonical (HF) name.
    pub name: String,
    /// Where each side holds it.
    pub a: String,
    pub b: String,
    pub status: Status,
    pub a_shape: Vec<usize>,
    pub b_shape: Vec<usize>,
    pub a_dtype: String,
    pub b_dtype: String,
    pub bitwise_equal: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metrics: Option<Metrics>,
    /// How A's block scales were laid out (quantized units).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub a_scales: Option<ScalesSeen>,
    /// How B's block scales were laid out (quantized units).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub b_scales: Option<ScalesSeen>,
    /// What the values are equal after, where the bytes differ (status
    /// `equal_after_conversion`): "reading B's block scales in the 128x4 swizzle", ...
    #[serde(skip_serializing_if = "Option::is_none")]
    pub equal_after: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub issues: Vec<Issue>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
    #[serde(skip)]
    pub expert: Option<ExpertProj>,
    /// Bytes read from both sides.
    #[serde(skip)]
    pub bytes: u64,
    /// Member names of A this unit expected in B but B lacks.
    #[serde(skip)]
    pub missing_members: Vec<String>,
    /// Member names of B that A lacks (the unit is in both).
    #[serde(skip)]
    pub extra_members: Vec<String>,
    /// One side's block scales read swizzled, the bytes cannot tell which
    /// (`layouts::Reading::EitherSwizzled`); `layouts::settle_open` names it.
    #[serde(skip)]
    pub swizzle_side_open: bool,
    /// B's block scales in another one-byte dtype than A's, read as the same codes:
    /// (A's dtype, B's dtype, B's scale tensor).
    #[serde(skip)]
    pub scale_dtype_differs: Option<(Dtype, Dtype, String)>,
    /// B's global scalars that differ from A's with no convention explaining it: (member,
    /// A's value, B's value, B's tensor), for the diagnoses across units.
    #[serde(skip)]
    pub scalars_differ: Vec<(&'static str, f32, f32, String)>,
    /// Both sides' global scales (dequant direction), where both hold one: A's, B's.
    #[serde(skip)]
    pub scales_2: Option<(f32, f32)>,
    /// Equal by itself, a mismatch by a diagnosis across units
    /// (`diagnose::file_under_mismatches`).
    #[serde(skip)]
    pub filed_by_diagnosis: bool,
}

impl LoadError {
    /// The issue a unit that cannot be read is filed under.
    pub fn issue_kind(&self) -> IssueKind {
        match self {
            LoadError::Scales(_) => IssueKind::Scales,
            LoadError::Missing(_) => IssueKind::MissingMember,
            LoadError::Unreadable(_) => IssueKind::Unreadable,
        }
    }
}

impl UnitResult {
    pub fn new(name: &str, expert: Option<ExpertProj>) -> UnitResult {
        UnitResult {
            name: name.to_string(),
            a: String::new(),
            b: String::new(),
            status: Status::Equal,
            a_shape: vec![],
            b_shape: vec![],
            a_dtype: String::new(),
            b_dtype: String::new(),
            bitwise_equal: false,
            metrics: None,
            a_scales: None,
            b_scales: None,
            equal_after: None,
            issues: vec![],
            notes: vec![],
            expert,
            bytes: 0,
            missing_members: vec![],
            extra_members: vec![],
            swizzle_side_open: false,
            scale_dtype_differs: None,
            scalars_differ: vec![],
            scales_2: None,
            filed_by_diagnosis: false,
        }
    }
    pub fn issue(&mut self, kind: IssueKind, message: impl Into<String>) {
        self.issues.push(Issue {
            kind,
            message: message.into(),
        });
    }
    fn finish(mut self, close: bool) -> UnitResult {
        self.status = if !self.issues.is_empty() {
            Status::Mismatch
        } else if self.bitwise_equal {
            Status::Equal
        } else if self.equal_after.is_some() {
            Status::EqualAfterConversion
        } else if close {
            Status::Close
        } else {
            Status::Mismatch
        };
        self
    }
}

/// A's global scales of an expert projection, for the fused-w13 checks.
#[derive(Clone, Copy, Debug, Default)]
pub struct AScalars {
    pub scale_2: Option<f32>,
    pub input_scale: Option<f32>,
}

/// How B's geometry relates to A's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Align {
    Same,
    /// B is rows (dim 0 of a 2-D view) `[r0, r0 + n)` of A.
    Rows(usize),
    /// B is columns `[c0, c0 + n)` of A.
    Cols(usize),
}

/// Align `[rows, cols]` of B to A: equal, or a TP shard. None when neither.
pub fn align2(a: (usize, usize), b: (usize, usize), tp: Option<(usize, usize)>) -> Option<Align> {
    if a == b {
        return Some(Align::Same);
    }
    let (r, n) = tp?;
    if a.1 == b.1 && a.0 == n * b.0 {
        return Some(Align::Rows(r * b.0));
    }
    if a.0 == b.0 && a.1 == n * b.1 {
        return Some(Align::Cols(r * b.1));
    }
    None
}

/// How tensor parallelism splits a module's weight (vLLM's / SGLang's DeepSeek layers).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TpSplit {
    /// Column-parallel (and the vocab-parallel embedding / lm_head): output rows, dim 0.
    Rows,
    /// Row-parallel: the input dim K, the last dim.
    Cols,
    /// The same whole tensor on every rank (norms, the MoE router).
    Replicated,
}

impl TpSplit {
    fn what(self) -> &'static str {
        match self {
            TpSplit::Rows => "column-parallel: split along its output rows (dim 0)",
            TpSplit::Cols => "row-parallel: split along K, its input dim (the last)",
            TpSplit::Replicated => "replicated: whole on every TP rank",
        }
    }
}

/// How TP splits A's tensor `name` (a canonical name: `….down_proj.weight`), by its module;
/// None where the name does not say (the shapes decide, as for any tensor).
pub fn tp_split(name: &str) -> Option<TpSplit> {
    let parts: Vec<&str> = name.split('.').collect();
    let module = match parts.as_slice() {
        [.., m, _] => *m,
        _ => return None,
    };
    let parent = parts.len().checked_sub(3).map(|i| parts[i]);
    match module {
        "gate_proj" | "up_proj" | "w1" | "w3" | "q_proj" | "k_proj" | "v_proj" | "q_b_proj"
        | "kv_b_proj" | "embed_tokens" | "lm_head" => Some(TpSplit::Rows),
        "down_proj" | "w2" | "o_proj" | "wo" => Some(TpSplit::Cols),
        "gate" if matches!(parent, Some("mlp" | "ffn")) => Some(TpSplit::Replicated),
        "e_score_correction_bias" if matches!(parent, Some("mlp" | "ffn")) => {
            Some(TpSplit::Replicated)
        }
        m if m.ends_with("layernorm") || m.ends_with("_norm") || m == "norm" => {
            Some(TpSplit::Replicated)
        }
        _ => None,
    }
}

/// The issue of a TP slice along dim `dim` of `ndim` (0: rows) where `name`'s module is split
/// along another (or not at all); None where the split is the module's (or it is unknown).
fn wrong_tp_axis(name: &str, dim: usize, ndim: usize, slice: &str) -> Option<String> {
    let want = tp_split(name)?;
    let ok = match want {
        TpSplit::Rows => dim == 0,
        TpSplit::Cols => dim + 1 == ndim,
        TpSplit::Replicated => false,
    };
    (!ok).then(|| {
        let module = name.rsplit('.').nth(1).unwrap_or(name);
        format!(
            "B is A's {slice}: split across TP along the wrong axis — `{module}` is {} (the \
             loader narrowed another dim)",
            want.what()
        )
    })
}

/// `part/whole` as a reduced fraction ("1/2", "3/8").
fn frac(part: usize, whole: usize) -> String {
    let (mut x, mut y) = (part, whole);
    while y != 0 {
        (x, y) = (y, x % y);
    }
    let g = x.max(1);
    format!("{}/{}", part / g, whole / g)
}

fn shape_hint(a: &[usize], b: &[usize], tp: Option<(usize, usize)>) -> String {
    let diff: Vec<usize> = (0..a.len().min(b.len()))
        .filter(|&i| a[i] != b[i])
        .collect();
    if a.len() == b.len() && diff.len() == 1 {
        let d = diff[0];
        if b[d] > 0 && a[d].is_multiple_of(b[d]) && tp.is_none() {
            return format!(
                " — dim {d} is 1/{} of A's: a tensor-parallel shard? pass --tp-rank/--tp-size",
                a[d] / b[d]
            );
        }
    }
    String::new()
}

fn dname(d: Dtype) -> String {
    format!("{d:?}")
}

/// Dequant-direction global scales compared: equal bits, or within the ulp a reciprocal
/// conversion (compressed-tensors' gs) costs. The tolerance holds only between finite values:
/// against an infinity it is infinite too (`inf <= 4ε·inf`), and a B scale of ±inf would pass.
pub fn same_scale(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits()
        || (a.is_finite()
            && b.is_finite()
            && (a - b).abs() <= 4.0 * f32::EPSILON * a.abs().max(b.abs()))
}

/// Two finite, same-signed f32 values `n` representable numbers apart (`None` otherwise).
fn ulps_apart(a: f32, b: f32) -> Option<u32> {
    let same_sign = a.is_sign_negative() == b.is_sign_negative();
    (a.is_finite() && b.is_finite() && same_sign)
        .then(|| (a.abs().to_bits() as i64 - b.abs().to_bits() as i64).unsigned_abs() as u32)
}

/// B's global scale `y` is A's `x` times a power of two other than 1 (a re-encoding whose
/// block scales make up for it, as halved block scales with a doubled weight_scale_2 do):
/// exactly, or, where the two sides store it in different conventions, up to the one ulp
/// the reciprocal of a conversion costs (`1/(1/v)` is within one ulp of `v` in f32). The
/// exact `x·2^k`, or None.
fn power_of_two_reencoding(x: f32, y: f32, conventions_differ: bool) -> Option<f32> {
    if !(x.is_normal() && y.is_normal()) {
        return None;
    }
    let k = (y / x).abs().log2().round();
    if k == 0.0 || !k.is_finite() {
        return None;
    }
    let exact = x * 2f32.powi(k as i32);
    if !exact.is_normal() {
        return None;
    }
    let allowed = u32::from(conventions_differ);
    ulps_apart(exact, y)
        .filter(|&d| d <= allowed)
        .map(|_| exact)
}

/// Two optional scalars of sides in different conventions agree up to the ulp a reciprocal
/// costs (or are both absent).
fn scalar_converted(a: Option<f32>, b: Option<f32>) -> bool {
    match (a, b) {
        (Some(x), Some(y)) => same_scale(x, y),
        (None, None) => true,
        _ => false,
    }
}

/// What a unit with the same codes but other bytes is equal after (`UnitResult::equal_after`).
fn conversions(u: &UnitResult, relaid: bool, converted_scalars: Option<String>) -> String {
    let mut why = vec![];
    if relaid {
        let side = if u.swizzle_side_open {
            None
        } else if u.a_scales == Some(ScalesSeen::Swizzled) {
            Some(SideName::A)
        } else {
            Some(SideName::B)
        };
        why.push(layouts::relaid_reason(side));
    }
    why.extend(converted_scalars);
    why.join(" and ")
}

/// One side has a global scale and the other none: an NVFP4 weight cannot be dequantized
/// without it, whichever side lacks it. The absent tensor is named as that side's convention
/// names it (`weight_global_scale` in compressed-tensors, `weight_scale_2` in ModelOpt);
/// the other side's is listed as what the lacking side has no counterpart for (missing in
/// B, or extra in B).
fn missing_global_scale(u: &mut UnitResult, qa: &QRaw, qb: &QRaw) {
    let (lacking, lacking_raw, has_raw) = if qa.scale_2.is_none() {
        ("A", qa, qb)
    } else {
        ("B", qb, qa)
    };
    let has_side = if lacking == "A" { "B" } else { "A" };
    u.issue(
        IssueKind::MissingMember,
        format!(
            "{lacking} has no {} (`{}`): its NVFP4 codes cannot be dequantized without their \
             global scale; {has_side}'s {} is {:e}",
            lacking_raw.global_scale_member(),
            lacking_raw.scale_2_expected,
            has_raw.global_scale_member(),
            has_raw.scale_2.unwrap_or_default()
        ),
    );
    let present = has_raw.scale_2_name.clone();
    if lacking == "A" {
        u.extra_members.extend(present);
    } else {
        u.missing_members.extend(present);
    }
}

/// A unit's two quantized sides before their block scales' layouts are decided: A whole
/// and cut to B's geometry `rb` (`align`), B, and how each side's scales can be read.
struct Sides<'a, 's> {
    a_full: QMatrix<'a>,
    a: QMatrix<'a>,
    a_sc: &'s Scales<'a>,
    b: QMatrix<'a>,
    b_sc: &'s Scales<'a>,
    align: Align,
    rb: (usize, usize),
}

impl<'a> Sides<'a, '_> {
    /// The sides under the readings of their block scales that pair them
    /// ([`layouts::choose`]): (A whole, A cut, B). `u` records how each side's were read, and
    /// a note for a side read swizzled.
    fn pair(
        self,
        u: &mut UnitResult,
        packed_equal: bool,
    ) -> (QMatrix<'a>, QMatrix<'a>, QMatrix<'a>) {
        let Sides {
            a_full,
            a,
            a_sc,
            b,
            b_sc,
            align,
            rb,
        } = self;
        let a_head = swizzled_head(&a_full, a_sc, align, rb);
        let b_head = swizzled_head(&b, b_sc, Align::Same, rb);
        let reading = layouts::choose(
            Readings {
                stored: &a,
                swizzled_head: a_head.as_ref(),
            },
            Readings {
                stored: &b,
                swizzled_head: b_head.as_ref(),
            },
            packed_equal,
        );
        u.a_scales = Some(a_sc.seen);
        u.b_scales = Some(b_sc.seen);
        // the whole swizzled reading of the side that won only
        let a_full_swz = (reading == Reading::ASwizzled)
            .then(|| swizzled_reading(&a_full, a_sc))
            .flatten();
        let a_swz = a_full_swz.as_ref().and_then(|m| cut_to(m, align, rb));
        let b_swz = matches!(reading, Reading::BSwizzled | Reading::EitherSwizzled)
            .then(|| swizzled_reading(&b, b_sc))
            .flatten();
        let paired = match (reading, a_swz, a_full_swz, b_swz) {
            (Reading::ASwizzled, Some(a_swz), Some(a_full_swz), _) => {
                u.read_swizzled(SideName::A);
                (a_full_swz, a_swz, b)
            }
            (Reading::BSwizzled, _, _, Some(b_swz)) => {
                u.read_swizzled(SideName::B);
                (a_full, a, b_swz)
            }
            // the same values under either side's swizzled reading: B's, until its side is named
            (Reading::EitherSwizzled, _, _, Some(b_swz)) => {
                u.swizzle_side_open = true;
                (a_full, a, b_swz)
            }
            _ => (a_full, a, b),
        };
        for side in [SideName::A, SideName::B] {
            if u.scales(side) == Some(ScalesSeen::Swizzled) {
                u.notes.push(layouts::swizzle_note(Some(side)));
            }
        }
        if u.swizzle_side_open {
            u.notes.push(layouts::swizzle_note(None));
        }
        paired
    }
}

/// `m` (a side's whole matrix) cut to B's geometry `rb` as `align` says.
fn cut_to<'a>(m: &QMatrix<'a>, align: Align, rb: (usize, usize)) -> Option<QMatrix<'a>> {
    match align {
        Align::Same => Some(m.clone()),
        Align::Rows(r0) => m.rows_slice(r0, rb.0),
        Align::Cols(c0) => m.cols_slice(c0, rb.1),
    }
}

/// The first tile of `m` (a side's whole matrix, cut to B's geometry `rb` as `align` says)
/// under the swizzled reading of its block scales, where their size fits both layouts: what
/// decides the layout ([`layouts::choose`]).
fn swizzled_head<'a>(
    m: &QMatrix<'a>,
    sc: &Scales,
    align: Align,
    rb: (usize, usize),
) -> Option<QMatrix<'a>> {
    let n = rb.0.min(layouts::LAYOUT_ROWS);
    if align == Align::Same {
        let head = m.rows_slice(0, n)?;
        return Some(QMatrix {
            scales: std::borrow::Cow::Owned(sc.alternative_head(n)?),
            ..head
        });
    }
    // a TP shard: the rows or columns of the whole swizzled reading
    cut_to(&swizzled_reading(m, sc)?, align, rb)?.rows_slice(0, n)
}

/// `m` under the swizzled reading of its block scales, where their size fits both layouts
/// and nothing decided which.
fn swizzled_reading<'a>(m: &QMatrix<'a>, sc: &Scales) -> Option<QMatrix<'a>> {
    sc.alternative().map(|s| QMatrix {
        scales: std::borrow::Cow::Owned(s),
        ..m.clone()
    })
}

/// B's scalar is A's rounded to a 16-bit float (an engine that keeps scales in BF16 / FP16).
fn low_precision(a: f32, b: f32) -> &'static str {
    if half::bf16::from_f32(a).to_f32() == b {
        ": A's value rounded to BF16 (a scale kept in BF16 loses the low bits)"
    } else if half::f16::from_f32(a).to_f32() == b {
        ": A's value rounded to FP16 (a scale kept in FP16 loses the low bits)"
    } else {
        ""
    }
}

fn reciprocal_of(a: f32, b: f32) -> bool {
    let p = a as f64 * b as f64;
    (p - 1.0).abs() < 1e-5 && (a as f64 - 1.0).abs() > 1e-3
}

/// Metrics of B (test) against A (reference), both quantized, same geometry.
pub fn metrics_qq(a: &QMatrix, b: &QMatrix) -> Metrics {
    let rows_per = (CHUNK / a.cols.max(1)).max(1);
    let n_chunks = a.rows.div_ceil(rows_per);
    (0..n_chunks)
        .into_par_iter()
        .map(|c| {
            let (r0, r1) = (c * rows_per, ((c + 1) * rows_per).min(a.rows));
            let mut x = vec![0f32; (r1 - r0) * a.cols];
            let mut y = vec![0f32; (r1 - r0) * a.cols];
            a.dequant_rows(r0, r1, &mut x);
            b.dequant_rows(r0, r1, &mut y);
            Accum::over(&y, &x, r0 * a.cols)
        })
        .reduce(Accum::default, Accum::merge)
        .finish()
}

/// A float matrix view: `[rows, row_elems]` elements of `dtype`.
#[derive(Clone, Copy, Debug)]
pub struct DView<'a> {
    pub mat: Mat<'a>,
    pub dtype: Dtype,
}

impl DView<'_> {
    pub fn es(&self) -> usize {
        (self.dtype.bitsize() / 8).max(1)
    }
    pub fn row_elems(&self) -> usize {
        self.mat.row_bytes / self.es()
    }
    pub fn len(&self) -> usize {
        self.mat.rows * self.row_elems()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Decode elements `[s, s + out.len())` (row-major over the view).
    fn decode(&self, s: usize, out: &mut [f32]) -> bool {
        let (re, es) = (self.row_elems().max(1), self.es());
        let mut done = 0;
        while done < out.len() {
            let e = s + done;
            let (r, c) = (e / re, e % re);
            let n = (re - c).min(out.len() - done);
            let row = self.mat.row(r);
            if !decode_f32_into(
                self.dtype,
                &row[c * es..(c + n) * es],
                &mut out[done..done + n],
            ) {
                return false;
            }
            done += n;
        }
        true
    }
}

/// One side's values as a diff engine reads them: a quantized matrix (dequantized on the
/// way) or a float view, row-major, flat indices shared with the other side.
pub enum Values<'a, 'b> {
    Q(&'b QMatrix<'a>),
    D(DView<'a>),
}

impl Values<'_, '_> {
    pub fn len(&self) -> usize {
        match self {
            Values::Q(q) => q.rows * q.cols,
            Values::D(d) => d.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn fill(&self, s: usize, out: &mut [f32]) -> bool {
        match self {
            Values::D(d) => d.decode(s, out),
            Values::Q(q) => {
                // whole rows only: chunks are aligned to rows by the caller
                let r0 = s / q.cols;
                let r1 = (s + out.len()) / q.cols;
                q.dequant_rows(r0, r1, out);
                true
            }
        }
    }
}

/// Metrics of `b` (test) against `a` (reference) over equal element counts.
pub fn metrics_any(a: &Values, b: &Values) -> Option<Metrics> {
    let n = a.len();
    if n != b.len() {
        return None;
    }
    // align chunks to the rows of a quantized side
    let unit = match (a, b) {
        (Values::Q(q), _) | (_, Values::Q(q)) => q.cols.max(1),
        _ => 1,
    };
    let chunk = (CHUNK / unit).max(1) * unit;
    let n_chunks = n.div_ceil(chunk);
    let parts: Vec<Option<Accum>> = (0..n_chunks)
        .into_par_iter()
        .map(|c| {
            let s = c * chunk;
            let len = chunk.min(n - s);
            let mut x = vec![0f32; len];
            let mut y = vec![0f32; len];
            (a.fill(s, &mut x) && b.fill(s, &mut y)).then(|| Accum::over(&y, &x, s))
        })
        .collect();
    parts
        .into_iter()
        .try_fold(Accum::default(), |acc, p| p.map(|p| acc.merge(p)))
        .map(Accum::finish)
}

/// Resolve a side's raw quantized linear with its own geometry. Err says why not.
fn qmatrix<'a>(
    raw: &QRaw<'a>,
    rows: usize,
    cols: usize,
) -> Result<(QMatrix<'a>, super::view::Scales<'a>), LoadError> {
    let block = raw.format.block();
    if !cols.is_multiple_of(block) {
        return Err(LoadError::Unreadable(format!(
            "`{}`: K = {cols} is not a multiple of the {block} block",
            raw.weight_name
        )));
    }
    let sc = raw
        .scales
        .resolve(rows, cols / block)
        .map_err(|e| LoadError::Scales(format!("`{}`: {e}", raw.scale_name)))?;
    Ok((
        QMatrix {
            format: raw.format,
            rows,
            cols,
            packed: raw.packed,
            scales: sc.linear.clone(),
            scale_2: raw.scale_2.unwrap_or(1.0),
        },
        sc,
    ))
}

/// Compare two raws of one unit.
pub fn compare(
    name: &str,
    expert: Option<ExpertProj>,
    a: &Raw,
    b: &Raw,
    opts: &Options,
    a_scalars: &dyn Fn(ExpertProj) -> Option<AScalars>,
    engine: &dyn DiffEngine,
) -> Result<UnitResult> {
    let mut u = UnitResult::new(name, expert);
    match (a, b) {
        (Raw::Q(qa), Raw::Q(qb)) => compare_qq(&mut u, qa, qb, opts, a_scalars, engine),
        (Raw::D(da), Raw::D(db)) => compare_dd(&mut u, da, db, opts, engine),
        (Raw::Q(qa), Raw::D(db)) => compare_qd(&mut u, qa, db, opts, true, engine),
        (Raw::D(da), Raw::Q(qb)) => compare_qd(&mut u, qb, da, opts, false, engine),
    }
}

/// A loaded side's shape and dtype as the report gives them (a unit the other side could not
/// be loaded for still says what this side holds).
pub fn shape_and_dtype(raw: &Raw) -> (Vec<usize>, String) {
    match raw {
        Raw::Q(q) => q_shape_and_dtype(q),
        Raw::D(d) => (d.shape.clone(), dname(d.dtype)),
    }
}

fn q_shape_and_dtype(q: &QRaw) -> (Vec<usize>, String) {
    let dtype = q_dtype(q.weight_dtype, q.format, q.scale_dtype);
    (q.weight_shape.clone(), dtype)
}

/// A quantized unit's dtype as the report gives it: `U8 (nvfp4, scales F8_E4M3)`.
pub fn q_dtype(weight: Dtype, format: Format, scales: Dtype) -> String {
    format!("{} ({}, scales {scales:?})", dname(weight), format.name())
}

fn compare_qq(
    u: &mut UnitResult,
    qa: &QRaw,
    qb: &QRaw,
    opts: &Options,
    a_scalars: &dyn Fn(ExpertProj) -> Option<AScalars>,
    engine: &dyn DiffEngine,
) -> Result<UnitResult> {
    u.a = qa.weight_name.clone();
    u.b = qb.weight_name.clone();
    (u.a_shape, u.a_dtype) = q_shape_and_dtype(qa);
    (u.b_shape, u.b_dtype) = q_shape_and_dtype(qb);
    u.bytes = (qa.packed.len()
        + qa.scales.unit_len(qa.rows())
        + qb.packed.len()
        + qb.scales.unit_len(qb.rows())) as u64;
    let done = |u: &mut UnitResult| std::mem::replace(u, UnitResult::new("", None)).finish(false);
    if qa.format != qb.format {
        match ue8m0_tagged_e4m3(qa, qb) {
            Some(msg) => u.issue(IssueKind::Dtype, msg),
            None => u.issue(
                IssueKind::Format,
                format!("A is {}, B is {}", qa.format.name(), qb.format.name()),
            ),
        }
        return Ok(done(u));
    }
    // the same bytes under a signed dtype: torch's `>> 4` sign-extends the high nibble and
    // `.float()` reads -128..127, so whatever unpacks them by their dtype gets other codes
    if qa.weight_dtype != qb.weight_dtype {
        u.issue(
            IssueKind::Dtype,
            format!(
                "B's packed codes `{}` are {:?} where A's `{}` are {:?}: whatever unpacks them by \
                 their dtype (an int8 `>> 4` sign-extends the high nibble) reads other codes",
                qb.weight_name, qb.weight_dtype, qa.weight_name, qa.weight_dtype
            ),
        );
    }
    let (a_full, a_sc) = match qmatrix(qa, qa.rows(), qa.cols()) {
        Ok(v) => v,
        Err(e) => {
            u.issue(e.issue_kind(), format!("A: {e}"));
            return Ok(done(u));
        }
    };
    // a packed weight stored transposed ([K/2, N] bytes)
    let (ra, rb) = ((qa.rows(), qa.cols()), (qb.rows(), qb.cols()));
    if ra != rb && qb.packed.rows == qa.packed.row_bytes && qb.packed.row_bytes == qa.packed.rows {
        if qb.packed.transposed_of(&qa.packed, 1) {
            u.issue(
                IssueKind::Transposed,
                format!(
                    "B holds the packed weight transposed: {:?} is A's {:?} with rows and columns swapped",
                    qb.weight_shape, qa.weight_shape
                ),
            );
        } else {
            u.issue(
                IssueKind::Shape,
                format!(
                    "B {:?} vs A {:?}: transposed shape, different contents",
                    qb.weight_shape, qa.weight_shape
                ),
            );
        }
        return Ok(done(u));
    }
    let align = align2(ra, rb, opts.tp);
    let axis = match align {
        Some(Align::Rows(r0)) => {
            let slice = format!("rows {r0}..{}", r0 + rb.0);
            u.notes.push(format!("B is TP {slice} of A"));
            wrong_tp_axis(&u.name, 0, 2, &slice)
        }
        Some(Align::Cols(c0)) => {
            let slice = format!("columns (K) {c0}..{}", c0 + rb.1);
            u.notes.push(format!("B is TP {slice} of A"));
            wrong_tp_axis(&u.name, 1, 2, &slice)
        }
        _ => None,
    };
    if let Some(msg) = axis {
        u.issue(IssueKind::TpAxis, msg);
    }
    // a K slice that starts or ends inside a scale block: no rank of an engine can hold it
    if let (Some(Align::Cols(c0)), Some((r, n))) = (align, opts.tp) {
        let block = qa.format.block();
        if !c0.is_multiple_of(block) || !rb.1.is_multiple_of(block) {
            return Err(crate::error::Error::usage(format!(
                "--tp-size {n} does not fit A's `{}`: its K = {} holds {} scale blocks of {block}, \
                 which {n} TP ranks cannot split at block boundaries (rank {r}'s K slice \
                 {c0}..{} cuts a block; K/{block} must be a multiple of the TP size); B's `{}` \
                 holds K = {}",
                qa.weight_name,
                ra.1,
                ra.1 / block,
                c0 + rb.1,
                qb.weight_name,
                rb.1
            )));
        }
    }
    // B cut along K to another width than 1/n of A's, under a TP size that cannot split A's
    // K at block boundaries: bad usage too (it was a bare shape mismatch, exit 1)
    if let (None, Some((_, n))) = (align, opts.tp) {
        let block = qa.format.block();
        if ra.0 == rb.0 && rb.1 < ra.1 && !(ra.1 / block).is_multiple_of(n) {
            return Err(crate::error::Error::usage(format!(
                "--tp-size {n} does not fit A's `{}`: its K = {} holds {} scale blocks of {block}, \
                 which {n} TP ranks cannot split at block boundaries (K/{block} must be a \
                 multiple of the TP size); B's `{}` holds K = {}, {} of A's",
                qa.weight_name,
                ra.1,
                ra.1 / block,
                qb.weight_name,
                rb.1,
                frac(rb.1, ra.1)
            )));
        }
    }
    let (Some(a_m), Some(align)) = (align.and_then(|al| cut_to(&a_full, al, rb)), align) else {
        u.issue(
            IssueKind::Shape,
            format!(
                "B [{}, {}] vs A [{}, {}] (rows, K){}",
                rb.0,
                rb.1,
                ra.0,
                ra.1,
                shape_hint(&[ra.0, ra.1], &[rb.0, rb.1], opts.tp)
            ),
        );
        return Ok(done(u));
    };
    let (b_m, b_sc) = match qmatrix(qb, rb.0, rb.1) {
        Ok(v) => v,
        Err(e) => {
            u.issue(e.issue_kind(), format!("B: {e}"));
            return Ok(done(u));
        }
    };
    // the codes first: where they differ (found early, as a rule) the scales need not be
    // compared whole; then which side's block scales, if either, read swizzled
    let packed_equal = a_m.packed.same(&b_m.packed);
    let sides = Sides {
        a_full,
        a: a_m,
        a_sc: &a_sc,
        b: b_m,
        b_sc: &b_sc,
        align,
        rb,
    };
    let (a_full, a_m, mut b_m) = sides.pair(u, packed_equal);
    // A's whole matrix, kept for a TP shard: another rank's slice may be what B holds
    let a_whole = (ra != rb).then_some(a_full);
    let codes_equal = packed_equal && a_m.scales == b_m.scales;
    // U8 block scales holding A's scale values cast to integers (a value conversion where
    // the e4m3 bytes belong): 0.5 → 0, 3.5 → 3
    if !codes_equal
        && packed_equal
        && qa.scale_dtype == Dtype::F8_E4M3
        && matches!(qb.scale_dtype, Dtype::U8 | Dtype::I8)
        && a_m.scales.len() == b_m.scales.len()
        && a_m.scales.iter().zip(b_m.scales.iter()).all(|(&a, &b)| {
            // saturated or wrapped past 255 (torch's float → uint8 cast wraps)
            let v = crate::nvfp4::e4m3::decode(a);
            v as u8 == b || v as u32 as u8 == b
        })
    {
        u.issue(
            IssueKind::Scales,
            format!(
                "B's block scales `{}` ({:?}) hold A's scale values cast to integers (e.g. 0.5 → 0), \
                 not their e4m3 bytes: converted (`.to(torch.uint8)`) where reinterpreted (`.view(torch.uint8)`) belongs",
                qb.scale_name, qb.scale_dtype
            ),
        );
        return Ok(done(u));
    }
    // the same bytes under another FP8 format: every op that reads them by their dtype (a
    // torch dequantization, `.float()`, a kernel picked by dtype) decodes other values
    let fp8 = |d: Dtype| matches!(d, Dtype::F8_E4M3 | Dtype::F8_E5M2);
    if fp8(qa.scale_dtype) && fp8(qb.scale_dtype) && qa.scale_dtype != qb.scale_dtype {
        let how = if a_m.scales == b_m.scales {
            "the bytes are the same, but read as their dtype they are other values (the e4m3 \
             byte 0x38, 1.0, is 0.5 as e5m2)"
        } else {
            "the scale values were converted (other bytes: kernels read the e4m3 bytes)"
        };
        u.issue(
            IssueKind::Dtype,
            format!(
                "B's block scales `{}` are {:?} where A's are {:?}: {how}",
                qb.scale_name, qb.scale_dtype, qa.scale_dtype
            ),
        );
    }
    // the same codes under another one-byte dtype (U8 where F8_E4M3 belongs): equal, and
    // worth a note, since a loader that copies by value where it should reinterpret changes them
    if qa.scale_dtype != qb.scale_dtype
        && qa.scale_dtype.bitsize() == 8
        && qb.scale_dtype.bitsize() == 8
    {
        u.scale_dtype_differs = Some((qa.scale_dtype, qb.scale_dtype, qb.scale_name.clone()));
    }
    // global scale
    let (sa, sb) = (qa.scale_2, qb.scale_2);
    u.scales_2 = sa.zip(sb);
    // weight_scale_2 and input_scale exchanged (both dequant-direction scalars, one per
    // linear: a loader that maps them by position)
    let swapped = match (sa, sb, qa.input_scale, qb.input_scale) {
        (Some(wa), Some(wb), Some(ia), Some(ib)) => {
            !same_scale(wa, ia) && same_scale(wb, ia) && same_scale(ib, wa)
        }
        _ => false,
    };
    let mut scale_ok = true;
    let mut conv_ulp = false;
    // B's global scale is another value (a re-quantization, or a wrong scalar; an issue of its
    // own below unless the values come out identical)
    let mut gs_differs = false;
    match (sa, sb) {
        (Some(x), Some(y)) if x.to_bits() == y.to_bits() => {}
        (Some(x), Some(y)) if same_scale(x, y) => {
            if qa.reciprocal_names != qb.reciprocal_names {
                conv_ulp = true;
                u.notes.push("global scales stored in different conventions (weight_scale_2 vs weight_global_scale): equal after conversion".into());
            } else {
                u.notes.push(format!(
                    "weight_scale_2 differs in the last bits: B {y:e}, A {x:e}"
                ));
            }
        }
        (Some(x), Some(y)) => {
            scale_ok = false;
            gs_differs = true;
            // the named conventions only explain a unit whose codes are A's: with other codes
            // the scale is one more symptom of holding another tensor (a swap, a permutation)
            let gate = u
                .expert
                .filter(|e| e.proj == Proj::Up && codes_equal)
                .and_then(|e| {
                    a_scalars(ExpertProj {
                        proj: Proj::Gate,
                        ..e
                    })
                });
            if swapped {
                u.issue(
                    IssueKind::Scale2InputScaleSwapped,
                    format!(
                        "weight_scale_2 and input_scale swapped: B's weight_scale_2 {y:e} is A's input_scale, \
                         B's input_scale {:e} is A's weight_scale_2 ({x:e})",
                        qb.input_scale.unwrap_or_default()
                    ),
                );
            } else if let Some(g) = gate.and_then(|g| g.scale_2).filter(|&g| same_scale(g, y)) {
                let how = if qb.scale_2_shared == Shared::W13Shared {
                    "w13_weight_scale_2 holds one value per expert"
                } else {
                    "both w13_weight_scale_2 entries hold the gate's"
                };
                u.issue(
                    IssueKind::Scale2GateOnly,
                    format!(
                        "up_proj weight_scale_2: B {y:e} is the gate's ({g:e}); A's up is {x:e} — {how}: \
                         vLLM keeps only w1's weight_scale_2 for w13, so up_proj dequantizes off by ×{:.4}",
                        y / x
                    ),
                );
            } else if codes_equal && reciprocal_of(x, y) && qb.reciprocal_names {
                // B's own tensor is a weight_global_scale: it holds 1/y = A's weight_scale_2
                u.issue(
                    IssueKind::Scale2Flipped,
                    format!(
                        "weight_global_scale: B stores {:e} = A's weight_scale_2 ({x:e}) under compressed-tensors' \
                         weight_global_scale name, which holds gs = 1/weight_scale_2 — the convention is flipped",
                        1.0 / y
                    ),
                );
            } else if codes_equal && reciprocal_of(x, y) {
                u.issue(
                    IssueKind::Scale2Flipped,
                    format!(
                        "weight_scale_2: B {y:e} = 1/A ({x:e}): B holds the quant-direction gs (compressed-tensors' \
                         weight_global_scale) as weight_scale_2 — the convention is flipped"
                    ),
                );
            } else {
                u.scalars_differ.push((
                    "weight_scale_2",
                    x,
                    y,
                    qb.scale_2_name.clone().unwrap_or_default(),
                ));
                u.issue(
                    IssueKind::Scale2,
                    format!(
                        "weight_scale_2: B {y:e}, A {x:e} (×{:.6}){}",
                        y / x,
                        low_precision(x, y)
                    ),
                );
            }
        }
        (Some(_), None) | (None, Some(_)) => {
            scale_ok = false;
            missing_global_scale(u, qa, qb);
        }
        (None, None) => {}
    }
    // input scale
    let mut input_ok = true;
    match (qa.input_scale, qb.input_scale) {
        (Some(x), Some(y)) if same_scale(x, y) => {}
        (Some(x), Some(y)) => {
            let other = u.expert.filter(|e| e.proj != Proj::Down).and_then(|e| {
                a_scalars(ExpertProj {
                    proj: if e.proj == Proj::Gate {
                        Proj::Up
                    } else {
                        Proj::Gate
                    },
                    ..e
                })
            });
            let max = other.and_then(|o| o.input_scale).map(|o| o.max(x));
            if swapped {
                // named with weight_scale_2
                input_ok = false;
            } else if qb.input_shared == Shared::W13Shared && max.is_some_and(|m| same_scale(m, y))
            {
                u.notes.push(format!(
                    "input_scale: B holds max(gate, up) = {y:e} for w13 (as vLLM does: both GEMMs quantize the same input); A's own is {x:e}"
                ));
            } else if reciprocal_of(x, y) && qb.reciprocal_names {
                input_ok = false;
                u.issue(
                    IssueKind::InputScaleFlipped,
                    format!(
                        "input_global_scale: B stores {:e} = A's input_scale ({x:e}) under compressed-tensors' \
                         input_global_scale name, which holds 1/input_scale — the convention is flipped",
                        1.0 / y
                    ),
                );
            } else if reciprocal_of(x, y) {
                input_ok = false;
                u.issue(
                    IssueKind::InputScaleFlipped,
                    format!("input_scale: B {y:e} = 1/A ({x:e}): a gs stored as input_scale — the convention is flipped"),
                );
            } else {
                input_ok = false;
                u.scalars_differ.push((
                    "input_scale",
                    x,
                    y,
                    qb.input_name.clone().unwrap_or_default(),
                ));
                u.issue(
                    IssueKind::InputScale,
                    format!("input_scale: B {y:e}, A {x:e}"),
                );
            }
        }
        (Some(_), None) => {
            input_ok = false;
            u.issue(IssueKind::MissingMember, "B has no input_scale (A does)");
            u.missing_members.extend(qa.input_name.clone());
        }
        (None, Some(_)) => u.notes.push("B has an input_scale, A has none".into()),
        (None, None) => {}
    }
    let conventions_differ = qa.reciprocal_names != qb.reciprocal_names;
    // scalars stored in other conventions are other bytes, whatever the values come out as
    // the same values in another float dtype (F64 where F32 belongs) are other bytes too
    let dtypes_differ = qa.scalar_dtypes != qb.scalar_dtypes;
    let same_values = sa.map(f32::to_bits) == sb.map(f32::to_bits)
        && qa.input_scale.map(f32::to_bits) == qb.input_scale.map(f32::to_bits);
    let scalars_bitwise = !conventions_differ && !dtypes_differ && same_values;
    let scalars_converted = (conventions_differ
        && (sa.map(f32::to_bits) == sb.map(f32::to_bits) || conv_ulp)
        && scalar_converted(qa.input_scale, qb.input_scale))
        || (!conventions_differ && dtypes_differ && same_values);
    // one side's scales read unswizzled, the other's as stored: other bytes, the same codes
    let relaid = u.swizzle_side_open
        || (u.a_scales == Some(ScalesSeen::Swizzled)) != (u.b_scales == Some(ScalesSeen::Swizzled));
    let same_codes = codes_equal && scale_ok && input_ok;
    u.bitwise_equal = same_codes && scalars_bitwise && !relaid;
    if same_codes && !u.bitwise_equal && (scalars_bitwise || scalars_converted) {
        let scalars = (!scalars_bitwise).then(|| {
            if conventions_differ {
                "converting the global scales between conventions (weight_scale_2 = 1/weight_global_scale)"
                    .to_string()
            } else {
                let d = |t: (Option<Dtype>, Option<Dtype>)| {
                    [t.0, t.1]
                        .iter()
                        .flatten()
                        .map(|d| format!("{d:?}"))
                        .collect::<Vec<_>>()
                        .join("/")
                };
                format!(
                    "reading B's {} global/input scales as A's {} (the same values in another dtype)",
                    d(qb.scalar_dtypes),
                    d(qa.scalar_dtypes)
                )
            }
        });
        u.equal_after = Some(conversions(u, relaid, scalars));
    }
    if codes_equal && scale_ok {
        // identical codes and scales (the global scale up to the ulp a convention's reciprocal
        // costs): the values are identical; no need to dequantize
        return Ok(std::mem::replace(u, UnitResult::new("", None)).finish(true));
    }
    // a global scale re-encoded by a power of two (the block scales making up for it), in
    // another convention whose reciprocal costs its last bit: the values are compared under
    // the exact power of two, so that the ulp does not read as another encoding
    let reencoded = match (sa, sb) {
        (Some(x), Some(y)) if gs_differs => power_of_two_reencoding(x, y, conventions_differ),
        _ => None,
    };
    if let Some(exact) = reencoded {
        b_m.scale_2 = exact;
    }
    let Some((m, counted)) = engine.metrics_counted(&a_m, &b_m, !gs_differs)? else {
        u.issue(
            IssueKind::Unreadable,
            "the dequantized sides differ in length",
        );
        return Ok(done(u));
    };
    let identical = m.max_abs_err == 0.0 && m.nan_count + m.inf_count == 0;
    if identical && gs_differs && u.issues.iter().all(|i| i.kind == IssueKind::Scale2) {
        // another global scale that B's block scales make up for, value for value
        u.issues.clear();
        u.notes.push(format!(
            "B re-encodes A's values: weight_scale_2 ×{:.6} with the block scales making up for \
             it; the dequantized values are identical{}",
            sb.zip(sa).map_or(1.0, |(y, x)| y / x),
            match (reencoded, sb) {
                (Some(exact), Some(y)) if exact.to_bits() != y.to_bits() => format!(
                    " (B's global scale {y:e} is 1 ulp from the exact {exact:e}: the reciprocal \
                     of its other convention)"
                ),
                _ => String::new(),
            }
        ));
    }
    // under A's global scale a value that differs is another code or block scale: a copy
    // never changes one, and a re-quantization would have moved the global scale too. Under
    // another one, values within --min-cosine are that scale's re-quantization, not another
    // tensor: the diagnoses below are for the rest
    let close = identical || (gs_differs && m.passes(opts.min_cosine));
    // the codes first: their test stops at the first byte that is not swapped
    if !codes_equal
        && !close
        && a_m.packed.nibble_swapped_of(&b_m.packed)
        && a_m.scales == b_m.scales
    {
        u.issue(
            IssueKind::NibblesSwapped,
            format!(
                "B is A with the two FP4 codes of every byte exchanged (element 2i in the high \
                 nibble; the layout puts it in the low one): cosine {:.6}",
                m.cosine
            ),
        );
    } else if let Some((o, n, what)) = (!codes_equal && !close)
        .then_some(())
        .and(opts.tp)
        .zip(a_whole.as_ref())
        .and_then(|((r, n), whole)| {
            // B's scales of a size both layouts fit, read linear for want of a match: the
            // other rank's slice may match under the swizzled reading
            let bs = if u.b_scales == Some(ScalesSeen::Ambiguous) {
                readings(qb)
            } else {
                vec![b_m.clone()]
            };
            bs.iter()
                .find_map(|b| other_tp_rank(whole, b, r, n))
                .map(|(o, w)| (o, n, w))
        })
    {
        u.issue(
            IssueKind::TpRank,
            format!(
                "B holds TP rank {o}'s slice of A ({what}), not rank {}'s of {n}: the engine loaded \
                 another rank's shard, or the dump is rank {o}'s",
                opts.tp.map_or(0, |t| t.0)
            ),
        );
    } else if let Some((d, what)) = (packed_equal && !codes_equal && !close)
        .then(|| scales_shifted(a_whole.as_ref().unwrap_or(&a_m), &b_m, align))
        .flatten()
    {
        u.issue(
            IssueKind::ScalesShifted,
            format!(
                "B's block scales are A's shifted by {d:+} column: B's scale block j holds A's block \
                 j{d:+}{what}, while its packed codes are A's — a scale slice cut one block off (its K \
                 offset miscounted); {}",
                values_differ(&m, a_m.cols)
            ),
        );
    } else if !codes_equal && !close {
        u.issue(
            IssueKind::Values,
            format!(
                "{}{}{}{}",
                values_differ(&m, a_m.cols),
                if gs_differs {
                    String::new()
                } else {
                    blocks_differ(&a_m, &b_m, counted)
                },
                all_zero(&b_m),
                if m.nan_count + m.inf_count > 0 {
                    format!(
                        ", {} NaN / {} Inf in B{}",
                        m.nan_count,
                        m.inf_count,
                        nan_scale(&b_m, b_sc.seen == ScalesSeen::Swizzled)
                    )
                } else {
                    String::new()
                }
            ),
        );
    }
    u.metrics = Some(m);
    Ok(std::mem::replace(u, UnitResult::new("", None)).finish(close))
}

/// "values differ: cosine …, max_abs_err …", and where A (the reference) is what made the
/// figures NaN or infinite, its first such value (`Accum::takes` ranks a NaN difference
/// first; B's own NaN/Inf are counted apart): a reference that holds NaN points at itself.
pub fn values_differ(m: &Metrics, cols: usize) -> String {
    let mut s = format!(
        "values differ: cosine {:.6}, max_abs_err {:.3e}",
        m.cosine, m.max_abs_err
    );
    if let Some(i) = m.max_abs_err_index.filter(|_| cols > 0) {
        if m.max_abs_err.is_finite() {
            s += &format!(" at row {}, column {}", i / cols, i % cols);
        } else if m.nan_count + m.inf_count == 0 {
            let what = if m.max_abs_err.is_nan() {
                "NaN"
            } else {
                "infinite"
            };
            s += &format!(
                "; A (the reference) is {what} at row {}, column {}",
                i / cols,
                i % cols
            );
        }
    }
    s
}

/// "; N of M blocks differ under the same global scale, the first at row r, block j (its
/// codes / its scale)": where values differ though the global scale is A's (MXFP4: none).
/// `counted`: the engine's count, made in its pass over the values (`None`: counted here).
fn blocks_differ(a: &QMatrix, b: &QMatrix, counted: Option<BlockCount>) -> String {
    let Some(BlockCount {
        n,
        first: Some((r, j, codes, scale)),
        codes_differ,
    }) = counted.or_else(|| BlockCount::rows(a, b, 0, a.rows))
    else {
        return String::new();
    };
    let all = a.rows * a.kb();
    // the codes A's and (nearly) every differing block scale A's times one factor, over at
    // least half the blocks: the block scales were rescaled at load (a saturated or rounded
    // few aside), not a stray byte
    let rescaled = match (!codes_differ && n * 2 >= all)
        .then(|| blocks::scale_factor(a, b))
        .flatten()
    {
        Some((f, same_factor)) if f != 1.0 && same_factor * 10 >= n * 9 => {
            format!(
            ": B's block scales are A's ×{f} ({same_factor} of the {n} differing blocks; the packed \
             codes are A's) — the block scales were rescaled at load"
            )
        }
        _ => String::new(),
    };
    let what = match (codes, scale) {
        (true, true) => "codes and scale",
        (true, false) => "codes",
        _ => "scale",
    };
    // MXFP4 has no global scale to stay the same
    let under = match a.format {
        Format::Nvfp4 => {
            " under the same global scale (a copy changes none; a re-quantization would have \
             moved the global scale)"
        }
        Format::Mxfp4 => " (a copy changes none)",
    };
    format!("; {n} of {all} blocks differ{under}, the first at row {r}, block {j} (its {what}){rescaled}")
}

/// B dequantizes to zeros everywhere (every code ±0, every block scale 0, or a zero global
/// scale): a tensor the loader allocated and never filled, not one with other values.
fn all_zero(b: &QMatrix) -> &'static str {
    let codes = (0..b.packed.rows).all(|r| b.packed.row(r).iter().all(|&x| x & 0x77 == 0));
    let scales = b.scales.iter().all(|&x| x & 0x7F == 0);
    if b.scale_2 == 0.0 {
        ": B's global scale is 0, so every value is zero (never loaded?)"
    } else if codes || (b.format == crate::nvfp4::Format::Nvfp4 && scales) {
        ": B is all zeros (every code or every block scale 0): the tensor was allocated and never loaded"
    } else {
        ""
    }
}

/// Where B's NaN comes from when a block scale holds the e4m3 NaN code (`0x7F` / `0xFF`).
fn nan_scale(b: &QMatrix, swizzled: bool) -> String {
    if b.format != crate::nvfp4::Format::Nvfp4 {
        return String::new();
    }
    let kb = b.kb().max(1);
    let nans: Vec<usize> = (0..b.scales.len())
        .filter(|&i| crate::nvfp4::e4m3::is_nan(b.scales[i]))
        .collect();
    match nans.first() {
        Some(&i) => format!(
            ": {} block scale(s) hold the e4m3 NaN code, first at row {} block {} (0x{:02X}{})",
            nans.len(),
            i / kb,
            i % kb,
            b.scales[i],
            if swizzled { ", after unswizzling" } else { "" }
        ),
        None => String::new(),
    }
}

/// Both units quantized, as matrices at their own geometry; `None` otherwise.
fn both_q<'a>(a: &Raw<'a>, b: &Raw<'a>) -> Option<(QMatrix<'a>, QMatrix<'a>)> {
    let (Raw::Q(qa), Raw::Q(qb)) = (a, b) else {
        return None;
    };
    let (am, _) = qmatrix(qa, qa.rows(), qa.cols()).ok()?;
    let (bm, _) = qmatrix(qb, qb.rows(), qb.cols()).ok()?;
    Some((am, bm))
}

/// A side's matrix under each reading its block scales allow: one, or two when their size
/// fits both layouts and nothing decided which (linear first).
fn readings<'a>(q: &QRaw<'a>) -> Vec<QMatrix<'a>> {
    let Ok((m, sc)) = qmatrix(q, q.rows(), q.cols()) else {
        return vec![];
    };
    let swizzled = sc.alternative().map(|s| QMatrix {
        scales: std::borrow::Cow::Owned(s),
        ..m.clone()
    });
    std::iter::once(m).chain(swizzled).collect()
}

/// B's codes are rows `[r0, r0 + B's rows)` of A, at any offset (not only B's TP rank's),
/// under either reading of B's scales.
pub fn holds_rows(a: &Raw, b: &Raw, r0: usize) -> bool {
    let (Raw::Q(qa), Raw::Q(qb)) = (a, b) else {
        return false;
    };
    let Some(am) = own_q(qa) else {
        return false;
    };
    readings(qb).iter().any(|bm| {
        am.cols == bm.cols && am.rows_slice(r0, bm.rows).is_some_and(|s| s.same_codes(bm))
    })
}

/// Two quantized units of one geometry share their packed codes (`Part::Codes`) or their
/// block scales as stored (`Part::Scales`); false when either is not quantized or the
/// geometries differ.
pub fn same_part(a: &Raw, b: &Raw, part: Part) -> bool {
    both_q(a, b).is_some_and(|(am, bm)| {
        (am.format, am.rows, am.cols) == (bm.format, bm.rows, bm.cols)
            && match part {
                Part::Codes => am.packed.same(&bm.packed),
                Part::Scales => am.scales == bm.scales,
            }
    })
}

/// What [`same_part`] compares.
#[derive(Clone, Copy)]
pub enum Part {
    Codes,
    Scales,
}

/// The other TP rank (of `n`, not `rank`) whose slice of A has B's codes, and the slice.
/// B's block scales A's (`whole`, cut as `align` says) shifted by `d` = ±1 column in every
/// row, over every column whose source lies inside A: `(d, where)`. Its packed codes are
/// checked equal by the caller.
fn scales_shifted(whole: &QMatrix, b: &QMatrix, align: Align) -> Option<(i64, String)> {
    let (kb_a, kb_b) = (whole.kb(), b.kb());
    let block = whole.format.block();
    let (r0, c0) = match align {
        Align::Same => (0, 0),
        Align::Rows(r0) => (r0, 0),
        Align::Cols(c0) => (0, c0 / block),
    };
    if r0 + b.rows > whole.rows || whole.format != b.format || kb_a < 2 {
        return None;
    }
    [-1i64, 1].into_iter().find_map(|d| {
        let cols: Vec<(usize, usize)> = (0..kb_b)
            .filter_map(|j| {
                let s = c0 as i64 + j as i64 + d;
                (s >= 0 && (s as usize) < kb_a).then_some((j, s as usize))
            })
            .collect();
        if cols.len() + 1 < kb_b || cols.is_empty() {
            return None;
        }
        let mut moved = false;
        for r in 0..b.rows {
            let (sa, sb) = (whole.scale_row(r0 + r), b.scale_row(r));
            for &(j, s) in &cols {
                if sb[j] != sa[s] {
                    return None;
                }
                moved |= sb[j] != sa[c0 + j];
            }
        }
        let what = if c0 > 0 || kb_a != kb_b {
            format!(
                " (B's scale columns are A's {}..{}, where {}..{} belong)",
                (c0 as i64 + d).max(0),
                (c0 + kb_b) as i64 + d,
                c0,
                c0 + kb_b
            )
        } else {
            String::new()
        };
        moved.then_some((d, what))
    })
}

fn other_tp_rank(a: &QMatrix, b: &QMatrix, rank: usize, n: usize) -> Option<(usize, String)> {
    let (ra, rb) = ((a.rows, a.cols), (b.rows, b.cols));
    (0..n).filter(|&o| o != rank).find_map(|o| {
        let (slice, what) = match align2(ra, rb, Some((o, n)))? {
            Align::Rows(r0) => (a.rows_slice(r0, rb.0)?, format!("rows {r0}..{}", r0 + rb.0)),
            Align::Cols(c0) => (
                a.cols_slice(c0, rb.1)?,
                format!("columns (K) {c0}..{}", c0 + rb.1),
            ),
            Align::Same => return None,
        };
        slice.same_codes(b).then_some((o, what))
    })
}

fn dense_view<'a>(d: &DRaw<'a>) -> Option<DView<'a>> {
    let es = (d.dtype.bitsize() / 8).max(1);
    let (rows, cols) = match d.shape.as_slice() {
        [] => (1, 1),
        [n] => (1, *n),
        s => (s[..s.len() - 1].iter().product(), s[s.len() - 1]),
    };
    Some(DView {
        mat: Mat::dense(d.bytes, rows, cols * es)?,
        dtype: d.dtype,
    })
}

/// A's view restricted to B's TP shard: split along the one dim where A is `size` times B.
fn shard_view<'a>(
    a: &DRaw<'a>,
    b_shape: &[usize],
    tp: Option<(usize, usize)>,
) -> Option<(DView<'a>, String)> {
    let (r, n) = tp?;
    if a.shape.len() != b_shape.len() {
        return None;
    }
    let diff: Vec<usize> = (0..a.shape.len())
        .filter(|&i| a.shape[i] != b_shape[i])
        .collect();
    let [d] = diff[..] else { return None };
    if a.shape[d] != n * b_shape[d] {
        return None;
    }
    let es = (a.dtype.bitsize() / 8).max(1);
    let outer: usize = a.shape[..d].iter().product();
    let inner: usize = a.shape[d + 1..].iter().product::<usize>() * es;
    let full = Mat::dense(a.bytes, outer, a.shape[d] * inner)?;
    let len = b_shape[d];
    let mat = full.slice_cols(r * len * inner, len * inner)?;
    Some((
        DView {
            mat,
            dtype: a.dtype,
        },
        format!(
            "B is TP slice {}..{} of dim {d} of A",
            r * len,
            (r + 1) * len
        ),
    ))
}

/// `UnitResult::equal_after` of a plain tensor stored in another dtype with the same values.
fn dtype_conversion(a: Dtype, b: Dtype) -> String {
    format!("reading B's {b:?} as A's {a:?} (the same values in another dtype)")
}

fn is_int(d: Dtype) -> bool {
    matches!(
        d,
        Dtype::I8
            | Dtype::U8
            | Dtype::I16
            | Dtype::U16
            | Dtype::I32
            | Dtype::U32
            | Dtype::I64
            | Dtype::U64
            | Dtype::BOOL
    )
}

fn ints(d: &DView) -> Option<Vec<i64>> {
    let es = d.es();
    let mut v = Vec::with_capacity(d.len());
    for r in 0..d.mat.rows {
        for c in d.mat.row(r).chunks_exact(es) {
            v.push(match (d.dtype, es) {
                (Dtype::I8, _) => c[0] as i8 as i64,
                (Dtype::U8 | Dtype::BOOL, _) => c[0] as i64,
                (Dtype::I16, _) => i16::from_le_bytes([c[0], c[1]]) as i64,
                (Dtype::U16, _) => u16::from_le_bytes([c[0], c[1]]) as i64,
                (Dtype::I32, _) => i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64,
                (Dtype::U32, _) => u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64,
                (Dtype::I64 | Dtype::U64, _) => {
                    i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]])
                }
                _ => return None,
            });
        }
    }
    Some(v)
}

fn compare_dd(
    u: &mut UnitResult,
    da: &DRaw,
    db: &DRaw,
    opts: &Options,
    engine: &dyn DiffEngine,
) -> Result<UnitResult> {
    u.a = da.name.clone();
    u.b = db.name.clone();
    u.a_shape = da.shape.clone();
    u.b_shape = db.shape.clone();
    u.a_dtype = dname(da.dtype);
    u.b_dtype = dname(db.dtype);
    u.bytes = (da.bytes.len() + db.bytes.len()) as u64;
    let done = |u: &mut UnitResult, close: bool| {
        std::mem::replace(u, UnitResult::new("", None)).finish(close)
    };
    let (Some(va_full), Some(vb)) = (dense_view(da), dense_view(db)) else {
        u.issue(IssueKind::Unreadable, "bytes do not fill the shape");
        return Ok(done(u, false));
    };
    let va = if da.shape == db.shape {
        va_full
    } else if let Some((v, note)) = shard_view(da, &db.shape, opts.tp) {
        let r = opts.tp.map_or(0, |t| t.0);
        if let Some(d) = (0..da.shape.len()).find(|&i| da.shape[i] != db.shape[i]) {
            let len = db.shape[d];
            let slice = format!("slice {}..{} of dim {d}", r * len, (r + 1) * len);
            if let Some(msg) = wrong_tp_axis(&u.name, d, da.shape.len(), &slice) {
                u.issue(IssueKind::TpAxis, msg);
            }
        }
        u.notes.push(note);
        v
    } else if da.shape.len() == 2 && db.shape == [da.shape[1], da.shape[0]] {
        let transposed = if da.dtype == db.dtype {
            vb.mat.transposed_of(&va_full.mat, vb.es())
        } else {
            false
        };
        u.issue(
            if transposed {
                IssueKind::Transposed
            } else {
                IssueKind::Shape
            },
            if transposed {
                format!("B holds A transposed: {:?} vs {:?}", db.shape, da.shape)
            } else {
                format!(
                    "B {:?} vs A {:?}: transposed shape, different contents",
                    db.shape, da.shape
                )
            },
        );
        return Ok(done(u, false));
    } else {
        u.issue(
            IssueKind::Shape,
            format!(
                "B {:?} vs A {:?}{}",
                db.shape,
                da.shape,
                shape_hint(&da.shape, &db.shape, opts.tp)
            ),
        );
        return Ok(done(u, false));
    };
    if da.dtype == db.dtype && va.mat.same(&vb.mat) {
        u.bitwise_equal = true;
        return Ok(done(u, true));
    }
    // a TP shard with another rank's bytes
    if let Some((r, n)) = opts
        .tp
        .filter(|_| da.shape != db.shape && da.dtype == db.dtype)
    {
        let other = (0..n).filter(|&o| o != r).find_map(|o| {
            let (v, note) = shard_view(da, &db.shape, Some((o, n)))?;
            v.mat.same(&vb.mat).then_some((o, note))
        });
        if let Some((o, note)) = other {
            u.issue(
                IssueKind::TpRank,
                format!(
                    "B holds TP rank {o}'s slice of A ({}), not rank {r}'s of {n}: the engine loaded \
                     another rank's shard, or the dump is rank {o}'s",
                    note.trim_start_matches("B is TP ")
                ),
            );
            return Ok(done(u, false));
        }
    }
    if is_int(da.dtype) || is_int(db.dtype) {
        match (ints(&va), ints(&vb)) {
            (Some(x), Some(y)) if x.len() == y.len() => {
                let diff: Vec<usize> = (0..x.len()).filter(|&i| x[i] != y[i]).collect();
                if let Some(&i) = diff.first() {
                    u.issue(
                        IssueKind::Values,
                        format!(
                            "{} of {} integers differ; first at flat index {i}: B {}, A {}",
                            diff.len(),
                            x.len(),
                            y[i],
                            x[i]
                        ),
                    );
                } else {
                    u.notes.push(format!(
                        "dtype differs (A {:?}, B {:?}), values identical",
                        da.dtype, db.dtype
                    ));
                    u.equal_after = Some(dtype_conversion(da.dtype, db.dtype));
                    return Ok(done(u, true));
                }
            }
            _ => u.issue(
                IssueKind::Dtype,
                format!("A {:?}, B {:?}: not comparable", da.dtype, db.dtype),
            ),
        }
        return Ok(done(u, false));
    }
    let Some(m) = engine.metrics(&Values::D(va), &Values::D(vb))? else {
        u.issue(
            IssueKind::Dtype,
            format!(
                "A {:?}, B {:?}: a dtype this tool does not decode",
                da.dtype, db.dtype
            ),
        );
        return Ok(done(u, false));
    };
    let identical = m.max_abs_err == 0.0 && m.nan_count + m.inf_count == 0;
    if da.dtype != db.dtype {
        if identical {
            u.notes.push(format!(
                "dtype differs (A {:?}, B {:?}), values identical",
                da.dtype, db.dtype
            ));
            u.metrics = Some(m);
            u.equal_after = Some(dtype_conversion(da.dtype, db.dtype));
            return Ok(done(u, true));
        }
        u.issue(
            IssueKind::Dtype,
            format!(
                "B holds {:?} where A holds {:?}: values changed (max_abs_err {:.3e}, cosine {:.6})",
                db.dtype, da.dtype, m.max_abs_err, m.cosine
            ),
        );
    } else if !identical {
        // one dtype on both sides: a load copies the values bit for bit, so any that differ
        // were changed (a conversion would have changed the dtype)
        u.issue(
            IssueKind::Values,
            format!(
                "{} (both sides {:?}: a copy changes no value)",
                // B's rows: A's TP slice along dim 0 is one flat row
                values_differ(&m, vb.row_elems()),
                da.dtype
            ),
        );
    }
    let close = m.passes(opts.min_cosine);
    u.metrics = Some(m);
    Ok(done(u, close))
}

/// One side quantized, the other a float tensor (e.g. a BF16 engine that dequantized at load).
fn compare_qd(
    u: &mut UnitResult,
    q: &QRaw,
    d: &DRaw,
    opts: &Options,
    q_is_a: bool,
    engine: &dyn DiffEngine,
) -> Result<UnitResult> {
    let (qn, qs, qd) = (
        q.weight_name.clone(),
        q.weight_shape.clone(),
        format!("{} ({})", dname(q.weight_dtype), q.format.name()),
    );
    let (dn, ds, dd) = (d.name.clone(), d.shape.clone(), dname(d.dtype));
    if q_is_a {
        (u.a, u.a_shape, u.a_dtype, u.b, u.b_shape, u.b_dtype) = (qn, qs, qd, dn, ds, dd);
    } else {
        (u.a, u.a_shape, u.a_dtype, u.b, u.b_shape, u.b_dtype) = (dn, ds, dd, qn, qs, qd);
    }
    u.bytes = (q.packed.len() + q.scales.unit_len(q.rows()) + d.bytes.len()) as u64;
    let done = |u: &mut UnitResult, close: bool| {
        std::mem::replace(u, UnitResult::new("", None)).finish(close)
    };
    let (qm, _) = match qmatrix(q, q.rows(), q.cols()) {
        Ok(v) => v,
        Err(e) => {
            u.issue(
                e.issue_kind(),
                format!("{}: {e}", if q_is_a { "A" } else { "B" }),
            );
            return Ok(done(u, false));
        }
    };
    let Some(dv) = dense_view(d) else {
        u.issue(IssueKind::Unreadable, "bytes do not fill the shape");
        return Ok(done(u, false));
    };
    let (rq, rd) = ((qm.rows, qm.cols), (dv.mat.rows, dv.row_elems()));
    // only A may be wider (B is the shard)
    let qm = match if q_is_a {
        align2(rq, rd, opts.tp)
    } else {
        (rq == rd).then_some(Align::Same)
    } {
        Some(Align::Same) => Some(qm),
        Some(Align::Rows(r0)) => {
            let slice = format!("rows {r0}..{}", r0 + rd.0);
            if let Some(msg) = wrong_tp_axis(&u.name, 0, 2, &slice) {
                u.issue(IssueKind::TpAxis, msg);
            }
            qm.rows_slice(r0, rd.0)
        }
        Some(Align::Cols(c0)) => {
            let slice = format!("columns (K) {c0}..{}", c0 + rd.1);
            if let Some(msg) = wrong_tp_axis(&u.name, 1, 2, &slice) {
                u.issue(IssueKind::TpAxis, msg);
            }
            qm.cols_slice(c0, rd.1)
        }
        None => None,
    };
    // a one-byte float tensor of the packed weight's own shape: the packed FP4 codes under
    // a float dtype (read by it, each byte is one value where it holds two codes)
    if qm.is_none() && d.dtype.bitsize() == 8 && d.shape == q.weight_shape {
        u.issue(
            IssueKind::Dtype,
            format!(
                "{}'s `{}` is {:?} {:?}: the shape of {}'s packed FP4 codes `{}` ({:?}), under a \
                 float dtype that reads each byte as one value where it holds two codes",
                if q_is_a { "B" } else { "A" },
                d.name,
                d.dtype,
                d.shape,
                if q_is_a { "A" } else { "B" },
                q.weight_name,
                q.weight_dtype
            ),
        );
        return Ok(done(u, false));
    }
    let Some(qm) = qm else {
        u.issue(
            IssueKind::Shape,
            format!(
                "B {:?} vs A {:?}{}",
                u.b_shape,
                u.a_shape,
                shape_hint(&[rq.0, rq.1], &[rd.0, rd.1], opts.tp)
            ),
        );
        return Ok(done(u, false));
    };
    u.notes.push(format!(
        "{} holds this weight as {:?} (unquantized), {} as {}: compared after dequantization",
        if q_is_a { "B" } else { "A" },
        d.dtype,
        if q_is_a { "A" } else { "B" },
        q.format.name()
    ));
    let (qa, qb) = (Values::Q(&qm), Values::D(dv));
    let m = if q_is_a {
        engine.metrics(&qa, &qb)?
    } else {
        engine.metrics(&qb, &qa)?
    };
    let Some(m) = m else {
        u.issue(
            IssueKind::Dtype,
            format!("{:?}: a dtype this tool does not decode", d.dtype),
        );
        return Ok(done(u, false));
    };
    // a scale size both layouts fit was read linear: a swizzled reading decisively nearer the
    // float side is what the tensor holds (an engine dump against BF16 originals)
    let mut m = m;
    if let (false, true, Format::Nvfp4, Some(dv)) = (
        m.passes(opts.min_cosine),
        rq == rd,
        qm.format,
        dense_view(d),
    ) {
        let (rows, kb) = (qm.rows, qm.kb());
        if swizzled_len(rows, kb) == rows * kb {
            let sw = QMatrix {
                scales: std::borrow::Cow::Owned(unswizzle(&qm.scales, rows, kb)),
                ..qm.clone()
            };
            let (sa, sb) = (Values::Q(&sw), Values::D(dv));
            let ms = if q_is_a {
                engine.metrics(&sa, &sb)?
            } else {
                engine.metrics(&sb, &sa)?
            };
            if let Some(ms) =
                ms.filter(|ms| layout_by_cosines(m.cosine, ms.cosine) == ScaleLayout::Swizzled)
            {
                u.notes.push(format!(
                    "{}'s block scales read in the 128x4 swizzle (their size fits both layouts; cosine {:.6} against {:.6} read linear)",
                    if q_is_a { "A" } else { "B" },
                    ms.cosine,
                    m.cosine
                ));
                m = ms;
            }
        }
    }
    let close = m.passes(opts.min_cosine);
    if !close {
        u.issue(IssueKind::Values, values_differ(&m, qm.cols));
        if let Some(msg) = unquantized_source(&qm, dv) {
            let (f, qside) = if q_is_a { ("B", "A") } else { ("A", "B") };
            u.issue(
                IssueKind::UnquantizedSource,
                format!(
                    "{f}'s `{}` holds the unquantized weights {qside}'s `{}` was quantized \
                     from: {msg}; the difference is {}'s quantization error, not a load error",
                    d.name,
                    q.weight_name,
                    q.format.name()
                ),
            );
        }
        if let Some((how, mm)) = q_is_a
            .then(|| mxfp4_misread(&qm, dv, opts.min_cosine))
            .flatten()
        {
            u.issue(
                IssueKind::ScalesMisread,
                format!(
                    "B's `{}` holds A's MXFP4 `{}` dequantized with {how} (`{}`): cosine {:.6} \
                     against that reading, {:.6} against the right one (32-element blocks, UE8M0 scales)",
                    d.name, q.weight_name, q.scale_name, mm.cosine, m.cosine
                ),
            );
        }
    }
    u.metrics = Some(m);
    Ok(done(u, close))
}

/// Does the float side `dv` hold the weights `qm` was quantized from? On its first rows, its
/// values quantize back to `qm`'s E2M1 codes under `qm`'s own block scales (at least 99%: a
/// BF16 original one rounding step across a code boundary is allowed), while few of them are
/// `qm`'s values themselves (at most half: an engine's dequantized copy holds them all, however
/// damaged one block of it is). The evidence, or None.
fn unquantized_source(qm: &QMatrix, dv: DView) -> Option<String> {
    const ROWS: usize = 64;
    let rows = qm.rows.min(ROWS);
    let (cols, block) = (qm.cols, qm.format.block());
    if dv.len() != qm.rows * cols {
        return None;
    }
    let mut y = vec![0f32; rows * cols];
    if !dv.decode(0, &mut y) {
        return None;
    }
    let (mut same_code, mut same_value) = (0usize, 0usize);
    let mut x = vec![0f32; cols];
    for r in 0..rows {
        let sc = qm.scale_row(r);
        dequantize_row(qm.format, qm.packed.row(r), sc, qm.scale_2, block, &mut x);
        for (c, (&b, &a)) in y[r * cols..(r + 1) * cols].iter().zip(&x).enumerate() {
            let scale = qm.scale_2
                * match qm.format {
                    Format::Nvfp4 => e4m3::decode(sc[c / block]),
                    Format::Mxfp4 => ue8m0::decode(sc[c / block]),
                };
            let (lo, hi) = e2m1::unpack(qm.packed.row(r)[c / 2]);
            let code = if c % 2 == 0 { lo } else { hi };
            // ±0 are one value
            same_code += usize::from(e2m1::decode(e2m1::encode(b / scale)) == e2m1::decode(code));
            same_value += usize::from(a == b);
        }
    }
    let n = rows * cols;
    (n > 0 && same_code * 100 >= n * 99 && same_value * 2 <= n).then(|| {
        format!(
            "{:.2}% of the values of its first {rows} rows quantize back to those codes under \
             their own block scales, while {:.2}% equal their values",
            100.0 * same_code as f64 / n as f64,
            100.0 * same_value as f64 / n as f64
        )
    })
}

/// One side's MXFP4 linear whose UE8M0 block scales the other side holds tagged F8_E4M3
/// (so read as NVFP4, without a global scale): the same packed codes and scale bytes read as
/// MXFP4. The message names the mislabelled tensor.
fn ue8m0_tagged_e4m3(qa: &QRaw, qb: &QRaw) -> Option<String> {
    let (mx, nv, side, other) = match (qa.format, qb.format) {
        (Format::Mxfp4, Format::Nvfp4) => (qa, qb, "B", "A"),
        (Format::Nvfp4, Format::Mxfp4) => (qb, qa, "A", "B"),
        _ => return None,
    };
    if nv.scale_2.is_some() || nv.scale_dtype != Dtype::F8_E4M3 {
        return None;
    }
    let as_mx = QRaw {
        format: Format::Mxfp4,
        ..nv.clone()
    };
    let (m, _) = qmatrix(mx, mx.rows(), mx.cols()).ok()?;
    let (n, _) = qmatrix(&as_mx, as_mx.rows(), as_mx.cols()).ok()?;
    m.same_codes(&n).then(|| {
        format!(
            "{side}'s block scales `{}` are tagged F8_E4M3 but hold {other}'s UE8M0 (F8_E8M0) scale bytes \
             of `{}` ([N, K/32], no global scale): an MXFP4 linear whose scale dtype is mislabelled, \
             read as NVFP4 (E4M3 scales, 16-element blocks)",
            nv.scale_name, mx.scale_name
        )
    })
}

/// The misreading of MXFP4 block scales that gives the float side's values (cosine at least
/// `min_cosine`), if one does: each UE8M0 scale applied to 16 elements as NVFP4's block (a
/// row's K/32 scales cover its first half, then repeat), or the UE8M0 bytes read as E4M3.
fn mxfp4_misread(qm: &QMatrix, dv: DView, min_cosine: f64) -> Option<(&'static str, Metrics)> {
    if qm.format != Format::Mxfp4 || dv.len() != qm.rows * qm.cols {
        return None;
    }
    let mut y = vec![0f32; dv.len()];
    if !dv.decode(0, &mut y) {
        return None;
    }
    let (cols, kb) = (qm.cols, qm.kb());
    let read = |format: Format, block: usize| {
        let mut x = vec![0f32; y.len()];
        for r in 0..qm.rows {
            let row = qm.scale_row(r);
            let sc: Vec<u8> = (0..cols / block).map(|j| row[j % kb]).collect();
            let out = &mut x[r * cols..(r + 1) * cols];
            dequantize_row(format, qm.packed.row(r), &sc, qm.scale_2, block, out);
        }
        Accum::over(&y, &x, 0).finish()
    };
    [
        (
            "each UE8M0 block scale applied to 16 elements instead of 32",
            Format::Mxfp4,
            16,
        ),
        ("the UE8M0 block scales read as E4M3", Format::Nvfp4, 32),
    ]
    .into_iter()
    .map(|(how, format, block)| (how, read(format, block)))
    .find(|(_, m)| m.passes(min_cosine))
}

/// A side's quantized matrix read at its own geometry (scales resolved; an ambiguous size
/// read as linear).
pub fn own_q<'a>(raw: &QRaw<'a>) -> Option<QMatrix<'a>> {
    qmatrix(raw, raw.rows(), raw.cols()).ok().map(|(m, _)| m)
}

/// A's quantized matrix cut to B's geometry `target` (equal, or B's TP shard).
pub fn aligned_q<'a>(
    raw: &QRaw<'a>,
    target: (usize, usize),
    tp: Option<(usize, usize)>,
) -> Option<QMatrix<'a>> {
    let m = own_q(raw)?;
    match align2((m.rows, m.cols), target, tp)? {
        Align::Same => Some(m),
        Align::Rows(r0) => m.rows_slice(r0, target.0),
        Align::Cols(c0) => m.cols_slice(c0, target.1),
    }
}

/// Metrics of B's matrix against A's, quantized or not, when the shapes agree (Ok(None)
/// when they do not).
pub fn metrics_raw(
    a: &Raw,
    b: &Raw,
    tp: Option<(usize, usize)>,
    engine: &dyn DiffEngine,
) -> Result<Option<Metrics>> {
    match (a, b) {
        (Raw::Q(qa), Raw::Q(qb)) => {
            let Some(mb) = own_q(qb) else { return Ok(None) };
            let Some(ma) = aligned_q(qa, (mb.rows, mb.cols), tp) else {
                return Ok(None);
            };
            engine.metrics(&Values::Q(&ma), &Values::Q(&mb))
        }
        (Raw::D(da), Raw::D(db)) => {
            let Some(vb) = dense_view(db) else {
                return Ok(None);
            };
            let va = if da.shape == db.shape {
                dense_view(da)
            } else {
                shard_view(da, &db.shape, tp).map(|v| v.0)
            };
            match va {
                Some(va) => engine.metrics(&Values::D(va), &Values::D(vb)),
                None => Ok(None),
            }
        }
        _ => Ok(None),
    }
}

/// Rows a pairing that a diagnosis proposes is tried on before the whole matrix.
const TRY_ROWS: usize = 64;

/// Whether B's matrix matches A's to `min_cosine` with no NaN or Inf: a diagnosis's test of
/// a pairing (B's gate holds A's up, ...). A quantized pairing is first tried on its first
/// [`TRY_ROWS`] rows and dropped when they fail: a wrong pairing fails on every row, and
/// every unit differing (a re-quantized checkpoint) would otherwise cost a whole second
/// comparison per expert.
pub fn passes_raw(
    a: &Raw,
    b: &Raw,
    tp: Option<(usize, usize)>,
    engine: &dyn DiffEngine,
    min_cosine: f64,
) -> Result<bool> {
    if let (Raw::Q(qa), Raw::Q(qb)) = (a, b) {
        let head = own_q(qb).and_then(|mb| {
            let ma = aligned_q(qa, (mb.rows, mb.cols), tp)?;
            (mb.rows > 4 * TRY_ROWS)
                .then(|| Some((ma.rows_slice(0, TRY_ROWS)?, mb.rows_slice(0, TRY_ROWS)?)))?
        });
        if let Some((ha, hb)) = head {
            let m = engine.metrics(&Values::Q(&ha), &Values::Q(&hb))?;
            if !m.is_some_and(|m| m.passes(min_cosine)) {
                return Ok(false);
            }
        }
    }
    Ok(metrics_raw(a, b, tp, engine)?.is_some_and(|m| m.passes(min_cosine)))
}

/// The geometry a B unit has, that A units are cut to before fingerprinting.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Geom {
    Q(usize, usize),
    D(Vec<usize>, Dtype),
}

/// Fingerprints of a unit at its own geometry, and that geometry: one, or in full two when
/// its block scales have a size both layouts fit and nothing decided which (linear first).
pub fn fingerprint_own(r: &Raw, depth: Depth) -> Option<(Vec<u64>, Geom)> {
    match r {
        Raw::Q(q) => {
            let ms = match depth {
                Depth::Full => readings(q),
                Depth::Sample => own_q(q).into_iter().collect(),
            };
            let g = Geom::Q(ms.first()?.rows, ms.first()?.cols);
            Some((ms.iter().map(|m| m.fingerprint(depth)).collect(), g))
        }
        Raw::D(d) => Some((
            vec![dense_view(d)?.mat.fingerprint(depth)],
            Geom::D(d.shape.clone(), d.dtype),
        )),
    }
}

/// B holds exactly A's unit (cut to B's geometry: B's TP shard), every byte compared through
/// full fingerprints, each side's scales under each reading they allow.
pub fn holds_whole(a: &Raw, b: &Raw, tp: Option<(usize, usize)>) -> bool {
    fingerprint_own(b, Depth::Full).is_some_and(|(fb, g)| {
        full_fingerprints_as(a, &g, tp)
            .iter()
            .any(|fa| fb.contains(fa))
    })
}

/// Full fingerprints of A's unit cut to geometry `g`, its scales under each reading they
/// allow (linear first).
fn full_fingerprints_as(a: &Raw, g: &Geom, tp: Option<(usize, usize)>) -> Vec<u64> {
    match (a, g) {
        (Raw::Q(q), Geom::Q(r, c)) => readings(q)
            .iter()
            .filter_map(|m| {
                let al = align2((m.rows, m.cols), (*r, *c), tp)?;
                Some(cut_to(m, al, (*r, *c))?.fingerprint(Depth::Full))
            })
            .collect(),
        _ => fingerprint_as(a, g, tp, Depth::Full).into_iter().collect(),
    }
}

/// Fingerprint of A's unit cut to geometry `g` (B's shard).
pub fn fingerprint_as(a: &Raw, g: &Geom, tp: Option<(usize, usize)>, depth: Depth) -> Option<u64> {
    match (a, g) {
        (Raw::Q(q), Geom::Q(r, c)) => Some(aligned_q(q, (*r, *c), tp)?.fingerprint(depth)),
        (Raw::D(d), Geom::D(shape, dtype)) if d.dtype == *dtype => {
            let v = if &d.shape == shape {
                dense_view(d)?
            } else {
                shard_view(d, shape, tp)?.0
            };
            Some(v.mat.fingerprint(depth))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// One changed code: NVFP4 says the global scale stayed A's; MXFP4, which has none, does
    /// not (it said "under the same global scale" too).
    #[test]
    fn blocks_differ_speaks_of_a_global_scale_only_for_nvfp4() {
        use crate::weights::blocks::tests::q;
        let seed: u64 = rand::random();
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        for format in [Format::Nvfp4, Format::Mxfp4] {
            let (rows, cols) = (4, 4 * format.block());
            let a_codes: Vec<u8> = (0..rows * cols / 2).map(|_| r.gen()).collect();
            let scales: Vec<u8> = (0..rows * cols / format.block())
                .map(|_| r.gen_range(100..120))
                .collect();
            let mut b_codes = a_codes.clone();
            let at = r.gen_range(0..b_codes.len());
            b_codes[at] ^= 0x11;
            let (a, b) = (
                q(format, rows, cols, &a_codes, &scales),
                q(format, rows, cols, &b_codes, &scales),
            );
            let msg = blocks_differ(&a, &b, None);
            let what = format!("seed {seed} {format:?}: {msg}");
            assert!(msg.contains("1 of 16 blocks differ"), "{what}");
            assert_eq!(
                msg.contains("global scale"),
                format == Format::Nvfp4,
                "{what}"
            );
        }
    }

    /// A power-of-two re-encoding of a global scale: exact within one convention, up to the
    /// one ulp a reciprocal costs across two, and no further; ×1 and other ratios are none.
    #[test]
    fn power_of_two_reencoding_allows_one_ulp_across_conventions_only() {
        let seed: u64 = rand::random();
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let step = |v: f32, k: i32| f32::from_bits((v.to_bits() as i32 + k) as u32);
        for _ in 0..200 {
            let x: f32 = r.gen_range(1e-5..1e-2);
            let k = *[-2, -1, 1, 2, 3].get(r.gen_range(0..5)).unwrap_or(&1);
            let exact = x * 2f32.powi(k);
            let what = format!("seed {seed}: x {x:e}, ×2^{k}");
            for conv in [false, true] {
                assert_eq!(
                    power_of_two_reencoding(x, exact, conv),
                    Some(exact),
                    "{what}"
                );
                let one_off = conv.then_some(exact);
                assert_eq!(
                    power_of_two_reencoding(x, step(exact, 1), conv),
                    one_off,
                    "{what}"
                );
                assert_eq!(
                    power_of_two_reencoding(x, step(exact, -1), conv),
                    one_off,
                    "{what}"
                );
                assert_eq!(
                    power_of_two_reencoding(x, step(exact, 2), conv),
                    None,
                    "{what}"
                );
                assert_eq!(power_of_two_reencoding(x, 3.0 * x, conv), None, "{what}");
                assert_eq!(power_of_two_reencoding(x, step(x, 1), conv), None, "{what}");
            }
            // the reciprocal round trip a convention change makes stays within the ulp
            let through_gs = 1.0 / (1.0 / exact);
            assert_eq!(
                power_of_two_reencoding(x, through_gs, true),
                Some(exact),
                "{what}"
            );
        }
        assert_eq!(power_of_two_reencoding(0.0, 0.0, true), None);
        assert_eq!(power_of_two_reencoding(1.0, f32::INFINITY, true), None);
        assert_eq!(power_of_two_reencoding(1.0, -2.0, true), None);
    }
}
