//! Synthetic traces: a tiny transformer (vLLM module names, random weights from a seed) run in
//! f32 and recorded the way the Python recorder records a real one — children before parents,
//! inputs and outputs per call. Faults are planted inside one module's computation and then
//! propagate downstream through the real arithmetic, so `nan-locate` and `bisect` are tested
//! on what a broken model actually leaves behind, without Python or a GPU.

use crate::checkpoint::writer::{bf16_bytes, f32_bytes, i64_bytes, write_file, TensorSpec};
use crate::error::{Error, Result};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, StandardNormal};
use safetensors::Dtype;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum FaultKind {
    /// Set one element (token, channel) of the module's output to NaN.
    Nan,
    /// Set one element to +Inf.
    Inf,
    /// Add Gaussian noise of this size relative to the output's RMS (cosine ≈ 1/√(1+s²)).
    Perturb(f32),
}

#[derive(Clone, Debug, PartialEq)]
pub struct Fault {
    pub module: String,
    pub kind: FaultKind,
    pub token: usize,
    pub channel: usize,
}

#[derive(Clone, Debug)]
pub struct SynthTraceConfig {
    pub tokens: usize,
    pub hidden: usize,
    pub heads: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub vocab: usize,
    /// Weights and token ids.
    pub seed: u64,
    /// Storage dtype of float tensors: BF16, F16 or F32.
    pub dtype: Dtype,
    pub inputs: bool,
    pub rank: Option<u64>,
    /// Step of the first forward pass; with `steps > 1` the passes are numbered from it.
    pub step: Option<u64>,
    pub steps: usize,
    pub counter_start: u64,
    /// Relative noise added to every output, as a different-but-healthy kernel would.
    pub jitter: f32,
    pub faults: Vec<Fault>,
}

impl Default for SynthTraceConfig {
    fn default() -> Self {
        SynthTraceConfig {
            tokens: 8,
            hidden: 64,
            heads: 4,
            intermediate: 128,
            layers: 2,
            vocab: 97,
            seed: 0,
            dtype: Dtype::BF16,
            inputs: true,
            rank: None,
            step: None,
            steps: 1,
            counter_start: 0,
            jitter: 0.0,
            faults: vec![],
        }
    }
}

struct Weights {
    embed: Vec<f32>,
    layers: Vec<LayerWeights>,
    norm: Vec<f32>,
    lm_head: Vec<f32>,
}

struct LayerWeights {
    ln1: Vec<f32>,
    wq: Vec<f32>,
    wk: Vec<f32>,
    wv: Vec<f32>,
    wo: Vec<f32>,
    ln2: Vec<f32>,
    w13: Vec<f32>,
    w2: Vec<f32>,
}

fn normal(rng: &mut ChaCha8Rng, n: usize, std: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let z: f32 = StandardNormal.sample(rng);
            z * std
        })
        .collect()
}

impl Weights {
    fn new(c: &SynthTraceConfig) -> Weights {
        let mut rng = ChaCha8Rng::seed_from_u64(c.seed);
        let (h, i) = (c.hidden, c.intermediate);
        let lin =
            |rng: &mut ChaCha8Rng, o: usize, k: usize| normal(rng, o * k, 1.0 / (k as f32).sqrt());
        let norm =
            |rng: &mut ChaCha8Rng| normal(rng, h, 0.1).into_iter().map(|v| 1.0 + v).collect();
        let embed = normal(&mut rng, c.vocab * h, 1.0);
        let layers = (0..c.layers)
            .map(|_| LayerWeights {
                ln1: norm(&mut rng),
                wq: lin(&mut rng, h, h),
                wk: lin(&mut rng, h, h),
                wv: lin(&mut rng, h, h),
                wo: lin(&mut rng, h, h),
                ln2: norm(&mut rng),
                w13: lin(&mut rng, 2 * i, h),
                w2: lin(&mut rng, h, i),
            })
            .collect();
        Weights {
            embed,
            layers,
            norm: norm(&mut rng),
            lm_head: lin(&mut rng, c.vocab, h),
        }
    }
}

/// `y[t, o] = Σ_k x[t, k] · w[o, k]`
fn linear(x: &[f32], w: &[f32], out: usize) -> Vec<f32> {
    let k = w.len() / out.max(1);
    x.chunks(k.max(1))
        .flat_map(|row| {
            w.chunks(k.max(1))
                .map(move |wr| row.iter().zip(wr).map(|(a, b)| a * b).sum::<f32>())
        })
        .collect()
}

fn rmsnorm(x: &[f32], w: &[f32]) -> Vec<f32> {
    x.chunks(w.len().max(1))
        .flat_map(|row| {
            let ms = row.iter().map(|v| v * v).sum::<f32>() / row.len() as f32;
            let r = 1.0 / (ms + 1e-6).sqrt();
            row.iter().zip(w).map(move |(v, g)| v * r * g)
        })
        .collect()
}

