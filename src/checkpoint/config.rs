//! `config.json` (and `hf_quant_config.json`) → a validated [`ModelConfig`].
//!
//! Field names are the HF DeepSeek ones (DESIGN.md §3); the names of DeepSeek's own inference
//! code (`dim`, `moe_inter_dim`, `n_activated_experts`, `n_expert_groups`, `n_limited_groups`,
//! `score_func`, `route_scale`, `n_dense_layers`, `n_layers`, `inter_dim`) are accepted as
//! aliases, since native-V4 checkpoints ship that style of config.
//!
//! Defaults for optional fields, chosen as DeepSeek's HF configs and transformers'
//! `DeepseekV3Config` behave, and so that a missing field never restricts routing:
//! - `scoring_func`: `sigmoid` (transformers' DeepSeek-V3 hard-codes sigmoid; every V3/R1
//!   config.json says so explicitly);
//! - `norm_topk_prob`: `true` (DeepSeek-V3/R1 config.json and transformers' default);
//! - `n_group`: 1, `topk_group`: `n_group` (a missing group limit keeps every group);
//! - `routed_scaling_factor`: 1.0 (DeepSeek-V2's configuration_deepseek.py default;
//!   transformers' `DeepseekV3Config` and DeepSeek-V3's own give 2.5);
//! - `n_shared_experts`, `first_k_dense_replace`, `num_hash_layers`: 0; `swiglu_limit`: none
//!   (as is 0, DeepSeek-V4's own "no clamp");
//! - `rms_norm_eps`: 1e-6; `intermediate_size`: `moe_intermediate_size`;
//!   `vocab_size`: 0 (unknown; a hash layer's `tid2eid` then gives it);
//! - `num_hidden_layers`: the number of layers the checkpoint's tensor names show.
//!
//! Engines fill a missing field from their own config class, and those disagree
//! ([`ENGINE_DEFAULTS`]): [`ModelConfig::unstated`] lists the ones config.json leaves out.

use crate::error::{Error, Result};
use crate::moe::{MoeConfig, ScoringFunc};
use crate::nvfp4::Format;
use serde::Serialize;
use serde_json::{Map, Value};
use std::path::{Path, PathBuf};

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ModelConfig {
    pub path: PathBuf,
    pub model_type: Option<String>,
    pub architectures: Vec<String>,
    pub moe: MoeConfig,
    pub quant: Option<QuantConfig>,
    /// `moe_layer_freq` (default 1): engines build an MoE block only where
    /// `layer % moe_layer_freq == 0` (and `layer >= first_k_dense_replace`).
    pub moe_layer_freq: usize,
    /// `topk_method`: `noaux_tc` selects experts on `score + e_score_correction_bias`.
    pub topk_method: Option<String>,
    /// `n_shared_experts` as config.json states it (`moe.n_shared_experts` defaults a missing
    /// one to 0): an explicit 0 makes an engine drop a shared expert the checkpoint holds.
    pub n_shared_experts_stated: Option<usize>,
    /// The [`ENGINE_DEFAULTS`] fields config.json does not state, with the value used here
    /// instead: engines fill them from different defaults.
    pub unstated: Vec<Unstated>,
}

impl ModelConfig {
    /// Bad input when config.json routes in a way the router here does not: DeepSeek-V2's
    /// `group_limited_greedy` ranks groups by their best score, the router here ranks them as
    /// V3's `noaux_tc` does (the sum of the two best, on score + bias). Only with a group limit
    /// (`topk_group < n_group`) does the ranking pick other experts. Checked where a layer is
    /// loaded to run, not on parsing: `audit` reads such a config and reports on it.
    pub fn check_routable(&self) -> Result<()> {
        let m = &self.moe;
        if self.topk_method.as_deref() == Some("group_limited_greedy") && m.topk_group < m.n_group {
            return Err(Error::bad_file(
                &self.path,
                format!(
                    "field `topk_method`: \"group_limited_greedy\" (DeepSeek-V2: groups ranked by \
                     their best expert) with topk_group {} of n_group {} is not supported; the \
                     router ranks groups as DeepSeek-V3's noaux_tc does (the sum of their two \
                     best scores)",
                    m.topk_group, m.n_group
                ),
            ));
        }
        Ok(())
    }
}

/// A field whose default differs between the config classes engines load config.json with:
/// transformers' `DeepseekV3Config`, DeepSeek-V3's own `configuration_deepseek.py` (remote
/// code) and DeepSeek-V2's (`model_type: deepseek_v2`, whose classes engines also serve V3
/// through). V3's two agree on every MoE field; V2's differs on each of these.
pub struct EngineDefault {
    pub field: &'static str,
    /// DeepSeek's native names for the same field.
    pub aliases: &'static [&'static str],
    pub transformers_v3: &'static str,
    pub deepseek_v3: &'static str,
    pub deepseek_v2: &'static str,
}

