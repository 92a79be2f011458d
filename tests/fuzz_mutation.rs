//! Stable-toolchain fallback for the cargo-fuzz targets in `fuzz/` (which need nightly flags):
//! a deterministic mutation fuzzer. Valid seed inputs are mutated with a seeded ChaCha stream
//! (bit flips, interesting bytes, numbers swapped for extreme ones, splices, truncation,
//! duplication) and fed through the same calls as the fuzz targets; any panic fails the test
//! and writes the input to `target/fuzz-crashes/<target>/`.
//!
//! `cargo test --release --test fuzz_mutation -- --ignored fuzz_` runs them;
//! `FUZZ_SECS` (per target, default 60) and `FUZZ_SEED` (default random, printed) steer it.
//! Crashers belong in `tests/data/fuzz-regressions/<target>/`, replayed by
//! `bad_input_matrix::fuzz_regressions_replay` in every normal test run.

use nvfp4dbg::checkpoint::config::{parse_config, parse_hf_quant_config};
use nvfp4dbg::checkpoint::writer::{f32_bytes, write_file, TensorSpec};
use nvfp4dbg::checkpoint::{Checkpoint, Dtype, TensorFile};
use nvfp4dbg::trace::{parse_file_name, TraceFile};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const INTERESTING: &[&[u8]] = &[
    b"0",
    b"-1",
    b"18446744073709551615",
    b"18446744073709551616",
    b"9223372036854775807",
    b"4294967296",
    b"1e999",
    b"-0.0",
    b"NaN",
    b"null",
    b"[]",
    b"{}",
    b"\"\"",
    b"true",
    b"\"F4\"",
    b"\"F8_E8M0\"",
    b"\"I64\"",
    b"\"U8\"",
    b"\"BOOL\"",
    b"[0,0]",
    b"[1,0]",
    b"[4294967295,4294967295,4294967295]",
    b"\xff\xfe",
    b"\"..\"",
    b"\"/etc/passwd\"",
];

fn mutate(r: &mut ChaCha8Rng, seeds: &[Vec<u8>], input: &mut Vec<u8>) {
    let n = r.gen_range(1..=4);
    for _ in 0..n {
        let len = input.len();
        match r.gen_range(0..10) {
            0 if len > 0 => {
                let i = r.gen_range(0..len);
                input[i] ^= 1 << r.gen_range(0..8);
            }
            1 if len > 0 => {
                let i = r.gen_range(0..len);
                input[i] = [0u8, 0xff, 0x7f, 0x80, b'9', b'"', b',', b'-'][r.gen_range(0..8)];
            }
            // a number or token replaced by an extreme one
            2 | 3 if len > 0 => {
                let i = r.gen_range(0..len);
                let mut j = i;
                while j < len && (input[j].is_ascii_alphanumeric() || input[j] == b'.') {
                    j += 1;
                }
                let tok = INTERESTING[r.gen_range(0..INTERESTING.len())];
                input.splice(i..j.max(i), tok.iter().copied());
            }
            4 if len > 1 => {
                let a = r.gen_range(0..len);
                let b = (a + r.gen_range(1..=64)).min(len);
                input.drain(a..b);
            }
            5 if len > 0 => {
                let a = r.gen_range(0..len);
                let b = (a + r.gen_range(1..=64)).min(len);
                let chunk = input[a..b].to_vec();
                let at = r.gen_range(0..=len);
                input.splice(at..at, chunk);
            }
            6 => {
                let other = &seeds[r.gen_range(0..seeds.len())];
                if !other.is_empty() && len > 0 {
                    let a = r.gen_range(0..other.len());
                    let at = r.gen_range(0..len);
                    input.truncate(at);
                    input.extend_from_slice(&other[a..]);
                }
            }
            7 if len > 0 => input.truncate(r.gen_range(0..len)),
            8 if len > 0 => {
                let i = r.gen_range(0..len);
                input.insert(i, r.gen());
            }
            _ => {
                let tok = INTERESTING[r.gen_range(0..INTERESTING.len())];
                let at = r.gen_range(0..=len);
                input.splice(at..at, tok.iter().copied());
            }
        }
    }
}

