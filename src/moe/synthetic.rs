//! Synthetic DeepSeek-style MoE models, deterministic from a seed: BF16 weights with
//! per-output-channel variation and heavy tails, a router with a correction bias (or V4 hash
//! tables), and activations shaped like real ones (student-t tails, fixed outlier channels,
//! massive-activation tokens, per-token norm variation). Routed experts are quantized with
//! ModelOpt semantics and get `input_scale = amax / 2688` calibrated on synthetic activations.
//!
//! Every tensor comes from its own RNG stream keyed by (seed, layer, role, index), so a
//! checkpoint can be written one expert tensor at a time and an in-memory layer is the same
//! model bit for bit.

use super::forward::{amax, bf16, rmsnorm_bf16, swiglu_reference};
use super::gs::input_scale_of_amax;
use super::{router, DenseMlp, Expert, MoeConfig, MoeLayer, QLinear, Router, Routing, ScoringFunc};
use crate::error::{Error, Result};
use crate::nvfp4::{e4m3, quantize_nvfp4, quantize_weight_nvfp4, weight_global_scale};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, LogNormal, StandardNormal, StudentT};
use rayon::prelude::*;
use std::str::FromStr;

/// Model presets. The real-dimension ones follow the public configs; the V4 ones are
/// approximations of DeepSeek-V4-Flash / -Pro (dimensions from their published configs,
/// MoE semantics as docs/moe-forward.md pins them, experts as ModelOpt NVFP4 instead of the
/// native MXFP4).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Preset {
    /// CPU-fast V3-like model: hidden 256, I 128, 16 experts top-4, 4 groups / top-2.
    Tiny,
    /// CPU-fast V4-like model (sqrtsoftplus, one hash layer, swiglu_limit), native V4 names.
    TinyV4,
    /// DeepSeek-V3 / R1.
    Dsv3,
    /// DeepSeek-V4-Flash (approximation).
    Dsv4Flash,
    /// DeepSeek-V4-Pro (approximation).
    Dsv4Pro,
}

impl FromStr for Preset {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "tiny" => Ok(Preset::Tiny),
            "tiny-v4" => Ok(Preset::TinyV4),
            "dsv3" => Ok(Preset::Dsv3),
            "dsv4-flash" => Ok(Preset::Dsv4Flash),
            "dsv4-pro" => Ok(Preset::Dsv4Pro),
            _ => Err(format!(
                "`{s}`: expected tiny, tiny-v4, dsv3, dsv4-flash or dsv4-pro"
            )),
        }
    }
}

impl Preset {
    pub fn name(self) -> &'static str {
        match self {
            Preset::Tiny => "tiny",
            Preset::TinyV4 => "tiny-v4",
            Preset::Dsv3 => "dsv3",
            Preset::Dsv4Flash => "dsv4-flash",
            Preset::Dsv4Pro => "dsv4-pro",
        }
    }

    /// V4 presets use the native V4 tensor names (`layers.{l}.ffn.experts.{e}.w1`).
    pub fn native_v4_names(self) -> bool {
        matches!(self, Preset::TinyV4 | Preset::Dsv4Flash | Preset::Dsv4Pro)
    }

    /// Layers `synth` writes unless told otherwise: all of a tiny model, the dense prefix plus
    /// one MoE layer of a real-dimension one (a full dsv3 is ~1.5 TB with its BF16 originals);
    /// for V4 that is one hash-routed layer (`--layers 4` reaches the first scored one).
    pub fn default_layers(self) -> usize {
        match self {
            Preset::Tiny | Preset::TinyV4 => 3,
            Preset::Dsv3 => 4,
            Preset::Dsv4Flash | Preset::Dsv4Pro => 1,
        }
    }

    pub fn config(self) -> MoeConfig {
        let v3 = MoeConfig {
            hidden_size: 7168,
            moe_intermediate_size: 2048,
            intermediate_size: 18432,
            n_routed_experts: 256,
            num_experts_per_tok: 8,
            n_shared_experts: 1,
            n_group: 8,
            topk_group: 4,
            routed_scaling_factor: 2.5,
            scoring_func: ScoringFunc::Sigmoid,
            norm_topk_prob: true,
            first_k_dense_replace: 3,
            num_hidden_layers: 61,
            num_hash_layers: 0,
            swiglu_limit: None,
            rms_norm_eps: 1e-6,
            vocab_size: 129280,
        };
        match self {
            Preset::Dsv3 => v3,
            Preset::Tiny => MoeConfig {
                hidden_size: 256,
                moe_intermediate_size: 128,
                intermediate_size: 512,
                n_routed_experts: 16,
                num_experts_per_tok: 4,
                n_group: 4,
                topk_group: 2,
                first_k_dense_replace: 1,
                num_hidden_layers: 3,
                vocab_size: 1000,
                ..v3
            },
            Preset::TinyV4 => MoeConfig {
                hidden_size: 256,
                moe_intermediate_size: 128,
                intermediate_size: 512,
                n_routed_experts: 16,
                num_experts_per_tok: 4,
                n_group: 1,
                topk_group: 1,
                routed_scaling_factor: 1.5,
                scoring_func: ScoringFunc::Sqrtsoftplus,
                first_k_dense_replace: 0,
                num_hidden_layers: 3,
                num_hash_layers: 1,
                swiglu_limit: Some(10.0),
                vocab_size: 1000,
                ..v3
            },
            Preset::Dsv4Flash => MoeConfig {
                hidden_size: 4096,
                moe_intermediate_size: 2048,
                intermediate_size: 2048,
                n_routed_experts: 256,
                num_experts_per_tok: 6,
                n_group: 1,
                topk_group: 1,
                routed_scaling_factor: 1.5,
                scoring_func: ScoringFunc::Sqrtsoftplus,
                first_k_dense_replace: 0,
                num_hidden_layers: 43,
                num_hash_layers: 3,
                swiglu_limit: Some(10.0),
                ..v3
            },
            Preset::Dsv4Pro => MoeConfig {
                hidden_size: 7168,
                moe_intermediate_size: 3072,
                intermediate_size: 3072,
                n_routed_experts: 384,
                num_experts_per_tok: 6,
                n_group: 1,
                topk_group: 1,
                routed_scaling_factor: 2.5,
                scoring_func: ScoringFunc::Sqrtsoftplus,
                first_k_dense_replace: 0,
                num_hidden_layers: 61,
                num_hash_layers: 3,
                swiglu_limit: Some(10.0),
                ..v3
            },
        }
    }
}