/// The MoE fields whose defaults differ (transformers / DeepSeek-V3 / DeepSeek-V2). Not here,
/// because the defaults agree or a missing one is bad input already: `moe_layer_freq` (1
/// everywhere; transformers makes every layer past `first_k_dense_replace` MoE),
/// `n_routed_experts` and `num_experts_per_tok` (required).
pub const ENGINE_DEFAULTS: [EngineDefault; 8] = [
    EngineDefault {
        field: "routed_scaling_factor",
        aliases: &["route_scale"],
        transformers_v3: "2.5",
        deepseek_v3: "2.5",
        deepseek_v2: "1.0",
    },
    EngineDefault {
        field: "n_group",
        aliases: &["n_expert_groups"],
        transformers_v3: "8",
        deepseek_v3: "8",
        deepseek_v2: "None (no group limit)",
    },
    EngineDefault {
        field: "topk_group",
        aliases: &["n_limited_groups"],
        transformers_v3: "4",
        deepseek_v3: "4",
        deepseek_v2: "None (no group limit)",
    },
    EngineDefault {
        field: "norm_topk_prob",
        aliases: &[],
        transformers_v3: "true",
        deepseek_v3: "true",
        deepseek_v2: "false",
    },
    EngineDefault {
        field: "scoring_func",
        aliases: &["score_func"],
        transformers_v3: "sigmoid (hard-coded)",
        deepseek_v3: "sigmoid",
        deepseek_v2: "softmax",
    },
    EngineDefault {
        field: "topk_method",
        aliases: &[],
        transformers_v3: "noaux_tc (hard-coded)",
        deepseek_v3: "noaux_tc",
        deepseek_v2: "gready (no e_score_correction_bias)",
    },
    EngineDefault {
        field: "first_k_dense_replace",
        aliases: &["n_dense_layers"],
        transformers_v3: "3",
        deepseek_v3: "3",
        deepseek_v2: "0",
    },
    EngineDefault {
        field: "n_shared_experts",
        aliases: &[],
        transformers_v3: "1",
        deepseek_v3: "1",
        deepseek_v2: "None (no shared expert)",
    },
];

/// An [`ENGINE_DEFAULTS`] field config.json leaves out, and what was used for it here.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Unstated {
    pub field: &'static str,
    pub used: String,
}

