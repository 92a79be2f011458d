//! One MoE layer out of a checkpoint: config, router (+ bias, + V4 hash table), the routed
//! experts as NVFP4 linears (with their BF16 originals from `bf16/` when shipped), the shared
//! experts and the norm in front of the block. HF-V3 and native-V4 names.

use super::config::ModelConfig;
use super::formats::{self, find_linear, read_linear, Convention, LinearNames};
use super::hf::Checkpoint;
use super::names::{inventory, LayerNames, Naming, Proj, Scheme};
use super::source::TensorSource;
use crate::error::{Error, Result};
use crate::moe::{DenseMlp, Expert, MoeLayer, QLinear, Router};
use crate::nvfp4::{quantize_weight_nvfp4, Format, ScaleProblem};
use rayon::prelude::*;
use std::collections::BTreeMap;
use std::path::Path;

/// A checkpoint opened for MoE work: tensors, validated config and the naming its keys use.
#[derive(Debug)]
pub struct MoeCheckpoint {
    pub ckpt: Checkpoint,
    pub config: ModelConfig,
    pub naming: Naming,
    layers: BTreeMap<usize, LayerNames>,
}

impl MoeCheckpoint {
    pub fn open(path: &Path) -> Result<MoeCheckpoint> {
        let ckpt = Checkpoint::open(path)?;
        let naming = Naming::detect(ckpt.names()).ok_or_else(|| {
            Error::bad_file(
                path,
                "no MoE expert tensors: expected `model.layers.{l}.mlp.experts.{e}.*` (HF), \
                 `layers.{l}.ffn.experts.{e}.*` (native V4) or `...mlp.experts.w13_weight` (vLLM)",
            )
        })?;
        let layers = inventory(&naming, ckpt.names());
        let config = ckpt.config()?;
        Ok(MoeCheckpoint {
            ckpt,
            config,
            naming,
            layers,
        })
    }

    /// Indices of the MoE layers: those holding MoE tensors that config.json does not make
    /// dense (`first_k_dense_replace`, `moe_layer_freq`) nor leave out (`num_hidden_layers`).
    pub fn moe_layers(&self) -> Vec<usize> {
        let k = self.config.moe.first_k_dense_replace;
        self.layers
            .keys()
            .copied()
            .filter(|&l| l >= k && self.ruled_out_past_k(l).is_none())
            .collect()
    }

    /// Why config.json rules out layer `l` (at or past `first_k_dense_replace`) as an MoE
    /// layer an engine builds: past `num_hidden_layers`, or off `moe_layer_freq`.
    fn ruled_out_past_k(&self, l: usize) -> Option<String> {
        let (n, freq) = (
            self.config.moe.num_hidden_layers,
            self.config.moe_layer_freq,
        );
        if l >= n {
            Some(format!(
                "config.json's num_hidden_layers = {n} ends the model at layer {}",
                n.saturating_sub(1)
            ))
        } else if !l.is_multiple_of(freq) {
            Some(format!(
                "config.json's moe_layer_freq = {freq} makes it a dense MLP (MoE blocks only \
                 where layer % {freq} == 0)"
            ))
        } else {
            None
        }
    }

    /// Layers holding routed-expert tensors, whatever config.json says of them.
    pub fn expert_layers(&self) -> Vec<usize> {
        self.layers.keys().copied().collect()
    }

    /// Layers holding routed-expert tensors that config.json's `first_k_dense_replace` makes
    /// dense MLPs: an engine builds a dense MLP there and never runs those experts (`audit`
    /// flags them).
    pub fn dense_by_config(&self) -> Vec<usize> {
        let k = self.config.moe.first_k_dense_replace;
        self.layers.keys().copied().filter(|&l| l < k).collect()
    }

    /// Is `layer` an MoE layer an engine would run? Bad input naming why not: no expert
    /// tensors, or config.json making it dense (then a verdict would be about weights nobody
    /// uses). The one check every command taking a layer goes through.
    pub fn check_layer(&self, layer: usize) -> Result<()> {
        let moe = self.moe_layers();
        if moe.contains(&layer) {
            return Ok(());
        }
        let k = self.config.moe.first_k_dense_replace;
        let listed = if moe.is_empty() {
            "none".to_string()
        } else {
            ranges(&moe)
        };
        let dense = match k {
            1 => "layer 0".to_string(),
            _ => format!("layers 0-{}", k.saturating_sub(1)),
        };
        let what = match (self.layers.get(&layer), self.ruled_out_past_k(layer)) {
            (Some(inv), Some(why)) if layer >= k => format!(
                "layer {layer} is not an MoE layer: {why}, although layer {layer} holds {} \
                 routed experts. An engine never runs them, so a verdict on them would be about \
                 weights nobody uses (MoE layers: {listed})",
                inv.experts.len()
            ),
            (Some(inv), _) if layer < k => format!(
                "layer {layer} is not an MoE layer: config.json's first_k_dense_replace = {k} makes \
                 {dense} dense MLPs, although layer {layer} holds {} routed experts. An engine \
                 builds a dense MLP there and never runs them, so a verdict on them would be about \
                 weights nobody uses (MoE layers: {listed}; `audit` flags those tensors)",
                inv.experts.len()
            ),
            (_, _) if k > 0 => format!(
                "layer {layer} is not an MoE layer of this checkpoint (MoE layers: {listed}; \
                 config.json's first_k_dense_replace = {k} makes {dense} dense)"
            ),
            (_, _) => format!(
                "layer {layer} is not an MoE layer of this checkpoint (MoE layers: {listed})"
            ),
        };
        Err(Error::bad_file(self.ckpt.path(), what))
    }

