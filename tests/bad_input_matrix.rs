//! Every command that reads files × every kind of broken input (DESIGN.md §6): exit 2, the
//! message names the file, and nothing panics. Valid material comes from `synth` and
//! `synth-trace`; each broken input is one small, targeted damage to it.

mod checkpoint_util;
use checkpoint_util::*;
use nvfp4dbg::checkpoint::writer::{write_file, TensorSpec};
use nvfp4dbg::checkpoint::{Dtype, TensorFile};
use rand::Rng;
use std::path::{Path, PathBuf};

/// A raw safetensors file from a header string and data bytes.
fn raw(path: &Path, header: &str, data: &[u8]) {
    let mut b = (header.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(header.as_bytes());
    b.extend_from_slice(data);
    std::fs::write(path, b).unwrap();
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let t = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &t);
        } else {
            std::fs::copy(e.path(), &t).unwrap();
        }
    }
}

/// The shard of `dir` holding `name`.
fn shard_with(dir: &Path, name: &str) -> PathBuf {
    shards(dir)
        .into_iter()
        .find(|p| TensorFile::open(p).unwrap().contains(name))
        .unwrap_or_else(|| panic!("no shard of {} holds {name}", dir.display()))
}

/// Rewrite `file` with tensor `name` replaced by `(dtype, shape, bytes)`.
fn replace_tensor(file: &Path, name: &str, dtype: Dtype, shape: &[usize], bytes: Vec<u8>) {
    let f = TensorFile::open(file).unwrap();
    let mut out = vec![];
    for n in f.names() {
        if n == name {
            out.push((TensorSpec::new(n, dtype, shape), bytes.clone()));
        } else {
            let t = f.info(n).unwrap();
            out.push((
                TensorSpec::new(n, t.dtype, &t.shape),
                f.bytes(n).unwrap().to_vec(),
            ));
        }
    }
    let meta = f.metadata().clone();
    drop(f);
    let tmp = file.with_extension("tmp");
    write_file(&tmp, out, Some(meta)).unwrap();
    std::fs::rename(&tmp, file).unwrap();
}

/// One broken input: the path handed to the command and the path stderr must name.
struct Broken {
    what: String,
    arg: PathBuf,
    names: PathBuf,
}

/// The broken-file kinds every command that reads one safetensors file must survive.
fn broken_files(dir: &Path, good_file: &Path, tag: &str) -> Vec<Broken> {
    let d = dir.join(format!("files-{tag}"));
    std::fs::create_dir_all(&d).unwrap();
    let mut v = vec![];
    let mut push = |what: &str, p: PathBuf| {
        v.push(Broken {
            what: format!("{tag}: {what}"),
            arg: p.clone(),
            names: p,
        })
    };
    push("missing path", d.join("missing.safetensors"));
    let p = d.join("empty.safetensors");
    std::fs::write(&p, b"").unwrap();
    push("empty file", p);
    let bytes = std::fs::read(good_file).unwrap();
    let p = d.join("truncated.safetensors");
    std::fs::write(&p, &bytes[..bytes.len() - 5]).unwrap();
    push("truncated safetensors", p);
    let p = d.join("nonjson.safetensors");
    raw(&p, "this is not { json at all", &[0u8; 16]);
    push("non-JSON header", p);
    let p = d.join("past-end.safetensors");
    raw(
        &p,
        r#"{"hidden_states":{"dtype":"F32","shape":[4,64],"data_offsets":[0,1024]}}"#,
        &[0u8; 32],
    );
    push("offsets past the end", p);
    let p = d.join("short.safetensors");
    std::fs::write(&p, [7u8, 0, 0]).unwrap();
    push("3-byte file", p);
    v
}

