//! `--kernel builtin|PATH.so` (layertest, gs-sweep, multilayer): the user's MoE kernel, loaded
//! as a plugin of kernels/include/nvfp4dbg_moe.h, run on the same inputs as ours, judged
//! three ways (theirs vs reference, ours vs reference, theirs vs ours), with the likely bug
//! named when theirs deviates.

use super::layertest::{at, KERNEL_CHECK_MAX_MACS};
use crate::backend::cuda::plugin::Plugin;
use crate::backend::cuda::CudaBackend;
use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::moe::byok::{self, Feeding, Judgement, Outputs};
use crate::moe::ep::{ExpertMap, Placement};
use crate::moe::{ActScales, MoeLayer, MoeOutput, Path as MoePath, Routing};
use crate::report::{e, f, Section};
use serde_json::json;
use std::path::PathBuf;

/// Which MoE kernel runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KernelChoice {
    Builtin,
    Plugin(PathBuf),
}

impl std::str::FromStr for KernelChoice {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "" => Err("expected builtin or the path of a plugin .so".into()),
            "builtin" => Ok(KernelChoice::Builtin),
            p => Ok(KernelChoice::Plugin(PathBuf::from(p))),
        }
    }
}

#[derive(clap::Args, Debug, Clone)]
pub struct KernelArgs {
    /// The routed-experts MoE kernel under test: builtin, or a shared library built against
    /// kernels/include/nvfp4dbg_moe.h (see kernels/examples/). A plugin runs on the same inputs
    /// as the built-in kernel (needs --device cuda) and is judged against the BF16 reference
    /// and against the built-in kernel; a plugin that fails, crashes or hangs is exit 2
    #[arg(long, value_name = "builtin|PATH.so", default_value = "builtin")]
    pub kernel: KernelChoice,
}

impl KernelArgs {
    /// Load the plugin (checks its ABI; needs no GPU), or `None` for the built-in kernel.
    pub fn load(&self) -> Result<Option<Plugin>> {
        match &self.kernel {
            KernelChoice::Builtin => Ok(None),
            KernelChoice::Plugin(p) => Plugin::load(p).map(Some),
        }
    }
}

/// The CUDA device a plugin runs on, or a usage error naming the plugin.
pub fn plugin_gpu<'a>(
    plugin: &Plugin,
    cuda: Option<&'a CudaBackend>,
    on: &str,
) -> Result<&'a CudaBackend> {
    cuda.ok_or_else(|| {
        Error::usage(format!(
            "--kernel {}: a plugin is a CUDA kernel and needs a GPU (--device cuda); this run is on {on}. \
             Without a GPU, `layertest --dump-inputs DIR` writes what the kernel receives and \
             `nvfp4dbg compare-outputs DIR OUT.safetensors` judges its output",
            plugin.path.display()
        ))
    })
}

/// The fixed per-expert scales a plugin takes; per-batch dynamic scales have no ABI field.
pub fn fixed_scales(scales: &ActScales) -> Result<(&[f32], &[f32])> {
    match scales {
        ActScales::Fixed { gs1, gs2 } => Ok((gs1, gs2)),
        ActScales::Dynamic => Err(Error::usage(
            "--gs dynamic computes the down projection's global scales per batch inside the \
             kernel; the plugin ABI (and --dump-inputs) takes fixed per-expert scales: pick \
             another --gs",
        )),
    }
}

/// The plugin's routed output: one call, or one call per EP rank (each with its local experts,
/// its expert map and the plugin's id convention, one after the other on this GPU) summed on
/// the host in rank order.
pub fn run_plugin(
    plugin: &Plugin,
    cuda: &CudaBackend,
    layer: &MoeLayer,
    hidden: &[f32],
    routing: &Routing,
    scales: &ActScales,
    ep: Option<(usize, Placement)>,
) -> Result<Vec<f32>> {
    let (gs1, gs2) = fixed_scales(scales)?;
    let gpu = cuda.gpu();
    match ep.filter(|(n, _)| *n > 1) {
        None => plugin.forward(gpu, layer, hidden, routing, gs1, gs2, None),
        Some((n, placement)) => {
            let mut sum = vec![0f32; hidden.len()];
            for map in ExpertMap::all_ranks(layer.config.n_routed_experts, n, placement)? {
                let part = plugin.forward(gpu, layer, hidden, routing, gs1, gs2, Some(&map))?;
                sum.iter_mut().zip(&part).for_each(|(s, p)| *s += p);
            }
            Ok(sum)
        }
    }
}

