//! Quantized linear layers as checkpoints store them (DESIGN.md §3):
//! - ModelOpt NVFP4: `X.weight` U8 `[N, K/2]`, `X.weight_scale` F8_E4M3 `[N, K/16]` (linear),
//!   `X.weight_scale_2` F32 `[]` (dequant direction, amax/2688), `X.input_scale` F32 `[]`;
//! - compressed-tensors NVFP4: `X.weight_packed`, `X.weight_scale`, `X.weight_global_scale`
//!   (the quant direction: it is `gs = 1/weight_scale_2`), `X.input_global_scale` (`1/input_scale`);
//! - MXFP4 (native V4): `X.weight` U8/I8 `[N, K/2]`, `X.scale` or `X.weight_scale`
//!   F8_E8M0 (or U8) `[N, K/32]`, no global scale.
//!
//! Shapes and dtypes that cannot belong together are bad input. Values that merely look wrong
//! (a global scale in the other convention's direction) are for `audit` to diagnose:
//! [`convention_suspicion`].

use super::file::{is_float, TensorInfo};
use super::source::TensorSource;
use crate::error::{Error, Result};
use crate::moe::QLinear;
use crate::nvfp4::{e4m3, layout, Format, Fp4Tensor, GS_DENOM};
use safetensors::Dtype;
use serde::Serialize;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Convention {
    /// `weight_scale_2` / `input_scale`: dequant direction.
    Modelopt,
    /// `weight_global_scale` / `input_global_scale`: quant direction (reciprocals).
    CompressedTensors,
    /// E8M0 block scales of 32, no global scale.
    Mxfp4,
}

/// The member names of one quantized linear that exist in the source.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct LinearNames {
    pub base: String,
    pub convention: Convention,
    pub weight: String,
    pub weight_scale: String,
    /// `weight_scale_2` (ModelOpt) or `weight_global_scale` (compressed-tensors), if present.
    pub global_scale: Option<String>,
    /// `input_scale` (ModelOpt) or `input_global_scale` (compressed-tensors), if present.
    pub input_scale: Option<String>,
}

impl LinearNames {
    /// The name its global scale has or would have in its convention: a missing one is named
    /// as the checkpoint's convention spells it.
    pub fn global_scale_name(&self) -> String {
        self.global_scale
            .clone()
            .unwrap_or_else(|| match self.convention {
                Convention::CompressedTensors => format!("{}.weight_global_scale", self.base),
                _ => format!("{}.weight_scale_2", self.base),
            })
    }
}

/// Where the members of `base` are, if `base` is a quantized linear. A packed weight without
/// block scales, or scales without a weight, is bad input (a triple missing a member).
pub fn find_linear(src: &dyn TensorSource, base: &str) -> Result<Option<LinearNames>> {
    let m = |s: &str| format!("{base}.{s}");
    let has = |s: &str| src.contains(&m(s));
    let packed_ct = has("weight_packed");
    let weight_u8 = src
        .locate(&m("weight"))
        .is_some_and(|(_, t)| matches!(t.dtype, Dtype::U8 | Dtype::I8));
    let scale = ["weight_scale", "scale"].into_iter().find(|s| has(s));
    if !packed_ct && !weight_u8 {
        if let Some(s) = scale {
            // a scale whose weight is missing (or is not packed) cannot be a linear's
            if !has("weight") {
                return Err(Error::bad_tensor(
                    src.file_of(&m(s)),
                    &m(s),
                    format!("block scales without their packed weight `{}`", m("weight")),
                ));
            }
            if s == "weight_scale" && src.tensor_info(&m(s))?.dtype == Dtype::F8_E4M3 {
                let w = src.tensor_info(&m("weight"))?;
                return Err(Error::bad_tensor(
                    src.file_of(&m("weight")),
                    &m("weight"),
                    format!(
                        "has NVFP4 block scales (`weight_scale` F8_E4M3) but is {:?}, not a packed U8 weight",
                        w.dtype
                    ),
                ));
            }
        }
        return Ok(None);
    }
    let weight = if packed_ct {
        m("weight_packed")
    } else {
        m("weight")
    };
    let Some(scale) = scale else {
        return Err(Error::bad_tensor(
            src.file_of(&weight),
            &weight,
            format!(
                "packed FP4 weight without block scales (`{}` missing)",
                m("weight_scale")
            ),
        ));
    };
    let scale_dtype = src.tensor_info(&m(scale))?.dtype;
    let mxfp4 = scale == "scale"
        || scale_dtype == Dtype::F8_E8M0
        || is_e8m0_by_shape(src, &weight, &m(scale));
    let pick = |a: &str, b: &str| {
        if has(a) {
            Some(m(a))
        } else if has(b) {
            Some(m(b))
        } else {
            None
        }
    };
    let ct = packed_ct || (!has("weight_scale_2") && has("weight_global_scale"));
    let (convention, global_scale, input_scale) = if mxfp4 {
        (
            Convention::Mxfp4,
            None,
            pick("input_scale", "input_global_scale"),
        )
    } else if ct {
        (
            Convention::CompressedTensors,
            pick("weight_global_scale", "weight_scale_2"),
            pick("input_global_scale", "input_scale"),
        )
    } else {
        (
            Convention::Modelopt,
            pick("weight_scale_2", "weight_global_scale"),
            pick("input_scale", "input_global_scale"),
        )
    };
    Ok(Some(LinearNames {
        base: base.to_string(),
        convention,
        weight,
        weight_scale: m(scale),
        global_scale,
        input_scale,
    }))
}