/// Broken checkpoint directories: each a copy of `good` with one damage.
fn broken_checkpoints(dir: &Path, good: &Path, r: &mut impl Rng) -> Vec<Broken> {
    let d = dir.join("ckpts");
    std::fs::create_dir_all(&d).unwrap();
    let mut v = vec![];
    let p = d.join("missing");
    v.push(Broken {
        what: "checkpoint: missing path".into(),
        arg: p.clone(),
        names: p,
    });
    let p = d.join("no-tensors");
    std::fs::create_dir_all(&p).unwrap();
    std::fs::write(p.join("README.txt"), "no tensors here").unwrap();
    v.push(Broken {
        what: "checkpoint: directory without tensors".into(),
        arg: p.clone(),
        names: p,
    });
    let p = d.join("bad-config");
    copy_dir(good, &p);
    std::fs::write(p.join("config.json"), "{\"hidden_size\": 256, oops").unwrap();
    v.push(Broken {
        what: "checkpoint: broken config.json".into(),
        arg: p.clone(),
        names: p.join("config.json"),
    });
    let p = d.join("truncated-shard");
    copy_dir(good, &p);
    let s = shards(&p).pop().unwrap();
    let bytes = std::fs::read(&s).unwrap();
    let cut = r.gen_range(1..64);
    std::fs::write(&s, &bytes[..bytes.len() - cut]).unwrap();
    v.push(Broken {
        what: format!("checkpoint: shard truncated by {cut} bytes"),
        arg: p.clone(),
        names: s,
    });
    let p = d.join("nonjson-shard");
    copy_dir(good, &p);
    let s = shards(&p).remove(0);
    let mut bytes = std::fs::read(&s).unwrap();
    bytes[8] = b'#';
    std::fs::write(&s, bytes).unwrap();
    v.push(Broken {
        what: "checkpoint: shard header not JSON".into(),
        arg: p.clone(),
        names: s,
    });
    v
}

/// Checkpoints whose expert tensors are of the wrong dtype or shape for the MoE commands.
fn wrong_tensors(dir: &Path, good: &Path) -> Vec<Broken> {
    let d = dir.join("wrong");
    std::fs::create_dir_all(&d).unwrap();
    let name = "model.layers.1.mlp.experts.3.up_proj.weight";
    let info = {
        let s = shard_with(good, name);
        TensorFile::open(&s).unwrap().info(name).unwrap().clone()
    };
    let numel = info.numel();
    let mut v = vec![];
    let p = d.join("dtype");
    copy_dir(good, &p);
    let s = shard_with(&p, name);
    replace_tensor(&s, name, Dtype::F32, &info.shape, vec![0x3c; numel * 4]);
    v.push(Broken {
        what: format!("checkpoint: {name} as F32"),
        arg: p,
        names: s,
    });
    let p = d.join("shape");
    copy_dir(good, &p);
    let s = shard_with(&p, name);
    let shape = [info.shape[0] / 2, info.shape[1]];
    replace_tensor(&s, name, info.dtype, &shape, vec![0x11; numel / 2]);
    v.push(Broken {
        what: format!("checkpoint: {name} with shape {shape:?}"),
        arg: p,
        names: s,
    });
    v
}

/// One damage done to a file's bytes.
type Damage = fn(&mut Vec<u8>);

/// Broken trace directories for nan-locate and bisect.
fn broken_traces(dir: &Path, good: &Path) -> Vec<Broken> {
    let d = dir.join("traces");
    std::fs::create_dir_all(&d).unwrap();
    let mut v = vec![];
    let p = d.join("missing");
    v.push(Broken {
        what: "trace: missing path".into(),
        arg: p.clone(),
        names: p,
    });
    let p = d.join("empty-dir");
    std::fs::create_dir_all(&p).unwrap();
    v.push(Broken {
        what: "trace: directory without trace files".into(),
        arg: p.clone(),
        names: p,
    });
    let files = shards(good);
    let damages: [(&str, Damage); 4] = [
        ("empty trace file", |b| b.clear()),
        ("truncated trace file", |b| {
            let n = b.len() - 3;
            b.truncate(n)
        }),
        ("trace header not JSON", |b| b[8] = b'!'),
        ("trace offsets past the end", |b| {
            let n = b.len() - 8;
            b.truncate(n);
        }),
    ];
    for (i, (what, damage)) in damages.into_iter().enumerate() {
        let p = d.join(format!("t{i}"));
        copy_dir(good, &p);
        let victim = p.join(files[(i * 3) % files.len()].file_name().unwrap());
        let mut b = std::fs::read(&victim).unwrap();
        damage(&mut b);
        std::fs::write(&victim, b).unwrap();
        v.push(Broken {
            what: format!("trace: {what}"),
            arg: p,
            names: victim,
        });
    }
    v
}