// ---- deterministic streams ----

mod role {
    pub const NORM: u64 = 1;
    pub const ROUTER: u64 = 2;
    pub const BIAS: u64 = 3;
    pub const TID2EID: u64 = 4;
    pub const SHARED: u64 = 5; // + 0..3
    pub const DENSE: u64 = 10; // + 0..3
    pub const EXPERT: u64 = 20; // + 0..3
    pub const CALIB: u64 = 30;
    pub const RESIDUAL: u64 = 40;
    pub const IDS: u64 = 41;
}

fn mix(mut z: u64) -> u64 {
    // splitmix64 finalizer
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn stream(seed: u64, layer: usize, role: u64, idx: usize) -> ChaCha8Rng {
    let s = mix(mix(mix(mix(seed) ^ layer as u64) ^ role) ^ idx as u64);
    ChaCha8Rng::seed_from_u64(s)
}

/// Student-t with 5 degrees of freedom, scaled to unit variance: the heavy tail of real
/// weights and activations.
fn heavy(rng: &mut ChaCha8Rng) -> f32 {
    // StudentT::new(5) cannot fail; fall back to a normal if it ever did
    match StudentT::new(5.0f32) {
        Ok(t) => t.sample(rng) / (5.0f32 / 3.0).sqrt(),
        Err(_) => StandardNormal.sample(rng),
    }
}

fn lognormal(rng: &mut ChaCha8Rng, sigma: f32) -> f32 {
    match LogNormal::new(0.0f32, sigma) {
        Ok(d) => d.sample(rng),
        Err(_) => 1.0,
    }
}

/// Laplace with unit variance: heavier tails than a normal (kurtosis 6) at the cost of one
/// uniform and one log, which matters for the millions of weights of a layer.
#[inline]
fn laplace(rng: &mut ChaCha8Rng) -> f32 {
    let u: f32 = rng.gen::<f32>() - 0.5;
    let m = -(1.0 - 2.0 * u.abs()).max(f32::MIN_POSITIVE).ln() * std::f32::consts::FRAC_1_SQRT_2;
    if u < 0.0 {
        -m
    } else {
        m
    }
}

/// A BF16 linear weight `[out, in]`: std `1/sqrt(in)`, each output channel scaled by a
/// log-normal factor, Laplace entries.
fn linear(rng: &mut ChaCha8Rng, out: usize, inp: usize) -> Vec<f32> {
    let std = 1.0 / (inp as f32).sqrt();
    let mut w = Vec::with_capacity(out * inp);
    for _ in 0..out {
        let c = std * lognormal(rng, 0.25);
        for _ in 0..inp {
            w.push(bf16(c * laplace(rng)));
        }
    }
    w
}

// ---- activations ----

/// The fixed outlier channels of a model of width `hidden`: `(channel, magnitude)`. Fixed per
/// width (not per batch), as real outlier channels are a property of the model.
pub fn outlier_channels(hidden: usize) -> Vec<(usize, f32)> {
    let mut rng = stream(0x006f_7574_6c69_6572, hidden, role::RESIDUAL, 0);
    let n = (hidden / 128).max(2).min(hidden);
    let mut chans: Vec<usize> = Vec::with_capacity(n);
    while chans.len() < n {
        let c = rng.gen_range(0..hidden);
        if !chans.contains(&c) {
            chans.push(c);
        }
    }
    chans
        .into_iter()
        .map(|c| (c, rng.gen_range(10.0..30.0)))
        .collect()
}

/// Scale of the synthetic residual stream: a typical token's rms is ~10, about 8x what one
/// synthetic MoE layer adds, as a layer's update is a modest fraction of a real residual stream.
pub const RESIDUAL_SCALE: f32 = 6.0;

/// A residual stream `[tokens, hidden]` (BF16-exact): per-token scale log-normal(0, 0.5),
/// student-t entries, outlier channels 10-30x, and massive activations (~300x in the first
/// outlier channel) on token 0 and about 1% of the others, like attention-sink tokens.
pub fn residual_stream(hidden: usize, tokens: usize, seed: u64) -> Vec<f32> {
    let outliers = outlier_channels(hidden);
    let mut mult = vec![1f32; hidden];
    for &(c, m) in &outliers {
        mult[c] = m;
    }
    let massive_chan = outliers.first().map_or(0, |o| o.0);
    let mut out = vec![0f32; tokens * hidden];
    out.par_chunks_mut(hidden).enumerate().for_each(|(t, row)| {
        let mut rng = stream(seed, t, role::RESIDUAL, 1);
        let sigma = RESIDUAL_SCALE * lognormal(&mut rng, 0.5);
        for (v, &m) in row.iter_mut().zip(&mult) {
            *v = bf16(sigma * m * heavy(&mut rng));
        }
        if t == 0 || rng.gen_bool(0.01) {
            row[massive_chan] = bf16(sigma * 300.0 * rng.gen_range(0.8..1.2));
        }
    });
    out
}

/// MoE-block inputs `[tokens, hidden]`: `bf16(rmsnorm(h) · norm_weight)` of a synthetic
/// residual stream.
pub fn moe_input(
    hidden: usize,
    tokens: usize,
    norm_weight: Option<&[f32]>,
    eps: f32,
    seed: u64,
) -> Vec<f32> {
    rmsnorm_bf16(
        &residual_stream(hidden, tokens, seed),
        hidden,
        norm_weight,
        eps,
    )
}

/// Random token ids in `[0, vocab)`.
pub fn input_ids(vocab: usize, tokens: usize, seed: u64) -> Vec<i64> {
    let mut rng = stream(seed, 0, role::IDS, 0);
    (0..tokens)
        .map(|_| rng.gen_range(0..vocab.max(1) as i64))
        .collect()
}

// ---- the model ----

/// The BF16 weights of one routed expert, `[out, in]` each, BF16-exact.
#[derive(Clone, Debug)]
pub struct ExpertBf16 {
    pub w1: Vec<f32>,
    pub w3: Vec<f32>,
    pub w2: Vec<f32>,
}

/// The calibration batch of one MoE layer and its routing.
#[derive(Clone, Debug)]
pub struct Calibration {
    pub hidden: Vec<f32>,
    pub input_ids: Vec<i64>,
    pub routing: Routing,
}

#[derive(Clone, Debug)]
pub struct SyntheticModel {
    pub preset: Preset,
    pub config: MoeConfig,
    pub seed: u64,
}

impl SyntheticModel {
    pub fn new(preset: Preset, seed: u64) -> SyntheticModel {
        SyntheticModel {
            preset,
            config: preset.config(),
            seed,
        }
    }

    /// The same model cut to `n` layers (`num_hidden_layers = n`; hash layers beyond it go).
    pub fn with_layers(mut self, n: usize) -> SyntheticModel {
        self.config.num_hidden_layers = n;
        self.config.num_hash_layers = self.config.num_hash_layers.min(n);
        self
    }

    /// Tokens a calibration batch routes. The gate/up input's amax of each expert is a max
    /// over the rows routed to it, cheap at any size, and a real calibrator sees many rows per
    /// expert: 8192 tokens give DeepSeek-V3's 256 experts ~256 rows each and ~80
    /// massive-activation tokens in all. (With 256, each expert saw ~8 rows, the gate/up
    /// `input_scale`s spread 3.4x across one layer's experts, and a test batch's massive token
    /// saturated the input of an expert that had seen none: a healthy synthetic checkpoint
    /// failed `layertest --gs checkpoint`.)
    pub const ROUTED_CALIBRATION_TOKENS: usize = 8192;

    /// Of those, the tokens whose rows also run the expert's SwiGLU for the down input's amax:
    /// 1024 where the CPU forward is cheap (tiny), down to 256 for full-size models, whose
    /// SwiGLU would otherwise dominate `synth`.
    pub fn swiglu_calibration_tokens(&self) -> usize {
        const CALIBRATION_MACS: usize = 1 << 30;
        let c = &self.config;
        let macs_per_token =
            3 * c.num_experts_per_tok.max(1) * c.hidden_size * c.moe_intermediate_size;
        (CALIBRATION_MACS / macs_per_token.max(1)).clamp(256, 1024)
    }

    /// The RMSNorm weight before layer `l`'s MLP: log-normal around 1, BF16.
    pub fn norm_weight(&self, l: usize) -> Vec<f32> {
        let mut rng = stream(self.seed, l, role::NORM, 0);
        (0..self.config.hidden_size)
            .map(|_| bf16(lognormal(&mut rng, 0.3)))
            .collect()
    }

    pub fn router(&self, l: usize) -> Router {
        let c = &self.config;
        let (h, e, k) = (c.hidden_size, c.n_routed_experts, c.num_experts_per_tok);
        let mut rng = stream(self.seed, l, role::ROUTER, 0);
        let std = 1.0 / (h as f32).sqrt();
        let weight = (0..e * h)
            .map(|_| {
                let v: f32 = StandardNormal.sample(&mut rng);
                bf16(v * std)
            })
            .collect();
        let hash = c.is_hash_layer(l);
        let e_score_correction_bias = (!hash).then(|| {
            let mut rng = stream(self.seed, l, role::BIAS, 0);
            (0..e)
                .map(|_| {
                    let v: f32 = StandardNormal.sample(&mut rng);
                    0.05 * v
                })
                .collect()
        });
        let tid2eid = hash.then(|| {
            let mut rng = stream(self.seed, l, role::TID2EID, 0);
            let mut t = Vec::with_capacity(c.vocab_size * k);
            let mut pool: Vec<i64> = (0..e as i64).collect();
            for _ in 0..c.vocab_size {
                // k distinct experts per token id (partial Fisher-Yates)
                for j in 0..k {
                    let r = rng.gen_range(j..e);
                    pool.swap(j, r);
                    t.push(pool[j]);
                }
            }
            t
        });
        Router {
            weight,
            e_score_correction_bias,
            tid2eid,
        }
    }

    /// One weight of a BF16 MLP: `which` 0 = w1 `[i, h]`, 1 = w3 `[i, h]`, 2 = w2 `[h, i]`.
    fn mlp_weight(&self, l: usize, role: u64, idx: usize, which: usize, i: usize) -> Vec<f32> {
        let h = self.config.hidden_size;
        let mut rng = stream(self.seed, l, role + which as u64, idx);
        if which == 2 {
            linear(&mut rng, h, i)
        } else {
            linear(&mut rng, i, h)
        }
    }

    /// Shared-expert weight `which` (0 w1, 1 w3, 2 w2) of layer `l`.
    pub fn shared_weight(&self, l: usize, which: usize) -> Vec<f32> {
        let i = self.config.n_shared_experts * self.config.moe_intermediate_size;
        self.mlp_weight(l, role::SHARED, 0, which, i)
    }

    pub fn shared(&self, l: usize) -> Option<DenseMlp> {
        (self.config.n_shared_experts > 0).then(|| DenseMlp {
            intermediate: self.config.n_shared_experts * self.config.moe_intermediate_size,
            w1: self.shared_weight(l, 0),
            w3: self.shared_weight(l, 1),
            w2: self.shared_weight(l, 2),
        })
    }

    /// Dense-layer MLP weight `which` (0 w1, 1 w3, 2 w2) of layer `l < first_k_dense_replace`.
    pub fn dense_weight(&self, l: usize, which: usize) -> Vec<f32> {
        self.mlp_weight(l, role::DENSE, 0, which, self.config.intermediate_size)
    }

    pub fn dense_mlp(&self, l: usize) -> DenseMlp {
        DenseMlp {
            intermediate: self.config.intermediate_size,
            w1: self.dense_weight(l, 0),
            w3: self.dense_weight(l, 1),
            w2: self.dense_weight(l, 2),
        }
    }

    pub fn expert_bf16(&self, l: usize, e: usize) -> ExpertBf16 {
        let i = self.config.moe_intermediate_size;
        ExpertBf16 {
            w1: self.mlp_weight(l, role::EXPERT, e, 0, i),
            w3: self.mlp_weight(l, role::EXPERT, e, 1, i),
            w2: self.mlp_weight(l, role::EXPERT, e, 2, i),
        }
    }

    /// Synthetic MoE inputs of layer `l` (through its norm weight) and token ids.
    pub fn activations(&self, l: usize, tokens: usize, seed: u64) -> (Vec<f32>, Vec<i64>) {
        let c = &self.config;
        let norm = self.norm_weight(l);
        (
            moe_input(c.hidden_size, tokens, Some(&norm), c.rms_norm_eps, seed),
            input_ids(c.vocab_size, tokens, seed),
        )
    }

    /// The batch `input_scale`s of layer `l` are calibrated on, and its routing.
    pub fn calibration(&self, l: usize, router: &Router) -> Result<Calibration> {
        let (hidden, ids) = self.activations(
            l,
            Self::ROUTED_CALIBRATION_TOKENS,
            mix(self.seed ^ role::CALIB),
        );
        let routing = router::route_with(&self.config, l, router, &hidden, Some(&ids))?;
        Ok(Calibration {
            hidden,
            input_ids: ids,
            routing,
        })
    }

    /// amax of what expert `e`'s two GEMMs see on the calibration batch (BF16 model):
    /// `(gate/up input, down input)`, the second over the rows of the first
    /// `swiglu_calibration_tokens()` tokens; `None` when no such token reached the expert.
    pub fn expert_amax(
        &self,
        cal: &Calibration,
        e: usize,
        w: &ExpertBf16,
    ) -> (Option<f32>, Option<f32>) {
        let c = &self.config;
        let (h, i, k) = (c.hidden_size, c.moe_intermediate_size, cal.routing.top_k);
        let swiglu_tokens = self.swiglu_calibration_tokens();
        let (mut rows, mut x) = (vec![], vec![]);
        for (s, &id) in cal.routing.topk_ids.iter().enumerate() {
            if id as usize == e {
                let row = &cal.hidden[(s / k) * h..(s / k + 1) * h];
                rows.extend_from_slice(row);
                if s / k < swiglu_tokens {
                    x.extend_from_slice(row);
                }
            }
        }
        let a1 = (!rows.is_empty()).then(|| amax(&rows));
        let a2 = (!x.is_empty()).then(|| {
            amax(&swiglu_reference(
                &x,
                x.len() / h,
                h,
                i,
                &w.w1,
                &w.w3,
                c.swiglu_limit,
            ))
        });
        (a1, a2)
    }

    /// MoE layer `l`, in memory, with BF16 originals and calibrated `input_scale`s.
    /// Memory: the whole layer as f32 originals (fine for tiny; ~45 GB for dsv3).
    pub fn moe_layer(&self, l: usize) -> Result<MoeLayer> {
        let c = &self.config;
        if !c.is_moe_layer(l) {
            return Err(Error::usage(format!(
                "layer {l} of the synthetic {} model is not an MoE layer (MoE layers: {}..{})",
                self.preset.name(),
                c.first_k_dense_replace,
                c.num_hidden_layers
            )));
        }
        let router = self.router(l);
        let cal = self.calibration(l, &router)?;
        let built: Vec<(ExpertBf16, Option<f32>, Option<f32>)> = (0..c.n_routed_experts)
            .into_par_iter()
            .map(|e| {
                let w = self.expert_bf16(l, e);
                let (a1, a2) = self.expert_amax(&cal, e, &w);
                (w, a1, a2)
            })
            .collect();
        let a1: Vec<Option<f32>> = built.iter().map(|b| b.1).collect();
        let a2: Vec<Option<f32>> = built.iter().map(|b| b.2).collect();
        let (s1, s2) = (fill_unseen(&a1), fill_unseen(&a2));
        let experts = built
            .into_par_iter()
            .enumerate()
            .map(|(e, (w, _, _))| {
                quantize_expert(
                    &w,
                    c.hidden_size,
                    c.moe_intermediate_size,
                    [s1[e], s1[e], s2[e]],
                    true,
                )
            })
            .collect();
        Ok(MoeLayer {
            index: l,
            config: c.clone(),
            router,
            experts,
            shared: self.shared(l),
            norm_weight: Some(self.norm_weight(l)),
        })
    }
}

/// Per-expert `input_scale` from per-expert amax; an expert no calibration token reached gets
/// the layer's largest amax (a calibrator has nothing better).
pub fn fill_unseen(amax: &[Option<f32>]) -> Vec<f32> {
    let layer_max = amax.iter().flatten().fold(0f32, |m, &a| m.max(a));
    amax.iter()
        .map(|a| input_scale_of_amax(a.unwrap_or(layer_max)))
        .collect()
}

/// Quantize one expert as ModelOpt exports it: gate and up share one `weight_scale_2` (the
/// engines fuse them into w13 and vLLM keeps only the gate's), down has its own.
/// `input_scales` = (gate, up, down).
pub fn quantize_expert(
    w: &ExpertBf16,
    h: usize,
    i: usize,
    input_scales: [f32; 3],
    keep_originals: bool,
) -> Expert {
    let (ws_g, _) = weight_global_scale(&w.w1);
    let (ws_u, _) = weight_global_scale(&w.w3);
    let ws2 = ws_g.max(ws_u);
    let q = |x: &[f32]| {
        let (mut t, _) = quantize_nvfp4(x, i, h, 1.0 / ws2);
        t.scale_2 = ws2;
        t
    };
    let (down, _) = quantize_weight_nvfp4(&w.w2, h, i);
    let ql = |weight, s: f32, orig: &Vec<f32>| QLinear {
        weight,
        input_scale: Some(s),
        original: keep_originals.then(|| orig.clone()),
    };
    Expert {
        w1: ql(q(&w.w1), input_scales[0], &w.w1),
        w3: ql(q(&w.w3), input_scales[1], &w.w3),
        w2: ql(down, input_scales[2], &w.w2),
    }
}

/// The expert most calibration tokens went to (ties: lowest id): where faults are planted so
/// a test batch surely reaches them.
pub fn busiest_expert(routing: &Routing, n_experts: usize) -> usize {
    let mut load = vec![0usize; n_experts];
    for &id in &routing.topk_ids {
        if let Some(l) = load.get_mut(id as usize) {
            *l += 1;
        }
    }
    let mut best = 0;
    for (e, &n) in load.iter().enumerate() {
        if n > load[best] {
            best = e;
        }
    }
    best
}

// ---- planted faults ----

/// Faults `synth --plant` can put into one expert of one layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Fault {
    /// One gate_proj block scale is 0x7F (NaN).
    NanBlockScale,
    /// gate/up `input_scale` 1000x too small (gs1 1000x too large: activations saturate).
    BadInputScale,
    /// gate/up `weight_scale_2` differ (up requantized with twice the gate's). The math stays
    /// right; an engine that keeps only the gate's (vLLM's w13) halves the up projection.
    Ws2Mismatch,
    /// gate_proj quantized with a `weight_scale_2` 64x too small: most block scales sit at 448.
    SaturatedScales,
    /// down_proj `weight_scale` left out of the checkpoint.
    MissingTensor,
    /// gate and up NVFP4 tensors written under each other's names.
    SwapGateUp,
}