/// Causal multi-head attention on `[T, H]` q, k, v.
fn attention(q: &[f32], k: &[f32], v: &[f32], tokens: usize, heads: usize) -> Vec<f32> {
    let h = q.len() / tokens.max(1);
    let dh = h / heads.max(1);
    let scale = 1.0 / (dh as f32).sqrt();
    let mut out = vec![0f32; q.len()];
    for hd in 0..heads {
        for t in 0..tokens {
            let qi = &q[t * h + hd * dh..t * h + (hd + 1) * dh];
            let scores: Vec<f32> = (0..=t)
                .map(|s| {
                    let ki = &k[s * h + hd * dh..s * h + (hd + 1) * dh];
                    qi.iter().zip(ki).map(|(a, b)| a * b).sum::<f32>() * scale
                })
                .collect();
            let m = scores.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let e: Vec<f32> = scores.iter().map(|s| (s - m).exp()).collect();
            let z: f32 = e.iter().sum();
            for (s, p) in e.iter().enumerate() {
                for d in 0..dh {
                    out[t * h + hd * dh + d] += p / z * v[s * h + hd * dh + d];
                }
            }
        }
    }
    out
}

fn silu_mul(gu: &[f32], inter: usize) -> Vec<f32> {
    gu.chunks(2 * inter)
        .flat_map(|row| {
            let (g, u) = row.split_at(inter);
            g.iter().zip(u).map(|(g, u)| g / (1.0 + (-g).exp()) * u)
        })
        .collect()
}

enum Val<'a> {
    F(&'a [f32], Vec<usize>),
    Ids(&'a [i64]),
}

/// Receives each module call as it completes; the forward is written once for both the dry
/// run (collect names) and the recording run.
struct Recorder<'c> {
    cfg: &'c SynthTraceConfig,
    dir: Option<&'c Path>,
    counter: u64,
    step: Option<u64>,
    names: Vec<String>,
    written: Vec<PathBuf>,
    jitter_rng: ChaCha8Rng,
}

impl Recorder<'_> {
    /// A call of a module from hidden states `[tokens, hidden]` to hidden states.
    fn call_hidden(
        &mut self,
        module: &str,
        input: &[f32],
        output: &mut [f32],
        th: &[usize],
    ) -> Result<()> {
        self.call(module, &[Val::F(input, th.to_vec())], output, th, None)
    }

    /// Apply planted faults and jitter to `output` (in place: downstream sees them), then record.
    fn call(
        &mut self,
        module: &str,
        inputs: &[Val],
        output: &mut [f32],
        shape: &[usize],
        extra: Option<(&[f32], Vec<usize>)>,
    ) -> Result<()> {
        self.names.push(module.to_string());
        if self.cfg.jitter > 0.0 {
            perturb(output, self.cfg.jitter, &mut self.jitter_rng);
        }
        let per_token: usize = shape.iter().skip(1).product();
        for f in self.cfg.faults.iter().filter(|f| f.module == module) {
            let idx = f.token * per_token + f.channel;
            match f.kind {
                FaultKind::Nan | FaultKind::Inf => {
                    let v = if f.kind == FaultKind::Nan {
                        f32::NAN
                    } else {
                        f32::INFINITY
                    };
                    let slot = output.get_mut(idx).ok_or_else(|| {
                        Error::usage(format!(
                            "fault at `{module}`: (token {}, channel {}) is outside its output {shape:?}",
                            f.token, f.channel
                        ))
                    })?;
                    *slot = v;
                }
                FaultKind::Perturb(s) => {
                    let mut rng =
                        ChaCha8Rng::seed_from_u64(self.cfg.seed ^ 0x5EED_F00D ^ self.counter);
                    perturb(output, s, &mut rng);
                }
            }
        }
        if let Some(dir) = self.dir {
            let dt = self.cfg.dtype;
            let float = |name: String, x: &[f32], shape: &[usize]| {
                let bytes = match dt {
                    Dtype::F32 => f32_bytes(x),
                    Dtype::F16 => x
                        .iter()
                        .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
                        .collect(),
                    _ => bf16_bytes(x),
                };
                (TensorSpec::new(name, dt, shape), bytes)
            };
            let mut tensors = Vec::new();
            if self.cfg.inputs {
                for (i, v) in inputs.iter().enumerate() {
                    tensors.push(match v {
                        Val::F(x, s) => float(format!("input.{i}"), x, s),
                        Val::Ids(ids) => (
                            TensorSpec::new(format!("input.{i}"), Dtype::I64, &[ids.len()]),
                            i64_bytes(ids),
                        ),
                    });
                }
            }
            tensors.push(float("output".into(), output, shape));
            if let Some((x, s)) = extra {
                tensors.push(float("output.1".into(), x, &s));
            }
            let mut meta = BTreeMap::new();
            if let Some(r) = self.cfg.rank {
                meta.insert("rank".to_string(), r.to_string());
            }
            if let Some(s) = self.step {
                meta.insert("step".to_string(), s.to_string());
            }
            let path = dir.join(format!("{:06}-{module}.safetensors", self.counter));
            write_file(&path, tensors, (!meta.is_empty()).then_some(meta))?;
            self.written.push(path);
        }
        self.counter += 1;
        Ok(())
    }
}