/// Broken case files for `run`.
fn broken_cases(dir: &Path) -> Vec<Broken> {
    let d = dir.join("cases");
    std::fs::create_dir_all(&d).unwrap();
    let mut v = vec![];
    let mut add = |what: &str, name: &str, text: Option<&str>| {
        let p = d.join(name);
        if let Some(t) = text {
            std::fs::write(&p, t).unwrap();
        }
        v.push(Broken {
            what: format!("case: {what}"),
            arg: p.clone(),
            names: p,
        });
    };
    add("missing path", "missing.toml", None);
    add("empty file", "empty.toml", Some(""));
    add("not TOML", "garbage.toml", Some("command = [[[ \u{0}"));
    add(
        "unknown command",
        "unknown.toml",
        Some("description = \"x\"\ncommand = \"frobnicate\"\nexpect = \"pass\"\n"),
    );
    add(
        "wrong type",
        "type.toml",
        Some("description = \"x\"\ncommand = \"layertest\"\nargs = 3\nexpect = \"pass\"\n"),
    );
    v
}

/// Does `cmd` take a positional file argument yet? (`routing` and `compare-weights` are being
/// finished elsewhere; until they are, their rows are reported as skipped, not passed.)
fn takes_positional(cmd: &str) -> bool {
    let o = run(&[cmd, "--help"]);
    let h = stdout(&o);
    h.lines()
        .skip_while(|l| !l.starts_with("Arguments:"))
        .nth(1)
        .is_some_and(|l| l.trim_start().starts_with('<'))
}

fn check(cmd: &[String], b: &Broken, failures: &mut Vec<String>) {
    let args: Vec<&str> = cmd.iter().map(|s| s.as_str()).collect();
    let o = run(&args);
    let err = stderr(&o);
    let want = b.names.display().to_string();
    let mut why = vec![];
    if code(&o) != 2 {
        why.push(format!("exit {} (want 2)", code(&o)));
    }
    if !err.contains(&want) {
        why.push(format!("stderr does not name {want}"));
    }
    if err.contains("panicked") {
        why.push("panicked".into());
    }
    if !why.is_empty() {
        failures.push(format!(
            "{} [{}]: {}\n  stderr: {}",
            args.join(" "),
            b.what,
            why.join("; "),
            err.trim()
        ));
    }
}

