//! Expert parallelism on the CPU through the library: the sharded NVFP4 forward equals the
//! unsharded one up to FP32 summation order for N ∈ {1, 2, 4, 8} and both placements (checked
//! against a bound written out here from first principles), and the flipped id conventions
//! drop and misroute exactly the (token, slot) pairs the buggy engines do.

use nvfp4dbg::backend::DeviceRequest;
use nvfp4dbg::moe::ep::{ExpertMap, Placement};
use nvfp4dbg::moe::parallel::run::{forward, EpDevices, EpRequest, ReduceMode};
use nvfp4dbg::moe::parallel::EpFault;
use nvfp4dbg::moe::synthetic::{Preset, SyntheticModel};
use nvfp4dbg::moe::{moe_forward, ActScales, MoeLayer, MoeOutput, Path, Routing};
use nvfp4dbg::nvfp4::Flavor;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const H: usize = 256;

struct Case {
    seed: u64,
    layer: MoeLayer,
    x: Vec<f32>,
    routing: Routing,
}

fn case(tokens: usize) -> Case {
    let seed: u64 = rand::random();
    eprintln!("seed {seed}");
    let m = SyntheticModel::new(Preset::Tiny, seed);
    let layer = m.moe_layer(1).unwrap();
    let (x, ids) = m.activations(1, tokens, seed);
    let routing = nvfp4dbg::moe::route(&layer, &x, Some(&ids)).unwrap();
    Case {
        seed,
        layer,
        x,
        routing,
    }
}

fn scales(seed: u64, e: usize) -> Vec<ActScales> {
    let mut r = ChaCha8Rng::seed_from_u64(seed ^ 0xe9);
    vec![
        ActScales::Fixed {
            gs1: (0..e).map(|_| r.gen_range(60.0..2500.0)).collect(),
            gs2: (0..e).map(|_| r.gen_range(60.0..2500.0)).collect(),
        },
        ActScales::Dynamic,
    ]
}

fn unsharded(c: &Case, s: &ActScales) -> MoeOutput {
    let path = Path::Nvfp4 {
        scales: s,
        flavor: Flavor::Reference,
    };
    moe_forward(&c.layer, &c.x, &c.routing, &path, true).unwrap()
}

/// Any two summation orders of the same n = K + 1 terms (K products `fl(w·y)` and the shared
/// output) are each within `γ_K · Σ|terms|` of the exact sum (Higham §4.2), so they differ by
/// at most twice that. `|shared| ≤ |out| + Σ|p|` (plus the same rounding).
fn outside_bound(ep: &[f32], one: &MoeOutput, r: &Routing) -> Vec<(usize, f64, f64)> {
    let u = 2f64.powi(-24);
    let k = r.top_k;
    let g = k as f64 * u / (1.0 - k as f64 * u);
    let ps = one.per_slot.as_ref().unwrap();
    let mut bad = vec![];
    for (j, (&a, &b)) in ep.iter().zip(&one.out).enumerate() {
        let (t, ch) = (j / H, j % H);
        let sum_p: f64 = (0..k)
            .map(|s| ((r.topk_weights[t * k + s] * ps[(t * k + s) * H + ch]) as f64).abs())
            .sum();
        let terms = (2.0 * sum_p + (b as f64).abs()) / (1.0 - g);
        let d = (a as f64 - b as f64).abs();
        // NaN on either side is outside too
        let within = d <= 2.0 * g * terms;
        if !within {
            bad.push((j, d, 2.0 * g * terms));
        }
    }
    bad
}

fn request(n: usize, placement: Placement, fault: Option<EpFault>) -> EpRequest {
    EpRequest {
        size: n,
        placement,
        reduce: ReduceMode::Auto,
        fault,
    }
}

#[test]
fn sharded_equals_unsharded_up_to_fp32_summation_order() {
    let c = case(16);
    let e = c.layer.config.n_routed_experts;
    let dev = EpDevices::open(&DeviceRequest::Cpu, 8, None).unwrap();
    for s in scales(c.seed, e) {
        let one = unsharded(&c, &s);
        for n in [1, 2, 4, 8] {
            for placement in [Placement::Linear, Placement::RoundRobin] {
                let what = format!("seed {} n {n} {placement:?} {s:?}", c.seed);
                let ep = forward(
                    &dev,
                    &request(n, placement, None),
                    &c.layer,
                    &c.x,
                    &c.routing,
                    &s,
                    Flavor::Reference,
                    true,
                )
                .unwrap();
                assert_eq!(ep.ranks.len(), n, "{what}");
                assert_eq!(ep.reduce.method, "host", "{what}");
                let bad = outside_bound(&ep.out, &one, &c.routing);
                assert!(
                    bad.is_empty(),
                    "{what}: {} outside, first {:?}",
                    bad.len(),
                    bad[0]
                );
                if n == 1 {
                    let same = ep
                        .out
                        .iter()
                        .zip(&one.out)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(
                        same,
                        "{what}: one rank must be the unsharded run, bit for bit"
                    );
                }
                // every pair computed once, by its owner, with the unsharded run's bits
                let ps = ep.per_slot.as_ref().unwrap();
                let ps1 = one.per_slot.as_ref().unwrap();
                assert!(
                    ps.iter().zip(ps1).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{what}: per-slot outputs differ"
                );
                let computed: u64 = ep.ranks.iter().map(|r| r.plan.slots.computed).sum();
                assert_eq!(computed as usize, c.routing.topk_ids.len(), "{what}");
                assert_eq!(ep.act_stats, one.act_stats, "{what}: activation blocks");
                // the shared experts once: rank 0 only
                let maps = ExpertMap::all_ranks(e, n, placement).unwrap();
                for (r, m) in ep.ranks.iter().zip(&maps) {
                    assert_eq!(r.plan.map, *m, "{what}");
                }
            }
        }
    }
}

