//! B's layer `l` holding A's layer `l + k`: a loader that numbers layers otherwise than the
//! checkpoint (dense layers or the MTP layer counted differently, a pipeline stage's local
//! layer numbers). Each layer whose values differ is probed with one of its tensors against the
//! same tensor of every other layer of A (sampled fingerprints nominate); the layer pairing is
//! then confirmed tensor by tensor on every byte.

use super::compare::{
    fingerprint_as, fingerprint_own, holds_whole, shape_and_dtype, IssueKind, UnitResult,
};
use super::diagnose::{Diagnosis, DiagnosisKind};
use super::load::{Raw, SideRef};
use super::view::Depth;
use rayon::prelude::*;
use std::collections::{BTreeMap, BTreeSet};

/// `model.layers.12.mlp…` → (`model.layers.`, 12, `.mlp…`).
fn split_layer(key: &str) -> Option<(&str, usize, &str)> {
    let at = key.find("layers.")? + "layers.".len();
    let digits = key[at..].find(|c: char| !c.is_ascii_digit())?;
    let layer = key[at..at + digits].parse().ok()?;
    Some((&key[..at], layer, &key[at + digits..]))
}

fn with_layer(key: &str, layer: usize) -> Option<String> {
    let (head, _, tail) = split_layer(key)?;
    Some(format!("{head}{layer}{tail}"))
}

/// A side's unit `k`, loaded.
fn unit<'a>(side: &SideRef<'a>, k: &str) -> Option<Raw<'a>> {
    side.load(&side.inv.units.get(k)?.source).ok()
}

