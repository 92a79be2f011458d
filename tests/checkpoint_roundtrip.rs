//! The checkpoint pieces together, through the public API and the real binary: a BF16 HF
//! DeepSeek directory → `quantize` → `load_moe_layer` gives back exactly the NVFP4 experts
//! `quantize_weight_nvfp4` makes of the originals, the untouched router / shared experts /
//! norm, and `audit` of the result flags what a per-tensor global scale implies for vLLM.

mod checkpoint_util;
use checkpoint_util::*;
use nvfp4dbg::checkpoint::{list_moe_layers, load_moe_layer, Naming, Proj};
use nvfp4dbg::nvfp4::quantize_weight_nvfp4;
use rand::Rng;
use std::collections::BTreeMap;

#[test]
fn bf16_checkpoint_quantize_load_audit() {
    let (seed, mut r) = rng("roundtrip");
    let d = tempfile::tempdir().unwrap();
    let (inp, out) = (d.path().join("bf16"), d.path().join("nvfp4"));
    std::fs::create_dir(&inp).unwrap();
    let (h, i, e, k) = (16 * r.gen_range(2..5), 16 * r.gen_range(1..4), 4, 2);
    let n = Naming::hf_v3();
    let mut tensors = vec![];
    let mut orig: BTreeMap<String, Vec<f32>> = BTreeMap::new();
    for l in 0..2 {
        let mut add = |name: String, shape: &[usize], r: &mut rand_chacha::ChaCha8Rng| {
            let v = weights(
                r,
                shape.iter().product::<usize>() / shape[shape.len() - 1],
                shape[shape.len() - 1],
            );
            tensors.push(bf16(&name, shape, &v));
            orig.insert(name, v);
        };
        add(n.router_weight(l), &[e, h], &mut r);
        add(n.norm(l), &[h], &mut r);
        for p in Proj::ALL {
            let (rows, cols) = if p == Proj::Down { (h, i) } else { (i, h) };
            add(
                format!("{}.weight", n.shared_expert(l, p)),
                &[rows, cols],
                &mut r,
            );
            for x in 0..e {
                add(
                    format!("{}.weight", n.expert(l, x, p)),
                    &[rows, cols],
                    &mut r,
                );
            }
        }
    }
    write(&inp.join("model.safetensors"), tensors);
    let mut cfg = config_json(h, i, e, k, 2);
    cfg["n_group"] = 2.into();
    cfg["n_shared_experts"] = 1.into();
    std::fs::write(inp.join("config.json"), cfg.to_string()).unwrap();

    let o = run(&[
        "quantize",
        p(&inp),
        p(&out),
        "--exclude",
        "mlp.gate.",
        "--exclude",
        "shared_experts",
    ]);
    assert_eq!(code(&o), 0, "seed {seed}: {}", stderr(&o));
    assert_eq!(list_moe_layers(&out).unwrap(), vec![0, 1]);
    for l in 0..2 {
        let layer = load_moe_layer(&out, l).unwrap();
        assert_eq!(layer.config.n_routed_experts, e);
        assert_eq!(
            layer.router.weight,
            orig[&n.router_weight(l)],
            "seed {seed}: router copied as is"
        );
        assert_eq!(layer.norm_weight.as_ref(), Some(&orig[&n.norm(l)]));
        let s = layer.shared.as_ref().unwrap();
        assert_eq!(
            s.w2,
            orig[&format!("{}.weight", n.shared_expert(l, Proj::Down))]
        );
        for (x, ex) in layer.experts.iter().enumerate() {
            for (p, q) in [
                (Proj::Gate, &ex.w1),
                (Proj::Up, &ex.w3),
                (Proj::Down, &ex.w2),
            ] {
                let w = &orig[&format!("{}.weight", n.expert(l, x, p))];
                let (want, _) = quantize_weight_nvfp4(w, q.out_features(), q.in_features());
                assert_eq!(q.weight, want, "seed {seed}: layer {l} expert {x} {p:?}");
                assert!(q.input_scale.is_none() && q.original.is_none());
            }
        }
    }
    // the BF16 directory itself loads too: its experts are quantized on the fly, identically
    let layer = load_moe_layer(&inp, 1).unwrap();
    let w = &orig[&format!("{}.weight", n.expert(1, 2, Proj::Up))];
    assert_eq!(layer.experts[2].w3.original.as_ref(), Some(w));
    assert_eq!(layer.experts[2].w3.weight, quantize_weight_nvfp4(w, i, h).0);

    // per-tensor global scales: gate and up of an expert differ, which vLLM's fused w13 cannot
    // represent, and audit says so; nothing else is wrong (config_json leaves topk_method to
    // the engines' defaults: a warning, not an error)
    let json = d.path().join("audit.json");
    let o = run(&["audit", p(&out), "--json", p(&json)]);
    assert_eq!(code(&o), 1, "seed {seed}: {}", stdout(&o));
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let kinds: Vec<&str> = v["findings"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["severity"] == "error")
        .map(|f| f["kind"].as_str().unwrap())
        .collect();
    assert!(
        !kinds.is_empty() && kinds.iter().all(|&k| k == "gate_up_scale_mismatch"),
        "{kinds:?}"
    );
}