impl Unstated {
    pub fn defaults(&self) -> Option<&'static EngineDefault> {
        ENGINE_DEFAULTS.iter().find(|d| d.field == self.field)
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum QuantMethod {
    Modelopt,
    CompressedTensors,
    Other(String),
}

impl QuantMethod {
    /// As config.json spells it.
    pub fn name(&self) -> &str {
        match self {
            QuantMethod::Modelopt => "modelopt",
            QuantMethod::CompressedTensors => "compressed-tensors",
            QuantMethod::Other(s) => s,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct QuantConfig {
    /// The file it came from (config.json or hf_quant_config.json).
    pub source: PathBuf,
    pub method: QuantMethod,
    /// `NVFP4`, `MXFP4`, `FP8`, ... (compressed-tensors: derived from `format` / the weight scheme).
    pub algo: Option<String>,
    pub group_size: Option<usize>,
    /// Modules left unquantized (`exclude_modules` / `ignore`).
    pub exclude_modules: Vec<String>,
    pub kv_cache_quant_algo: Option<String>,
}

impl QuantConfig {
    /// The FP4 format the config promises, if any.
    pub fn format(&self) -> Option<Format> {
        match self.algo.as_deref().map(|s| s.to_ascii_uppercase()) {
            Some(a) if a.contains("NVFP4") => Some(Format::Nvfp4),
            Some(a) if a.contains("MXFP4") => Some(Format::Mxfp4),
            _ => None,
        }
    }
}

/// An exclude_modules / ignore entry as a regex over module names: compressed-tensors'
/// `re:` entries as regexes anchored at the start (Python's `re.match`), the others as
/// whole-name globs (`*` any run of characters, ModelOpt's and vLLM's reading).
pub fn exclude_pattern(pat: &str) -> Option<regex::Regex> {
    let src = match pat.strip_prefix("re:") {
        Some(r) => format!("^(?:{r})"),
        None => format!("^{}$", regex::escape(pat).replace(r"\*", ".*")),
    };
    regex::Regex::new(&src).ok()
}

/// A compiled exclude list: which modules (names without `.weight`) it leaves unquantized.
/// Entries that are no valid pattern cover nothing.
#[derive(Clone, Debug, Default)]
pub struct ExcludeList {
    patterns: Vec<regex::Regex>,
}

impl ExcludeList {
    pub fn new(entries: &[String]) -> ExcludeList {
        ExcludeList {
            patterns: entries.iter().filter_map(|p| exclude_pattern(p)).collect(),
        }
    }

    pub fn covers(&self, module: &str) -> bool {
        self.patterns.iter().any(|re| re.is_match(module))
    }
}

/// Read `config.json` at `path`, and `hf_quant_config.json` next to it when present.
/// `layers_hint` fills a missing `num_hidden_layers`.
pub fn read_config(path: &Path, layers_hint: Option<usize>) -> Result<ModelConfig> {
    let text = super::file::read_regular(path)?;
    let mut cfg = parse_config(path, &text, layers_hint)?;
    if cfg.quant.is_none() {
        let hq = path.with_file_name(super::hf::HF_QUANT_CONFIG_FILE);
        if hq.is_file() {
            let t = super::file::read_regular(&hq)?;
            cfg.quant = Some(parse_hf_quant_config(&hq, &t)?);
        }
    }
    Ok(cfg)
}

/// Parse the text of a config.json; errors name `path` and the field.
pub fn parse_config(path: &Path, text: &[u8], layers_hint: Option<usize>) -> Result<ModelConfig> {
    let root: Value = serde_json::from_slice(text)
        .map_err(|e| Error::bad_file(path, format!("not valid JSON: {e}")))?;
    let root = root
        .as_object()
        .ok_or_else(|| Error::bad_file(path, "is not a JSON object"))?;
    // multimodal wrappers keep the language model's config under text_config
    let obj = match root.get("text_config").and_then(|v| v.as_object()) {
        Some(t) if !has(root, &["hidden_size", "dim"]) => t,
        _ => root,
    };
    let f = Fields { path, obj };
    let hidden_size = f.req_usize(&["hidden_size", "dim"])?;
    let moe_intermediate_size = f.req_usize(&["moe_intermediate_size", "moe_inter_dim"])?;
    let n_routed_experts = f.req_usize(&["n_routed_experts"])?;
    let num_experts_per_tok = f.req_usize(&["num_experts_per_tok", "n_activated_experts"])?;
    let n_group = f.opt_usize(&["n_group", "n_expert_groups"])?.unwrap_or(1);
    let topk_group = f
        .opt_usize(&["topk_group", "n_limited_groups"])?
        .unwrap_or(n_group);
    let num_hidden_layers = match f.opt_usize(&["num_hidden_layers", "n_layers"])? {
        Some(n) => n,
        None => layers_hint.ok_or_else(|| {
            f.bad(
                "num_hidden_layers",
                "missing, and the checkpoint's tensor names do not show the layers".into(),
            )
        })?,
    };
    let scoring_func = match f.opt_str(&["scoring_func", "score_func"])? {
        None => ScoringFunc::Sigmoid,
        Some(s) => match s.to_ascii_lowercase().as_str() {
            "sigmoid" => ScoringFunc::Sigmoid,
            "softmax" => ScoringFunc::Softmax,
            "sqrtsoftplus" | "sqrt_softplus" => ScoringFunc::Sqrtsoftplus,
            _ => {
                return Err(f.bad(
                    "scoring_func",
                    format!("unknown value \"{s}\" (expected sigmoid, softmax or sqrtsoftplus)"),
                ))
            }
        },
    };
    let moe = MoeConfig {
        hidden_size,
        moe_intermediate_size,
        intermediate_size: f
            .opt_usize(&["intermediate_size", "inter_dim"])?
            .unwrap_or(moe_intermediate_size),
        n_routed_experts,
        num_experts_per_tok,
        n_shared_experts: f.opt_usize(&["n_shared_experts"])?.unwrap_or(0),
        n_group,
        topk_group,
        routed_scaling_factor: f
            .opt_f32(&["routed_scaling_factor", "route_scale"])?
            .unwrap_or(1.0),
        scoring_func,
        norm_topk_prob: f.opt_bool(&["norm_topk_prob"])?.unwrap_or(true),
        first_k_dense_replace: f
            .opt_usize(&["first_k_dense_replace", "n_dense_layers"])?
            .unwrap_or(0),
        num_hidden_layers,
        num_hash_layers: f
            .opt_usize(&["num_hash_layers", "n_hash_layers"])?
            .unwrap_or(0),
        // 0 is DeepSeek-V4's own "no clamp" (its code clamps where the limit is > 0)
        swiglu_limit: f.opt_f32(&["swiglu_limit"])?.filter(|&l| l != 0.0),
        rms_norm_eps: f.opt_f32(&["rms_norm_eps", "norm_eps"])?.unwrap_or(1e-6),
        vocab_size: f.opt_usize(&["vocab_size"])?.unwrap_or(0),
    };
    validate(&f, &moe)?;
    let model_type = f.opt_str(&["model_type"])?.map(|s| s.to_string());
    let moe_layer_freq = f.opt_usize(&["moe_layer_freq"])?.unwrap_or(1);
    if moe_layer_freq == 0 {
        return Err(f.bad("moe_layer_freq", "must be at least 1".into()));
    }
    let topk_method = f.opt_str(&["topk_method"])?.map(|s| s.to_string());
    let n_shared_experts_stated = f.opt_usize(&["n_shared_experts"])?;
    let unstated = unstated(&f, &moe);
    let architectures = match root.get("architectures") {
        None | Some(Value::Null) => vec![],
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| {
                v.as_str()
                    .map(|s| s.to_string())
                    .ok_or_else(|| f.bad("architectures", "must be a list of strings".into()))
            })
            .collect::<Result<_>>()?,
        Some(_) => return Err(f.bad("architectures", "must be a list of strings".into())),
    };
    let quant = match root.get("quantization_config") {
        None | Some(Value::Null) => None,
        Some(q) => Some(parse_quantization_config(path, "quantization_config", q)?),
    };
    Ok(ModelConfig {
        path: path.to_path_buf(),
        model_type,
        architectures,
        moe,
        quant,
        moe_layer_freq,
        topk_method,
        n_shared_experts_stated,
        unstated,
    })
}

/// The [`ENGINE_DEFAULTS`] fields `f` does not state (under any name), with the value `moe`
/// holds for each. None for a native config (`dim`, not `hidden_size`): DeepSeek's own
/// inference code reads it, with its `ModelArgs` defaults, not these classes.
fn unstated(f: &Fields, moe: &MoeConfig) -> Vec<Unstated> {
    if f.get(&["hidden_size"]).is_none() {
        return vec![];
    }
    ENGINE_DEFAULTS
        .iter()
        .filter(|d| {
            let mut keys = vec![d.field];
            keys.extend(d.aliases);
            f.get(&keys).is_none()
        })
        .map(|d| Unstated {
            field: d.field,
            used: used_value(d.field, moe),
        })
        .collect()
}

/// What this tool runs with for a field config.json leaves out.
fn used_value(field: &str, m: &MoeConfig) -> String {
    match field {
        "routed_scaling_factor" => format!("{:?}", m.routed_scaling_factor),
        "n_group" => m.n_group.to_string(),
        "topk_group" => format!("{} (= n_group)", m.topk_group),
        "norm_topk_prob" => m.norm_topk_prob.to_string(),
        "scoring_func" => format!("{:?}", m.scoring_func).to_ascii_lowercase(),
        "topk_method" => "score + e_score_correction_bias where the router holds one".into(),
        "first_k_dense_replace" => m.first_k_dense_replace.to_string(),
        "n_shared_experts" => m.n_shared_experts.to_string(),
        _ => "?".into(),
    }
}

fn validate(f: &Fields, m: &MoeConfig) -> Result<()> {
    // Far above any model's (DeepSeek-V3: hidden 7168, 256 experts): a dimension past it is a
    // typo or a corrupt file, named here rather than as an allocation or a shape error later.
    const MOST: usize = 1 << 24;
    let nz = |name: &str, v: usize| {
        if v == 0 {
            Err(f.bad(name, "must be at least 1".into()))
        } else if v > MOST {
            Err(f.bad(
                name,
                format!("{v} is not a plausible size (more than 2^24)"),
            ))
        } else {
            Ok(())
        }
    };
    nz("hidden_size", m.hidden_size)?;
    nz("moe_intermediate_size", m.moe_intermediate_size)?;
    nz("n_routed_experts", m.n_routed_experts)?;
    nz("num_experts_per_tok", m.num_experts_per_tok)?;
    nz("n_group", m.n_group)?;
    nz("topk_group", m.topk_group)?;
    // the shared experts' intermediate size is a dimension too (1e9 shared experts were
    // reported as a lack of memory for --tokens)
    let shared = m.n_shared_experts.checked_mul(m.moe_intermediate_size);
    if shared.is_none_or(|w| w > MOST) {
        return Err(f.bad(
            "n_shared_experts",
            format!(
                "{} is not plausible: the shared experts' intermediate size, moe_intermediate_size x n_shared_experts = {} x {}, is more than 2^24",
                m.n_shared_experts, m.moe_intermediate_size, m.n_shared_experts
            ),
        ));
    }
    if m.num_experts_per_tok > m.n_routed_experts {
        return Err(f.bad(
            "num_experts_per_tok",
            format!(
                "{} is more than n_routed_experts = {}",
                m.num_experts_per_tok, m.n_routed_experts
            ),
        ));
    }
    if !m.n_routed_experts.is_multiple_of(m.n_group) {
        return Err(f.bad(
            "n_group",
            format!(
                "n_routed_experts = {} is not divisible by n_group = {}",
                m.n_routed_experts, m.n_group
            ),
        ));
    }
    if m.topk_group > m.n_group {
        return Err(f.bad(
            "topk_group",
            format!("{} is more than n_group = {}", m.topk_group, m.n_group),
        ));
    }
    let reachable = m.topk_group * (m.n_routed_experts / m.n_group);
    if m.num_experts_per_tok > reachable {
        return Err(f.bad(
            "num_experts_per_tok",
            format!(
                "{} experts cannot be picked from topk_group = {} groups of {} experts",
                m.num_experts_per_tok,
                m.topk_group,
                m.n_routed_experts / m.n_group
            ),
        ));
    }
    if !(m.routed_scaling_factor.is_finite() && m.routed_scaling_factor > 0.0) {
        return Err(f.bad(
            "routed_scaling_factor",
            format!(
                "{} is not a positive finite number",
                m.routed_scaling_factor
            ),
        ));
    }
    if let Some(l) = m.swiglu_limit {
        if !(l.is_finite() && l > 0.0) {
            return Err(f.bad(
                "swiglu_limit",
                format!("{l} is not a positive finite number"),
            ));
        }
    }
    if !(m.rms_norm_eps.is_finite() && m.rms_norm_eps >= 0.0) {
        return Err(f.bad(
            "rms_norm_eps",
            format!("{} is not a finite number ≥ 0", m.rms_norm_eps),
        ));
    }
    if m.num_hidden_layers > 1 << 16 {
        return Err(f.bad(
            "num_hidden_layers",
            format!(
                "{} is not a plausible layer count (more than 2^16)",
                m.num_hidden_layers
            ),
        ));
    }
    if m.first_k_dense_replace > m.num_hidden_layers {
        return Err(f.bad(
            "first_k_dense_replace",
            format!(
                "{} is more than num_hidden_layers = {}",
                m.first_k_dense_replace, m.num_hidden_layers
            ),
        ));
    }
    if m.num_hash_layers > m.num_hidden_layers {
        return Err(f.bad(
            "num_hash_layers",
            format!(
                "{} is more than num_hidden_layers = {}",
                m.num_hash_layers, m.num_hidden_layers
            ),
        ));
    }
    Ok(())
}

fn has(obj: &Map<String, Value>, keys: &[&str]) -> bool {
    keys.iter()
        .any(|k| obj.get(*k).is_some_and(|v| !v.is_null()))
}

struct Fields<'a> {
    path: &'a Path,
    obj: &'a Map<String, Value>,
}

impl<'a> Fields<'a> {
    fn bad(&self, field: &str, what: String) -> Error {
        Error::bad_file(self.path, format!("field `{field}`: {what}"))
    }
    /// The first of `keys` present and not null.
    fn get<'k>(&self, keys: &[&'k str]) -> Option<(&'k str, &'a Value)> {
        keys.iter()
            .find_map(|k| self.obj.get(*k).filter(|v| !v.is_null()).map(|v| (*k, v)))
    }
    fn opt_usize(&self, keys: &[&str]) -> Result<Option<usize>> {
        let Some((k, v)) = self.get(keys) else {
            return Ok(None);
        };
        v.as_u64()
            .and_then(|u| usize::try_from(u).ok())
            .map(Some)
            .ok_or_else(|| self.bad(k, format!("must be a non-negative integer, found {v}")))
    }
    fn req_usize(&self, keys: &[&str]) -> Result<usize> {
        self.opt_usize(keys)?
            .ok_or_else(|| self.bad(keys[0], "missing (required for an MoE model)".into()))
    }
    fn opt_f32(&self, keys: &[&str]) -> Result<Option<f32>> {
        let Some((k, v)) = self.get(keys) else {
            return Ok(None);
        };
        v.as_f64()
            .map(|x| Some(x as f32))
            .ok_or_else(|| self.bad(k, format!("must be a number, found {v}")))
    }
    fn opt_bool(&self, keys: &[&str]) -> Result<Option<bool>> {
        let Some((k, v)) = self.get(keys) else {
            return Ok(None);
        };
        v.as_bool()
            .map(Some)
            .ok_or_else(|| self.bad(k, format!("must be true or false, found {v}")))
    }
    fn opt_str(&self, keys: &[&str]) -> Result<Option<&'a str>> {
        let Some((k, v)) = self.get(keys) else {
            return Ok(None);
        };
        v.as_str()
            .map(Some)
            .ok_or_else(|| self.bad(k, format!("must be a string, found {v}")))
    }
}