impl FromStr for Fault {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        Fault::all()
            .into_iter()
            .find(|f| f.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = Fault::all().iter().map(|f| f.name()).collect();
                format!("`{s}`: expected one of {}", names.join(", "))
            })
    }
}

impl Fault {
    pub fn all() -> [Fault; 6] {
        [
            Fault::NanBlockScale,
            Fault::BadInputScale,
            Fault::Ws2Mismatch,
            Fault::SaturatedScales,
            Fault::MissingTensor,
            Fault::SwapGateUp,
        ]
    }

    pub fn name(self) -> &'static str {
        match self {
            Fault::NanBlockScale => "nan-block-scale",
            Fault::BadInputScale => "bad-input-scale",
            Fault::Ws2Mismatch => "ws2-mismatch",
            Fault::SaturatedScales => "saturated-scales",
            Fault::MissingTensor => "missing-tensor",
            Fault::SwapGateUp => "swap-gate-up",
        }
    }

    /// Plant the fault into a quantized expert (its BF16 originals stay right, as in a real
    /// conversion bug). Returns what was done, in words. `MissingTensor` changes nothing here:
    /// the writer leaves the tensor out.
    pub fn plant(self, ex: &mut Expert, w: &ExpertBf16) -> String {
        let (i, h) = (ex.w1.weight.rows, ex.w1.weight.cols);
        match self {
            Fault::NanBlockScale => {
                if let Some(s) = ex.w1.weight.scales.first_mut() {
                    *s = e4m3::NAN;
                }
                "gate_proj.weight_scale[0, 0] = 0x7F (E4M3 NaN)".into()
            }
            Fault::BadInputScale => {
                for q in [&mut ex.w1, &mut ex.w3] {
                    q.input_scale = q.input_scale.map(|s| s / 1000.0);
                }
                "gate_proj.input_scale and up_proj.input_scale divided by 1000".into()
            }
            Fault::Ws2Mismatch => {
                let ws2 = ex.w3.weight.scale_2 * 2.0;
                let (mut t, _) = quantize_nvfp4(&w.w3, i, h, 1.0 / ws2);
                t.scale_2 = ws2;
                ex.w3.weight = t;
                format!(
                    "up_proj requantized with weight_scale_2 {:e} (gate_proj has {:e})",
                    ws2, ex.w1.weight.scale_2
                )
            }
            Fault::SaturatedScales => {
                let ws2 = ex.w1.weight.scale_2 / 64.0;
                let (mut t, st) = quantize_nvfp4(&w.w1, i, h, 1.0 / ws2);
                t.scale_2 = ws2;
                ex.w1.weight = t;
                format!(
                    "gate_proj quantized with weight_scale_2 64x too small: {} of {} block scales at 448",
                    st.saturated, st.blocks
                )
            }
            Fault::MissingTensor => "down_proj.weight_scale left out".into(),
            Fault::SwapGateUp => {
                std::mem::swap(&mut ex.w1.weight, &mut ex.w3.weight);
                "gate_proj and up_proj NVFP4 tensors swapped".into()
            }
        }
    }
}