#[test]
fn the_bound_catches_a_shared_expert_added_on_every_rank() {
    // the check above must be able to fail: adding rank 1's share twice (what a rank that
    // also adds the shared experts, or a double reduce, does) is far outside the bound
    let c = case(8);
    let s = ActScales::Dynamic;
    let one = unsharded(&c, &s);
    let dev = EpDevices::open(&DeviceRequest::Cpu, 2, None).unwrap();
    let ep = forward(
        &dev,
        &request(2, Placement::Linear, None),
        &c.layer,
        &c.x,
        &c.routing,
        &s,
        Flavor::Reference,
        false,
    )
    .unwrap();
    assert!(outside_bound(&ep.out, &one, &c.routing).is_empty());
    let mut twice = ep.out.clone();
    for (o, p) in twice.iter_mut().zip(&ep.ranks[0].partial) {
        *o += p;
    }
    assert!(!outside_bound(&twice, &one, &c.routing).is_empty());
    // and a one-ulp nudge on one element with a tiny bound is caught too
    let mut nudged = ep.out.clone();
    let j = (0..nudged.len())
        .min_by(|&a, &b| one.out[a].abs().total_cmp(&one.out[b].abs()))
        .unwrap();
    nudged[j] += 1e-3 + nudged[j].abs() * 1e-3;
    assert!(!outside_bound(&nudged, &one, &c.routing).is_empty());
}

/// Owner rank of `g` and its local id, written out for the two placements.
fn owner(g: usize, e: usize, n: usize, placement: Placement) -> (usize, usize) {
    match placement {
        Placement::Linear => (g / (e / n), g % (e / n)),
        Placement::RoundRobin => (g % n, g / n),
    }
}

#[test]
fn flipped_conventions_drop_exactly_the_pairs_engines_drop() {
    let c = case(24);
    let e = c.layer.config.n_routed_experts;
    let s = ActScales::Dynamic;
    let one = unsharded(&c, &s);
    let dev = EpDevices::open(&DeviceRequest::Cpu, 4, None).unwrap();
    for n in [2, 4] {
        let nl = e / n;
        for placement in [Placement::Linear, Placement::RoundRobin] {
            for fault in [EpFault::LocalIds, EpFault::GlobalIds] {
                let what = format!("seed {} n {n} {placement:?} {fault:?}", c.seed);
                let ep = forward(
                    &dev,
                    &request(n, placement, Some(fault)),
                    &c.layer,
                    &c.x,
                    &c.routing,
                    &s,
                    Flavor::Reference,
                    false,
                )
                .unwrap();
                for r in 0..n {
                    let (mut dropped, mut wrong, mut spurious) = (0u64, 0u64, 0u64);
                    for &id in &c.routing.topk_ids {
                        let g = id as usize;
                        let (own, local) = owner(g, e, n, placement);
                        // the local expert rank r's kernel runs for this pair, if any
                        let runs: Option<usize> = match fault {
                            // handed expert_map[g] (-1 unless own == r), looked up as global
                            EpFault::LocalIds => (own == r)
                                .then(|| owner(local, e, n, placement))
                                .filter(|&(o2, _)| o2 == r)
                                .map(|(_, l2)| l2),
                            // handed g, used as a local index into an nl-entry table
                            EpFault::GlobalIds => (g < nl).then_some(g),
                        };
                        match (own == r, runs) {
                            (true, None) => dropped += 1,
                            (true, Some(l)) if l != local => wrong += 1,
                            (false, Some(_)) => spurious += 1,
                            _ => {}
                        }
                    }
                    let got = &ep.ranks[r].plan.slots;
                    assert_eq!(
                        (got.dropped, got.wrong_expert, got.spurious),
                        (dropped, wrong, spurious),
                        "{what} rank {r}"
                    );
                }
                let total_bad: u64 = ep
                    .ranks
                    .iter()
                    .map(|r| r.plan.slots.dropped + r.plan.slots.wrong_expert)
                    .sum();
                assert!(total_bad > 0, "{what}: the fault changed nothing");
                assert!(
                    !outside_bound(&ep.out, &one, &c.routing).is_empty(),
                    "{what}: a flipped convention must show in the output"
                );
            }
        }
    }
}
