//! Reading one unit of one side: a quantized linear (triple or fused slice) as packed codes +
//! raw block scales + global scales, or a plain tensor as bytes. Nothing is copied: the views
//! point into the memory maps. What cannot be read is an `Err(String)` saying why; the caller
//! reports it against the unit.

use super::inventory::{Inventory, Source};
use super::rules::Renamed;
use super::view::{Mat, RawScales};
use crate::checkpoint::formats::{dequant_direction, input_scale, weight_scale_2};
use crate::checkpoint::{Convention, Proj, TensorSource};
use crate::nvfp4::Format;
use safetensors::Dtype;
use std::collections::BTreeSet;

/// How a global scale was found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shared {
    /// One value for this projection alone.
    Own,
    /// A fused `[E]` tensor: gate and up share one value (vLLM keeps one for w13).
    W13Shared,
}

/// A quantized linear of one side.
#[derive(Clone, Debug)]
pub struct QRaw<'a> {
    pub format: Format,
    pub packed: Mat<'a>,
    pub scales: RawScales<'a>,
    /// Dequant direction (`weight_scale_2`, or `1/weight_global_scale`); 1 for MXFP4.
    pub scale_2: Option<f32>,
    pub scale_2_shared: Shared,
    /// Stored under compressed-tensors' reciprocal names.
    pub reciprocal_names: bool,
    /// Dequant direction.
    pub input_scale: Option<f32>,
    /// The stored dtypes of the global scale and the input scale (F32, or another float).
    pub scalar_dtypes: (Option<Dtype>, Option<Dtype>),
    pub input_shared: Shared,
    /// Where the codes live, for messages (`file tensor` or `tensor[index]`).
    pub weight_name: String,
    pub weight_shape: Vec<usize>,
    pub weight_dtype: Dtype,
    pub scale_dtype: Dtype,
    pub scale_name: String,
    /// Original names of the global scales, when stored (for the `missing` list).
    pub scale_2_name: Option<String>,
    /// The global scale's name as this side's convention gives it, stored or not
    /// (`….weight_global_scale` for compressed-tensors, `….weight_scale_2` otherwise).
    pub scale_2_expected: String,
    pub input_name: Option<String>,
}

impl QRaw<'_> {
    /// The member a global scale goes by in this side's convention.
    pub fn global_scale_member(&self) -> &'static str {
        global_scale_member(self.reciprocal_names)
    }
    pub fn rows(&self) -> usize {
        self.packed.rows
    }
    pub fn cols(&self) -> usize {
        self.packed.row_bytes * 2
    }
}

/// A plain tensor of one side (or a slice of a fused float tensor).
#[derive(Clone, Debug)]
pub struct DRaw<'a> {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub bytes: &'a [u8],
    pub name: String,
}

#[derive(Clone, Debug)]
pub enum Raw<'a> {
    Q(QRaw<'a>),
    D(DRaw<'a>),
}

/// One side, for loading.
pub struct SideRef<'a> {
    pub src: &'a Renamed<'a>,
    pub inv: &'a Inventory,
    /// "A" or "B", for messages.
    pub label: &'static str,
    /// Fused tensors (their names as stored) whose block scales are read swizzled where the
    /// size allows both layouts.
    pub swizzled: &'a BTreeSet<String>,
}

/// No fused tensor known swizzled.
pub static NONE_SWIZZLED: BTreeSet<String> = BTreeSet::new();

/// Why a unit cannot be read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LoadError {
    /// Its block-scale tensor (named in the message) has a dtype or shape no kernel reads.
    Scales(String),
    /// A member it cannot be read without is not there.
    Missing(String),
    /// Anything else.
    Unreadable(String),
}

impl From<String> for LoadError {
    fn from(s: String) -> Self {
        LoadError::Unreadable(s)
    }
}

impl std::fmt::Display for LoadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LoadError::Scales(s) | LoadError::Missing(s) | LoadError::Unreadable(s) => {
                f.write_str(s)
            }
        }
    }
}

fn global_scale_member(reciprocal: bool) -> &'static str {
    if reciprocal {
        "weight_global_scale"
    } else {
        "weight_scale_2"
    }
}

