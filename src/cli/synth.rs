//! `synth`: write a small (or real-dimension) HF-style DeepSeek checkpoint to test against:
//! BF16 router / shared experts / norms, ModelOpt NVFP4 routed experts with calibrated
//! `input_scale`s, the experts' BF16 originals under `DIR/bf16/`, and optional planted faults
//! recorded in `DIR/planted.json`. Layers are written one at a time, experts a few at a time,
//! so memory stays near one layer however large the preset.

use super::common::{progress, OutArgs};
use crate::checkpoint::writer::{bf16_bytes, f32_bytes, i64_bytes, ShardWriter, TensorSpec};
use crate::error::{Error, Result};
use crate::moe::synthetic::{
    busiest_expert, fill_unseen, quantize_expert, ExpertBf16, Fault, Preset, SyntheticModel,
};
use crate::moe::Expert;
use crate::nvfp4::Fp4Tensor;
use crate::report::{write_atomic, Report, Section, Verdict};
use rayon::prelude::*;
use safetensors::Dtype;
use serde::Serialize;
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::str::FromStr;

#[derive(clap::Args, Debug)]
#[command(
    after_help = "Presets: tiny (hidden 256, moe_intermediate 128, 16 experts top-4, \
4 groups / top-2, 1 shared, 3 layers, first 1 dense), tiny-v4 (the same dims, V4 routing: \
sqrtsoftplus, 1 hash layer, swiglu_limit 10, native V4 names), dsv3 (DeepSeek-V3/R1: 7168, 2048, \
256 top-8, 8/4 groups, first 3 dense), dsv4-flash (approximation: 4096, 2048, 256 top-6, 3 hash \
layers), dsv4-pro (approximation: 7168, 3072, 384 top-6, 3 hash layers).\n\nFaults (--plant \
NAME[@LAYER[:EXPERT]], default: the first MoE layer, its busiest expert): nan-block-scale, \
bad-input-scale, ws2-mismatch, saturated-scales, missing-tensor, swap-gate-up."
)]
pub struct Args {
    /// Output directory (created; must not already hold a config.json unless --force)
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// tiny, tiny-v4, dsv3, dsv4-flash or dsv4-pro
    #[arg(long, value_name = "PRESET", default_value = "tiny")]
    pub preset: Preset,
    /// Layers to write (default: all 3 of a tiny preset; dsv3: the 3 dense layers + 1 MoE
    /// layer; dsv4-*: 1 hash-routed MoE layer)
    #[arg(long, value_name = "N")]
    pub layers: Option<usize>,
    #[arg(long, value_name = "S", default_value_t = 0)]
    pub seed: u64,
    /// Plant a fault: NAME[@LAYER[:EXPERT]] (repeatable)
    #[arg(long, value_name = "FAULT")]
    pub plant: Vec<PlantSpec>,
    /// Overwrite a directory that already holds a checkpoint
    #[arg(long)]
    pub force: bool,
    /// Do not write the experts' BF16 originals under DIR/bf16/ (they are 4x the NVFP4 bytes;
    /// commands then use the dequantized checkpoint as their reference)
    #[arg(long)]
    pub no_originals: bool,
    #[command(flatten)]
    pub out_args: OutArgs,
}

/// `--plant NAME[@LAYER[:EXPERT]]`.
#[derive(Clone, Debug)]
pub struct PlantSpec {
    pub fault: Fault,
    pub layer: Option<usize>,
    pub expert: Option<usize>,
}

impl FromStr for PlantSpec {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let (name, at) = match s.split_once('@') {
            Some((n, a)) => (n, Some(a)),
            None => (s, None),
        };
        let fault: Fault = name.parse()?;
        let num = |v: &str| {
            v.parse::<usize>()
                .map_err(|_| format!("`{s}`: `{v}` is not a number"))
        };
        let (layer, expert) = match at {
            None => (None, None),
            Some(a) => match a.split_once(':') {
                Some((l, e)) => (Some(num(l)?), Some(num(e)?)),
                None => (Some(num(a)?), None),
            },
        };
        Ok(PlantSpec {
            fault,
            layer,
            expert,
        })
    }
}

