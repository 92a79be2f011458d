//! Interrupted runs (SIGKILL, and SIGINT as Ctrl-C sends it) leave no half-written output or
//! report under its final name — only temporary names, or nothing — and never touch their
//! inputs. Each command first runs to completion for the reference bytes (the same seed gives
//! the same bytes), then is killed at random moments across its run time; after each kill,
//! every file under a final name must be byte-identical to the reference one, a directory
//! that claims to be a checkpoint (config.json, index) must be whole and of one run, and the
//! inputs must hash as before.

use nvfp4dbg::checkpoint::writer::{bf16_bytes, write_file, TensorSpec};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use safetensors::Dtype;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_nvfp4dbg");

/// Files that make a directory a checkpoint; when one is there, the directory must be whole.
const MARKERS: [&str; 2] = ["config.json", "model.safetensors.index.json"];

type Snapshot = BTreeMap<PathBuf, Vec<u8>>;

fn rng(what: &str) -> (u64, ChaCha8Rng) {
    let seed = std::env::var("NVFP4DBG_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    eprintln!("{what}: seed {seed} (NVFP4DBG_SEED={seed} to replay)");
    (seed, ChaCha8Rng::seed_from_u64(seed))
}

/// Every file under `dir`, by path relative to it.
fn snapshot(dir: &Path) -> Snapshot {
    let mut out = Snapshot::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                let rel = p.strip_prefix(dir).unwrap().to_path_buf();
                out.insert(rel, std::fs::read(&p).unwrap());
            }
        }
    }
    out
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(|x| x.as_str()).collect()
}

fn is_temp(rel: &Path) -> bool {
    rel.file_name()
        .is_some_and(|n| n.to_string_lossy().contains(".tmp-"))
}