/// One diagnosis per layer offset: which of B's layers hold which of A's, and how many of their
/// differing tensors that explains (each confirmed on every byte). Those tensors' issues say so.
pub fn layer_shift(
    results: &mut [UnitResult],
    a: &SideRef,
    b: &SideRef,
    tp: Option<(usize, usize)>,
) -> Vec<Diagnosis> {
    let bad = |r: &UnitResult| r.issues.iter().any(|i| i.kind == IssueKind::Values);
    // the differing units of each layer, in key order
    let mut by_layer: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for (i, r) in results.iter().enumerate().filter(|(_, r)| bad(r)) {
        if let Some((_, l, _)) = split_layer(&r.name) {
            by_layer.entry(l).or_default().push(i);
        }
    }
    let a_layers: BTreeSet<usize> = a
        .inv
        .units
        .keys()
        .filter_map(|k| split_layer(k).map(|(_, l, _)| l))
        .collect();
    // B's unit `kb` is A's same-named unit of layer `from`, confirmed on every byte
    let holds = |kb: &str, from: usize| match (
        with_layer(kb, from).and_then(|ka| unit(a, &ka)),
        unit(b, kb),
    ) {
        (Some(ra), Some(rb)) => holds_whole(&ra, &rb, tp),
        _ => false,
    };
    // the other layer of A whose same-named tensor B's `probe` (of layer `l`) holds: sampled
    // fingerprints nominate
    let shifted_from = |probe: &str, rb: &Raw, l: usize| {
        let (fb, geom) = fingerprint_own(rb, Depth::Sample)?;
        a_layers.iter().copied().filter(|&o| o != l).find(|&o| {
            with_layer(probe, o)
                .and_then(|ka| fingerprint_as(&unit(a, &ka)?, &geom, tp, Depth::Sample))
                .is_some_and(|fa| fb.contains(&fa))
        })
    };
    // (B's layer, A's layer) → the units it explains
    let found: Vec<(usize, usize, Vec<usize>)> = by_layer
        .par_iter()
        .filter_map(|(&l, units)| {
            // a few probes, matrices only (one may be wrong in its own way, and a norm's
            // vector can be the same in every layer: ones, before training)
            let matrices = units.iter().filter(|&&i| results[i].a_shape.len() >= 2);
            let from = matrices.take(3).find_map(|&i| {
                let probe = &results[i].name;
                shifted_from(probe, &unit(b, probe)?, l)
            })?;
            let explained: Vec<usize> = units
                .iter()
                .copied()
                .filter(|&i| holds(&results[i].name, from))
                .collect();
            (!explained.is_empty()).then_some((l, from, explained))
        })
        .collect();
    // B's units with no same-named unit in A (B's layer holds another kind than A's layer
    // of that number: a pipeline stage of MoE layers numbered from 0 where A's first layers
    // are dense), by layer: the shift is found from the units that exist in both layers
    let mut b_only: BTreeMap<usize, Vec<&str>> = BTreeMap::new();
    for k in b.inv.units.keys().filter(|k| !a.inv.units.contains_key(*k)) {
        if let Some((_, l, _)) = split_layer(k) {
            b_only.entry(l).or_default().push(k);
        }
    }
    let unpaired: Vec<(usize, usize, usize, Vec<usize>)> = b_only
        .par_iter()
        .filter_map(|(&l, keys)| {
            let from = keys
                .iter()
                .filter_map(|&k| Some((k, unit(b, k)?)))
                .filter(|(_, r)| shape_and_dtype(r).0.len() >= 2)
                .take(3)
                .find_map(|(probe, rb)| shifted_from(probe, &rb, l))?;
            // the layer's paired tensors that differ (a norm, attention) hold A's `from` too
            let paired: Vec<usize> = by_layer
                .get(&l)
                .into_iter()
                .flatten()
                .copied()
                .filter(|&i| holds(&results[i].name, from))
                .collect();
            let n = keys.iter().filter(|&&kb| holds(kb, from)).count();
            (n > 0).then_some((l, from, n, paired))
        })
        .collect();
    // (B's layer, A's layer) → (paired units explained, B-only units explained)
    let mut pairs: BTreeMap<(usize, usize), (usize, usize)> = BTreeMap::new();
    let mut found = found;
    for (l, from, n, paired) in unpaired {
        if !found.iter().any(|f| f.0 == l) && !paired.is_empty() {
            found.push((l, from, paired));
        }
        pairs.entry((l, from)).or_default().1 += n;
    }
    for (l, from, units) in &found {
        pairs.entry((*l, *from)).or_default().0 += units.len();
    }
    for (l, from, units) in &found {
        for &i in units {
            if let Some(issue) = results[i]
                .issues
                .iter_mut()
                .find(|i| i.kind == IssueKind::Values)
            {
                issue
                    .message
                    .push_str(&format!(" — B's layer {l} holds A's layer {from}"));
            }
        }
    }
    let mut by_offset: BTreeMap<i64, Vec<(usize, usize, usize, usize)>> = BTreeMap::new();
    for ((l, from), (paired, only)) in pairs {
        by_offset
            .entry(from as i64 - l as i64)
            .or_default()
            .push((l, from, paired, only));
    }
    by_offset
        .into_iter()
        .map(|(off, pairs)| {
            let tensors: usize = pairs.iter().map(|p| p.2 + p.3).sum();
            let only: usize = pairs.iter().map(|p| p.3).sum();
            let shown: Vec<String> = pairs
                .iter()
                .take(8)
                .map(|(l, from, _, _)| format!("{l}←{from}"))
                .collect();
            Diagnosis {
                kind: DiagnosisKind::LayerShift,
                layer: (pairs.len() == 1).then_some(pairs[0].0),
                experts: vec![],
                tensors,
                message: format!(
                    "B's layer l holds A's layer l{off:+} in {} layer(s) (B's ← A's: {}{}), {tensors} tensors \
                     confirmed byte for byte{}: the loader numbers layers otherwise than the checkpoint (dense or MTP \
                     layers counted differently, or a pipeline stage's local layer numbers)",
                    pairs.len(),
                    shown.join(", "),
                    if pairs.len() > 8 { ", …" } else { "" },
                    if only > 0 {
                        format!(
                            " ({only} of them with no same-named tensor in A: A's layer of B's \
                             number is of another kind, dense where B's is MoE or the reverse, so \
                             they are listed as extra in B)"
                        )
                    } else {
                        String::new()
                    }
                ),
                fails: true,
                units: vec![],
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_numbers_are_found_and_replaced() {
        assert_eq!(
            split_layer("model.layers.12.mlp.experts.3.gate_proj.weight"),
            Some(("model.layers.", 12, ".mlp.experts.3.gate_proj.weight"))
        );
        assert_eq!(
            with_layer("layers.3.ffn.w1.weight", 40).as_deref(),
            Some("layers.40.ffn.w1.weight")
        );
        assert_eq!(split_layer("model.embed_tokens.weight"), None);
        assert_eq!(split_layer("model.layers.x.mlp"), None);
    }
}
