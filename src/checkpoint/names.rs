//! The names MoE tensors go by (DESIGN.md §3): HF-V3 (`model.layers.{l}.mlp.experts.{e}.
//! gate_proj`), native V4 (`layers.{l}.ffn.experts.{e}.w1`) and vLLM's fused engine layout
//! (`model.layers.{l}.mlp.experts.w13_weight`). A scheme is detected from the names themselves,
//! with whatever leading prefix they carry (`model.`, `language_model.model.`, none): a
//! renamed or prefixed key is the classic weight-loading bug, so we never assume one.

use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet, HashMap};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Scheme {
    /// `{prefix}layers.{l}.mlp.experts.{e}.{gate,up,down}_proj`
    HfV3,
    /// `{prefix}layers.{l}.ffn.experts.{e}.{w1,w3,w2}`
    NativeV4,
    /// `{prefix}layers.{l}.mlp.experts.{w13,w2}_weight` (vLLM FusedMoE state dict)
    VllmFused,
}

/// The three projections of an expert: w1 = gate, w3 = up, w2 = down.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Proj {
    Gate,
    Up,
    Down,
}

impl Proj {
    pub const ALL: [Proj; 3] = [Proj::Gate, Proj::Up, Proj::Down];
    pub fn hf(self) -> &'static str {
        match self {
            Proj::Gate => "gate_proj",
            Proj::Up => "up_proj",
            Proj::Down => "down_proj",
        }
    }
    pub fn native(self) -> &'static str {
        match self {
            Proj::Gate => "w1",
            Proj::Up => "w3",
            Proj::Down => "w2",
        }
    }
    fn parse(s: &str) -> Option<Proj> {
        Some(match s {
            "gate_proj" | "w1" => Proj::Gate,
            "up_proj" | "w3" => Proj::Up,
            "down_proj" | "w2" => Proj::Down,
            _ => return None,
        })
    }

    /// The projection `s` names in `scheme`'s own words only (`w1` native, `gate_proj` HF).
    fn parse_in(scheme: Scheme, s: &str) -> Option<Proj> {
        Proj::parse(s).filter(|p| match scheme {
            Scheme::NativeV4 => p.native() == s,
            Scheme::HfV3 | Scheme::VllmFused => p.hf() == s,
        })
    }
}

/// A naming scheme plus the prefix before `layers.`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct Naming {
    pub scheme: Scheme,
    /// Everything before `layers.{l}.`, e.g. `model.` for HF, `` for native V4.
    pub prefix: String,
}

/// What a tensor name is, in MoE terms.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Key {
    /// A routed expert's projection; `member` is what follows (`weight`, `weight_scale`, ...).
    Expert {
        layer: usize,
        expert: usize,
        proj: Proj,
        member: String,
    },
    SharedExpert {
        layer: usize,
        proj: Proj,
        member: String,
    },
    /// A dense layer's MLP (the layers before `first_k_dense_replace`): HF
    /// `mlp.{gate,up,down}_proj`, native `ffn.{w1,w3,w2}`; not an MoE tensor.
    DenseMlp {
        layer: usize,
        proj: Proj,
        member: String,
    },
    RouterWeight {
        layer: usize,
    },
    RouterBias {
        layer: usize,
    },
    Tid2eid {
        layer: usize,
    },
    Norm {
        layer: usize,
    },
    /// vLLM fused experts: `w13 = true` for `w13_*`, false for `w2_*`; member as `weight_scale`.
    Fused {
        layer: usize,
        w13: bool,
        member: String,
    },
}

impl Key {
    pub fn layer(&self) -> usize {
        match self {
            Key::Expert { layer, .. }
            | Key::SharedExpert { layer, .. }
            | Key::DenseMlp { layer, .. }
            | Key::RouterWeight { layer }
            | Key::RouterBias { layer }
            | Key::Tid2eid { layer }
            | Key::Norm { layer }
            | Key::Fused { layer, .. } => *layer,
        }
    }
}

