//! `routing` (H4): do tokens reach the right experts? Reads a routing dump, checks ids and
//! weights against the config, looks for local-vs-global id confusion under expert
//! parallelism, recomputes the routing from hidden states (or router logits) when a checkpoint
//! is given, and reports the expert load.

use super::common::{DeviceArgs, OutArgs};
use crate::checkpoint::{MoeCheckpoint, TensorSource};
use crate::error::{Error, Result};
use crate::moe::ep::check::{
    self, Agreement, Expectations, ExpertLoad, IdSpace, Ids, Outcome, RankLoad, RefCompare,
    Tolerances,
};
use crate::moe::ep::dump::{self, Matrix, RoutingDump};
use crate::moe::ep::{ExpertMap, Placement};
use crate::moe::{MoeConfig, MoeLayer, Router, Routing};
use crate::report::{self, Report, Section, Verdict};
use serde::Serialize;
use std::path::PathBuf;

/// Router logits recomputed from hidden states must match the dump's this well.
const MIN_LOGITS_COSINE: f64 = 0.999;

#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    /// Routing dump (safetensors): topk_ids [T,K], topk_weights [T,K], optionally
    /// router_logits [T,E], hidden_states [T,H], input_ids [T]
    #[arg(value_name = "DUMP")]
    pub dump: PathBuf,
    /// Checkpoint directory (config.json and the MoE layers; routing reads each layer's gate
    /// weight and e_score_correction_bias): enables recomputing the routing
    #[arg(long, value_name = "DIR")]
    pub checkpoint: Option<PathBuf>,
    /// Layer the dump comes from (default: the dump's `layer` metadata)
    #[arg(long, value_name = "L")]
    pub layer: Option<usize>,
    /// Number of routed experts (default: n_routed_experts of the checkpoint config)
    #[arg(long, value_name = "E")]
    pub num_experts: Option<usize>,
    /// Override the config's norm_topk_prob
    #[arg(long, value_name = "BOOL")]
    pub norm_topk_prob: Option<bool>,
    /// Override the config's routed_scaling_factor
    #[arg(long, value_name = "F")]
    pub routed_scaling_factor: Option<f32>,
    /// EP rank the dump was taken on (default: the dump's `ep_rank` metadata)
    #[arg(long, value_name = "R")]
    pub ep_rank: Option<usize>,
    /// EP world size (default: the dump's `ep_size` metadata, else 1)
    #[arg(long, value_name = "N")]
    pub ep_size: Option<usize>,
    /// How experts are spread over EP ranks (vLLM's expert_placement_strategy; default: the
    /// dump's `placement` metadata, else linear)
    #[arg(long, value_enum)]
    pub placement: Option<Placement>,
    /// What the dump's ids are meant to be: global router output, or local ids after expert_map
    /// (default: the dump's `ids` metadata, else global)
    #[arg(long, value_enum)]
    pub ids: Option<IdSpace>,
    /// Hidden states [T,H] (safetensors) when the dump does not hold them
    #[arg(long, value_name = "FILE")]
    pub hidden: Option<PathBuf>,
    /// Minimum fraction of slots agreeing with the recomputed routing (near-ties flip between
    /// a BF16 engine router and the FP32 reference)
    #[arg(long, value_name = "RATE", default_value_t = 0.95)]
    pub min_match: f64,
    /// Maximum relative L2 error of topk_weights against the recomputed weights
    #[arg(long, value_name = "REL", default_value_t = 0.02)]
    pub max_weight_err: f64,
    /// Tokens tolerated at experts the router does not choose even with its logits moved by
    /// their BF16 rounding in the dump's favour (not near-ties: --min-match tolerates those)
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub max_clear_mismatches: u64,
    #[command(flatten)]
    pub device: DeviceArgs,
    #[command(flatten)]
    pub out_args: OutArgs,
}

impl Args {
    fn placement(&self) -> Placement {
        self.placement.unwrap_or(Placement::Linear)
    }
    fn ids(&self) -> IdSpace {
        self.ids.unwrap_or(IdSpace::Global)
    }
}

#[derive(Serialize)]
struct Summary {
    tokens: usize,
    top_k: usize,
    num_experts: usize,
    findings: usize,
    ep_rank: Option<usize>,
    ep_size: usize,
    /// Slots whose id is among the recomputed ids of its token, the ids read as declared.
    match_rate: Option<f64>,
    /// The same under the id mapping that fits the dump best (`id_transform`: "identity",
    /// "expert_map", "minus offset 8"): what the ids mean when they are not what they claim.
    best_match_rate: Option<f64>,
    id_transform: Option<String>,
    weight_rel_l2: Option<f64>,
    /// Tokens at another expert set than the recomputed one that exact ties of the selection
    /// score allow (counted as matching).
    tokens_accepted_under_ties: Option<u64>,
    unused_experts: usize,
    max_over_mean: f64,
}

fn meta_usize(d: &RoutingDump, key: &str) -> Result<Option<usize>> {
    d.metadata
        .get(key)
        .map(|v| {
            v.trim().parse().map_err(|_| {
                Error::bad_file(
                    &d.path,
                    format!("metadata `{key}` = \"{v}\" is not a non-negative integer"),
                )
            })
        })
        .transpose()
}

/// A metadata value spelled as the flag of the same name takes it (`linear`, `round-robin`;
/// `global`, `local`).
fn meta_enum<T: clap::ValueEnum>(d: &RoutingDump, key: &str) -> Result<Option<T>> {
    d.metadata
        .get(key)
        .map(|v| {
            T::from_str(v.trim(), true).map_err(|_| {
                let names: Vec<String> = T::value_variants()
                    .iter()
                    .filter_map(|x| x.to_possible_value().map(|p| p.get_name().to_string()))
                    .collect();
                Error::bad_file(
                    &d.path,
                    format!(
                        "metadata `{key}` = \"{v}\" is not one of {}",
                        names.join(", ")
                    ),
                )
            })
        })
        .transpose()
}

fn check_range(name: &str, v: f64, lo: f64, hi: f64) -> Result<()> {
    if !(lo..=hi).contains(&v) {
        return Err(Error::usage(format!("{name} {v} is outside [{lo}, {hi}]")));
    }
    Ok(())
}