    /// A walk through every MoE layer (multilayer's default) is one an engine takes only where
    /// the checkpoint and config.json agree on the MoE layers. Bad input naming the layer where
    /// they do not: routed experts config.json makes dense (`first_k_dense_replace`,
    /// `moe_layer_freq`), or an MoE layer config.json promises that holds no MoE tensors
    /// between the first and last MoE layer held, or holding a dense MLP instead. The walk
    /// would step over such a layer, and pass, while the engine runs it on weights it cannot
    /// load. Layers past `num_hidden_layers` are left to `audit` (DeepSeek stores its MTP
    /// layer there).
    pub fn check_moe_walk(&self) -> Result<()> {
        let (k, n) = (
            self.config.moe.first_k_dense_replace,
            self.config.moe.num_hidden_layers,
        );
        for &l in self.layers.keys().filter(|&&l| l < n) {
            self.check_layer(l)?;
        }
        let moe = self.moe_layers();
        let (Some(&first), Some(&last)) = (moe.first(), moe.last()) else {
            return Ok(());
        };
        let freq = self.config.moe_layer_freq.max(1);
        for l in (k..last).filter(|l| l.is_multiple_of(freq) && !moe.contains(l)) {
            let dense = format!("{}.weight", self.naming.dense_mlp(l, Proj::Gate));
            let holds = if self.ckpt.contains(&dense) {
                format!("holds a dense MLP (`{dense}`) and no routed experts")
            } else if l > first {
                format!(
                    "holds no MoE tensors (between MoE layers {first} and {last}, which it holds)"
                )
            } else {
                continue;
            };
            return Err(Error::bad_file(
                self.ckpt.path(),
                format!(
                    "layer {l} {holds}, but config.json (first_k_dense_replace = {k}, \
                     num_hidden_layers = {n}) makes it an MoE layer: an engine builds a router \
                     and routed experts there and finds none, while a walk through the MoE \
                     layers would step over it (`nvfp4dbg audit` lists every such layer)"
                ),
            ));
        }
        Ok(())
    }

    pub fn load_layer(&self, layer: usize) -> Result<MoeLayer> {
        self.check_layer(layer)?;
        load_layer(self, layer)
    }

    /// Does [`MoeCheckpoint::load_layer`] read layer `layer`'s experts' BF16 originals
    /// (bf16/ holds them)? They load as f32: 4 bytes a weight beside the NVFP4 half byte.
    pub fn ships_originals(&self, layer: usize) -> bool {
        self.ckpt.originals().is_some_and(|o| {
            o.contains(&format!(
                "{}.weight",
                self.naming.expert(layer, 0, Proj::Gate)
            ))
        })
    }

    /// What [`MoeCheckpoint::load_layer`] refuses in layer `layer` short of its routed experts:
    /// the router (weight, selection bias, hash table) read and checked, and the shared expert
    /// present as config.json says. Reads no expert weight (`audit` runs it on every layer).
    pub fn check_structure(&self, layer: usize) -> Result<()> {
        self.check_layer(layer)?;
        let mut cfg = self.config.moe.clone();
        router_parts(self, layer, &mut cfg)?;
        shared_present(self, layer, &cfg).map(|_| ())
    }
}

/// Indices of the MoE layers of a checkpoint (see [`MoeCheckpoint::moe_layers`]).
pub fn list_moe_layers(path: &Path) -> Result<Vec<usize>> {
    Ok(MoeCheckpoint::open(path)?.moe_layers())
}

/// Load MoE layer `layer` of the checkpoint at `path` (a directory, or a file next to its
/// config.json).
pub fn load_moe_layer(path: &Path, layer: usize) -> Result<MoeLayer> {
    MoeCheckpoint::open(path)?.load_layer(layer)
}

fn ranges(v: &[usize]) -> String {
    let mut out: Vec<String> = vec![];
    let mut i = 0;
    while i < v.len() {
        let mut j = i;
        while j + 1 < v.len() && v[j + 1] == v[j] + 1 {
            j += 1;
        }
        out.push(if i == j {
            v[i].to_string()
        } else {
            format!("{}-{}", v[i], v[j])
        });
        i = j + 1;
    }
    out.join(",")
}

