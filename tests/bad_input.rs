//! Bad input is exit 2, never a panic, never exit 0: every damaged file and directory, driven
//! through the real binary (`audit`, `quantize`), must give a message naming the file (and the
//! tensor where there is one), and must leave the input untouched.

mod checkpoint_util;
use checkpoint_util::*;
use nvfp4dbg::checkpoint::writer::{f32_bytes, TensorSpec};
use nvfp4dbg::checkpoint::Dtype;
use rand::Rng;
use std::path::{Path, PathBuf};

/// A file from a raw header string and data bytes.
fn raw(path: &Path, header: &str, data: &[u8]) {
    let mut b = (header.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(header.as_bytes());
    b.extend_from_slice(data);
    std::fs::write(path, b).unwrap();
}

struct Case {
    what: &'static str,
    /// the path handed to the command
    input: PathBuf,
    /// text stderr must contain (the file; the tensor where there is one)
    names: Vec<String>,
    /// a triple whose shapes cannot belong together: `audit` names it as a finding (exit 1,
    /// the rest of the checkpoint still scanned); every other command refuses it (exit 2)
    audit_finding: bool,
}

/// A valid small NVFP4 checkpoint file (one ModelOpt triple and a BF16 tensor).
fn good_tensors(r: &mut impl Rng) -> Vec<(TensorSpec, Vec<u8>)> {
    let w = weights(r, 8, 32);
    let (q, _) = nvfp4dbg::nvfp4::quantize_weight_nvfp4(&w, 8, 32);
    vec![
        (
            TensorSpec::new(
                "model.layers.0.mlp.experts.0.up_proj.weight",
                Dtype::U8,
                &[8, 16],
            ),
            q.packed,
        ),
        (
            TensorSpec::new(
                "model.layers.0.mlp.experts.0.up_proj.weight_scale",
                Dtype::F8_E4M3,
                &[8, 2],
            ),
            q.scales,
        ),
        (
            TensorSpec::new(
                "model.layers.0.mlp.experts.0.up_proj.weight_scale_2",
                Dtype::F32,
                &[],
            ),
            f32_bytes(&[q.scale_2]),
        ),
        bf16(
            "model.layers.0.mlp.experts.0.gate_proj.weight",
            &[8, 32],
            &w,
        ),
    ]
}

fn cases(dir: &Path, r: &mut impl Rng) -> Vec<Case> {
    let mut v = vec![];
    let f = |n: &str| dir.join(n);
    let s = |p: &Path| p.display().to_string();

    // truncated: a valid file cut inside its data
    let good = f("good.safetensors");
    write(&good, good_tensors(r));
    let bytes = std::fs::read(&good).unwrap();
    let t = f("truncated.safetensors");
    std::fs::write(&t, &bytes[..bytes.len() - 7]).unwrap();
    v.push(Case {
        what: "truncated file",
        audit_finding: false,
        names: vec![
            s(&t),
            "model.layers.0.mlp.experts.0.gate_proj.weight".into(),
        ],
        input: t,
    });

    let t = f("header_past_end.safetensors");
    let mut b = 4096u64.to_le_bytes().to_vec();
    b.extend_from_slice(b"{\"a\":{}}");
    std::fs::write(&t, b).unwrap();
    v.push(Case {
        what: "header length past the end",
        audit_finding: false,
        names: vec![s(&t)],
        input: t,
    });

    let t = f("huge_header.safetensors");
    let mut b = (1u64 << 40).to_le_bytes().to_vec();
    b.extend_from_slice(&[0u8; 64]);
    std::fs::write(&t, b).unwrap();
    v.push(Case {
        what: "absurd header length",
        audit_finding: false,
        names: vec![s(&t)],
        input: t,
    });

    let t = f("not_json.safetensors");
    raw(&t, "this is not json at all!", &[0; 16]);
    v.push(Case {
        what: "non-JSON header",
        audit_finding: false,
        names: vec![s(&t)],
        input: t,
    });

    let t = f("broken_json.safetensors");
    raw(&t, "{\"x\": {\"dtype\": \"F32\", \"shape\": [2], ", &[0; 8]);
    v.push(Case {
        what: "broken JSON header",
        audit_finding: false,
        names: vec![s(&t)],
        input: t,
    });

    let t = f("unknown_dtype.safetensors");
    raw(
        &t,
        r#"{"w.weight":{"dtype":"F12","shape":[2],"data_offsets":[0,4]}}"#,
        &[0; 4],
    );
    v.push(Case {
        what: "unknown dtype",
        audit_finding: false,
        names: vec![s(&t), "w.weight".into()],
        input: t,
    });

    let t = f("offsets_past_end.safetensors");
    raw(
        &t,
        r#"{"w.weight":{"dtype":"F32","shape":[4, 4],"data_offsets":[0,64]}}"#,
        &[0; 32],
    );
    v.push(Case {
        what: "offsets past the end",
        audit_finding: false,
        names: vec![s(&t), "w.weight".into()],
        input: t,
    });

    let t = f("overlap.safetensors");
    raw(
        &t,
        r#"{"a.weight":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},"b.weight":{"dtype":"F32","shape":[4],"data_offsets":[8,24]}}"#,
        &[0; 24],
    );
    v.push(Case {
        what: "overlapping offsets",
        audit_finding: false,
        names: vec![s(&t), "b.weight".into()],
        input: t,
    });

    let t = f("bytecount.safetensors");
    raw(
        &t,
        r#"{"w.weight":{"dtype":"BF16","shape":[3, 16],"data_offsets":[0,64]}}"#,
        &[0; 64],
    );
    v.push(Case {
        what: "byte count != dtype x shape",
        audit_finding: false,
        names: vec![s(&t), "w.weight".into()],
        input: t,
    });

    let t = f("packed_vs_scale.safetensors");
    let mut ts = good_tensors(r);
    ts[1] = (
        TensorSpec::new(
            "model.layers.0.mlp.experts.0.up_proj.weight_scale",
            Dtype::F8_E4M3,
            &[8, 4],
        ),
        vec![0x38; 32],
    );
    write(&t, ts);
    v.push(Case {
        what: "packed weight shape disagreeing with its scale",
        audit_finding: true,
        names: vec![
            s(&t),
            "model.layers.0.mlp.experts.0.up_proj.weight_scale".into(),
        ],
        input: t,
    });

    let t = f("empty.safetensors");
    std::fs::write(&t, b"").unwrap();
    v.push(Case {
        what: "empty file",
        audit_finding: false,
        names: vec![s(&t)],
        input: t,
    });

    // directories
    let mk = |n: &str| {
        let d = dir.join(n);
        std::fs::create_dir_all(&d).unwrap();
        write(
            &d.join("model.safetensors"),
            good_tensors(&mut rand::thread_rng()),
        );
        d
    };
    let d = mk("broken_config");
    std::fs::write(
        d.join("config.json"),
        "{\"hidden_size\": 64, \"n_routed_experts\": ",
    )
    .unwrap();
    v.push(Case {
        what: "broken config.json",
        audit_finding: false,
        names: vec![s(&d.join("config.json"))],
        input: d,
    });

    let d = mk("incomplete_config");
    let mut c = config_json(32, 16, 4, 2, 1);
    c.as_object_mut().unwrap().remove("hidden_size");
    std::fs::write(d.join("config.json"), c.to_string()).unwrap();
    v.push(Case {
        what: "incomplete config.json",
        audit_finding: false,
        names: vec![s(&d.join("config.json")), "hidden_size".into()],
        input: d,
    });

    let d = mk("nonsense_config");
    let mut c = config_json(32, 16, 4, 2, 1);
    c["num_experts_per_tok"] = 9.into();
    std::fs::write(d.join("config.json"), c.to_string()).unwrap();
    v.push(Case {
        what: "top-k > experts",
        audit_finding: false,
        names: vec![s(&d.join("config.json")), "num_experts_per_tok".into()],
        input: d,
    });

    let d = mk("missing_shard");
    std::fs::rename(
        d.join("model.safetensors"),
        d.join("model-00001-of-00002.safetensors"),
    )
    .unwrap();
    let ix = serde_json::json!({"weight_map": {
        "model.layers.0.mlp.experts.0.up_proj.weight": "model-00001-of-00002.safetensors",
        "model.layers.0.mlp.experts.0.down_proj.weight": "model-00002-of-00002.safetensors"}});
    std::fs::write(d.join("model.safetensors.index.json"), ix.to_string()).unwrap();
    v.push(Case {
        what: "index naming a missing shard",
        audit_finding: false,
        names: vec![
            s(&d.join("model.safetensors.index.json")),
            "model-00002-of-00002.safetensors".into(),
        ],
        input: d,
    });

    let d = mk("index_tensor_missing");
    std::fs::rename(
        d.join("model.safetensors"),
        d.join("model-00001-of-00001.safetensors"),
    )
    .unwrap();
    let ix = serde_json::json!({"weight_map": {"model.layers.0.mlp.experts.9.up_proj.weight": "model-00001-of-00001.safetensors"}});
    std::fs::write(d.join("model.safetensors.index.json"), ix.to_string()).unwrap();
    v.push(Case {
        what: "index naming a tensor its shard lacks",
        audit_finding: false,
        names: vec![
            s(&d.join("model-00001-of-00001.safetensors")),
            "model.layers.0.mlp.experts.9.up_proj.weight".into(),
        ],
        input: d,
    });

    let d = mk("broken_index");
    std::fs::write(d.join("model.safetensors.index.json"), "{\"weight_map\": {").unwrap();
    v.push(Case {
        what: "broken index JSON",
        audit_finding: false,
        names: vec![s(&d.join("model.safetensors.index.json"))],
        input: d,
    });

    let d = dir.join("no_tensors");
    std::fs::create_dir_all(&d).unwrap();
    std::fs::write(
        d.join("config.json"),
        config_json(32, 16, 4, 2, 1).to_string(),
    )
    .unwrap();
    std::fs::write(d.join("README.md"), "nothing here").unwrap();
    v.push(Case {
        what: "directory without tensors",
        audit_finding: false,
        names: vec![s(&d)],
        input: d,
    });

    let t = f("does_not_exist.safetensors");
    v.push(Case {
        what: "missing path",
        audit_finding: false,
        names: vec![s(&t)],
        input: t,
    });
    v
}

#[test]
fn bad_input_exits_2_naming_file_and_tensor() {
    let (seed, mut r) = rng("bad input");
    let d = tempfile::tempdir().unwrap();
    let inputs = d.path().join("inputs");
    std::fs::create_dir(&inputs).unwrap();
    let all = cases(&inputs, &mut r);
    let before = snapshot(&inputs);
    let outdir = d.path().join("outputs");
    for c in &all {
        let out = outdir.join(c.input.file_name().unwrap());
        for args in [
            vec!["audit", p(&c.input)],
            vec!["quantize", p(&c.input), p(&out)],
        ] {
            let o = run(&args);
            let err = stderr(&o);
            if c.audit_finding && args[0] == "audit" {
                let out = stdout(&o);
                assert_eq!(code(&o), 1, "seed {seed}: {}: {err}{out}", c.what);
                assert!(out.contains("shape/dtype error"), "{}: {out}", c.what);
                assert!(out.contains(c.names[1].as_str()), "{}: {out}", c.what);
                continue;
            }
            assert_eq!(
                code(&o),
                2,
                "seed {seed}: {} ({}): exit {}\n{err}{}",
                c.what,
                args[0],
                code(&o),
                stdout(&o)
            );
            assert!(
                !err.contains("panicked") && !err.contains("internal error"),
                "{}: {err}",
                c.what
            );
            for n in &c.names {
                assert!(
                    err.contains(n.as_str()),
                    "{} ({}): stderr does not name `{n}`:\n{err}",
                    c.what,
                    args[0]
                );
            }
            assert!(
                !out.exists()
                    || out
                        .read_dir()
                        .map(|mut x| x.next().is_none())
                        .unwrap_or(false),
                "{}: {} wrote output",
                c.what,
                args[0]
            );
        }
    }
    assert_eq!(snapshot(&inputs), before, "an input file changed");
}

#[test]
fn valid_inputs_are_not_bad_input() {
    // the baseline the damaged files were cut from is fine: the refusals above are about the damage
    let (_, mut r) = rng("good input");
    let d = tempfile::tempdir().unwrap();
    let good = d.path().join("good.safetensors");
    write(&good, good_tensors(&mut r));
    let before = snapshot(d.path());
    let o = run(&["audit", p(&good)]);
    assert!(code(&o) == 0 || code(&o) == 1, "{}", stderr(&o));
    let o = run(&["quantize", p(&good), p(&d.path().join("q.safetensors"))]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let after: Vec<_> = snapshot(d.path())
        .into_iter()
        .filter(|(p, _)| p == &good)
        .collect();
    assert_eq!(after, before, "input changed");
}

/// A FIFO where a file belongs (`mkfifo`): opening one blocks until a writer comes, so these
/// commands hung on it until killed. Now each is bad input at once, naming the path.
#[test]
fn a_fifo_where_a_file_belongs_is_bad_input_not_a_hang() {
    let d = tempfile::tempdir().unwrap();
    let mkfifo = |path: &Path| {
        let ok = std::process::Command::new("mkfifo").arg(path).status();
        assert!(ok.is_ok_and(|s| s.success()), "mkfifo {}", path.display());
    };
    let fifo = d.path().join("w.safetensors");
    mkfifo(&fifo);
    let trace = d.path().join("trace");
    std::fs::create_dir(&trace).unwrap();
    let traced = trace.join("000000-model.layers.0.mlp.safetensors");
    mkfifo(&traced);
    let out = d.path().join("out.safetensors");
    for (args, named) in [
        (vec!["audit", p(&fifo)], &fifo),
        (vec!["quantize", p(&fifo), p(&out)], &fifo),
        (vec!["routing", p(&fifo), "--num-experts", "16"], &fifo),
        (
            vec!["compare-weights", p(&fifo), p(&fifo), "--device", "cpu"],
            &fifo,
        ),
        (vec!["nan-locate", p(&trace)], &traced),
        (vec!["bisect", p(&trace), p(&trace)], &traced),
    ] {
        let o = std::process::Command::new("timeout")
            .arg("60")
            .arg(bin())
            .args(&args)
            .output()
            .unwrap();
        let err = stderr(&o);
        assert_eq!(
            code(&o),
            2,
            "{args:?}: exit {} (124: hung)\n{err}",
            code(&o)
        );
        assert!(
            err.contains(p(named)) && err.contains("not a regular file"),
            "{args:?}: {err}"
        );
    }
}

// Guards: without an index, a shard that is a broken symlink, a symlink loop or a directory
// was skipped (quantize passed on half the checkpoint, layertest said "no MoE expert tensors");
// an index that was one of those was ignored; a shard the index names that is a directory was
// said not to exist.
#[test]
fn unreadable_shards_and_index_are_bad_input_not_skipped() {
    let (seed, _) = rng("unreadable shards");
    let d = tempfile::tempdir().unwrap();
    let good = d.path().join("good");
    synth(&good, seed, &["--layers", "2", "--no-originals"]);
    let index = "model.safetensors.index.json";
    let copy = |name: &str| {
        let c = d.path().join(name);
        std::fs::create_dir(&c).unwrap();
        for e in std::fs::read_dir(&good).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), c.join(e.file_name())).unwrap();
        }
        c
    };
    let dangling = |at: &Path| std::os::unix::fs::symlink("../blobs/missing", at).unwrap();
    let looped = |at: &Path| std::os::unix::fs::symlink(at.file_name().unwrap(), at).unwrap();
    let dir = |at: &Path| std::fs::create_dir(at).unwrap();
    let mut cases: Vec<(PathBuf, PathBuf, &str)> = vec![];
    for (what, make, says) in [
        ("dangling", &dangling as &dyn Fn(&Path), "symlink"),
        ("loop", &looped, "symlink"),
        ("dir", &dir, "directory"),
    ] {
        // the MoE layer's shard, without an index
        let c = copy(&format!("noindex-{what}"));
        std::fs::remove_file(c.join(index)).unwrap();
        let shard = shards(&c).pop().unwrap();
        std::fs::remove_file(&shard).unwrap();
        make(&shard);
        cases.push((c, shard, says));
        // the index itself
        let c = copy(&format!("index-{what}"));
        std::fs::remove_file(c.join(index)).unwrap();
        make(&c.join(index));
        let named = c.join(index);
        cases.push((c, named, says));
        // a shard the index names
        let c = copy(&format!("indexed-{what}"));
        let shard = shards(&c).pop().unwrap();
        std::fs::remove_file(&shard).unwrap();
        make(&shard);
        cases.push((c, shard, says));
    }
    // the regular files of a case (its broken links and loops are not followed)
    let files = |c: &Path| -> Vec<(PathBuf, Vec<u8>)> {
        let mut v: Vec<_> = std::fs::read_dir(c)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|f| std::fs::symlink_metadata(f).is_ok_and(|m| m.is_file()))
            .map(|f| (f.clone(), std::fs::read(&f).unwrap()))
            .collect();
        v.sort();
        v
    };
    for (c, named, says) in &cases {
        let before = files(c);
        let q = d.path().join("q").join(c.file_name().unwrap());
        for args in [
            vec!["audit", p(c)],
            vec![
                "layertest",
                "--checkpoint",
                p(c),
                "--device",
                "cpu",
                "--tokens",
                "8",
            ],
            vec!["quantize", p(c), p(&q)],
        ] {
            let o = run(&args);
            let err = stderr(&o);
            assert_eq!(
                code(&o),
                2,
                "seed {seed}: {args:?}: exit {}\n{err}",
                code(&o)
            );
            let file = named.file_name().unwrap().to_str().unwrap();
            assert!(
                err.contains(file) && err.contains(says) && !err.contains("panicked"),
                "seed {seed}: {args:?}: does not name {file} as a {says}:\n{err}"
            );
        }
        assert_eq!(files(c), before, "{}: input changed", c.display());
    }
}

