//! Where the error of a layer lives: per expert (from the per-slot outputs) and per token.

use super::Routing;
use crate::metrics::{compare, Metrics};
use rayon::prelude::*;
use serde::Serialize;

#[derive(Clone, Debug, Serialize)]
pub struct ExpertMetrics {
    pub expert: usize,
    /// (token, slot) pairs routed to this expert.
    pub slots: usize,
    #[serde(flatten)]
    pub metrics: Metrics,
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
            ExpertMetrics {
                expert: e,
                slots: r.len(),
                metrics: compare(&gather(test_slots), &gather(ref_slots)),
            }
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
        let mut tk = per_token(&t[..8], &r[..8], h);
        tk.sort_by(|a, b| worst_first(&a.metrics, &b.metrics));
        assert_eq!(tk.len(), 2);
    }
}