/// Split `name` at its `layers.{l}.`: (prefix, l, rest).
pub fn split_layer(name: &str) -> Option<(&str, usize, &str)> {
    let mut from = 0;
    while let Some(i) = name[from..].find("layers.") {
        let at = from + i;
        let after = &name[at + "layers.".len()..];
        let digits = after.bytes().take_while(|b| b.is_ascii_digit()).count();
        let boundary = at == 0 || name.as_bytes()[at - 1] == b'.';
        if boundary && digits > 0 && after.as_bytes().get(digits) == Some(&b'.') {
            if let Ok(l) = after[..digits].parse() {
                return Some((&name[..at], l, &after[digits + 1..]));
            }
        }
        from = at + 1;
    }
    None
}

fn scheme_of(rest: &str) -> Option<Scheme> {
    if let Some(r) = rest.strip_prefix("mlp.experts.") {
        if r.starts_with("w13_") || r.starts_with("w2_") {
            return Some(Scheme::VllmFused);
        }
        if r.starts_with(|c: char| c.is_ascii_digit()) {
            return Some(Scheme::HfV3);
        }
    }
    if let Some(r) = rest.strip_prefix("ffn.experts.") {
        if r.starts_with(|c: char| c.is_ascii_digit()) {
            return Some(Scheme::NativeV4);
        }
    }
    None
}

impl Naming {
    pub fn hf_v3() -> Naming {
        Naming {
            scheme: Scheme::HfV3,
            prefix: "model.".into(),
        }
    }
    pub fn native_v4() -> Naming {
        Naming {
            scheme: Scheme::NativeV4,
            prefix: String::new(),
        }
    }
    pub fn vllm_fused() -> Naming {
        Naming {
            scheme: Scheme::VllmFused,
            prefix: "model.".into(),
        }
    }

