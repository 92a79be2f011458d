//! The DeepSeek router, exactly as docs/moe-forward.md pins it: FP32 logits (f64 accumulation
//! here), scoring, bias-corrected group-limited top-k or V4 hash ids, unbiased weights.

use super::{MoeConfig, MoeLayer, Router, Routing, ScoringFunc};
use crate::error::{Error, Result};
use rayon::prelude::*;
use std::cmp::Ordering;

/// `norm_topk_prob` divides by `sum + 1e-20`, so all-zero scores give zero weights, not NaN.
pub const NORM_EPS: f32 = 1e-20;

/// Route a batch `hidden` `[tokens, hidden_size]` through `layer`'s router. `input_ids` is
/// needed by hash layers only.
pub fn route(layer: &MoeLayer, hidden: &[f32], input_ids: Option<&[i64]>) -> Result<Routing> {
    route_with(&layer.config, layer.index, &layer.router, hidden, input_ids)
}

/// [`route`] from the router alone (no experts needed: synthetic calibration routes before
/// the experts exist).
pub fn route_with(
    c: &MoeConfig,
    index: usize,
    router: &Router,
    hidden: &[f32],
    input_ids: Option<&[i64]>,
) -> Result<Routing> {
    super::validate_router(c, index, router)?;
    let (h, e, k) = (c.hidden_size, c.n_routed_experts, c.num_experts_per_tok);
    let tokens = token_count(hidden, h, index)?;
    let hash = hash_table(c, index, router, tokens, input_ids)?;
    let logits = router_logits(&router.weight, hidden, tokens, h, e);
    let bias = router.e_score_correction_bias.as_deref();

    let per_token: Vec<(Vec<i32>, Vec<f32>)> = logits
        .par_chunks(e)
        .enumerate()
        .map(|(t, l)| {
            let scores = score(c.scoring_func, l);
            let ids: Vec<usize> = match hash {
                Some((table, ids)) => {
                    // validated above: the id is in range and the table row exists
                    let row = ids[t] as usize * k;
                    table[row..row + k].iter().map(|&x| x as usize).collect()
                }
                None => {
                    let sel: Vec<f32> = match bias {
                        Some(b) => scores.iter().zip(b).map(|(s, b)| s + b).collect(),
                        None => scores.clone(),
                    };
                    select(&sel, c.n_group, c.topk_group, k)
                }
            };
            let w = weights(&scores, &ids, c.norm_topk_prob, c.routed_scaling_factor);
            (ids.iter().map(|&i| i as i32).collect(), w)
        })
        .collect();

    let mut topk_ids = Vec::with_capacity(tokens * k);
    let mut topk_weights = Vec::with_capacity(tokens * k);
    for (ids, w) in per_token {
        topk_ids.extend(ids);
        topk_weights.extend(w);
    }
    Ok(Routing {
        tokens,
        top_k: k,
        topk_ids,
        topk_weights,
    })
}

/// Number of rows of a `[tokens, hidden]` batch, or a usage error naming the layer.
pub(crate) fn token_count(hidden: &[f32], h: usize, layer: usize) -> Result<usize> {
    if h == 0 || !hidden.len().is_multiple_of(h) {
        return Err(Error::usage(format!(
            "MoE layer {layer}: hidden states of {} values are not [tokens, {h}]",
            hidden.len()
        )));
    }
    Ok(hidden.len() / h)
}

/// For a hash layer, the table and the checked `input_ids`; `None` for a scored layer.
fn hash_table<'a>(
    c: &MoeConfig,
    l: usize,
    router: &'a Router,
    tokens: usize,
    input_ids: Option<&'a [i64]>,
) -> Result<Option<(&'a [i64], &'a [i64])>> {
    if !c.is_hash_layer(l) {
        return Ok(None);
    }
    let table = router.tid2eid.as_deref().ok_or_else(|| {
        Error::usage(format!(
            "MoE layer {l} is a hash layer (num_hash_layers = {}) but has no gate.tid2eid table",
            c.num_hash_layers
        ))
    })?;
    let ids = input_ids.ok_or_else(|| {
        Error::usage(format!(
            "MoE layer {l} routes by tid2eid[input_ids]: input_ids are required (an `input_ids` tensor in --input)"
        ))
    })?;
    if ids.len() != tokens {
        return Err(Error::usage(format!(
            "MoE layer {l}: {} input_ids for {tokens} tokens",
            ids.len()
        )));
    }
    let vocab = table.len() / c.num_experts_per_tok;
    if let Some((t, &id)) = ids
        .iter()
        .enumerate()
        .find(|(_, &id)| id < 0 || id as usize >= vocab)
    {
        return Err(Error::usage(format!(
            "MoE layer {l}: input_ids[{t}] = {id} is outside tid2eid's vocabulary of {vocab}"
        )));
    }
    Ok(Some((table, ids)))
}