pub fn run(args: &Args) -> Result<Report> {
    check_range("--min-match", args.min_match, 0.0, 1.0)?;
    if !(args.max_weight_err.is_finite() && args.max_weight_err >= 0.0) {
        return Err(Error::usage(format!(
            "--max-weight-err {}: a finite relative error >= 0",
            args.max_weight_err
        )));
    }
    if let Some(f) = args
        .routed_scaling_factor
        .filter(|f| !(f.is_finite() && *f > 0.0))
    {
        return Err(Error::usage(format!(
            "--routed-scaling-factor {f}: a finite factor > 0"
        )));
    }
    let d = RoutingDump::load(&args.dump)?;
    // `placement` and `ids` default to the dump's metadata, as `ep_rank` and `ep_size` do
    // (`layertest --save-routing` writes all four): a round-robin dump was read as linear,
    // and a dump of local ids as global ones
    let resolved;
    let args = if args.placement.is_none() || args.ids.is_none() {
        let mut a = args.clone();
        a.placement = a.placement.or(meta_enum::<Placement>(&d, "placement")?);
        a.ids = a.ids.or(meta_enum::<IdSpace>(&d, "ids")?);
        resolved = a;
        &resolved
    } else {
        args
    };
    let ckpt = match &args.checkpoint {
        Some(dir) => Some(MoeCheckpoint::open(dir)?),
        None => None,
    };
    let config = ckpt.as_ref().map(|c| c.config.moe.clone());
    let num_experts = match (args.num_experts, &config) {
        (Some(e), Some(c)) if e != c.n_routed_experts => {
            return Err(Error::usage(format!(
                "--num-experts {e} contradicts n_routed_experts = {} of the checkpoint config",
                c.n_routed_experts
            )))
        }
        (Some(e), _) => e,
        (None, Some(c)) => c.n_routed_experts,
        (None, None) => {
            return Err(Error::usage(
                "the number of experts is unknown: pass --checkpoint DIR or --num-experts E",
            ))
        }
    };
    if num_experts == 0 {
        return Err(Error::usage("--num-experts must be at least 1"));
    }
    let exp = Expectations {
        num_experts,
        top_k: config.as_ref().map(|c| c.num_experts_per_tok),
        norm_topk_prob: args
            .norm_topk_prob
            .or(config.as_ref().map(|c| c.norm_topk_prob)),
        routed_scaling_factor: args
            .routed_scaling_factor
            .or(config.as_ref().map(|c| c.routed_scaling_factor)),
    };
    let ep_size = args.ep_size.or(meta_usize(&d, "ep_size")?).unwrap_or(1);
    if ep_size == 0 {
        return Err(match args.ep_size {
            Some(_) => Error::usage("--ep-size 0: an EP world has at least one rank"),
            None => Error::bad_file(
                &d.path,
                "metadata `ep_size` = 0: an EP world has at least one rank",
            ),
        });
    }
    let ep_rank = args.ep_rank.or(meta_usize(&d, "ep_rank")?);
    // checked for every EP size: rank 5 of a world of 1 was taken for the whole world
    if let Some(rank) = ep_rank.filter(|&r| r >= ep_size) {
        let what = format!("EP rank {rank} is not below the EP size {ep_size}");
        return Err(match (args.ep_rank, args.ep_size) {
            (Some(_), Some(_)) => Error::usage(format!("--ep-rank/--ep-size: {what}")),
            _ => Error::bad_file(
                &d.path,
                format!("metadata `ep_rank` / `ep_size` (or the flags given with them): {what}"),
            ),
        });
    }
    let maps = if ep_size > 1 {
        let rank = ep_rank.ok_or_else(|| {
            Error::usage("--ep-size needs --ep-rank (or `ep_rank` in the dump's metadata)")
        })?;
        if ep_size > num_experts {
            let what = format!(
                "EP size {ep_size} is larger than the {num_experts} experts: some rank would hold none"
            );
            return Err(match args.ep_size {
                Some(_) => Error::usage(format!(
                    "--ep-size {ep_size} (dump {}): {what}",
                    d.path.display()
                )),
                None => Error::bad_file(&d.path, format!("metadata `ep_size`: {what}")),
            });
        }
        let maps = ExpertMap::all_ranks(num_experts, ep_size, args.placement())?;
        Some((rank, maps))
    } else {
        if args.ids() == IdSpace::Local {
            return Err(Error::usage("--ids local needs --ep-rank and --ep-size"));
        }
        None
    };
    let me = maps.as_ref().map(|(r, m)| &m[*r]);

    let ids = Ids {
        tokens: d.tokens,
        top_k: d.top_k,
        ids: &d.topk_ids,
        weights: &d.topk_weights,
    };
    let mut out = check::check_ids(&ids, &exp, args.ids(), me);
    out.extend(check::check_weights(
        &ids,
        &exp,
        check::sum_tolerance(d.weights_dtype, d.top_k, &d.topk_weights),
    ));
    let mut rank_load: Vec<RankLoad> = vec![];
    if let Some((rank, m)) = &maps {
        if !m[0].is_even() {
            out.notes.push(format!(
                "{num_experts} experts over {ep_size} ranks do not divide evenly: vLLM's split is used \
                 (the first {} ranks hold one more); SGLang and DeepEP refuse this configuration",
                num_experts % ep_size
            ));
        }
        let (o, loads) = check::check_ep_ids(&ids, m, *rank, args.ids());
        out.extend(o);
        rank_load = loads;
    }

    let agreements = recompute(args, &d, ckpt.as_ref(), &exp, &ids, maps.as_ref(), &mut out)?;
    // ids at E that a shift of all ids explains are not SGLang's fused shared expert
    if out
        .findings
        .iter()
        .any(|f| f.kind == check::FindingKind::IdsShifted)
    {
        let hint = check::sglang_hint(num_experts);
        for f in out
            .findings
            .iter_mut()
            .filter(|f| f.kind == check::FindingKind::OutOfRange)
        {
            f.message = f.message.replace(&hint, "");
            f.message
                .push_str(" — explained by the shift of the ids (ids_shifted)");
        }
    }
    if let (Some(ag), false) = (
        agreements.iter().find(|a| a.dropped_by_rank.is_some()),
        rank_load.is_empty(),
    ) {
        if let Some(dr) = &ag.dropped_by_rank {
            for (l, &n) in rank_load.iter_mut().zip(dr) {
                l.dropped = Some(n);
            }
        }
    }

    let global_ids: Vec<i64> = match (args.ids(), me) {
        (IdSpace::Local, Some(m)) => d
            .topk_ids
            .iter()
            .map(|&l| m.global(l).map_or(-1, |g| g as i64))
            .collect(),
        _ => d.topk_ids.clone(),
    };
    let load = check::expert_load(&global_ids, num_experts);
    Ok(build_report(
        args, &d, &exp, ep_rank, ep_size, out, agreements, load, rank_load,
    ))
}