    /// The scheme most expert tensor names follow; None when no name is an expert's.
    pub fn detect<'a>(names: impl IntoIterator<Item = &'a str>) -> Option<Naming> {
        let mut votes: HashMap<(Scheme, &str), usize> = HashMap::new();
        for n in names {
            if let Some((prefix, _, rest)) = split_layer(n) {
                if let Some(s) = scheme_of(rest) {
                    *votes.entry((s, prefix)).or_default() += 1;
                }
            }
        }
        // fused tensors are few (8 per layer) but decisive: an engine dump is fused throughout
        votes
            .into_iter()
            .max_by_key(|((s, p), n)| (*s == Scheme::VllmFused, *n, std::cmp::Reverse(*p)))
            .map(|((scheme, prefix), _)| Naming {
                scheme,
                prefix: prefix.to_string(),
            })
    }

    fn mlp(&self, l: usize) -> String {
        match self.scheme {
            Scheme::NativeV4 => format!("{}layers.{l}.ffn", self.prefix),
            Scheme::HfV3 | Scheme::VllmFused => format!("{}layers.{l}.mlp", self.prefix),
        }
    }

    fn proj(&self, p: Proj) -> &'static str {
        match self.scheme {
            Scheme::NativeV4 => p.native(),
            Scheme::HfV3 | Scheme::VllmFused => p.hf(),
        }
    }

    /// Base name of a routed expert's projection (append `.weight`, `.weight_scale`, ...).
    /// For the fused scheme this is the HF name the fused tensor was built from.
    pub fn expert(&self, l: usize, e: usize, p: Proj) -> String {
        format!("{}.experts.{e}.{}", self.mlp(l), self.proj(p))
    }

    /// Base name of a shared-expert projection.
    pub fn shared_expert(&self, l: usize, p: Proj) -> String {
        format!("{}.shared_experts.{}", self.mlp(l), self.proj(p))
    }

    /// Base name of a dense layer's MLP projection (`model.layers.0.mlp.gate_proj`,
    /// `layers.0.ffn.w1`).
    pub fn dense_mlp(&self, l: usize, p: Proj) -> String {
        format!("{}.{}", self.mlp(l), self.proj(p))
    }

    pub fn router_weight(&self, l: usize) -> String {
        format!("{}.gate.weight", self.mlp(l))
    }

    pub fn router_bias(&self, l: usize) -> String {
        match self.scheme {
            Scheme::NativeV4 => format!("{}.gate.bias", self.mlp(l)),
            Scheme::HfV3 | Scheme::VllmFused => {
                format!("{}.gate.e_score_correction_bias", self.mlp(l))
            }
        }
    }

    pub fn tid2eid(&self, l: usize) -> String {
        format!("{}.gate.tid2eid", self.mlp(l))
    }

    /// The RMSNorm weight in front of the MoE block.
    pub fn norm(&self, l: usize) -> String {
        match self.scheme {
            Scheme::NativeV4 => format!("{}layers.{l}.ffn_norm.weight", self.prefix),
            Scheme::HfV3 | Scheme::VllmFused => {
                format!("{}layers.{l}.post_attention_layernorm.weight", self.prefix)
            }
        }
    }

    /// vLLM fused tensor: `w13 = true` → `...experts.w13_{member}`, else `w2_{member}`.
    pub fn fused(&self, l: usize, w13: bool, member: &str) -> String {
        let w = if w13 { "w13" } else { "w2" };
        format!("{}layers.{l}.mlp.experts.{w}_{member}", self.prefix)
    }

    /// What `name` is under this naming, if it is an MoE tensor.
    pub fn parse(&self, name: &str) -> Option<Key> {
        let rest = name.strip_prefix(self.prefix.as_str())?;
        let rest = rest.strip_prefix("layers.")?;
        let digits = rest.bytes().take_while(|b| b.is_ascii_digit()).count();
        let layer: usize = rest.get(..digits)?.parse().ok()?;
        let rest = rest.get(digits..)?.strip_prefix('.')?;
        let norm = match self.scheme {
            Scheme::NativeV4 => "ffn_norm.weight",
            _ => "post_attention_layernorm.weight",
        };
        if rest == norm {
            return Some(Key::Norm { layer });
        }
        let mlp = match self.scheme {
            Scheme::NativeV4 => "ffn.",
            _ => "mlp.",
        };
        let rest = rest.strip_prefix(mlp)?;
        if let Some(g) = rest.strip_prefix("gate.") {
            return match g {
                "weight" => Some(Key::RouterWeight { layer }),
                "tid2eid" => Some(Key::Tid2eid { layer }),
                "bias" if self.scheme == Scheme::NativeV4 => Some(Key::RouterBias { layer }),
                "e_score_correction_bias" if self.scheme != Scheme::NativeV4 => {
                    Some(Key::RouterBias { layer })
                }
                _ => None,
            };
        }
        if let Some(s) = rest.strip_prefix("shared_experts.") {
            let (p, member) = s.split_once('.')?;
            return Some(Key::SharedExpert {
                layer,
                proj: Proj::parse(p)?,
                member: member.to_string(),
            });
        }
        if let Some((p, member)) = rest.split_once('.') {
            if let Some(proj) = Proj::parse_in(self.scheme, p) {
                return Some(Key::DenseMlp {
                    layer,
                    proj,
                    member: member.to_string(),
                });
            }
        }
        let ex = rest.strip_prefix("experts.")?;
        if self.scheme == Scheme::VllmFused {
            if let Some(m) = ex.strip_prefix("w13_") {
                return Some(Key::Fused {
                    layer,
                    w13: true,
                    member: m.to_string(),
                });
            }
            if let Some(m) = ex.strip_prefix("w2_") {
                return Some(Key::Fused {
                    layer,
                    w13: false,
                    member: m.to_string(),
                });
            }
        }
        let (e, s) = ex.split_once('.')?;
        let expert: usize = e.parse().ok()?;
        let (p, member) = s.split_once('.')?;
        Some(Key::Expert {
            layer,
            expert,
            proj: Proj::parse(p)?,
            member: member.to_string(),
        })
    }
}

/// What one MoE layer's names show.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct LayerNames {
    pub layer: usize,
    /// Expert ids with at least one tensor (fused: 0..E from the tensor shape is unknown here).
    pub experts: BTreeSet<usize>,
    pub router: bool,
    pub bias: bool,
    pub tid2eid: bool,
    pub shared: bool,
    pub norm: bool,
    pub fused: bool,
}