/// A U8 scale with a block of 32 is E8M0 (MXFP4); with a block of 16, E4M3 stored as bytes.
fn is_e8m0_by_shape(src: &dyn TensorSource, weight: &str, scale: &str) -> bool {
    let (Ok(w), Ok(s)) = (src.tensor_info(weight), src.tensor_info(scale)) else {
        return false;
    };
    s.dtype == Dtype::U8
        && w.shape.len() == 2
        && s.shape.len() == 2
        && s.shape[1] * 16 == w.shape[1]
}

/// Base names of every quantized linear in `src`, in name order of their weights.
pub fn quantized_bases(src: &dyn TensorSource) -> Vec<String> {
    let mut v: Vec<String> = src
        .tensor_names()
        .filter_map(|n| {
            n.strip_suffix(".weight_scale")
                .or_else(|| n.strip_suffix(".scale"))
                .or_else(|| n.strip_suffix(".weight_packed"))
                .map(|b| b.to_string())
        })
        .collect();
    v.sort();
    v.dedup();
    v
}

/// Validated geometry of a linear's packed weight and block scales.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Geometry {
    pub format: Format,
    pub rows: usize,
    pub cols: usize,
}

fn dims(t: &TensorInfo) -> String {
    format!("{:?} {:?}", t.dtype, t.shape)
}