/// `logits[t, e] = f32(Σ_k f64(h[t,k]) · f64(Wg[e,k]))`, `[tokens, experts]`.
pub fn router_logits(
    weight: &[f32],
    hidden: &[f32],
    tokens: usize,
    h: usize,
    e: usize,
) -> Vec<f32> {
    let mut out = vec![0f32; tokens * e];
    out.par_chunks_mut(e)
        .zip(hidden.par_chunks(h))
        .with_min_len(4)
        .for_each(|(o, x)| {
            for (j, w) in weight.chunks_exact(h).enumerate() {
                o[j] = super::forward::dot(x, w) as f32;
            }
        });
    out
}

/// Scores of one token's logits, in f32.
pub fn score(func: ScoringFunc, logits: &[f32]) -> Vec<f32> {
    match func {
        ScoringFunc::Sigmoid => logits.iter().map(|&l| 1.0 / (1.0 + (-l).exp())).collect(),
        ScoringFunc::Softmax => {
            let m = logits.iter().fold(
                f32::NEG_INFINITY,
                |m, &l| if l > m || l.is_nan() { l } else { m },
            );
            let ex: Vec<f32> = logits.iter().map(|&l| (l - m).exp()).collect();
            // an accumulation: f64 on the CPU, rounded once
            let sum = ex.iter().map(|&v| v as f64).sum::<f64>() as f32;
            ex.iter().map(|&v| v / sum).collect()
        }
        ScoringFunc::Sqrtsoftplus => logits.iter().map(|&l| softplus(l).sqrt()).collect(),
    }
}

/// `ln(1 + e^l)` in f32, the identity above 20 (as torch's `softplus` threshold).
pub fn softplus(l: f32) -> f32 {
    if l > 20.0 {
        l
    } else {
        l.exp().ln_1p()
    }
}

/// Descending value, then ascending index. NaN ranks above everything, as `torch.topk` puts
/// it first; a NaN router input then still routes somewhere and shows up downstream.
fn rank(a: (f32, usize), b: (f32, usize)) -> Ordering {
    let by_value = match (a.0.is_nan(), b.0.is_nan()) {
        (true, true) => Ordering::Equal,
        (true, false) => Ordering::Less,
        (false, true) => Ordering::Greater,
        (false, false) => b.0.partial_cmp(&a.0).unwrap_or(Ordering::Equal),
    };
    by_value.then(a.1.cmp(&b.1))
}

/// Group-limited top-k on the selection scores `sel` (score + bias). Returns expert ids in
/// descending `sel` order.
pub fn select(sel: &[f32], n_group: usize, topk_group: usize, k: usize) -> Vec<usize> {
    let e = sel.len();
    let mut allowed = vec![true; e];
    if n_group > 1 {
        let gsz = e / n_group;
        let mut groups: Vec<(f32, usize)> = (0..n_group)
            .map(|g| {
                let mut v: Vec<(f32, usize)> =
                    (g * gsz..(g + 1) * gsz).map(|i| (sel[i], i)).collect();
                v.sort_by(|a, b| rank(*a, *b));
                let top2 = v.iter().take(2).fold(0f32, |s, x| s + x.0);
                (top2, g)
            })
            .collect();
        groups.sort_by(|a, b| rank(*a, *b));
        allowed.iter_mut().for_each(|a| *a = false);
        for &(_, g) in groups.iter().take(topk_group) {
            allowed[g * gsz..(g + 1) * gsz]
                .iter_mut()
                .for_each(|a| *a = true);
        }
    }
    let mut cand: Vec<(f32, usize)> = (0..e)
        .filter(|&i| allowed[i])
        .map(|i| (sel[i], i))
        .collect();
    cand.sort_by(|a, b| rank(*a, *b));
    cand.into_iter().take(k).map(|(_, i)| i).collect()
}