fn str_list(path: &Path, field: &str, v: Option<&Value>) -> Result<Vec<String>> {
    match v {
        None | Some(Value::Null) => Ok(vec![]),
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| {
                x.as_str().map(|s| s.to_string()).ok_or_else(|| {
                    Error::bad_file(path, format!("field `{field}`: must be a list of strings"))
                })
            })
            .collect(),
        Some(_) => Err(Error::bad_file(
            path,
            format!("field `{field}`: must be a list of strings"),
        )),
    }
}

/// `quantization_config` of config.json: ModelOpt (`quant_method: modelopt`, `quant_algo`) or
/// compressed-tensors (`format`, `config_groups.*.weights`).
fn parse_quantization_config(path: &Path, field: &str, q: &Value) -> Result<QuantConfig> {
    let bad =
        |sub: &str, what: &str| Error::bad_file(path, format!("field `{field}.{sub}`: {what}"));
    let obj = q
        .as_object()
        .ok_or_else(|| Error::bad_file(path, format!("field `{field}`: must be a JSON object")))?;
    let s = |k: &str| -> Result<Option<String>> {
        match obj.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(_) => Err(bad(k, "must be a string")),
        }
    };
    let method = match s("quant_method")?.as_deref() {
        Some("modelopt") => QuantMethod::Modelopt,
        Some("compressed-tensors") | Some("compressed_tensors") => QuantMethod::CompressedTensors,
        Some(other) => QuantMethod::Other(other.to_string()),
        None => return Err(bad("quant_method", "missing")),
    };
    // the weight scheme of the first config group (compressed-tensors, newer ModelOpt)
    let weights = obj
        .get("config_groups")
        .and_then(|g| g.as_object())
        .and_then(|g| g.values().next())
        .and_then(|g| g.get("weights"));
    let group_size = match obj
        .get("group_size")
        .or_else(|| weights.and_then(|w| w.get("group_size")))
    {
        None | Some(Value::Null) => None,
        Some(v) => Some(
            v.as_u64()
                .and_then(|u| usize::try_from(u).ok())
                .ok_or_else(|| bad("group_size", "must be a non-negative integer"))?,
        ),
    };
    let mut algo = s("quant_algo")?;
    if algo.is_none() {
        algo = s("format")?.map(|f| {
            let l = f.to_ascii_lowercase();
            if l.contains("nvfp4") {
                "NVFP4".to_string()
            } else if l.contains("mxfp4") {
                "MXFP4".to_string()
            } else {
                f
            }
        });
    }
    if algo.is_none() || algo.as_deref() == Some("pack-quantized") {
        let bits = weights
            .and_then(|w| w.get("num_bits"))
            .and_then(|v| v.as_u64());
        let ty = weights.and_then(|w| w.get("type")).and_then(|v| v.as_str());
        if bits == Some(4) && ty == Some("float") {
            algo = Some(
                if group_size == Some(32) {
                    "MXFP4"
                } else {
                    "NVFP4"
                }
                .to_string(),
            );
        }
    }
    let mut exclude = str_list(
        path,
        &format!("{field}.exclude_modules"),
        obj.get("exclude_modules"),
    )?;
    exclude.extend(str_list(
        path,
        &format!("{field}.ignore"),
        obj.get("ignore"),
    )?);
    Ok(QuantConfig {
        source: path.to_path_buf(),
        method,
        algo,
        group_size,
        exclude_modules: exclude,
        kv_cache_quant_algo: s("kv_cache_quant_algo")?,
    })
}