/// Safetensors inputs are mutated in their header text and then re-prefixed with a length
/// that fits (most of the time), so the mutations reach the entry parser and not only the
/// length check.
fn mutate_safetensors(r: &mut ChaCha8Rng, seeds: &[Vec<u8>], input: &mut Vec<u8>) {
    if input.len() < 8 || r.gen_bool(0.2) {
        return mutate(r, seeds, input);
    }
    let n = u64::from_le_bytes(input[..8].try_into().unwrap()) as usize;
    if n > input.len() - 8 {
        return mutate(r, seeds, input);
    }
    let mut header = input[8..8 + n].to_vec();
    let mut data = input[8 + n..].to_vec();
    if r.gen_bool(0.8) {
        mutate(r, seeds, &mut header);
    } else {
        mutate(r, seeds, &mut data);
    }
    let mut len = header.len() as u64;
    if r.gen_bool(0.05) {
        len = len.wrapping_add(r.gen_range(0..16)).wrapping_sub(8);
    }
    input.clear();
    input.extend_from_slice(&len.to_le_bytes());
    input.extend_from_slice(&header);
    input.extend_from_slice(&data);
}

fn st_file(tensors: &[(&str, Dtype, &[usize], Vec<u8>)], meta: Option<(&str, &str)>) -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("s.safetensors");
    let specs = tensors
        .iter()
        .map(|(n, d, s, b)| (TensorSpec::new(*n, *d, s), b.clone()))
        .collect();
    let meta = meta.map(|(k, v)| [(k.to_string(), v.to_string())].into_iter().collect());
    write_file(&p, specs, meta).unwrap();
    std::fs::read(p).unwrap()
}

fn safetensors_seeds(r: &mut ChaCha8Rng) -> Vec<Vec<u8>> {
    let v: Vec<f32> = (0..64).map(|_| r.gen_range(-4.0f32..4.0)).collect();
    let mut bytes = |n: usize| (0..n).map(|_| r.gen::<u8>()).collect::<Vec<u8>>();
    let (b8, b16, b64, b4) = (bytes(8), bytes(32), bytes(64), bytes(4));
    vec![
        st_file(
            &[
                ("w.weight", Dtype::U8, &[4, 2], b8.clone()),
                ("w.weight_scale", Dtype::F8_E4M3, &[4, 1], b4.clone()),
                ("w.weight_scale_2", Dtype::F32, &[], f32_bytes(&[0.5])),
                ("w.input_scale", Dtype::F32, &[], f32_bytes(&[v[0].abs()])),
            ],
            None,
        ),
        st_file(
            &[
                ("a", Dtype::BF16, &[4, 4], b16.clone()),
                ("b", Dtype::F16, &[16], b16.clone()),
                ("c", Dtype::F32, &[4, 4], f32_bytes(&v[..16])),
                ("d", Dtype::F64, &[8], b64.clone()),
                ("e", Dtype::I64, &[2, 4], b64),
                ("f", Dtype::F8_E5M2, &[8], b8),
            ],
            Some(("format", "pt")),
        ),
        st_file(
            &[
                ("output", Dtype::F32, &[2, 8], f32_bytes(&v[..16])),
                ("input.0", Dtype::BF16, &[2, 8], b16),
            ],
            Some(("rank", "0")),
        ),
        st_file(&[("empty", Dtype::F32, &[0, 4], vec![])], None),
    ]
}

fn text_seeds(files: &[PathBuf]) -> Vec<Vec<u8>> {
    files.iter().map(|p| std::fs::read(p).unwrap()).collect()
}

fn repo(p: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(p)
}

type Target<'a> = Box<dyn Fn(&[u8]) + 'a>;