// Guards: without an index, a numbered shard set with one shard gone was read as the whole
// checkpoint (quantize wrote the rest and passed).
#[test]
fn a_numbered_shard_set_missing_a_shard_is_bad_input() {
    let (seed, mut r) = rng("numbered shard gap");
    let d = tempfile::tempdir().unwrap();
    let c = d.path().join("ck");
    synth(&c, seed, &["--layers", "2", "--no-originals"]);
    std::fs::remove_file(c.join("model.safetensors.index.json")).unwrap();
    let files = shards(&c);
    assert!(files.len() >= 2, "seed {seed}: synth wrote {files:?}");
    let gone = &files[r.gen_range(0..files.len())];
    std::fs::remove_file(gone).unwrap();
    let q = d.path().join("q");
    for args in [vec!["audit", p(&c)], vec!["quantize", p(&c), p(&q)]] {
        let o = run(&args);
        let err = stderr(&o);
        let name = gone.file_name().unwrap().to_str().unwrap();
        assert_eq!(code(&o), 2, "seed {seed}: {args:?}: {err}");
        assert!(
            err.contains(name) && err.contains("does not exist") && !err.contains("panicked"),
            "seed {seed}: {args:?}: does not name {name}:\n{err}"
        );
    }
}

// Guards: a tensor whose data_offsets run past the end of the file also leaves a gap where it
// belonged, and the gap was reported against the next tensor, which is fine.
#[test]
fn a_tensor_past_the_end_is_named_not_its_neighbour() {
    let (seed, mut r) = rng("past the end");
    let d = tempfile::tempdir().unwrap();
    let v: Vec<f32> = (0..6).map(|_| r.gen_range(-4.0f32..4.0)).collect();
    let data = f32_bytes(&v);
    // a [0,8) b moved to [24,32) past the 24 data bytes, c [16,24): gap [8,16) before c
    let h = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[24,32]},"c":{"dtype":"F32","shape":[2],"data_offsets":[16,24]}}"#;
    let f = d.path().join("w.safetensors");
    raw(&f, h, &data);
    let o = run(&["audit", p(&f)]);
    let err = stderr(&o);
    assert_eq!(code(&o), 2, "seed {seed}: {err}");
    assert!(
        err.contains("`b`") && err.contains("past the end") && !err.contains("`c`"),
        "seed {seed}: {err}"
    );
}