/// The shared experts' output `[T, H]` (zeros without), added to a routed-only output: the
/// layer's reference forward on `backend` with every routing weight 0 (`0 · y + shared` is
/// `shared` exactly, and on a GPU this costs one reference forward, not a CPU MLP).
pub fn shared_out(
    backend: &dyn Backend,
    layer: &MoeLayer,
    hidden: &[f32],
    routing: &Routing,
) -> Result<Vec<f32>> {
    if layer.shared.is_none() {
        return Ok(vec![0.0; hidden.len()]);
    }
    let mut zero = routing.clone();
    zero.topk_weights.iter_mut().for_each(|w| *w = 0.0);
    Ok(backend
        .moe_forward(layer, hidden, &zero, &MoePath::Reference, false)?
        .out)
}

/// Judge the plugin's routed output. `ours` must carry per-slot rows (the routed part is
/// rebuilt from them bit for bit); the diagnosis runs on the CPU when the layer is small enough.
#[allow(clippy::too_many_arguments)]
pub fn judge_plugin(
    theirs_routed: &[f32],
    ours: &MoeOutput,
    reference: &[f32],
    shared: &[f32],
    layer: &MoeLayer,
    hidden: &[f32],
    routing: &Routing,
    scales: &ActScales,
    feeding: Feeding,
    min_cosine: f64,
) -> Result<(Judgement, Option<String>)> {
    let h = layer.config.hidden_size;
    let ps = ours
        .per_slot
        .as_deref()
        .ok_or_else(|| Error::usage("internal: the built-in run returned no per-slot outputs"))?;
    let ours_routed = byok::routed_sum(ps, routing, h);
    let o = Outputs {
        theirs_routed,
        ours_routed: &ours_routed,
        ours_layer: &ours.out,
        reference_layer: reference,
        shared,
    };
    let first = byok::judge(&o, min_cosine, &[]);
    if first.agree {
        return Ok((first, None));
    }
    let macs = byok::routed_macs(&layer.config, routing);
    if macs > KERNEL_CHECK_MAX_MACS {
        return Ok((
            first,
            Some(format!(
                "diagnosis skipped: {macs:.1e} multiply-adds per CPU variant (limit {KERNEL_CHECK_MAX_MACS:.0e}); use fewer --tokens"
            )),
        ));
    }
    let variants = byok::bug_variants(layer, hidden, routing, scales, feeding)?;
    Ok((byok::judge(&o, min_cosine, &variants), None))
}

/// Where a plugin's routed output deviates from ours, as compare-outputs says it (one
/// expert's, an expert's slot dropped per token, rows scaled per token, rows permuted, rows
/// never written): None when it agrees, or when a known bug already explains it.
pub fn localize_plugin(
    theirs_routed: &[f32],
    ours: &MoeOutput,
    routing: &Routing,
    hidden: usize,
    j: &Judgement,
) -> Option<byok::Localization> {
    if j.agree || j.theirs_vs_ours.passes(byok::AGREE_MIN_COSINE) || j.diagnosis.is_some() {
        return None;
    }
    let ps = ours.per_slot.as_deref()?;
    let ours_routed = byok::routed_sum(ps, routing, hidden);
    let mut l = byok::localize(theirs_routed, &ours_routed, routing, hidden)?;
    byok::name_dropped_slots(&mut l, theirs_routed, &ours_routed, ps, routing, hidden);
    Some(l)
}