/// Group score as [`select`] computes it: the sum of the group's two best selection scores.
fn group_score(sel: &[f32]) -> f32 {
    let mut v: Vec<(f32, usize)> = sel.iter().copied().zip(0..).collect();
    v.sort_by(|a, b| rank(*a, *b));
    v.iter().take(2).fold(0f32, |s, x| s + x.0)
}

/// Whether `chosen` (distinct expert ids, any order) is a top-k [`select`] could return under
/// some tie-break: exact ties of the selection scores `sel` may go either way, between
/// experts and between groups (engines break them by index, by kernel order or not at all;
/// a CUDA-graph batch padded with zero hidden states ties every expert when the router has no
/// correction bias). `false` when `sel` holds NaN: no tie-break is defined then.
pub fn is_valid_topk(sel: &[f32], n_group: usize, topk_group: usize, chosen: &[usize]) -> bool {
    let e = sel.len();
    if chosen.is_empty() || chosen.len() > e || sel.iter().any(|v| v.is_nan()) {
        return false;
    }
    let mut is_chosen = vec![false; e];
    for &c in chosen {
        if c >= e || is_chosen[c] {
            return false;
        }
        is_chosen[c] = true;
    }
    let floor = chosen.iter().map(|&c| sel[c]).fold(f32::INFINITY, f32::min);
    let mut allowed = vec![true; e];
    if n_group > 1 && topk_group < n_group && e.is_multiple_of(n_group) {
        let gsz = e / n_group;
        let gs: Vec<f32> = (0..n_group)
            .map(|g| group_score(&sel[g * gsz..(g + 1) * gsz]))
            .collect();
        let mut sorted = gs.clone();
        sorted.sort_by(|a, b| b.total_cmp(a));
        let thr = sorted[topk_group.max(1) - 1];
        // groups the chosen experts need, and groups every tie-break keeps
        let mut keep: Vec<bool> = (0..n_group)
            .map(|g| gs[g] > thr || is_chosen[g * gsz..(g + 1) * gsz].iter().any(|&c| c))
            .collect();
        if (0..n_group).any(|g| keep[g] && gs[g] < thr) {
            return false;
        }
        let kept = keep.iter().filter(|&&k| k).count();
        if kept > topk_group {
            return false;
        }
        // the rest from the groups tied at the threshold: those whose best expert is lowest,
        // as they compete least with the chosen ones
        let mut tied: Vec<(f32, usize)> = (0..n_group)
            .filter(|&g| !keep[g] && gs[g] == thr)
            .map(|g| {
                let best = sel[g * gsz..(g + 1) * gsz]
                    .iter()
                    .copied()
                    .fold(f32::NEG_INFINITY, f32::max);
                (best, g)
            })
            .collect();
        if tied.len() < topk_group - kept {
            return false;
        }
        tied.sort_by(|a, b| a.0.total_cmp(&b.0));
        for &(_, g) in tied.iter().take(topk_group - kept) {
            keep[g] = true;
        }
        for (i, a) in allowed.iter_mut().enumerate() {
            *a = keep[i / gsz];
        }
    }
    (0..e).all(|i| is_chosen[i] || !allowed[i] || sel[i] <= floor)
}

/// `w = score[id]`; `w / (Σ w + 1e-20)` with `norm_topk_prob`; then `× routed_scaling_factor`.
pub fn weights(scores: &[f32], ids: &[usize], norm_topk_prob: bool, scaling: f32) -> Vec<f32> {
    let mut w: Vec<f32> = ids.iter().map(|&i| scores[i]).collect();
    if norm_topk_prob {
        let sum = w.iter().fold(0f32, |s, &x| s + x) + NORM_EPS;
        w.iter_mut().for_each(|x| *x /= sum);
    }
    w.iter_mut().for_each(|x| *x *= scaling);
    w
}