fn dtype_of(src: &Renamed, name: &str) -> Result<(Dtype, Vec<usize>), String> {
    src.tensor_info(name)
        .map(|t| (t.dtype, t.shape.clone()))
        .map_err(|e| e.to_string())
}

/// The stored dtype of an optional tensor (a global or input scale).
fn stored_dtype(src: &Renamed, name: Option<&str>) -> Option<Dtype> {
    name.and_then(|n| dtype_of(src, n).ok()).map(|d| d.0)
}

/// Block scales are one-byte codes (E4M3, UE8M0, or U8 holding them) in `[.., N, K/block]`
/// order. A wider dtype (the values converted to F32 / BF16) or the transposed shape is named
/// here; otherwise it surfaces as a byte count no layout fits, or as values that differ.
fn check_scales(
    src: &Renamed,
    name: &str,
    rows: usize,
    packed_cols: usize,
) -> Result<(), LoadError> {
    let (dtype, shape) = dtype_of(src, name)?;
    if dtype.bitsize() != 8 {
        return Err(LoadError::Scales(format!(
            "`{}`: block scales stored as {dtype:?} ({} bytes a scale), not one-byte F8_E4M3 codes: \
             the scale values were converted (kernels read the e4m3 bytes)",
            src.original(name),
            dtype.bitsize() / 8
        )));
    }
    if let [.., x, y] = shape[..] {
        // K/16 (NVFP4) or K/32 (MXFP4) scales a row, K = 2 × the packed columns
        let transposed = y == rows && x != rows && (x * 8 == packed_cols || x * 16 == packed_cols);
        if transposed {
            return Err(LoadError::Scales(format!(
                "`{}`: block scales shaped {shape:?}, [.., K/block, N] where [.., N, K/block] = [.., {rows}, {x}] belongs: stored transposed",
                src.original(name)
            )));
        }
    }
    Ok(())
}

fn bytes_of<'a>(src: &'a Renamed, name: &str) -> Result<&'a [u8], String> {
    src.tensor_bytes(name).map_err(|e| e.to_string())
}