#[test]
fn every_reader_rejects_every_broken_input_with_exit_2() {
    let (seed, mut r) = rng("bad_input_matrix");
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let good = dir.join("good");
    let o = run(&[
        "synth",
        "--out",
        p(&good),
        "--preset",
        "tiny",
        "--no-originals",
        "--seed",
        &r.gen::<u32>().to_string(),
    ]);
    assert_eq!(code(&o), 0, "synth: {}", stderr(&o));
    let trace = dir.join("trace");
    let o = run(&[
        "synth-trace",
        "--out",
        p(&trace),
        "--seed",
        &r.gen::<u32>().to_string(),
    ]);
    assert_eq!(code(&o), 0, "synth-trace: {}", stderr(&o));
    let good_file = shards(&good).remove(0);
    let out = dir.join("out");
    let s = |p: &Path| p.display().to_string();

    let files = broken_files(dir, &good_file, "file");
    let ckpts = broken_checkpoints(dir, &good, &mut r);
    let wrong = wrong_tensors(dir, &good);
    let traces = broken_traces(dir, &trace);
    let cases = broken_cases(dir);
    let ckpt_and_files: Vec<&Broken> = ckpts.iter().chain(files.iter()).collect();

    let mut rows: Vec<(Vec<String>, &Broken)> = vec![];
    let v = |a: &[&str]| a.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    for b in &ckpt_and_files {
        let a = s(&b.arg);
        rows.push((v(&["audit", &a]), b));
        rows.push((v(&["quantize", &a, &s(&out.join("q"))]), b));
        for c in ["layertest", "gs-sweep", "multilayer"] {
            let mut args = v(&[c, "--checkpoint", &a, "--tokens", "8"]);
            if c == "gs-sweep" {
                args.extend(v(&["--points", "3"]));
            }
            rows.push((args, b));
        }
    }
    for b in &wrong {
        let a = s(&b.arg);
        for c in ["layertest", "gs-sweep", "multilayer"] {
            let mut args = v(&[c, "--checkpoint", &a, "--tokens", "8"]);
            if c == "gs-sweep" {
                args.extend(v(&["--points", "3"]));
            }
            rows.push((args, b));
        }
    }
    for b in &files {
        let a = s(&b.arg);
        rows.push((v(&["layertest", "--input", &a]), b));
    }
    let mut skipped = vec![];
    if takes_positional("routing") {
        for b in &files {
            rows.push((v(&["routing", &s(&b.arg)]), b));
        }
    } else {
        skipped.push("routing");
    }
    if takes_positional("compare-weights") {
        for b in &ckpt_and_files {
            let a = s(&b.arg);
            rows.push((v(&["compare-weights", &a, &s(&good)]), b));
            rows.push((v(&["compare-weights", &s(&good), &a]), b));
        }
    } else {
        skipped.push("compare-weights");
    }
    for b in &traces {
        let a = s(&b.arg);
        rows.push((v(&["nan-locate", &a]), b));
        rows.push((v(&["bisect", &a, &s(&trace)]), b));
        rows.push((v(&["bisect", &s(&trace), &a]), b));
    }
    for b in &cases {
        rows.push((v(&["run", &s(&b.arg)]), b));
    }

    let before = snapshot(dir);
    let mut failures = vec![];
    for (cmd, b) in &rows {
        check(cmd, b, &mut failures);
    }
    // inputs are opened read-only and never modified
    let after: Vec<_> = snapshot(dir)
        .into_iter()
        .filter(|(p, _)| !p.starts_with(&out))
        .collect();
    let before: Vec<_> = before
        .into_iter()
        .filter(|(p, _)| !p.starts_with(&out))
        .collect();
    assert!(before == after, "seed {seed}: an input was modified");
    if !skipped.is_empty() {
        eprintln!("skipped (no positional argument yet): {skipped:?}");
    }
    assert!(
        failures.is_empty(),
        "seed {seed}: {} of {} rows failed:\n{}",
        failures.len(),
        rows.len(),
        failures.join("\n")
    );
    eprintln!("{} rows, seed {seed}", rows.len());
}

/// Run the binary under GNU `time` (when there is one) for its peak resident set, in KiB.
fn peak_kib(args: &[&str]) -> Option<(std::process::Output, u64)> {
    let time = Path::new("/usr/bin/time");
    if !time.exists() {
        return None;
    }
    let o = std::process::Command::new(time)
        .args(["-f", "PEAK_KIB=%M", bin()])
        .args(args)
        .args(["--quiet", "--no-report-dir"])
        .output()
        .unwrap();
    let err = stderr(&o);
    let kib = err
        .lines()
        .rev()
        .find_map(|l| l.strip_prefix("PEAK_KIB="))
        .and_then(|v| v.trim().parse().ok())?;
    Some((o, kib))
}