/// Every layer with MoE tensors (routed experts, fused experts or a router), by layer index.
pub fn inventory<'a>(
    naming: &Naming,
    names: impl IntoIterator<Item = &'a str>,
) -> BTreeMap<usize, LayerNames> {
    let mut all: BTreeMap<usize, LayerNames> = BTreeMap::new();
    for n in names {
        let Some(k) = naming.parse(n) else { continue };
        let l = all.entry(k.layer()).or_insert_with(|| LayerNames {
            layer: k.layer(),
            ..Default::default()
        });
        match k {
            Key::Expert { expert, .. } => {
                l.experts.insert(expert);
            }
            Key::SharedExpert { .. } => l.shared = true,
            // a dense layer's MLP does not make an MoE layer
            Key::DenseMlp { .. } => {}
            Key::RouterWeight { .. } => l.router = true,
            Key::RouterBias { .. } => l.bias = true,
            Key::Tid2eid { .. } => l.tid2eid = true,
            Key::Norm { .. } => l.norm = true,
            Key::Fused { .. } => l.fused = true,
        }
    }
    // a norm alone does not make an MoE layer (dense layers have one too)
    all.retain(|_, l| !l.experts.is_empty() || l.fused || l.router);
    all
}

/// Indices of the MoE layers present (sorted).
pub fn layers_present<'a>(naming: &Naming, names: impl IntoIterator<Item = &'a str>) -> Vec<usize> {
    inventory(naming, names).into_keys().collect()
}

/// The up-projection sibling of a gate projection module (`.gate_proj` → `.up_proj`, `.w1` →
/// `.w3`), if `base` is one: the pair vLLM fuses into one w13 with one global scale.
pub fn up_sibling(base: &str) -> Option<String> {
    for (g, u) in [(".gate_proj", ".up_proj"), (".w1", ".w3")] {
        if let Some(stem) = base.strip_suffix(g) {
            return Some(format!("{stem}{u}"));
        }
    }
    None
}