/// A fault as planted, for planted.json and the report.
#[derive(Clone, Debug, Serialize)]
pub struct Planted {
    pub fault: Fault,
    pub layer: usize,
    pub expert: usize,
    pub tensors: Vec<String>,
    pub detail: String,
}

/// Tensor names: HF V3 (`model.layers.{l}.mlp.experts.{e}.gate_proj`) or native V4
/// (`layers.{l}.ffn.experts.{e}.w1`).
struct Names {
    native: bool,
}

impl Names {
    fn mlp(&self, l: usize) -> String {
        if self.native {
            format!("layers.{l}.ffn")
        } else {
            format!("model.layers.{l}.mlp")
        }
    }
    fn norm(&self, l: usize) -> String {
        if self.native {
            format!("layers.{l}.ffn_norm.weight")
        } else {
            format!("model.layers.{l}.post_attention_layernorm.weight")
        }
    }
    fn proj(&self, which: usize) -> &'static str {
        match (self.native, which) {
            (false, 0) => "gate_proj",
            (false, 1) => "up_proj",
            (false, _) => "down_proj",
            (true, 0) => "w1",
            (true, 1) => "w3",
            (true, _) => "w2",
        }
    }
    fn gate(&self, l: usize) -> String {
        format!("{}.gate.weight", self.mlp(l))
    }
    fn bias(&self, l: usize) -> String {
        if self.native {
            format!("{}.gate.bias", self.mlp(l))
        } else {
            format!("{}.gate.e_score_correction_bias", self.mlp(l))
        }
    }
    fn tid2eid(&self, l: usize) -> String {
        format!("{}.gate.tid2eid", self.mlp(l))
    }
    fn shared(&self, l: usize, which: usize) -> String {
        format!("{}.shared_experts.{}.weight", self.mlp(l), self.proj(which))
    }
    fn dense(&self, l: usize, which: usize) -> String {
        format!("{}.{}.weight", self.mlp(l), self.proj(which))
    }
    fn expert(&self, l: usize, e: usize, which: usize) -> String {
        format!("{}.experts.{e}.{}", self.mlp(l), self.proj(which))
    }
}

fn shard_name(i: usize, n: usize) -> String {
    format!("model-{:05}-of-{:05}.safetensors", i + 1, n)
}

/// Most layers `synth` writes: past any DeepSeek model's depth, and far past the disk a test
/// checkpoint should take (a tiny layer is ~3 MB with its BF16 originals, a dsv3 MoE layer several GB).
const MAX_LAYERS: usize = 128;

