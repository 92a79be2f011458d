//! What the bench runs: the figure catalogue and `--only`, the DeepSeek-V3 problem sizes, the
//! work (FLOPs, bytes) of each problem, and the synthetic routings of the GEMM figures.

use super::figure::Work;
use crate::error::{Error, Result};
use crate::moe::{MoeConfig, Routing};
use rand::{Rng, SeedableRng};

pub const COPY: &str = "copy_d2d";
/// Square cuBLAS GEMM sizes; the last is skipped by `--quick`.
pub const CUBLAS_SIZES: [usize; 2] = [4096, 8192];
/// The prefill batch of the grouped GEMM and layer figures.
pub const PREFILL_TOKENS: usize = 4096;
/// Decode batches of the grouped GEMM figures.
pub const DECODE_TOKENS: [usize; 3] = [1, 8, 64];
/// Batches of the whole-layer figures.
pub const LAYER_TOKENS: [usize; 2] = [16, 4096];
/// The activations of the quantize figures: `[rows, cols]` BF16.
pub const QUANT_SHAPE: (usize, usize) = (8192, 7168);

/// The figure groups, in run order.
pub const GROUPS: [&str; 5] = ["floors", "quantize", "gemm", "reduce", "layer"];

pub fn cublas_name(m: usize) -> String {
    format!("cublas_bf16_{m}")
}
pub fn quantize_name(flavor: crate::nvfp4::Flavor) -> String {
    match flavor {
        crate::nvfp4::Flavor::Reference => "quantize_bf16_reference".into(),
        crate::nvfp4::Flavor::CudaFast => "quantize_bf16_cuda_fast".into(),
    }
}
pub fn prefill_name(part: Option<&str>) -> String {
    match part {
        Some(p) => format!("gemm_prefill_{PREFILL_TOKENS}_{p}"),
        None => format!("gemm_prefill_{PREFILL_TOKENS}"),
    }
}
pub fn decode_name(tokens: usize) -> String {
    format!("gemm_decode_{tokens}")
}
pub fn cublas_experts_name(tokens: usize) -> String {
    format!("cublas_bf16_experts_{tokens}")
}
pub fn layer_name(tokens: usize, graph: bool) -> String {
    format!("layer_{tokens}_{}", if graph { "graph" } else { "eager" })
}
pub const REDUCE_COMPARE: &str = "reduce_compare";
pub const REDUCE_NAN_SCAN: &str = "reduce_nan_scan";
pub const REDUCE_AMAX: &str = "reduce_amax";