/// Cross-check the members' dtypes and shapes: `weight [N, K/2]`, `weight_scale [N, K/block]`,
/// scalar float global and input scales.
pub fn check_linear(src: &dyn TensorSource, n: &LinearNames) -> Result<Geometry> {
    let w = src.tensor_info(&n.weight)?;
    let s = src.tensor_info(&n.weight_scale)?;
    let bad_w = |what: String| Error::bad_tensor(src.file_of(&n.weight), &n.weight, what);
    let bad_s =
        |what: String| Error::bad_tensor(src.file_of(&n.weight_scale), &n.weight_scale, what);
    if !matches!(w.dtype, Dtype::U8 | Dtype::I8) || w.shape.len() != 2 {
        return Err(bad_w(format!(
            "a packed FP4 weight is U8 [N, K/2]; found {}",
            dims(w)
        )));
    }
    let format = if n.convention == Convention::Mxfp4 {
        Format::Mxfp4
    } else {
        Format::Nvfp4
    };
    let ok_dtype = match format {
        Format::Nvfp4 => matches!(s.dtype, Dtype::F8_E4M3 | Dtype::U8),
        Format::Mxfp4 => matches!(s.dtype, Dtype::F8_E8M0 | Dtype::U8),
    };
    // without a global scale the triple may be MXFP4 whose scales lost their dtype
    let maybe_mxfp4 = format == Format::Nvfp4 && n.global_scale.is_none();
    if !ok_dtype {
        return Err(bad_s(format!(
            "{}; found {:?}",
            match format {
                Format::Mxfp4 => "MXFP4 block scales are F8_E8M0 (or U8)",
                Format::Nvfp4 if maybe_mxfp4 => {
                    "block scales are F8_E4M3 (NVFP4, beside a weight_scale_2) or F8_E8M0 (MXFP4)"
                }
                Format::Nvfp4 => "NVFP4 block scales are F8_E4M3",
            },
            s.dtype
        )));
    }
    let (rows, cols) = (w.shape[0], w.shape[1] * 2);
    let block = format.block();
    if !cols.is_multiple_of(block) {
        return Err(bad_w(format!(
            "K = 2 × {} = {cols} is not a multiple of the {} block ({block})",
            w.shape[1],
            format.name()
        )));
    }
    let kb = cols / block;
    if s.shape != [rows, kb] {
        let (pr, pk) = layout::swizzled_dims(rows, kb);
        let hint = if s.shape == [pr, pk] || s.shape == [pr * pk] {
            " — that is the 128x4 swizzled (padded) layout kernels use; checkpoints hold linear scales"
        } else if maybe_mxfp4 && s.shape == [rows, cols / 32] {
            " — that is MXFP4's 32-element blocks, whose UE8M0 scales are F8_E8M0, not E4M3"
        } else {
            ""
        };
        return Err(bad_s(format!(
            "shape {:?} does not fit packed weight `{}` {:?} (K = {cols}): expected [{rows}, {kb}]{hint}",
            s.shape, n.weight, w.shape
        )));
    }
    for name in n.global_scale.iter().chain(n.input_scale.iter()) {
        let t = src.tensor_info(name)?;
        if !is_float(t.dtype) || t.numel() != 1 {
            return Err(Error::bad_tensor(
                src.file_of(name),
                name,
                format!("a global scale is one float (F32 []); found {}", dims(t)),
            ));
        }
    }
    Ok(Geometry { format, rows, cols })
}

/// `weight_scale_2` (dequant direction) of a linear, converted from compressed-tensors' `gs`.
/// MXFP4 has none (1.0).
pub fn weight_scale_2(src: &dyn TensorSource, n: &LinearNames) -> Result<f32> {
    let Some(g) = &n.global_scale else {
        return Ok(1.0);
    };
    Ok(dequant_direction(g, src.tensor_scalar_f32(g)?))
}

/// A stored global scale in the dequant direction: compressed-tensors' `*_global_scale` are
/// quant-direction (`gs`), ModelOpt's `weight_scale_2` / `input_scale` already dequant.
pub fn dequant_direction(name: &str, v: f32) -> f32 {
    if name.ends_with("global_scale") {
        crate::nvfp4::rcp(v)
    } else {
        v
    }
}

/// `input_scale` (dequant direction), converted from `input_global_scale`.
pub fn input_scale(src: &dyn TensorSource, n: &LinearNames) -> Result<Option<f32>> {
    let Some(i) = &n.input_scale else {
        return Ok(None);
    };
    Ok(Some(dequant_direction(i, src.tensor_scalar_f32(i)?)))
}

/// Read the quantized linear at `base` (no BF16 original); bad input when `base` is not one.
pub fn read_qlinear(src: &dyn TensorSource, base: &str) -> Result<QLinear> {
    let n = find_linear(src, base)?.ok_or_else(|| {
        Error::bad_tensor(
            src.file_of(&format!("{base}.weight")),
            &format!("{base}.weight"),
            "not a quantized linear (no packed weight with block scales)",
        )
    })?;
    read_linear(src, &n)
}

