//! vLLM's fused expert tensors of an engine-side dump: `w13_weight [E, 2I, H/2]` (each
//! expert's gate rows, then its up rows), `w2_weight [E, H, I/2]`, U8, with `*_weight_scale`
//! (linear `[E, N, K/16]` or each expert in the 128x4 swizzle; MXFP4: `[E, N, K/32]` E8M0),
//! `*_weight_scale_2` (compressed-tensors: `*_weight_global_scale`, the quant direction) and
//! `*_input_scale` (`*_input_global_scale`) per expert. They are not ModelOpt triples, so the
//! per-linear scan does not see them: here each expert, and each half of a w13, is scanned for
//! what that scan finds in a linear.

use super::{allclose, SATURATED_HANDFUL};
use super::{block_values, scan_scales, AuditOptions, BlockValues, Finding, FindingKind};
use crate::checkpoint::file::{is_float, TensorInfo};
use crate::checkpoint::hf::Checkpoint;
use crate::checkpoint::source::TensorSource;
use crate::error::{Error, Result};
use crate::nvfp4::layout::{detect_layout, swizzled_len, unswizzle, LayoutGuess};
use crate::nvfp4::{e2m1, Format, ScaleProblem};
use safetensors::Dtype;
use std::borrow::Cow;
use std::collections::BTreeMap;
use std::ops::Range;

/// `w13_weight_scale_2 [E, 2]` holds gate and up per expert; vLLM keeps column 0 for both.
pub(super) fn gate_up_scales(ck: &Checkpoint, out: &mut Vec<Finding>) -> Result<()> {
    for n in ck.names() {
        if !n.ends_with("w13_weight_scale_2") {
            continue;
        }
        let t = ck.info(n)?;
        if t.shape.len() != 2 || t.shape[1] != 2 || !is_float(t.dtype) {
            continue;
        }
        let v = ck.to_f32(n)?;
        let bad: Vec<usize> = (0..t.shape[0])
            .filter(|&e| {
                // non-finite and non-positive scales are findings of their own
                [v[2 * e], v[2 * e + 1]]
                    .iter()
                    .all(|x| x.is_finite() && *x > 0.0)
                    && !allclose(v[2 * e + 1], v[2 * e])
            })
            .collect();
        if let Some(&e0) = bad.first() {
            out.push(Finding {
                tensor: n.to_string(),
                file: ck.file_of(n).to_path_buf(),
                kind: FindingKind::GateUpScaleMismatch,
                detail: format!(
                    "{} of {} experts have w1 != w3 weight_scale_2 (first: expert {e0}, {:e} vs {:e}); vLLM uses column 0 for both",
                    bad.len(),
                    t.shape[0],
                    v[2 * e0],
                    v[2 * e0 + 1]
                ),
            });
        }
    }
    Ok(())
}

/// The fused expert weights: `*w13_weight` / `*w2_weight`, U8 `[E, N, K/2]`.
fn weights(ck: &Checkpoint) -> impl Iterator<Item = (&str, &TensorInfo)> + '_ {
    ck.names().filter_map(|n| {
        let stem = n.strip_suffix("_weight")?;
        if !(stem.ends_with("w13") || stem.ends_with("w2")) {
            return None;
        }
        let t = ck.info(n).ok()?;
        let fused = matches!(t.dtype, Dtype::U8 | Dtype::I8)
            && matches!(t.shape.as_slice(), &[e, n, k] if e > 0 && n > 0 && k > 0);
        fused.then_some((n, t))
    })
}

/// The tensors the fused scan reads (weights, their block, global and input scales): the
/// generic NaN/Inf scan of float tensors leaves them to it.
pub(super) fn members(ck: &Checkpoint) -> Vec<String> {
    let mut out = vec![];
    for (n, _) in weights(ck) {
        let stem = &n[..n.len() - "_weight".len()];
        out.push(n.to_string());
        for m in SCALARS.iter().chain(["weight_scale"].iter()) {
            let name = format!("{stem}_{m}");
            if ck.contains(&name) {
                out.push(name);
            }
        }
    }
    out
}