fn perturb(x: &mut [f32], rel: f32, rng: &mut ChaCha8Rng) {
    let finite: Vec<f32> = x.iter().copied().filter(|v| v.is_finite()).collect();
    let rms = (finite.iter().map(|v| v * v).sum::<f32>() / finite.len().max(1) as f32).sqrt();
    for v in x.iter_mut() {
        let z: f32 = StandardNormal.sample(rng);
        *v += rel * rms * z;
    }
}

fn forward(c: &SynthTraceConfig, w: &Weights, ids: &[i64], r: &mut Recorder) -> Result<()> {
    let (t, h, inter) = (c.tokens, c.hidden, c.intermediate);
    let th = vec![t, h];
    let mut x: Vec<f32> = ids
        .iter()
        .flat_map(|&id| {
            w.embed[id as usize * h..(id as usize + 1) * h]
                .iter()
                .copied()
        })
        .collect();
    r.call("model.embed_tokens", &[Val::Ids(ids)], &mut x, &th, None)?;
    let mut hs = x;
    for (l, lw) in w.layers.iter().enumerate() {
        let p = format!("model.layers.{l}");
        let layer_in = hs.clone();
        let mut xn = rmsnorm(&hs, &lw.ln1);
        r.call_hidden(&format!("{p}.input_layernorm"), &hs, &mut xn, &th)?;
        let mut q = linear(&xn, &lw.wq, h);
        r.call_hidden(&format!("{p}.self_attn.q_proj"), &xn, &mut q, &th)?;
        let mut k = linear(&xn, &lw.wk, h);
        r.call_hidden(&format!("{p}.self_attn.k_proj"), &xn, &mut k, &th)?;
        let mut v = linear(&xn, &lw.wv, h);
        r.call_hidden(&format!("{p}.self_attn.v_proj"), &xn, &mut v, &th)?;
        let mut o = attention(&q, &k, &v, t, c.heads);
        r.call(
            &format!("{p}.self_attn.attn"),
            &[
                Val::F(&q, th.clone()),
                Val::F(&k, th.clone()),
                Val::F(&v, th.clone()),
            ],
            &mut o,
            &th,
            None,
        )?;
        let mut a = linear(&o, &lw.wo, h);
        r.call_hidden(&format!("{p}.self_attn.o_proj"), &o, &mut a, &th)?;
        r.call_hidden(&format!("{p}.self_attn"), &xn, &mut a, &th)?;
        let h1: Vec<f32> = hs.iter().zip(&a).map(|(x, y)| x + y).collect();
        let mut x2 = rmsnorm(&h1, &lw.ln2);
        r.call_hidden(&format!("{p}.post_attention_layernorm"), &h1, &mut x2, &th)?;
        let mut gu = linear(&x2, &lw.w13, 2 * inter);
        r.call(
            &format!("{p}.mlp.gate_up_proj"),
            &[Val::F(&x2, th.clone())],
            &mut gu,
            &[t, 2 * inter],
            None,
        )?;
        let mut act = silu_mul(&gu, inter);
        r.call(
            &format!("{p}.mlp.act_fn"),
            &[Val::F(&gu, vec![t, 2 * inter])],
            &mut act,
            &[t, inter],
            None,
        )?;
        let mut m = linear(&act, &lw.w2, h);
        r.call(
            &format!("{p}.mlp.down_proj"),
            &[Val::F(&act, vec![t, inter])],
            &mut m,
            &th,
            None,
        )?;
        r.call_hidden(&format!("{p}.mlp"), &x2, &mut m, &th)?;
        let mut h2: Vec<f32> = h1.iter().zip(&m).map(|(x, y)| x + y).collect();
        // the decoder layer returns a tuple: the new residual stream and the mid-layer one
        r.call(
            &p,
            &[Val::F(&layer_in, th.clone())],
            &mut h2,
            &th,
            Some((&h1, th.clone())),
        )?;
        hs = h2;
    }
    let mut hn = rmsnorm(&hs, &w.norm);
    r.call_hidden("model.norm", &hs, &mut hn, &th)?;
    r.call("model", &[Val::Ids(ids)], &mut hn, &th, None)?;
    let mut logits = linear(&hn, &w.lm_head, c.vocab);
    r.call(
        "lm_head",
        &[Val::F(&hn, th.clone())],
        &mut logits,
        &[t, c.vocab],
        None,
    )?;
    Ok(())
}