/// Recompute the routing where the dump and the checkpoint allow it; every comparison
/// made is returned.
fn recompute(
    args: &Args,
    d: &RoutingDump,
    ckpt: Option<&MoeCheckpoint>,
    exp: &Expectations,
    ids: &Ids,
    maps: Option<&(usize, Vec<ExpertMap>)>,
    out: &mut Outcome,
) -> Result<Vec<Agreement>> {
    let hidden = match &args.hidden {
        Some(p) => Some(dump::load_hidden(p, d.tokens)?),
        None => d.hidden_states.clone(),
    };
    if let Some(h) = &hidden {
        out.extend(check::check_inputs_finite(
            "hidden_states",
            &h.data,
            h.rows,
            h.cols,
        ));
    }
    if let Some(lg) = d
        .router_logits
        .as_ref()
        .filter(|lg| lg.cols != exp.num_experts)
    {
        return Err(Error::bad_tensor(
            &d.path,
            "router_logits",
            format!(
                "has {} experts a token, the layer {}",
                lg.cols, exp.num_experts
            ),
        ));
    }
    if let Some(lg) = &d.router_logits {
        out.extend(check::check_inputs_finite(
            "router_logits",
            &lg.data,
            lg.rows,
            lg.cols,
        ));
    }
    let Some(mc) = ckpt else {
        if hidden.is_some() || d.router_logits.is_some() {
            out.notes.push(
                "hidden states / router logits present but no --checkpoint: routing not recomputed"
                    .into(),
            );
        }
        return Ok(vec![]);
    };
    let layer_idx = match args.layer.or(meta_usize(d, "layer")?) {
        Some(l) => l,
        // something to recompute the routing from, and no layer to recompute it for: a PASS
        // would say the routing was checked
        None if hidden.is_some() || d.router_logits.is_some() || d.input_ids.is_some() => {
            return Err(Error::bad_file(
                &d.path,
                "no `layer` metadata: the routing cannot be recomputed from the checkpoint's \
                 router without the layer the dump comes from; pass --layer N (or add `layer` \
                 to the dump's metadata)",
            ))
        }
        None => {
            out.notes.push(
                "no --layer (and no `layer` metadata in the dump), and nothing to recompute the \
                 routing from: routing not recomputed"
                    .into(),
            );
            return Ok(vec![]);
        }
    };
    // the check layertest, gs-sweep and multilayer make: expert tensors, and not a layer
    // config.json's first_k_dense_replace makes dense
    mc.check_layer(layer_idx)?;
    // --norm-topk-prob / --routed-scaling-factor override the config for the recomputed
    // routing too, not only for the weight sums
    let config = &MoeConfig {
        norm_topk_prob: args.norm_topk_prob.unwrap_or(mc.config.moe.norm_topk_prob),
        routed_scaling_factor: args
            .routed_scaling_factor
            .unwrap_or(mc.config.moe.routed_scaling_factor),
        ..mc.config.moe.clone()
    };
    let router = read_router(mc, layer_idx)?;
    let tol = Tolerances {
        min_match: args.min_match,
        weight_rel_l2: args.max_weight_err,
    };
    let base = RefCompare {
        source: "",
        space: args.ids(),
        ep: maps.map(|(r, m)| (&m[*r], m.as_slice())),
        routed_scaling_factor: exp.routed_scaling_factor,
        tol,
        num_experts: config.n_routed_experts,
        ids_checked_elsewhere: false,
    };
    let mut agreements = vec![];

    let mut hash_checked = false;
    if config.is_hash_layer(layer_idx) {
        // a hash layer routes by tid2eid[input_ids]: without both nothing is checked
        let tk = mc.naming.tid2eid(layer_idx);
        let Some(t2e) = &router.tid2eid else {
            return Err(Error::bad_tensor(
                mc.ckpt.path(),
                &tk,
                format!(
                    "missing: layer {layer_idx} is a hash layer (num_hash_layers = {}) and routes \
                     by this table; without it the routing cannot be recomputed",
                    config.num_hash_layers
                ),
            ));
        };
        let Some(input_ids) = &d.input_ids else {
            return Err(Error::bad_tensor(
                &d.path,
                "input_ids",
                format!(
                    "missing: layer {layer_idx} is a hash layer that routes by \
                     tid2eid[input_ids]; add the batch's token ids as an `input_ids` [{}] tensor \
                     to the dump",
                    d.tokens
                ),
            ));
        };
        let vocab = t2e.len() / config.num_experts_per_tok.max(1);
        if let Some((t, &v)) = input_ids
            .iter()
            .enumerate()
            .find(|(_, &v)| usize::try_from(v).map_or(true, |v| v >= vocab))
        {
            return Err(Error::bad_tensor(
                &d.path,
                "input_ids",
                format!(
                    "input_ids[{t}] = {v} is outside the vocabulary of {tk} ({vocab} token ids) in \
                     {}",
                    mc.ckpt.file_of(&tk).display()
                ),
            ));
        }
        // local ids are compared with the table's ids under expert_map below
        if args.ids() == IdSpace::Global {
            let (o, ag) = check::check_hash(
                ids,
                input_ids,
                t2e,
                config.num_experts_per_tok,
                config.n_routed_experts,
            );
            out.extend(o);
            agreements.extend(ag);
            hash_checked = true;
        }
    }

    let backend = || args.device.open(args.out_args.quiet);
    // tokens at experts no near-tie explains, on global ids (local ones are mapped first)
    let clear = |logits: &[f32]| match args.ids() {
        IdSpace::Global => check::clear_mismatches(
            ids,
            logits,
            config.n_routed_experts,
            config.scoring_func,
            router.e_score_correction_bias.as_deref(),
            config.n_group,
            config.topk_group,
            args.max_clear_mismatches,
        ),
        _ => Default::default(),
    };
    if let Some(h) = &hidden {
        if h.cols != config.hidden_size {
            return Err(Error::bad_tensor(
                args.hidden.as_deref().unwrap_or(&d.path),
                "hidden_states",
                format!(
                    "has {} channels, hidden_size is {}",
                    h.cols, config.hidden_size
                ),
            ));
        }
        // the router runs in FP32 on the hidden states as given (DESIGN §4): F32 ones are
        // not rounded to BF16 first (BF16 ones are exact in f32 either way)
        let hb = &h.data;
        if let Some(lg) = &d.router_logits {
            check_logits_shape(d, lg, config)?;
            let (o, m) = check::check_logits(
                &lg.data,
                hb,
                &router.weight,
                d.tokens,
                config.hidden_size,
                config.n_routed_experts,
                MIN_LOGITS_COSINE,
            );
            out.extend(o);
            out.notes.push(format!(
                "router_logits vs hidden_states · gateᵀ: cosine {:.6}, rel_l2 {:.3e}",
                m.cosine, m.rel_l2
            ));
        }
        let be = backend()?;
        let logits = crate::moe::router::router_logits(
            &router.weight,
            hb,
            d.tokens,
            config.hidden_size,
            config.n_routed_experts,
        );
        let reroute = |c: &MoeConfig, r: &Router| {
            let v = be.route(
                &router_layer(layer_idx, c.clone(), r.clone()),
                hb,
                d.input_ids.as_deref(),
            )?;
            // ties are those of the router that ran: another layer's gate has its own logits
            let other;
            let lg = if r.weight == router.weight {
                &logits
            } else {
                other = crate::moe::router::router_logits(
                    &r.weight,
                    hb,
                    d.tokens,
                    config.hidden_size,
                    config.n_routed_experts,
                );
                &other
            };
            Ok(accept_ties(ids, &v, lg, c, r, layer_idx, args.ids()))
        };
        let (routing, ties) = reroute(config, &router)?;
        let cmp = RefCompare {
            source: "hidden_states + gate",
            ids_checked_elsewhere: hash_checked,
            ..base
        };
        let (mut o, ag) = check::compare_with_reference(ids, &routing, &cmp);
        if ties > 0 {
            o.notes.push(ties_note(ties, cmp.source));
        }
        if o.findings.is_empty() {
            if !hash_checked {
                o.extend(clear(&logits));
            }
        } else {
            let reroute = |c: &MoeConfig, r: &Router| reroute(c, r).map(|(v, _)| v);
            diagnose(
                ids,
                config,
                &router,
                &logits,
                &routing,
                &cmp,
                &reroute,
                layer_idx,
                &neighbour_routers(mc, layer_idx),
                &mut o,
            )?;
        }
        out.extend(o);
        agreements.extend(ag.map(|mut a| {
            a.tokens_accepted_under_ties = ties;
            a
        }));
    } else if let Some(lg) = &d.router_logits {
        {
            check_logits_shape(d, lg, config)?;
            let be = backend()?;
            let reroute = |c: &MoeConfig, r: &Router| {
                let v = route_from_logits(&*be, layer_idx, c, r, lg, d.input_ids.as_deref())?;
                Ok(accept_ties(ids, &v, &lg.data, c, r, layer_idx, args.ids()))
            };
            let (routing, ties) = reroute(config, &router)?;
            let cmp = RefCompare {
                source: "router_logits",
                ids_checked_elsewhere: hash_checked,
                ..base
            };
            let (mut o, ag) = check::compare_with_reference(ids, &routing, &cmp);
            if ties > 0 {
                o.notes.push(ties_note(ties, cmp.source));
            }
            if !o.findings.is_empty() {
                let reroute = |c: &MoeConfig, r: &Router| reroute(c, r).map(|(v, _)| v);
                // the engine's logits hold whichever gate it ran: no other layer's router to try
                diagnose(
                    ids,
                    config,
                    &router,
                    &lg.data,
                    &routing,
                    &cmp,
                    &reroute,
                    layer_idx,
                    &[],
                    &mut o,
                )?;
            } else if !hash_checked {
                o.extend(clear(&lg.data));
            }
            out.extend(o);
            agreements.extend(ag.map(|mut a| {
                a.tokens_accepted_under_ties = ties;
                a
            }));
        }
    } else if !hash_checked {
        out.notes.push(
            "the dump holds neither hidden_states nor router_logits (and no --hidden): routing not recomputed"
                .into(),
        );
    }
    Ok(agreements)
}