pub fn run(args: &Args) -> Result<Report> {
    let preset = args.preset;
    let n_layers = args.layers.unwrap_or(preset.default_layers());
    if n_layers == 0 {
        return Err(Error::usage("--layers must be at least 1"));
    }
    if n_layers > MAX_LAYERS {
        return Err(Error::usage(format!(
            "--layers {n_layers}: at most {MAX_LAYERS} (DeepSeek-V3 has 61; each layer is written in full)"
        )));
    }
    let model = SyntheticModel::new(preset, args.seed).with_layers(n_layers);
    let c = model.config.clone();
    let moe_layers: Vec<usize> = (0..n_layers).filter(|&l| c.is_moe_layer(l)).collect();
    let first_moe = *moe_layers.first().ok_or_else(|| {
        Error::usage(format!(
            "--layers {n_layers} writes only dense layers of {} (first_k_dense_replace {}): nothing to quantize",
            preset.name(),
            c.first_k_dense_replace
        ))
    })?;
    // resolve where each fault goes; the expert may depend on the calibration routing
    let mut plans: Vec<(Fault, usize, Option<usize>)> = vec![];
    for p in &args.plant {
        let l = p.layer.unwrap_or(first_moe);
        if !moe_layers.contains(&l) {
            return Err(Error::usage(format!(
                "--plant {}@{l}: layer {l} is not an MoE layer of this checkpoint (MoE layers: {})",
                p.fault.name(),
                super::layertest::ranges(&moe_layers)
            )));
        }
        if let Some(e) = p.expert.filter(|&e| e >= c.n_routed_experts) {
            return Err(Error::usage(format!(
                "--plant {}@{l}:{e}: the model has {} experts",
                p.fault.name(),
                c.n_routed_experts
            )));
        }
        // a fault planted twice in one place compounds (a second swap undoes the first)
        // while planted.json would list both
        if let Some(&(_, _, e)) = plans.iter().find(|&&(f, pl, pe)| {
            f == p.fault && pl == l && (pe == p.expert || pe.is_none() || p.expert.is_none())
        }) {
            let at = |e: Option<usize>| e.map_or(String::new(), |e| format!(":{e}"));
            return Err(Error::usage(format!(
                "--plant {}@{l}{} and --plant {}@{l}{} plant one fault twice in the same place \
                 (name distinct experts with @LAYER:EXPERT to plant it in two)",
                p.fault.name(),
                at(e),
                p.fault.name(),
                at(p.expert)
            )));
        }
        plans.push((p.fault, l, p.expert));
    }

    let dir = &args.out;
    if dir.join("config.json").exists() && !args.force {
        return Err(Error::usage(format!(
            "{} already holds a checkpoint (config.json); pass --force to overwrite",
            dir.display()
        )));
    }
    // A forced run takes the old checkpoint's markers away first and writes them after every
    // shard: a run killed halfway leaves shards, never an old config.json or index vouching
    // for a mix of old and new shards.
    for marker in [
        "config.json",
        "hf_quant_config.json",
        "planted.json",
        "model.safetensors.index.json",
        "bf16/model.safetensors.index.json",
    ] {
        let p = dir.join(marker);
        if p.is_file() {
            std::fs::remove_file(&p).map_err(|e| Error::io(&p, e))?;
        }
    }
    if !args.no_originals {
        std::fs::create_dir_all(dir.join("bf16")).map_err(|e| Error::io(dir, e))?;
    }

    let names = Names {
        native: preset.native_v4_names(),
    };
    let total_experts = moe_layers.len() * c.n_routed_experts + (n_layers - moe_layers.len());
    let pb = progress(total_experts as u64, "synth", args.out_args.quiet);
    let mut weight_map: BTreeMap<String, String> = BTreeMap::new();
    let mut bf16_map: BTreeMap<String, String> = BTreeMap::new();
    let mut planted: Vec<Planted> = vec![];
    let mut bytes = 0u64;
    for l in 0..n_layers {
        let shard = shard_name(l, n_layers);
        if c.is_moe_layer(l) {
            let bi = moe_layers.iter().position(|&m| m == l).unwrap_or(0);
            let bf16_shard = shard_name(bi, moe_layers.len());
            let layer_plans: Vec<(Fault, Option<usize>)> = plans
                .iter()
                .filter(|p| p.1 == l)
                .map(|p| (p.0, p.2))
                .collect();
            let (w, wb, p) = write_moe_layer(
                &model,
                &names,
                l,
                dir,
                &shard,
                &bf16_shard,
                &layer_plans,
                !args.no_originals,
                &pb,
            )?;
            for n in w {
                weight_map.insert(n, shard.clone());
            }
            for n in wb {
                bf16_map.insert(n, bf16_shard.clone());
            }
            planted.extend(p);
        } else {
            for n in write_dense_layer(&model, &names, l, &dir.join(&shard))? {
                weight_map.insert(n, shard.clone());
            }
            pb.inc(1);
        }
    }
    pb.finish_and_clear();

    for (p, map) in [
        (dir.to_path_buf(), &weight_map),
        (dir.join("bf16"), &bf16_map),
    ] {
        if map.is_empty() && p != *dir {
            continue;
        }
        let mut total = 0u64;
        for f in map.values().collect::<std::collections::BTreeSet<_>>() {
            total += std::fs::metadata(p.join(f)).map(|m| m.len()).unwrap_or(0);
        }
        bytes += total;
        let idx = json!({"metadata": {"total_size": total}, "weight_map": map});
        write_json(&p.join("model.safetensors.index.json"), &idx)?;
    }
    let exclude = if names.native {
        vec![
            "lm_head",
            "*.ffn.gate",
            "*.ffn.shared_experts.*",
            "*.attn.*",
        ]
    } else {
        vec![
            "lm_head",
            "*.mlp.gate",
            "*.shared_experts.*",
            "*.self_attn.*",
        ]
    };
    let mut exclude: Vec<String> = exclude.into_iter().map(String::from).collect();
    for l in 0..c.first_k_dense_replace.min(n_layers) {
        exclude.push(format!("{}.*", names.mlp(l)));
    }
    write_json(&dir.join("config.json"), &config_json(&model, &exclude))?;
    write_json(
        &dir.join("hf_quant_config.json"),
        &json!({
            "producer": {"name": "modelopt", "version": concat!("nvfp4dbg-synth-", env!("CARGO_PKG_VERSION"))},
            "quantization": {
                "quant_algo": "NVFP4",
                "kv_cache_quant_algo": null,
                "group_size": 16,
                "exclude_modules": exclude,
            }
        }),
    )?;
    let planted_json = json!({
        "preset": preset.name(),
        "seed": args.seed,
        "layers": n_layers,
        "faults": planted,
    });
    write_json(&dir.join("planted.json"), &planted_json)?;

    let mut files = Section::kv(
        format!("synth: {} checkpoint in {}", preset.name(), dir.display()),
        &[
            (
                "layers",
                format!(
                    "{n_layers} (MoE layers {})",
                    super::layertest::ranges(&moe_layers)
                ),
            ),
            (
                "dims",
                format!(
                    "hidden {}, moe_intermediate {}, {} experts top-{}, {:?} scoring",
                    c.hidden_size,
                    c.moe_intermediate_size,
                    c.n_routed_experts,
                    c.num_experts_per_tok,
                    c.scoring_func
                ),
            ),
            (
                "names",
                if names.native {
                    "native V4".into()
                } else {
                    "HF V3".into()
                },
            ),
            (
                "tensors",
                format!(
                    "{} (+ {} BF16 originals in bf16/)",
                    weight_map.len(),
                    bf16_map.len()
                ),
            ),
            ("bytes", bytes.to_string()),
        ],
    );
    if matches!(preset, Preset::Dsv4Flash | Preset::Dsv4Pro | Preset::TinyV4) {
        files.row(vec![
            "note".into(),
            "V4 dims and routing approximate DeepSeek-V4; experts are ModelOpt NVFP4, not the native MXFP4".into(),
        ]);
    }
    let mut faults = Section::new("Planted faults", &["fault", "layer", "expert", "what"]);
    for p in &planted {
        faults.row(vec![
            p.fault.name().into(),
            p.layer.to_string(),
            p.expert.to_string(),
            p.detail.clone(),
        ]);
    }
    let headline = format!(
        "wrote {n_layers} layers of `{}` to {} ({} faults planted)",
        preset.name(),
        dir.display(),
        planted.len()
    );
    let mut r = Report::new("synth", Verdict::Pass, headline)
        .summary(json!({
            "out": dir.display().to_string(),
            "preset": preset.name(),
            "layers": n_layers,
            "seed": args.seed,
            "tensors": weight_map.len(),
            "bytes": bytes,
            "planted": planted.len(),
        }))
        .with("planted", &planted)
        .section(files);
    if !planted.is_empty() {
        r = r.section(faults);
    }
    Ok(r)
}