// Guards: a header naming one tensor twice was read last-entry-wins, silently (a reader keeping
// the first entry loads other bytes under that name).
#[test]
fn a_tensor_named_twice_in_a_header_is_bad_input() {
    let (seed, mut r) = rng("named twice");
    let d = tempfile::tempdir().unwrap();
    let v: Vec<f32> = (0..4).map(|_| r.gen_range(-4.0f32..4.0)).collect();
    let h = r#"{"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"y":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"x":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}}"#;
    let f = d.path().join("w.safetensors");
    raw(&f, h, &f32_bytes(&v));
    for args in [
        vec!["audit", p(&f)],
        vec!["compare-weights", p(&f), p(&f), "--device", "cpu"],
    ] {
        let o = run(&args);
        let err = stderr(&o);
        assert_eq!(code(&o), 2, "seed {seed}: {args:?}: {err}");
        assert!(
            err.contains("w.safetensors") && err.contains("`x`") && err.contains("twice"),
            "seed {seed}: {args:?}: {err}"
        );
    }
}

// Guards: n_shared_experts = 1e9 in config.json was reported as a lack of memory for --tokens
// ("needs 217088 GB ... try fewer --tokens"), not as the config field it is.
#[test]
fn an_absurd_n_shared_experts_is_named_in_config_json() {
    let (seed, _) = rng("n_shared_experts");
    let d = tempfile::tempdir().unwrap();
    let c = d.path().join("ck");
    synth(&c, seed, &["--layers", "2", "--no-originals"]);
    let cfg = c.join("config.json");
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&cfg).unwrap()).unwrap();
    v["n_shared_experts"] = serde_json::json!(1_000_000_000u64);
    std::fs::write(&cfg, v.to_string()).unwrap();
    let o = run(&[
        "layertest",
        "--checkpoint",
        p(&c),
        "--device",
        "cpu",
        "--tokens",
        "8",
    ]);
    let err = stderr(&o);
    assert_eq!(code(&o), 2, "seed {seed}: {err}");
    assert!(
        err.contains("config.json")
            && err.contains("n_shared_experts")
            && !err.contains("--tokens"),
        "seed {seed}: {err}"
    );
}