/// Run `target` on mutations of `seeds` for `FUZZ_SECS`; return (executions, seconds).
fn fuzz(name: &str, seeds: Vec<Vec<u8>>, structured: bool, target: Target) {
    let secs: u64 = std::env::var("FUZZ_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    let seed: u64 = std::env::var("FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    eprintln!("{name}: FUZZ_SEED={seed} FUZZ_SECS={secs}");
    let mut r = ChaCha8Rng::seed_from_u64(seed);
    // seeds must pass through cleanly first
    for s in &seeds {
        target(s);
    }
    let mut corpus = seeds.clone();
    let start = Instant::now();
    let mut execs = 0u64;
    let prev = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    while start.elapsed() < Duration::from_secs(secs) {
        let mut input = corpus[r.gen_range(0..corpus.len())].clone();
        if structured {
            mutate_safetensors(&mut r, &seeds, &mut input);
        } else {
            mutate(&mut r, &seeds, &mut input);
        }
        input.truncate(1 << 16);
        let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| target(&input)));
        execs += 1;
        if res.is_err() {
            std::panic::set_hook(prev);
            let dir = repo("target/fuzz-crashes").join(name);
            std::fs::create_dir_all(&dir).unwrap();
            let p = dir.join(format!("crash-{seed}-{execs}"));
            std::fs::write(&p, &input).unwrap();
            // re-run with the hook back, for the message
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| target(&input)));
            panic!(
                "{name}: FUZZ_SEED={seed}: panic on input written to {}",
                p.display()
            );
        }
        // keep a few mutants as new starting points (no coverage feedback: a small pool)
        if corpus.len() < 256 && r.gen_ratio(1, 64) {
            corpus.push(input);
        }
    }
    std::panic::set_hook(prev);
    let t = start.elapsed().as_secs_f64();
    eprintln!(
        "{name}: {execs} executions in {t:.0} s ({:.0}/s), no panic",
        execs as f64 / t
    );
}

#[test]
#[ignore]
fn fuzz_safetensors_file() {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path().join("x.safetensors");
    let mut r = ChaCha8Rng::seed_from_u64(1);
    fuzz(
        "safetensors_file",
        safetensors_seeds(&mut r),
        true,
        Box::new(|data| {
            std::fs::write(&p, data).unwrap();
            if let Ok(f) = TensorFile::open(&p) {
                let names: Vec<String> = f.names().map(str::to_string).collect();
                for n in &names {
                    let _ = f.to_f32(n);
                    let _ = f.to_i64(n);
                    let _ = f.scalar_f32(n);
                }
            }
        }),
    );
}

#[test]
#[ignore]
fn fuzz_config_json() {
    let mut seeds = text_seeds(&[]);
    for dir in ["tests/data/golden"] {
        let d = repo(dir);
        if let Ok(rd) = std::fs::read_dir(&d) {
            for e in rd.flatten() {
                let p = e.path();
                if p.extension().is_some_and(|x| x == "json") {
                    seeds.push(std::fs::read(p).unwrap());
                }
            }
        }
    }
    seeds.push(
        serde_json::to_vec_pretty(&serde_json::json!({
            "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
            "hidden_size": 256, "moe_intermediate_size": 128, "intermediate_size": 512,
            "n_routed_experts": 16, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
            "n_shared_experts": 1, "num_hidden_layers": 3, "first_k_dense_replace": 1,
            "routed_scaling_factor": 2.5, "norm_topk_prob": true, "scoring_func": "sigmoid",
            "topk_method": "noaux_tc", "rms_norm_eps": 1e-6, "vocab_size": 97,
            "quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4",
                "group_size": 16, "exclude_modules": ["lm_head"]}
        }))
        .unwrap(),
    );
    seeds.push(
        serde_json::to_vec(&serde_json::json!({
            "producer": {"name": "modelopt", "version": "0.1"},
            "quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}
        }))
        .unwrap(),
    );
    seeds.push(
        serde_json::to_vec(&serde_json::json!({
            "model_type": "deepseek_v4", "hidden_size": 64, "moe_intermediate_size": 32,
            "n_routed_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 2,
            "num_hash_layers": 1, "scoring_func": "sqrtsoftplus",
            "quantization_config": {"quant_method": "compressed-tensors",
                "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "float", "group_size": 16}}}}
        }))
        .unwrap(),
    );
    fuzz(
        "config_json",
        seeds,
        false,
        Box::new(|data| {
            let p = Path::new("config.json");
            let _ = parse_config(p, data, None);
            let _ = parse_config(p, data, data.first().map(|b| *b as usize % 8));
            let _ = parse_hf_quant_config(Path::new("hf_quant_config.json"), data);
        }),
    );
}