/// The reference with each token whose dump ids (global) name another expert set, but one a
/// tie-break of exact ties of the selection score (score + bias) could choose, group
/// selection included, taking the dump's ids and the weights recomputed for them; and how
/// many tokens that is. Exact ties are real: engines pad CUDA-graph batches with zero hidden
/// states, which tie every expert when the router has no correction bias, and duplicated gate
/// rows tie on every token. Hash layers and local ids are left as they are.
fn accept_ties(
    ids: &Ids,
    reference: &Routing,
    logits: &[f32],
    config: &MoeConfig,
    router: &Router,
    layer: usize,
    space: IdSpace,
) -> (Routing, u64) {
    use crate::moe::router::{is_valid_topk, score, weights};
    let (e, k) = (config.n_routed_experts, reference.top_k);
    if space != IdSpace::Global
        || config.is_hash_layer(layer)
        || reference.tokens != ids.tokens
        || k != ids.top_k
        || logits.len() != reference.tokens * e
    {
        return (reference.clone(), 0);
    }
    let mut r = reference.clone();
    let mut n = 0u64;
    for (t, l) in logits.chunks(e).enumerate() {
        let got = &ids.ids[t * k..(t + 1) * k];
        let want = &reference.topk_ids[t * k..(t + 1) * k];
        if got.iter().all(|&g| want.iter().any(|&w| w as i64 == g)) {
            continue;
        }
        let Some(chosen) = got
            .iter()
            .map(|&g| usize::try_from(g).ok().filter(|&g| g < e))
            .collect::<Option<Vec<usize>>>()
        else {
            continue;
        };
        let sc = score(config.scoring_func, l);
        let sel: Vec<f32> = match &router.e_score_correction_bias {
            Some(b) => sc.iter().zip(b).map(|(s, b)| s + b).collect(),
            None => sc.clone(),
        };
        if !is_valid_topk(&sel, config.n_group, config.topk_group, &chosen) {
            continue;
        }
        let w = weights(
            &sc,
            &chosen,
            config.norm_topk_prob,
            config.routed_scaling_factor,
        );
        for (j, (&c, w)) in chosen.iter().zip(w).enumerate() {
            r.topk_ids[t * k + j] = c as i32;
            r.topk_weights[t * k + j] = w;
        }
        n += 1;
    }
    (r, n)
}