/// A header claiming terabytes, or far more tensors than any shard holds, is refused before
/// anything that size is allocated; a trace of thousands of files is scanned in bounded memory.
#[test]
fn resource_bounds_on_absurd_inputs() {
    let (seed, mut r) = rng("resource_bounds");
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();

    // header length of ~1 TB in an 8 KiB file
    let tb = d.join("terabyte-header.safetensors");
    let claim: u64 = (1u64 << 40) + r.gen_range(0..1u64 << 30);
    let mut b = claim.to_le_bytes().to_vec();
    b.extend_from_slice(b"{\"a\":{}}");
    b.resize(8192, b' ');
    std::fs::write(&tb, &b).unwrap();
    // a tensor claiming terabytes of data in a small file
    let big = d.join("terabyte-tensor.safetensors");
    raw(
        &big,
        &format!(
            r#"{{"model.layers.0.mlp.gate.weight":{{"dtype":"F32","shape":[{},{}],"data_offsets":[0,{}]}}}}"#,
            1u64 << 20,
            1u64 << 18,
            1u64 << 40
        ),
        &[1u8; 64],
    );
    for f in [&tb, &big] {
        for cmd in [
            vec!["audit", p(f)],
            vec!["layertest", "--input", p(f)],
            vec!["quantize", p(f), p(&d.join("q"))],
            vec!["routing", p(f)],
        ] {
            let (o, kib) = match peak_kib(&cmd) {
                Some(x) => x,
                None => (run(&cmd), 0),
            };
            assert_eq!(code(&o), 2, "seed {seed}: {cmd:?}: {}", stderr(&o));
            assert!(stderr(&o).contains(p(f)), "{cmd:?}: {}", stderr(&o));
            assert!(!stderr(&o).contains("panicked"), "{cmd:?}: {}", stderr(&o));
            assert!(kib < 256 << 10, "{cmd:?}: peak {kib} KiB on an 8 KiB file");
        }
    }
    // the same claims inside a trace
    let tr = d.join("trace");
    std::fs::create_dir_all(&tr).unwrap();
    std::fs::copy(&tb, tr.join("000000-model.embed.safetensors")).unwrap();
    let o = run(&["nan-locate", p(&tr)]);
    assert_eq!(code(&o), 2, "nan-locate: {}", stderr(&o));
    assert!(stderr(&o).contains("000000-model.embed.safetensors"));

    // a million zero-size tensors: a valid file, but the header must still parse in bounded
    // memory (a few hundred bytes per tensor) or be refused
    let many = d.join("many-tensors.safetensors");
    let n = 1_000_000 + r.gen_range(0..1000);
    let mut h = String::with_capacity(n * 56);
    h.push('{');
    for i in 0..n {
        if i > 0 {
            h.push(',');
        }
        h.push_str(&format!(
            r#""t{i}":{{"dtype":"U8","shape":[0],"data_offsets":[0,0]}}"#
        ));
    }
    h.push('}');
    raw(&many, &h, &[]);
    // loaded as a checkpoint by `layertest`, which then finds no MoE layer in it: the
    // loader's cost alone (it peaked at 1.5 GB before header entries were streamed)
    if let Some((o, kib)) = peak_kib(&["layertest", "--checkpoint", p(&many)]) {
        assert_eq!(
            code(&o),
            2,
            "seed {seed}: {n} empty tensors: {}",
            stderr(&o)
        );
        assert!(stderr(&o).contains(p(&many)), "{}", stderr(&o));
        assert!(!stderr(&o).contains("panicked"), "{}", stderr(&o));
        assert!(
            kib < 768 << 10,
            "seed {seed}: loading a {} MB header with {n} tensors peaked at {} MiB",
            h.len() >> 20,
            kib >> 10
        );
        eprintln!("{n} tensors: peak {} MiB", kib >> 10);
    }
    // the same header as `layertest --input` (which then finds no `hidden_states`: exit 2) and
    // as a trace file: both went through the `safetensors` crate's parser, which peaked at
    // ~950 MiB; now the checkpoint reader's streaming one
    let many_trace = d.join("many-tensor-trace");
    std::fs::create_dir_all(&many_trace).unwrap();
    std::fs::copy(&many, many_trace.join("000000-model.embed.safetensors")).unwrap();
    for (cmd, named, want) in [
        (
            vec!["layertest", "--input", p(&many), "--device", "cpu"],
            p(&many).to_string(),
            2,
        ),
        // the file has no `output`: with nothing else in the trace, nothing was scanned, which
        // is bad input naming the file (it used to "PASS … 1 module calls")
        (
            vec!["nan-locate", p(&many_trace)],
            "000000-model.embed.safetensors".to_string(),
            2,
        ),
        // as a routing dump (no `topk_ids`: exit 2): the `safetensors` crate's parser, unbounded
        // in memory on this header, until dumps went through the checkpoint reader
        (vec!["routing", p(&many)], p(&many).to_string(), 2),
    ] {
        let Some((o, kib)) = peak_kib(&cmd) else {
            break;
        };
        let out = format!("{}{}", stdout(&o), stderr(&o));
        assert_eq!(code(&o), want, "seed {seed}: {cmd:?}: {out}");
        assert!(out.contains(&named), "{cmd:?}: {out}");
        assert!(!out.contains("panicked"), "{cmd:?}: {out}");
        assert!(
            kib < 768 << 10,
            "seed {seed}: {cmd:?} on a {} MB header with {n} tensors peaked at {} MiB",
            h.len() >> 20,
            kib >> 10
        );
        eprintln!("{cmd:?}: {n} tensors: peak {} MiB", kib >> 10);
    }

    // thousands of trace files: scanned, not held open; one NaN in the last is found
    let many_dir = d.join("many-trace");
    std::fs::create_dir_all(&many_dir).unwrap();
    let files = 3000 + r.gen_range(0..500);
    for i in 0..files {
        let v = if i == files - 1 { f32::NAN } else { i as f32 };
        nvfp4dbg::checkpoint::writer::write_file(
            &many_dir.join(format!("{i:06}-model.layers.{}.mlp.safetensors", i % 61)),
            vec![(
                TensorSpec::new("output", Dtype::F32, &[1, 2]),
                nvfp4dbg::checkpoint::writer::f32_bytes(&[1.0, v]),
            )],
            None,
        )
        .unwrap();
    }
    let o = run(&["nan-locate", p(&many_dir)]);
    assert_eq!(
        code(&o),
        1,
        "seed {seed}: nan-locate over {files} files: {}",
        stderr(&o)
    );
    let last = format!("{:06}-model.layers.", files - 1);
    assert!(
        stdout(&o).contains(&last) || stderr(&o).contains(&last),
        "seed {seed}: nan-locate did not point at {last}: {}",
        stdout(&o)
    );
}