// Guards: `routing` took EP rank 5 of an EP world of 1 (metadata or flags) without a word; the
// rank check ran only for EP sizes above 1.
#[test]
fn routing_refuses_an_ep_rank_outside_a_world_of_one() {
    let (seed, mut r) = rng("ep rank");
    let d = tempfile::tempdir().unwrap();
    let (t, k, e) = (8usize, 4usize, 16i64);
    let mut ids = vec![];
    for _ in 0..t {
        let mut row: Vec<i64> = vec![];
        while row.len() < k {
            let x = r.gen_range(0..e);
            if !row.contains(&x) {
                row.push(x);
            }
        }
        ids.extend(row);
    }
    let w: Vec<f32> = (0..t * k).map(|_| r.gen_range(0.05f32..1.0)).collect();
    let ids_b: Vec<u8> = ids.iter().flat_map(|x| x.to_le_bytes()).collect();
    let meta: std::collections::BTreeMap<String, String> = [("ep_rank", "5"), ("ep_size", "1")]
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .into();
    let f = d.path().join("rd.safetensors");
    nvfp4dbg::checkpoint::writer::write_file(
        &f,
        vec![
            (TensorSpec::new("topk_ids", Dtype::I64, &[t, k]), ids_b),
            f32t("topk_weights", &[t, k], &w),
        ],
        Some(meta),
    )
    .unwrap();
    let o = run(&["routing", p(&f), "--num-experts", "16", "--device", "cpu"]);
    let err = stderr(&o);
    assert_eq!(code(&o), 2, "seed {seed}: {err}");
    assert!(
        err.contains("rd.safetensors") && err.contains("EP rank 5"),
        "seed {seed}: {err}"
    );
    let o = run(&[
        "routing",
        p(&f),
        "--num-experts",
        "16",
        "--device",
        "cpu",
        "--ep-rank",
        "3",
        "--ep-size",
        "1",
    ]);
    let err = stderr(&o);
    assert_eq!(code(&o), 2, "seed {seed}: {err}");
    assert!(err.contains("EP rank 3"), "seed {seed}: {err}");
}

// Guards: a negative --gs was taken by clap for a flag ("unexpected argument '-1'"), not
// refused as a global scale.
#[test]
fn a_negative_gs_is_refused_as_a_global_scale() {
    let (seed, mut r) = rng("negative gs");
    let v = format!("-{:.3}", r.gen_range(0.1f32..1000.0));
    for args in [
        vec!["quantize", "--gs", &v, "in.safetensors", "out.safetensors"],
        vec!["layertest", "--gs", &v, "--device", "cpu"],
        vec!["gs-sweep", "--gs", &v, "--device", "cpu"],
    ] {
        let o = run(&args);
        let err = stderr(&o);
        assert_eq!(code(&o), 2, "seed {seed}: {args:?}: {err}");
        assert!(
            err.contains("positive") && !err.contains("unexpected argument"),
            "seed {seed}: {args:?}: {err}"
        );
    }
}