pub fn read_linear(src: &dyn TensorSource, n: &LinearNames) -> Result<QLinear> {
    let g = check_linear(src, n)?;
    if g.format == Format::Nvfp4 && n.global_scale.is_none() {
        return Err(Error::bad_tensor(
            src.file_of(&n.weight),
            &n.global_scale_name(),
            "missing: an NVFP4 weight needs its global scale (weight_scale_2, or weight_global_scale)",
        ));
    }
    let weight = Fp4Tensor {
        format: g.format,
        rows: g.rows,
        cols: g.cols,
        packed: src.tensor_bytes(&n.weight)?.to_vec(),
        scales: src.tensor_bytes(&n.weight_scale)?.to_vec(),
        scale_2: weight_scale_2(src, n)?,
    };
    Ok(QLinear {
        weight,
        input_scale: input_scale(src, n)?,
        original: None,
    })
}

/// A global scale that looks like it is in the other convention's direction. Real weights
/// have |w| well under 2688, so a ModelOpt `weight_scale_2 = amax/2688` is < 1, and a
/// compressed-tensors `weight_global_scale = 2688/amax` is > 1; past that boundary the value
/// is most likely the reciprocal stored under the wrong name. `max_block_scale` (decoded)
/// says what |w| the value implies.
pub fn convention_suspicion(
    convention: Convention,
    stored: f32,
    max_block_scale: f32,
) -> Option<String> {
    let implied = |ws2: f32| 6.0 * max_block_scale * ws2;
    // a NaN/Inf scale is a finding of its own; its reciprocal says nothing
    if !stored.is_finite() {
        return None;
    }
    match convention {
        Convention::Modelopt if stored > 1.0 => Some(format!(
            "weight_scale_2 = {stored:.4e} > 1 gives |w| up to {:.3e}; read as a gs (1/x) it gives {:.3e}: a compressed-tensors gs stored as weight_scale_2?",
            implied(stored),
            implied(1.0 / stored)
        )),
        Convention::CompressedTensors if stored > 0.0 && stored < 1.0 => Some(format!(
            "weight_global_scale = {stored:.4e} < 1 gives |w| up to {:.3e}; read as a weight_scale_2 it gives {:.3e}: a ModelOpt weight_scale_2 stored as the gs?",
            implied(1.0 / stored),
            implied(stored)
        )),
        _ => None,
    }
}

/// The activation counterpart: `input_scale = amax/2688` past 10 means activations of
/// ~27000, which no engine calibrates to; likely `1/input_scale` stored.
pub fn input_scale_suspicion(convention: Convention, stored: f32) -> Option<String> {
    if !stored.is_finite() {
        return None;
    }
    match convention {
        Convention::Modelopt if stored > 10.0 => Some(format!(
            "input_scale = {stored:.4e} means activations up to {:.3e}; 1/x = {:.4e} looks meant (a gs stored as input_scale?)",
            stored * GS_DENOM,
            1.0 / stored
        )),
        Convention::CompressedTensors if stored > 0.0 && stored < 0.1 => Some(format!(
            "input_global_scale = {stored:.4e} means activations up to {:.3e}: an input_scale stored as the gs?",
            GS_DENOM / stored
        )),
        _ => None,
    }
}

