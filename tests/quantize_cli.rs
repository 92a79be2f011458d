//! `nvfp4dbg quantize` on files and HF directories: what gets quantized, what is copied, the
//! mirrored shards + index + config.json, the report, and refusals.

mod checkpoint_util;
use checkpoint_util::*;
use nvfp4dbg::checkpoint::formats::read_qlinear;
use nvfp4dbg::checkpoint::writer::TensorSpec;
use nvfp4dbg::checkpoint::{Checkpoint, Dtype, TensorFile, TensorSource};
use nvfp4dbg::nvfp4::{quantize_nvfp4, quantize_weight_nvfp4, weight_global_scale};
use rand::Rng;

#[test]
fn hf_directory_is_mirrored() {
    let (seed, mut r) = rng("quantize dir");
    let d = tempfile::tempdir().unwrap();
    let (inp, out) = (d.path().join("in"), d.path().join("out"));
    std::fs::create_dir(&inp).unwrap();
    let (h, i) = (16 * r.gen_range(1..5), 16 * r.gen_range(1..4));
    let w1 = weights(&mut r, i, h);
    let w2 = weights(&mut r, h, i);
    let gate = weights(&mut r, 4, h);
    let norm = weights(&mut r, 1, h);
    let odd = weights(&mut r, 3, 24);
    write(
        &inp.join("model-00001-of-00002.safetensors"),
        vec![
            bf16(
                "model.layers.0.mlp.experts.0.gate_proj.weight",
                &[i, h],
                &w1,
            ),
            bf16("model.layers.0.mlp.gate.weight", &[4, h], &gate),
            bf16(
                "model.layers.0.post_attention_layernorm.weight",
                &[h],
                &norm,
            ),
        ],
    );
    write(
        &inp.join("model-00002-of-00002.safetensors"),
        vec![
            f32t(
                "model.layers.0.mlp.experts.0.down_proj.weight",
                &[h, i],
                &w2,
            ),
            bf16("model.embed.odd.weight", &[3, 24], &odd),
        ],
    );
    let index = serde_json::json!({"metadata": {"total_size": 1}, "weight_map": {
        "model.layers.0.mlp.experts.0.gate_proj.weight": "model-00001-of-00002.safetensors",
        "model.layers.0.mlp.gate.weight": "model-00001-of-00002.safetensors",
        "model.layers.0.post_attention_layernorm.weight": "model-00001-of-00002.safetensors",
        "model.layers.0.mlp.experts.0.down_proj.weight": "model-00002-of-00002.safetensors",
        "model.embed.odd.weight": "model-00002-of-00002.safetensors"}});
    std::fs::write(inp.join("model.safetensors.index.json"), index.to_string()).unwrap();
    std::fs::write(
        inp.join("config.json"),
        config_json(h, i, 4, 2, 1).to_string(),
    )
    .unwrap();
    std::fs::write(inp.join("tokenizer.json"), b"{\"tok\": 1}").unwrap();
    let before = snapshot(&inp);
    let json = d.path().join("r.json");
    let o = run(&[
        "quantize",
        p(&inp),
        p(&out),
        "--exclude",
        "mlp.gate.",
        "--json",
        p(&json),
    ]);
    assert_eq!(code(&o), 0, "seed {seed}: {}", stderr(&o));
    assert_eq!(snapshot(&inp), before, "input untouched");
    assert!(!stderr(&o).contains("panicked"));

    let c = Checkpoint::open(&out).unwrap();
    assert!(c.index_path().is_some());
    assert_eq!(c.shards().len(), 2);
    let q = read_qlinear(&c, "model.layers.0.mlp.experts.0.gate_proj").unwrap();
    assert_eq!(q.weight, quantize_weight_nvfp4(&w1, i, h).0, "seed {seed}");
    let q = read_qlinear(&c, "model.layers.0.mlp.experts.0.down_proj").unwrap();
    assert_eq!(q.weight, quantize_weight_nvfp4(&w2, h, i).0, "seed {seed}");
    assert!(c
        .file_of("model.layers.0.mlp.experts.0.down_proj.weight_scale")
        .ends_with("model-00002-of-00002.safetensors"));
    // excluded, 1-D and K % 16 != 0 tensors are copied byte for byte
    let src = Checkpoint::open(&inp).unwrap();
    for n in [
        "model.layers.0.mlp.gate.weight",
        "model.layers.0.post_attention_layernorm.weight",
        "model.embed.odd.weight",
    ] {
        assert_eq!(c.bytes(n).unwrap(), src.bytes(n).unwrap(), "{n}");
        let (a, b) = (c.info(n).unwrap(), src.info(n).unwrap());
        assert_eq!((a.dtype, &a.shape), (b.dtype, &b.shape), "{n}");
    }
    assert_eq!(
        c.info("model.layers.0.mlp.experts.0.gate_proj.weight")
            .unwrap()
            .dtype,
        Dtype::U8
    );
    // the index lists every output tensor, total_size is the data size
    let ix: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("model.safetensors.index.json")).unwrap())
            .unwrap();
    assert_eq!(
        ix["weight_map"].as_object().unwrap().len(),
        c.names().count()
    );
    let data: usize = c.names().map(|n| c.info(n).unwrap().nbytes()).sum();
    assert_eq!(ix["metadata"]["total_size"].as_u64(), Some(data as u64));
    let cfg = c.config().unwrap();
    let qc = cfg.quant.unwrap();
    assert_eq!(qc.algo.as_deref(), Some("NVFP4"));
    // engines read exclude_modules as module names / whole-name globs, never as substrings:
    // the exact modules of the float weight matrices left unquantized (--exclude'd, K % 16 != 0)
    let want = vec![
        "model.embed.odd".to_string(),
        "model.layers.0.mlp.gate".to_string(),
    ];
    assert_eq!(qc.exclude_modules, want, "seed {seed}");
    assert_eq!(exclude_lists(&out), (want.clone(), want), "seed {seed}");
    let help = std::process::Command::new(bin())
        .args(["quantize", "--help"])
        .output()
        .unwrap();
    let help = stdout(&help)
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    assert!(
        help.contains("exclude_modules") && help.contains("exact module names"),
        "{help}"
    );
    assert_eq!(
        std::fs::read(out.join("tokenizer.json")).unwrap(),
        b"{\"tok\": 1}"
    );
    let rep: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(rep["command"], "quantize");
    assert_eq!(rep["verdict"], "pass");
    assert_eq!(rep["summary"]["quantized"], 2);
    assert_eq!(rep["summary"]["copied"], 3);
    assert_eq!(rep["tensors"].as_array().unwrap().len(), 2);
}