fn write_json(path: &Path, v: &Value) -> Result<()> {
    let text = serde_json::to_string_pretty(v).unwrap_or_default() + "\n";
    write_atomic(path, text.as_bytes())
}

/// An f32 as the decimal a human wrote (1e-6, not 9.99999997e-7).
fn json_f32(v: f32) -> Value {
    v.to_string()
        .parse::<f64>()
        .map_or(Value::Null, |x| json!(x))
}

fn config_json(model: &SyntheticModel, exclude: &[String]) -> Value {
    let c = &model.config;
    let v4 = model.preset.native_v4_names();
    let mut m = Map::new();
    let mut put = |k: &str, v: Value| {
        m.insert(k.to_string(), v);
    };
    put(
        "architectures",
        json!([if v4 {
            "DeepseekV4ForCausalLM"
        } else {
            "DeepseekV3ForCausalLM"
        }]),
    );
    put(
        "model_type",
        json!(if v4 { "deepseek_v4" } else { "deepseek_v3" }),
    );
    put("hidden_size", json!(c.hidden_size));
    put("intermediate_size", json!(c.intermediate_size));
    put("moe_intermediate_size", json!(c.moe_intermediate_size));
    put("n_routed_experts", json!(c.n_routed_experts));
    put("num_experts_per_tok", json!(c.num_experts_per_tok));
    put("n_shared_experts", json!(c.n_shared_experts));
    put("n_group", json!(c.n_group));
    put("topk_group", json!(c.topk_group));
    put("routed_scaling_factor", json_f32(c.routed_scaling_factor));
    put("scoring_func", json!(c.scoring_func));
    put("topk_method", json!("noaux_tc"));
    put("norm_topk_prob", json!(c.norm_topk_prob));
    put("first_k_dense_replace", json!(c.first_k_dense_replace));
    put("moe_layer_freq", json!(1));
    put("num_hidden_layers", json!(c.num_hidden_layers));
    put("rms_norm_eps", json_f32(c.rms_norm_eps));
    put("vocab_size", json!(c.vocab_size));
    put("hidden_act", json!("silu"));
    put("torch_dtype", json!("bfloat16"));
    if v4 || c.num_hash_layers > 0 {
        put("num_hash_layers", json!(c.num_hash_layers));
    }
    if let Some(l) = c.swiglu_limit {
        put("swiglu_limit", json_f32(l));
    }
    put(
        "quantization_config",
        json!({
            "quant_method": "modelopt",
            "quant_algo": "NVFP4",
            "group_size": 16,
            "kv_cache_quant_algo": null,
            "exclude_modules": exclude,
        }),
    );
    Value::Object(m)
}