/// Every figure in run order, with its group. `--quick` drops the 8192^3 GEMM.
pub fn catalog(quick: bool) -> Vec<(String, &'static str)> {
    use crate::nvfp4::Flavor;
    let mut v: Vec<(String, &'static str)> = vec![(COPY.into(), "floors")];
    for (x, m) in CUBLAS_SIZES.iter().enumerate() {
        if !(quick && x > 0) {
            v.push((cublas_name(*m), "floors"));
        }
    }
    for f in [Flavor::Reference, Flavor::CudaFast] {
        v.push((quantize_name(f), "quantize"));
    }
    v.push((prefill_name(Some("gate_up")), "gemm"));
    v.push((prefill_name(Some("down")), "gemm"));
    v.push((prefill_name(None), "gemm"));
    v.push((cublas_experts_name(PREFILL_TOKENS), "gemm"));
    for t in DECODE_TOKENS {
        v.push((decode_name(t), "gemm"));
        v.push((cublas_experts_name(t), "gemm"));
    }
    for n in [REDUCE_COMPARE, REDUCE_NAN_SCAN, REDUCE_AMAX] {
        v.push((n.into(), "reduce"));
    }
    for t in LAYER_TOKENS {
        v.push((layer_name(t, false), "layer"));
        v.push((layer_name(t, true), "layer"));
    }
    v
}

/// Which figures run. The copy and the 4096^3 GEMM always do: every ratio needs them.
#[derive(Clone, Debug)]
pub struct Selection {
    names: Vec<String>,
}

impl Selection {
    /// `only`: figure names, group names, or name prefixes (`gemm_decode` → all decode
    /// batches); `None` = everything.
    pub fn new(only: Option<&[String]>, quick: bool) -> Result<Selection> {
        let all = catalog(quick);
        let full = catalog(false);
        let Some(only) = only else {
            return Ok(Selection {
                names: all.into_iter().map(|(n, _)| n).collect(),
            });
        };
        let matches = |entry: &str, name: &str, group: &str| {
            name == entry || group == entry || name.starts_with(&format!("{entry}_"))
        };
        for entry in only {
            let entry = entry.trim();
            if !full.iter().any(|(n, g)| matches(entry, n, g)) {
                let names: Vec<&str> = full.iter().map(|(n, _)| n.as_str()).collect();
                return Err(Error::usage(format!(
                    "--only: `{entry}` is no figure or group; groups: {}; figures: {}",
                    GROUPS.join(", "),
                    names.join(", ")
                )));
            }
        }
        let always = [COPY.to_string(), cublas_name(CUBLAS_SIZES[0])];
        Ok(Selection {
            names: all
                .into_iter()
                .filter(|(n, g)| always.contains(n) || only.iter().any(|e| matches(e.trim(), n, g)))
                .map(|(n, _)| n)
                .collect(),
        })
    }

    pub fn wants(&self, name: &str) -> bool {
        self.names.iter().any(|n| n == name)
    }

    pub fn names(&self) -> &[String] {
        &self.names
    }
}

/// The MoE dimensions the GEMM and layer figures use (DeepSeek-V3: H 7168, I 2048, 256
/// experts, top-8, one shared expert).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dims {
    pub h: usize,
    pub i: usize,
    pub e: usize,
    pub k: usize,
    /// Shared-expert intermediate size (0: none).
    pub shared_i: usize,
}

impl Dims {
    pub fn from_config(c: &MoeConfig) -> Dims {
        Dims {
            h: c.hidden_size,
            i: c.moe_intermediate_size,
            e: c.n_routed_experts,
            k: c.num_experts_per_tok,
            shared_i: c.n_shared_experts * c.moe_intermediate_size,
        }
    }

    pub fn dsv3() -> Dims {
        Dims::from_config(&crate::moe::synthetic::Preset::Dsv3.config())
    }

    /// FP4 codes + E4M3 block scales of `[rows, cols]`.
    fn fp4(rows: usize, cols: usize) -> f64 {
        (rows * cols / 2 + rows * cols / 16) as f64
    }

    /// One expert's gate and up weights (NVFP4).
    pub fn fp4_gate_up_bytes(&self) -> f64 {
        2.0 * Self::fp4(self.i, self.h)
    }
    /// One expert's down weight (NVFP4).
    pub fn fp4_down_bytes(&self) -> f64 {
        Self::fp4(self.h, self.i)
    }
    /// One expert's three weights in BF16.
    pub fn bf16_expert_bytes(&self) -> f64 {
        (3 * self.i * self.h * 2) as f64
    }
}

/// How a batch lands on the experts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Load {
    /// (token, slot) rows = tokens * top_k.
    pub rows: usize,
    /// Experts with at least one row.
    pub touched: usize,
}

impl Load {
    pub fn of(routing: &Routing, e: usize) -> Load {
        Load {
            rows: routing.topk_ids.len(),
            touched: expert_counts(routing, e).iter().filter(|c| **c > 0).count(),
        }
    }
}

/// The grouped gate/up GEMM (SwiGLU and requantization fused): reads the NVFP4 inputs and the
/// touched experts' weights, writes the NVFP4 intermediate.
pub fn gate_up_work(d: &Dims, l: Load) -> Work {
    let n = l.rows as f64;
    let (h, i) = (d.h as f64, d.i as f64);
    Work {
        flops: 2.0 * n * (2.0 * i) * h,
        bytes: l.touched as f64 * d.fp4_gate_up_bytes()
            + n * (h / 2.0 + h / 16.0)
            + n * (i / 2.0 + i / 16.0),
    }
}