/// Every input under `tests/data/fuzz-regressions/<target>/` through the same calls as that
/// fuzz target (fuzz/fuzz_targets/<target>.rs): each must come back as a value, never a panic.
#[test]
fn fuzz_regressions_replay() {
    use nvfp4dbg::checkpoint::config::{parse_config, parse_hf_quant_config};
    use nvfp4dbg::checkpoint::Checkpoint;
    use nvfp4dbg::trace::{parse_file_name, TraceFile};
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/fuzz-regressions");
    let tmp = tempfile::tempdir().unwrap();
    let mut replayed = 0;
    for target in [
        "safetensors_file",
        "config_json",
        "shard_index",
        "trace_file",
        "case_toml",
        "rules_toml",
    ] {
        let mut inputs: Vec<PathBuf> = std::fs::read_dir(root.join(target))
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| !p.file_name().unwrap().to_string_lossy().starts_with('.'))
            .collect();
        inputs.sort();
        for input in inputs {
            let data = std::fs::read(&input).unwrap();
            let what = input.display().to_string();
            let r = std::panic::catch_unwind(|| match target {
                "safetensors_file" => {
                    let p = tmp.path().join("x.safetensors");
                    std::fs::write(&p, &data).unwrap();
                    if let Ok(f) = TensorFile::open(&p) {
                        let names: Vec<String> = f.names().map(str::to_string).collect();
                        for n in &names {
                            let _ = f.to_f32(n);
                            let _ = f.to_i64(n);
                            let _ = f.scalar_f32(n);
                        }
                    }
                }
                "config_json" => {
                    let _ = parse_config(Path::new("config.json"), &data, None);
                    let hint = data.first().map(|b| *b as usize % 8);
                    let _ = parse_config(Path::new("config.json"), &data, hint);
                    let _ = parse_hf_quant_config(Path::new("hf_quant_config.json"), &data);
                }
                "shard_index" => {
                    let d = tmp.path().join("ckpt");
                    std::fs::create_dir_all(&d).unwrap();
                    for shard in [
                        "model-00001-of-00002.safetensors",
                        "model-00002-of-00002.safetensors",
                    ] {
                        let first = if shard.starts_with("model-00001") {
                            "a.weight"
                        } else {
                            "c.weight"
                        };
                        write_file(
                            &d.join(shard),
                            vec![
                                (
                                    TensorSpec::new(first, Dtype::F32, &[2, 2]),
                                    nvfp4dbg::checkpoint::writer::f32_bytes(&[
                                        1.0, -2.0, 3.5, 0.25,
                                    ]),
                                ),
                                (
                                    TensorSpec::new("b.weight", Dtype::F32, &[2]),
                                    nvfp4dbg::checkpoint::writer::f32_bytes(&[7.0, 8.0]),
                                ),
                            ],
                            None,
                        )
                        .unwrap();
                    }
                    std::fs::write(d.join("model.safetensors.index.json"), &data).unwrap();
                    if let Ok(c) = Checkpoint::open(&d) {
                        let names: Vec<String> = c.names().map(str::to_string).collect();
                        for n in &names {
                            let _ = c.to_f32(n);
                        }
                        let _ = c.config();
                    }
                }
                "trace_file" => {
                    let (name, body) = match data.iter().position(|&b| b == b'\n') {
                        Some(i) => (&data[..i], &data[i + 1..]),
                        None => (&b""[..], &data[..]),
                    };
                    if let Ok(name) = std::str::from_utf8(name) {
                        let _ = parse_file_name(name);
                    }
                    let p = tmp.path().join("000001-model.layers.0.mlp.safetensors");
                    std::fs::write(&p, body).unwrap();
                    if let Ok(f) = TraceFile::open(&p) {
                        let mut out = Vec::new();
                        for t in f.tensors() {
                            let n = t.numel();
                            t.read_f32(0, n, &mut out);
                            t.read_f32(n / 2, n, &mut out);
                            t.read_f32(n, 1, &mut out);
                        }
                    }
                }
                "case_toml" => {
                    let p = tmp.path().join("case.toml");
                    std::fs::write(&p, &data).unwrap();
                    let _ = nvfp4dbg::cli::run_case::load_case(&p);
                }
                "rules_toml" => {
                    use nvfp4dbg::weights::rules::{Renames, Side};
                    let p = tmp.path().join("rules.toml");
                    std::fs::write(&p, &data).unwrap();
                    if let Ok(r) = Renames::load(&["model.".to_string()], Some(&p)) {
                        for n in [
                            "model.layers.3.mlp.experts.7.gate_proj.weight",
                            "layers.3.ffn.experts.7.w1.weight_scale",
                        ] {
                            let _ = r.apply(n, Side::A);
                            let _ = r.apply(n, Side::B);
                        }
                    }
                }
                _ => unreachable!(),
            });
            assert!(r.is_ok(), "{what}: panicked");
            replayed += 1;
        }
    }
    eprintln!("replayed {replayed} fuzz regression inputs");
}