fn write_dense_layer(
    model: &SyntheticModel,
    names: &Names,
    l: usize,
    path: &Path,
) -> Result<Vec<String>> {
    let c = &model.config;
    let (h, i) = (c.hidden_size, c.intermediate_size);
    let mut specs = vec![TensorSpec::new(names.norm(l), Dtype::BF16, &[h])];
    for which in 0..3 {
        let shape = if which == 2 { [h, i] } else { [i, h] };
        specs.push(TensorSpec::new(names.dense(l, which), Dtype::BF16, &shape));
    }
    let out: Vec<String> = specs.iter().map(|s| s.name.clone()).collect();
    let mut w = ShardWriter::create(path, specs, None)?;
    w.write_next(&bf16_bytes(&model.norm_weight(l)))?;
    for which in 0..3 {
        // one tensor in memory at a time
        w.write_next(&bf16_bytes(&model.dense_weight(l, which)))?;
    }
    w.finish()?;
    Ok(out)
}

fn fp4_specs(base: &str, rows: usize, cols: usize) -> [TensorSpec; 3] {
    [
        TensorSpec::new(format!("{base}.weight"), Dtype::U8, &[rows, cols / 2]),
        TensorSpec::new(
            format!("{base}.weight_scale"),
            Dtype::F8_E4M3,
            &[rows, cols / 16],
        ),
        TensorSpec::new(format!("{base}.weight_scale_2"), Dtype::F32, &[]),
    ]
}

/// An expert ready to write: id, tensors, calibration amaxes, faults planted in it.
type BuiltExpert = (
    usize,
    Expert,
    Option<f32>,
    Option<f32>,
    Vec<(Fault, String)>,
);

type LayerNamesOut = (Vec<String>, Vec<String>, Vec<Planted>);