/// The three-way table and the suspects.
pub fn sections(j: &Judgement, who: &str, note: Option<&str>, hidden: usize) -> Vec<Section> {
    let row = |name: &str, m: &crate::metrics::Metrics, min: f64, ok: bool| {
        vec![
            name.to_string(),
            f(m.cosine, 6),
            f(m.rel_l2, 4),
            f(m.sqnr_db, 2),
            format!(
                "{} at {}",
                e(m.max_abs_err),
                at(m.max_abs_err_index, hidden)
            ),
            format!("{}/{}", m.nan_count, m.inf_count),
            format!("{min}"),
            if ok { "ok" } else { "FAIL" }.to_string(),
        ]
    };
    let mut s = Section::new(
        format!("Kernel under test: {who} (three-way)"),
        &[
            "comparison",
            "cosine",
            "rel_l2",
            "sqnr_db",
            "max_abs_err",
            "NaN/Inf",
            "min cosine",
            "",
        ],
    );
    s.row(row(
        "theirs vs reference (layer)",
        &j.theirs_vs_reference,
        j.min_cosine,
        j.theirs_pass,
    ));
    s.row(row(
        "ours (builtin) vs reference (layer)",
        &j.ours_vs_reference,
        j.min_cosine,
        j.ours_pass,
    ));
    s.row(row(
        "theirs vs ours (routed experts)",
        &j.theirs_vs_ours,
        j.agree_min_cosine,
        j.agree,
    ));
    let mut out = vec![s];
    if !j.suspects.is_empty() || note.is_some() {
        let mut d = Section::new(
            "Known engine bugs, recomputed on the CPU (theirs vs each variant, routed)",
            &["bug", "cosine", "rel_l2", "explains"],
        );
        for x in &j.suspects {
            d.row(vec![
                x.description.to_string(),
                f(x.cosine, 6),
                f(x.rel_l2, 4),
                if x.explains { "YES" } else { "no" }.to_string(),
            ]);
        }
        if let Some(n) = note {
            d.row(vec![n.to_string(), "-".into(), "-".into(), "-".into()]);
        }
        out.push(d);
    }
    out
}

/// The JSON of a plugin run.
pub fn json(plugin: Option<&Plugin>, j: &Judgement, note: Option<&str>) -> serde_json::Value {
    json!({
        "plugin": plugin.map(|p| json!({
            "path": p.path.display().to_string(),
            "name": p.name,
            "scale_layout": p.scale_layout,
            "id_convention": p.ids,
            "output_dtype": p.output_dtype,
        })),
        "pass": j.pass(),
        "judgement": j,
        "diagnosis": j.diagnosis,
        "diagnosis_note": note,
    })
}

/// The plugin's whole-layer output: its routed sum plus our shared experts (what gs-sweep and
/// multilayer use in place of the built-in layer output).
pub fn plugin_layer(
    plugin: &Plugin,
    cuda: &CudaBackend,
    layer: &MoeLayer,
    hidden: &[f32],
    routing: &Routing,
    scales: &ActScales,
    ep: Option<(usize, Placement)>,
) -> Result<Vec<f32>> {
    let mut out = run_plugin(plugin, cuda, layer, hidden, routing, scales, ep)?;
    let shared = shared_out(cuda, layer, hidden, routing)?;
    out.iter_mut().zip(&shared).for_each(|(o, s)| *o += s);
    Ok(out)
}