/// Keys that make a config.json a (DeepSeek-style) MoE config, whose fields are then required.
const MOE_KEYS: [&str; 4] = [
    "n_routed_experts",
    "moe_intermediate_size",
    "num_experts_per_tok",
    "moe_inter_dim",
];

/// Validate a config.json for commands that work on any model (audit, quantize): broken JSON is
/// bad input; an MoE config must be complete and sensible; a dense model's config is only read
/// for its quantization part. Returns the MoE config when there is one, and the quant config.
pub fn check_config_file(
    path: &Path,
    layers_hint: Option<usize>,
) -> Result<(Option<ModelConfig>, Option<QuantConfig>)> {
    let text = super::file::read_regular(path)?;
    let root: Value = serde_json::from_slice(&text)
        .map_err(|e| Error::bad_file(path, format!("not valid JSON: {e}")))?;
    let obj = root
        .as_object()
        .ok_or_else(|| Error::bad_file(path, "is not a JSON object"))?;
    let inner = obj.get("text_config").and_then(|v| v.as_object());
    let moe = MOE_KEYS
        .iter()
        .any(|k| obj.contains_key(*k) || inner.is_some_and(|t| t.contains_key(*k)));
    if moe {
        let c = read_config(path, layers_hint)?;
        let q = c.quant.clone();
        return Ok((Some(c), q));
    }
    Ok((None, quant_only(path, &root)?))
}