/// Run to completion; returns the wall time.
fn run_full(args: &[&str]) -> Duration {
    let start = Instant::now();
    let o = Command::new(BIN).args(args).output().unwrap();
    assert!(
        o.status.code() == Some(0) || o.status.code() == Some(1),
        "{args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    start.elapsed()
}

/// Start `args`, wait `after`, send `signal` (KILL or INT) unless it is done by then.
/// Returns whether the signal reached a live process.
fn run_killed(args: &[&str], after: Duration, signal: &str) -> bool {
    let mut child = Command::new(BIN)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while start.elapsed() < after {
        if child.try_wait().unwrap().is_some() {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let ok = Command::new("kill")
        .args([&format!("-{signal}"), &child.id().to_string()])
        .status()
        .unwrap()
        .success();
    let status = child.wait().unwrap();
    ok && status.code().is_none()
}

/// After a kill: every final-named file is byte-identical to the same file of one of the
/// complete runs `refs` (no torn file), and if a checkpoint marker is there, there is one run
/// whose every shard is there and whose every file that is there is its own (no mix vouched
/// for).
fn check_output(out: &Path, refs: &[(&str, &Snapshot)], what: &str) {
    let now = snapshot(out);
    let finals: Vec<(&PathBuf, &Vec<u8>)> = now.iter().filter(|(p, _)| !is_temp(p)).collect();
    for (rel, bytes) in &finals {
        assert!(
            refs.iter().any(|(_, r)| r.get(*rel) == Some(*bytes)),
            "{what}: {} ({} bytes) is not the file a complete run writes: torn or half-written",
            rel.display(),
            bytes.len()
        );
    }
    let marked = finals
        .iter()
        .any(|(rel, _)| MARKERS.iter().any(|m| rel.ends_with(m)));
    if !marked {
        return;
    }
    // files of no name run X writes may be an older run's leftovers (a shard count that shrank)
    let whole = refs.iter().any(|(_, r)| {
        finals
            .iter()
            .all(|(rel, b)| r.get(*rel).is_none_or(|x| x == *b))
            && r.keys()
                .filter(|k| k.extension().is_some_and(|x| x == "safetensors"))
                .all(|k| now.get(k) == r.get(k))
    });
    let listing: Vec<String> = finals
        .iter()
        .map(|(rel, b)| {
            let from: Vec<&str> = refs
                .iter()
                .filter(|(_, r)| r.get(*rel) == Some(*b))
                .map(|(n, _)| *n)
                .collect();
            format!("{} (from {from:?})", rel.display())
        })
        .collect();
    assert!(
        whole,
        "{what}: a checkpoint marker vouches for a directory that is not one whole run: {listing:#?}"
    );
}

/// A BF16 HF directory big enough that quantizing it in a debug build takes a second or more.
fn bf16_checkpoint(dir: &Path, r: &mut ChaCha8Rng) {
    std::fs::create_dir_all(dir).unwrap();
    let shards = 3;
    let mut map = serde_json::Map::new();
    for s in 0..shards {
        let fname = format!("model-{:05}-of-{shards:05}.safetensors", s + 1);
        let mut tensors = vec![];
        for t in 0..4 {
            let name = format!("model.layers.{s}.self_attn.proj{t}.weight");
            let (rows, cols) = (512, 2048);
            let v: Vec<f32> = (0..rows * cols)
                .map(|_| r.gen_range(-1.0f32..1.0) * if r.gen_bool(0.01) { 40.0 } else { 1.0 })
                .collect();
            map.insert(name.clone(), fname.clone().into());
            tensors.push((
                TensorSpec::new(&name, Dtype::BF16, &[rows, cols]),
                bf16_bytes(&v),
            ));
        }
        write_file(&dir.join(&fname), tensors, None).unwrap();
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::to_string_pretty(&index).unwrap(),
    )
    .unwrap();
    std::fs::write(
        dir.join("config.json"),
        r#"{"architectures": ["Toy"], "model_type": "toy"}"#,
    )
    .unwrap();
    std::fs::write(dir.join("tokenizer_config.json"), r#"{"x": 1}"#).unwrap();
}

/// `kills` runs of `args` killed at random moments over `0 .. 1.2 * full`, alternately by
/// SIGKILL and SIGINT; `prepare` resets the output before each; `check` runs after each.
fn kill_repeatedly(
    r: &mut ChaCha8Rng,
    kills: usize,
    full: Duration,
    args: &[&str],
    mut prepare: impl FnMut(),
    mut check: impl FnMut(&str),
) -> usize {
    let mut landed = 0;
    for i in 0..kills {
        prepare();
        let after = full.mul_f64(r.gen_range(0.0..1.2));
        let signal = if i % 2 == 0 { "KILL" } else { "INT" };
        if run_killed(args, after, signal) {
            landed += 1;
        }
        check(&format!("{args:?} SIG{signal} after {after:?}"));
    }
    landed
}

fn reset(dir: &Path) {
    let _ = std::fs::remove_dir_all(dir);
}

fn copy_dir(from: &Path, to: &Path) {
    reset(to);
    for (rel, bytes) in snapshot(from) {
        let p = to.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, bytes).unwrap();
    }
}

#[test]
fn killed_synth_leaves_whole_files_or_temporary_names() {
    let (seed, mut r) = rng("synth");
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let (ref_old, ref_new, out) = (d.join("ref-old"), d.join("ref-new"), d.join("out"));
    let seed_old = (seed % 1000).to_string();
    let seed_new = (seed % 1000 + 1).to_string();
    let synth = |out: &Path, preset: &str, seed: &str| {
        vec![
            "synth".to_string(),
            "--out".into(),
            s(out),
            "--preset".into(),
            preset.into(),
            "--seed".into(),
            seed.into(),
            "--force".into(),
            "--quiet".into(),
            "--no-report-dir".into(),
        ]
    };
    run_full(&strs(&synth(&ref_old, "tiny-v4", &seed_old)));
    let full = run_full(&strs(&synth(&ref_new, "tiny", &seed_new)));
    let (old, new) = (snapshot(&ref_old), snapshot(&ref_new));
    assert!(old.len() > 5 && new.len() > 5);
    let out_v = synth(&out, "tiny", &seed_new);
    let out_args = strs(&out_v);

    // into a fresh directory
    let landed = kill_repeatedly(
        &mut r,
        6,
        full,
        &out_args,
        || reset(&out),
        |what| check_output(&out, &[("new", &new)], &format!("seed {seed}: {what}")),
    );
    // --force over another checkpoint (other preset, other names, other seed)
    let landed_force = kill_repeatedly(
        &mut r,
        6,
        full,
        &out_args,
        || copy_dir(&ref_old, &out),
        |what| {
            check_output(
                &out,
                &[("old", &old), ("new", &new)],
                &format!("seed {seed}: --force over an old checkpoint: {what}"),
            )
        },
    );
    eprintln!("synth ({full:?} a run): {landed} + {landed_force} of 12 signals landed mid-run");
}

#[test]
fn killed_quantize_leaves_whole_files_and_its_input_untouched() {
    let (seed, mut r) = rng("quantize");
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let input = d.join("bf16");
    bf16_checkpoint(&input, &mut r);
    let before = snapshot(&input);
    let (ref_gs, ref_new, out) = (d.join("ref-gs"), d.join("ref-new"), d.join("out"));
    let args = |out: &Path, gs: Option<&str>| {
        let mut v = vec!["quantize".to_string(), s(&input), s(out)];
        if let Some(g) = gs {
            v.extend(["--gs".to_string(), g.to_string()]);
        }
        v.extend(["--quiet".into(), "--no-report-dir".into()]);
        v
    };
    run_full(&strs(&args(&ref_gs, Some("1000"))));
    let full = run_full(&strs(&args(&ref_new, None)));
    let (old, new) = (snapshot(&ref_gs), snapshot(&ref_new));
    assert!(new.contains_key(Path::new("config.json")) && new.len() >= 6);
    assert_ne!(
        old.get(Path::new("model-00001-of-00003.safetensors")),
        new.get(Path::new("model-00001-of-00003.safetensors"))
    );
    let out_v = args(&out, None);
    let out_args = strs(&out_v);
    let unchanged = |what: &str| {
        assert!(
            snapshot(&input) == before,
            "seed {seed}: {what}: the input changed"
        )
    };
    let landed = kill_repeatedly(
        &mut r,
        6,
        full,
        &out_args,
        || reset(&out),
        |what| {
            check_output(&out, &[("new", &new)], &format!("seed {seed}: {what}"));
            unchanged(what);
        },
    );
    // over the output of an earlier run (another --gs)
    let landed_over = kill_repeatedly(
        &mut r,
        6,
        full,
        &out_args,
        || copy_dir(&ref_gs, &out),
        |what| {
            check_output(
                &out,
                &[("old", &old), ("new", &new)],
                &format!("seed {seed}: over an earlier output: {what}"),
            );
            unchanged(what);
        },
    );
    eprintln!("quantize ({full:?} a run): {landed} + {landed_over} of 12 signals landed mid-run");
}

#[test]
fn killed_layertest_leaves_no_half_written_report() {
    let (seed, mut r) = rng("layertest report");
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let ckpt = d.join("ckpt");
    let sd = (seed % 1000).to_string();
    run_full(&[
        "synth",
        "--out",
        &s(&ckpt),
        "--seed",
        &sd,
        "--quiet",
        "--no-report-dir",
    ]);
    let before = snapshot(&ckpt);
    let args = |out: &Path| {
        vec![
            "layertest".to_string(),
            "--checkpoint".into(),
            s(&ckpt),
            "--device".into(),
            "cpu".into(),
            "--seed".into(),
            sd.clone(),
            "--quiet".into(),
            "--json".into(),
            s(&out.join("layertest.json")),
            "--report-dir".into(),
            s(&out.join("reports")),
        ]
    };
    let (refd, out) = (d.join("ref"), d.join("out"));
    let ref_v = args(&refd);
    let full = run_full(&strs(&ref_v));
    let reference = snapshot(&refd);
    assert!(reference.contains_key(Path::new("layertest.json")));
    assert!(reference.contains_key(Path::new("reports/report.json")));
    let out_v = args(&out);
    let out_args = strs(&out_v);
    let landed = kill_repeatedly(
        &mut r,
        8,
        full,
        &out_args,
        || reset(&out),
        |what| {
            check_output(
                &out,
                &[("complete", &reference)],
                &format!("seed {seed}: {what}"),
            );
            assert!(
                snapshot(&ckpt) == before,
                "seed {seed}: {what}: the input changed"
            );
        },
    );
    eprintln!("layertest ({full:?} a run): {landed} of 8 signals landed mid-run");
}
