//! The MoE figures at DeepSeek-V3 dims: the grouped NVFP4 GEMMs (prefill and decode), the
//! same problems through per-expert cuBLAS BF16 GEMMs, and the whole layer (router, sort,
//! GEMMs, shared expert, combine) eager and as a CUDA graph.

use super::figure::{Spec, Unit};
use super::gpu::{alloc, details, fill_bf16, fill_f32, Runner};
use super::plan::{self, Dims, Load};
use super::synth;
use super::timer;
use crate::backend::cuda::blas;
use crate::backend::cuda::moe::{Nvfp4Forward, Stage};
use crate::error::{Error, Result};
use crate::moe::synthetic::Preset;
use crate::moe::{ActScales, MoeLayer, MoeOutput, Routing};
use crate::nvfp4::Flavor;
use cudarc::driver::CudaSlice;
use serde_json::{json, Value};

/// The host-side layer and inputs every MoE figure shares.
struct Material {
    layer: MoeLayer,
    dims: Dims,
    hidden: Vec<f32>,
    scales: ActScales,
}

/// BF16 weights of every expert and activations for the largest batch (cuBLAS baseline).
struct Bf16Experts {
    w13: CudaSlice<u16>,
    w2: CudaSlice<u16>,
    x: CudaSlice<u16>,
    a: CudaSlice<u16>,
    g: CudaSlice<u16>,
    y: CudaSlice<u16>,
    rows: usize,
}

/// Batches at or above this size are reported in TFLOP/s, smaller ones in GB/s (at DSv3 dims
/// on Hopper the floor changes from bytes to FLOPs between 64 and 4096 tokens).
const COMPUTE_BOUND_TOKENS: usize = 1024;

fn check_finite(out: &MoeOutput, what: &str) -> Result<()> {
    // a time-split build (kernels/moe_gemm_sm90.cu RS_DIAG) computes wrong outputs on purpose
    if crate::backend::cuda::nvrtc::tuning_define("RS_DIAG").is_some_and(|d| d != 0) {
        return Ok(());
    }
    let bad = out.out.iter().filter(|v| !v.is_finite()).count();
    if bad > 0 || out.out.is_empty() {
        return Err(Error::usage(format!(
            "{what}: {bad} of {} outputs are not finite (the synthetic data or the kernels are broken)",
            out.out.len()
        )));
    }
    if out.act_stats.nan_scales > 0 {
        return Err(Error::usage(format!(
            "{what}: {} activation block scales are NaN",
            out.act_stats.nan_scales
        )));
    }
    Ok(())
}