/// The note that says how many tokens [`accept_ties`] accepted.
fn ties_note(n: u64, source: &str) -> String {
    format!(
        "{n} token(s) name another expert set than the routing recomputed from {source}, but one \
         that exact ties of the selection score (score + bias) allow (padding rows of zeros tie \
         every expert without a correction bias): counted as matching, their weights compared with \
         those recomputed for the dump's experts"
    )
}

/// Weights of one token from its scores and chosen ids.
type Reweigh<'a> = dyn Fn(&[f32], &[usize]) -> Vec<f32> + 'a;

/// Router bugs recomputed when the dump disagrees with the reference: the ones whose routing
/// the dump matches (ids and weights within the tolerances, no finding left but misaligned
/// slots) are named in the first finding's message and as notes, two at once when no single
/// one explains the dump. `reroute` routes the same input under another config
/// or router; `logits` `[T, E]` give the scores for the weight-only variants.
#[allow(clippy::too_many_arguments)]
fn diagnose(
    ids: &Ids,
    config: &MoeConfig,
    router: &Router,
    logits: &[f32],
    reference: &Routing,
    cmp: &RefCompare,
    reroute: &dyn Fn(&MoeConfig, &Router) -> Result<Routing>,
    layer: usize,
    other_layers: &[(usize, Router)],
    out: &mut Outcome,
) -> Result<()> {
    use crate::moe::router::{score, select, softplus, weights};
    use crate::moe::ScoringFunc;
    let name = |f: ScoringFunc| {
        serde_json::to_value(f)
            .ok()
            .and_then(|v| v.as_str().map(String::from))
            .unwrap_or_default()
    };
    let mut variants: Vec<(String, Routing)> = vec![];
    if config.n_group > 1 && config.topk_group < config.n_group {
        let c = MoeConfig {
            n_group: 1,
            topk_group: 1,
            ..config.clone()
        };
        variants.push((
            format!(
                "group limit ignored (top-{} over all experts, not within the best topk_group = {} \
                 of n_group = {} groups)",
                config.num_experts_per_tok, config.topk_group, config.n_group
            ),
            reroute(&c, router)?,
        ));
    }
    for f in [
        ScoringFunc::Sigmoid,
        ScoringFunc::Softmax,
        ScoringFunc::Sqrtsoftplus,
    ] {
        if f != config.scoring_func {
            let c = MoeConfig {
                scoring_func: f,
                ..config.clone()
            };
            variants.push((
                format!(
                    "{} scoring where the config says scoring_func = {}",
                    name(f),
                    name(config.scoring_func)
                ),
                reroute(&c, router)?,
            ));
        }
    }
    let e = config.n_routed_experts;
    // the weights of the reference's ids under another formula
    let reweigh = |f: &Reweigh| -> Routing {
        let k = reference.top_k;
        let mut w = Vec::with_capacity(reference.topk_weights.len());
        for (t, l) in logits.chunks(e).enumerate().take(reference.tokens) {
            let sc = score(config.scoring_func, l);
            let row: Vec<usize> = reference.topk_ids[t * k..(t + 1) * k]
                .iter()
                .map(|&i| i as usize)
                .collect();
            w.extend(f(&sc, &row));
        }
        Routing {
            topk_weights: w,
            ..reference.clone()
        }
    };
    let rsf = config.routed_scaling_factor;
    if config.scoring_func == ScoringFunc::Sqrtsoftplus {
        // V4's sqrt(softplus(logit)) with the sqrt left out: softplus scores select (with the
        // bias; a hash layer keeps its table's ids) and weigh
        let k = reference.top_k;
        let mut v = reference.clone();
        v.topk_weights.clear();
        for (t, l) in logits.chunks(e).enumerate().take(reference.tokens) {
            let sp: Vec<f32> = l.iter().map(|&l| softplus(l)).collect();
            let row: Vec<usize> = if config.is_hash_layer(layer) {
                reference.topk_ids[t * k..(t + 1) * k]
                    .iter()
                    .map(|&i| i as usize)
                    .collect()
            } else {
                let sel: Vec<f32> = match &router.e_score_correction_bias {
                    Some(b) => sp.iter().zip(b).map(|(s, b)| s + b).collect(),
                    None => sp.clone(),
                };
                select(&sel, config.n_group, config.topk_group, k)
            };
            for (slot, &i) in row.iter().enumerate() {
                v.topk_ids[t * k + slot] = i as i32;
            }
            v.topk_weights
                .extend(weights(&sp, &row, config.norm_topk_prob, rsf));
        }
        variants.push((
            "softplus scoring where the config says scoring_func = sqrtsoftplus (the sqrt of \
             sqrt(softplus(logit)) left out)"
                .into(),
            v,
        ));
    }
    if let Some(b) = &router.e_score_correction_bias {
        let r = Router {
            e_score_correction_bias: None,
            ..router.clone()
        };
        variants.push((
            "e_score_correction_bias ignored in the selection".into(),
            reroute(config, &r)?,
        ));
        variants.push((
            "e_score_correction_bias added to the weights (weights from score + bias, not the \
             unbiased score)"
                .into(),
            reweigh(&|sc, row| {
                let sel: Vec<f32> = sc.iter().zip(b).map(|(s, b)| s + b).collect();
                weights(&sel, row, config.norm_topk_prob, rsf)
            }),
        ));
    }
    if config.norm_topk_prob {
        variants.push((
            "weights not normalized (norm_topk_prob = true ignored)".into(),
            reweigh(&|sc, row| weights(sc, row, false, rsf)),
        ));
    } else {
        variants.push((
            "weights normalized to sum to 1 (norm_topk_prob = false ignored: an engine default \
             of true)"
                .into(),
            reweigh(&|sc, row| weights(sc, row, true, rsf)),
        ));
    }
    if rsf != 1.0 {
        variants.push((
            format!(
                "routed_scaling_factor applied twice (weights × {rsf}², not × {rsf}: in the router \
                 and again on the MoE output)"
            ),
            reweigh(&|sc, row| weights(sc, row, config.norm_topk_prob, rsf * rsf)),
        ));
    }
    if config.n_group > 1 && config.topk_group < config.n_group && e.is_multiple_of(config.n_group)
    {
        variants.push((
            format!(
                "groups ranked by their best expert (max, DeepSeek-V2's group_limited_greedy), not \
                 by the sum of their top-2 selection scores (noaux_tc) — keeping topk_group = {} of \
                 n_group = {} groups",
                config.topk_group, config.n_group
            ),
            groups_by_max(config, router, logits, reference),
        ));
    }
    for (l, r) in other_layers {
        variants.push((
            format!(
                "layer {l}'s router (its gate weight and e_score_correction_bias routed the dump's \
                 tokens, not layer {}'s: a layer index off when the gates were loaded or called)",
                layer
            ),
            reroute(config, r)?,
        ));
    }
    // Two bugs at once: each router bug (and none) with the dump's rows one token off, and
    // any of those with topk_ids and topk_weights misaligned. The fewest bugs that explain the
    // dump are named; one bug alone is preferred to a pair.
    let mut candidates: Vec<(Vec<String>, Routing)> = vec![(vec![], reference.clone())];
    candidates.extend(variants.into_iter().map(|(what, v)| (vec![what], v)));
    if reference.tokens > 2 {
        let unshifted = candidates.len();
        for i in 0..unshifted {
            for (s, what) in [
                (1usize, "the next token's (dump token t ↔ token t+1)"),
                (
                    reference.tokens - 1,
                    "the previous token's (dump token t ↔ token t−1)",
                ),
            ] {
                let (mut bugs, v) = candidates[i].clone();
                bugs.push(format!(
                    "rows one token off: each dump row holds {what} routing — topk_ids and the \
                     hidden states / logits are misaligned by a token (a dropped or extra token on one side)"
                ));
                candidates.push((bugs, one_token_off(&v, s)));
            }
        }
    }
    let mut explained: Vec<Vec<String>> = vec![];
    for (mut bugs, v) in candidates {
        let (o, ag) = check::compare_with_reference(ids, &v, cmp);
        let Some(ag) = ag.filter(|a| a.weights.is_some()) else {
            continue;
        };
        let misaligned = !o.findings.is_empty()
            && ag.weights_misaligned
            && o.findings
                .iter()
                .all(|f| f.kind == check::FindingKind::WeightError);
        if misaligned {
            bugs.push(MISALIGNED.into());
        } else if !o.findings.is_empty() {
            continue;
        }
        explained.push(bugs);
    }
    let fewest = explained.iter().map(Vec::len).min().unwrap_or(0);
    explained.retain(|b| b.len() == fewest);
    // misaligned slots alone are the weight finding's own diagnosis
    if explained.iter().any(|b| b.len() == 1 && b[0] == MISALIGNED) {
        return Ok(());
    }
    let (lead, joined) = if fewest == 1 {
        (
            "this router bug",
            explained
                .iter()
                .map(|b| b[0].clone())
                .collect::<Vec<_>>()
                .join(" / "),
        )
    } else {
        (
            "these bugs at once",
            explained
                .iter()
                .map(|b| b.join(" + "))
                .collect::<Vec<_>>()
                .join(" / "),
        )
    };
    if let Some(f) = out.findings.first_mut().filter(|_| fewest > 0) {
        f.message.push_str(&format!(
            "; the dump matches the routing recomputed with {lead}: {joined}"
        ));
    }
    for b in &explained {
        out.notes.push(match b.len() {
            1 => format!("router bug that explains the dump: {}", b[0]),
            _ => format!(
                "router bugs that together explain the dump: {}",
                b.join(" + ")
            ),
        });
    }
    Ok(())
}