/// The per-expert scalars beside a fused weight: global scales (ModelOpt's dequant
/// direction, compressed-tensors' quant direction), then input scales.
const SCALARS: [&str; 4] = [
    "weight_scale_2",
    "weight_global_scale",
    "input_scale",
    "input_global_scale",
];

/// What the scan of one fused weight saw.
pub(super) struct Scanned {
    pub format: Format,
    /// Codes and block scales read.
    pub bytes: u64,
}

/// Scans every fused expert weight.
pub(super) fn experts(
    ck: &Checkpoint,
    opts: &AuditOptions,
    out: &mut Vec<Finding>,
) -> Result<Vec<Scanned>> {
    let mut scanned = vec![];
    for (n, t) in weights(ck) {
        let &[e, rows, packed_cols] = t.shape.as_slice() else {
            continue;
        };
        let w13 = n.ends_with("w13_weight");
        if w13 && rows % 2 == 1 {
            return Err(Error::bad_tensor(
                ck.file_of(n),
                n,
                format!(
                    "shape {:?}: a w13 holds each expert's gate rows, then as many up rows; {rows} rows is odd",
                    t.shape
                ),
            ));
        }
        let w = Fused {
            name: n,
            experts: e,
            rows,
            cols: 2 * packed_cols,
            parts: parts(e, rows, w13),
        };
        let stem = &n[..n.len() - "_weight".len()];
        let global = match w.scalars(ck, &format!("{stem}_{}", SCALARS[0]))? {
            Some(g) => Some(g),
            None => w.scalars(ck, &format!("{stem}_{}", SCALARS[1]))?,
        };
        if let Some((gn, v)) = &global {
            w.scalar_checks(ck, gn, v, out);
        }
        for input in &SCALARS[2..] {
            if let Some((iname, v)) = w.scalars(ck, &format!("{stem}_{input}"))? {
                w.scalar_checks(ck, &iname, &v, out);
            }
        }
        // the dequant direction per part, for the overflow check
        let scale_2: Vec<f32> = match &global {
            Some((gn, v)) => v
                .iter()
                .map(|&g| crate::checkpoint::formats::dequant_direction(gn, g))
                .collect(),
            None => vec![f32::NAN; w.parts.len()],
        };
        let codes = ck.bytes(n)?;
        w.codes_checks(ck, codes, out);
        let global_name = global.as_ref().map(|(gn, _)| gn.as_str());
        let (format, scale_bytes) =
            w.block_scale_checks(ck, opts, codes, (global_name, &scale_2), out)?;
        scanned.push(Scanned {
            format,
            bytes: (codes.len() + scale_bytes) as u64,
        });
    }
    Ok(scanned)
}

/// An expert of a fused tensor, or one half of it (w13: gate, up).
struct Part {
    expert: usize,
    half: &'static str,
    /// Its rows within the expert.
    rows: Range<usize>,
}

impl Part {
    /// "expert 3 (up), row 70, block 2" for the `i`-th of the part's block scales.
    fn at(&self, i: usize, kb: usize) -> String {
        format!(
            "expert {}, row {}, block {}",
            self.label(),
            self.rows.start + i / kb,
            i % kb
        )
    }

    fn label(&self) -> String {
        match self.half {
            "" => self.expert.to_string(),
            h => format!("{} ({h})", self.expert),
        }
    }
}

fn parts(experts: usize, rows: usize, w13: bool) -> Vec<Part> {
    let halves: Vec<(&'static str, Range<usize>)> = if w13 {
        vec![("gate", 0..rows / 2), ("up", rows / 2..rows)]
    } else {
        vec![("", 0..rows)]
    };
    (0..experts)
        .flat_map(|expert| {
            halves.iter().map(move |(half, r)| Part {
                expert,
                half,
                rows: r.clone(),
            })
        })
        .collect()
}

