//! `layertest --dump-inputs DIR`: exactly what a kernel of kernels/include/nvfp4dbg_moe.h
//! receives, as safetensors named after the header's fields, plus what it should produce; and
//! the reader `compare-outputs` rebuilds the layer from (it needs nothing else).
//!
//! `DIR/inputs.safetensors` (one EP rank holding every expert, global ids, identity map):
//! `hidden_states` BF16 [T, H]; `a1_gscale`, `a2_gscale` F32 [E]; `w1`, `w3` U8 [E, I, H/2],
//! `w2` U8 [E, H, I/2]; `w1_scale`, `w3_scale` F8_E4M3 [E, I, H/16], `w2_scale` [E, H, I/16]
//! (linear) and `*_scale_swizzled` F8_E4M3 [E, pad128(rows), pad4(cols/16)] (128x4); `w*_scale_2`
//! F32 [E]; `topk_ids` I32 [T, K] (global); `topk_weights` F32 [T, K]; `expert_map` I32 [E].
//! The scalars (dims, swiglu_limit, id convention) are in the metadata.
//!
//! `DIR/expected.safetensors`: F32 [T, H] each: `reference_out` (the BF16 reference layer),
//! `nvfp4_out` (our NVFP4 layer), `nvfp4_routed` (our routed experts' weighted sum: what the
//! kernel must write), `shared_out` (the shared experts, to add to a routed output). Its
//! metadata records a digest of every tensor of both files; [`read`] checks them and recomputes
//! what it can ([`verify`]), so no reader judges against an edited or mixed-up dump.

mod verify;
pub use verify::{Agreement, DumpCheck, TOKEN_MAX_REL_ERR};

use super::super::config::{MoeConfig, ScoringFunc};
use super::super::{ActScales, Expert, MoeLayer, QLinear, Router, Routing};
use crate::checkpoint::file::TensorFile;
use crate::checkpoint::writer::{f32_bytes, write_file, TensorSpec};
use crate::error::{Error, Result};
use crate::nvfp4::layout::{swizzle, swizzled_dims};
use crate::nvfp4::{Format, Fp4Tensor};
use safetensors::Dtype;
use std::collections::BTreeMap;
use std::path::Path;

pub const INPUTS: &str = "inputs.safetensors";
pub const EXPECTED: &str = "expected.safetensors";
/// `format` metadata value of the inputs file.
pub const FORMAT: &str = "nvfp4dbg-moe-inputs";
/// `format` metadata value of the expected file.
pub const EXPECTED_FORMAT: &str = "nvfp4dbg-moe-expected";

/// What `expected.safetensors` holds, all `[T, H]`.
pub struct Expected {
    pub reference_out: Vec<f32>,
    pub nvfp4_out: Vec<f32>,
    pub nvfp4_routed: Vec<f32>,
    pub shared_out: Vec<f32>,
}