/// The second bug most often found with another: each token's weights sit in other slots than
/// their ids.
const MISALIGNED: &str = "topk_ids and topk_weights misaligned (each token's weights agree as \
                          a set but sit in other slots than their ids: one sorted or permuted \
                          without the other)";

/// The routing of `logits` `[T, E]` with the groups ranked by their best selection score
/// (score + bias), as DeepSeek-V2's group_limited_greedy ranks them, instead of the sum of
/// their two best (V3's noaux_tc); weights as the config gives them.
fn groups_by_max(
    config: &MoeConfig,
    router: &Router,
    logits: &[f32],
    reference: &Routing,
) -> Routing {
    use crate::moe::router::{score, select, weights};
    let (e, k, g) = (config.n_routed_experts, reference.top_k, config.n_group);
    let gsz = e / g;
    let (mut ids, mut w) = (Vec::new(), Vec::new());
    for l in logits.chunks(e).take(reference.tokens) {
        let sc = score(config.scoring_func, l);
        let mut sel: Vec<f32> = match &router.e_score_correction_bias {
            Some(b) => sc.iter().zip(b).map(|(s, b)| s + b).collect(),
            None => sc.clone(),
        };
        let mut best: Vec<(f32, usize)> = (0..g)
            .map(|j| {
                let m = sel[j * gsz..(j + 1) * gsz]
                    .iter()
                    .fold(f32::NEG_INFINITY, |m, &v| m.max(v));
                (m, j)
            })
            .collect();
        best.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        for &(_, j) in &best[config.topk_group..] {
            sel[j * gsz..(j + 1) * gsz].fill(f32::NEG_INFINITY);
        }
        let row = select(&sel, 1, 1, k);
        w.extend(weights(
            &sc,
            &row,
            config.norm_topk_prob,
            config.routed_scaling_factor,
        ));
        ids.extend(row.iter().map(|&i| i as i32));
    }
    Routing {
        topk_ids: ids,
        topk_weights: w,
        ..reference.clone()
    }
}

/// `r` with dump token t holding token t + `s`'s routing (rows rotated by `s` tokens).
fn one_token_off(r: &Routing, s: usize) -> Routing {
    let k = r.top_k;
    let (mut ids, mut w) = (r.topk_ids.clone(), r.topk_weights.clone());
    ids.rotate_left(s * k);
    w.rotate_left(s * k);
    Routing {
        topk_ids: ids,
        topk_weights: w,
        ..r.clone()
    }
}

fn check_logits_shape(d: &RoutingDump, lg: &Matrix<f32>, config: &MoeConfig) -> Result<()> {
    if lg.cols != config.n_routed_experts {
        return Err(Error::bad_tensor(
            &d.path,
            "router_logits",
            format!(
                "has {} experts, n_routed_experts is {}",
                lg.cols, config.n_routed_experts
            ),
        ));
    }
    Ok(())
}