/// Largest finite block scale (decoded), ignoring sign; for [`convention_suspicion`].
pub fn max_block_scale(format: Format, codes: &[u8]) -> f32 {
    codes
        .iter()
        .map(|&c| match format {
            Format::Nvfp4 if e4m3::is_nan(c) => 0.0,
            _ => format.decode_scale(c).abs(),
        })
        .filter(|v| v.is_finite())
        .fold(0.0, f32::max)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::file::TensorFile;
    use crate::checkpoint::writer::{f32_bytes, write_file, TensorSpec};
    use crate::nvfp4::quantize_weight_nvfp4;
    use rand::{Rng, SeedableRng};
    use rand_distr::{Distribution, StandardNormal};

    fn random_weight(seed: u64, rows: usize, cols: usize) -> Vec<f32> {
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        (0..rows * cols)
            .map(|_| {
                let v: f32 = StandardNormal.sample(&mut r);
                v * 0.02
            })
            .collect()
    }

    fn modelopt(base: &str, t: &Fp4Tensor, input_scale: f32) -> Vec<(TensorSpec, Vec<u8>)> {
        vec![
            (
                TensorSpec::new(format!("{base}.weight"), Dtype::U8, &[t.rows, t.cols / 2]),
                t.packed.clone(),
            ),
            (
                TensorSpec::new(
                    format!("{base}.weight_scale"),
                    Dtype::F8_E4M3,
                    &[t.rows, t.cols / 16],
                ),
                t.scales.clone(),
            ),
            (
                TensorSpec::new(format!("{base}.weight_scale_2"), Dtype::F32, &[]),
                f32_bytes(&[t.scale_2]),
            ),
            (
                TensorSpec::new(format!("{base}.input_scale"), Dtype::F32, &[]),
                f32_bytes(&[input_scale]),
            ),
        ]
    }

    #[test]
    fn modelopt_and_compressed_tensors_read_the_same() {
        let seed: u64 = rand::random();
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let (rows, cols) = (r.gen_range(1..20), 16 * r.gen_range(1..8));
        let x = random_weight(seed, rows, cols);
        let (t, _) = quantize_weight_nvfp4(&x, rows, cols);
        let is: f32 = r.gen_range(0.001..0.1);
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("m.safetensors");
        let mut tensors = modelopt("a", &t, is);
        // the same weight, compressed-tensors style (reciprocal global scales)
        tensors.push((
            TensorSpec::new("b.weight_packed", Dtype::U8, &[rows, cols / 2]),
            t.packed.clone(),
        ));
        tensors.push((
            TensorSpec::new("b.weight_scale", Dtype::F8_E4M3, &[rows, cols / 16]),
            t.scales.clone(),
        ));
        tensors.push((
            TensorSpec::new("b.weight_global_scale", Dtype::F32, &[1]),
            f32_bytes(&[1.0 / t.scale_2]),
        ));
        tensors.push((
            TensorSpec::new("b.input_global_scale", Dtype::F32, &[1]),
            f32_bytes(&[1.0 / is]),
        ));
        write_file(&p, tensors, None).unwrap();
        let f = TensorFile::open(&p).unwrap();
        let a = read_qlinear(&f, "a").unwrap();
        assert_eq!(a.weight, t, "seed {seed}");
        assert_eq!(a.input_scale, Some(is));
        let nb = find_linear(&f, "b").unwrap().unwrap();
        assert_eq!(nb.convention, Convention::CompressedTensors);
        let b = read_linear(&f, &nb).unwrap();
        assert_eq!(b.weight.packed, t.packed);
        let rel = (b.weight.scale_2 - t.scale_2).abs() / t.scale_2;
        assert!(rel < 1e-6, "seed {seed}");
        assert!((b.input_scale.unwrap() - is).abs() / is < 1e-6);
        assert_eq!(quantized_bases(&f), vec!["a".to_string(), "b".to_string()]);
        let smax = max_block_scale(Format::Nvfp4, &t.scales);
        assert_eq!(
            smax, 448.0,
            "auto-scaled weights reach 448 in the amax block"
        );
        assert!(convention_suspicion(Convention::Modelopt, t.scale_2, smax).is_none());
        let s = convention_suspicion(Convention::Modelopt, 1.0 / t.scale_2, smax).unwrap();
        assert!(s.contains("gs"), "{s}");
        assert!(convention_suspicion(Convention::CompressedTensors, t.scale_2, smax).is_some());
        assert!(input_scale_suspicion(Convention::Modelopt, 2688.0).is_some());
        assert!(input_scale_suspicion(Convention::Modelopt, is).is_none());
    }

    #[test]
    fn mismatched_shapes_are_bad_input() {
        let (rows, cols) = (256, 64);
        let x = random_weight(rand::random(), rows, cols);
        let (t, _) = quantize_weight_nvfp4(&x, rows, cols);
        let d = tempfile::tempdir().unwrap();
        type Case<'a> = (&'a str, Vec<(TensorSpec, Vec<u8>)>, &'a str);
        let cases: Vec<Case> = vec![
            (
                "scale rows",
                {
                    let mut v = modelopt("a", &t, 0.01);
                    v[1] = (
                        TensorSpec::new("a.weight_scale", Dtype::F8_E4M3, &[rows / 2, cols / 8]),
                        t.scales.clone(),
                    );
                    v
                },
                "expected [256, 4]",
            ),
            (
                "swizzled",
                {
                    let mut v = modelopt("a", &t, 0.01);
                    let sw = layout::swizzle(&t.scales, rows, cols / 16);
                    v[1] = (
                        TensorSpec::new("a.weight_scale", Dtype::F8_E4M3, &[sw.len()]),
                        sw,
                    );
                    v
                },
                "swizzled",
            ),
            (
                "scale dtype",
                {
                    let mut v = modelopt("a", &t, 0.01);
                    v[1] = (
                        TensorSpec::new("a.weight_scale", Dtype::F8_E5M2, &[rows, cols / 16]),
                        t.scales.clone(),
                    );
                    v
                },
                "F8_E4M3",
            ),
            (
                "ws2 shape",
                {
                    let mut v = modelopt("a", &t, 0.01);
                    v[2] = (
                        TensorSpec::new("a.weight_scale_2", Dtype::F32, &[2]),
                        f32_bytes(&[1.0, 2.0]),
                    );
                    v
                },
                "one float",
            ),
            (
                "no scale",
                {
                    let mut v = modelopt("a", &t, 0.01);
                    v.remove(1);
                    v
                },
                "without block scales",
            ),
            (
                "bf16 weight with e4m3 scales",
                {
                    let mut v = modelopt("a", &t, 0.01);
                    v[0] = (
                        TensorSpec::new("a.weight", Dtype::BF16, &[rows, cols / 4]),
                        t.packed.clone(),
                    );
                    v
                },
                "not a packed U8",
            ),
        ];
        for (what, tensors, want) in cases {
            let p = d
                .path()
                .join(format!("{}.safetensors", what.replace(' ', "_")));
            write_file(&p, tensors, None).unwrap();
            let f = TensorFile::open(&p).unwrap();
            let e = read_qlinear(&f, "a").unwrap_err().to_string();
            assert!(
                e.contains(&p.display().to_string()) && e.contains("`a."),
                "{what}: {e}"
            );
            assert!(e.contains(want), "{what}: {e}");
        }
    }

    /// Guards an MXFP4 triple (no global scale) whose scales lost their dtype being told
    /// "NVFP4 block scales are F8_E4M3", and its UE8M0 bytes tagged F8_E4M3 being told
    /// NVFP4's shape: both messages now name MXFP4's scales.
    #[test]
    fn scales_of_a_triple_without_global_scale_name_mxfp4() {
        let seed: u64 = rand::random();
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let (rows, cols) = (r.gen_range(1..9), 32 * r.gen_range(1..5));
        let d = tempfile::tempdir().unwrap();
        let packed: Vec<u8> = (0..rows * cols / 2).map(|_| r.gen()).collect();
        for (dtype, bytes, want) in [
            (Dtype::F32, 4, "or F8_E8M0 (MXFP4); found F32"),
            (Dtype::F8_E4M3, 1, "MXFP4's 32-element blocks"),
        ] {
            let p = d.path().join(format!("{dtype:?}.safetensors"));
            let scales: Vec<u8> = (0..rows * cols / 32 * bytes)
                .map(|_| r.gen_range(100..140))
                .collect();
            let tensors = vec![
                (
                    TensorSpec::new("w.weight", Dtype::U8, &[rows, cols / 2]),
                    packed.clone(),
                ),
                (
                    TensorSpec::new("w.weight_scale", dtype, &[rows, cols / 32]),
                    scales,
                ),
            ];
            write_file(&p, tensors, None).unwrap();
            let f = TensorFile::open(&p).unwrap();
            let n = find_linear(&f, "w").unwrap().unwrap();
            let e = check_linear(&f, &n).unwrap_err().to_string();
            assert!(
                e.contains(want) && e.contains("w.weight_scale"),
                "seed {seed}: {e}"
            );
        }
    }
}