fn u32s_le(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Write `DIR/inputs.safetensors` and `DIR/expected.safetensors` (atomically, each).
#[allow(clippy::too_many_arguments)]
pub fn write(
    dir: &Path,
    layer: &MoeLayer,
    hidden: &[f32],
    routing: &Routing,
    gs1: &[f32],
    gs2: &[f32],
    expected: &Expected,
    origin: &str,
) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let c = &layer.config;
    let (h, i, e, t, k) = (
        c.hidden_size,
        c.moe_intermediate_size,
        c.n_routed_experts,
        routing.tokens,
        routing.top_k,
    );
    if let Some(x) = layer
        .experts
        .iter()
        .find(|x| x.w1.weight.format != Format::Nvfp4)
    {
        return Err(Error::usage(format!(
            "--dump-inputs writes the NVFP4 kernel ABI; this layer's experts are {}",
            x.w1.weight.format.name()
        )));
    }
    let mut tensors: Vec<(TensorSpec, Vec<u8>)> = vec![
        (
            TensorSpec::new("hidden_states", Dtype::BF16, &[t, h]),
            crate::checkpoint::writer::bf16_bytes(hidden),
        ),
        (
            TensorSpec::new("a1_gscale", Dtype::F32, &[e]),
            f32_bytes(gs1),
        ),
        (
            TensorSpec::new("a2_gscale", Dtype::F32, &[e]),
            f32_bytes(gs2),
        ),
    ];
    type Pick = fn(&Expert) -> &QLinear;
    let mats: [(&str, Pick, usize, usize); 3] = [
        ("w1", |x| &x.w1, i, h),
        ("w3", |x| &x.w3, i, h),
        ("w2", |x| &x.w2, h, i),
    ];
    for (name, pick, rows, cols) in mats {
        let kb = cols / 16;
        let (pr, pk) = swizzled_dims(rows, kb);
        let mut codes = Vec::with_capacity(e * rows * cols / 2);
        let mut lin = Vec::with_capacity(e * rows * kb);
        let mut swz = Vec::with_capacity(e * pr * pk);
        let mut s2 = Vec::with_capacity(e);
        for x in &layer.experts {
            let w = &pick(x).weight;
            codes.extend_from_slice(&w.packed);
            lin.extend_from_slice(&w.scales);
            swz.extend(swizzle(&w.scales, rows, kb));
            s2.push(w.scale_2);
        }
        tensors.push((
            TensorSpec::new(name, Dtype::U8, &[e, rows, cols / 2]),
            codes,
        ));
        tensors.push((
            TensorSpec::new(format!("{name}_scale"), Dtype::F8_E4M3, &[e, rows, kb]),
            lin,
        ));
        tensors.push((
            TensorSpec::new(
                format!("{name}_scale_swizzled"),
                Dtype::F8_E4M3,
                &[e, pr, pk],
            ),
            swz,
        ));
        tensors.push((
            TensorSpec::new(format!("{name}_scale_2"), Dtype::F32, &[e]),
            f32_bytes(&s2),
        ));
    }
    let map: Vec<i32> = (0..e as i32).collect();
    tensors.push((
        TensorSpec::new("topk_ids", Dtype::I32, &[t, k]),
        u32s_le(&routing.topk_ids),
    ));
    tensors.push((
        TensorSpec::new("topk_weights", Dtype::F32, &[t, k]),
        f32_bytes(&routing.topk_weights),
    ));
    tensors.push((
        TensorSpec::new("expert_map", Dtype::I32, &[e]),
        u32s_le(&map),
    ));
    let mut meta = BTreeMap::new();
    for (key, v) in [
        ("format", FORMAT.to_string()),
        (
            "abi_version",
            crate::backend::cuda::plugin::ABI_VERSION.to_string(),
        ),
        ("tokens", t.to_string()),
        ("hidden", h.to_string()),
        ("intermediate", i.to_string()),
        ("num_experts", e.to_string()),
        ("num_local_experts", e.to_string()),
        ("top_k", k.to_string()),
        (
            "swiglu_limit",
            c.swiglu_limit.map_or("none".into(), |v| format!("{v:?}")),
        ),
        ("id_convention", "global".into()),
        ("ep_rank", "0".into()),
        ("ep_size", "1".into()),
        ("layer", layer.index.to_string()),
        ("origin", origin.to_string()),
        (
            "output",
            "the kernel writes the routed experts' weighted sum, [tokens, hidden]; hand it back \
             as tensor `output` (F32, BF16 or F16) to `nvfp4dbg compare-outputs DIR FILE`"
                .into(),
        ),
    ] {
        meta.insert(key.to_string(), v);
    }
    let out = |n: &str, v: &[f32]| (TensorSpec::new(n, Dtype::F32, &[t, h]), f32_bytes(v));
    let outputs = vec![
        out("reference_out", &expected.reference_out),
        out("nvfp4_out", &expected.nvfp4_out),
        out("nvfp4_routed", &expected.nvfp4_routed),
        out("shared_out", &expected.shared_out),
    ];
    let mut digests = verify::digest_metadata(&tensors, &outputs);
    digests.insert("format".into(), EXPECTED_FORMAT.into());
    write_file(&dir.join(INPUTS), tensors, Some(meta))?;
    write_file(&dir.join(EXPECTED), outputs, Some(digests))
}

/// A dumped layer, rebuilt: routed experts only (no router, no shared experts).
pub struct Dumped {
    pub layer: MoeLayer,
    pub hidden: Vec<f32>,
    pub routing: Routing,
    pub scales: ActScales,
    pub expected: Expected,
    /// How `expected` was verified against the inputs.
    pub check: DumpCheck,
}

fn meta_usize(f: &TensorFile, key: &str) -> Result<usize> {
    let v = f
        .metadata()
        .get(key)
        .ok_or_else(|| Error::bad_file(f.path(), format!("metadata `{key}` missing")))?;
    v.parse()
        .map_err(|_| Error::bad_file(f.path(), format!("metadata `{key}` = {v:?} is not a count")))
}

fn tensor<'a>(f: &'a TensorFile, name: &str, dtype: Dtype, shape: &[usize]) -> Result<&'a [u8]> {
    let t = f.info(name)?;
    if t.dtype != dtype || t.shape != shape {
        return Err(Error::bad_tensor(
            f.path(),
            name,
            format!("{:?} {:?}, expected {dtype:?} {shape:?}", t.dtype, t.shape),
        ));
    }
    f.bytes(name)
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Read a `--dump-inputs` directory back, and check that `expected.safetensors` is what its
/// inputs give (exit 2 naming the tensor when it is not: an edited or mixed-up dump).
pub fn read(dir: &Path) -> Result<Dumped> {
    let f = TensorFile::open(&dir.join(INPUTS))?;
    if f.metadata().get("format").map(String::as_str) != Some(FORMAT) {
        return Err(Error::bad_file(
            f.path(),
            format!("not a `layertest --dump-inputs` file (metadata format != {FORMAT})"),
        ));
    }
    let x = TensorFile::open(&dir.join(EXPECTED))?;
    let digests_verified = verify::check_digests(&f, &x)?;
    let (layer, hidden, routing, scales) = read_inputs(&f)?;
    let expected = read_expected(&x, routing.tokens, layer.config.hidden_size)?;
    let mut d = Dumped {
        layer,
        hidden,
        routing,
        scales,
        expected,
        check: DumpCheck::default(),
    };
    d.check = verify::check_expected(&d, x.path(), digests_verified)?;
    Ok(d)
}