/// The grouped down GEMM: reads the NVFP4 intermediate and the weights, writes f32 rows.
pub fn down_work(d: &Dims, l: Load) -> Work {
    let n = l.rows as f64;
    let (h, i) = (d.h as f64, d.i as f64);
    Work {
        flops: 2.0 * n * h * i,
        bytes: l.touched as f64 * d.fp4_down_bytes() + n * (i / 2.0 + i / 16.0) + n * h * 4.0,
    }
}

/// The FP4 weight bytes (codes + scales) a batch touches.
pub fn fp4_weight_bytes(d: &Dims, l: Load) -> f64 {
    l.touched as f64 * (d.fp4_gate_up_bytes() + d.fp4_down_bytes())
}

/// The same problem in BF16 through cuBLAS: per touched expert, one GEMM with the gate and up
/// weights side by side (BF16 out) and the down GEMM (BF16 intermediate in, BF16 out).
pub fn cublas_experts_work(d: &Dims, l: Load) -> Work {
    let n = l.rows as f64;
    let (h, i) = (d.h as f64, d.i as f64);
    Work {
        flops: 6.0 * n * h * i,
        bytes: l.touched as f64 * d.bf16_expert_bytes()
            + n * h * 2.0
            + n * 2.0 * i * 2.0
            + n * i * 2.0
            + n * h * 2.0,
    }
}

/// The whole layer: router GEMM (f32), routed experts, shared expert. Bytes: the hidden
/// states in and the output out (f32), the router weight (f32), the touched experts' NVFP4
/// weights and the shared expert's BF16 weights; intermediates a fused layer never writes.
pub fn layer_work(d: &Dims, tokens: usize, l: Load) -> Work {
    let t = tokens as f64;
    let n = l.rows as f64;
    let (h, i, e, si) = (d.h as f64, d.i as f64, d.e as f64, d.shared_i as f64);
    Work {
        flops: 2.0 * t * h * e + 6.0 * n * h * i + 6.0 * t * h * si,
        bytes: 2.0 * t * h * 4.0 + e * h * 4.0 + fp4_weight_bytes(d, l) + 3.0 * si * h * 2.0,
    }
}

/// Rows per expert.
pub fn expert_counts(routing: &Routing, e: usize) -> Vec<usize> {
    let mut c = vec![0usize; e];
    for &id in &routing.topk_ids {
        if let Some(x) = usize::try_from(id).ok().and_then(|i| c.get_mut(i)) {
            *x += 1;
        }
    }
    c
}

/// Rows per touched expert (`counts`: rows per expert, as `expert_counts`): minimum, 10th
/// percentile, median, 90th percentile, maximum (nearest rank; zeros when no expert is
/// touched). How uneven a router's load is: the grouped GEMMs pay per tile, and an expert's
/// last tile is as wide as its rest needs.
pub fn rows_spread(counts: &[usize]) -> [usize; 5] {
    let mut c: Vec<usize> = counts.iter().copied().filter(|&n| n > 0).collect();
    if c.is_empty() {
        return [0; 5];
    }
    c.sort_unstable();
    let at = |q: usize| c[(q * (c.len() - 1) + 50) / 100];
    [at(0), at(10), at(50), at(90), at(100)]
}

/// `[E+1]` start row of each expert in the expert-sorted order.
pub fn expert_offsets(counts: &[usize]) -> Vec<usize> {
    let mut o = Vec::with_capacity(counts.len() + 1);
    let mut run = 0;
    o.push(0);
    for c in counts {
        run += c;
        o.push(run);
    }
    o
}