/// Only the quantization part of a config.json (for checkpoints that are not DeepSeek MoE
/// models): `quantization_config`, else `hf_quant_config.json` next to it.
pub fn quant_only(path: &Path, root: &Value) -> Result<Option<QuantConfig>> {
    if let Some(q) = root.get("quantization_config").filter(|q| !q.is_null()) {
        return Ok(Some(parse_quantization_config(
            path,
            "quantization_config",
            q,
        )?));
    }
    let hq = path.with_file_name(super::hf::HF_QUANT_CONFIG_FILE);
    if hq.is_file() {
        let t = super::file::read_regular(&hq)?;
        return Ok(Some(parse_hf_quant_config(&hq, &t)?));
    }
    Ok(None)
}

/// ModelOpt's `hf_quant_config.json`: `{producer, quantization: {quant_algo, group_size, ...}}`.
pub fn parse_hf_quant_config(path: &Path, text: &[u8]) -> Result<QuantConfig> {
    let v: Value = serde_json::from_slice(text)
        .map_err(|e| Error::bad_file(path, format!("not valid JSON: {e}")))?;
    let q = v
        .get("quantization")
        .ok_or_else(|| Error::bad_file(path, "field `quantization`: missing"))?;
    let mut q = q.clone();
    if let Some(o) = q.as_object_mut() {
        o.entry("quant_method")
            .or_insert(Value::String("modelopt".into()));
    }
    parse_quantization_config(path, "quantization", &q)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::Rng;

    fn v3_json(e: usize, k: usize) -> serde_json::Value {
        serde_json::json!({
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
            "n_routed_experts": e, "num_experts_per_tok": k, "n_shared_experts": 1,
            "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
            "scoring_func": "sigmoid", "norm_topk_prob": true, "first_k_dense_replace": 3,
            "num_hidden_layers": 61, "rms_norm_eps": 1e-6, "vocab_size": 129280,
            "quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4",
                                    "group_size": 16, "exclude_modules": ["lm_head"]}
        })
    }

    fn parse(v: &serde_json::Value) -> Result<ModelConfig> {
        parse_config(Path::new("/x/config.json"), v.to_string().as_bytes(), None)
    }

    #[test]
    fn deepseek_v3_config() {
        let k = rand::thread_rng().gen_range(1..=8);
        let c = parse(&v3_json(256, k)).unwrap();
        assert_eq!(c.moe.n_routed_experts, 256);
        assert_eq!(c.moe.num_experts_per_tok, k);
        assert_eq!((c.moe.n_group, c.moe.topk_group), (8, 4));
        assert_eq!(c.moe.routed_scaling_factor, 2.5);
        assert_eq!(c.moe.scoring_func, ScoringFunc::Sigmoid);
        assert!(c.moe.norm_topk_prob && c.moe.is_moe_layer(3) && !c.moe.is_moe_layer(2));
        let q = c.quant.unwrap();
        assert_eq!(q.method, QuantMethod::Modelopt);
        assert_eq!(q.format(), Some(Format::Nvfp4));
        assert_eq!(q.exclude_modules, vec!["lm_head".to_string()]);
        assert_eq!(c.model_type.as_deref(), Some("deepseek_v3"));
    }

    #[test]
    fn defaults_and_native_aliases() {
        let v = serde_json::json!({"dim": 64, "moe_inter_dim": 32, "n_routed_experts": 8,
            "n_activated_experts": 2, "score_func": "sqrtsoftplus", "n_hash_layers": 2,
            "swiglu_limit": 10.0, "n_layers": 4});
        let c = parse(&v).unwrap();
        let m = &c.moe;
        assert_eq!(
            (
                m.hidden_size,
                m.moe_intermediate_size,
                m.num_experts_per_tok
            ),
            (64, 32, 2)
        );
        assert_eq!((m.n_group, m.topk_group, m.n_shared_experts), (1, 1, 0));
        assert_eq!(m.scoring_func, ScoringFunc::Sqrtsoftplus);
        assert_eq!((m.num_hash_layers, m.swiglu_limit), (2, Some(10.0)));
        assert!(m.norm_topk_prob);
        assert_eq!(m.routed_scaling_factor, 1.0);
        // num_hidden_layers from the hint when missing, an error without one
        let v = serde_json::json!({"hidden_size": 64, "moe_intermediate_size": 32,
            "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 4});
        let c = parse_config(Path::new("c.json"), v.to_string().as_bytes(), Some(5)).unwrap();
        assert_eq!((c.moe.num_hidden_layers, c.moe.topk_group), (5, 4));
        assert!(parse(&v)
            .unwrap_err()
            .to_string()
            .contains("num_hidden_layers"));
    }

    /// `swiglu_limit: 0` is DeepSeek-V4's "no clamp" (it was refused as not positive);
    /// DeepSeek-V2's group_limited_greedy ranks groups by their best expert, which this router
    /// does not: refused by name (it was routed V3's way without a word).
    #[test]
    fn a_zero_swiglu_limit_is_no_clamp_and_v2_group_ranking_is_refused() {
        let k = rand::thread_rng().gen_range(1..=8);
        let mut v = v3_json(256, k);
        v["swiglu_limit"] = serde_json::json!(0.0);
        assert_eq!(parse(&v).unwrap().moe.swiglu_limit, None);
        v["swiglu_limit"] = serde_json::json!(-1.0);
        assert!(parse(&v).unwrap_err().to_string().contains("swiglu_limit"));
        let mut v = v3_json(256, k);
        v["topk_method"] = serde_json::json!("group_limited_greedy");
        // parsed (audit reports on such a config), refused where a layer is loaded to run
        let e = parse(&v).unwrap().check_routable().unwrap_err().to_string();
        assert!(
            e.contains("topk_method") && e.contains("group_limited_greedy"),
            "{e}"
        );
        // without a group limit the ranking of groups does not matter
        v["topk_group"] = serde_json::json!(8);
        assert!(parse(&v).unwrap().check_routable().is_ok());
    }

    #[test]
    fn unstated_fields_whose_engine_defaults_differ() {
        let fields = |c: &ModelConfig| c.unstated.iter().map(|u| u.field).collect::<Vec<_>>();
        // every one stated but topk_method
        assert_eq!(fields(&parse(&v3_json(256, 8)).unwrap()), ["topk_method"]);
        let mut v = v3_json(256, 8);
        v["topk_method"] = "noaux_tc".into();
        assert!(fields(&parse(&v).unwrap()).is_empty());
        let o = v.as_object_mut().unwrap();
        o.remove("routed_scaling_factor");
        o.remove("norm_topk_prob");
        o.remove("moe_layer_freq");
        let c = parse(&v).unwrap();
        assert_eq!(fields(&c), ["routed_scaling_factor", "norm_topk_prob"]);
        assert_eq!(c.unstated[0].used, "1.0");
        let d = c.unstated[0].defaults().unwrap();
        assert_eq!((d.transformers_v3, d.deepseek_v2), ("2.5", "1.0"));
        // native names count as stated
        let mut v = v3_json(256, 8);
        let o = v.as_object_mut().unwrap();
        o.remove("routed_scaling_factor");
        o.insert("route_scale".into(), 2.5.into());
        assert_eq!(fields(&parse(&v).unwrap()), ["topk_method"]);
        // a native config is read with DeepSeek's ModelArgs defaults, not these classes'
        let v = serde_json::json!({"dim": 64, "moe_inter_dim": 32, "n_routed_experts": 8,
            "n_activated_experts": 2, "n_layers": 4});
        assert!(fields(&parse(&v).unwrap()).is_empty());
    }

    #[test]
    fn bad_configs_name_the_field() {
        let cases: Vec<(&str, serde_json::Value, &str)> = vec![
            ("hidden_size", serde_json::Value::Null, "missing"),
            (
                "hidden_size",
                serde_json::json!("7168"),
                "non-negative integer",
            ),
            (
                "n_routed_experts",
                serde_json::json!(-1),
                "non-negative integer",
            ),
            (
                "num_experts_per_tok",
                serde_json::json!(300),
                "more than n_routed_experts",
            ),
            ("n_group", serde_json::json!(7), "not divisible"),
            ("topk_group", serde_json::json!(9), "more than n_group"),
            ("scoring_func", serde_json::json!("relu"), "unknown value"),
            ("norm_topk_prob", serde_json::json!(1), "true or false"),
            ("routed_scaling_factor", serde_json::json!(-2.5), "positive"),
            ("moe_intermediate_size", serde_json::json!(0), "at least 1"),
            (
                "hidden_size",
                serde_json::json!(u64::MAX),
                "not a plausible size",
            ),
            (
                "n_routed_experts",
                serde_json::json!(1u64 << 40),
                "not a plausible size",
            ),
            (
                "num_hidden_layers",
                serde_json::json!(1u64 << 62),
                "not a plausible layer count",
            ),
            (
                "first_k_dense_replace",
                serde_json::json!(99),
                "num_hidden_layers",
            ),
        ];
        for (field, val, want) in cases {
            let mut v = v3_json(256, 8);
            v[field] = val;
            let e = parse(&v).unwrap_err().to_string();
            assert!(
                e.contains("config.json") && e.contains(field) && e.contains(want),
                "{field}: {e}"
            );
        }
        let mut v = v3_json(16, 8);
        v["topk_group"] = serde_json::json!(1);
        assert!(parse(&v)
            .unwrap_err()
            .to_string()
            .contains("cannot be picked"));
        let mut v = v3_json(256, 8);
        v["quantization_config"] = serde_json::json!({"quant_algo": "NVFP4"});
        assert!(parse(&v).unwrap_err().to_string().contains("quant_method"));
        for bad in ["", "{", "[1,2]", "{\"hidden_size\": 1,}"] {
            let e = parse_config(Path::new("/x/config.json"), bad.as_bytes(), None)
                .unwrap_err()
                .to_string();
            assert!(e.contains("config.json"), "{e}");
        }
    }

    #[test]
    fn compressed_tensors_and_hf_quant_config() {
        let mut v = v3_json(256, 8);
        v["quantization_config"] = serde_json::json!({
            "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
            "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "float", "group_size": 16}}},
            "ignore": ["lm_head", "re:.*mlp.gate$"]});
        let q = parse(&v).unwrap().quant.unwrap();
        assert_eq!(q.method, QuantMethod::CompressedTensors);
        assert_eq!((q.format(), q.group_size), (Some(Format::Nvfp4), Some(16)));
        assert_eq!(q.exclude_modules.len(), 2);
        let hq = br#"{"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"], "kv_cache_quant_algo": null}}"#;
        let q = parse_hf_quant_config(Path::new("hf_quant_config.json"), hq).unwrap();
        assert_eq!(
            (q.format(), q.method),
            (Some(Format::Nvfp4), QuantMethod::Modelopt)
        );
        let e = parse_hf_quant_config(Path::new("hf_quant_config.json"), b"{}").unwrap_err();
        assert!(e.to_string().contains("hf_quant_config.json"));
    }
}