fn load_layer(mc: &MoeCheckpoint, layer: usize) -> Result<MoeLayer> {
    mc.config.check_routable()?;
    let ck = &mc.ckpt;
    let n = &mc.naming;
    let mut cfg = mc.config.moe.clone();
    let Some(inv) = mc.layers.get(&layer) else {
        return Err(Error::bad_file(
            ck.path(),
            format!("layer {layer} holds no MoE tensors"),
        ));
    };
    if n.scheme == Scheme::VllmFused || inv.fused {
        return Err(Error::bad_file(
            ck.path(),
            "this is a vLLM engine dump (fused w13/w2 experts), not a checkpoint: compare it \
             with `compare-weights`",
        ));
    }
    let (e_count, hidden, inter) = (
        cfg.n_routed_experts,
        cfg.hidden_size,
        cfg.moe_intermediate_size,
    );

    let (weight, bias, tid2eid) = router_parts(mc, layer, &mut cfg)?;

    // routed experts
    let originals = ck.originals().filter(|_| mc.ships_originals(layer));
    let experts = (0..e_count)
        .into_par_iter()
        .map(|e| {
            let lin = |p: Proj, rows: usize, cols: usize| {
                load_expert_linear(ck, originals, &n.expert(layer, e, p), rows, cols)
            };
            Ok(Expert {
                w1: lin(Proj::Gate, inter, hidden)?,
                w3: lin(Proj::Up, inter, hidden)?,
                w2: lin(Proj::Down, hidden, inter)?,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    expect_promised_format(mc, layer)?;

    // shared experts
    let shared = if shared_present(mc, layer, &cfg)? {
        Some(load_shared(ck, n, layer, &cfg)?)
    } else {
        None
    };

    let norm_weight = vector(ck, &n.norm(layer), hidden, "[hidden_size]")?;
    if norm_weight.is_none() {
        // a checkpoint without RMSNorm weights runs on unit ones; one that holds them for
        // other layers lost this one (engines refuse a missing key, or run it untrained)
        let held: Vec<usize> = mc
            .layers
            .keys()
            .copied()
            .filter(|&l| ck.contains(&n.norm(l)))
            .collect();
        if !held.is_empty() {
            return Err(Error::bad_file(
                ck.path(),
                format!(
                    "tensor {} is missing (layer {layer}'s RMSNorm weight before the MoE), while \
                     the checkpoint holds it for layers {}",
                    n.norm(layer),
                    ranges(&held)
                ),
            ));
        }
    }

    Ok(MoeLayer {
        index: layer,
        config: cfg,
        router: Router {
            weight,
            e_score_correction_bias: bias,
            tid2eid,
        },
        experts,
        shared,
        norm_weight,
    })
}

/// Bad input when config.json's quantization config promises another format than layer
/// `layer`'s stored experts hold (`quant_algo: FP8` over NVFP4 tensors, `quant_method: fp8`
/// with no algorithm): engines pick their loader and kernels from it, so what they run is not
/// the layer tested here. ModelOpt's MIXED_PRECISION names its algorithms per layer and
/// passes; experts stored in a float dtype (quantized here) have nothing to disagree with.
fn expect_promised_format(mc: &MoeCheckpoint, layer: usize) -> Result<()> {
    let Some(q) = &mc.config.quant else {
        return Ok(());
    };
    let Some(ln) = find_linear(&mc.ckpt, &mc.naming.expert(layer, 0, Proj::Gate))? else {
        return Ok(());
    };
    let held = match ln.convention {
        Convention::Mxfp4 => Format::Mxfp4,
        _ => Format::Nvfp4,
    };
    let promised = match (&q.algo, q.format()) {
        (Some(a), _) if a.to_ascii_uppercase().contains("MIXED") => return Ok(()),
        (_, Some(f)) if f == held => return Ok(()),
        (Some(a), _) => format!("quant_algo {a}"),
        (None, _) => match &q.method {
            crate::checkpoint::QuantMethod::Other(m) => {
                format!("quant_method \"{m}\" and no algorithm")
            }
            _ => return Ok(()),
        },
    };
    Err(Error::bad_file(
        &q.source,
        format!(
            "states {promised}, but layer {layer}'s experts hold {} tensors (`{}`): engines pick their loader and kernels from the config and read these bytes as another format; state the format the tensors hold (`nvfp4dbg audit` checks the whole checkpoint)",
            held.name().to_uppercase(),
            ln.weight_scale
        ),
    ))
}

/// Layer `layer`'s router as `load_layer` reads and checks it: the weight, the selection bias
/// and the hash table (`cfg.vocab_size` set from it where config.json has none).
#[allow(clippy::type_complexity)]
fn router_parts(
    mc: &MoeCheckpoint,
    layer: usize,
    cfg: &mut crate::moe::MoeConfig,
) -> Result<(Vec<f32>, Option<Vec<f32>>, Option<Vec<i64>>)> {
    let (ck, n) = (&mc.ckpt, &mc.naming);
    let (e_count, hidden) = (cfg.n_routed_experts, cfg.hidden_size);
    let rw = n.router_weight(layer);
    let (weight, shape) = read_dense(ck, &rw)?.ok_or_else(|| {
        Error::bad_tensor(
            ck.path(),
            &rw,
            "missing: the router weight of this MoE layer",
        )
    })?;
    expect_shape(
        ck,
        &rw,
        &shape,
        &[e_count, hidden],
        "[n_routed_experts, hidden_size] from config.json",
    )?;
    expect_finite(ck, &rw, &weight, &shape)?;
    let rb = n.router_bias(layer);
    let bias = vector(ck, &rb, e_count, "[n_routed_experts]")?;
    if bias.is_none()
        && mc.config.topk_method.as_deref() == Some("noaux_tc")
        && !cfg.is_hash_layer(layer)
    {
        return Err(Error::bad_tensor(
            ck.path(),
            &rb,
            "missing: config.json's topk_method = \"noaux_tc\" selects experts on score + \
             e_score_correction_bias, and an engine would run this layer with an uninitialized \
             or zero bias",
        ));
    }
    let tk = n.tid2eid(layer);
    let tid2eid = if ck.contains(&tk) {
        let t = ck.info(&tk)?.clone();
        let k = cfg.num_experts_per_tok;
        if t.shape.len() != 2 || t.shape[1] != k {
            return Err(Error::bad_tensor(
                ck.file_of(&tk),
                &tk,
                format!(
                    "shape {:?} is not [vocab, num_experts_per_tok = {k}]",
                    t.shape
                ),
            ));
        }
        let ids = ck.to_i64(&tk)?;
        if let Some(i) = ids.iter().position(|&v| v < 0 || v as usize >= e_count) {
            return Err(Error::bad_tensor(
                ck.file_of(&tk),
                &tk,
                format!(
                    "entry [{}, {}] = {} is not an expert id in 0..{e_count}",
                    i / k,
                    i % k,
                    ids[i]
                ),
            ));
        }
        // a row names k distinct experts: a repeated one runs the token through it twice
        let repeated = ids.chunks(k).enumerate().find_map(|(r, row)| {
            let j = (1..row.len()).find(|&j| row[..j].contains(&row[j]))?;
            Some((r, j, row[j]))
        });
        if let Some((r, j, x)) = repeated {
            return Err(Error::bad_tensor(
                ck.file_of(&tk),
                &tk,
                format!(
                    "row {r} names expert {x} twice (entry [{r}, {j}]): each token's row holds \
                     {k} distinct experts, or the token runs through that expert twice"
                ),
            ));
        }
        if cfg.vocab_size == 0 {
            cfg.vocab_size = t.shape[0];
        }
        Some(ids)
    } else {
        if cfg.is_hash_layer(layer) {
            return Err(Error::bad_tensor(
                ck.path(),
                &tk,
                format!(
                    "missing: layer {layer} routes by hash (num_hash_layers = {}) and needs its tid2eid table",
                    cfg.num_hash_layers
                ),
            ));
        }
        None
    };
    Ok((weight, bias, tid2eid))
}

/// Whether layer `layer` holds a shared expert, all three of its projections; bad input where
/// config.json's `n_shared_experts` says otherwise.
fn shared_present(mc: &MoeCheckpoint, layer: usize, cfg: &crate::moe::MoeConfig) -> Result<bool> {
    let (ck, n) = (&mc.ckpt, &mc.naming);
    let gate0 = format!("{}.weight", n.shared_expert(layer, Proj::Gate));
    let present = if ck.contains(&gate0)
        || find_linear(ck, &n.shared_expert(layer, Proj::Gate))?.is_some()
    {
        if mc.config.n_shared_experts_stated == Some(0) {
            return Err(Error::bad_tensor(
                ck.file_of(&gate0),
                &gate0,
                format!(
                    "layer {layer} holds a shared expert, but config.json has n_shared_experts = 0: \
                     an engine builds none and drops it"
                ),
            ));
        }
        // all three projections, or an engine builds a shared expert of zeros
        for p in [Proj::Up, Proj::Down] {
            let base = n.shared_expert(layer, p);
            if !ck.contains(&format!("{base}.weight")) && find_linear(ck, &base)?.is_none() {
                return Err(Error::bad_tensor(
                    ck.path(),
                    &format!("{base}.weight"),
                    "missing: a shared expert needs gate, up and down",
                ));
            }
        }
        true
    } else if cfg.n_shared_experts > 0 {
        return Err(Error::bad_tensor(
            ck.path(),
            &gate0,
            format!(
                "missing: config.json has n_shared_experts = {} but layer {layer} has no shared expert",
                cfg.n_shared_experts
            ),
        ));
    } else {
        false
    };
    Ok(present)
}

/// The optional 1-D float tensor `name` of `len` values (`what` its shape in words), checked
/// for shape and finiteness; `None` where the checkpoint has none.
fn vector(ck: &Checkpoint, name: &str, len: usize, what: &str) -> Result<Option<Vec<f32>>> {
    if !ck.contains(name) {
        return Ok(None);
    }
    expect_shape(ck, name, &ck.info(name)?.shape, &[len], what)?;
    let v = ck.to_f32(name)?;
    expect_finite(ck, name, &v, &[len])?;
    Ok(Some(v))
}

fn expect_shape(
    ck: &Checkpoint,
    name: &str,
    got: &[usize],
    want: &[usize],
    what: &str,
) -> Result<()> {
    if got != want {
        return Err(Error::bad_tensor(
            ck.file_of(name),
            name,
            format!("shape {got:?}, expected {want:?} ({what})"),
        ));
    }
    Ok(())
}

/// Bad input naming the first NaN/Inf of the float tensor `name` (row-major, `shape`): an
/// engine computes with it, and the layer's output (or, for a BF16 original, the reference)
/// would be NaN with no tensor to blame.
fn expect_finite(ck: &Checkpoint, name: &str, v: &[f32], shape: &[usize]) -> Result<()> {
    let Some(i) = v.iter().position(|x| !x.is_finite()) else {
        return Ok(());
    };
    let mut at = vec![];
    let mut rest = i;
    for &d in shape.iter().rev() {
        at.push(rest % d.max(1));
        rest /= d.max(1);
    }
    at.reverse();
    let at: Vec<String> = at.iter().map(|x| x.to_string()).collect();
    Err(Error::bad_tensor(
        ck.file_of(name),
        name,
        format!("element [{}] is {}", at.join(", "), v[i]),
    ))
}

/// Bad input when an expert's weight_scale_2 (`ws2`, dequant direction) cannot be a global
/// scale: an engine's `alpha = input_scale * weight_scale_2` zeroes (0), flips (< 0) or blows
/// up (NaN/Inf) that expert's output. (A tiny positive one is a near-zero weight, not a fault.)
/// Also when it looks stored in the other convention's direction (`formats::
/// convention_suspicion`: weights past 2688): the layer would be tested, against a reference
/// dequantized with the same scale, on weights no engine should load.
fn expect_usable_global_scale(ck: &Checkpoint, ln: &LinearNames, q: &QLinear) -> Result<()> {
    let ws2 = q.weight.scale_2;
    if let (Some(g), None) = (&ln.global_scale, ScaleProblem::of(ws2)) {
        let convention = if g.ends_with("global_scale") {
            Convention::CompressedTensors
        } else {
            Convention::Modelopt
        };
        let smax = formats::max_block_scale(q.weight.format, &q.weight.scales);
        let stored = ck.tensor_scalar_f32(g)?;
        if let Some(s) = formats::convention_suspicion(convention, stored, smax) {
            return Err(Error::bad_tensor(
                ck.file_of(g),
                g,
                format!("{s} (`nvfp4dbg audit` lists every global scale in the wrong direction)"),
            ));
        }
    }
    let why = match ScaleProblem::of(ws2) {
        Some(ScaleProblem::NotFinite) => "every output of this expert becomes NaN/Inf",
        Some(ScaleProblem::Zero) => "a global scale must be positive: this expert's output is zero",
        Some(ScaleProblem::Negative) => {
            "a global scale must be positive: an engine's alpha flips this expert's output"
        }
        Some(ScaleProblem::ReciprocalOverflows) | None => return Ok(()),
    };
    let name = ln.global_scale.as_deref().unwrap_or(&ln.weight);
    Err(Error::bad_tensor(
        ck.file_of(name),
        name,
        format!("gives weight_scale_2 = {ws2}: {why}"),
    ))
}

/// A weight that may be stored quantized or in a float dtype, as f32 `[rows, cols]`.
fn read_dense(src: &dyn TensorSource, name: &str) -> Result<Option<(Vec<f32>, Vec<usize>)>> {
    let base = name.strip_suffix(".weight").unwrap_or(name);
    if let Some(ln) = find_linear(src, base)? {
        let q = read_linear(src, &ln)?;
        let shape = vec![q.weight.rows, q.weight.cols];
        return Ok(Some((q.weight.dequantize(), shape)));
    }
    if !src.contains(name) {
        return Ok(None);
    }
    let t = src.tensor_info(name)?;
    if t.shape.len() != 2 {
        return Err(Error::bad_tensor(
            src.file_of(name),
            name,
            format!(
                "a linear weight is 2-D [out, in]; found shape {:?}",
                t.shape
            ),
        ));
    }
    let shape = t.shape.clone();
    Ok(Some((src.tensor_f32(name)?, shape)))
}

/// An expert projection: the NVFP4 linear, or — for a BF16 checkpoint — the float weight
/// quantized here exactly as `quantize` does, with the float weight kept as the original.
fn load_expert_linear(
    ck: &Checkpoint,
    originals: Option<&Checkpoint>,
    base: &str,
    rows: usize,
    cols: usize,
) -> Result<QLinear> {
    let wname = format!("{base}.weight");
    let mut q = match find_linear(ck, base)? {
        Some(ln) => {
            let q = read_linear(ck, &ln)?;
            expect_usable_global_scale(ck, &ln, &q)?;
            q
        }
        None => {
            let (w, shape) = read_dense(ck, &wname)?.ok_or_else(|| {
                Error::bad_tensor(
                    ck.path(),
                    &wname,
                    "missing: every routed expert needs gate, up and down",
                )
            })?;
            expect_shape(ck, &wname, &shape, &[rows, cols], "from config.json")?;
            if !cols.is_multiple_of(16) {
                return Err(Error::bad_tensor(
                    ck.file_of(&wname),
                    &wname,
                    format!("in-features {cols} are not a multiple of 16: cannot be NVFP4"),
                ));
            }
            expect_finite(ck, &wname, &w, &shape)?;
            let (t, _) = quantize_weight_nvfp4(&w, rows, cols);
            return Ok(QLinear {
                weight: t,
                input_scale: None,
                original: Some(w),
            });
        }
    };
    let (r, c) = (q.weight.rows, q.weight.cols);
    if (r, c) != (rows, cols) {
        return Err(Error::bad_tensor(
            ck.file_of(&wname),
            &wname,
            format!(
                "holds a [{r}, {c}] weight (packed [{r}, {}]); config.json says [{rows}, {cols}]",
                c / 2
            ),
        ));
    }
    if let Some(o) = originals {
        let t = o.info(&wname)?;
        if t.shape != [rows, cols] {
            return Err(Error::bad_tensor(
                o.file_of(&wname),
                &wname,
                format!(
                    "BF16 original has shape {:?}, the quantized weight is [{rows}, {cols}]",
                    t.shape
                ),
            ));
        }
        let w = o.to_f32(&wname)?;
        expect_finite(o, &wname, &w, &t.shape)?;
        q.original = Some(w);
    }
    Ok(q)
}

fn load_shared(
    ck: &Checkpoint,
    n: &Naming,
    layer: usize,
    cfg: &crate::moe::MoeConfig,
) -> Result<DenseMlp> {
    let h = cfg.hidden_size;
    let src_of = |name: &str| -> &Checkpoint {
        match ck.originals() {
            Some(o) if o.contains(name) => o,
            _ => ck,
        }
    };
    let get = |p: Proj| -> Result<(Vec<f32>, Vec<usize>, String)> {
        let name = format!("{}.weight", n.shared_expert(layer, p));
        let src = src_of(&name);
        let quantized = find_linear(src, &n.shared_expert(layer, p))?.is_some();
        let (mut w, shape) = read_dense(src, &name)?.ok_or_else(|| {
            Error::bad_tensor(
                ck.path(),
                &name,
                "missing: a shared expert needs gate, up and down",
            )
        })?;
        if quantized {
            // DenseMlp weights are BF16-exact: a quantized shared expert is used as the BF16
            // model a dequantized checkpoint would be.
            w.iter_mut()
                .for_each(|v| *v = half::bf16::from_f32(*v).to_f32());
        }
        Ok((w, shape, name))
    };
    let (w1, s1, n1) = get(Proj::Gate)?;
    let (w3, s3, n3) = get(Proj::Up)?;
    let (w2, s2, n2) = get(Proj::Down)?;
    for (w, s, name) in [(&w1, &s1, &n1), (&w3, &s3, &n3), (&w2, &s2, &n2)] {
        expect_finite(src_of(name), name, w, s)?;
    }
    let inter = s1[0];
    expect_shape(
        ck,
        &n1,
        &s1,
        &[inter, h],
        "[shared intermediate, hidden_size]",
    )?;
    expect_shape(ck, &n3, &s3, &[inter, h], "the gate's shape")?;
    expect_shape(
        ck,
        &n2,
        &s2,
        &[h, inter],
        "[hidden_size, shared intermediate]",
    )?;
    if cfg.n_shared_experts > 0 && inter != cfg.moe_intermediate_size * cfg.n_shared_experts {
        return Err(Error::bad_tensor(
            ck.file_of(&n1),
            &n1,
            format!(
                "shared intermediate {inter} != moe_intermediate_size × n_shared_experts = {} × {}",
                cfg.moe_intermediate_size, cfg.n_shared_experts
            ),
        ));
    }
    Ok(DenseMlp {
        intermediate: inter,
        w1,
        w3,
        w2,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::hf::{CONFIG_FILE, ORIGINALS_DIR, SINGLE_FILE};
    use crate::checkpoint::writer::{bf16_bytes, f32_bytes, i64_bytes, write_file, TensorSpec};
    use rand::{Rng, SeedableRng};
    use rand_distr::{Distribution, StandardNormal};
    use safetensors::Dtype;

    struct Dims {
        h: usize,
        i: usize,
        e: usize,
        k: usize,
        vocab: usize,
    }

    fn err<T>(r: Result<T>) -> String {
        match r {
            Ok(_) => panic!("expected an error"),
            Err(e) => e.to_string(),
        }
    }

    fn bf16_round(v: Vec<f32>) -> Vec<f32> {
        v.into_iter()
            .map(|x| half::bf16::from_f32(x).to_f32())
            .collect()
    }

    /// A tiny checkpoint: layer 0 dense, layers 1..=2 MoE; returns the originals by name.
    fn write_tiny(
        dir: &Path,
        n: &Naming,
        d: &Dims,
        seed: u64,
        hash: bool,
    ) -> BTreeMap<String, Vec<f32>> {
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let mut randn = |len: usize, s: f32| -> Vec<f32> {
            bf16_round(
                (0..len)
                    .map(|_| {
                        let v: f32 = StandardNormal.sample(&mut r);
                        s * v
                    })
                    .collect(),
            )
        };
        let mut q = vec![];
        let mut o = vec![];
        let mut orig = BTreeMap::new();
        for l in 1..=2 {
            q.push((
                TensorSpec::new(n.router_weight(l), Dtype::BF16, &[d.e, d.h]),
                bf16_bytes(&randn(d.e * d.h, 0.1)),
            ));
            q.push((
                TensorSpec::new(n.router_bias(l), Dtype::F32, &[d.e]),
                f32_bytes(&randn(d.e, 0.01)),
            ));
            q.push((
                TensorSpec::new(n.norm(l), Dtype::BF16, &[d.h]),
                bf16_bytes(&randn(d.h, 1.0)),
            ));
            if hash && l == 1 {
                let ids: Vec<i64> = (0..d.vocab * d.k)
                    .map(|i| ((i * 7 + l) % d.e) as i64)
                    .collect();
                q.push((
                    TensorSpec::new(n.tid2eid(l), Dtype::I64, &[d.vocab, d.k]),
                    i64_bytes(&ids),
                ));
            }
            for p in Proj::ALL {
                let (rows, cols) = if p == Proj::Down {
                    (d.h, d.i)
                } else {
                    (d.i, d.h)
                };
                let name = format!("{}.weight", n.shared_expert(l, p));
                q.push((
                    TensorSpec::new(&name, Dtype::BF16, &[rows, cols]),
                    bf16_bytes(&randn(rows * cols, 0.05)),
                ));
                for e in 0..d.e {
                    let base = n.expert(l, e, p);
                    let w = randn(rows * cols, 0.05);
                    let (t, _) = quantize_weight_nvfp4(&w, rows, cols);
                    q.push((
                        TensorSpec::new(format!("{base}.weight"), Dtype::U8, &[rows, cols / 2]),
                        t.packed.clone(),
                    ));
                    q.push((
                        TensorSpec::new(
                            format!("{base}.weight_scale"),
                            Dtype::F8_E4M3,
                            &[rows, cols / 16],
                        ),
                        t.scales.clone(),
                    ));
                    q.push((
                        TensorSpec::new(format!("{base}.weight_scale_2"), Dtype::F32, &[]),
                        f32_bytes(&[t.scale_2]),
                    ));
                    q.push((
                        TensorSpec::new(format!("{base}.input_scale"), Dtype::F32, &[]),
                        f32_bytes(&[0.01 + e as f32 * 1e-3]),
                    ));
                    o.push((
                        TensorSpec::new(format!("{base}.weight"), Dtype::BF16, &[rows, cols]),
                        bf16_bytes(&w),
                    ));
                    orig.insert(format!("{base}.weight"), w);
                }
            }
        }
        write_file(&dir.join(SINGLE_FILE), q, None).unwrap();
        std::fs::create_dir_all(dir.join(ORIGINALS_DIR)).unwrap();
        write_file(&dir.join(ORIGINALS_DIR).join(SINGLE_FILE), o, None).unwrap();
        let cfg = serde_json::json!({
            "hidden_size": d.h, "moe_intermediate_size": d.i, "intermediate_size": 4 * d.i,
            "n_routed_experts": d.e, "num_experts_per_tok": d.k, "n_shared_experts": 1,
            "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": true,
            "scoring_func": if hash { "sqrtsoftplus" } else { "sigmoid" },
            "first_k_dense_replace": 1, "num_hidden_layers": 3,
            "num_hash_layers": if hash { 2 } else { 0 }, "swiglu_limit": if hash { Some(10.0) } else { None },
        });
        std::fs::write(dir.join(CONFIG_FILE), cfg.to_string()).unwrap();
        orig
    }

    #[test]
    fn loads_hf_v3_and_native_v4_layers() {
        let seed: u64 = rand::random();
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let d = Dims {
            h: 16 * r.gen_range(1..4),
            i: 16 * r.gen_range(1..3),
            e: 4,
            k: 2,
            vocab: 11,
        };
        for (n, hash) in [(Naming::hf_v3(), false), (Naming::native_v4(), true)] {
            let dir = tempfile::tempdir().unwrap();
            let orig = write_tiny(dir.path(), &n, &d, seed, hash);
            assert_eq!(list_moe_layers(dir.path()).unwrap(), vec![1, 2]);
            let mc = MoeCheckpoint::open(dir.path()).unwrap();
            assert_eq!(mc.naming, n);
            let layer = mc.load_layer(2).unwrap();
            assert_eq!(layer.experts.len(), d.e, "seed {seed}");
            assert_eq!(layer.router.weight.len(), d.e * d.h);
            assert_eq!(
                layer
                    .router
                    .e_score_correction_bias
                    .as_ref()
                    .map(|b| b.len()),
                Some(d.e)
            );
            assert_eq!(layer.norm_weight.as_ref().map(|b| b.len()), Some(d.h));
            let s = layer.shared.as_ref().unwrap();
            assert_eq!((s.intermediate, s.w2.len()), (d.i, d.h * d.i));
            for (e, ex) in layer.experts.iter().enumerate() {
                for (p, q) in [
                    (Proj::Gate, &ex.w1),
                    (Proj::Up, &ex.w3),
                    (Proj::Down, &ex.w2),
                ] {
                    let w = &orig[&format!("{}.weight", n.expert(2, e, p))];
                    assert_eq!(q.original.as_ref(), Some(w), "seed {seed}");
                    let (t, _) = quantize_weight_nvfp4(w, q.out_features(), q.in_features());
                    assert_eq!(q.weight, t, "seed {seed}");
                    assert_eq!(q.input_scale, Some(0.01 + e as f32 * 1e-3));
                }
            }
            assert_eq!(layer.experts[0].w2.out_features(), d.h);
            if hash {
                let l1 = mc.load_layer(1).unwrap();
                let t = l1.router.tid2eid.unwrap();
                assert_eq!(t.len(), d.vocab * d.k);
                assert_eq!(l1.config.vocab_size, d.vocab);
                assert_eq!(l1.config.swiglu_limit, Some(10.0));
                // num_hash_layers = 2: layer 2 routes by score and ships no table
                assert!(layer.router.tid2eid.is_none());
            }
            let e = err(mc.load_layer(0));
            assert!(e.contains("layer 0") && e.contains("1-2"), "{e}");
        }
    }

    /// A layer holding experts that config.json's first_k_dense_replace makes dense is not
    /// an MoE layer: not listed, not loaded, and the refusal says why.
    #[test]
    fn a_layer_config_json_makes_dense_is_not_an_moe_layer() {
        let seed: u64 = rand::random();
        let d = Dims {
            h: 32,
            i: 16,
            e: 4,
            k: 2,
            vocab: 5,
        };
        let dir = tempfile::tempdir().unwrap();
        write_tiny(dir.path(), &Naming::hf_v3(), &d, seed, false);
        let cfg = dir.path().join(CONFIG_FILE);
        let mut v: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&cfg).unwrap()).unwrap();
        v["first_k_dense_replace"] = 2.into();
        std::fs::write(&cfg, v.to_string()).unwrap();
        let mc = MoeCheckpoint::open(dir.path()).unwrap();
        assert_eq!((mc.moe_layers(), mc.dense_by_config()), (vec![2], vec![1]));
        assert_eq!(list_moe_layers(dir.path()).unwrap(), vec![2]);
        let e = err(mc.load_layer(1));
        assert!(
            e.contains("config.json's first_k_dense_replace = 2")
                && e.contains("layer 1 is not an MoE layer")
                && e.contains("MoE layers: 2"),
            "{e}"
        );
        assert_eq!(mc.load_layer(2).unwrap().experts.len(), d.e, "seed {seed}");
    }

    #[test]
    fn hash_layer_without_table_and_shape_mismatch_are_bad_input() {
        let seed: u64 = rand::random();
        let d = Dims {
            h: 32,
            i: 16,
            e: 4,
            k: 2,
            vocab: 5,
        };
        let dir = tempfile::tempdir().unwrap();
        let n = Naming::native_v4();
        write_tiny(dir.path(), &n, &d, seed, true);
        let cfg = dir.path().join(CONFIG_FILE);
        let mut v: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&cfg).unwrap()).unwrap();
        v["num_hash_layers"] = 3.into();
        std::fs::write(&cfg, v.to_string()).unwrap();
        let e = err(load_moe_layer(dir.path(), 2));
        assert!(e.contains("tid2eid") && e.contains("hash"), "{e}");
        // config disagreeing with the tensors
        v["num_hash_layers"] = 0.into();
        v["moe_intermediate_size"] = 32.into();
        std::fs::write(&cfg, v.to_string()).unwrap();
        let e = err(load_moe_layer(dir.path(), 2));
        assert!(
            e.contains("config.json says") && e.contains("layers.2.ffn.experts."),
            "{e}"
        );
        std::fs::remove_file(&cfg).unwrap();
        let e = err(load_moe_layer(dir.path(), 2));
        assert!(e.contains("config.json"), "{e}");
    }

    /// Guards a hash table row naming one expert twice being loaded as is: the token would
    /// run through that expert twice with two weights.
    #[test]
    fn hash_table_row_naming_an_expert_twice_is_bad_input() {
        use crate::checkpoint::file::TensorFile;
        let seed: u64 = rand::random();
        let d = Dims {
            h: 32,
            i: 16,
            e: 4,
            k: 2,
            vocab: 5,
        };
        let dir = tempfile::tempdir().unwrap();
        let n = Naming::native_v4();
        write_tiny(dir.path(), &n, &d, seed, true);
        assert!(load_moe_layer(dir.path(), 1).is_ok(), "seed {seed}");
        let path = dir.path().join(SINGLE_FILE);
        let row = (seed % d.vocab as u64) as usize;
        let tensors: Vec<(TensorSpec, Vec<u8>)> = {
            let f = TensorFile::open(&path).unwrap();
            let names: Vec<String> = f.names().map(String::from).collect();
            names
                .iter()
                .map(|name| {
                    let t = f.info(name).unwrap();
                    let mut b = f.slice(t).to_vec();
                    if *name == n.tid2eid(1) {
                        let first = row * d.k * 8;
                        let (a, rest) = b.split_at_mut(first + 8);
                        rest[..8].copy_from_slice(&a[first..]);
                    }
                    (TensorSpec::new(name.clone(), t.dtype, &t.shape), b)
                })
                .collect()
        };
        write_file(&path, tensors, None).unwrap();
        let e = err(load_moe_layer(dir.path(), 1));
        assert!(
            e.contains(&n.tid2eid(1)) && e.contains(&format!("row {row} names expert")),
            "seed {seed}: {e}"
        );
    }
}