fn check(c: &SynthTraceConfig) -> Result<()> {
    let dims = [
        c.tokens,
        c.hidden,
        c.heads,
        c.intermediate,
        c.layers,
        c.vocab,
        c.steps,
    ];
    if dims.contains(&0) || !c.hidden.is_multiple_of(c.heads) {
        return Err(Error::usage(
            "synthetic trace: every dimension must be > 0 and hidden divisible by heads",
        ));
    }
    if !matches!(c.dtype, Dtype::BF16 | Dtype::F16 | Dtype::F32) {
        return Err(Error::usage(
            "synthetic trace: dtype must be bf16, f16 or f32",
        ));
    }
    Ok(())
}

/// The module calls of one forward pass, in completion order.
pub fn module_calls(c: &SynthTraceConfig) -> Result<Vec<String>> {
    check(c)?;
    let dry = SynthTraceConfig {
        faults: vec![],
        jitter: 0.0,
        tokens: 1,
        ..c.clone()
    };
    let w = Weights::new(&dry);
    let mut r = Recorder {
        cfg: &dry,
        dir: None,
        counter: 0,
        step: None,
        names: vec![],
        written: vec![],
        jitter_rng: ChaCha8Rng::seed_from_u64(0),
    };
    forward(&dry, &w, &[0], &mut r)?;
    Ok(r.names)
}

/// Write the trace into `dir` (created if needed); returns the files in execution order.
pub fn write_trace(dir: &Path, c: &SynthTraceConfig) -> Result<Vec<PathBuf>> {
    let calls = module_calls(c)?;
    for f in &c.faults {
        if !calls.contains(&f.module) {
            return Err(Error::usage(format!(
                "fault at `{}`: no such module in the synthetic model (it has e.g. {}, {}, {})",
                f.module,
                calls.first().map(String::as_str).unwrap_or(""),
                calls.get(5).map(String::as_str).unwrap_or(""),
                calls.last().map(String::as_str).unwrap_or("")
            )));
        }
    }
    let w = Weights::new(c);
    // a dry run with the faults first: a fault outside its module's output is reported before
    // any file is written
    let mut dry = Recorder {
        cfg: c,
        dir: None,
        counter: 0,
        step: None,
        names: vec![],
        written: vec![],
        jitter_rng: ChaCha8Rng::seed_from_u64(0),
    };
    forward(c, &w, &vec![0; c.tokens], &mut dry)?;
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let mut r = Recorder {
        cfg: c,
        dir: Some(dir),
        counter: c.counter_start,
        step: None,
        names: vec![],
        written: vec![],
        jitter_rng: ChaCha8Rng::seed_from_u64(c.seed ^ 0x0717_7E55),
    };
    let mut ids_rng = ChaCha8Rng::seed_from_u64(c.seed.wrapping_add(1));
    for s in 0..c.steps {
        r.step = c
            .step
            .map(|first| first + s as u64)
            .or((c.steps > 1).then_some(s as u64));
        let ids: Vec<i64> = (0..c.tokens)
            .map(|_| ids_rng.gen_range(0..c.vocab as i64))
            .collect();
        forward(c, &w, &ids, &mut r)?;
    }
    Ok(r.written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_seed_gives_the_same_trace_and_faults_are_checked() {
        let seed: u64 = rand::random();
        let dir = tempfile::tempdir().unwrap();
        let c = SynthTraceConfig {
            seed,
            ..Default::default()
        };
        let a = write_trace(&dir.path().join("a"), &c).unwrap();
        let b = write_trace(&dir.path().join("b"), &c).unwrap();
        assert_eq!(a.len(), module_calls(&c).unwrap().len());
        for (x, y) in a.iter().zip(&b) {
            assert_eq!(x.file_name(), y.file_name());
            assert_eq!(
                std::fs::read(x).unwrap(),
                std::fs::read(y).unwrap(),
                "seed {seed}"
            );
        }
        let fault = |module: &str, token| SynthTraceConfig {
            faults: vec![Fault {
                module: module.into(),
                kind: FaultKind::Nan,
                token,
                channel: 0,
            }],
            ..c.clone()
        };
        let e = write_trace(&dir.path().join("c"), &fault("model.layers.9.mlp", 0)).unwrap_err();
        assert!(e.to_string().contains("model.layers.9.mlp"), "{e}");
        let e = write_trace(&dir.path().join("d"), &fault("lm_head", 99)).unwrap_err();
        assert!(e.to_string().contains("token 99"), "{e}");
        assert!(!dir.path().join("d").exists());
        let bad = SynthTraceConfig {
            heads: 3,
            ..c.clone()
        };
        assert!(write_trace(&dir.path().join("e"), &bad).is_err());
    }
}