#[allow(clippy::too_many_arguments)]
fn write_moe_layer(
    model: &SyntheticModel,
    names: &Names,
    l: usize,
    dir: &Path,
    shard: &str,
    bf16_shard: &str,
    plans: &[(Fault, Option<usize>)],
    originals: bool,
    pb: &indicatif::ProgressBar,
) -> Result<LayerNamesOut> {
    let c = &model.config;
    let (h, i, ne) = (c.hidden_size, c.moe_intermediate_size, c.n_routed_experts);
    let router = model.router(l);
    let cal = model.calibration(l, &router)?;
    let busiest = busiest_expert(&cal.routing, ne);
    let plans: Vec<(Fault, usize)> = plans
        .iter()
        .map(|(f, e)| (*f, e.unwrap_or(busiest)))
        .collect();
    let missing: Vec<String> = plans
        .iter()
        .filter(|p| p.0 == Fault::MissingTensor)
        .map(|p| format!("{}.weight_scale", names.expert(l, p.1, 2)))
        .collect();

    // ---- specs: the small tensors, the experts' quantized tensors, then every input_scale
    // (known only once all experts are calibrated) ----
    let mut specs = vec![
        TensorSpec::new(names.norm(l), Dtype::BF16, &[h]),
        TensorSpec::new(names.gate(l), Dtype::BF16, &[ne, h]),
    ];
    if router.e_score_correction_bias.is_some() {
        specs.push(TensorSpec::new(names.bias(l), Dtype::F32, &[ne]));
    }
    if let Some(t) = &router.tid2eid {
        specs.push(TensorSpec::new(
            names.tid2eid(l),
            Dtype::I64,
            &[t.len() / c.num_experts_per_tok, c.num_experts_per_tok],
        ));
    }
    let is = c.n_shared_experts * i;
    if c.n_shared_experts > 0 {
        for which in 0..3 {
            let shape = if which == 2 { [h, is] } else { [is, h] };
            specs.push(TensorSpec::new(names.shared(l, which), Dtype::BF16, &shape));
        }
    }
    let mut bf_specs = vec![];
    for e in 0..ne {
        for which in 0..3 {
            let (rows, cols) = if which == 2 { (h, i) } else { (i, h) };
            let base = names.expert(l, e, which);
            specs.extend(
                fp4_specs(&base, rows, cols)
                    .into_iter()
                    .filter(|s| !missing.contains(&s.name)),
            );
            bf_specs.push(TensorSpec::new(
                format!("{base}.weight"),
                Dtype::BF16,
                &[rows, cols],
            ));
        }
    }
    for e in 0..ne {
        for which in 0..3 {
            specs.push(TensorSpec::new(
                format!("{}.input_scale", names.expert(l, e, which)),
                Dtype::F32,
                &[],
            ));
        }
    }
    let main_names: Vec<String> = specs.iter().map(|s| s.name.clone()).collect();
    let bf_names: Vec<String> = if originals {
        bf_specs.iter().map(|s| s.name.clone()).collect()
    } else {
        vec![]
    };
    let mut w = ShardWriter::create(&dir.join(shard), specs, None)?;
    let mut wb = if originals {
        Some(ShardWriter::create(
            &dir.join("bf16").join(bf16_shard),
            bf_specs,
            None,
        )?)
    } else {
        None
    };

    w.write_next(&bf16_bytes(&model.norm_weight(l)))?;
    w.write_next(&bf16_bytes(&router.weight))?;
    if let Some(b) = &router.e_score_correction_bias {
        w.write_next(&f32_bytes(b))?;
    }
    if let Some(t) = &router.tid2eid {
        w.write_next(&i64_bytes(t))?;
    }
    if c.n_shared_experts > 0 {
        for which in 0..3 {
            w.write_next(&bf16_bytes(&model.shared_weight(l, which)))?;
        }
    }

    let mut planted = vec![];
    let mut amax1 = vec![None; ne];
    let mut amax2 = vec![None; ne];
    // a few experts at a time in parallel, written in order
    let chunk = rayon::current_num_threads().clamp(1, 16);
    for start in (0..ne).step_by(chunk) {
        let end = (start + chunk).min(ne);
        let built: Vec<BuiltExpert> = (start..end)
            .into_par_iter()
            .map(|e| {
                let bf: ExpertBf16 = model.expert_bf16(l, e);
                let (a1, a2) = model.expert_amax(&cal, e, &bf);
                let mut ex = quantize_expert(&bf, h, i, [0.0; 3], originals);
                let mut done = vec![];
                for (f, _) in plans.iter().filter(|p| {
                    p.1 == e && !matches!(p.0, Fault::BadInputScale | Fault::MissingTensor)
                }) {
                    done.push((*f, f.plant(&mut ex, &bf)));
                }
                (e, ex, a1, a2, done)
            })
            .collect();
        for (e, ex, a1, a2, done) in built {
            amax1[e] = a1;
            amax2[e] = a2;
            for (which, q) in [&ex.w1, &ex.w3, &ex.w2].into_iter().enumerate() {
                let base = names.expert(l, e, which);
                write_fp4(&mut w, &base, &q.weight, &missing)?;
                if let (Some(wb), Some(orig)) = (wb.as_mut(), q.original.as_deref()) {
                    // swap-gate-up swaps the NVFP4 tensors only: the originals stay in place
                    wb.write_next(&bf16_bytes(orig))?;
                }
            }
            for (f, detail) in done {
                planted.push(Planted {
                    fault: f,
                    layer: l,
                    expert: e,
                    tensors: fault_tensors(names, f, l, e),
                    detail,
                });
            }
            pb.inc(1);
        }
    }
    let s1 = fill_unseen(&amax1);
    let s2 = fill_unseen(&amax2);
    for e in 0..ne {
        let mut sc = [s1[e], s1[e], s2[e]];
        if plans
            .iter()
            .any(|p| p.0 == Fault::BadInputScale && p.1 == e)
        {
            sc[0] /= 1000.0;
            sc[1] /= 1000.0;
            planted.push(Planted {
                fault: Fault::BadInputScale,
                layer: l,
                expert: e,
                tensors: fault_tensors(names, Fault::BadInputScale, l, e),
                detail: format!(
                    "gate_proj/up_proj input_scale {:e} instead of {:e} (1000x too small)",
                    sc[0], s1[e]
                ),
            });
        }
        for v in sc {
            w.write_next(&f32_bytes(&[v]))?;
        }
    }
    for p in plans.iter().filter(|p| p.0 == Fault::MissingTensor) {
        planted.push(Planted {
            fault: p.0,
            layer: l,
            expert: p.1,
            tensors: fault_tensors(names, p.0, l, p.1),
            detail: "down_proj.weight_scale left out of the shard and the index".into(),
        });
    }
    w.finish()?;
    if let Some(wb) = wb {
        wb.finish()?;
    }
    Ok((main_names, bf_names, planted))
}