/// A small random layer for unit tests: V3-style config (overridable), quantized experts with
/// BF16 originals and input scales, a shared expert, a correction bias.
#[cfg(test)]
pub(crate) fn test_layer(
    rng: &mut ChaCha8Rng,
    h: usize,
    i: usize,
    e: usize,
    k: usize,
    func: ScoringFunc,
) -> MoeLayer {
    let config = MoeConfig {
        hidden_size: h,
        moe_intermediate_size: i,
        intermediate_size: 2 * i,
        n_routed_experts: e,
        num_experts_per_tok: k,
        n_shared_experts: 1,
        n_group: 1,
        topk_group: 1,
        routed_scaling_factor: 2.5,
        scoring_func: func,
        norm_topk_prob: true,
        first_k_dense_replace: 1,
        num_hidden_layers: 4,
        num_hash_layers: 0,
        swiglu_limit: None,
        rms_norm_eps: 1e-6,
        vocab_size: 50,
    };
    let seed: u64 = rng.gen();
    let m = SyntheticModel {
        preset: Preset::Tiny,
        config,
        seed,
    };
    let router = Router {
        weight: (0..e * h)
            .map(|_| {
                let v: f32 = StandardNormal.sample(rng);
                bf16(v / (h as f32).sqrt())
            })
            .collect(),
        e_score_correction_bias: Some((0..e).map(|_| rng.gen_range(-0.05..0.05)).collect()),
        tid2eid: None,
    };
    let experts = (0..e)
        .map(|x| {
            let w = m.expert_bf16(1, x);
            quantize_expert(&w, h, i, [0.01, 0.01, 0.01], true)
        })
        .collect();
    MoeLayer {
        index: 1,
        config: m.config.clone(),
        router,
        experts,
        shared: m.shared(1),
        norm_weight: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::compare;
    use crate::moe::gs::{resolve, Calibration as Cal, GsSource, InputScaleReduce};
    use crate::moe::{moe_forward, ActScales, Path};
    use crate::nvfp4::Flavor;

    #[test]
    fn same_seed_same_model_other_seed_other_model() {
        let a = SyntheticModel::new(Preset::Tiny, 7);
        let b = SyntheticModel::new(Preset::Tiny, 7);
        let c = SyntheticModel::new(Preset::Tiny, 8);
        assert_eq!(a.expert_bf16(1, 3).w2, b.expert_bf16(1, 3).w2);
        assert_ne!(a.expert_bf16(1, 3).w2, c.expert_bf16(1, 3).w2);
        assert_ne!(a.expert_bf16(1, 3).w1, a.expert_bf16(1, 4).w1);
        assert_ne!(a.expert_bf16(1, 3).w1, a.expert_bf16(2, 3).w1);
    }

    #[test]
    fn activations_have_heavy_tails_and_outliers() {
        let seed = rand::random();
        let h = residual_stream(256, 64, seed);
        assert!(h.iter().all(|v| bf16(*v) == *v));
        let outl = outlier_channels(256);
        assert!(outl.len() >= 2);
        // the outlier channels carry far more energy than the others
        let energy = |c: usize| h.iter().skip(c).step_by(256).map(|v| v * v).sum::<f32>() / 64.0;
        let normal: f32 = (0..256)
            .filter(|c| !outl.iter().any(|o| o.0 == *c))
            .map(energy)
            .sum::<f32>()
            / 254.0;
        for &(c, _) in &outl[1..] {
            assert!(energy(c) > 30.0 * normal, "seed {seed}: channel {c}");
        }
        // token 0 is a massive-activation token: measured against its own typical entry, as
        // the token's overall scale is itself random (log-normal)
        let row0 = &h[..256];
        let mut mags: Vec<f32> = row0.iter().map(|v| v.abs()).collect();
        mags.sort_by(f32::total_cmp);
        assert!(row0[outl[0].0].abs() > 50.0 * mags[128], "seed {seed}");
        // per-token norms vary
        let norms: Vec<f32> = h
            .chunks(256)
            .map(|r| r.iter().map(|v| v * v).sum::<f32>().sqrt())
            .collect();
        let (lo, hi) = norms
            .iter()
            .fold((f32::MAX, 0f32), |(a, b), &n| (a.min(n), b.max(n)));
        assert!(hi > 2.0 * lo, "seed {seed}");
    }

    #[test]
    fn tiny_layer_nvfp4_error_is_plausible() {
        let seed: u64 = rand::random();
        let m = SyntheticModel::new(Preset::Tiny, seed);
        let layer = m.moe_layer(1).unwrap();
        layer.validate().unwrap();
        assert!(layer
            .experts
            .iter()
            .all(|e| e.w1.weight.scale_2 == e.w3.weight.scale_2));
        let (x, ids) = m.activations(1, 64, seed ^ 1);
        let r = crate::moe::route(&layer, &x, Some(&ids)).unwrap();
        let reference = moe_forward(&layer, &x, &r, &Path::Reference, false).unwrap();
        for src in [
            GsSource::Calibrated,
            GsSource::Checkpoint,
            GsSource::Dynamic,
        ] {
            let cal = Cal {
                hidden: &x,
                input_ids: Some(&ids),
                routing: Some(&r),
                amax: None,
            };
            let s = resolve(src, &layer, InputScaleReduce::PerExpert, &cal, seed).unwrap();
            let q = moe_forward(
                &layer,
                &x,
                &r,
                &Path::Nvfp4 {
                    scales: &s,
                    flavor: Flavor::Reference,
                },
                false,
            )
            .unwrap();
            let mt = compare(&q.out, &reference.out);
            // a fully quantized MoE layer: ~0.1-0.25 rel-L2 against BF16
            assert!(
                mt.rel_l2 > 0.05 && mt.rel_l2 < 0.3,
                "seed {seed} {src}: rel_l2 {}",
                mt.rel_l2
            );
        }
        // the engines' default gs (amax assumed 1) saturates these activations
        let d = ActScales::Fixed {
            gs1: vec![2688.0; 16],
            gs2: vec![2688.0; 16],
        };
        let q = moe_forward(
            &layer,
            &x,
            &r,
            &Path::Nvfp4 {
                scales: &d,
                flavor: Flavor::Reference,
            },
            false,
        )
        .unwrap();
        assert!(
            q.act_stats.saturated * 4 > q.act_stats.blocks,
            "{:?}",
            q.act_stats
        );
    }

    #[test]
    fn v4_presets_route_by_hash_on_their_first_layers() {
        let m = SyntheticModel::new(Preset::TinyV4, rand::random());
        let l0 = m.moe_layer(0).unwrap();
        assert!(
            l0.is_hash_layer()
                && l0.router.tid2eid.is_some()
                && l0.router.e_score_correction_bias.is_none()
        );
        let l1 = m.moe_layer(1).unwrap();
        assert!(!l1.is_hash_layer() && l1.router.tid2eid.is_none());
        let (x, ids) = m.activations(0, 8, 3);
        let r = crate::moe::route(&l0, &x, Some(&ids)).unwrap();
        let t = l0.router.tid2eid.as_ref().unwrap();
        for tk in 0..8 {
            let row = &t[ids[tk] as usize * 4..ids[tk] as usize * 4 + 4];
            let got: Vec<i64> = r.topk_ids[tk * 4..tk * 4 + 4]
                .iter()
                .map(|&v| v as i64)
                .collect();
            assert_eq!(got, row);
        }
        assert!(m.moe_layer(5).is_err());
    }

    #[test]
    fn real_presets_have_the_published_dims() {
        let c = Preset::Dsv3.config();
        assert_eq!(
            (
                c.hidden_size,
                c.moe_intermediate_size,
                c.n_routed_experts,
                c.num_experts_per_tok
            ),
            (7168, 2048, 256, 8)
        );
        assert_eq!(
            (
                c.n_group,
                c.topk_group,
                c.first_k_dense_replace,
                c.num_hidden_layers
            ),
            (8, 4, 3, 61)
        );
        let p = Preset::Dsv4Pro.config();
        assert_eq!(
            (p.hidden_size, p.n_routed_experts, p.num_hash_layers),
            (7168, 384, 3)
        );
        assert_eq!(p.scoring_func, ScoringFunc::Sqrtsoftplus);
        assert_eq!("dsv4-flash".parse::<Preset>(), Ok(Preset::Dsv4Flash));
        // a cut model keeps a valid config: no more hash layers than layers
        let cut = SyntheticModel::new(Preset::Dsv4Flash, 0).with_layers(1);
        assert_eq!(
            (cut.config.num_hidden_layers, cut.config.num_hash_layers),
            (1, 1)
        );
    }

    #[test]
    fn planted_faults_change_what_they_say() {
        let m = SyntheticModel::new(Preset::Tiny, rand::random());
        let w = m.expert_bf16(1, 0);
        let clean = quantize_expert(&w, 256, 128, [0.01, 0.01, 0.02], true);
        for f in Fault::all() {
            let mut ex = clean.clone();
            let what = f.plant(&mut ex, &w);
            assert!(!what.is_empty());
            match f {
                Fault::NanBlockScale => assert!(e4m3::is_nan(ex.w1.weight.scales[0])),
                Fault::BadInputScale => assert_eq!(ex.w1.input_scale, Some(0.01 / 1000.0)),
                Fault::Ws2Mismatch => assert_ne!(ex.w1.weight.scale_2, ex.w3.weight.scale_2),
                Fault::SaturatedScales => {
                    let sat = ex
                        .w1
                        .weight
                        .scales
                        .iter()
                        .filter(|&&s| s == e4m3::MAX_CODE)
                        .count();
                    assert!(sat * 2 > ex.w1.weight.scales.len(), "{sat}");
                }
                Fault::MissingTensor => assert_eq!(ex.w2.weight, clean.w2.weight),
                Fault::SwapGateUp => assert_eq!(ex.w1.weight, clean.w3.weight),
            }
            assert_eq!(f.name().parse::<Fault>(), Ok(f));
        }
    }
}
