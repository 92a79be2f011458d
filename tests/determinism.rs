//! The same seed gives the same bytes on the CPU: `synth`, `layertest --save-outputs` and
//! `quantize` run twice must write identical files (rayon scheduling, hash-map order and
//! timestamps must not leak into outputs). A different seed must change them, so the
//! comparison can fail.

mod checkpoint_util;
use checkpoint_util::*;
use rand::Rng;
use std::path::Path;

/// Every file under `dir`, relative path and bytes.
fn tree(dir: &Path) -> Vec<(String, Vec<u8>)> {
    snapshot(dir)
        .into_iter()
        .map(|(p, b)| (p.strip_prefix(dir).unwrap().display().to_string(), b))
        .collect()
}

fn ok(args: &[&str]) {
    let o = run(args);
    assert_eq!(code(&o), 0, "{args:?}: {}", stderr(&o));
}

fn assert_same(what: &str, seed: u64, a: &[(String, Vec<u8>)], b: &[(String, Vec<u8>)]) {
    let names = |t: &[(String, Vec<u8>)]| t.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
    assert_eq!(names(a), names(b), "seed {seed}: {what}: different files");
    for ((n, x), (_, y)) in a.iter().zip(b) {
        assert!(x == y, "seed {seed}: {what}: {n} differs between two runs");
    }
}

#[test]
fn same_seed_same_bytes() {
    let (seed, mut r) = rng("determinism");
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let s = r.gen::<u32>().to_string();
    let other = (r.gen::<u32>() | 1)
        .wrapping_add(s.parse::<u32>().unwrap())
        .to_string();

    // synth: with originals, so the BF16 files are covered too
    for (n, sd) in [("a", &s), ("b", &s), ("c", &other)] {
        ok(&[
            "synth",
            "--out",
            p(&d.join(n)),
            "--preset",
            "tiny",
            "--seed",
            sd,
        ]);
    }
    let (a, b, c) = (tree(&d.join("a")), tree(&d.join("b")), tree(&d.join("c")));
    assert!(a.len() > 2, "synth wrote {} files", a.len());
    assert_same("synth", seed, &a, &b);
    assert!(a != c, "seed {seed}: synth ignores --seed");

    // layertest --save-outputs on the synthesized checkpoint
    let layer = r.gen_range(1..3).to_string();
    let tokens = r.gen_range(8..24).to_string();
    for (n, sd) in [
        ("la.safetensors", &s),
        ("lb.safetensors", &s),
        ("lc.safetensors", &other),
    ] {
        let o = run(&[
            "layertest",
            "--checkpoint",
            p(&d.join("a")),
            "--layer",
            &layer,
            "--tokens",
            &tokens,
            "--seed",
            sd,
            "--save-outputs",
            p(&d.join(n)),
        ]);
        // a layer may fail its thresholds (exit 1); the outputs are written either way
        assert!(code(&o) == 0 || code(&o) == 1, "layertest: {}", stderr(&o));
    }
    let read = |n: &str| std::fs::read(d.join(n)).unwrap();
    assert!(
        read("la.safetensors") == read("lb.safetensors"),
        "seed {seed}: layertest --save-outputs differs between two runs (layer {layer}, {tokens} tokens)"
    );
    assert!(
        read("la.safetensors") != read("lc.safetensors"),
        "seed {seed}: layertest ignores --seed"
    );

    // quantize the BF16 originals twice
    for n in ["qa", "qb"] {
        ok(&["quantize", p(&d.join("a").join("bf16")), p(&d.join(n))]);
    }
    let (qa, qb) = (tree(&d.join("qa")), tree(&d.join("qb")));
    assert!(!qa.is_empty(), "quantize wrote nothing");
    assert_same("quantize", seed, &qa, &qb);
}