/// A routing dump with no routing decision in it (0 tokens, or top-k 0) passed every check
/// without making one ("PASS: 0 tokens × K experts"): it is bad input naming the file and
/// `topk_ids`. The same dump with tokens in it is judged (exit 0 or 1), so the refusal is
/// about emptiness, not the layout.
#[test]
fn an_empty_routing_dump_is_bad_input() {
    let (seed, mut r) = rng("empty_routing_dump");
    let tmp = tempfile::tempdir().unwrap();
    let experts = 4 * r.gen_range(2..9usize);
    for (i, (tokens, k)) in [(0, r.gen_range(1..5usize)), (r.gen_range(1..9), 0), (0, 0)]
        .into_iter()
        .chain([(r.gen_range(1..9usize), r.gen_range(1..4usize))])
        .enumerate()
    {
        let lead: Vec<usize> = if r.gen_bool(0.5) {
            vec![tokens]
        } else {
            vec![1, tokens]
        };
        let mut shape = lead.clone();
        shape.push(k);
        let n = tokens * k;
        // distinct ids per token in range, weights that sum to 1 per token
        let ids: Vec<u8> = (0..tokens)
            .flat_map(|t| (0..k).map(move |j| ((t + j * 3) % experts) as i64))
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let w: Vec<u8> = (0..n)
            .map(|_| 1.0f32 / k as f32)
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let header = format!(
            r#"{{"topk_ids":{{"dtype":"I64","shape":{shape:?},"data_offsets":[0,{}]}},"topk_weights":{{"dtype":"F32","shape":{shape:?},"data_offsets":[{},{}]}}}}"#,
            n * 8,
            n * 8,
            n * 12
        );
        let f = tmp.path().join(format!("dump{i}.safetensors"));
        let mut data = ids;
        data.extend(w);
        raw(&f, &header, &data);
        let o = run(&["routing", p(&f), "--num-experts", &experts.to_string()]);
        let ctx = format!("seed {seed}: shape {shape:?}\n{}{}", stdout(&o), stderr(&o));
        assert!(!stderr(&o).contains("panicked"), "{ctx}");
        if n == 0 {
            assert_eq!(code(&o), 2, "{ctx}");
            assert!(stderr(&o).contains(p(&f)), "{ctx}");
            assert!(stderr(&o).contains("topk_ids"), "{ctx}");
        } else {
            assert_ne!(code(&o), 2, "{ctx}");
        }
    }
}