#[cfg(test)]
#[allow(clippy::needless_range_loop)] // the naive router indexes on purpose
mod tests {
    use super::*;
    use crate::moe::synthetic::test_layer;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// An independent router: scalar loops, full sorts by hand, no shared helpers.
    fn naive_route(
        c: &MoeConfig,
        wg: &[f32],
        bias: Option<&[f32]>,
        tid: Option<&[i64]>,
        index: usize,
        x: &[f32],
        ids: &[i64],
    ) -> (Vec<i32>, Vec<f32>) {
        let (h, e, k) = (c.hidden_size, c.n_routed_experts, c.num_experts_per_tok);
        let t = x.len() / h;
        let (mut out_ids, mut out_w) = (vec![], vec![]);
        for tt in 0..t {
            let mut logit = vec![0f32; e];
            for j in 0..e {
                let mut s = 0f64;
                for q in 0..h {
                    s += x[tt * h + q] as f64 * wg[j * h + q] as f64;
                }
                logit[j] = s as f32;
            }
            let sc: Vec<f32> = match c.scoring_func {
                ScoringFunc::Sigmoid => logit.iter().map(|l| 1.0 / (1.0 + (-l).exp())).collect(),
                ScoringFunc::Sqrtsoftplus => logit
                    .iter()
                    .map(|&l| (if l > 20.0 { l } else { l.exp().ln_1p() }).sqrt())
                    .collect(),
                ScoringFunc::Softmax => {
                    let mut m = f32::NEG_INFINITY;
                    for &l in &logit {
                        if l > m {
                            m = l;
                        }
                    }
                    let mut s = 0f64;
                    for &l in &logit {
                        s += (l - m).exp() as f64;
                    }
                    logit.iter().map(|&l| (l - m).exp() / s as f32).collect()
                }
            };
            let chosen: Vec<usize> = if c.is_hash_layer(index) {
                let tab = tid.unwrap();
                (0..k)
                    .map(|j| tab[ids[tt] as usize * k + j] as usize)
                    .collect()
            } else {
                let sel: Vec<f32> = (0..e).map(|j| sc[j] + bias.map_or(0.0, |b| b[j])).collect();
                let mut ok = vec![true; e];
                if c.n_group > 1 {
                    let gs = e / c.n_group;
                    let mut gscore = vec![0f32; c.n_group];
                    for g in 0..c.n_group {
                        // best and second best by scanning
                        let (mut b1, mut b2) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
                        for j in g * gs..(g + 1) * gs {
                            if sel[j] > b1 {
                                b2 = b1;
                                b1 = sel[j];
                            } else if sel[j] > b2 {
                                b2 = sel[j];
                            }
                        }
                        gscore[g] = if gs == 1 { b1 } else { b1 + b2 };
                    }
                    let mut keep = vec![false; c.n_group];
                    for _ in 0..c.topk_group {
                        let mut best: Option<usize> = None;
                        for g in 0..c.n_group {
                            if !keep[g] && best.is_none_or(|b| gscore[g] > gscore[b]) {
                                best = Some(g);
                            }
                        }
                        keep[best.unwrap()] = true;
                    }
                    for j in 0..e {
                        ok[j] = keep[j / gs];
                    }
                }
                let mut taken = vec![false; e];
                let mut v = vec![];
                for _ in 0..k {
                    let mut best: Option<usize> = None;
                    for j in 0..e {
                        if ok[j] && !taken[j] && best.is_none_or(|b| sel[j] > sel[b]) {
                            best = Some(j);
                        }
                    }
                    taken[best.unwrap()] = true;
                    v.push(best.unwrap());
                }
                v
            };
            let mut w: Vec<f32> = chosen.iter().map(|&j| sc[j]).collect();
            if c.norm_topk_prob {
                let mut s = 0f32;
                for x in &w {
                    s += x;
                }
                for x in w.iter_mut() {
                    *x /= s + 1e-20;
                }
            }
            for x in w.iter_mut() {
                *x *= c.routed_scaling_factor;
            }
            out_ids.extend(chosen.iter().map(|&j| j as i32));
            out_w.extend(w);
        }
        (out_ids, out_w)
    }