/// Modules engines never quantize whatever the config says: embeddings, the output head (also
/// MTP's `shared_head.head`), the MoE router `gate` (not `gate_proj`) and MTP's `eh_proj`
/// (a plain `nn.Linear` in vLLM's and SGLang's DeepSeek MTP, built without the quant config).
pub fn never_quantized(module: &str) -> bool {
    let last = module.rsplit('.').next().unwrap_or(module);
    [
        "embed_tokens",
        "embed",
        "lm_head",
        "head",
        "gate",
        "eh_proj",
    ]
    .contains(&last)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::Rng;

    #[test]
    fn gate_projections_name_their_up_sibling() {
        assert_eq!(
            up_sibling("layers.1.ffn.experts.0.w1").as_deref(),
            Some("layers.1.ffn.experts.0.w3")
        );
        assert_eq!(
            up_sibling("model.layers.3.mlp.shared_experts.gate_proj").as_deref(),
            Some("model.layers.3.mlp.shared_experts.up_proj")
        );
        assert_eq!(up_sibling("x.down_proj"), None);
        assert_eq!(up_sibling("model.layers.3.mlp.gate"), None);
    }

    fn all_names(n: &Naming, layers: &[usize], experts: usize) -> Vec<String> {
        let mut v = vec![
            "lm_head.weight".to_string(),
            format!("{}embed_tokens.weight", n.prefix),
        ];
        for &l in layers {
            v.push(n.router_weight(l));
            v.push(n.router_bias(l));
            v.push(n.norm(l));
            for p in Proj::ALL {
                v.push(format!("{}.weight", n.shared_expert(l, p)));
                for e in 0..experts {
                    for m in ["weight", "weight_scale", "weight_scale_2", "input_scale"] {
                        v.push(format!("{}.{m}", n.expert(l, e, p)));
                    }
                }
            }
        }
        // a dense layer's MLP and attention are no MoE layer
        v.push(format!("{}layers.0.mlp.gate_proj.weight", n.prefix));
        v.push(format!(
            "{}layers.0.post_attention_layernorm.weight",
            n.prefix
        ));
        v
    }

    #[test]
    fn detects_every_scheme_and_prefix() {
        let mut r = rand::thread_rng();
        let experts = r.gen_range(1..6);
        for n in [
            Naming::hf_v3(),
            Naming::native_v4(),
            Naming {
                scheme: Scheme::HfV3,
                prefix: "language_model.model.".into(),
            },
            Naming {
                scheme: Scheme::NativeV4,
                prefix: "model.".into(),
            },
            Naming {
                scheme: Scheme::HfV3,
                prefix: String::new(),
            },
        ] {
            let names = all_names(&n, &[1, 3, 4], experts);
            let got = Naming::detect(names.iter().map(|s| s.as_str())).unwrap();
            assert_eq!(got, n);
            let inv = inventory(&n, names.iter().map(|s| s.as_str()));
            assert_eq!(
                inv.keys().copied().collect::<Vec<_>>(),
                vec![1, 3, 4],
                "{n:?}"
            );
            let l = &inv[&3];
            assert_eq!(l.experts.len(), experts);
            assert!(l.router && l.bias && l.norm && l.shared && !l.tid2eid && !l.fused);
            assert_eq!(
                n.parse(&format!(
                    "{}.weight_scale_2",
                    n.expert(4, experts - 1, Proj::Up)
                )),
                Some(Key::Expert {
                    layer: 4,
                    expert: experts - 1,
                    proj: Proj::Up,
                    member: "weight_scale_2".into()
                })
            );
            assert_eq!(n.parse(&n.tid2eid(7)), Some(Key::Tid2eid { layer: 7 }));
        }
        assert_eq!(
            Naming::hf_v3().expert(3, 7, Proj::Down),
            "model.layers.3.mlp.experts.7.down_proj"
        );
        assert_eq!(
            Naming::native_v4().expert(3, 7, Proj::Up),
            "layers.3.ffn.experts.7.w3"
        );
        assert_eq!(Naming::native_v4().router_bias(2), "layers.2.ffn.gate.bias");
        assert_eq!(Naming::native_v4().norm(2), "layers.2.ffn_norm.weight");
        assert_eq!(
            Naming::hf_v3().router_bias(2),
            "model.layers.2.mlp.gate.e_score_correction_bias"
        );
    }

    /// A dense layer's MLP under either scheme's words parses to one key, any member (the
    /// quantized ones too), and makes no MoE layer; the other scheme's words do not parse.
    #[test]
    fn dense_mlp_names_map_between_schemes() {
        let (hf, native) = (Naming::hf_v3(), Naming::native_v4());
        for p in Proj::ALL {
            for m in ["weight", "weight_scale", "weight_scale_2", "input_scale"] {
                let want = Some(Key::DenseMlp {
                    layer: 0,
                    proj: p,
                    member: m.into(),
                });
                assert_eq!(hf.parse(&format!("{}.{m}", hf.dense_mlp(0, p))), want);
                assert_eq!(
                    native.parse(&format!("{}.{m}", native.dense_mlp(0, p))),
                    want
                );
            }
        }
        assert_eq!(hf.dense_mlp(2, Proj::Up), "model.layers.2.mlp.up_proj");
        assert_eq!(native.dense_mlp(2, Proj::Down), "layers.2.ffn.w2");
        assert_eq!(native.parse("layers.0.ffn.gate_proj.weight"), None);
        assert_eq!(hf.parse("model.layers.0.mlp.w1.weight"), None);
        let names = ["layers.0.ffn.w1.weight", "layers.0.ffn_norm.weight"];
        assert!(inventory(&native, names).is_empty());
    }

    #[test]
    fn fused_engine_dumps() {
        let n = Naming::vllm_fused();
        let mut names = vec![];
        for m in ["weight", "weight_scale", "weight_scale_2", "input_scale"] {
            names.push(n.fused(5, true, m));
            names.push(n.fused(5, false, m));
        }
        names.push(n.router_weight(5));
        assert_eq!(names[0], "model.layers.5.mlp.experts.w13_weight");
        let got = Naming::detect(names.iter().map(|s| s.as_str())).unwrap();
        assert_eq!(got, n);
        let inv = inventory(&n, names.iter().map(|s| s.as_str()));
        assert!(inv[&5].fused && inv[&5].router);
        assert_eq!(
            n.parse("model.layers.5.mlp.experts.w2_weight_scale_2"),
            Some(Key::Fused {
                layer: 5,
                w13: false,
                member: "weight_scale_2".into()
            })
        );
    }

    #[test]
    fn split_layer_needs_a_boundary() {
        assert_eq!(
            split_layer("model.layers.12.mlp.x"),
            Some(("model.", 12, "mlp.x"))
        );
        assert_eq!(split_layer("layers.0.ffn.x"), Some(("", 0, "ffn.x")));
        assert_eq!(split_layer("model.sublayers.3.x"), None);
        assert_eq!(
            split_layer("model.layers.x.layers.2.y"),
            Some(("model.layers.x.", 2, "y"))
        );
        assert_eq!(
            Naming::detect(["lm_head.weight", "model.norm.weight"]),
            None
        );
    }
}