/// A balanced random routing: each token picks `k` distinct experts uniformly (what a
/// well-trained router's load looks like on average), weights `1/k`.
pub fn uniform_routing(tokens: usize, k: usize, e: usize, seed: u64) -> Result<Routing> {
    if k == 0 || k > e {
        return Err(Error::usage(format!(
            "routing: top-{k} of {e} experts is not possible"
        )));
    }
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut pool: Vec<i32> = (0..e as i32).collect();
    let mut ids = Vec::with_capacity(tokens * k);
    for _ in 0..tokens {
        for j in 0..k {
            let x = r.gen_range(j..e);
            pool.swap(j, x);
            ids.push(pool[j]);
        }
    }
    Ok(Routing {
        tokens,
        top_k: k,
        topk_ids: ids,
        topk_weights: vec![1.0 / k as f32; tokens * k],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn catalogue_names_are_unique_and_grouped() {
        for quick in [false, true] {
            let c = catalog(quick);
            let mut names: Vec<&str> = c.iter().map(|(n, _)| n.as_str()).collect();
            names.sort();
            names.dedup();
            assert_eq!(names.len(), c.len());
            assert!(c.iter().all(|(_, g)| GROUPS.contains(g)));
        }
        assert_eq!(catalog(false).len(), catalog(true).len() + 1);
        assert!(!catalog(true).iter().any(|(n, _)| n == "cublas_bf16_8192"));
        assert_eq!(catalog(false)[0].0, COPY);
    }

    #[test]
    fn only_selects_names_groups_and_prefixes_and_keeps_the_floors() {
        let s = |v: &[&str]| {
            let v: Vec<String> = v.iter().map(|x| x.to_string()).collect();
            Selection::new(Some(&v), false)
        };
        let g = s(&["gemm_decode"]).unwrap();
        for t in DECODE_TOKENS {
            assert!(g.wants(&decode_name(t)));
            assert!(!g.wants(&cublas_experts_name(t)));
        }
        assert!(g.wants(COPY) && g.wants("cublas_bf16_4096"));
        assert!(!g.wants("cublas_bf16_8192") && !g.wants("layer_16_eager"));
        let l = s(&["layer", " reduce_amax "]).unwrap();
        assert!(l.wants("layer_16_eager") && l.wants("layer_4096_graph"));
        assert!(l.wants(REDUCE_AMAX) && !l.wants(REDUCE_COMPARE));
        // `layer_1` is no prefix of `layer_16_eager` (prefixes end at an underscore)
        assert!(s(&["layer_1"]).is_err());
        let e = s(&["gemm", "nope"]).unwrap_err().to_string();
        assert!(e.contains("`nope`") && e.contains("gemm_decode_8"), "{e}");
        // the 8192 GEMM by name; quick still drops it
        assert!(s(&["cublas_bf16_8192"]).unwrap().wants("cublas_bf16_8192"));
        let v = vec!["floors".to_string()];
        let q = Selection::new(Some(&v), true).unwrap();
        assert!(!q.wants("cublas_bf16_8192"));
        assert_eq!(
            Selection::new(None, false).unwrap().names().len(),
            catalog(false).len()
        );
    }

    #[test]
    fn dsv3_weight_bytes() {
        let d = Dims::dsv3();
        assert_eq!((d.h, d.i, d.e, d.k, d.shared_i), (7168, 2048, 256, 8, 2048));
        // codes: 3 * 2048 * 7168 / 2 = 22 020 096 B, scales 1/8 of that
        let per_expert = d.fp4_gate_up_bytes() + d.fp4_down_bytes();
        assert_eq!(per_expert, 22_020_096.0 * 1.125);
        assert_eq!(d.bf16_expert_bytes(), 88_080_384.0);
        // the whole layer's experts: about 6.3 GB of NVFP4
        assert!((per_expert * 256.0 - 6.34e9).abs() < 0.01e9);
    }

    #[test]
    fn gemm_work_by_hand() {
        let d = Dims {
            h: 64,
            i: 32,
            e: 4,
            k: 2,
            shared_i: 32,
        };
        let l = Load {
            rows: 10,
            touched: 3,
        };
        let gu = gate_up_work(&d, l);
        assert_eq!(gu.flops, 2.0 * 10.0 * 64.0 * 64.0);
        // weights: 3 experts * 2 * (32*64/2 + 32*64/16) = 3 * 2 * 1152; in 10*(32+4); out 10*(16+2)
        assert_eq!(gu.bytes, 6912.0 + 360.0 + 180.0);
        let dn = down_work(&d, l);
        assert_eq!(dn.flops, 2.0 * 10.0 * 64.0 * 32.0);
        assert_eq!(dn.bytes, 3456.0 + 180.0 + 2560.0);
        assert_eq!(fp4_weight_bytes(&d, l), 6912.0 + 3456.0);
        let cb = cublas_experts_work(&d, l);
        assert_eq!(cb.flops, gu.flops + dn.flops);
        assert_eq!(
            cb.bytes,
            3.0 * 3.0 * 32.0 * 64.0 * 2.0
                + 10.0 * 64.0 * 2.0
                + 10.0 * 64.0 * 2.0
                + 10.0 * 32.0 * 2.0
                + 10.0 * 64.0 * 2.0
        );
        let lw = layer_work(&d, 5, l);
        assert_eq!(
            lw.flops,
            2.0 * 5.0 * 64.0 * 4.0 + gu.flops + dn.flops + 6.0 * 5.0 * 64.0 * 32.0
        );
        assert_eq!(
            lw.bytes,
            2.0 * 5.0 * 64.0 * 4.0 + 4.0 * 64.0 * 4.0 + 10368.0 + 3.0 * 32.0 * 64.0 * 2.0
        );
    }

    #[test]
    fn rows_spread_is_taken_over_the_touched_experts() {
        // expert e gets 10 * e rows for e in 1..=10 (expert 0 and 11 none): 550 rows, top-1
        let ids: Vec<i32> = (1..=10).flat_map(|e| vec![e; 10 * e as usize]).collect();
        let r = Routing {
            tokens: ids.len(),
            top_k: 1,
            topk_weights: vec![1.0; ids.len()],
            topk_ids: ids,
        };
        // nearest rank over the 10 touched: indices 0, 1, 5 (4.5 rounds up), 8, 9
        assert_eq!(rows_spread(&expert_counts(&r, 12)), [10, 20, 60, 90, 100]);
        let none = Routing {
            tokens: 0,
            top_k: 1,
            topk_weights: vec![],
            topk_ids: vec![],
        };
        assert_eq!(rows_spread(&expert_counts(&none, 12)), [0; 5]);
    }

    #[test]
    fn uniform_routing_picks_distinct_experts_and_spreads_the_load() {
        let seed: u64 = rand::random();
        let (t, k, e) = (4096, 8, 256);
        let r = uniform_routing(t, k, e, seed).unwrap();
        assert_eq!((r.tokens, r.top_k, r.topk_ids.len()), (t, k, t * k));
        for row in r.topk_ids.chunks(k) {
            let mut v = row.to_vec();
            v.sort();
            v.dedup();
            assert_eq!(v.len(), k, "seed {seed}: repeated expert in {row:?}");
            assert!(v.iter().all(|x| (0..e as i32).contains(x)));
        }
        let c = expert_counts(&r, e);
        assert_eq!(c.iter().sum::<usize>(), t * k);
        // 128 rows per expert on average; binomial sd ~11
        assert!(
            c.iter().all(|x| (60..200).contains(x)),
            "seed {seed}: {c:?}"
        );
        let o = expert_offsets(&c);
        assert_eq!(o.len(), e + 1);
        assert_eq!(o[e], t * k);
        assert!(o.windows(2).zip(&c).all(|(w, c)| w[1] - w[0] == *c));
        assert_eq!(Load::of(&r, e).touched, 256);
        let mut sorted = c.clone();
        sorted.sort();
        let spread = rows_spread(&c);
        assert_eq!((spread[0], spread[4]), (sorted[0], sorted[255]));
        assert!(spread.windows(2).all(|w| w[0] <= w[1]), "{spread:?}");
        // one token touches exactly k experts
        let one = uniform_routing(1, k, e, seed).unwrap();
        assert_eq!(
            Load::of(&one, e),
            Load {
                rows: 8,
                touched: 8
            }
        );
        assert_ne!(
            uniform_routing(64, k, e, seed).unwrap(),
            uniform_routing(64, k, e, seed ^ 1).unwrap()
        );
        assert!(uniform_routing(1, 9, 8, seed).is_err());
    }
}