#[test]
#[ignore]
fn fuzz_shard_index() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().to_path_buf();
    for (shard, first) in [
        ("model-00001-of-00002.safetensors", "a.weight"),
        ("model-00002-of-00002.safetensors", "c.weight"),
    ] {
        write_file(
            &d.join(shard),
            vec![
                (
                    TensorSpec::new(first, Dtype::F32, &[2, 2]),
                    f32_bytes(&[1.0, -2.0, 3.5, 0.25]),
                ),
                (
                    TensorSpec::new("b.weight", Dtype::F32, &[2]),
                    f32_bytes(&[7.0, 8.0]),
                ),
            ],
            None,
        )
        .unwrap();
    }
    let seeds = vec![
        br#"{"metadata":{"total_size":48},"weight_map":{"a.weight":"model-00001-of-00002.safetensors","b.weight":"model-00002-of-00002.safetensors","c.weight":"model-00002-of-00002.safetensors"}}"#.to_vec(),
        br#"{"weight_map":{"a.weight":"model-00001-of-00002.safetensors","b.weight":"model-00001-of-00002.safetensors","c.weight":"model-00002-of-00002.safetensors"}}"#.to_vec(),
    ];
    let idx = d.join("model.safetensors.index.json");
    fuzz(
        "shard_index",
        seeds,
        false,
        Box::new(|data| {
            std::fs::write(&idx, data).unwrap();
            if let Ok(c) = Checkpoint::open(&d) {
                let names: Vec<String> = c.names().map(str::to_string).collect();
                for n in &names {
                    let _ = c.to_f32(n);
                }
                let _ = c.config();
            }
        }),
    );
}

#[test]
#[ignore]
fn fuzz_trace_file() {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path().join("000001-model.layers.0.mlp.safetensors");
    let mut r = ChaCha8Rng::seed_from_u64(2);
    // trace inputs are "name\nbytes"; the structured mutator works on the bytes part
    let seeds = safetensors_seeds(&mut r);
    let names = [
        "000000-model.embed_tokens.safetensors",
        "0001234-model.layers.3.mlp.experts.safetensors",
        "123456-.safetensors",
        ".000001-x.safetensors",
    ];
    fuzz(
        "trace_file",
        seeds,
        true,
        Box::new(|data| {
            let name = names[data.len() % names.len()];
            let _ = parse_file_name(name);
            if let Ok(s) = std::str::from_utf8(&data[..data.len().min(40)]) {
                let _ = parse_file_name(s);
            }
            std::fs::write(&p, data).unwrap();
            if let Ok(f) = TraceFile::open(&p) {
                let mut out = Vec::new();
                for t in f.tensors() {
                    let n = t.numel();
                    t.read_f32(0, n, &mut out);
                    t.read_f32(n / 2, n, &mut out);
                    t.read_f32(n, 1, &mut out);
                    t.read_f32(usize::MAX - 1, 4, &mut out);
                }
            }
        }),
    );
}

#[test]
#[ignore]
fn fuzz_case_toml() {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path().join("case.toml");
    let mut cases: Vec<PathBuf> = std::fs::read_dir(repo("cases"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .collect();
    cases.sort();
    fuzz(
        "case_toml",
        text_seeds(&cases),
        false,
        Box::new(|data| {
            std::fs::write(&p, data).unwrap();
            let _ = nvfp4dbg::cli::run_case::load_case(&p);
        }),
    );
}

#[test]
#[ignore]
fn fuzz_rules_toml() {
    use nvfp4dbg::weights::rules::{Renames, Side};
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path().join("rules.toml");
    let mut seeds: Vec<PathBuf> = std::fs::read_dir(repo("fuzz/seeds/rules_toml"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    seeds.sort();
    fuzz(
        "rules_toml",
        text_seeds(&seeds),
        false,
        Box::new(|data| {
            std::fs::write(&p, data).unwrap();
            if let Ok(r) = Renames::load(&["model.".to_string()], Some(&p)) {
                for n in [
                    "model.layers.3.mlp.experts.7.gate_proj.weight",
                    "layers.3.ffn.experts.7.w1.weight_scale",
                    "",
                ] {
                    let _ = r.apply(n, Side::A);
                    let _ = r.apply(n, Side::B);
                }
            }
        }),
    );
}
