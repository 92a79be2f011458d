//! Where the error of a layer lives: per expert (from the per-slot outputs) and per token.

use super::forward::{amax, dynamic_gs};
use super::{ActScales, Routing};
use crate::metrics::{compare, Metrics};
use crate::nvfp4::{quantize_nvfp4, BlockStats};
use rayon::prelude::*;
use serde::Serialize;

#[derive(Clone, Debug, Serialize)]
pub struct ExpertMetrics {
    pub expert: usize,
    /// (token, slot) pairs routed to this expert.
    pub slots: usize,
    /// `‖test‖ / ‖ref‖` over its slots: an output off by a factor (a weight_scale_2 or
    /// input_scale) shows here whatever its cosine.
    pub norm_ratio: f64,
    #[serde(flatten)]
    pub metrics: Metrics,
}

impl ExpertMetrics {
    pub fn new(expert: usize, slots: usize, test: &[f32], reference: &[f32]) -> ExpertMetrics {
        let norm = |v: &[f32]| {
            v.iter()
                .map(|&x| (x as f64) * (x as f64))
                .sum::<f64>()
                .sqrt()
        };
        let (nt, nr) = (norm(test), norm(reference));
        ExpertMetrics {
            expert,
            slots,
            norm_ratio: if nt == nr { 1.0 } else { nt / nr },
            metrics: compare(test, reference),
        }
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct TokenMetrics {
    pub token: usize,
    #[serde(flatten)]
    pub metrics: Metrics,
}

/// Metrics of the unweighted expert outputs `test_slots` vs `ref_slots` (`[T*K, hidden]`),
/// one entry per expert that received at least one slot.
pub fn per_expert(
    routing: &Routing,
    test_slots: &[f32],
    ref_slots: &[f32],
    hidden: usize,
    n_experts: usize,
) -> Vec<ExpertMetrics> {
    let mut rows: Vec<Vec<usize>> = vec![vec![]; n_experts];
    for (s, &id) in routing.topk_ids.iter().enumerate() {
        if id >= 0
            && (id as usize) < n_experts
            && (s + 1) * hidden <= test_slots.len().min(ref_slots.len())
        {
            rows[id as usize].push(s);
        }
    }
    rows.par_iter()
        .enumerate()
        .filter(|(_, r)| !r.is_empty())
        .map(|(e, r)| {
            let gather = |v: &[f32]| -> Vec<f32> {
                r.iter()
                    .flat_map(|&s| v[s * hidden..(s + 1) * hidden].iter().copied())
                    .collect()
            };
            ExpertMetrics::new(e, r.len(), &gather(test_slots), &gather(ref_slots))
        })
        .collect()
}

/// Metrics of every token row of `test` vs `reference` (`[T, hidden]`).
pub fn per_token(test: &[f32], reference: &[f32], hidden: usize) -> Vec<TokenMetrics> {
    test.par_chunks(hidden)
        .zip(reference.par_chunks(hidden))
        .enumerate()
        .map(|(t, (a, b))| TokenMetrics {
            token: t,
            metrics: compare(a, b),
        })
        .collect()
}

/// Per expert, what happens to the blocks of its gate/up input (`hidden` rows routed to it,
/// quantized with its gs1): a too-large activation gs saturates them, a too-small one flushes
/// them. Empty stats for experts no token reached.
pub fn expert_input_blocks(
    routing: &Routing,
    hidden: &[f32],
    h: usize,
    n_experts: usize,
    scales: &ActScales,
) -> Vec<BlockStats> {
    let k = routing.top_k.max(1);
    let gs1: Vec<f32> = match scales {
        ActScales::Fixed { gs1, .. } => gs1.clone(),
        ActScales::Dynamic => vec![dynamic_gs(amax(hidden)); n_experts],
    };
    (0..n_experts)
        .into_par_iter()
        .map(|e| {
            let mut x = vec![];
            for (s, &id) in routing.topk_ids.iter().enumerate() {
                let t = s / k;
                if id as usize == e && (t + 1) * h <= hidden.len() {
                    x.extend_from_slice(&hidden[t * h..(t + 1) * h]);
                }
            }
            match gs1.get(e) {
                Some(&g) if !x.is_empty() && h.is_multiple_of(16) => {
                    quantize_nvfp4(&x, x.len() / h, h, g).1
                }
                _ => BlockStats::default(),
            }
        })
        .collect()
}

/// Order worst first: non-finite values, then the lowest cosine.
pub fn worst_first(a: &Metrics, b: &Metrics) -> std::cmp::Ordering {
    let bad = |m: &Metrics| m.nan_count + m.inf_count;
    bad(b)
        .cmp(&bad(a))
        .then_with(|| a.cosine.total_cmp(&b.cosine))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_broken_expert_and_token() {
        let routing = Routing {
            tokens: 2,
            top_k: 2,
            topk_ids: vec![0, 1, 1, 2],
            topk_weights: vec![0.5; 4],
        };
        let h = 4;
        let r: Vec<f32> = (0..16).map(|i| (i as f32 * 0.3).sin() + 2.0).collect();
        let mut t = r.clone();
        // slot 3 (token 1, expert 2) goes wrong
        t[12..16].iter_mut().for_each(|v| *v = -*v);
        let mut e = per_expert(&routing, &t, &r, h, 3);
        e.sort_by(|a, b| worst_first(&a.metrics, &b.metrics));
        assert_eq!(e[0].expert, 2);
        assert_eq!(e.iter().find(|x| x.expert == 1).map(|x| x.slots), Some(2));
        assert!((e[1].metrics.cosine - 1.0).abs() < 1e-12);
        let x: Vec<f32> = (0..32).map(|i| i as f32 - 10.0).collect();
        let sc = ActScales::Fixed {
            gs1: vec![1.0, 1e6, 1.0],
            gs2: vec![1.0; 3],
        };
        let st = expert_input_blocks(&routing, &x, 16, 3, &sc);
        assert_eq!(st[1].blocks, 2);
        assert_eq!(st[1].saturated, 2);
        assert_eq!(st[0].saturated, 0);
        let mut tk = per_token(&t[..8], &r[..8], h);
        tk.sort_by(|a, b| worst_first(&a.metrics, &b.metrics));
        assert_eq!(tk.len(), 2);
    }
}