impl Runner<'_> {
    fn gemm_names(tokens: usize) -> Vec<String> {
        if tokens == plan::PREFILL_TOKENS {
            vec![
                plan::prefill_name(Some("gate_up")),
                plan::prefill_name(Some("down")),
                plan::prefill_name(None),
            ]
        } else {
            vec![plan::decode_name(tokens)]
        }
    }

    fn layer_names(tokens: usize) -> Vec<String> {
        if plan::LAYER_TOKENS.contains(&tokens) {
            vec![
                plan::layer_name(tokens, false),
                plan::layer_name(tokens, true),
            ]
        } else {
            vec![]
        }
    }

    /// Every MoE figure: GEMMs per batch (sharing one uploaded forward with the layer figures
    /// of the same batch), then the layer-only batches.
    pub fn moe(&mut self) -> Result<()> {
        let mut batches: Vec<usize> = vec![plan::PREFILL_TOKENS];
        batches.extend(plan::DECODE_TOKENS.iter().rev());
        for t in plan::LAYER_TOKENS {
            if !batches.contains(&t) {
                batches.push(t);
            }
        }
        let wanted = |r: &Self, t: usize| {
            Self::gemm_names(t)
                .into_iter()
                .chain(Self::layer_names(t))
                .chain(std::iter::once(plan::cublas_experts_name(t)))
                .any(|n| r.wants(&n))
        };
        if !batches.iter().any(|t| wanted(self, *t)) {
            return Ok(());
        }
        let config = Preset::Dsv3.config();
        let dims = Dims::from_config(&config);
        self.say(&format!(
            "generating a synthetic DeepSeek-V3 MoE layer on the host ({} experts, {:.1} GB of NVFP4 weights)",
            dims.e,
            dims.e as f64 * (dims.fp4_gate_up_bytes() + dims.fp4_down_bytes()) / 1e9
        ));
        let max_tokens = batches.iter().copied().max().unwrap_or(1);
        let gs1 = 2688.0 / (2.0 * synth::HIDDEN_AMP);
        let m = Material {
            layer: synth::layer(&config, 3, self.seed),
            dims,
            hidden: synth::hidden(max_tokens, dims.h, self.seed),
            // fixed global scales with headroom: nothing saturates, nothing is NaN
            scales: ActScales::Fixed {
                gs1: vec![gs1; dims.e],
                gs2: vec![2688.0 / 256.0; dims.e],
            },
        };
        let mut bf16: Option<Bf16Experts> = None;
        for t in batches {
            if wanted(self, t) {
                self.batch(&m, t, &mut bf16)?;
            }
        }
        Ok(())
    }

    fn batch(&mut self, m: &Material, tokens: usize, bf16: &mut Option<Bf16Experts>) -> Result<()> {
        let d = m.dims;
        let gemm: Vec<String> = Self::gemm_names(tokens)
            .into_iter()
            .filter(|n| self.wants(n))
            .collect();
        let layer: Vec<String> = Self::layer_names(tokens)
            .into_iter()
            .filter(|n| self.wants(n))
            .collect();
        let cublas = plan::cublas_experts_name(tokens);
        let routing = plan::uniform_routing(tokens, d.k, d.e, self.seed ^ ((tokens as u64) << 8))?;
        let load = Load::of(&routing, d.e);
        if !gemm.is_empty() || !layer.is_empty() {
            self.say(&format!(
                "uploading the layer for {tokens} tokens ({} experts touched by the GEMM routing)",
                load.touched
            ));
            match self.forward(m, tokens) {
                Ok(mut f) => {
                    if !gemm.is_empty() {
                        self.nvfp4_gemms(m, &mut f, &routing, load, &gemm)?;
                    }
                    if self.wants(&cublas) {
                        self.cublas_experts(m, &routing, load, bf16)?;
                    }
                    if !layer.is_empty() {
                        self.layer_figs(m, &mut f, &layer)?;
                    }
                    return Ok(());
                }
                Err(e) => {
                    let specs = gemm
                        .iter()
                        .map(|n| self.gemm_spec(m, n, tokens, load))
                        .chain(layer.iter().map(|n| self.layer_spec(m, n, tokens, load)))
                        .collect();
                    self.record_all(specs, e)?;
                }
            }
        }
        if self.wants(&cublas) {
            self.cublas_experts(m, &routing, load, bf16)?;
        }
        Ok(())
    }

    fn forward(&self, m: &Material, tokens: usize) -> Result<Nvfp4Forward> {
        let f = Nvfp4Forward::new(
            &self.gpu,
            &m.layer,
            tokens,
            &m.scales,
            Flavor::Reference,
            false,
        )?;
        f.set_hidden(&m.hidden[..tokens * m.dims.h])?;
        Ok(f)
    }

    fn common_details(
        &self,
        m: &Material,
        tokens: usize,
        load: Load,
    ) -> serde_json::Map<String, serde_json::Value> {
        let d = m.dims;
        details(&[
            ("tokens", json!(tokens)),
            ("top_k", json!(d.k)),
            ("experts", json!(d.e)),
            ("hidden_size", json!(d.h)),
            ("moe_intermediate_size", json!(d.i)),
            ("rows", json!(load.rows)),
            ("touched_experts", json!(load.touched)),
        ])
    }

    fn gemm_spec(&self, m: &Material, name: &str, tokens: usize, load: Load) -> Spec {
        let d = &m.dims;
        let gu = plan::gate_up_work(d, load);
        let dn = plan::down_work(d, load);
        let (what, work) = if name == plan::prefill_name(Some("gate_up")) {
            ("the grouped gate/up GEMM [2x2048, 7168] with SwiGLU and NVFP4 requantization fused", gu)
        } else if name == plan::prefill_name(Some("down")) {
            ("the grouped down GEMM [7168, 2048] (f32 out)", dn)
        } else {
            (
                "both grouped GEMMs (gate/up with SwiGLU + requantization, then down)",
                gu + dn,
            )
        };
        let routing = "uniform random routing (distinct experts per token)";
        let mut s = if tokens >= COMPUTE_BOUND_TOKENS {
            let mut s = self.spec(
                name.into(),
                "gemm",
                format!("NVFP4 {what}, {tokens} tokens x top-{} of {} experts, {routing}; rate = FLOPs / median", d.k, d.e),
                Unit::TFlops,
            );
            s.amount = work.flops;
            s
        } else {
            let mut s = self.spec(
                name.into(),
                "gemm",
                format!("NVFP4 {what}, {tokens} tokens x top-{} of {} experts, {routing}; rate = FP4 weight bytes touched (codes + E4M3 scales) / median; L2 flushed between repeats", d.k, d.e),
                Unit::GBps,
            );
            s.amount = plan::fp4_weight_bytes(d, load);
            s
        };
        s.work = work;
        if work == gu + dn {
            s.baseline = Some(plan::cublas_experts_name(tokens));
        }
        s.details = self.common_details(m, tokens, load);
        s
    }

    fn nvfp4_gemms(
        &mut self,
        m: &Material,
        f: &mut Nvfp4Forward,
        routing: &Routing,
        load: Load,
        names: &[String],
    ) -> Result<()> {
        let tokens = routing.tokens;
        let specs: Vec<Spec> = names
            .iter()
            .map(|n| self.gemm_spec(m, n, tokens, load))
            .collect();
        // one whole forward first: the prologue leaves the sorted, quantized inputs the GEMM
        // stages read, and the output says the data is sane
        let ready = (|| {
            f.set_routing(&m.layer, routing)?;
            f.enqueue()?;
            check_finite(&f.output()?, "the NVFP4 forward on the GEMM routing")
        })();
        if let Err(e) = ready {
            return self.record_all(specs, e);
        }
        let decode = tokens < COMPUTE_BOUND_TOKENS;
        if decode {
            self.flush_buffers()?;
        }
        let gpu = self.gpu.clone();
        let cfg = *self.cfg();
        for spec in specs {
            let stages: &[Stage] = if spec.name == plan::prefill_name(Some("gate_up")) {
                &[Stage::GateUp]
            } else if spec.name == plan::prefill_name(Some("down")) {
                &[Stage::Down]
            } else {
                &[Stage::GateUp, Stage::Down]
            };
            let f: &Nvfp4Forward = f;
            let mut body = |_| {
                for s in stages {
                    f.enqueue_stage(*s)?;
                }
                Ok(())
            };
            let r = if decode {
                timer::time(
                    &gpu,
                    &cfg,
                    &spec.name,
                    &mut |_| self.enqueue_flush(),
                    &mut body,
                )
            } else {
                timer::time_plain(&gpu, &cfg, &spec.name, &mut body)
            };
            // the stages ran on intact inputs: a full forward is still sane
            let r = r.and_then(|s| {
                f.enqueue()?;
                check_finite(&f.output()?, &spec.name)?;
                Ok(s)
            });
            self.record(spec, r)?;
        }
        Ok(())
    }

    fn cublas_spec(&self, m: &Material, tokens: usize, load: Load) -> Spec {
        let d = &m.dims;
        let work = plan::cublas_experts_work(d, load);
        let what = format!(
            "the same expert GEMMs in BF16 through cuBLAS: per touched expert, x·[W1;W3]ᵀ [2x2048, 7168] and a·W2ᵀ [7168, 2048] (FP32 accumulate, BF16 out; no SwiGLU between), captured in one CUDA graph; {tokens} tokens x top-{} of {}",
            d.k, d.e
        );
        let mut s = if tokens >= COMPUTE_BOUND_TOKENS {
            let mut s = self.spec(
                plan::cublas_experts_name(tokens),
                "gemm",
                format!("{what}; rate = FLOPs / median"),
                Unit::TFlops,
            );
            s.amount = work.flops;
            s
        } else {
            let mut s = self.spec(
                plan::cublas_experts_name(tokens),
                "gemm",
                format!(
                    "{what}; rate = BF16 weight bytes touched / median; L2 flushed between repeats"
                ),
                Unit::GBps,
            );
            s.amount = load.touched as f64 * d.bf16_expert_bytes();
            s
        };
        s.work = work;
        s.details = self.common_details(m, tokens, load);
        s
    }

    fn cublas_experts(
        &mut self,
        m: &Material,
        routing: &Routing,
        load: Load,
        bf16: &mut Option<Bf16Experts>,
    ) -> Result<()> {
        let d = m.dims;
        let tokens = routing.tokens;
        let spec = self.cublas_spec(m, tokens, load);
        let gpu = self.gpu.clone();
        if bf16.is_none() {
            let rows = plan::PREFILL_TOKENS * d.k;
            self.say(&format!(
                "allocating BF16 weights of all {} experts for the cuBLAS baseline ({:.1} GB)",
                d.e,
                d.e as f64 * d.bf16_expert_bytes() / 1e9
            ));
            let made = (|| {
                let b = Bf16Experts {
                    w13: alloc::<u16>(&gpu, d.e * 2 * d.i * d.h, "BF16 gate/up weights")?,
                    w2: alloc::<u16>(&gpu, d.e * d.h * d.i, "BF16 down weights")?,
                    x: alloc::<u16>(&gpu, rows * d.h, "BF16 expert inputs")?,
                    a: alloc::<u16>(&gpu, rows * d.i, "BF16 intermediate")?,
                    g: alloc::<u16>(&gpu, rows * 2 * d.i, "gate/up outputs")?,
                    y: alloc::<u16>(&gpu, rows * d.h, "down outputs")?,
                    rows,
                };
                // uniform ±amp has RMS amp/sqrt(3): weights of RMS 1/sqrt(in)
                let amp = |k: usize| (3.0 / k as f32).sqrt();
                fill_bf16(&gpu, &b.w13, amp(d.h), self.seed ^ 0xB13)?;
                fill_bf16(&gpu, &b.w2, amp(d.i), self.seed ^ 0xB2)?;
                fill_bf16(&gpu, &b.x, synth::HIDDEN_AMP, self.seed ^ 0xB0)?;
                fill_bf16(&gpu, &b.a, 1.0, self.seed ^ 0xBA)?;
                Ok(b)
            })();
            match made {
                Ok(b) => *bf16 = Some(b),
                Err(e) => return self.record_all(vec![spec], e),
            }
        }
        let Some(b) = bf16.as_ref() else {
            return Ok(());
        };
        let decode = tokens < COMPUTE_BOUND_TOKENS;
        if decode {
            self.flush_buffers()?;
        }
        let cfg = *self.cfg();
        let name = spec.name.clone();
        let r = (|| {
            if load.rows > b.rows {
                return Err(Error::usage(
                    "internal: batch larger than the cuBLAS buffers",
                ));
            }
            let offs = plan::expert_offsets(&plan::expert_counts(routing, d.e));
            let (w13, w2) = (gpu.ptr(&b.w13), gpu.ptr(&b.w2));
            let (x, a, g, y) = (gpu.ptr(&b.x), gpu.ptr(&b.a), gpu.ptr(&b.g), gpu.ptr(&b.y));
            let mut enqueue = || -> Result<()> {
                for (e, w) in offs.windows(2).enumerate() {
                    let (r0, rows) = (w[0], w[1] - w[0]);
                    if rows == 0 {
                        continue;
                    }
                    blas::gemm_bf16(
                        &gpu,
                        rows,
                        2 * d.i,
                        d.h,
                        x + (r0 * d.h * 2) as u64,
                        w13 + (e * 2 * d.i * d.h * 2) as u64,
                        g + (r0 * 2 * d.i * 2) as u64,
                        blas::Out::Bf16,
                        "cuBLAS expert gate/up",
                    )?;
                    blas::gemm_bf16(
                        &gpu,
                        rows,
                        d.h,
                        d.i,
                        a + (r0 * d.i * 2) as u64,
                        w2 + (e * d.h * d.i * 2) as u64,
                        y + (r0 * d.h * 2) as u64,
                        blas::Out::Bf16,
                        "cuBLAS expert down",
                    )?;
                }
                Ok(())
            };
            let graph = timer::capture(&gpu, &name, &mut enqueue)?;
            let mut body = |_| timer::replay(&graph, &name);
            let samples = if decode {
                timer::time(&gpu, &cfg, &name, &mut |_| self.enqueue_flush(), &mut body)?
            } else {
                timer::time_plain(&gpu, &cfg, &name, &mut body)?
            };
            let out = gpu.download(&b.y, load.rows.min(64) * d.h, "the cuBLAS down outputs")?;
            if out
                .iter()
                .any(|v| !half::bf16::from_bits(*v).to_f32().is_finite())
            {
                return Err(Error::usage("the cuBLAS expert outputs are not finite"));
            }
            Ok(samples)
        })();
        self.record(spec, r)
    }

    fn layer_spec(&self, m: &Material, name: &str, tokens: usize, load: Load) -> Spec {
        let d = &m.dims;
        let work = plan::layer_work(d, tokens, load);
        let graph = name.ends_with("_graph");
        let how = if graph {
            "replays of one CUDA graph of the whole layer"
        } else {
            "eager launches"
        };
        let what = format!(
            "the whole MoE layer (FP32 router with grouped top-{} of {}, counting sort, NVFP4 quantize, grouped NVFP4 GEMMs, BF16 shared expert, combine), {tokens} tokens, {how}",
            d.k, d.e
        );
        let mut s = if tokens >= COMPUTE_BOUND_TOKENS {
            let mut s = self.spec(
                name.into(),
                "layer",
                format!("{what}; rate = FLOPs / median"),
                Unit::TFlops,
            );
            s.amount = work.flops;
            s
        } else {
            let mut s = self.spec(
                name.into(),
                "layer",
                format!("{what}; rate = bytes (weights touched, router, shared expert, hidden in, output) / median"),
                Unit::GBps,
            );
            s.amount = work.bytes;
            s
        };
        s.work = work;
        s.details = self.common_details(m, tokens, load);
        s.details
            .insert("routing".into(), json!("the layer's router on the GPU"));
        s
    }

    /// Where a decode-size layer spends its time: each stage of the forward timed alone
    /// (eager launches, after one whole forward left the inputs each stage reads), and which
    /// grouped GEMM kernels ran. None when a stage fails (the figures themselves report it).
    fn stage_split(&mut self, m: &Material, f: &mut Nvfp4Forward, tokens: usize) -> Option<Value> {
        let gpu = self.gpu.clone();
        let cfg = *self.cfg();
        f.enqueue().ok()?;
        let mut out = serde_json::Map::new();
        let time = |r: &mut Self, what: String, body: &mut dyn FnMut(usize) -> Result<()>| {
            let s = timer::time_plain(&gpu, &cfg, &what, body).ok()?;
            r.say(&format!("{what}: median {:.4} ms", s.median()));
            Some(s.median())
        };
        for stage in Stage::ALL {
            let ff: &Nvfp4Forward = f;
            let t = time(self, format!("layer_{tokens} stage {stage:?}"), &mut |_| {
                ff.enqueue_stage(stage)
            })?;
            out.insert(format!("{stage:?}"), json!(t));
        }
        // the router's share: the prologue on the routing it produced, given instead
        let routing = f.routing().ok()?;
        f.set_routing(&m.layer, &routing).ok()?;
        let ff: &Nvfp4Forward = f;
        let t = time(
            self,
            format!("layer_{tokens} stage Prologue, routing given"),
            &mut |_| ff.enqueue_stage(Stage::Prologue),
        )?;
        out.insert("Prologue_without_router".into(), json!(t));
        f.route_on_gpu(None).ok()?;
        // the router's logits GEMM alone, both ways the router runs it (router.rs): BF16 on the
        // tensor cores with FP32 accumulation (BF16-exact weight and input, the forward here),
        // and cuBLAS pedantic FP32 (otherwise)
        let (h, e) = (m.dims.h, m.dims.e);
        let x = alloc::<f32>(&self.gpu, tokens * h, "router GEMM input").ok()?;
        let w = alloc::<f32>(&self.gpu, e * h, "router GEMM weight").ok()?;
        let xb = alloc::<u16>(&self.gpu, tokens * h, "router GEMM input (BF16)").ok()?;
        let wb = alloc::<u16>(&self.gpu, e * h, "router GEMM weight (BF16)").ok()?;
        let l = alloc::<f32>(&self.gpu, tokens * e, "router GEMM output").ok()?;
        fill_f32(&self.gpu, &x, 1.0, self.seed).ok()?;
        fill_f32(&self.gpu, &w, 0.01, self.seed ^ 1).ok()?;
        fill_bf16(&self.gpu, &xb, 1.0, self.seed).ok()?;
        fill_bf16(&self.gpu, &wb, 0.01, self.seed ^ 1).ok()?;
        let g2 = self.gpu.clone();
        for (key, what, bf16) in [
            ("router_logits_gemm", "cuBLAS FP32 pedantic", false),
            (
                "router_logits_gemm_bf16",
                "cuBLAS BF16, FP32 accumulation",
                true,
            ),
        ] {
            let t = time(
                self,
                format!("layer_{tokens} router logits GEMM ({what})"),
                &mut |_| {
                    let l = g2.ptr(&l);
                    if bf16 {
                        let (x, w) = (g2.ptr(&xb), g2.ptr(&wb));
                        blas::gemm_bf16(&g2, tokens, e, h, x, w, l, blas::Out::F32, "router logits")
                    } else {
                        blas::gemm_f32(
                            &g2,
                            tokens,
                            e,
                            h,
                            g2.ptr(&x),
                            g2.ptr(&w),
                            l,
                            "router logits",
                        )
                    }
                },
            )?;
            out.insert(key.into(), json!(t));
        }
        out.insert("gemm".into(), json!(format!("{:?}", f.choose_gemm())));
        Some(Value::Object(out))
    }

    fn layer_figs(&mut self, m: &Material, f: &mut Nvfp4Forward, names: &[String]) -> Result<()> {
        let d = m.dims;
        let tokens = f.tokens();
        let gpu = self.gpu.clone();
        let cfg = *self.cfg();
        // until the router has run, the floor assumes the uniform routing's load
        let guess = Load::of(&plan::uniform_routing(tokens, d.k, d.e, self.seed)?, d.e);
        if let Err(e) = f.route_on_gpu(None) {
            let specs = names
                .iter()
                .map(|n| self.layer_spec(m, n, tokens, guess))
                .collect();
            return self.record_all(specs, e);
        }
        // where the layer's time goes, stage by stage (details.stage_median_ms)
        let split = self.stage_split(m, f, tokens);
        let f: &Nvfp4Forward = f;
        for name in names {
            let graph = name.ends_with("_graph");
            let r = (|| {
                let samples = if graph {
                    let g = f.capture()?;
                    timer::time_plain(&gpu, &cfg, name, &mut |_| g.replay())?
                } else {
                    timer::time_plain(&gpu, &cfg, name, &mut |_| f.enqueue())?
                };
                check_finite(&f.output()?, name)?;
                let routing = f.routing()?;
                Ok((samples, Load::of(&routing, d.e), routing))
            })();
            match r {
                Ok((s, load, routing)) => {
                    let mut spec = self.layer_spec(m, name, tokens, load);
                    // the router's load (the GEMM figures' uniform routing gives every expert about
                    // rows / experts)
                    let rows = plan::expert_counts(&routing, d.e);
                    spec.details.insert(
                        "expert_rows_min_p10_median_p90_max".into(),
                        json!(plan::rows_spread(&rows)),
                    );
                    // every expert's rows (bench/tile_split.py: the tiles they make)
                    spec.details.insert("expert_rows".into(), json!(rows));
                    if let Some(v) = &split {
                        spec.details.insert("stage_median_ms".into(), v.clone());
                    }
                    spec.details.insert("schedule".into(), json!(f.schedule()));
                    self.record(spec, Ok(s))?;
                }
                Err(e) => {
                    let spec = self.layer_spec(m, name, tokens, guess);
                    self.record(spec, Err(e))?;
                }
            }
        }
        Ok(())
    }
}