/// The four `[t, h]` tensors of `expected.safetensors`.
fn read_expected(x: &TensorFile, t: usize, h: usize) -> Result<Expected> {
    let get = |n: &str| -> Result<Vec<f32>> { Ok(f32s(tensor(x, n, Dtype::F32, &[t, h])?)) };
    Ok(Expected {
        reference_out: get("reference_out")?,
        nvfp4_out: get("nvfp4_out")?,
        nvfp4_routed: get("nvfp4_routed")?,
        shared_out: get("shared_out")?,
    })
}

/// The layer, hidden states, routing and activation scales of `inputs.safetensors`.
fn read_inputs(f: &TensorFile) -> Result<(MoeLayer, Vec<f32>, Routing, ActScales)> {
    let (t, h, i, e, k) = (
        meta_usize(f, "tokens")?,
        meta_usize(f, "hidden")?,
        meta_usize(f, "intermediate")?,
        meta_usize(f, "num_experts")?,
        meta_usize(f, "top_k")?,
    );
    if h == 0 || i == 0 || e == 0 || k == 0 || h % 16 != 0 || i % 16 != 0 || k > e {
        return Err(Error::bad_file(
            f.path(),
            format!("dims hidden {h}, intermediate {i}, experts {e}, top_k {k} do not make an NVFP4 MoE layer"),
        ));
    }
    let limit = match f.metadata().get("swiglu_limit").map(String::as_str) {
        None | Some("none") => None,
        Some(v) => Some(
            v.parse::<f32>()
                .map_err(|_| Error::bad_file(f.path(), format!("metadata swiglu_limit = {v:?}")))?,
        ),
    };
    let hidden: Vec<f32> = tensor(f, "hidden_states", Dtype::BF16, &[t, h])?
        .chunks_exact(2)
        .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
        .collect();
    let gs1 = f32s(tensor(f, "a1_gscale", Dtype::F32, &[e])?);
    let gs2 = f32s(tensor(f, "a2_gscale", Dtype::F32, &[e])?);
    let mut mats: Vec<Vec<Fp4Tensor>> = vec![];
    for (name, rows, cols) in [("w1", i, h), ("w3", i, h), ("w2", h, i)] {
        let codes = tensor(f, name, Dtype::U8, &[e, rows, cols / 2])?;
        let scales = tensor(
            f,
            &format!("{name}_scale"),
            Dtype::F8_E4M3,
            &[e, rows, cols / 16],
        )?;
        let s2 = f32s(tensor(f, &format!("{name}_scale_2"), Dtype::F32, &[e])?);
        let (cn, sn) = (rows * cols / 2, rows * cols / 16);
        mats.push(
            (0..e)
                .map(|x| Fp4Tensor {
                    format: Format::Nvfp4,
                    rows,
                    cols,
                    packed: codes[x * cn..(x + 1) * cn].to_vec(),
                    scales: scales[x * sn..(x + 1) * sn].to_vec(),
                    scale_2: s2[x],
                })
                .collect(),
        );
    }
    let ids: Vec<i32> = tensor(f, "topk_ids", Dtype::I32, &[t, k])?
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let weights = f32s(tensor(f, "topk_weights", Dtype::F32, &[t, k])?);
    let q = |w: Fp4Tensor| QLinear {
        weight: w,
        input_scale: None,
        original: None,
    };
    let mut it = mats.into_iter();
    let (w1, w3, w2) = (
        it.next().unwrap_or_default(),
        it.next().unwrap_or_default(),
        it.next().unwrap_or_default(),
    );
    let experts: Vec<Expert> = w1
        .into_iter()
        .zip(w3)
        .zip(w2)
        .map(|((a, b), c)| Expert {
            w1: q(a),
            w3: q(b),
            w2: q(c),
        })
        .collect();
    let config = MoeConfig {
        hidden_size: h,
        moe_intermediate_size: i,
        intermediate_size: i,
        n_routed_experts: e,
        num_experts_per_tok: k,
        n_shared_experts: 0,
        n_group: 1,
        topk_group: 1,
        routed_scaling_factor: 1.0,
        scoring_func: ScoringFunc::Sigmoid,
        norm_topk_prob: false,
        first_k_dense_replace: 0,
        num_hidden_layers: 1,
        num_hash_layers: 0,
        swiglu_limit: limit,
        rms_norm_eps: 1e-6,
        vocab_size: 1,
    };
    let layer = MoeLayer {
        index: 0,
        config,
        router: Router {
            weight: vec![0.0; e * h],
            e_score_correction_bias: None,
            tid2eid: None,
        },
        experts,
        shared: None,
        norm_weight: None,
    };
    let routing = Routing {
        tokens: t,
        top_k: k,
        topk_ids: ids,
        topk_weights: weights,
    };
    crate::moe::forward::check_routing(&layer, &routing, t)
        .map_err(|err| Error::bad_tensor(f.path(), "topk_ids", err.to_string()))?;
    Ok((layer, hidden, routing, ActScales::Fixed { gs1, gs2 }))
}