    fn random_case(
        seed: u64,
        func: ScoringFunc,
        n_group: usize,
        hash: bool,
    ) -> (MoeLayer, Vec<f32>, Vec<i64>) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let e = [8, 16, 32][rng.gen_range(0..3)];
        let n_group = if n_group > 1 && e % n_group == 0 {
            n_group
        } else {
            1
        };
        let k = rng.gen_range(1..=4.min(e));
        let mut layer = test_layer(&mut rng, 32, 16, e, k, func);
        layer.config.n_group = n_group;
        layer.config.topk_group = if n_group > 1 {
            let gs = e / n_group;
            rng.gen_range(k.div_ceil(gs).max(1)..=n_group)
        } else {
            1
        };
        layer.config.norm_topk_prob = rng.gen_bool(0.7);
        layer.config.routed_scaling_factor = rng.gen_range(0.5..3.0);
        if hash {
            layer.config.num_hash_layers = layer.index + 1;
            let vocab = 50;
            layer.router.tid2eid =
                Some((0..vocab * k).map(|_| rng.gen_range(0..e as i64)).collect());
        }
        if rng.gen_bool(0.3) {
            layer.router.e_score_correction_bias = None;
        }
        let t = rng.gen_range(1..20);
        let x: Vec<f32> = (0..t * 32)
            .map(|_| half::bf16::from_f32(rng.gen_range(-3.0..3.0)).to_f32())
            .collect();
        let ids = (0..t).map(|_| rng.gen_range(0..50)).collect();
        (layer, x, ids)
    }

    #[test]
    fn router_matches_a_naive_router_on_random_inputs() {
        let base: u64 = rand::random();
        for (n, func) in [
            ScoringFunc::Sigmoid,
            ScoringFunc::Softmax,
            ScoringFunc::Sqrtsoftplus,
        ]
        .into_iter()
        .enumerate()
        {
            for groups in [1, 2, 4] {
                for hash in [false, true] {
                    for rep in 0..6u64 {
                        let seed =
                            base ^ (n as u64 * 1000 + groups as u64 * 100 + hash as u64 * 10 + rep);
                        let (layer, x, ids) = random_case(seed, func, groups, hash);
                        let r = route(&layer, &x, Some(&ids)).unwrap();
                        let (ni, nw) = naive_route(
                            &layer.config,
                            &layer.router.weight,
                            layer.router.e_score_correction_bias.as_deref(),
                            layer.router.tid2eid.as_deref(),
                            layer.index,
                            &x,
                            &ids,
                        );
                        assert_eq!(
                            r.topk_ids, ni,
                            "seed {seed} {func:?} groups {groups} hash {hash}"
                        );
                        assert_eq!(
                            r.topk_weights, nw,
                            "seed {seed} {func:?} groups {groups} hash {hash}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn group_limit_excludes_experts_of_dropped_groups() {
        // 4 groups of 2; the single best expert lives in a group whose second expert is awful
        let sel = [0.9, -5.0, 0.5, 0.5, 0.4, 0.4, 0.1, 0.1];
        // group scores: -4.1, 1.0, 0.8, 0.2 → keep groups 1 and 2
        assert_eq!(select(&sel, 4, 2, 3), vec![2, 3, 4]);
        // without group limit the 0.9 wins
        assert_eq!(select(&sel, 1, 1, 3), vec![0, 2, 3]);
    }

    /// [`select`] with explicit tie-breaks: `gp` ranks tied groups, `ep` tied experts.
    fn select_with(
        sel: &[f32],
        n_group: usize,
        tg: usize,
        k: usize,
        gp: &[usize],
        ep: &[usize],
    ) -> Vec<usize> {
        let e = sel.len();
        let gsz = e / n_group;
        let mut groups: Vec<usize> = (0..n_group).collect();
        let gs: Vec<f32> = (0..n_group)
            .map(|g| group_score(&sel[g * gsz..(g + 1) * gsz]))
            .collect();
        groups.sort_by(|&a, &b| gs[b].total_cmp(&gs[a]).then(gp[a].cmp(&gp[b])));
        let mut cand: Vec<usize> = (0..e)
            .filter(|&i| groups[..tg].contains(&(i / gsz)))
            .collect();
        cand.sort_by(|&a, &b| sel[b].total_cmp(&sel[a]).then(ep[a].cmp(&ep[b])));
        let mut v = cand[..k].to_vec();
        v.sort_unstable();
        v
    }

    #[test]
    fn valid_topk_under_ties_is_what_some_tie_break_selects() {
        use rand::seq::SliceRandom;
        let seed: u64 = rand::random();
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        for _ in 0..60 {
            let e = 8;
            let (n_group, tg) = [(1, 1), (4, 2), (2, 1), (4, 3)][rng.gen_range(0..4)];
            let k = rng.gen_range(1..=3);
            let sel: Vec<f32> = (0..e)
                .map(|_| [0.0, 0.5, 1.0][rng.gen_range(0..3)])
                .collect();
            let mut reachable = std::collections::BTreeSet::new();
            let (mut gp, mut ep): (Vec<usize>, Vec<usize>) =
                ((0..n_group).collect(), (0..e).collect());
            for _ in 0..3000 {
                gp.shuffle(&mut rng);
                ep.shuffle(&mut rng);
                reachable.insert(select_with(&sel, n_group, tg, k, &gp, &ep));
            }
            for mask in 0u32..(1 << e) {
                if mask.count_ones() as usize != k {
                    continue;
                }
                let set: Vec<usize> = (0..e).filter(|&i| mask >> i & 1 == 1).collect();
                assert_eq!(
                    is_valid_topk(&sel, n_group, tg, &set),
                    reachable.contains(&set),
                    "seed {seed}: sel {sel:?} groups {n_group}/{tg} k {k} set {set:?}"
                );
            }
            let mut own = select(&sel, n_group, tg, k);
            own.reverse();
            assert!(is_valid_topk(&sel, n_group, tg, &own), "seed {seed}");
        }
    }

    #[test]
    fn ties_go_to_the_lower_index() {
        assert_eq!(select(&[0.5, 0.7, 0.7, 0.5], 1, 1, 3), vec![1, 2, 0]);
        assert_eq!(select(&[0.3, 0.3, 0.3, 0.3], 2, 1, 2), vec![0, 1]);
    }

    #[test]
    fn zero_scores_give_zero_weights_not_nan() {
        // sigmoid(-200) is exactly 0 in f32: the 1e-20 guard keeps 0/0 away
        let w = weights(&[0.0, 0.0, 0.0], &[0, 1], true, 2.5);
        assert_eq!(w, vec![0.0, 0.0]);
        let mut rng = ChaCha8Rng::seed_from_u64(rand::random());
        let mut layer = test_layer(&mut rng, 32, 16, 8, 2, ScoringFunc::Sigmoid);
        layer.router.weight.iter_mut().for_each(|w| *w = -1.0);
        layer.router.e_score_correction_bias = None;
        let x = vec![8.0f32; 32 * 3];
        let r = route(&layer, &x, None).unwrap();
        assert!(
            r.topk_weights.iter().all(|&w| w == 0.0),
            "{:?}",
            r.topk_weights
        );
    }

    #[test]
    fn hash_layers_need_input_ids_in_range() {
        let mut rng = ChaCha8Rng::seed_from_u64(rand::random());
        let mut layer = test_layer(&mut rng, 32, 16, 8, 2, ScoringFunc::Sqrtsoftplus);
        layer.config.num_hash_layers = layer.index + 1;
        layer.router.tid2eid = Some(vec![1, 2, 3, 4]); // vocab 2
        let x = vec![0.5f32; 32 * 2];
        assert!(route(&layer, &x, None).is_err());
        assert!(route(&layer, &x, Some(&[0, 2])).is_err());
        let r = route(&layer, &x, Some(&[1, 0])).unwrap();
        assert_eq!(r.topk_ids, vec![3, 4, 1, 2]);
        layer.router.tid2eid = Some(vec![1, 2, 3, 9]);
        assert!(route(&layer, &x, Some(&[1, 0])).is_err());
    }

    #[test]
    fn sqrtsoftplus_switches_to_identity_above_20() {
        let s = score(ScoringFunc::Sqrtsoftplus, &[25.0, 0.0, -30.0]);
        assert_eq!(s[0], 25f32.sqrt());
        assert_eq!(s[1], std::f32::consts::LN_2.sqrt());
        assert!(s[2] > 0.0 && s[2] < 1e-6);
    }
}