impl<'a> SideRef<'a> {
    pub fn load(&self, source: &Source) -> Result<Raw<'a>, LoadError> {
        match source {
            Source::Linear(ln) => self.load_linear(ln, None).map(Raw::Q),
            Source::Merged(m) => self.load_part(m),
            Source::Fused(f) => self.load_fused(f.layer, f.proj, f.index),
            Source::Tensor(name) => {
                let (dtype, shape) = dtype_of(self.src, name)?;
                Ok(Raw::D(DRaw {
                    dtype,
                    shape,
                    bytes: bytes_of(self.src, name)?,
                    name: self.src.original(name).to_string(),
                }))
            }
            Source::Incomplete { problem, .. } => Err(LoadError::Missing(problem.clone())),
        }
    }

    /// A quantized unit's weight_scale_2 (dequant direction) alone: a linear's scalar read
    /// without mapping its weight; other sources loaded. None for a float tensor or a linear
    /// without one.
    pub fn scale_2(&self, source: &Source) -> Option<f32> {
        match source {
            Source::Linear(ln) => match (&ln.global_scale, ln.convention) {
                (_, Convention::Mxfp4) => Some(1.0),
                (None, _) => None,
                (Some(_), _) => weight_scale_2(self.src, ln).ok(),
            },
            s => match self.load(s).ok()? {
                Raw::Q(q) => q.scale_2,
                Raw::D(_) => None,
            },
        }
    }

    /// Rows `[row0, row0 + rows)` of a merged linear, its global scales the part's own (a
    /// `[parts]` tensor before vLLM's processing) or the one they share (after it: the max).
    fn load_part(&self, m: &super::merged::MergedPart) -> Result<Raw<'a>, LoadError> {
        let cut = |what: &str| format!("rows {}..{} ({what})", m.row0, m.row0 + m.rows);
        match m.inner.as_ref() {
            Source::Linear(ln) => {
                let mut q = self.load_linear(ln, Some((m.part, m.parts)))?;
                q.packed = q
                    .packed
                    .slice_rows(m.row0, m.rows)
                    .ok_or_else(|| format!("`{}`: no {}", q.weight_name, cut("merged part")))?;
                q.scales.row0 = m.row0;
                q.weight_name = format!("{} {}", q.weight_name, cut("merged part"));
                q.weight_shape[0] = m.rows;
                Ok(Raw::Q(q))
            }
            Source::Tensor(name) => {
                let (dtype, shape) = dtype_of(self.src, name)?;
                let bytes = bytes_of(self.src, name)?;
                let row = bytes.len() / shape[0].max(1);
                let part = bytes
                    .get(m.row0 * row..(m.row0 + m.rows) * row)
                    .ok_or_else(|| format!("`{}`: no {}", self.src.original(name), cut("part")))?;
                Ok(Raw::D(DRaw {
                    dtype,
                    shape: [&[m.rows][..], &shape[1..]].concat(),
                    bytes: part,
                    name: format!("{} {}", self.src.original(name), cut("merged part")),
                }))
            }
            s => Err(format!("a merged part of {s:?}").into()),
        }
    }

    /// A global scale of a merged linear's part: element `part` of a `[parts]` tensor, or the
    /// one value of a scalar.
    fn part_scalar(&self, name: &str, (part, parts): (usize, usize)) -> Result<f32, LoadError> {
        let v = self.src.tensor_f32(name).map_err(|e| e.to_string())?;
        match v.len() {
            1 => Ok(v[0]),
            n if n == parts => Ok(v[part]),
            n => Err(format!(
                "`{}`: {n} values for a merged linear of {parts} parts",
                self.src.original(name)
            )
            .into()),
        }
    }

    fn load_linear(
        &self,
        ln: &crate::checkpoint::LinearNames,
        part: Option<(usize, usize)>,
    ) -> Result<QRaw<'a>, LoadError> {
        let src = self.src;
        let (wd, ws) = dtype_of(src, &ln.weight)?;
        let (sd, _) = dtype_of(src, &ln.weight_scale)?;
        if !matches!(wd, Dtype::U8 | Dtype::I8) || ws.len() != 2 {
            return Err(format!(
                "`{}`: a packed FP4 weight is U8 [N, K/2], found {wd:?} {ws:?}",
                src.original(&ln.weight)
            )
            .into());
        }
        check_scales(src, &ln.weight_scale, ws[0], ws[1])?;
        let bytes = bytes_of(src, &ln.weight)?;
        let packed = Mat::dense(bytes, ws[0], ws[1])
            .ok_or_else(|| format!("`{}`: bytes do not fill {ws:?}", src.original(&ln.weight)))?;
        let format = if ln.convention == Convention::Mxfp4 {
            Format::Mxfp4
        } else {
            Format::Nvfp4
        };
        let scale_2 = match (&ln.global_scale, format, part) {
            (_, Format::Mxfp4, _) => Some(1.0),
            (None, _, _) => None,
            (Some(g), _, Some(p)) => Some(dequant_direction(g, self.part_scalar(g, p)?)),
            (Some(_), _, None) => Some(weight_scale_2(src, ln).map_err(|e| e.to_string())?),
        };
        let input_scale = match (&ln.input_scale, part) {
            (Some(i), Some(p)) => Some(dequant_direction(i, self.part_scalar(i, p)?)),
            _ => input_scale(src, ln).map_err(|e| e.to_string())?,
        };
        Ok(QRaw {
            format,
            packed,
            scales: RawScales {
                region: bytes_of(src, &ln.weight_scale)?,
                region_rows: ws[0],
                row0: 0,
                tensor_swizzled: self.swizzled.contains(src.original(&ln.weight)),
            },
            scale_2,
            scale_2_shared: Shared::Own,
            reciprocal_names: ln.convention == Convention::CompressedTensors,
            input_scale,
            input_shared: Shared::Own,
            scalar_dtypes: (
                stored_dtype(src, ln.global_scale.as_deref()),
                stored_dtype(src, ln.input_scale.as_deref()),
            ),
            weight_name: src.original(&ln.weight).to_string(),
            weight_shape: ws,
            weight_dtype: wd,
            scale_dtype: sd,
            scale_name: src.original(&ln.weight_scale).to_string(),
            scale_2_name: ln
                .global_scale
                .as_deref()
                .map(|n| src.original(n).to_string()),
            scale_2_expected: match &ln.global_scale {
                Some(n) => src.original(n).to_string(),
                None => {
                    let w = src.original(&ln.weight);
                    let base = w.rsplit_once('.').map_or(w, |(b, _)| b);
                    let reciprocal = ln.convention == Convention::CompressedTensors;
                    format!("{base}.{}", global_scale_member(reciprocal))
                }
            },
            input_name: ln
                .input_scale
                .as_deref()
                .map(|n| src.original(n).to_string()),
        })
    }

    /// A per-expert value of a fused `[E]`, `[E, 1]` or `[E, 2]` scale tensor; `reciprocal`
    /// for compressed-tensors' quant-direction names.
    fn fused_scalar(
        &self,
        name: &str,
        index: usize,
        experts: usize,
        proj: Proj,
        reciprocal: bool,
    ) -> Result<(f32, Shared), String> {
        let (_, shape) = dtype_of(self.src, name)?;
        let v = self.src.tensor_f32(name).map_err(|e| e.to_string())?;
        let (val, shared) = match shape.as_slice() {
            [e] | [e, 1] if *e == experts => (v[index], Shared::W13Shared),
            [e, 2] if *e == experts => (v[index * 2 + usize::from(proj == Proj::Up)], Shared::Own),
            _ => {
                return Err(format!(
                    "`{}`: shape {shape:?}, expected [{experts}] or [{experts}, 2]",
                    self.src.original(name)
                ))
            }
        };
        let val = if reciprocal {
            crate::nvfp4::rcp(val)
        } else {
            val
        };
        // w2 has one projection: "shared" means nothing there
        let shared = if proj == Proj::Down {
            Shared::Own
        } else {
            shared
        };
        Ok((val, shared))
    }

    fn load_fused(&self, layer: usize, proj: Proj, index: usize) -> Result<Raw<'a>, LoadError> {
        let src = self.src;
        let fl = self
            .inv
            .fused
            .get(&layer)
            .ok_or_else(|| format!("layer {layer}: no fused tensors"))?;
        let w13 = proj != Proj::Down;
        let wname = fl
            .member(w13, "weight")
            .ok_or_else(|| format!("layer {layer}: no fused weight"))?;
        let (wd, ws) = dtype_of(src, wname)?;
        let [e, r_all, c] = ws[..] else {
            return Err(format!(
                "`{}`: shape {ws:?} is not [experts, rows, cols]",
                src.original(wname)
            )
            .into());
        };
        if index >= e {
            return Err(format!(
                "index {index} beyond the {e} experts of `{}`",
                src.original(wname)
            )
            .into());
        }
        if w13 && r_all % 2 != 0 {
            return Err(format!(
                "`{}`: {r_all} rows cannot hold gate and up halves",
                src.original(wname)
            )
            .into());
        }
        let (row0, rows) = match proj {
            Proj::Gate => (0, r_all / 2),
            Proj::Up => (r_all / 2, r_all / 2),
            Proj::Down => (0, r_all),
        };
        let label = format!(
            "{}[{index}]{}",
            src.original(wname),
            match proj {
                Proj::Gate => " rows 0..I (gate)",
                Proj::Up => " rows I..2I (up)",
                Proj::Down => "",
            }
        );
        let bytes = bytes_of(src, wname)?;
        if !matches!(wd, Dtype::U8 | Dtype::I8) {
            // a BF16 (unquantized) engine: the slice is a plain matrix
            let es = wd.bitsize() / 8;
            let per = r_all * c * es;
            let start = index * per + row0 * c * es;
            let slice = bytes
                .get(start..start + rows * c * es)
                .ok_or_else(|| format!("`{}`: too short for its shape", src.original(wname)))?;
            return Ok(Raw::D(DRaw {
                dtype: wd,
                shape: vec![rows, c],
                bytes: slice,
                name: label,
            }));
        }
        let per = r_all * c;
        let expert_bytes = bytes
            .get(index * per..(index + 1) * per)
            .ok_or_else(|| format!("`{}`: too short for its shape", src.original(wname)))?;
        let packed = Mat::dense(expert_bytes, r_all, c)
            .and_then(|m| m.slice_rows(row0, rows))
            .ok_or_else(|| format!("`{}`: bad shape", src.original(wname)))?;
        let sname = fl.member(w13, "weight_scale").ok_or_else(|| {
            LoadError::Missing(format!(
                "`{}` has no block scales (`..._weight_scale`)",
                src.original(wname)
            ))
        })?;
        let (sd, _) = dtype_of(src, sname)?;
        check_scales(src, sname, r_all, c)?;
        let sbytes = bytes_of(src, sname)?;
        if sbytes.len() % e != 0 {
            return Err(LoadError::Scales(format!(
                "`{}`: {} block-scale bytes do not split into {e} experts",
                src.original(sname),
                sbytes.len()
            )));
        }
        let sper = sbytes.len() / e;
        let format = if sd == Dtype::F8_E8M0 || (sd == Dtype::U8 && sper == r_all * (2 * c / 32)) {
            Format::Mxfp4
        } else {
            Format::Nvfp4
        };
        let (scale_2, scale_2_shared, recip) = match (
            format,
            fl.member(w13, "weight_scale_2"),
            fl.member(w13, "weight_global_scale"),
        ) {
            (Format::Mxfp4, _, _) => (Some(1.0), Shared::Own, false),
            (_, Some(n), _) => {
                let (v, s) = self.fused_scalar(n, index, e, proj, false)?;
                (Some(v), s, false)
            }
            (_, None, Some(n)) => {
                let (v, s) = self.fused_scalar(n, index, e, proj, true)?;
                (Some(v), s, true)
            }
            _ => (None, Shared::Own, false),
        };
        let (input_scale, input_shared) = match (
            fl.member(w13, "input_scale"),
            fl.member(w13, "input_global_scale"),
        ) {
            (Some(n), _) => {
                let (v, s) = self.fused_scalar(n, index, e, proj, false)?;
                (Some(v), s)
            }
            (None, Some(n)) => {
                let (v, s) = self.fused_scalar(n, index, e, proj, true)?;
                (Some(v), s)
            }
            _ => (None, Shared::Own),
        };
        Ok(Raw::Q(QRaw {
            format,
            packed,
            scales: RawScales {
                region: &sbytes[index * sper..(index + 1) * sper],
                region_rows: r_all,
                row0,
                tensor_swizzled: self.swizzled.contains(src.original(wname)),
            },
            scale_2,
            scale_2_shared,
            reciprocal_names: recip,
            input_scale,
            input_shared,
            scalar_dtypes: (
                stored_dtype(
                    src,
                    fl.member(w13, "weight_scale_2")
                        .or(fl.member(w13, "weight_global_scale")),
                ),
                stored_dtype(
                    src,
                    fl.member(w13, "input_scale")
                        .or(fl.member(w13, "input_global_scale")),
                ),
            ),
            weight_name: label,
            weight_shape: vec![rows, c],
            weight_dtype: wd,
            scale_dtype: sd,
            scale_name: format!("{}[{index}]", src.original(sname)),
            scale_2_name: fl
                .member(w13, "weight_scale_2")
                .or(fl.member(w13, "weight_global_scale"))
                .map(|n| format!("{}[{index}]", src.original(n))),
            scale_2_expected: match fl
                .member(w13, "weight_scale_2")
                .or(fl.member(w13, "weight_global_scale"))
            {
                Some(n) => format!("{}[{index}]", src.original(n)),
                None => {
                    let w = src.original(wname);
                    let stem = w.strip_suffix("weight").unwrap_or(w);
                    let ct = recip || fl.member(w13, "input_global_scale").is_some();
                    format!("{stem}{}[{index}]", global_scale_member(ct))
                }
            },
            input_name: fl
                .member(w13, "input_scale")
                .or(fl.member(w13, "input_global_scale"))
                .map(|n| format!("{}[{index}]", src.original(n))),
        }))
    }
}