fn write_fp4(w: &mut ShardWriter, base: &str, t: &Fp4Tensor, missing: &[String]) -> Result<()> {
    w.write_next(&t.packed)?;
    if !missing.contains(&format!("{base}.weight_scale")) {
        w.write_next(&t.scales)?;
    }
    w.write_next(&f32_bytes(&[t.scale_2]))
}

fn fault_tensors(names: &Names, f: Fault, l: usize, e: usize) -> Vec<String> {
    let x = |which: usize, what: &str| format!("{}.{what}", names.expert(l, e, which));
    match f {
        Fault::NanBlockScale | Fault::SaturatedScales => vec![x(0, "weight_scale")],
        Fault::BadInputScale => vec![x(0, "input_scale"), x(1, "input_scale")],
        Fault::Ws2Mismatch => vec![x(0, "weight_scale_2"), x(1, "weight_scale_2")],
        Fault::MissingTensor => vec![x(2, "weight_scale")],
        Fault::SwapGateUp => vec![x(0, "weight"), x(1, "weight")],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plant_specs_parse() {
        let p: PlantSpec = "nan-block-scale@2:7".parse().unwrap();
        assert_eq!(
            (p.fault, p.layer, p.expert),
            (Fault::NanBlockScale, Some(2), Some(7))
        );
        let p: PlantSpec = "swap-gate-up@1".parse().unwrap();
        assert_eq!((p.layer, p.expert), (Some(1), None));
        assert!("nan-block-scale@x".parse::<PlantSpec>().is_err());
        assert!("bogus".parse::<PlantSpec>().is_err());
    }
}