/// Where a finding kind was seen: the parts, how many elements, the first place.
#[derive(Default)]
struct Hits {
    parts: Vec<String>,
    experts: std::collections::BTreeSet<usize>,
    count: u64,
    first: Option<String>,
}

impl Hits {
    fn add(&mut self, p: &Part, count: u64, first: impl FnOnce() -> String) {
        if count == 0 {
            return;
        }
        self.parts.push(p.label());
        self.experts.insert(p.expert);
        self.count += count;
        if self.first.is_none() {
            self.first = Some(first());
        }
    }

    /// "N of E experts: 3 (gate), 5, …".
    fn which(&self, experts: usize) -> String {
        let mut s = self.parts.iter().take(8).cloned().collect::<Vec<_>>();
        if self.parts.len() > 8 {
            s.push(format!("… ({} in all)", self.parts.len()));
        }
        format!(
            "{} of {experts} experts: {}",
            self.experts.len(),
            s.join(", ")
        )
    }
}

struct Fused<'a> {
    name: &'a str,
    experts: usize,
    rows: usize,
    cols: usize,
    parts: Vec<Part>,
}

impl Fused<'_> {
    fn finding(&self, ck: &Checkpoint, tensor: &str, kind: FindingKind, detail: String) -> Finding {
        Finding {
            tensor: tensor.to_string(),
            file: ck.file_of(tensor).to_path_buf(),
            kind,
            detail,
        }
    }

    /// A per-expert scalar tensor beside the weight, one value per part: `[E]` or `[E, 1]`
    /// (one for the whole expert), `[E, 2]` (w13: gate, up), or `[]` (one for every expert).
    fn scalars(&self, ck: &Checkpoint, name: &str) -> Result<Option<(String, Vec<f32>)>> {
        let Some((f, t)) = ck.locate(name) else {
            return Ok(None);
        };
        let per_expert = match t.shape.as_slice() {
            [] => 0,
            [e] | [e, 1] if *e == self.experts => 1,
            [e, 2] if *e == self.experts && self.parts.len() == 2 * self.experts => 2,
            s => {
                return Err(Error::bad_tensor(
                    f.path(),
                    name,
                    format!(
                        "shape {s:?}: a per-expert scale of `{}` ({} experts) is [{e}], [{e}, 1]{} or []",
                        self.name,
                        self.experts,
                        if self.parts.len() == 2 * self.experts {
                            format!(", [{}, 2]", self.experts)
                        } else {
                            String::new()
                        },
                        e = self.experts
                    ),
                ))
            }
        };
        if !is_float(t.dtype) {
            return Err(Error::bad_tensor(
                f.path(),
                name,
                format!("dtype {:?}: a scale is F32 (or BF16/F16)", t.dtype),
            ));
        }
        let v = ck.to_f32(name)?;
        let halves = self.parts.len() / self.experts;
        let at = |i: usize| match per_expert {
            0 => v[0],
            1 => v[i / halves],
            _ => v[i],
        };
        Ok(Some((
            name.to_string(),
            (0..self.parts.len()).map(at).collect(),
        )))
    }

    /// NaN/Inf, zero, negative, or a reciprocal that overflows, per part.
    fn scalar_checks(&self, ck: &Checkpoint, name: &str, v: &[f32], out: &mut Vec<Finding>) {
        let (mut nonfinite, mut nonpositive) = (Hits::default(), Hits::default());
        for (p, &x) in self.parts.iter().zip(v) {
            match ScaleProblem::of(x) {
                None => {}
                Some(ScaleProblem::NotFinite | ScaleProblem::ReciprocalOverflows) => {
                    nonfinite.add(p, 1, || format!("expert {}: {x:e}", p.label()))
                }
                Some(ScaleProblem::Zero | ScaleProblem::Negative) => {
                    nonpositive.add(p, 1, || format!("expert {}: {x:e}", p.label()))
                }
            }
        }
        let e = self.experts;
        if let Some(first) = &nonfinite.first {
            out.push(self.finding(ck, name, FindingKind::NonfiniteGlobalScale, format!(
                "NaN, infinite, or with a reciprocal that overflows (engines compute the other direction from it) in {} (first {first}): every output of those experts becomes NaN/Inf",
                nonfinite.which(e)
            )));
        }
        if let Some(first) = &nonpositive.first {
            out.push(self.finding(ck, name, FindingKind::NonpositiveGlobalScale, format!(
                "zero or negative in {} (first {first}): a scale must be positive (zero flushes, negative flips the sign)",
                nonpositive.which(e)
            )));
        }
    }

    /// Codes of magnitude 0 in a whole part: never loaded, or zero-initialized memory.
    fn codes_checks(&self, ck: &Checkpoint, codes: &[u8], out: &mut Vec<Finding>) {
        let per = codes.len() / self.experts;
        let row = self.cols / 2;
        let mut zero = Hits::default();
        for p in &self.parts {
            let b = &codes[p.expert * per..][p.rows.start * row..p.rows.end * row];
            if b.iter().all(|&v| v & 0x77 == 0) {
                zero.add(p, 1, String::new);
            }
        }
        if zero.count > 0 {
            out.push(self.finding(
                ck,
                self.name,
                FindingKind::AllZeroWeight,
                format!(
                    "every FP4 code is ±0 in {} (never loaded, or zero-initialized memory)",
                    zero.which(self.experts)
                ),
            ));
        }
    }

    /// The block scales' format and layout, from their size per expert.
    fn scale_layout(
        &self,
        path: &std::path::Path,
        name: &str,
        t: &TensorInfo,
        bytes: &[u8],
    ) -> Result<(Format, Layout)> {
        let bad = |what: String| Err(Error::bad_tensor(path, name, what));
        if !matches!(t.dtype, Dtype::F8_E4M3 | Dtype::U8) {
            return bad(format!(
                "dtype {:?}: block scales are F8_E4M3 (NVFP4) or U8 bytes (E4M3, or MXFP4's E8M0)",
                t.dtype
            ));
        }
        if t.shape.first() != Some(&self.experts) || !bytes.len().is_multiple_of(self.experts) {
            return bad(format!(
                "shape {:?}: the block scales of `{}` hold {} experts first",
                t.shape, self.name, self.experts
            ));
        }
        let per = bytes.len() / self.experts;
        let (rows, cols) = (self.rows, self.cols);
        if cols % 16 == 0 {
            let kb = cols / 16;
            // every expert's padding must be clean for the swizzle: check each
            let guess = (0..self.experts)
                .map(|x| detect_layout(per, rows, kb, Some(&bytes[x * per..(x + 1) * per])))
                .find(|g| *g != LayoutGuess::Swizzled)
                .unwrap_or(LayoutGuess::Swizzled);
            match guess {
                LayoutGuess::Linear => return Ok((Format::Nvfp4, Layout::Linear)),
                LayoutGuess::Ambiguous => return Ok((Format::Nvfp4, Layout::Ambiguous)),
                LayoutGuess::Swizzled => return Ok((Format::Nvfp4, Layout::Swizzled)),
                LayoutGuess::Neither if per == swizzled_len(rows, kb) => {
                    return bad(format!(
                        "{per} bytes an expert fit the 128x4 swizzle of [{rows}, {kb}], but bytes in its padding are not zero (a swizzled tensor's padding is)"
                    ))
                }
                LayoutGuess::Neither => {}
            }
        }
        if t.dtype == Dtype::U8 && cols % 32 == 0 && per == rows * cols / 32 {
            return Ok((Format::Mxfp4, Layout::Linear));
        }
        bad(format!(
            "{per} bytes an expert: `{}` holds [{rows}, {cols}] FP4 values an expert, so NVFP4 block scales are [{rows}, {}] ({}), or {} bytes in the 128x4 swizzle; MXFP4 (U8): [{rows}, {}]",
            self.name,
            cols / 16,
            rows * (cols / 16),
            swizzled_len(rows, cols / 16),
            cols / 32
        ))
    }

    /// NaN, negative, saturated, zero-over-codes and overflowing block scales, per part. Returns
    /// the scales' format and their bytes.
    fn block_scale_checks(
        &self,
        ck: &Checkpoint,
        opts: &AuditOptions,
        codes: &[u8],
        (global, scale_2): (Option<&str>, &[f32]),
        out: &mut Vec<Finding>,
    ) -> Result<(Format, usize)> {
        let sn = format!("{}_scale", self.name);
        let Some((sf, st)) = ck.locate(&sn) else {
            out.push(self.finding(
                ck,
                self.name,
                FindingKind::MissingMember,
                format!("fused expert weights without their block scales (no `{sn}`)"),
            ));
            return Ok((Format::Nvfp4, 0));
        };
        let bytes = sf.slice(st);
        let (format, layout) = self.scale_layout(sf.path(), &sn, st, bytes)?;
        let kb = self.cols / format.block();
        let (per_s, per_c, row) = (
            bytes.len() / self.experts,
            codes.len() / self.experts,
            self.cols / 2,
        );
        let mut hits: BTreeMap<&str, Hits> = BTreeMap::new();
        let halves = self.parts.len() / self.experts;
        for (ps, ws) in self.parts.chunks(halves).zip(scale_2.chunks(halves)) {
            let x = ps[0].expert;
            let raw = &bytes[x * per_s..(x + 1) * per_s];
            let unswizzled = || Cow::Owned(unswizzle(raw, self.rows, kb));
            // [the reading findings are placed by, the other reading where ambiguous]
            let readings: [Cow<[u8]>; 2] = match layout {
                Layout::Linear => [Cow::Borrowed(raw), Cow::Borrowed(&[][..])],
                Layout::Swizzled => [unswizzled(), Cow::Borrowed(&[][..])],
                Layout::Ambiguous => [Cow::Borrowed(raw), unswizzled()],
            };
            let rows_of = |p: &Part| p.rows.start * kb..p.rows.end * kb;
            let codes_of = |p: &Part| &codes[x * per_c..][p.rows.start * row..p.rows.end * row];
            let ws2 = |i: usize| if format == Format::Mxfp4 { 1.0 } else { ws[i] };
            let mut values = vec![BlockValues::default(); ps.len()];
            for (i, p) in ps.iter().enumerate() {
                let s = &readings[0][rows_of(p)];
                let sc = scan_scales(format, s);
                hits.entry("nan")
                    .or_default()
                    .add(p, sc.nan, || p.at(sc.first_nan.unwrap_or(0), kb));
                hits.entry("negative")
                    .or_default()
                    .add(p, sc.negative, String::new);
                if format == Format::Nvfp4
                    && sc.saturated > SATURATED_HANDFUL
                    && sc.saturated as f64 > opts.saturation_limit * s.len() as f64
                {
                    hits.entry("saturated")
                        .or_default()
                        .add(p, sc.saturated, String::new);
                }
                let may_overflow =
                    ws2(i).is_finite() && !((e2m1::MAX * sc.max) * ws2(i).abs()).is_finite();
                if sc.zero > 0 || may_overflow {
                    values[i] = block_values(format, self.cols, s, codes_of(p), ws2(i));
                }
            }
            // the ambiguous layout is read both ways: a zeroed or overflowing block must show
            // under both (in the expert: the other reading can move it to the other half)
            if layout == Layout::Ambiguous && values.iter().any(|v| v.dead + v.overflow > 0) {
                let (mut dead, mut overflow) = (0, 0);
                for (i, p) in ps.iter().enumerate() {
                    let s = &readings[1][rows_of(p)];
                    let v = block_values(format, self.cols, s, codes_of(p), ws2(i));
                    (dead, overflow) = (dead + v.dead, overflow + v.overflow);
                }
                for v in &mut values {
                    if dead == 0 {
                        (v.dead, v.dead_rows) = (0, 0);
                    }
                    if overflow == 0 {
                        v.overflow = 0;
                    }
                }
            }
            for (p, v) in ps.iter().zip(&values) {
                hits.entry("dead")
                    .or_default()
                    .add(p, v.dead, || p.at(v.first_dead.unwrap_or(0), kb));
                hits.entry("dead_rows")
                    .or_default()
                    .add(p, v.dead_rows, String::new);
                hits.entry("overflow")
                    .or_default()
                    .add(p, v.overflow, || p.at(v.first_overflow.unwrap_or(0), kb));
            }
        }
        let total = bytes.len();
        let e = self.experts;
        let layout_note = match layout {
            Layout::Linear => "",
            Layout::Swizzled => " (scales read in the 128x4 swizzle their size shows)",
            Layout::Ambiguous => " (under both readings of the scales, linear and 128x4-swizzled, which their size cannot tell apart)",
        };
        let first = |h: &Hits| h.first.clone().unwrap_or_default();
        let mut push = |kind, detail: String| out.push(self.finding(ck, &sn, kind, detail));
        if let Some(h) = hits.get("nan").filter(|h| h.count > 0) {
            push(FindingKind::NanBlockScales, format!(
                "{} of {total} block scales are NaN codes ({}), in {} (first at {}): the blocks dequantize to NaN",
                h.count,
                match format {
                    Format::Nvfp4 => "E4M3 0x7F/0xFF, what a plain cast past 448 makes",
                    Format::Mxfp4 => "E8M0 0xFF",
                },
                h.which(e),
                first(h)
            ));
        }
        if let Some(h) = hits.get("negative").filter(|h| h.count > 0) {
            push(
                FindingKind::NegativeBlockScales,
                format!(
                    "{} block scales are negative (their blocks flip sign), in {}",
                    h.count,
                    h.which(e)
                ),
            );
        }
        if let Some(h) = hits.get("saturated").filter(|h| h.count > 0) {
            push(FindingKind::SaturatedBlockScales, format!(
                "more than the --saturation-limit ({:.2}%) of block scales at 448 (their elements are clipped) in {}",
                100.0 * opts.saturation_limit,
                h.which(e)
            ));
        }
        if let Some(h) = hits.get("dead").filter(|h| h.count > 0) {
            let rows = hits.get("dead_rows").map_or(0, |r| r.count);
            push(FindingKind::ZeroBlockScales, format!(
                "{} block scales are zero over blocks whose FP4 codes are not all ±0{layout_note}, in {} (first at {}{}): those weights dequantize to 0; a quantizer writes scale 0 only over an all-zero block, so these scales were zeroed after quantization",
                h.count,
                h.which(e),
                first(h),
                match rows {
                    0 => String::new(),
                    1 => "; 1 whole row: a dead output channel".into(),
                    n => format!("; {n} whole rows: dead output channels"),
                }
            ));
        }
        if let Some(h) = hits.get("overflow").filter(|h| h.count > 0) {
            // E4M3 block scales stop at 448: an NVFP4 overflow is its global scale's doing
            let tensor = match (global, format) {
                (Some(g), Format::Nvfp4) => g,
                _ => &sn,
            };
            out.push(self.finding(ck, tensor, FindingKind::NonfiniteDequant, format!(
                "{} blocks dequantize to Inf{layout_note}, in {} (first at {}): code × block scale × weight_scale_2 overflows f32; every output those experts compute from them is Inf/NaN",
                h.count,
                h.which(e),
                first(h)
            )));
        }
        Ok((format, total))
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Layout {
    Linear,
    Swizzled,
    /// Both layouts have the expert's size (N % 128 == 0, K/16 % 4 == 0: DeepSeek's shapes).
    Ambiguous,
}