/// A layer holding only the router: routing needs nothing else, and a DeepSeek layer's
/// experts run to gigabytes.
fn router_layer(index: usize, config: MoeConfig, router: Router) -> MoeLayer {
    MoeLayer {
        index,
        config,
        router,
        experts: vec![],
        shared: None,
        norm_weight: None,
    }
}

/// Route from logits through the backend's router: the logits become the "hidden states" of
/// a router whose gate is the identity, so `h · Iᵀ` returns them exactly (one non-zero
/// product per sum) and scoring, bias, grouping, hashing and top-k are the backend's own.
/// The width is padded with zeros to the 16 a hidden size must be a multiple of.
fn route_from_logits(
    backend: &dyn crate::backend::Backend,
    index: usize,
    config: &MoeConfig,
    router: &Router,
    logits: &Matrix<f32>,
    input_ids: Option<&[i64]>,
) -> Result<Routing> {
    let e = config.n_routed_experts;
    let w = e.div_ceil(16) * 16;
    let mut eye = vec![0f32; e * w];
    for i in 0..e {
        eye[i * w + i] = 1.0;
    }
    let mut padded = vec![0f32; logits.rows * w];
    for (dst, src) in padded.chunks_mut(w).zip(logits.data.chunks(e)) {
        dst[..e].copy_from_slice(src);
    }
    let mut cfg = config.clone();
    cfg.hidden_size = w;
    let layer = router_layer(
        index,
        cfg,
        Router {
            weight: eye,
            e_score_correction_bias: router.e_score_correction_bias.clone(),
            tid2eid: router.tid2eid.clone(),
        },
    );
    backend.route(&layer, &padded, input_ids)
}

/// The routers of the MoE layers a layer-index bug would load instead of layer `l`'s: the
/// layers next to it and those `first_k_dense_replace` away (an index counted among MoE layers
/// only); none for a hash layer, whose ids come from its table. Unreadable ones are skipped.
fn neighbour_routers(mc: &MoeCheckpoint, l: usize) -> Vec<(usize, Router)> {
    let c = &mc.config.moe;
    if c.is_hash_layer(l) {
        return vec![];
    }
    let mut out: Vec<(usize, Router)> = vec![];
    for d in [1, c.first_k_dense_replace] {
        for n in [l.checked_sub(d), l.checked_add(d)].into_iter().flatten() {
            if d == 0 || !c.is_moe_layer(n) || out.iter().any(|(m, _)| *m == n) {
                continue;
            }
            if let Ok(r) = read_router(mc, n) {
                out.push((n, r));
            }
        }
    }
    out
}

/// The router of layer `l` (weight, bias, V4 hash table), and nothing else of the layer.
fn read_router(mc: &MoeCheckpoint, l: usize) -> Result<Router> {
    mc.config.check_routable()?;
    let ck = &mc.ckpt;
    let n = &mc.naming;
    let cfg = &mc.config.moe;
    let (e, h) = (cfg.n_routed_experts, cfg.hidden_size);
    let shape_of = |name: &str| ck.info(name).map(|t| t.shape.clone());
    let rw = n.router_weight(l);
    if !ck.contains(&rw) {
        return Err(Error::bad_tensor(
            ck.path(),
            &rw,
            "missing: the router weight of this MoE layer",
        ));
    }
    let s = shape_of(&rw)?;
    if s != [e, h] {
        return Err(Error::bad_tensor(
            ck.file_of(&rw),
            &rw,
            format!("shape {s:?}, expected [n_routed_experts, hidden_size] = [{e}, {h}]"),
        ));
    }
    let weight = ck.to_f32(&rw)?;
    expect_finite(mc, &rw, &weight, h)?;
    let rb = n.router_bias(l);
    let e_score_correction_bias = if ck.contains(&rb) {
        let s = shape_of(&rb)?;
        if s != [e] {
            return Err(Error::bad_tensor(
                ck.file_of(&rb),
                &rb,
                format!("shape {s:?}, expected [{e}]"),
            ));
        }
        let b = ck.to_f32(&rb)?;
        expect_finite(mc, &rb, &b, e)?;
        Some(b)
    } else {
        None
    };
    let tk = n.tid2eid(l);
    let tid2eid = if ck.contains(&tk) {
        let s = shape_of(&tk)?;
        let k = cfg.num_experts_per_tok;
        if s.len() != 2 || s[1] != k {
            return Err(Error::bad_tensor(
                ck.file_of(&tk),
                &tk,
                format!("shape {s:?} is not [vocab, num_experts_per_tok = {k}]"),
            ));
        }
        let t = ck.to_i64(&tk)?;
        if let Some(i) = t.iter().position(|&v| v < 0 || v >= e as i64) {
            return Err(Error::bad_tensor(
                ck.file_of(&tk),
                &tk,
                format!(
                    "entry [{}, {}] = {} is not an expert id in 0..{e}",
                    i / k,
                    i % k,
                    t[i]
                ),
            ));
        }
        Some(t)
    } else {
        None
    };
    Ok(Router {
        weight,
        e_score_correction_bias,
        tid2eid,
    })
}

/// Bad input naming the first NaN/Inf of router tensor `name` (`cols` a row), as `layertest`
/// refuses it: every token's scores would be NaN (weight) or one expert's selection NaN
/// (bias), and no routing of them is right or wrong.
fn expect_finite(mc: &MoeCheckpoint, name: &str, v: &[f32], cols: usize) -> Result<()> {
    let Some(i) = v.iter().position(|x| !x.is_finite()) else {
        return Ok(());
    };
    let at = if v.len() > cols {
        format!("[{}, {}]", i / cols.max(1), i % cols.max(1))
    } else {
        format!("[{i}]")
    };
    Err(Error::bad_tensor(
        mc.ckpt.file_of(name),
        name,
        format!(
            "element {at} is {}: the router cannot select experts on it",
            v[i]
        ),
    ))
}