/// Load `--kernel` and find the GPU it runs on: `None` for the built-in kernel.
pub fn open<'a>(
    args: &KernelArgs,
    devices: &'a crate::moe::parallel::run::EpDevices,
) -> Result<Option<(Plugin, &'a CudaBackend)>> {
    match args.load()? {
        None => Ok(None),
        Some(p) => {
            let g = plugin_gpu(&p, devices.cuda_main(), &devices.main().name())?;
            Ok(Some((p, g)))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;
    use crate::moe::synthetic::{Preset, SyntheticModel};

    #[test]
    fn shared_out_is_the_shared_mlp_bit_for_bit() {
        let seed: u64 = rand::random();
        let m = SyntheticModel::new(Preset::Tiny, seed);
        let layer = m.moe_layer(1).unwrap();
        let (x, ids) = m.activations(1, 5, seed);
        let r = crate::moe::route(&layer, &x, Some(&ids)).unwrap();
        let got = shared_out(&CpuBackend::new(), &layer, &x, &r).unwrap();
        let mlp = layer.shared.as_ref().expect("tiny has a shared expert");
        let want = crate::moe::forward::dense_forward(mlp, &x, 5, layer.config.hidden_size, None);
        assert_eq!(got.len(), want.len());
        for (j, (a, b)) in got.iter().zip(&want).enumerate() {
            assert_eq!(a.to_bits(), b.to_bits(), "seed {seed} at {j}");
        }
    }

    /// `layertest --kernel` used to fail a plugin that permutes tokens, drops one expert's slot
    /// of a token or scales each token's weights by its own factor with "the bug is in the
    /// kernel under test" only; it now localizes as compare-outputs does (on the CPU here:
    /// the plugin's output is built as such a kernel computes it).
    #[test]
    fn plugin_deviation_is_localized_as_compare_outputs_does() {
        use rand::{Rng, SeedableRng};
        let seed: u64 = rand::random();
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let m = SyntheticModel::new(Preset::Tiny, seed);
        let layer = m.moe_layer(1).unwrap();
        let t = 10;
        let (x, ids) = m.activations(1, t, seed);
        let r = crate::moe::route(&layer, &x, Some(&ids)).unwrap();
        let (h, k, e) = (
            layer.config.hidden_size,
            r.top_k,
            layer.config.n_routed_experts,
        );
        let scales = ActScales::Fixed {
            gs1: vec![crate::nvfp4::GS_DENOM / crate::moe::forward::amax(&x); e],
            gs2: vec![2000.0; e],
        };
        let path = MoePath::Nvfp4 {
            scales: &scales,
            flavor: crate::nvfp4::Flavor::Reference,
        };
        let ours = crate::moe::moe_forward(&layer, &x, &r, &path, true).unwrap();
        let shared = shared_out(&CpuBackend::new(), &layer, &x, &r).unwrap();
        let ps = ours.per_slot.clone().unwrap();
        let routed = byok::routed_sum(&ps, &r, h);
        let feeding = Feeding {
            layout: None,
            ep: None,
        };
        // tokens a and b exchanged; slot s of token a dropped; each token scaled by its own
        let (a, b) = (rng.gen_range(0..t), rng.gen_range(0..t - 1));
        let b = if b >= a { b + 1 } else { b };
        let mut permuted = routed.clone();
        for c in 0..h {
            permuted.swap(a * h + c, b * h + c);
        }
        let slot = a * k + rng.gen_range(0..k);
        let mut dropped_r = r.clone();
        dropped_r.topk_weights[slot] = 0.0;
        let dropped = byok::routed_sum(&ps, &dropped_r, h);
        let mut scaled = routed.clone();
        for row in scaled.chunks_mut(h) {
            let f = rng.gen_range(1.5f32..3.5);
            row.iter_mut().for_each(|v| *v *= f);
        }
        let want_drop = format!("token {a}: expert {}", r.topk_ids[slot]);
        for (name, theirs, want) in [
            ("permuted", &permuted, "tokens permuted".to_string()),
            ("dropped", &dropped, want_drop),
            ("scaled", &scaled, "not renormalized".to_string()),
        ] {
            let (j, _) = judge_plugin(
                theirs, &ours, &ours.out, &shared, &layer, &x, &r, &scales, feeding, 0.5,
            )
            .unwrap();
            assert!(!j.pass(), "seed {seed} {name}");
            let l = localize_plugin(theirs, &ours, &r, h, &j)
                .unwrap_or_else(|| panic!("seed {seed} {name}: not localized"));
            assert!(l.text.contains(&want), "seed {seed} {name}: {}", l.text);
        }
    }

    #[test]
    fn kernel_choice_parses() {
        assert_eq!("builtin".parse::<KernelChoice>(), Ok(KernelChoice::Builtin));
        assert_eq!(
            "./x.so".parse::<KernelChoice>(),
            Ok(KernelChoice::Plugin("./x.so".into()))
        );
        assert!("".parse::<KernelChoice>().is_err());
    }
}