#[test]
fn explicit_gs_and_single_files() {
    let (seed, mut r) = rng("quantize --gs");
    let d = tempfile::tempdir().unwrap();
    let (inp, out) = (
        d.path().join("a.safetensors"),
        d.path().join("b.safetensors"),
    );
    let (rows, cols) = (r.gen_range(1..40), 16 * r.gen_range(1..10));
    let w = weights(&mut r, rows, cols);
    write(&inp, vec![bf16("x.weight", &[rows, cols], &w)]);
    let gs = r.gen_range(1..100_000) as f32 / 8.0;
    let o = run(&["quantize", p(&inp), p(&out), "--gs", &gs.to_string()]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let f = TensorFile::open(&out).unwrap();
    let q = read_qlinear(&f, "x").unwrap();
    let (want, _) = quantize_nvfp4(&w, rows, cols, gs);
    assert_eq!(
        (q.weight.packed, q.weight.scales),
        (want.packed, want.scales),
        "seed {seed}"
    );
    assert_eq!(f.scalar_f32("x.weight_scale_2").unwrap(), 1.0 / gs);
    assert!(stdout(&o).contains("PASS"), "{}", stdout(&o));
    // mxfp4: E8M0 scales of 32, no global scale
    let o = run(&["quantize", p(&inp), p(&out), "--format", "mxfp4"]);
    if cols.is_multiple_of(32) {
        assert_eq!(code(&o), 0, "{}", stderr(&o));
        let f = TensorFile::open(&out).unwrap();
        assert_eq!(f.info("x.weight_scale").unwrap().dtype, Dtype::F8_E8M0);
        assert!(!f.contains("x.weight_scale_2"));
    }
}

#[test]
fn refusals_exit_2_and_write_nothing() {
    let (_, mut r) = rng("quantize refusals");
    let d = tempfile::tempdir().unwrap();
    let inp = d.path().join("a.safetensors");
    let mut w = weights(&mut r, 4, 32);
    let at = r.gen_range(0..w.len());
    w[at] = f32::NAN;
    write(&inp, vec![bf16("model.x.weight", &[4, 32], &w)]);
    let out = d.path().join("o.safetensors");
    let o = run(&["quantize", p(&inp), p(&out)]);
    assert_eq!(code(&o), 2);
    let e = stderr(&o);
    assert!(
        e.contains("a.safetensors") && e.contains("model.x.weight") && e.contains("NaN"),
        "{e}"
    );
    assert!(
        !out.exists() && std::fs::read_dir(d.path()).unwrap().count() == 1,
        "nothing written"
    );

    // a name the output would write twice
    let w = weights(&mut r, 4, 32);
    write(
        &inp,
        vec![
            bf16("y.weight", &[4, 32], &w),
            f32t("y.weight_scale_2", &[], &[1.0]),
        ],
    );
    let o = run(&["quantize", p(&inp), p(&out)]);
    assert_eq!(code(&o), 2);
    assert!(stderr(&o).contains("y.weight_scale_2"), "{}", stderr(&o));

    // OUT = IN, bad --gs, --gs with mxfp4
    let dir = d.path().join("dir");
    std::fs::create_dir(&dir).unwrap();
    write(
        &dir.join("model.safetensors"),
        vec![bf16("z.weight", &[4, 32], &w)],
    );
    for args in [
        vec!["quantize", p(&dir), p(&dir)],
        vec!["quantize", p(&inp), p(&inp)],
        vec!["quantize", p(&dir), p(&inp)],
        vec!["quantize", p(&inp), p(&out), "--gs", "0"],
        vec!["quantize", p(&inp), p(&out), "--gs", "inf"],
        // an unset shell variable: it would exclude every tensor and quantize nothing
        vec!["quantize", p(&inp), p(&out), "--exclude", ""],
        vec![
            "quantize",
            p(&inp),
            p(&out),
            "--gs",
            "2",
            "--format",
            "mxfp4",
        ],
    ] {
        let before = snapshot(d.path());
        let o = run(&args);
        assert_eq!(code(&o), 2, "{args:?}: {}", stderr(&o));
        assert!(!stderr(&o).contains("panicked"));
        assert_eq!(snapshot(d.path()), before, "{args:?} wrote something");
    }
}

/// A weight matrix in a dtype quantize cannot read (I32, F64) is refused, naming file, tensor
/// and dtype, unless --exclude keeps it (then its module is in exclude_modules); the packed
/// U8 weight of an already quantized linear is still copied.
#[test]
fn weight_matrices_it_cannot_read_are_refused_unless_excluded() {
    let (_, mut r) = rng("quantize non-float");
    let d = tempfile::tempdir().unwrap();
    let w = weights(&mut r, 8, 32);
    let q: Vec<u8> = (0..8 * 16).map(|_| r.gen()).collect();
    let sc: Vec<u8> = (0..8 * 2).map(|_| r.gen_range(0x30..0x50)).collect();
    for (dtype, bytes) in [
        (Dtype::I32, vec![7u8; 8 * 32 * 4]),
        (Dtype::F64, vec![0x3Fu8; 8 * 32 * 8]),
    ] {
        let inp = d.path().join(format!("{dtype:?}.safetensors"));
        write(
            &inp,
            vec![
                bf16("model.a.weight", &[8, 32], &w),
                (TensorSpec::new("model.b.weight", dtype, &[8, 32]), bytes),
                (
                    TensorSpec::new("model.c.weight", Dtype::U8, &[8, 16]),
                    q.clone(),
                ),
                (
                    TensorSpec::new("model.c.weight_scale", Dtype::F8_E4M3, &[8, 2]),
                    sc.clone(),
                ),
                f32t("model.c.weight_scale_2", &[], &[1e-3]),
            ],
        );
        let out = d.path().join("o.safetensors");
        let o = run(&["quantize", p(&inp), p(&out)]);
        assert_eq!(code(&o), 2, "{dtype:?}: {}", stderr(&o));
        let e = stderr(&o);
        assert!(
            e.contains(&format!("{dtype:?}.safetensors"))
                && e.contains("model.b.weight")
                && e.contains(&format!("{dtype:?}"))
                && !e.contains("panicked"),
            "{e}"
        );
        assert!(!out.exists());
        let o = run(&["quantize", p(&inp), p(&out), "--exclude", "model.b."]);
        assert_eq!(code(&o), 0, "{dtype:?}: {}", stderr(&o));
        let f = TensorFile::open(&out).unwrap();
        assert_eq!(f.info("model.b.weight").unwrap().dtype, dtype);
        assert_eq!(f.info("model.c.weight").unwrap().dtype, Dtype::U8);
        assert_eq!(f.info("model.a.weight").unwrap().dtype, Dtype::U8);
        std::fs::remove_file(&out).unwrap();
    }
}

/// Float weight matrices whose shape does not quantize (K not a multiple of 16, 3-D) are
/// copied, and the report says which and why instead of a bare "copied N".
#[test]
fn float_weights_left_unquantized_are_named() {
    let (seed, mut r) = rng("quantize unquantizable shapes");
    let d = tempfile::tempdir().unwrap();
    let (inp, out) = (
        d.path().join("a.safetensors"),
        d.path().join("b.safetensors"),
    );
    let rows = r.gen_range(1..20);
    let odd_k = 16 * r.gen_range(1..6) + r.gen_range(1..16);
    let good_k = 16 * r.gen_range(1..6);
    write(
        &inp,
        vec![
            bf16(
                "m.odd.weight",
                &[rows, odd_k],
                &weights(&mut r, rows, odd_k),
            ),
            bf16(
                "m.fused.weight",
                &[2, rows, good_k],
                &weights(&mut r, 2 * rows, good_k),
            ),
            bf16("m.norm.weight", &[good_k], &vec![1.0; good_k]),
            bf16(
                "m.ok.weight",
                &[rows, good_k],
                &weights(&mut r, rows, good_k),
            ),
            bf16(
                "lm_head.weight",
                &[rows, odd_k],
                &weights(&mut r, rows, odd_k),
            ),
        ],
    );
    let json = d.path().join("r.json");
    let o = run(&[
        "quantize",
        p(&inp),
        p(&out),
        "--exclude",
        "lm_head",
        "--json",
        p(&json),
    ]);
    assert_eq!(code(&o), 0, "seed {seed}: {}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(v["summary"]["quantized"], 1, "seed {seed}");
    let mut nq: Vec<(String, String)> = v["not_quantized"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| {
            (
                x["name"].as_str().unwrap().to_string(),
                x["reason"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    nq.sort();
    // the 1-D norm and the --exclude'd head are not news
    assert_eq!(nq.len(), 2, "seed {seed}: {nq:?}");
    assert!(
        nq[0].0 == "m.fused.weight" && nq[0].1.contains("3-D"),
        "seed {seed}: {nq:?}"
    );
    assert!(
        nq[1].0 == "m.odd.weight" && nq[1].1.contains(&format!("K = {odd_k}")),
        "seed {seed}: {nq:?}"
    );
    assert!(stdout(&o).contains("m.odd.weight"), "{}", stdout(&o));
}

/// An input that is already an NVFP4 checkpoint (synth's, HF and native V4 names, plus a BF16
/// attention projection its `*.self_attn.*` / `*.attn.*` entry covers): the float linears its
/// quantization_config excludes are copied, not quantized, already-quantized tensors are
/// copied byte for byte, the input's exclude list stays in the output's with the exact modules
/// kept, the report counts them, and the output audits clean.
#[test]
fn quantized_input_keeps_its_exclude_list() {
    let (seed, mut r) = rng("quantize a quantized checkpoint");
    let d = tempfile::tempdir().unwrap();
    for (preset, attn) in [
        ("tiny", "model.layers.1.self_attn.o_proj.weight"),
        ("tiny-v4", "layers.1.attn.wo.weight"),
    ] {
        let (inp, out) = (d.path().join(preset), d.path().join(format!("{preset}-q")));
        synth(&inp, r.gen(), &["--preset", preset, "--no-originals"]);
        let h = 256;
        add_shard(
            &inp,
            "attention.safetensors",
            vec![bf16(attn, &[h, h], &weights(&mut r, h, h))],
        );
        let (entries, _) = exclude_lists(&inp);
        let src = Checkpoint::open(&inp).unwrap();
        let kept: Vec<&str> = src
            .names()
            .filter(|n| n.ends_with(".weight"))
            .filter(|n| {
                let t = src.info(n).unwrap();
                t.dtype == Dtype::BF16 && t.shape.len() == 2
            })
            .collect();
        assert!(kept.len() > 4 && kept.contains(&attn), "{preset}: {kept:?}");
        let json = d.path().join(format!("{preset}.json"));
        let o = run(&["quantize", p(&inp), p(&out), "--json", p(&json)]);
        assert_eq!(code(&o), 0, "seed {seed} {preset}: {}", stderr(&o));
        let c = Checkpoint::open(&out).unwrap();
        assert_eq!(
            c.names().count(),
            src.names().count(),
            "seed {seed} {preset}"
        );
        for n in src.names() {
            let (a, b) = (c.info(n).unwrap(), src.info(n).unwrap());
            assert_eq!((a.dtype, &a.shape), (b.dtype, &b.shape), "seed {seed} {n}");
            assert!(
                c.bytes(n).unwrap() == src.bytes(n).unwrap(),
                "seed {seed}: {n} not copied byte for byte"
            );
        }
        let rep: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
        assert_eq!(rep["summary"]["quantized"], 0, "seed {seed} {preset}");
        assert_eq!(
            rep["summary"]["excluded_by_input_config"],
            kept.len(),
            "seed {seed} {preset}"
        );
        let mut want: Vec<String> = kept
            .iter()
            .map(|n| n.trim_end_matches(".weight").to_string())
            .chain(entries)
            .collect();
        want.sort();
        want.dedup();
        assert_eq!(
            exclude_lists(&out),
            (want.clone(), want),
            "seed {seed} {preset}"
        );
        let o = run(&["audit", p(&out)]);
        assert_eq!(code(&o), 0, "seed {seed} {preset}: {}", stdout(&o));
    }
}

/// A weight whose amax is nonzero but so small that amax/2688 has no normal f32 (BF16 values
/// of random sign and magnitude 1e-38..1e-36) would get the all-zero fallback scale and
/// all-zero codes; at 1e-35..3e-35 a subnormal weight_scale_2. Both are refused like a NaN,
/// naming the file, the tensor and its amax; --exclude keeps it as it is, and an all-zero
/// tensor still quantizes (finite scales, DESIGN §2).
#[test]
fn weights_too_small_for_their_own_scale_are_refused() {
    let (seed, mut r) = rng("quantize tiny amax");
    let d = tempfile::tempdir().unwrap();
    let (inp, out) = (
        d.path().join("a.safetensors"),
        d.path().join("b.safetensors"),
    );
    let (rows, cols) = (r.gen_range(1..20), 16 * r.gen_range(1..8));
    let name = "model.layers.0.mlp.experts.3.down_proj.weight";
    let mut tensors = vec![];
    for (exponents, says) in [
        (-38.0f32..-36.0, "every code would be zero"),
        (-35.0..3e-35f32.log10(), "would be subnormal"),
    ] {
        let tiny: Vec<f32> = (0..rows * cols)
            .map(|_| {
                let m = 10f32.powf(r.gen_range(exponents.clone()));
                let v = half::bf16::from_f32(if r.gen() { m } else { -m }).to_f32();
                assert!(v != 0.0, "seed {seed}");
                v
            })
            .collect();
        let amax = tiny.iter().fold(0f32, |m, v| m.max(v.abs()));
        tensors = vec![
            bf16(
                "model.a.weight",
                &[rows, cols],
                &weights(&mut r, rows, cols),
            ),
            bf16(
                "model.b.weight",
                &[rows, cols],
                &weights(&mut r, rows, cols),
            ),
        ];
        tensors.insert(r.gen_range(0..=2), bf16(name, &[rows, cols], &tiny));
        write(&inp, tensors.clone());
        let o = run(&["quantize", p(&inp), p(&out)]);
        assert_eq!(code(&o), 2, "seed {seed} {says}: {}", stderr(&o));
        let e = stderr(&o);
        for want in [
            "a.safetensors",
            name,
            &format!("amax {amax:e}"),
            says,
            "--exclude",
        ] {
            assert!(e.contains(want), "seed {seed}: no {want:?} in {e}");
        }
        assert!(!out.exists(), "seed {seed}: nothing written");
    }
    let o = run(&["quantize", p(&inp), p(&out), "--exclude", name]);
    assert_eq!(code(&o), 0, "seed {seed}: {}", stderr(&o));
    let (f, src) = (
        TensorFile::open(&out).unwrap(),
        TensorFile::open(&inp).unwrap(),
    );
    assert!(
        f.bytes(name).unwrap() == src.bytes(name).unwrap(),
        "seed {seed}: the --exclude'd tensor is copied"
    );
    assert_eq!(f.info("model.a.weight").unwrap().dtype, Dtype::U8);
    // the refusal is for tiny nonzero values only: the same tensor all zero quantizes
    for t in tensors.iter_mut().filter(|t| t.0.name == name) {
        t.1.iter_mut().for_each(|b| *b = 0);
    }
    write(&inp, tensors);
    let o = run(&["quantize", p(&inp), p(&out)]);
    assert_eq!(code(&o), 0, "seed {seed}: {}", stderr(&o));
    let f = TensorFile::open(&out).unwrap();
    let ws2 = f
        .scalar_f32(&name.replace(".weight", ".weight_scale_2"))
        .unwrap();
    assert!(ws2.is_normal(), "seed {seed}: {ws2}");
}

/// Guards: a --gs in the dequant direction (weight_scale_2 = amax/2688 passed as gs) flushed every
/// block of the weight to zero and the run passed (exit 0) with all-zero codes written.
#[test]
fn a_gs_that_flushes_every_block_is_refused() {
    let (seed, mut r) = rng("quantize --gs flushing everything");
    let d = tempfile::tempdir().unwrap();
    let (inp, out) = (
        d.path().join("a.safetensors"),
        d.path().join("b.safetensors"),
    );
    let (rows, cols) = (r.gen_range(1..20), 16 * r.gen_range(1..8));
    let name = "model.layers.1.mlp.experts.2.up_proj.weight";
    // a weight's amax (below ~3.9: above it, amax²/16128 rounds to a nonzero E4M3 scale
    // and the weight_scale_2-sized gs does not flush every block)
    let w = weights(&mut r, rows, cols);
    let target = r.gen_range(0.02f32..2.0) / w.iter().fold(0f32, |m, v| m.max(v.abs()));
    let w: Vec<f32> = w.iter().map(|v| v * target).collect();
    let amax = w.iter().fold(0f32, |m, v| m.max(v.abs()));
    write(&inp, vec![bf16(name, &[rows, cols], &w)]);
    let ws2 = amax / 2688.0;
    let o = run(&["quantize", p(&inp), p(&out), "--gs", &ws2.to_string()]);
    assert_eq!(code(&o), 2, "seed {seed}: {}", stdout(&o));
    let e = stderr(&o);
    for want in ["a.safetensors", name, "every code", "--exclude"] {
        assert!(e.contains(want), "seed {seed}: no {want:?} in {e}");
    }
    assert!(!out.exists(), "seed {seed}: nothing written");
    // the quant direction, 1/weight_scale_2, quantizes
    let o = run(&[
        "quantize",
        p(&inp),
        p(&out),
        "--gs",
        &(1.0 / ws2).to_string(),
    ]);
    assert_eq!(code(&o), 0, "seed {seed}: {}", stderr(&o));
}

/// Without --exclude, what engines never quantize (the embedding, lm_head, the MoE router's
/// gate, MTP's eh_proj) is copied byte for byte and named in exclude_modules, while the other
/// linears are quantized. All were quantized, and engines then load packed codes into a BF16
/// embedding or router.
#[test]
fn what_engines_never_quantize_is_copied_and_excluded() {
    let (seed, mut r) = rng("quantize never-quantized modules");
    let d = tempfile::tempdir().unwrap();
    let (inp, out) = (d.path().join("in"), d.path().join("out"));
    std::fs::create_dir(&inp).unwrap();
    let (h, i, e, v) = (
        16 * r.gen_range(2..5),
        16 * r.gen_range(1..4),
        4 * r.gen_range(1..3),
        16 * r.gen_range(2..4),
    );
    let kept = [
        ("model.embed_tokens", v, h),
        ("lm_head", v, h),
        ("model.layers.1.mlp.gate", e, h),
        ("model.layers.2.eh_proj", h, 2 * h),
    ];
    let quantized = [
        ("model.layers.1.self_attn.q_a_proj", 2 * i, h),
        ("model.layers.1.mlp.experts.0.gate_proj", i, h),
    ];
    let mut tensors = vec![];
    for &(m, rows, cols) in kept.iter().chain(&quantized) {
        tensors.push(bf16(
            &format!("{m}.weight"),
            &[rows, cols],
            &weights(&mut r, rows, cols),
        ));
    }
    write(&inp.join("model.safetensors"), tensors);
    std::fs::write(
        inp.join("config.json"),
        config_json(h, i, e, 2, 3).to_string(),
    )
    .unwrap();
    let json = d.path().join("r.json");
    let o = run(&["quantize", p(&inp), p(&out), "--json", p(&json)]);
    assert_eq!(code(&o), 0, "seed {seed}: {}", stderr(&o));
    let (src, c) = (
        Checkpoint::open(&inp).unwrap(),
        Checkpoint::open(&out).unwrap(),
    );
    for (m, _, _) in kept {
        let n = format!("{m}.weight");
        assert_eq!(
            c.bytes(&n).unwrap(),
            src.bytes(&n).unwrap(),
            "seed {seed}: {n}"
        );
        assert_eq!(c.info(&n).unwrap().dtype, Dtype::BF16, "seed {seed}: {n}");
        assert!(!c.names().any(|x| x == format!("{m}.weight_scale")), "{m}");
    }
    for (m, _, _) in quantized {
        assert_eq!(
            c.info(&format!("{m}.weight")).unwrap().dtype,
            Dtype::U8,
            "seed {seed}: {m}"
        );
    }
    let mut want: Vec<String> = kept.iter().map(|k| k.0.to_string()).collect();
    want.sort();
    assert_eq!(exclude_lists(&out), (want.clone(), want), "seed {seed}");
    let rep: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(rep["summary"]["never_quantized"], 4, "seed {seed}");
    assert_eq!(rep["summary"]["quantized"], 2, "seed {seed}");
}

/// A directory quantize refuses partway (a NaN in a weight of its last shard) leaves OUT as
/// it was, byte for byte: no shard of this run under its final name, no temporary left, and a
/// previous checkpoint in OUT (config.json, index, hf_quant_config.json, shards) intact. The
/// shards are written under temporary names and renamed only once every one of them is done.
#[test]
fn a_refused_directory_leaves_out_as_it_was() {
    let (seed, mut r) = rng("quantize all or nothing");
    let d = tempfile::tempdir().unwrap();
    let inp = d.path().join("in");
    std::fs::create_dir(&inp).unwrap();
    let (h, i) = (16 * r.gen_range(1..5), 16 * r.gen_range(1..4));
    let mut map = serde_json::Map::new();
    let mut shards = vec![];
    for s in 0..3 {
        let file = format!("model-{:05}-of-00003.safetensors", s + 1);
        let mut tensors = vec![];
        for (proj, rows, cols) in [("gate_proj", i, h), ("up_proj", i, h), ("down_proj", h, i)] {
            let name = format!("model.layers.{s}.mlp.experts.0.{proj}.weight");
            map.insert(name.clone(), file.clone().into());
            tensors.push((name, [rows, cols], weights(&mut r, rows, cols)));
        }
        shards.push((file, tensors));
    }
    // (file, [(tensor, shape, values)])
    type Shard = (String, Vec<(String, [usize; 2], Vec<f32>)>);
    let write_shards = |shards: &[Shard]| {
        for (file, tensors) in shards {
            write(
                &inp.join(file),
                tensors.iter().map(|(n, s, v)| bf16(n, s, v)).collect(),
            );
        }
    };
    write_shards(&shards);
    let index = serde_json::json!({"metadata": {"total_size": 1}, "weight_map": map});
    std::fs::write(inp.join("model.safetensors.index.json"), index.to_string()).unwrap();
    std::fs::write(
        inp.join("config.json"),
        config_json(h, i, 4, 2, 3).to_string(),
    )
    .unwrap();
    std::fs::write(inp.join("tokenizer.json"), b"{\"tok\": 2}").unwrap();
    // a previous good output (another --gs, so its shards differ from this run's)
    let previous = d.path().join("previous");
    let gs = r.gen_range(100..5000).to_string();
    let o = run(&["quantize", p(&inp), p(&previous), "--gs", &gs]);
    assert_eq!(code(&o), 0, "seed {seed}: {}", stderr(&o));
    // a NaN in one weight of the last shard
    let (file, tensors) = &mut shards[2];
    let t = r.gen_range(0..tensors.len());
    let (name, _, v) = &mut tensors[t];
    let at = r.gen_range(0..v.len());
    v[at] = f32::NAN;
    let (file, name) = (file.clone(), name.clone());
    write_shards(&shards);
    let input = snapshot(&inp);
    for case in ["missing", "empty", "previous output"] {
        let out = d.path().join(case.replace(' ', "-"));
        match case {
            "missing" => {}
            "empty" => std::fs::create_dir(&out).unwrap(),
            _ => {
                std::fs::create_dir(&out).unwrap();
                for (from, bytes) in snapshot(&previous) {
                    let rel = from.strip_prefix(&previous).unwrap();
                    std::fs::write(out.join(rel), bytes).unwrap();
                }
            }
        }
        let before = out.exists().then(|| snapshot(&out));
        let o = run(&["quantize", p(&inp), p(&out)]);
        assert_eq!(code(&o), 2, "seed {seed} {case}: {}", stderr(&o));
        let e = stderr(&o);
        assert!(
            e.contains(&file) && e.contains(&name) && e.contains("NaN"),
            "seed {seed} {case}: {e}"
        );
        assert!(!e.contains("panicked"), "seed {seed} {case}: {e}");
        match before {
            None => assert!(!out.exists(), "seed {seed}: OUT created by a refused run"),
            Some(b) => {
                let now = snapshot(&out);
                let names: Vec<_> = now.iter().map(|(p, _)| p.display().to_string()).collect();
                assert!(
                    now == b,
                    "seed {seed} {case}: OUT changed by a refused run; now {names:#?}"
                );
            }
        }
        assert_eq!(snapshot(&inp), input, "seed {seed}: input untouched");
    }
}

/// An input holding compressed-tensors NVFP4 linears (llm-compressor's `weight_packed` and
/// reciprocal `weight_global_scale`) is refused before anything is written: quantize would
/// copy them under those names next to a ModelOpt quantization_config, a checkpoint no engine
/// loads. The message names the file, one such tensor and what to quantize instead.
#[test]
fn compressed_tensors_input_is_refused() {
    let (seed, mut r) = rng("quantize compressed-tensors input");
    let d = tempfile::tempdir().unwrap();
    let inp = d.path().join("in");
    std::fs::create_dir(&inp).unwrap();
    let (h, i) = (16 * r.gen_range(1..5), 16 * r.gen_range(1..4));
    let w = weights(&mut r, h, i);
    let (_, gs) = weight_global_scale(&w);
    let (q, _) = quantize_nvfp4(&w, h, i, gs);
    let base = "model.layers.0.mlp.experts.0.down_proj";
    // llm-compressor stores its global scales as [1]; a [] scalar is the same value
    let scalar: &[usize] = if r.gen() { &[] } else { &[1] };
    let float = "model.layers.0.self_attn.o_proj.weight";
    let (float_file, ct_file) = (
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    );
    write(
        &inp.join(float_file),
        vec![bf16(float, &[h, h], &weights(&mut r, h, h))],
    );
    let ct = vec![
        (
            TensorSpec::new(format!("{base}.weight_packed"), Dtype::U8, &[h, i / 2]),
            q.packed,
        ),
        (
            TensorSpec::new(format!("{base}.weight_scale"), Dtype::F8_E4M3, &[h, i / 16]),
            q.scales,
        ),
        f32t(&format!("{base}.weight_global_scale"), scalar, &[gs]),
        f32t(
            &format!("{base}.input_global_scale"),
            scalar,
            &[r.gen_range(100.0..3000.0)],
        ),
    ];
    let mut map = serde_json::Map::new();
    map.insert(float.into(), float_file.into());
    for (s, _) in &ct {
        map.insert(s.name.clone(), ct_file.into());
    }
    write(&inp.join(ct_file), ct);
    let index = serde_json::json!({"metadata": {"total_size": 1}, "weight_map": map});
    std::fs::write(inp.join("model.safetensors.index.json"), index.to_string()).unwrap();
    let mut cfg = config_json(h, i, 4, 2, 1);
    cfg["quantization_config"] = serde_json::json!({
        "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "float", "group_size": 16},
            "input_activations": {"num_bits": 4, "type": "float", "group_size": 16}}},
        "ignore": ["lm_head"]});
    std::fs::write(inp.join("config.json"), cfg.to_string()).unwrap();
    let input = snapshot(&inp);
    let out = d.path().join("out");
    let o = run(&["quantize", p(&inp), p(&out)]);
    let e = stderr(&o);
    assert_eq!(code(&o), 2, "seed {seed}: {e}");
    for want in [
        ct_file,
        &format!("{base}.weight_packed"),
        "compressed-tensors",
        "ModelOpt",
        "BF16 originals",
    ] {
        assert!(e.contains(want), "seed {seed}: no {want:?} in {e}");
    }
    assert!(!e.contains("panicked"), "seed {seed}: {e}");
    assert!(!out.exists(), "seed {seed}: a refused run wrote {out:?}");
    assert_eq!(snapshot(&inp), input, "seed {seed}: input untouched");
}

/// Each tensor gets its own weight_scale_2 by default (DESIGN.md §2), and the report names the
/// gate/up pairs that then differ; --shared-gate-up-scale gives a pair (HF gate_proj/up_proj,
/// native w1/w3) one, from the larger amax, with the codes quantized under it.
#[test]
fn gate_up_pairs_share_one_global_scale_on_request() {
    let (seed, mut r) = rng("quantize shared gate/up");
    let d = tempfile::tempdir().unwrap();
    let inp = d.path().join("in");
    std::fs::create_dir(&inp).unwrap();
    let (h, i) = (16 * r.gen_range(2..5), 16 * r.gen_range(1..4));
    let gate = weights(&mut r, i, h);
    let up: Vec<f32> = weights(&mut r, i, h).iter().map(|v| v * 3.0).collect();
    let (w1, w3): (Vec<f32>, Vec<f32>) = (weights(&mut r, i, h), weights(&mut r, i, h));
    let w3: Vec<f32> = w3.iter().map(|v| v * 0.25).collect();
    write(
        &inp.join("model.safetensors"),
        vec![
            bf16(
                "model.layers.0.mlp.experts.0.gate_proj.weight",
                &[i, h],
                &gate,
            ),
            bf16("model.layers.0.mlp.experts.0.up_proj.weight", &[i, h], &up),
            bf16("layers.1.ffn.shared_experts.w1.weight", &[i, h], &w1),
            bf16("layers.1.ffn.shared_experts.w3.weight", &[i, h], &w3),
        ],
    );
    let bf = |v: &[f32]| -> Vec<f32> {
        v.iter()
            .map(|&x| half::bf16::from_f32(x).to_f32())
            .collect()
    };
    let amax = |v: &[f32]| bf(v).iter().fold(0f32, |m, x| m.max(x.abs()));
    let json = d.path().join("r.json");
    let out = d.path().join("own");
    let o = run(&["quantize", p(&inp), p(&out), "--json", p(&json)]);
    assert_eq!(code(&o), 0, "seed {seed}: {}", stderr(&o));
    let rep: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(rep["summary"]["gate_up_pairs_split"], 2, "seed {seed}");
    assert!(
        stdout(&o).contains("--shared-gate-up-scale"),
        "{}",
        stdout(&o)
    );
    let c = Checkpoint::open(&out).unwrap();
    let q = read_qlinear(&c, "model.layers.0.mlp.experts.0.up_proj").unwrap();
    assert_eq!(
        q.weight,
        quantize_weight_nvfp4(&bf(&up), i, h).0,
        "seed {seed}"
    );

    let out = d.path().join("shared");
    let o = run(&[
        "quantize",
        p(&inp),
        p(&out),
        "--shared-gate-up-scale",
        "--json",
        p(&json),
    ]);
    assert_eq!(code(&o), 0, "seed {seed}: {}", stderr(&o));
    let rep: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(rep["summary"]["gate_up_pairs_split"], 0, "seed {seed}");
    let c = Checkpoint::open(&out).unwrap();
    for (g, u, a, b) in [
        (
            "model.layers.0.mlp.experts.0.gate_proj",
            "model.layers.0.mlp.experts.0.up_proj",
            &gate,
            &up,
        ),
        (
            "layers.1.ffn.shared_experts.w1",
            "layers.1.ffn.shared_experts.w3",
            &w1,
            &w3,
        ),
    ] {
        let (ws2, gs) = weight_global_scale(&[amax(a).max(amax(b))]);
        for (m, v) in [(g, a), (u, b)] {
            let q = read_qlinear(&c, m).unwrap();
            assert_eq!(
                q.weight.scale_2.to_bits(),
                ws2.to_bits(),
                "seed {seed}: {m}"
            );
            // codes and block scales under gs; scale_2 is the file's amax/2688 checked above
            // (quantize_nvfp4 sets 1/gs, which can differ from it by an ulp)
            let want = quantize_nvfp4(&bf(v), i, h, gs).0;
            assert!(
                q.weight.packed == want.packed && q.weight.scales == want.scales,
                "seed {seed}: {m}"
            );
        }
    }
    // the input has no config.json, so neither has the output directory (a finding of audit's:
    // no engine loads it); its tensors, audited as a file, are clean
    let o = run(&["audit", p(&out.join("model.safetensors"))]);
    assert_eq!(code(&o), 0, "{}{}", stdout(&o), stderr(&o));
    for bad in [vec!["--gs", "2"], vec!["--format", "mxfp4"]] {
        let mut args = vec!["quantize", p(&inp), p(&out), "--shared-gate-up-scale"];
        args.extend(bad);
        assert_eq!(code(&run(&args)), 2, "{args:?}");
    }
}

/// A global scale so large that the recipe's `out_scale = rcp(s * rcp(gs))` overflows to inf
/// for the smallest block scales (E4M3 subnormals) is refused: the auto scale 2688/amax of a
/// tensor whose amax is tiny (yet gives a normal weight_scale_2), and an explicit --gs. Such
/// blocks were written with codes computed from inf and NaN: their zeros as -6 (0xF),
/// everything else as ±6. The largest accepted --gs keeps every zero a zero code.
#[test]
fn global_scales_that_overflow_out_scale_are_refused() {
    use nvfp4dbg::nvfp4::{max_finite_out_scale_gs, out_scale_finite};
    let (seed, mut r) = rng("quantize out_scale overflow");
    let d = tempfile::tempdir().unwrap();
    let (inp, out) = (
        d.path().join("a.safetensors"),
        d.path().join("b.safetensors"),
    );
    let (rows, cols) = (r.gen_range(2..12), 16 * r.gen_range(2..8));
    let name = "model.layers.2.mlp.experts.5.up_proj.weight";
    // amax in [3.5e-35, 3.9e-33]: amax/2688 is a normal f32, gs = 2688/amax is past the limit
    let amax = 10f32.powf(r.gen_range(3.5e-35f32.log10()..3.9e-33f32.log10()));
    let gs = 2688.0 / amax;
    assert!((amax / 2688.0).is_normal() && !out_scale_finite(1.0 / (amax / 2688.0)));
    let tiny_block = |r: &mut rand_chacha::ChaCha8Rng, vmax: f32| -> Vec<f32> {
        (0..16)
            .map(|_| match r.gen_range(0..4) {
                0 => 0.0,
                _ => r.gen_range(-vmax..vmax),
            })
            .collect()
    };
    let mut w: Vec<f32> = (0..rows * cols).map(|_| r.gen_range(-amax..amax)).collect();
    w[r.gen_range(0..rows * cols)] = amax;
    // one block whose scale is the smallest E4M3 subnormal (2^-9) under gs
    let b = r.gen_range(0..rows * cols / 16);
    let vmax = 6.0 * 2f32.powi(-9) / gs;
    w[b * 16..b * 16 + 16].copy_from_slice(&tiny_block(&mut r, vmax));
    write(&inp, vec![f32t(name, &[rows, cols], &w)]);
    let o = run(&["quantize", p(&inp), p(&out)]);
    assert_eq!(code(&o), 2, "seed {seed}: {}{}", stdout(&o), stderr(&o));
    let e = stderr(&o);
    for want in ["a.safetensors", name, "out_scale", "--exclude"] {
        assert!(e.contains(want), "seed {seed}: no {want:?} in {e}");
    }
    assert!(!e.contains("panicked"), "seed {seed}: {e}");
    assert!(!out.exists(), "seed {seed}: nothing written");

    // --gs past the limit on ordinary weights: refused by the argument parser
    let w = weights(&mut r, rows, cols);
    write(&inp, vec![bf16(name, &[rows, cols], &w)]);
    let max = max_finite_out_scale_gs();
    assert!(out_scale_finite(max) && !out_scale_finite(f32::from_bits(max.to_bits() + 1)));
    let too_big = 10f32.powf(r.gen_range(max.log10() + 0.01..37.9));
    let o = run(&[
        "quantize",
        p(&inp),
        p(&out),
        "--gs",
        &format!("{too_big:e}"),
    ]);
    assert_eq!(code(&o), 2, "seed {seed}: --gs {too_big:e}: {}", stderr(&o));
    assert!(
        stderr(&o).contains("out_scale"),
        "seed {seed}: {}",
        stderr(&o)
    );
    assert!(!out.exists(), "seed {seed}: nothing written");

    // the largest accepted --gs: a block at the smallest scale keeps its zeros zero
    let mut w = weights(&mut r, rows, cols);
    let vmax = 6.0 * 2f32.powi(-9) / max;
    w[b * 16..b * 16 + 16].copy_from_slice(&tiny_block(&mut r, vmax));
    w[b * 16] = 0.0;
    write(&inp, vec![f32t(name, &[rows, cols], &w)]);
    let o = run(&["quantize", p(&inp), p(&out), "--gs", &format!("{max:e}")]);
    assert_eq!(code(&o), 0, "seed {seed}: {}", stderr(&o));
    let f = TensorFile::open(&out).unwrap();
    let packed = f.bytes(name).unwrap();
    for (i, &x) in w.iter().enumerate() {
        let c = (packed[i / 2] >> (4 * (i % 2))) & 0xF;
        if x == 0.0 {
            assert_eq!(c & 7, 0, "seed {seed}: element {i} is 0, code {c:#x}");
        }
    }
}

/// An input already quantized in one format, quantized again with the other --format, is
/// refused: its linears would be copied as they are under a quantization_config naming the
/// other algorithm (NVFP4 codes and E4M3 scales of 16 under `quant_algo: MXFP4`), which `audit`
/// flags as a config mismatch and engines load with the wrong method.
#[test]
fn quantized_input_of_the_other_format_is_refused() {
    let (seed, mut r) = rng("quantize other format");
    let d = tempfile::tempdir().unwrap();
    let (h, i) = (32 * r.gen_range(1..4), 32 * r.gen_range(1..4));
    let src = d.path().join("bf16");
    std::fs::create_dir(&src).unwrap();
    let mut tensors = vec![];
    for (proj, rows, cols) in [("gate_proj", i, h), ("up_proj", i, h), ("down_proj", h, i)] {
        tensors.push(bf16(
            &format!("model.layers.0.mlp.experts.0.{proj}.weight"),
            &[rows, cols],
            &weights(&mut r, rows, cols),
        ));
    }
    tensors.push(bf16("model.norm.weight", &[h], &weights(&mut r, 1, h)));
    write(&src.join("model.safetensors"), tensors);
    std::fs::write(
        src.join("config.json"),
        config_json(h, i, 1, 1, 1).to_string(),
    )
    .unwrap();
    for (first, second) in [("nvfp4", "mxfp4"), ("mxfp4", "nvfp4")] {
        let q = d.path().join(first);
        let o = run(&["quantize", p(&src), p(&q), "--format", first]);
        assert_eq!(code(&o), 0, "seed {seed}: {}", stderr(&o));
        // the same format again copies it (a fixed point); the other is refused
        let again = d.path().join(format!("{first}-again"));
        let o = run(&["quantize", p(&q), p(&again), "--format", first]);
        assert_eq!(code(&o), 0, "seed {seed}: {}", stderr(&o));
        let before = snapshot(d.path());
        for (inp, out) in [
            (q.clone(), d.path().join(format!("{first}-{second}"))),
            (
                q.join("model.safetensors"),
                d.path().join(format!("{first}-{second}.safetensors")),
            ),
        ] {
            let o = run(&["quantize", p(&inp), p(&out), "--format", second]);
            assert_eq!(
                code(&o),
                2,
                "seed {seed} {first} -> {second}: {}",
                stdout(&o)
            );
            let e = stderr(&o);
            for want in [
                "model.safetensors",
                "model.layers.0.mlp.experts.0.",
                ".weight_scale",
                &first.to_uppercase(),
                "--format",
            ] {
                assert!(e.contains(want), "seed {seed}: no {want:?} in {e}");
            }
            assert!(!out.exists(), "seed {seed}: {} written", out.display());
        }
        assert_eq!(snapshot(d.path()), before, "seed {seed}: something written");
    }
}

/// Quantizing into an OUT directory that holds another run's checkpoint with other shard names
/// is refused before anything is written: the old index (or, without one, the old shards) would
/// stay next to the new files, and loaders read the old weights (an index points them at the
/// old shards only) or both sets. The same sharding again is a plain rerun and succeeds.
#[test]
fn an_out_holding_other_shards_is_refused() {
    let (seed, mut r) = rng("quantize stale out");
    let d = tempfile::tempdir().unwrap();
    let (h, i) = (16 * r.gen_range(1..5), 16 * r.gen_range(1..4));
    let sharded = d.path().join("sharded");
    let single = d.path().join("single");
    for dir in [&sharded, &single] {
        std::fs::create_dir(dir).unwrap();
        std::fs::write(
            dir.join("config.json"),
            config_json(h, i, 2, 1, 1).to_string(),
        )
        .unwrap();
    }
    let names: Vec<String> = (0..2)
        .map(|e| format!("model.layers.0.mlp.experts.{e}.down_proj.weight"))
        .collect();
    let mut map = serde_json::Map::new();
    for (s, n) in names.iter().enumerate() {
        let file = format!("model-{:05}-of-00002.safetensors", s + 1);
        write(
            &sharded.join(&file),
            vec![bf16(n, &[h, i], &weights(&mut r, h, i))],
        );
        map.insert(n.clone(), file.into());
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    std::fs::write(
        sharded.join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();
    write(
        &single.join("model.safetensors"),
        names
            .iter()
            .map(|n| bf16(n, &[h, i], &weights(&mut r, h, i)))
            .collect(),
    );
    let (first, second) = if r.gen() {
        (&sharded, &single)
    } else {
        (&single, &sharded)
    };
    let out = d.path().join("out");
    let o = run(&["quantize", p(first), p(&out)]);
    assert_eq!(code(&o), 0, "seed {seed}: {}", stderr(&o));
    let before = snapshot(&out);
    let o = run(&["quantize", p(second), p(&out)]);
    assert_eq!(code(&o), 2, "seed {seed}: {}", stdout(&o));
    let e = stderr(&o);
    let stale = if first == &sharded {
        "model.safetensors.index.json"
    } else {
        "model.safetensors"
    };
    for want in [p(&out), stale, "Remove them"] {
        assert!(e.contains(want), "seed {seed}: no {want:?} in {e}");
    }
    assert!(snapshot(&out) == before, "seed {seed}: OUT changed");
    // a rerun of the first input over its own output is fine
    let o = run(&["quantize", p(first), p(&out)]);
    assert_eq!(code(&o), 0, "seed {seed}: {}", stderr(&o));
    // into an empty directory, the second one's output reads back as written
    let out2 = d.path().join("out2");
    std::fs::create_dir(&out2).unwrap();
    let o = run(&["quantize", p(second), p(&out2)]);
    assert_eq!(code(&o), 0, "seed {seed}: {}", stderr(&o));
    let c = Checkpoint::open(&out2).unwrap();
    for n in &names {
        assert_eq!(c.info(n).unwrap().dtype, Dtype::U8, "seed {seed}: {n}");
    }
}