#[allow(clippy::too_many_arguments)]
fn build_report(
    args: &Args,
    d: &RoutingDump,
    exp: &Expectations,
    ep_rank: Option<usize>,
    ep_size: usize,
    out: Outcome,
    agreements: Vec<Agreement>,
    load: ExpertLoad,
    rank_load: Vec<RankLoad>,
) -> Report {
    let pass = out.findings.is_empty();
    let headline = if pass {
        format!(
            "{} tokens × {} experts: ids, weights{} look right",
            d.tokens,
            d.top_k,
            if agreements.is_empty() {
                ""
            } else {
                " and recomputed routing"
            }
        )
    } else {
        // each kind once (the id checks and the recomputed routing may both name one)
        let mut kinds: Vec<String> = Vec::new();
        for f in &out.findings {
            let k = serde_json::to_value(f.kind)
                .ok()
                .and_then(|v| v.as_str().map(String::from))
                .unwrap_or_default();
            if !kinds.contains(&k) {
                kinds.push(k);
            }
        }
        format!("{} finding(s): {}", out.findings.len(), kinds.join(", "))
    };
    let main_ag = agreements
        .iter()
        .find(|a| a.weights.is_some())
        .or(agreements.first());
    let summary = Summary {
        tokens: d.tokens,
        top_k: d.top_k,
        num_experts: exp.num_experts,
        findings: out.findings.len(),
        ep_rank,
        ep_size,
        match_rate: main_ag.map(|a| a.declared_match_rate),
        best_match_rate: main_ag.map(|a| a.match_rate),
        id_transform: main_ag.map(|a| a.id_transform.clone()),
        weight_rel_l2: main_ag.and_then(|a| a.weights.as_ref()).map(|m| m.rel_l2),
        tokens_accepted_under_ties: main_ag.map(|a| a.tokens_accepted_under_ties),
        unused_experts: load.unused_experts,
        max_over_mean: load.max_over_mean,
    };

    let mut overview = Section::kv(
        "routing dump",
        &[
            ("file", d.path.display().to_string()),
            ("tokens × top_k", format!("{} × {}", d.tokens, d.top_k)),
            ("experts", exp.num_experts.to_string()),
            ("ids", format!("{:?}", args.ids()).to_lowercase()),
            (
                "EP",
                match ep_rank {
                    Some(r) if ep_size > 1 => {
                        format!("rank {r} of {ep_size} ({})", args.placement().name())
                    }
                    _ => "none".into(),
                },
            ),
        ],
    );
    for a in &agreements {
        overview.row(vec![
            format!("vs {}", a.source),
            format!(
                "{:.2}% slots, {:.2}% tokens match ({}{}){}",
                100.0 * a.match_rate,
                100.0 * a.token_match_rate,
                a.id_transform,
                if a.match_rate == a.declared_match_rate {
                    String::new()
                } else {
                    format!(
                        "; {:.2}% of slots as declared",
                        100.0 * a.declared_match_rate
                    )
                },
                a.weights
                    .as_ref()
                    .map(|m| format!("; weights rel_l2 {}", report::e(m.rel_l2)))
                    .unwrap_or_default()
            ) + &match a.tokens_accepted_under_ties {
                0 => String::new(),
                n => format!("; {n} token(s) under exact ties"),
            },
        ]);
    }
    let mut findings = Section::new(
        "findings",
        &["kind", "count", "first (token, slot, id)", "what"],
    );
    for f in &out.findings {
        findings.row(vec![
            serde_json::to_value(f.kind)
                .ok()
                .and_then(|v| v.as_str().map(String::from))
                .unwrap_or_default(),
            f.count.to_string(),
            f.first
                .map(|s| format!("({}, {}, {})", s.token, s.slot, s.id))
                .unwrap_or_else(|| "-".into()),
            wrap(&f.message, 72),
        ]);
    }
    let mut notes = Section::new("notes", &["note"]);
    for n in &out.notes {
        notes.row(vec![wrap(n, 100)]);
    }
    let mut hist = Section::new(
        "expert load (hottest first)",
        &["expert", "slots", "× mean", "bar"],
    );
    let mut order: Vec<usize> = (0..load.counts.len()).collect();
    order.sort_by_key(|&e| (std::cmp::Reverse(load.counts[e]), e));
    let shown = 12.min(order.len());
    for &e in order[..shown].iter().filter(|&&e| load.counts[e] > 0) {
        let c = load.counts[e];
        let rel = if load.mean > 0.0 {
            c as f64 / load.mean
        } else {
            0.0
        };
        let width = (c * 30).checked_div(load.max).unwrap_or(0) as usize;
        hist.row(vec![
            e.to_string(),
            c.to_string(),
            report::f(rel, 2),
            "#".repeat(width),
        ]);
    }
    hist.row(vec![
        "…".into(),
        format!("{} experts unused", load.unused_experts),
        format!("max/mean {}", report::f(load.max_over_mean, 2)),
        format!("{} out of range", load.out_of_range),
    ]);
    let mut ranks = Section::new(
        "EP ranks",
        &["rank", "experts", "slots", "expected (uniform)", "dropped"],
    );
    for l in &rank_load {
        ranks.row(vec![
            l.rank.to_string(),
            l.experts.clone(),
            l.slots.to_string(),
            report::f(l.expected, 1),
            l.dropped.map_or("-".into(), |n| n.to_string()),
        ]);
    }
    let plot = crate::report::svg::Plot {
        title: "expert load".into(),
        x_label: "expert".into(),
        y_label: "slots".into(),
        log_x: false,
        series: vec![crate::report::svg::Series {
            name: "slots".into(),
            points: load
                .counts
                .iter()
                .enumerate()
                .map(|(e, &c)| (e as f64, c as f64))
                .collect(),
        }],
        markers: vec![],
    };

    let mut r = Report::new("routing", Verdict::from_pass(pass), headline)
        .summary(&summary)
        .with("findings", &out.findings)
        .with("notes", &out.notes)
        .with("agreement", &agreements)
        .with("expert_load", &load)
        .with("rank_load", &rank_load)
        .section(overview);
    if !out.findings.is_empty() {
        r = r.section(findings);
    }
    if !out.notes.is_empty() {
        r = r.section(notes);
    }
    r = r.section(hist);
    if !rank_load.is_empty() {
        r = r.section(ranks);
    }
    r.plot("expert_load.svg", plot.render())
}

/// Break a long message into lines of at most `width` characters at spaces (tables stay
/// readable in a terminal).
pub(crate) fn wrap(text: &str, width: usize) -> String {
    let mut out = String::new();
    let mut line = 0usize;
    for word in text.split(' ') {
        let n = word.chars().count();
        if line > 0 && line + 1 + n > width {
            out.push('\n');
            line = 0;
        } else if line > 0 {
            out.push(' ');
            line += 1;
        }
        out.push_str(word);
        line += n;
    }
    out
}
