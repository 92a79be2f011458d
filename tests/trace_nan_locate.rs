//! `nan-locate` end to end through the binary, on synthetic traces (planted faults that
//! propagate) and hand-written ones (edge cases of naming, ordering, ranks, steps, bad files).

#[path = "trace_util/mod.rs"]
mod util;

use nvfp4dbg::trace::synthetic::{module_calls, write_trace, Fault, FaultKind, SynthTraceConfig};
use rand::Rng;
use serde_json::Value;
use util::*;

fn cfg(seed: u64) -> SynthTraceConfig {
    SynthTraceConfig {
        seed,
        ..Default::default()
    }
}

#[test]
fn a_planted_nan_or_inf_is_named_with_its_module_index_and_clean_inputs() {
    let seed: u64 = rand::random();
    let mut r = rng(seed);
    let tmp = tempfile::tempdir().unwrap();
    let base = cfg(seed);
    let calls = module_calls(&base).unwrap();
    for round in 0..4 {
        let at = r.gen_range(0..calls.len());
        let (token, channel) = (r.gen_range(0..base.tokens), r.gen_range(0..base.hidden));
        let kind = if round % 2 == 0 {
            FaultKind::Nan
        } else {
            FaultKind::Inf
        };
        let c = SynthTraceConfig {
            faults: vec![Fault {
                module: calls[at].clone(),
                kind,
                token,
                channel,
            }],
            dtype: [
                safetensors::Dtype::BF16,
                safetensors::Dtype::F16,
                safetensors::Dtype::F32,
            ][round % 3],
            ..base.clone()
        };
        let dir = tmp.path().join(format!("t{round}"));
        write_trace(&dir, &c).unwrap();
        let o = nvfp4dbg(
            tmp.path(),
            &["nan-locate", dir.to_str().unwrap(), "--context", "3"],
        );
        let ctx = format!(
            "seed {seed}, round {round}, fault {kind:?} at {} [{token}, {channel}]\n{}",
            calls[at],
            o.show()
        );
        assert_eq!(o.code, 1, "{ctx}");
        let f = &o.json["first_nonfinite"];
        assert_eq!(f["module"], calls[at].as_str(), "{ctx}");
        assert_eq!(f["tensor"], "output", "{ctx}");
        assert_eq!(f["counter"], at as u64, "{ctx}");
        assert_eq!(f["index"]["token"], token as u64, "{ctx}");
        assert_eq!(f["index"]["channel"], channel as u64, "{ctx}");
        assert_eq!(
            f["index"]["multi"],
            serde_json::json!([token, channel]),
            "{ctx}"
        );
        assert_eq!(
            f["kind"],
            if kind == FaultKind::Nan { "nan" } else { "inf" },
            "{ctx}"
        );
        assert_eq!(f["inputs_clean"], true, "{ctx}");
        assert!(
            f["file"]
                .as_str()
                .unwrap()
                .ends_with(&format!("{at:06}-{}.safetensors", calls[at])),
            "{ctx}"
        );
        if at == 0 {
            assert_eq!(o.json["last_clean"], Value::Null, "{ctx}");
        } else {
            assert_eq!(
                o.json["last_clean"]["module"],
                calls[at - 1].as_str(),
                "{ctx}"
            );
            assert_eq!(o.json["last_clean"]["counter"], (at - 1) as u64, "{ctx}");
        }
        // the table: up to 3 calls before, the bad one, 3 after
        let window = o.json["modules"].as_array().unwrap();
        let want = at.min(3) + 1 + (calls.len() - at - 1).min(3);
        assert_eq!(window.len(), want, "{ctx}");
        assert!(o.stdout.contains("FIRST BAD"), "{ctx}");
        assert!(o.stdout.contains(&calls[at]), "{ctx}");
    }
}

#[test]
fn a_clean_trace_passes_and_a_minus_inf_mask_input_does_not_count() {
    let seed: u64 = rand::random();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("clean");
    write_trace(&dir, &cfg(seed)).unwrap();
    let o = nvfp4dbg(tmp.path(), &["nan-locate", dir.to_str().unwrap()]);
    assert_eq!(o.code, 0, "seed {seed}\n{}", o.show());
    assert_eq!(o.json["verdict"], "pass");
    assert_eq!(o.json["first_nonfinite"], Value::Null);
    assert_eq!(
        o.json["summary"]["calls_scanned"],
        module_calls(&cfg(seed)).unwrap().len() as u64
    );

    // an attention mask full of -inf is an input, the output is finite: not a fault
    let mut r = rng(seed);
    let d2 = tmp.path().join("mask");
    std::fs::create_dir(&d2).unwrap();
    let mut mask = randv(&mut r, 16);
    mask[3] = f32::NEG_INFINITY;
    write_call(
        &d2,
        0,
        "attn",
        vec![
            t("input.0", &[4, 4], randv(&mut r, 16)),
            t("input.1", &[4, 4], mask),
            t("output", &[4, 4], randv(&mut r, 16)),
        ],
        &[],
    );
    let o = nvfp4dbg(tmp.path(), &["nan-locate", d2.to_str().unwrap()]);
    assert_eq!(o.code, 0, "seed {seed}\n{}", o.show());
}

#[test]
fn bad_inputs_say_the_value_came_from_earlier() {
    let seed: u64 = rand::random();
    let mut r = rng(seed);
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("tr");
    std::fs::create_dir(&d).unwrap();
    write_call(
        &d,
        0,
        "model.embed",
        vec![t("output", &[3, 5], randv(&mut r, 15))],
        &[],
    );
    // between the two modules, unrecorded code (a residual add) made a NaN
    let bad_at = r.gen_range(0..15);
    let mut x = randv(&mut r, 15);
    x[bad_at] = f32::NAN;
    let mut y = randv(&mut r, 15);
    y[bad_at] = f32::NAN;
    write_call(
        &d,
        1,
        "model.layers.0",
        vec![t("input.0", &[3, 5], x), t("output", &[3, 5], y)],
        &[],
    );
    let o = nvfp4dbg(tmp.path(), &["nan-locate", d.to_str().unwrap()]);
    let ctx = format!("seed {seed}\n{}", o.show());
    assert_eq!(o.code, 1, "{ctx}");
    let f = &o.json["first_nonfinite"];
    assert_eq!(f["module"], "model.layers.0", "{ctx}");
    assert_eq!(f["inputs_clean"], false, "{ctx}");
    assert_eq!(f["bad_input"]["tensor"], "input.0", "{ctx}");
    assert_eq!(f["bad_input"]["index"]["flat"], bad_at as u64, "{ctx}");
    assert_eq!(o.json["last_clean"]["module"], "model.embed", "{ctx}");
    assert!(
        o.json["summary"]["text"]
            .as_str()
            .unwrap()
            .contains("came from code that ran before"),
        "{ctx}"
    );

    // no inputs recorded: unknown, said so
    let d = tmp.path().join("noin");
    std::fs::create_dir(&d).unwrap();
    write_call(
        &d,
        0,
        "m",
        vec![t("output", &[2], vec![f32::INFINITY, 1.0])],
        &[],
    );
    let o = nvfp4dbg(tmp.path(), &["nan-locate", d.to_str().unwrap()]);
    assert_eq!(o.code, 1, "{}", o.show());
    assert_eq!(o.json["first_nonfinite"]["inputs_clean"], Value::Null);
    assert_eq!(o.json["first_nonfinite"]["kind"], "inf");
}

#[test]
fn order_is_the_counter_not_the_name_nor_the_mtime() {
    let seed: u64 = rand::random();
    let mut r = rng(seed);
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("tr");
    std::fs::create_dir(&d).unwrap();
    // counters past 999999 have seven digits: by name, 1000000 sorts before 999998
    let counters = [999_997u64, 999_998, 999_999, 1_000_000, 1_000_001];
    let first_bad = r.gen_range(1..4);
    let now = std::time::SystemTime::now();
    for (i, &c) in counters.iter().enumerate().rev() {
        let mut v = randv(&mut r, 8);
        if i >= first_bad {
            v[i] = f32::NAN;
        }
        let p = write_call(&d, c, &format!("m{i}"), vec![t("output", &[2, 4], v)], &[]);
        // newest file = earliest call: an mtime order would be backwards
        let f = std::fs::File::options().write(true).open(&p).unwrap();
        f.set_modified(now - std::time::Duration::from_secs(100 * i as u64))
            .unwrap();
    }
    let o = nvfp4dbg(tmp.path(), &["nan-locate", d.to_str().unwrap()]);
    let ctx = format!("seed {seed} first_bad {first_bad}\n{}", o.show());
    assert_eq!(o.code, 1, "{ctx}");
    assert_eq!(
        o.json["first_nonfinite"]["counter"], counters[first_bad],
        "{ctx}"
    );
    assert_eq!(
        o.json["first_nonfinite"]["module"],
        format!("m{first_bad}"),
        "{ctx}"
    );
    assert_eq!(
        o.json["last_clean"]["counter"],
        counters[first_bad - 1],
        "{ctx}"
    );
}

#[test]
fn odd_names_and_duplicate_counters_are_listed_as_skipped() {
    let seed: u64 = rand::random();
    let mut r = rng(seed);
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("tr");
    std::fs::create_dir(&d).unwrap();
    write_call(&d, 0, "a", vec![t("output", &[4], randv(&mut r, 4))], &[]);
    write_call(&d, 1, "b", vec![t("output", &[4], randv(&mut r, 4))], &[]);
    // same counter as `b`: the later name is skipped
    write_call(&d, 1, "c", vec![t("output", &[4], vec![f32::NAN; 4])], &[]);
    std::fs::write(d.join("README.md"), "notes").unwrap();
    std::fs::write(d.join("00042-short.safetensors"), "x").unwrap();
    std::fs::write(d.join(".000003-tmp.safetensors"), "x").unwrap();
    write_call(&d, 2, "d", vec![t("input.0", &[4], randv(&mut r, 4))], &[]); // no output
    let o = nvfp4dbg(tmp.path(), &["nan-locate", d.to_str().unwrap()]);
    let ctx = format!("seed {seed}\n{}", o.show());
    // the duplicate `c` holds a NaN nobody looked at: never a pass
    assert_eq!(o.code, 1, "{ctx}");
    assert_eq!(o.json["verdict"], "fail", "{ctx}");
    assert_eq!(o.json["first_nonfinite"], Value::Null, "{ctx}");
    assert_eq!(o.json["summary"]["calls_scanned"], 2, "{ctx}");
    assert_eq!(o.json["summary"]["calls_unscanned"], 3, "{ctx}");
    let skipped = o.json["skipped"].as_array().unwrap();
    let entry = |name: &str| {
        skipped
            .iter()
            .find(|s| s["file"].as_str().unwrap().ends_with(name))
            .unwrap_or_else(|| panic!("{name} not skipped\n{ctx}"))
    };
    let reason = |name: &str| entry(name)["reason"].as_str().unwrap().to_string();
    for (name, unscanned) in [
        ("000001-c.safetensors", true),
        ("00042-short.safetensors", true),
        ("000002-d.safetensors", true),
        ("README.md", false),
        (".000003-tmp.safetensors", false),
    ] {
        assert_eq!(entry(name)["unscanned_call"], unscanned, "{name}\n{ctx}");
        // the unscanned ones are named in the headline
        assert_eq!(
            o.json["summary"]["text"].as_str().unwrap().contains(name),
            unscanned,
            "{name}\n{ctx}"
        );
    }
    assert!(
        reason("000001-c.safetensors").contains("duplicate counter 000001"),
        "{ctx}"
    );
    assert!(
        reason("README.md").contains("NNNNNN-<module.path>.safetensors"),
        "{ctx}"
    );
    assert!(
        reason("00042-short.safetensors").contains("six-digit"),
        "{ctx}"
    );
    assert!(
        reason(".000003-tmp.safetensors").contains("hidden"),
        "{ctx}"
    );
    assert!(
        reason("000002-d.safetensors").contains("no `output`"),
        "{ctx}"
    );
    assert_eq!(skipped.len(), 5, "{ctx}");
    assert!(o.stdout.contains("Skipped files"), "{ctx}");
}

#[test]
fn bad_input_exits_2_naming_the_file() {
    let seed: u64 = rand::random();
    let mut r = rng(seed);
    let tmp = tempfile::tempdir().unwrap();
    // no trace file at all
    let d = tmp.path().join("junk");
    std::fs::create_dir(&d).unwrap();
    std::fs::write(d.join("notes.txt"), "x").unwrap();
    let o = nvfp4dbg(tmp.path(), &["nan-locate", d.to_str().unwrap()]);
    assert_eq!(o.code, 2, "{}", o.show());
    assert!(
        o.stderr.contains("junk") && o.stderr.contains("no trace files"),
        "{}",
        o.show()
    );
    let e = tmp.path().join("empty");
    std::fs::create_dir(&e).unwrap();
    assert_eq!(
        nvfp4dbg(tmp.path(), &["nan-locate", e.to_str().unwrap()]).code,
        2
    );
    assert_eq!(
        nvfp4dbg(tmp.path(), &["nan-locate", "does-not-exist"]).code,
        2
    );

    // a truncated file among good ones
    let d = tmp.path().join("trunc");
    std::fs::create_dir(&d).unwrap();
    write_call(&d, 0, "a", vec![t("output", &[16], randv(&mut r, 16))], &[]);
    let p = write_call(&d, 1, "b", vec![t("output", &[16], randv(&mut r, 16))], &[]);
    let bytes = std::fs::read(&p).unwrap();
    let cut = r.gen_range(0..bytes.len());
    std::fs::write(&p, &bytes[..cut]).unwrap();
    let o = nvfp4dbg(tmp.path(), &["nan-locate", d.to_str().unwrap()]);
    assert_eq!(o.code, 2, "seed {seed} cut {cut}\n{}", o.show());
    assert!(
        o.stderr.contains("000001-b.safetensors"),
        "seed {seed} cut {cut}\n{}",
        o.show()
    );

    // metadata that is not a number
    let d = tmp.path().join("meta");
    std::fs::create_dir(&d).unwrap();
    write_call(
        &d,
        0,
        "a",
        vec![t("output", &[4], randv(&mut r, 4))],
        &[("rank", "zero")],
    );
    let o = nvfp4dbg(tmp.path(), &["nan-locate", d.to_str().unwrap()]);
    assert_eq!(o.code, 2, "{}", o.show());
    assert!(
        o.stderr.contains("rank") && o.stderr.contains("000000-a.safetensors"),
        "{}",
        o.show()
    );
}

#[test]
fn ranks_in_subdirectories_and_steps_are_selected() {
    let seed: u64 = rand::random();
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("tp2");
    let nan_in = |m: &str| {
        vec![Fault {
            module: m.into(),
            kind: FaultKind::Nan,
            token: 1,
            channel: 2,
        }]
    };
    // rank 0 clean, rank 1 NaN in layer 0's MLP
    write_trace(
        &d.join("rank0"),
        &SynthTraceConfig {
            rank: Some(0),
            ..cfg(seed)
        },
    )
    .unwrap();
    write_trace(
        &d.join("rank1"),
        &SynthTraceConfig {
            rank: Some(1),
            faults: nan_in("model.layers.0.mlp.down_proj"),
            ..cfg(seed)
        },
    )
    .unwrap();
    let dir = d.to_str().unwrap();
    let o = nvfp4dbg(tmp.path(), &["nan-locate", dir, "--rank", "0"]);
    assert_eq!(o.code, 0, "seed {seed}\n{}", o.show());
    let o = nvfp4dbg(tmp.path(), &["nan-locate", dir, "--rank", "1"]);
    assert_eq!(o.code, 1, "seed {seed}\n{}", o.show());
    assert_eq!(
        o.json["first_nonfinite"]["module"],
        "model.layers.0.mlp.down_proj"
    );
    assert_eq!(o.json["first_nonfinite"]["rank"], 1);
    assert!(o.json["first_nonfinite"]["file"]
        .as_str()
        .unwrap()
        .contains("rank1"));
    let o = nvfp4dbg(tmp.path(), &["nan-locate", dir, "--rank", "5"]);
    assert_eq!(o.code, 2, "{}", o.show());
    assert!(o.stderr.contains("ranks present: 0, 1"), "{}", o.show());

    // steps in one directory with one running counter: step 0 clean, step 1 bad, step 2 clean
    let s = tmp.path().join("steps");
    let n = module_calls(&cfg(seed)).unwrap().len() as u64;
    write_trace(
        &s,
        &SynthTraceConfig {
            step: Some(0),
            ..cfg(seed)
        },
    )
    .unwrap();
    write_trace(
        &s,
        &SynthTraceConfig {
            step: Some(1),
            counter_start: n,
            faults: nan_in("model.layers.1.self_attn.o_proj"),
            ..cfg(seed)
        },
    )
    .unwrap();
    write_trace(
        &s,
        &SynthTraceConfig {
            step: Some(2),
            counter_start: 2 * n,
            ..cfg(seed)
        },
    )
    .unwrap();
    let dir = s.to_str().unwrap();
    let o = nvfp4dbg(tmp.path(), &["nan-locate", dir]);
    assert_eq!(o.code, 1, "{}", o.show());
    assert_eq!(o.json["first_nonfinite"]["step"], 1);
    assert_eq!(
        o.json["first_nonfinite"]["module"],
        "model.layers.1.self_attn.o_proj"
    );
    for step in ["0", "2"] {
        let o = nvfp4dbg(tmp.path(), &["nan-locate", dir, "--step", step]);
        assert_eq!(o.code, 0, "step {step}\n{}", o.show());
        assert_eq!(o.json["summary"]["calls_scanned"], n);
    }
    let o = nvfp4dbg(tmp.path(), &["nan-locate", dir, "--step", "7"]);
    assert_eq!(o.code, 2, "{}", o.show());
    assert!(o.stderr.contains("steps present: 0, 1, 2"), "{}", o.show());
    // calls that record no step beside calls that do: --step cannot place them, so they are
    // named as not scanned and the step does not pass (they were dropped without a word)
    let mixed = tmp.path().join("mixed");
    for (step, start, faults) in [
        (Some(0), 0, vec![]),
        (None, n, nan_in("model.layers.0.mlp.down_proj")),
    ] {
        let c = SynthTraceConfig {
            step,
            counter_start: start,
            faults,
            ..cfg(seed)
        };
        write_trace(&mixed, &c).unwrap();
    }
    let o = nvfp4dbg(
        tmp.path(),
        &["nan-locate", mixed.to_str().unwrap(), "--step", "0"],
    );
    assert_eq!(o.code, 1, "seed {seed}\n{}", o.show());
    assert_eq!(o.json["summary"]["calls_unscanned"], n, "{}", o.show());
    assert!(o.stdout.contains("records no step"), "{}", o.show());

    // steps recorded separately, counters restarting: order is (step, counter)
    let s = tmp.path().join("restart");
    write_trace(
        &s.join("step0"),
        &SynthTraceConfig {
            step: Some(0),
            faults: nan_in("lm_head"),
            ..cfg(seed)
        },
    )
    .unwrap();
    write_trace(
        &s.join("step1"),
        &SynthTraceConfig {
            step: Some(1),
            faults: nan_in("model.embed_tokens"),
            ..cfg(seed)
        },
    )
    .unwrap();
    let o = nvfp4dbg(tmp.path(), &["nan-locate", s.to_str().unwrap()]);
    assert_eq!(o.code, 1, "{}", o.show());
    assert_eq!(
        o.json["first_nonfinite"]["module"],
        "lm_head",
        "{}",
        o.show()
    );
    assert_eq!(o.json["first_nonfinite"]["step"], 0);
    assert!(
        o.json["skipped"].as_array().unwrap().is_empty(),
        "{}",
        o.show()
    );
}

#[test]
fn a_tensor_larger_than_one_scan_block_reports_the_right_index() {
    let seed: u64 = rand::random();
    let mut r = rng(seed);
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("big");
    std::fs::create_dir(&d).unwrap();
    // 4.3M elements: more than the 4M-element block the scan converts at a time
    let (tokens, hidden) = (2100usize, 2048usize);
    let mut x = vec![0.5f32; tokens * hidden];
    for v in x.iter_mut().step_by(97) {
        *v = r.gen_range(-4.0..4.0);
    }
    let bad = r.gen_range((1 << 22)..x.len());
    x[bad] = f32::NEG_INFINITY;
    write_call(
        &d,
        0,
        "big",
        vec![util::T {
            name: "output",
            dtype: safetensors::Dtype::BF16,
            shape: vec![tokens, hidden],
            data: x,
        }],
        &[],
    );
    let o = nvfp4dbg(tmp.path(), &["nan-locate", d.to_str().unwrap()]);
    let ctx = format!("seed {seed} bad {bad}\n{}", o.show());
    assert_eq!(o.code, 1, "{ctx}");
    let f = &o.json["first_nonfinite"];
    assert_eq!(f["index"]["flat"], bad as u64, "{ctx}");
    assert_eq!(f["index"]["token"], (bad / hidden) as u64, "{ctx}");
    assert_eq!(f["index"]["channel"], (bad % hidden) as u64, "{ctx}");
    assert_eq!(f["kind"], "inf", "{ctx}");
    assert_eq!(f["value"], "-inf", "{ctx}");
}

#[test]
fn ten_thousand_calls_scan_in_order() {
    let seed: u64 = rand::random();
    let mut r = rng(seed);
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("many");
    std::fs::create_dir(&d).unwrap();
    let n = 10_000u64;
    let bad = r.gen_range(n / 2..n);
    for c in 0..n {
        let mut v = randv(&mut r, 8);
        if c >= bad {
            v[(c % 8) as usize] = f32::NAN;
        }
        write_call(
            &d,
            c,
            &format!("model.layers.{}.mlp", c / 10),
            vec![t("output", &[2, 4], v)],
            &[],
        );
    }
    let t0 = std::time::Instant::now();
    let o = nvfp4dbg(tmp.path(), &["nan-locate", d.to_str().unwrap()]);
    let ctx = format!("seed {seed} bad {bad}\n{}", o.show());
    assert_eq!(o.code, 1, "{ctx}");
    assert_eq!(o.json["first_nonfinite"]["counter"], bad, "{ctx}");
    assert_eq!(o.json["summary"]["files_total"], n, "{ctx}");
    eprintln!("10k-file trace scanned in {:?}", t0.elapsed());
}

/// A file rewritten without its `output` (the recorder died mid-call, or wrote something else):
/// its other tensors are kept, renamed, so the file is a valid safetensors file.
fn strip_outputs(path: &std::path::Path, r: &mut rand_chacha::ChaCha8Rng) {
    let n = r.gen_range(1..4);
    let tensors: Vec<T> = (0..n)
        .map(|i| {
            let name: &'static str = ["input.0", "hidden", "scratch"][i];
            t(name, &[3], randv(r, 3))
        })
        .collect();
    std::fs::remove_file(path).unwrap();
    let dir = path.parent().unwrap();
    let (counter, module) =
        nvfp4dbg::trace::parse_file_name(path.file_name().unwrap().to_str().unwrap()).unwrap();
    write_call(dir, counter, &module, tensors, &[]);
}

/// Issue #5: a trace whose files were skipped passed as "PASS … N module calls". Nothing
/// scanned is bad input (exit 2 naming the trace and the files); a clean scan with calls left
/// out fails, naming them; a found NaN says earlier calls were not scanned; entries that are
/// not part of the trace (notes, hidden temporaries) do not change a pass.
#[test]
fn skipped_calls_are_never_a_pass() {
    let seed: u64 = rand::random();
    let mut r = rng(seed);
    let tmp = tempfile::tempdir().unwrap();

    // the only file has no output
    let only = tmp.path().join("only");
    std::fs::create_dir(&only).unwrap();
    let module = format!("model.layers.{}.mlp", r.gen_range(0..60));
    let p = write_call(
        &only,
        r.gen_range(0..1000),
        &module,
        vec![t("output", &[4], randv(&mut r, 4))],
        &[],
    );
    strip_outputs(&p, &mut r);
    let o = nvfp4dbg(tmp.path(), &["nan-locate", only.to_str().unwrap()]);
    let ctx = format!("seed {seed}\n{}", o.show());
    assert_eq!(o.code, 2, "{ctx}");
    assert!(!o.stdout.contains("PASS") && o.json.is_null(), "{ctx}");
    let name = p.file_name().unwrap().to_str().unwrap();
    assert!(o.stderr.contains(only.to_str().unwrap()), "{ctx}");
    assert!(o.stderr.contains(name), "{ctx}");
    assert!(o.stderr.contains("no `output`"), "{ctx}");
    assert!(!o.stderr.contains("panicked"), "{ctx}");

    // a synthetic trace with one call stripped of its output: the rest is clean
    let c = cfg(seed);
    let calls = module_calls(&c).unwrap();
    let d = tmp.path().join("one-stripped");
    let files = write_trace(&d, &c).unwrap();
    assert_eq!(files.len(), calls.len());
    let k = r.gen_range(0..files.len());
    strip_outputs(&files[k], &mut r);
    std::fs::write(d.join("README.md"), "notes").unwrap();
    let o = nvfp4dbg(tmp.path(), &["nan-locate", d.to_str().unwrap()]);
    let ctx = format!("seed {seed}, stripped {}\n{}", calls[k], o.show());
    assert_eq!(o.code, 1, "{ctx}");
    assert_eq!(o.json["verdict"], "fail", "{ctx}");
    assert_eq!(o.json["first_nonfinite"], Value::Null, "{ctx}");
    assert_eq!(o.json["summary"]["calls_scanned"], calls.len() - 1, "{ctx}");
    assert_eq!(o.json["summary"]["calls_unscanned"], 1, "{ctx}");
    let stripped = files[k].file_name().unwrap().to_str().unwrap();
    let text = o.json["summary"]["text"].as_str().unwrap();
    assert!(
        text.contains("not scanned") && text.contains(stripped),
        "{ctx}"
    );
    assert!(o.stdout.contains("NOT SCANNED"), "{ctx}");
    assert!(!text.contains("README.md"), "{ctx}");

    // a NaN planted after the stripped call is still found, and the report says that an
    // earlier one may hide in the call it could not scan
    if k + 1 < calls.len() {
        let at = r.gen_range(k + 1..calls.len());
        let faulty = SynthTraceConfig {
            faults: vec![Fault {
                module: calls[at].clone(),
                kind: FaultKind::Nan,
                token: r.gen_range(0..c.tokens),
                channel: r.gen_range(0..c.hidden),
            }],
            ..c.clone()
        };
        let d = tmp.path().join("nan-after-stripped");
        let files = write_trace(&d, &faulty).unwrap();
        strip_outputs(&files[k], &mut r);
        let o = nvfp4dbg(tmp.path(), &["nan-locate", d.to_str().unwrap()]);
        let ctx = format!(
            "seed {seed}, stripped {}, NaN at {}\n{}",
            calls[k],
            calls[at],
            o.show()
        );
        assert_eq!(o.code, 1, "{ctx}");
        assert_eq!(
            o.json["first_nonfinite"]["module"],
            calls[at].as_str(),
            "{ctx}"
        );
        let text = o.json["summary"]["text"].as_str().unwrap();
        assert!(
            text.contains("NOT scanned") && text.contains(stripped),
            "{ctx}"
        );
    }

    // ignored entries alone keep a clean trace a pass
    let d = tmp.path().join("clean-with-notes");
    write_trace(&d, &c).unwrap();
    std::fs::write(d.join("README.md"), "notes").unwrap();
    std::fs::write(d.join(".000003-x.safetensors.tmp"), "x").unwrap();
    let o = nvfp4dbg(tmp.path(), &["nan-locate", d.to_str().unwrap()]);
    let ctx = format!("seed {seed}\n{}", o.show());
    assert_eq!(o.code, 0, "{ctx}");
    assert_eq!(o.json["summary"]["calls_unscanned"], 0, "{ctx}");
    assert_eq!(o.json["summary"]["calls_scanned"], calls.len(), "{ctx}");
    assert_eq!(o.json["skipped"].as_array().unwrap().len(), 2, "{ctx}");
}

/// Without --rank every rank is scanned: a NaN on rank 1 of a clean rank 0 fails, naming rank 1
/// (it used to pass, scanning rank 0 only); the first bad call in (step, counter) order wins
/// across ranks; a trace without rank 0 needs no --rank.
#[test]
fn without_rank_every_rank_is_scanned() {
    let seed: u64 = rand::random();
    let tmp = tempfile::tempdir().unwrap();
    let fault = |m: &str| {
        vec![Fault {
            module: m.into(),
            kind: FaultKind::Nan,
            token: 1,
            channel: 3,
        }]
    };
    let write = |dir: &str, rank: u64, faults: Vec<Fault>| {
        write_trace(
            &tmp.path().join(dir).join(format!("rank{rank}")),
            &SynthTraceConfig {
                rank: Some(rank),
                faults,
                ..cfg(seed)
            },
        )
        .unwrap();
    };
    write("ep", 0, vec![]);
    write("ep", 1, fault("model.layers.1.mlp.down_proj"));
    write("ep", 2, vec![]);
    let o = nvfp4dbg(tmp.path(), &["nan-locate", "ep"]);
    assert_eq!(o.code, 1, "seed {seed}\n{}", o.show());
    let f = &o.json["first_nonfinite"];
    assert_eq!(f["module"], "model.layers.1.mlp.down_proj", "{}", o.show());
    assert_eq!(f["rank"], 1, "{}", o.show());
    assert!(
        f["file"].as_str().unwrap().contains("rank1"),
        "{}",
        o.show()
    );
    assert!(o.stdout.contains("rank 1"), "{}", o.show());
    assert_eq!(o.json["summary"]["ranks"], serde_json::json!([0, 1, 2]));
    assert_eq!(o.json["ranks"].as_array().unwrap().len(), 3);

    // both ranks bad: the earlier call wins, whichever rank it is on
    write("both", 0, fault("lm_head"));
    write("both", 1, fault("model.layers.0.self_attn.o_proj"));
    let o = nvfp4dbg(tmp.path(), &["nan-locate", "both"]);
    assert_eq!(o.code, 1, "seed {seed}\n{}", o.show());
    assert_eq!(o.json["first_nonfinite"]["rank"], 1, "{}", o.show());
    assert_eq!(
        o.json["first_nonfinite"]["module"],
        "model.layers.0.self_attn.o_proj"
    );

    // a step no rank holds: exit 2 naming the steps of every rank
    let o = nvfp4dbg(tmp.path(), &["nan-locate", "ep", "--step", "9"]);
    assert_eq!(o.code, 2, "{}", o.show());
    assert!(o.stderr.contains("step 9 in any rank"), "{}", o.show());

    // clean ranks 2 and 3, no rank 0: a pass over both, no --rank needed
    write("clean", 2, vec![]);
    write("clean", 3, vec![]);
    let o = nvfp4dbg(tmp.path(), &["nan-locate", "clean"]);
    assert_eq!(o.code, 0, "seed {seed}\n{}", o.show());
    assert!(o.stdout.contains("2 ranks (2, 3)"), "{}", o.show());
    let n = module_calls(&cfg(seed)).unwrap().len() as u64;
    assert_eq!(o.json["summary"]["calls_scanned_all_ranks"], 2 * n);
}

/// A NaN in a module's input while every recorded output before it was clean (code between
/// recorded modules made it, or hooks recorded out of order) and this module's output is clean
/// (it swallowed it): not a pass, named by module and tensor. It used to pass. A -inf mask
/// input still passes (see above).
#[test]
fn a_nan_in_an_input_only_whose_producer_was_clean_is_not_a_pass() {
    let seed: u64 = rand::random();
    let mut r = rng(seed);
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("t");
    std::fs::create_dir(&d).unwrap();
    let x = randv(&mut r, 32);
    let mut bad = x.clone();
    let at = r.gen_range(0..32);
    bad[at] = f32::NAN;
    write_call(
        &d,
        0,
        "model.embed_tokens",
        vec![t("output", &[4, 8], x)],
        &[],
    );
    write_call(
        &d,
        1,
        "model.layers.3.mlp.experts.12",
        vec![
            t("input.0", &[4, 8], bad),
            t("output", &[4, 8], randv(&mut r, 32)),
        ],
        &[],
    );
    write_call(
        &d,
        2,
        "model.norm",
        vec![t("output", &[4, 8], randv(&mut r, 32))],
        &[],
    );
    let o = nvfp4dbg(tmp.path(), &["nan-locate", d.to_str().unwrap()]);
    let ctx = format!("seed {seed}\n{}", o.show());
    assert_eq!(o.code, 1, "{ctx}");
    assert_eq!(o.json["verdict"], "fail", "{ctx}");
    // the trace's first bad tensor is that input: under `first_nonfinite`, where CI reads it,
    // and the last clean call is the one before it (it was the trace's last)
    assert_eq!(o.json["first_nonfinite"], o.json["nan_input"], "{ctx}");
    let n = &o.json["first_nonfinite"];
    assert_eq!(n["module"], "model.layers.3.mlp.experts.12", "{ctx}");
    assert_eq!(n["tensor"], "input.0", "{ctx}");
    assert_eq!(n["kind"], "nan", "{ctx}");
    assert_eq!(n["index"]["flat"], at as u64, "{ctx}");
    assert_eq!(
        (&n["index"]["token"], &n["index"]["channel"]),
        (&Value::from(at / 8), &Value::from(at % 8)),
        "{ctx}"
    );
    assert_eq!(
        o.json["last_clean"]["module"], "model.embed_tokens",
        "{ctx}"
    );
    assert!(o.stdout.contains("swallowed"), "{ctx}");
}

/// An Inf that is an overflow arriving: the module before wrote a value at its dtype's limit
/// (finite, so "clean"), the next one turned it into Inf. The Inf's module is still named, but
/// the overflow's start is said too. It used to read "this module produced it" only.
#[test]
fn an_inf_after_a_value_at_the_dtype_limit_names_where_the_overflow_started() {
    let seed: u64 = rand::random();
    let mut r = rng(seed);
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("t");
    std::fs::create_dir(&d).unwrap();
    let x = randv(&mut r, 32);
    let mut big = x.clone();
    let at = r.gen_range(0..32);
    big[at] = r.gen_range(0.6..1.0) * f32::MAX;
    let mut inf = x.clone();
    inf[at] = f32::INFINITY;
    write_call(
        &d,
        0,
        "model.embed_tokens",
        vec![t("output", &[4, 8], x.clone())],
        &[],
    );
    write_call(
        &d,
        1,
        "model.layers.2.mlp",
        vec![t("input.0", &[4, 8], x), t("output", &[4, 8], big.clone())],
        &[],
    );
    write_call(
        &d,
        2,
        "model.layers.3.input_layernorm",
        vec![t("input.0", &[4, 8], big), t("output", &[4, 8], inf)],
        &[],
    );
    let o = nvfp4dbg(tmp.path(), &["nan-locate", d.to_str().unwrap()]);
    let ctx = format!("seed {seed}\n{}", o.show());
    assert_eq!(o.code, 1, "{ctx}");
    let f = &o.json["first_nonfinite"];
    assert_eq!(f["module"], "model.layers.3.input_layernorm", "{ctx}");
    assert_eq!(f["near_overflow"]["module"], "model.layers.2.mlp", "{ctx}");
    assert!(o.stdout.contains("the overflow started there"), "{ctx}");
}

/// `rank<N>/` folders whose files carry no `rank` metadata are ranks N (their files used to
/// all count as rank 0: rank 1's NaN hid behind duplicate counters and `--rank 1` said no such
/// rank). A folder named otherwise is not part of the trace: listed as ignored, not read.
#[test]
fn rank_folders_without_rank_metadata_are_their_ranks() {
    let seed: u64 = rand::random();
    let mut r = rng(seed);
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("tp");
    let base = cfg(seed);
    let calls = module_calls(&base).unwrap();
    let at = r.gen_range(0..calls.len());
    let bad_rank = r.gen_range(1..4u64);
    let fault = |kind| {
        vec![Fault {
            module: calls[at].clone(),
            kind,
            token: r.clone().gen_range(0..base.tokens),
            channel: 1,
        }]
    };
    for rank in 0..=bad_rank {
        let faults = if rank == bad_rank {
            fault(FaultKind::Nan)
        } else {
            vec![]
        };
        let c = SynthTraceConfig {
            faults,
            ..cfg(seed)
        };
        write_trace(&d.join(format!("rank{rank}")), &c).unwrap();
    }
    // a copy of a bad trace in a folder that is not a rank: ignored
    let c = SynthTraceConfig {
        faults: fault(FaultKind::Inf),
        ..cfg(seed)
    };
    write_trace(&d.join("old"), &c).unwrap();
    let dir = d.to_str().unwrap();
    let ctx = |o: &Out| format!("seed {seed} rank {bad_rank} at {}\n{}", calls[at], o.show());
    let o = nvfp4dbg(tmp.path(), &["nan-locate", dir]);
    assert_eq!(o.code, 1, "{}", ctx(&o));
    assert_eq!(o.json["first_nonfinite"]["rank"], bad_rank, "{}", ctx(&o));
    assert_eq!(
        o.json["first_nonfinite"]["module"],
        calls[at].as_str(),
        "{}",
        ctx(&o)
    );
    assert_eq!(o.json["first_nonfinite"]["kind"], "nan", "{}", ctx(&o));
    assert_eq!(
        o.json["summary"]["ranks"].as_array().unwrap().len(),
        bad_rank as usize + 1,
        "{}",
        ctx(&o)
    );
    let skipped = o.json["skipped"].as_array().unwrap();
    assert_eq!(skipped.len(), 1, "{}", ctx(&o));
    assert!(
        skipped[0]["file"].as_str().unwrap().ends_with("old"),
        "{}",
        ctx(&o)
    );
    assert_eq!(skipped[0]["unscanned_call"], false, "{}", ctx(&o));
    assert!(
        skipped[0]["reason"].as_str().unwrap().contains("ignored"),
        "{}",
        ctx(&o)
    );
    let o = nvfp4dbg(
        tmp.path(),
        &["nan-locate", dir, "--rank", &bad_rank.to_string()],
    );
    assert_eq!(o.code, 1, "{}", ctx(&o));
    assert_eq!(
        o.json["first_nonfinite"]["module"],
        calls[at].as_str(),
        "{}",
        ctx(&o)
    );
    let o = nvfp4dbg(tmp.path(), &["nan-locate", dir, "--rank", "0"]);
    assert_eq!(o.code, 0, "{}", ctx(&o));
}

/// A `*.safetensors` file whose name has no counter (`weights.safetensors`, left there by
/// someone) is not a recorded call: listed as ignored, not scanned, and a clean trace still
/// passes (it used to fail as "not a pass"). A short counter, or two files of one counter,
/// are still calls that were not scanned.
#[test]
fn a_safetensors_file_without_a_counter_is_ignored() {
    let seed: u64 = rand::random();
    let mut r = rng(seed);
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("tr");
    write_trace(&d, &cfg(seed)).unwrap();
    // a real safetensors file, with a NaN in it even
    let mut v = randv(&mut r, 12);
    v[r.gen_range(0..12)] = f32::NAN;
    let stray = d.join("foo.safetensors");
    let tmpdir = tmp.path().join("w");
    std::fs::create_dir_all(&tmpdir).unwrap();
    let p = write_call(&tmpdir, 0, "w", vec![t("output", &[3, 4], v)], &[]);
    std::fs::rename(&p, &stray).unwrap();
    let o = nvfp4dbg(tmp.path(), &["nan-locate", "tr"]);
    let ctx = format!("seed {seed}\n{}", o.show());
    assert_eq!(o.code, 0, "{ctx}");
    let skipped = o.json["skipped"].as_array().unwrap();
    assert_eq!(skipped.len(), 1, "{ctx}");
    assert!(
        skipped[0]["file"]
            .as_str()
            .unwrap()
            .ends_with("foo.safetensors"),
        "{ctx}"
    );
    assert_eq!(skipped[0]["unscanned_call"], false, "{ctx}");
    assert!(o.stdout.contains("ignored"), "{ctx}");
    // the same trace, bisected against itself: a pass
    let o = nvfp4dbg(tmp.path(), &["bisect", "tr", "tr"]);
    assert_eq!(o.code, 0, "seed {seed}\n{}", o.show());
    // a short counter is still a call not scanned
    std::fs::rename(&stray, d.join("00042-foo.safetensors")).unwrap();
    let o = nvfp4dbg(tmp.path(), &["nan-locate", "tr"]);
    assert_eq!(o.code, 1, "seed {seed}\n{}", o.show());
    assert_eq!(
        o.json["skipped"][0]["unscanned_call"],
        true,
        "seed {seed}\n{}",
        o.show()
    );
}

/// An all-NaN output has no largest finite value: `max |out|` shows `-` (JSON `max_abs`
/// null), not 0.000e0 as if it were all zeros.
#[test]
fn an_all_nan_output_has_no_max_abs() {
    let seed: u64 = rand::random();
    let mut r = rng(seed);
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("tr");
    std::fs::create_dir_all(&d).unwrap();
    let (tokens, h) = (r.gen_range(2..8), 8 * r.gen_range(1..4));
    let x = randv(&mut r, tokens * h);
    let ts = vec![t("output", &[tokens, h], x.clone())];
    write_call(&d, 0, "model.embed_tokens", ts, &[]);
    let ts = vec![
        t("input.0", &[tokens, h], x),
        t("output", &[tokens, h], vec![f32::NAN; tokens * h]),
    ];
    write_call(&d, 1, "model.layers.0.self_attn", ts, &[]);
    let o = nvfp4dbg(tmp.path(), &["nan-locate", "tr"]);
    let ctx = format!("seed {seed}\n{}", o.show());
    assert_eq!(o.code, 1, "{ctx}");
    let m = o.json["modules"].as_array().unwrap();
    assert_eq!(m[1]["tensors"][1]["max_abs"], Value::Null, "{ctx}");
    assert!(
        m[0]["tensors"][0]["max_abs"].as_f64().unwrap() > 0.0,
        "{ctx}"
    );
    let row = o
        .stdout
        .lines()
        .find(|l| l.contains("model.layers.0.self_attn") && l.contains("FIRST BAD"))
        .unwrap();
    assert!(!row.contains("0.000e0"), "{ctx}");
    assert!(row.contains("│ -"), "{ctx}");
}

/// An additive attention mask (only 0 and -inf) is not a fault, as an output or an input: the
/// module that builds it is not the first bad call, and a layer whose NaN output came with a
/// clean hidden state and the mask produced the NaN itself. Both used to be wrong: the mask
/// builder was named as the first bad call (the real NaN layers later went unnamed), and the
/// attention layer's NaN was said to have come "from code that ran before" because of its mask.
/// A NaN output with an Inf (not a mask) input was made here too; an Inf output with an Inf
/// input still came from earlier.
#[test]
fn an_attention_mask_is_not_the_first_bad_call_nor_blamed_for_a_later_nan() {
    let seed: u64 = rand::random();
    let mut r = rng(seed);
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("tr");
    std::fs::create_dir(&d).unwrap();
    let (tok, hid) = (r.gen_range(2..9usize), r.gen_range(2..17usize));
    let layers = r.gen_range(2..7usize);
    let bad_layer = r.gen_range(0..layers);
    let (bt, bc) = (r.gen_range(0..tok), r.gen_range(0..hid));
    let mask: Vec<f32> = (0..tok * tok)
        .map(|i| {
            if i % tok > i / tok {
                f32::NEG_INFINITY
            } else {
                0.0
            }
        })
        .collect();
    let mut c = 0;
    let mut call = |module: &str, tensors: Vec<T>| {
        write_call(&d, c, module, tensors, &[]);
        c += 1;
    };
    let h = randv(&mut r, tok * hid);
    call(
        "model.embed_tokens",
        vec![t("output", &[tok, hid], h.clone())],
    );
    call(
        "model.causal_mask",
        vec![
            t("input.0", &[tok, hid], h.clone()),
            t("output", &[tok, tok], mask.clone()),
        ],
    );
    for l in 0..layers {
        let mut out = randv(&mut r, tok * hid);
        if l == bad_layer {
            out[bt * hid + bc] = f32::NAN;
        }
        call(
            &format!("model.layers.{l}.self_attn"),
            vec![
                t("input.0", &[tok, hid], h.clone()),
                t("input.1", &[tok, tok], mask.clone()),
                t("output", &[tok, hid], out),
            ],
        );
    }
    let o = nvfp4dbg(tmp.path(), &["nan-locate", d.to_str().unwrap()]);
    let ctx = format!(
        "seed {seed}, bad layer {bad_layer} [{bt}, {bc}]\n{}",
        o.show()
    );
    assert_eq!(o.code, 1, "{ctx}");
    let f = &o.json["first_nonfinite"];
    assert_eq!(
        f["module"],
        format!("model.layers.{bad_layer}.self_attn"),
        "{ctx}"
    );
    assert_eq!(f["index"]["multi"], serde_json::json!([bt, bc]), "{ctx}");
    assert_eq!(f["kind"], "nan", "{ctx}");
    assert_eq!(f["inputs_clean"], true, "{ctx}");
    assert_eq!(f["bad_input"], Value::Null, "{ctx}");
    assert_eq!(f["uncounted_input"]["tensor"], "input.1", "{ctx}");
    assert_eq!(f["uncounted_input"]["mask"], true, "{ctx}");
    assert_eq!(o.json["mask_outputs"]["count"], 1, "{ctx}");
    assert_eq!(
        o.json["mask_outputs"]["first"]["module"], "model.causal_mask",
        "{ctx}"
    );
    assert!(o.stdout.contains("attention mask"), "{ctx}");
    assert!(
        !o.stdout.contains("came from code that ran before"),
        "{ctx}"
    );

    // a NaN output whose hidden-state input holds an Inf (not a mask): made here, from the Inf
    let d2 = tmp.path().join("inf-in");
    std::fs::create_dir(&d2).unwrap();
    let mut x = randv(&mut r, tok * hid);
    let inf_at = r.gen_range(0..tok * hid);
    x[inf_at] = if r.gen_bool(0.5) {
        f32::INFINITY
    } else {
        f32::NEG_INFINITY
    };
    let mut y = randv(&mut r, tok * hid);
    y[inf_at] = f32::NAN;
    write_call(
        &d2,
        0,
        "norm",
        vec![
            t("input.0", &[tok, hid], x.clone()),
            t("output", &[tok, hid], y),
        ],
        &[],
    );
    let o = nvfp4dbg(tmp.path(), &["nan-locate", d2.to_str().unwrap()]);
    let ctx = format!("seed {seed}, Inf input at {inf_at}\n{}", o.show());
    assert_eq!(o.code, 1, "{ctx}");
    let f = &o.json["first_nonfinite"];
    assert_eq!(f["inputs_clean"], true, "{ctx}");
    assert_eq!(f["uncounted_input"]["mask"], false, "{ctx}");
    assert_eq!(f["uncounted_input"]["index"]["flat"], inf_at, "{ctx}");
    assert_eq!(o.json["mask_outputs"], Value::Null, "{ctx}");

    // an Inf output with an Inf (not a mask) input: it came from earlier
    let d3 = tmp.path().join("inf-inf");
    std::fs::create_dir(&d3).unwrap();
    write_call(
        &d3,
        0,
        "proj",
        vec![
            t("input.0", &[tok, hid], x.clone()),
            t("output", &[tok, hid], x),
        ],
        &[],
    );
    let o = nvfp4dbg(tmp.path(), &["nan-locate", d3.to_str().unwrap()]);
    let ctx = format!("seed {seed}\n{}", o.show());
    assert_eq!(o.code, 1, "{ctx}");
    let f = &o.json["first_nonfinite"];
    assert_eq!(f["inputs_clean"], false, "{ctx}");
    assert_eq!(f["bad_input"]["tensor"], "input.0", "{ctx}");
}

/// Guards: a NaN in a 0/-inf mask output was named at the mask's first -inf (a normal masked
/// position, reported as "first Inf"), not at the NaN.
#[test]
fn a_nan_in_a_mask_output_is_named_at_the_nan_not_at_the_masks_minus_inf() {
    let seed: u64 = rand::random();
    let mut r = rng(seed);
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("t");
    std::fs::create_dir(&d).unwrap();
    let tok = r.gen_range(3..12usize);
    let mut mask: Vec<f32> = (0..tok * tok)
        .map(|i| {
            if i % tok > i / tok {
                f32::NEG_INFINITY
            } else {
                0.0
            }
        })
        .collect();
    // a NaN on or below the diagonal, after the first -inf at [0, 1]
    let row = r.gen_range(1..tok);
    let nan_at = row * tok + r.gen_range(0..=row);
    mask[nan_at] = f32::NAN;
    write_call(
        &d,
        0,
        "model.embed_tokens",
        vec![t("output", &[tok, 8], randv(&mut r, tok * 8))],
        &[],
    );
    write_call(
        &d,
        1,
        "model.causal_mask",
        vec![t("output", &[tok, tok], mask)],
        &[],
    );
    let o = nvfp4dbg(tmp.path(), &["nan-locate", d.to_str().unwrap()]);
    let ctx = format!("seed {seed}, NaN at {nan_at}\n{}", o.show());
    assert_eq!(o.code, 1, "{ctx}");
    let f = &o.json["first_nonfinite"];
    assert_eq!(f["module"], "model.causal_mask", "{ctx}");
    assert_eq!(f["kind"], "nan", "{ctx}");
    assert_eq!(f["index"]["flat"], nan_at as u64, "{ctx}");
    assert!(
        o.stdout.contains("first NaN in `model.causal_mask`"),
        "{ctx}"
    );
}

/// Guards: a NaN that an input alone held (its output clean) before a later bad output was
/// dropped from the report: no `nan_input`, not in the verdict line.
#[test]
fn a_nan_input_swallowed_before_the_first_bad_output_is_still_reported() {
    let seed: u64 = rand::random();
    let mut r = rng(seed);
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("t");
    std::fs::create_dir(&d).unwrap();
    let mut x = randv(&mut r, 32);
    let at = r.gen_range(0..32);
    x[at] = f32::NAN;
    let mut y = randv(&mut r, 32);
    let bad_at = r.gen_range(0..32);
    y[bad_at] = f32::NAN;
    write_call(
        &d,
        0,
        "model.embed_tokens",
        vec![t("output", &[4, 8], randv(&mut r, 32))],
        &[],
    );
    write_call(
        &d,
        1,
        "model.layers.0.mlp.act_fn",
        vec![
            t("input.0", &[4, 8], x),
            t("output", &[4, 8], randv(&mut r, 32)),
        ],
        &[],
    );
    write_call(
        &d,
        2,
        "model.layers.0.mlp.down_proj",
        vec![
            t("input.0", &[4, 8], randv(&mut r, 32)),
            t("output", &[4, 8], y),
        ],
        &[],
    );
    let o = nvfp4dbg(tmp.path(), &["nan-locate", d.to_str().unwrap()]);
    let ctx = format!(
        "seed {seed}, input NaN at {at}, output NaN at {bad_at}\n{}",
        o.show()
    );
    assert_eq!(o.code, 1, "{ctx}");
    assert_eq!(
        o.json["first_nonfinite"]["module"], "model.layers.0.mlp.down_proj",
        "{ctx}"
    );
    let n = &o.json["nan_input"];
    assert_eq!(n["module"], "model.layers.0.mlp.act_fn", "{ctx}");
    assert_eq!(n["tensor"], "input.0", "{ctx}");
    assert_eq!(n["index"]["flat"], at as u64, "{ctx}");
    assert!(
        o.stdout.contains("`model.layers.0.mlp.act_fn` input.0"),
        "{ctx}"
    );
}

// Guards: a report path that cannot be written named a parent alone (`afile: File exists` for
// `--json afile/r.json`) or our temporary (`/proc/r.json.tmp-<pid>`), not the path and flag given.
#[test]
fn an_unwritable_report_path_is_exit_2_naming_the_path_and_flag() {
    let seed: u64 = rand::random();
    let tmp = tempfile::tempdir().unwrap();
    let trace = tmp.path().join("trace");
    write_trace(&trace, &cfg(seed)).unwrap();
    std::fs::write(tmp.path().join("afile"), "a file, not a folder").unwrap();
    let mut paths = vec![
        ("--json", "afile/r.json"),
        ("--report-dir", "afile/reports"),
    ];
    if std::path::Path::new("/proc/self").exists() {
        // no file can be created in /proc, not even by root
        paths.push(("--json", "/proc/r.json"));
    }
    for (flag, path) in paths {
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_nvfp4dbg"))
            .current_dir(tmp.path())
            .args(["nan-locate", trace.to_str().unwrap(), flag, path, "--quiet"])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&o.stderr);
        let ctx = format!("seed {seed} {flag} {path}\n{stderr}");
        assert_eq!(o.status.code(), Some(2), "{ctx}");
        assert!(stderr.contains(path) && stderr.contains(flag), "{ctx}");
        assert!(
            !stderr.contains(".tmp-") && !stderr.contains("panicked"),
            "{ctx}"
        );
    }
}

// A damaged file (truncated when the run died) aborted the scan with exit 2, even where a NaN
// lay before it or after it: the NaN is the answer, the damaged file is named as not scanned.
// With no NaN anywhere, a damaged file is still bad input (exit 2).
#[test]
fn a_damaged_file_does_not_hide_a_nan_found_around_it() {
    let seed: u64 = rand::random();
    let mut r = rng(seed);
    let tmp = tempfile::tempdir().unwrap();
    for damaged_first in [true, false] {
        let d = tmp.path().join(format!("t{damaged_first}"));
        std::fs::create_dir(&d).unwrap();
        let mut bad = randv(&mut r, 16);
        let at = r.gen_range(0..16);
        bad[at] = f32::NAN;
        let (damaged, nan) = if damaged_first { (1, 2) } else { (2, 1) };
        write_call(&d, 0, "a", vec![t("output", &[16], randv(&mut r, 16))], &[]);
        let p = write_call(
            &d,
            damaged,
            "b",
            vec![t("output", &[16], randv(&mut r, 16))],
            &[],
        );
        write_call(&d, nan, "c", vec![t("output", &[16], bad)], &[]);
        let bytes = std::fs::read(&p).unwrap();
        let cut = r.gen_range(1..bytes.len());
        std::fs::write(&p, &bytes[..cut]).unwrap();
        let o = nvfp4dbg(tmp.path(), &["nan-locate", d.to_str().unwrap()]);
        let ctx = format!(
            "seed {seed} cut {cut} damaged first {damaged_first}\n{}",
            o.show()
        );
        assert_eq!(o.code, 1, "{ctx}");
        assert_eq!(o.json["first_nonfinite"]["module"], "c", "{ctx}");
        assert_eq!(o.json["first_nonfinite"]["index"]["flat"], at, "{ctx}");
        // before the NaN it may have held an earlier one: named in the headline
        assert_eq!(
            o.stdout.contains("000001-b.safetensors: unreadable"),
            damaged_first,
            "{ctx}"
        );
        // bisect compares whole traces: a damaged file is bad input there
        let b = nvfp4dbg(
            tmp.path(),
            &["bisect", d.to_str().unwrap(), d.to_str().unwrap()],
        );
        assert_eq!(b.code, 2, "{ctx}\n{}", b.show());
    }
}

// Counters missing between recorded calls (files deleted, writes that failed) passed without a
// word: they are said, since a NaN there is never scanned.
#[test]
fn counter_gaps_before_the_answer_are_said() {
    let seed: u64 = rand::random();
    let mut r = rng(seed);
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("gap");
    std::fs::create_dir(&d).unwrap();
    let from = r.gen_range(1..5u64);
    let to = from + r.gen_range(0..3u64);
    for c in (0..from).chain(to + 1..to + 4) {
        write_call(&d, c, "m", vec![t("output", &[8], randv(&mut r, 8))], &[]);
    }
    let o = nvfp4dbg(tmp.path(), &["nan-locate", d.to_str().unwrap()]);
    let ctx = format!("seed {seed} gap {from}-{to}\n{}", o.show());
    assert_eq!(o.code, 0, "{ctx}");
    assert_eq!(
        o.json["summary"]["counter_gaps"],
        serde_json::json!([[from, to]]),
        "{ctx}"
    );
    assert!(
        o.stdout
            .contains(&format!("{} counter(s) absent", to - from + 1)),
        "{ctx}"
    );
}

/// Guards: a NaN made between recorded modules, swallowed by the first module that took it
/// (its output clean) and received by a later module through its inputs (its output bad) was
/// reported at the later module: `first_nonfinite` named a call after the first NaN. The first
/// NaN is the earlier input; the later output is `first_bad_output`. Across ranks the earlier
/// input decides too.
#[test]
fn a_nan_swallowed_then_received_downstream_is_named_where_it_first_shows() {
    let seed: u64 = rand::random();
    let mut r = rng(seed);
    let tmp = tempfile::tempdir().unwrap();
    // `n` calls; call `at` takes the NaN in input.0 and swallows it, calls from `bad` on take
    // it in input.0 and pass it on in their output
    let write = |r: &mut rand_chacha::ChaCha8Rng, d: &std::path::Path, at: u64, bad: u64| {
        std::fs::create_dir_all(d).unwrap();
        let flat = r.gen_range(0..32);
        for c in 0..8u64 {
            let (mut x, mut y) = (randv(r, 32), randv(r, 32));
            if c == at || c >= bad {
                x[flat] = f32::NAN;
            }
            if c >= bad {
                y[flat] = f32::NAN;
            }
            write_call(
                d,
                c,
                &format!("model.layers.{c}"),
                vec![t("input.0", &[4, 8], x), t("output", &[4, 8], y)],
                &[],
            );
        }
        flat
    };
    let at = r.gen_range(1..5);
    let bad = r.gen_range(at + 1..8);
    let flat = write(&mut r, &tmp.path().join("t"), at, bad);
    let o = nvfp4dbg(tmp.path(), &["nan-locate", "t"]);
    let ctx = format!(
        "seed {seed}, NaN input at {at}, outputs from {bad}\n{}",
        o.show()
    );
    assert_eq!(o.code, 1, "{ctx}");
    let f = &o.json["first_nonfinite"];
    assert_eq!(f["module"], format!("model.layers.{at}"), "{ctx}");
    assert_eq!(f["tensor"], "input.0", "{ctx}");
    assert_eq!(f["kind"], "nan", "{ctx}");
    assert_eq!(f["index"]["flat"], flat as u64, "{ctx}");
    assert!(
        f["file"]
            .as_str()
            .unwrap()
            .ends_with(&format!("{at:06}-model.layers.{at}.safetensors")),
        "{ctx}"
    );
    assert_eq!(
        f["first_bad_output"]["module"],
        format!("model.layers.{bad}"),
        "{ctx}"
    );
    assert_eq!(
        o.json["last_clean"]["module"],
        format!("model.layers.{}", at - 1),
        "{ctx}"
    );
    assert!(
        o.stdout
            .contains(&format!("first NaN in `model.layers.{at}` input.0")),
        "{ctx}"
    );

    // two ranks: rank 0 swallows a NaN at `at` (bad output later), rank 1 makes its own NaN
    // between the two: rank 0's input is first
    write(&mut r, &tmp.path().join("ep/rank0"), at, 7);
    std::fs::create_dir_all(tmp.path().join("ep/rank1")).unwrap();
    let own = r.gen_range(at + 1..7);
    for c in 0..8u64 {
        let mut y = randv(&mut r, 32);
        if c >= own {
            y[r.gen_range(0..32)] = f32::NAN;
        }
        let x = randv(&mut r, 32);
        write_call(
            &tmp.path().join("ep/rank1"),
            c,
            &format!("model.layers.{c}"),
            vec![t("input.0", &[4, 8], x), t("output", &[4, 8], y)],
            &[],
        );
    }
    let o = nvfp4dbg(tmp.path(), &["nan-locate", "ep"]);
    let ctx = format!(
        "seed {seed}, rank 0 input at {at}, rank 1 output at {own}\n{}",
        o.show()
    );
    assert_eq!(o.code, 1, "{ctx}");
    assert_eq!(o.json["first_nonfinite"]["rank"], 0, "{ctx}");
    assert_eq!(
        o.json["first_nonfinite"]["module"],
        format!("model.layers.{at}"),
        "{ctx}"
    );
}

/// Write `dir` (one rank) with 12 calls `model.layers.C`: `input.0` holds a NaN at the calls in
/// `nan_in`, `output` at those in `nan_out`. Returns the flat index of the NaN.
fn write_rank(
    r: &mut rand_chacha::ChaCha8Rng,
    dir: &std::path::Path,
    nan_in: &[u64],
    nan_out: &[u64],
) -> usize {
    write_calls(r, dir, 12, nan_in, nan_out)
}

/// [`write_rank`] with `n` calls.
fn write_calls(
    r: &mut rand_chacha::ChaCha8Rng,
    dir: &std::path::Path,
    n: u64,
    nan_in: &[u64],
    nan_out: &[u64],
) -> usize {
    std::fs::create_dir_all(dir).unwrap();
    let flat = r.gen_range(0..32);
    for c in 0..n {
        let (mut x, mut y) = (randv(r, 32), randv(r, 32));
        if nan_in.contains(&c) {
            x[flat] = f32::NAN;
        }
        if nan_out.contains(&c) {
            y[flat] = f32::NAN;
        }
        write_call(
            dir,
            c,
            &format!("model.layers.{c}"),
            vec![t("input.0", &[4, 8], x), t("output", &[4, 8], y)],
            &[],
        );
    }
    flat
}

/// Guards: across ranks, a rank whose only NaN was a swallowed input (its outputs all clean) was
/// never a candidate, so expert parallelism's NaN that rank 1's dispatch input holds at an
/// early counter, and that rank 0's later output received through its inputs (none before it on
/// rank 0), was reported at rank 0's output. The rank 1 input is where it first shows; rank 0's
/// output is `first_bad_output`. A NaN swallowed only after the received output is not it.
#[test]
fn a_nan_swallowed_on_one_rank_and_received_on_another_is_named_where_it_first_shows() {
    let seed: u64 = rand::random();
    let mut r = rng(seed);
    let tmp = tempfile::tempdir().unwrap();
    let at = r.gen_range(1..6u64);
    let bad = r.gen_range(at..11u64);
    let flat = write_rank(&mut r, &tmp.path().join("ep/rank1"), &[at], &[]);
    let received: Vec<u64> = (bad..12).collect();
    write_rank(&mut r, &tmp.path().join("ep/rank0"), &received, &received);
    let o = nvfp4dbg(tmp.path(), &["nan-locate", "ep"]);
    let ctx = format!(
        "seed {seed}, rank 1 input at {at}, rank 0 outputs from {bad}\n{}",
        o.show()
    );
    assert_eq!(o.code, 1, "{ctx}");
    let f = &o.json["first_nonfinite"];
    assert_eq!(f["rank"], 1, "{ctx}");
    assert_eq!(f["module"], format!("model.layers.{at}"), "{ctx}");
    assert_eq!(f["tensor"], "input.0", "{ctx}");
    assert_eq!(f["index"]["flat"], flat as u64, "{ctx}");
    assert!(f["file"].as_str().unwrap().contains("rank1"), "{ctx}");
    let b = &f["first_bad_output"];
    assert_eq!(b["rank"], 0, "{ctx}");
    assert_eq!(b["module"], format!("model.layers.{bad}"), "{ctx}");
    assert_eq!(b["tensor"], "output", "{ctx}");
    assert!(o.stdout.contains("rank 1: first NaN in"), "{ctx}");
    // the per-rank table names rank 1's swallowed input, not "-"
    let ranks = o.json["ranks"].as_array().unwrap();
    assert_eq!(ranks[1]["first_nonfinite"]["tensor"], "input.0", "{ctx}");
    assert_eq!(ranks[1]["first_nonfinite"]["counter"], at, "{ctx}");
    assert_eq!(ranks[0]["first_nonfinite"]["counter"], bad, "{ctx}");

    // rank 1 also makes a NaN of its own after rank 0 received one: still its input, and the
    // table of the first non-finite value is the input's, not rank 1's own output's
    write_rank(&mut r, &tmp.path().join("own/rank1"), &[at], &[11]);
    write_rank(&mut r, &tmp.path().join("own/rank0"), &received, &received);
    let o = nvfp4dbg(tmp.path(), &["nan-locate", "own"]);
    let ctx = format!(
        "seed {seed}, rank 1 input at {at} and output at 11, rank 0 outputs from {bad}\n{}",
        o.show()
    );
    assert_eq!(o.code, 1, "{ctx}");
    let f = &o.json["first_nonfinite"];
    assert_eq!(
        (&f["rank"], &f["counter"]),
        (&Value::from(1), &Value::from(at)),
        "{ctx}"
    );
    assert_eq!(f["tensor"], "input.0", "{ctx}");
    assert_eq!(f["first_bad_output"]["rank"], 0, "{ctx}");
    assert!(o.stdout.contains("input.0 F32 [4, 8]"), "{ctx}");
    assert!(!o.stdout.contains("this module produced it"), "{ctx}");

    // rank 1 swallows its NaN only after rank 0's output received one: rank 0's output it is
    let late = r.gen_range(bad + 1..12u64);
    write_rank(&mut r, &tmp.path().join("late/rank1"), &[late], &[]);
    write_rank(&mut r, &tmp.path().join("late/rank0"), &received, &received);
    let o = nvfp4dbg(tmp.path(), &["nan-locate", "late"]);
    let ctx = format!(
        "seed {seed}, rank 1 input at {late}, rank 0 outputs from {bad}\n{}",
        o.show()
    );
    assert_eq!(o.code, 1, "{ctx}");
    assert_eq!(o.json["first_nonfinite"]["rank"], 0, "{ctx}");
    assert_eq!(o.json["first_nonfinite"]["tensor"], "output", "{ctx}");
    assert_eq!(o.json["first_nonfinite"]["counter"], bad, "{ctx}");
}

/// Guards: a NaN a masked op swallowed on rank 1 while rank 0 has an unrelated bad output it
/// made itself (clean inputs): rank 0's output is the answer, as on one rank, but rank 1's
/// swallowed NaN is said beside it and in the per-rank table (it read "-" there, and the
/// headline did not name it). With no bad output on any rank, the earliest swallowed NaN is
/// the answer, whichever rank holds it (it was the lowest failing rank).
#[test]
fn a_swallowed_nan_on_another_rank_is_said_and_the_earliest_wins_without_bad_outputs() {
    let seed: u64 = rand::random();
    let mut r = rng(seed);
    let tmp = tempfile::tempdir().unwrap();
    let at = r.gen_range(1..6u64);
    let own = r.gen_range(at + 1..12u64);
    write_rank(&mut r, &tmp.path().join("masked/rank1"), &[at], &[]);
    let flat = write_rank(&mut r, &tmp.path().join("masked/rank0"), &[], &[own]);
    let o = nvfp4dbg(tmp.path(), &["nan-locate", "masked"]);
    let ctx = format!(
        "seed {seed}, rank 1 input at {at}, rank 0 own output at {own}\n{}",
        o.show()
    );
    assert_eq!(o.code, 1, "{ctx}");
    let f = &o.json["first_nonfinite"];
    assert_eq!(
        (&f["rank"], &f["counter"]),
        (&Value::from(0), &Value::from(own)),
        "{ctx}"
    );
    assert_eq!(f["tensor"], "output", "{ctx}");
    assert_eq!(f["index"]["flat"], flat as u64, "{ctx}");
    assert_eq!(f["inputs_clean"], true, "{ctx}");
    assert!(
        o.stdout
            .contains(&format!("rank 1's `model.layers.{at}` input.0")),
        "{ctx}"
    );
    let ranks = o.json["ranks"].as_array().unwrap();
    assert_eq!(ranks[1]["verdict"], "fail", "{ctx}");
    assert_eq!(ranks[1]["first_nonfinite"]["tensor"], "input.0", "{ctx}");
    assert_eq!(ranks[1]["first_nonfinite"]["counter"], at, "{ctx}");

    // no bad output anywhere: rank 0 swallows a NaN late, rank 1 early: rank 1's is first
    let early = r.gen_range(0..6u64);
    let late = r.gen_range(early + 1..12u64);
    write_rank(&mut r, &tmp.path().join("inputs/rank0"), &[late], &[]);
    let flat = write_rank(&mut r, &tmp.path().join("inputs/rank1"), &[early], &[]);
    let o = nvfp4dbg(tmp.path(), &["nan-locate", "inputs"]);
    let ctx = format!(
        "seed {seed}, rank 0 input at {late}, rank 1 at {early}\n{}",
        o.show()
    );
    assert_eq!(o.code, 1, "{ctx}");
    let f = &o.json["first_nonfinite"];
    assert_eq!(
        (&f["rank"], &f["counter"]),
        (&Value::from(1), &Value::from(early)),
        "{ctx}"
    );
    assert_eq!(f["tensor"], "input.0", "{ctx}");
    assert_eq!(f["index"]["flat"], flat as u64, "{ctx}");
    assert!(
        o.stdout.contains("rank 1: no NaN/Inf in any output"),
        "{ctx}"
    );
}

#[test]
fn an_inf_output_is_not_blamed_on_a_nan_swallowed_before_it() {
    let seed: u64 = rand::random();
    let mut r = rng(seed);
    let tmp = tempfile::tempdir().unwrap();
    // call `at` swallows a NaN in input.0; from call `bad` on, an Inf made between recorded
    // modules rides input.0 into the outputs: a NaN never becomes an Inf, so the Inf is its own
    let write = |r: &mut rand_chacha::ChaCha8Rng, d: &std::path::Path, at: u64, bad: u64| {
        std::fs::create_dir_all(d).unwrap();
        let flat = r.gen_range(0..32);
        for c in 0..8u64 {
            let (mut x, mut y) = (randv(r, 32), randv(r, 32));
            if c == at {
                x[flat] = f32::NAN;
            }
            if c >= bad {
                x[flat] = f32::INFINITY;
                y[flat] = f32::INFINITY;
            }
            write_call(
                d,
                c,
                &format!("model.layers.{c}"),
                vec![t("input.0", &[4, 8], x), t("output", &[4, 8], y)],
                &[],
            );
        }
    };
    let at = r.gen_range(1..5);
    let bad = r.gen_range(at + 1..8);
    write(&mut r, &tmp.path().join("t"), at, bad);
    let o = nvfp4dbg(tmp.path(), &["nan-locate", "t"]);
    let ctx = format!(
        "seed {seed}, NaN input at {at}, Inf from {bad}\n{}",
        o.show()
    );
    assert_eq!(o.code, 1, "{ctx}");
    let f = &o.json["first_nonfinite"];
    assert_eq!(f["module"], format!("model.layers.{bad}"), "{ctx}");
    assert_eq!(f["tensor"], "output", "{ctx}");
    assert_eq!(f["kind"], "inf", "{ctx}");
    assert!(o.stdout.contains("swallowed"), "{ctx}");

    // across ranks: rank 1 swallows the NaN, rank 0's Inf is its own
    write(&mut r, &tmp.path().join("ep/rank0"), 99, bad);
    write(&mut r, &tmp.path().join("ep/rank1"), at, 99);
    let o = nvfp4dbg(tmp.path(), &["nan-locate", "ep"]);
    let ctx = format!("seed {seed}, ranks\n{}", o.show());
    assert_eq!(o.code, 1, "{ctx}");
    let f = &o.json["first_nonfinite"];
    assert_eq!(f["module"], format!("model.layers.{bad}"), "{ctx}");
    assert_eq!(f["tensor"], "output", "{ctx}");
    assert_eq!(o.json["summary"]["rank"], 0, "{ctx}");
}

/// The counters of the report's table of calls (`modules`), and its printed row of `counter`.
fn window_of(o: &Out, counter: u64) -> (Vec<u64>, Option<String>) {
    let counters = o.json["modules"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["counter"].as_u64().unwrap())
        .collect();
    let row = o
        .stdout
        .lines()
        .find(|l| l.starts_with(&format!("│ {counter:06} ")))
        .map(str::to_string);
    (counters, row)
}

/// Guards: with no bad output but a NaN input swallowed in the middle of the trace, the table of
/// calls showed the last `--context` calls of the scan, unrelated to the answer. It is the calls
/// around the one that received the NaN, that call marked; on one rank and across ranks.
#[test]
fn the_calls_shown_around_a_swallowed_nan_are_those_around_its_call() {
    let seed: u64 = rand::random();
    let mut r = rng(seed);
    let tmp = tempfile::tempdir().unwrap();
    let n = 40u64;
    let context = r.gen_range(1..=5u64);
    let at = r.gen_range(context + 1..n - 2 * context - 1);
    // a second swallowed NaN later on does not move the table: the first is the answer
    let later = r.gen_range(at + 1..n);
    write_calls(&mut r, &tmp.path().join("t"), n, &[at, later], &[]);
    let ctx_arg = context.to_string();
    let o = nvfp4dbg(tmp.path(), &["nan-locate", "t", "--context", &ctx_arg]);
    let ctx = format!(
        "seed {seed}, {n} calls, --context {context}, NaN inputs at {at} and {later}\n{}",
        o.show()
    );
    assert_eq!(o.code, 1, "{ctx}");
    assert_eq!(o.json["first_nonfinite"]["counter"], at, "{ctx}");
    assert!(o.stdout.contains("no NaN/Inf in any output"), "{ctx}");
    let (counters, row) = window_of(&o, at);
    let want: Vec<u64> = (at - context..=at + context).collect();
    assert_eq!(counters, want, "{ctx}");
    let row = row.unwrap_or_else(|| panic!("no table row of counter {at}\n{ctx}"));
    assert!(row.contains("FIRST NaN (input)"), "{row}\n{ctx}");
    assert!(o.stdout.contains("Module calls around it"), "{ctx}");

    // across ranks: rank 0's only NaN is swallowed late, rank 1's early; rank 1's report is the
    // answer, and its table is around its call
    let late = r.gen_range(at + 1..n);
    write_calls(&mut r, &tmp.path().join("ep/rank0"), n, &[late], &[]);
    write_calls(&mut r, &tmp.path().join("ep/rank1"), n, &[at], &[]);
    let o = nvfp4dbg(tmp.path(), &["nan-locate", "ep", "--context", &ctx_arg]);
    let ctx = format!(
        "seed {seed}, --context {context}, rank 0 NaN input at {late}, rank 1 at {at}\n{}",
        o.show()
    );
    assert_eq!(o.code, 1, "{ctx}");
    let f = &o.json["first_nonfinite"];
    assert_eq!(
        (&f["rank"], &f["counter"]),
        (&Value::from(1), &Value::from(at)),
        "{ctx}"
    );
    let (counters, row) = window_of(&o, at);
    assert_eq!(counters, want, "{ctx}");
    assert!(
        row.is_some_and(|l| l.contains("FIRST NaN (input)")),
        "{ctx}"
    );
    // and rank 0 alone (its only NaN swallowed near the end): around its call, clipped there
    let o = nvfp4dbg(
        tmp.path(),
        &["nan-locate", "ep", "--rank", "0", "--context", &ctx_arg],
    );
    let ctx = format!(
        "seed {seed}, --context {context}, rank 0 at {late}\n{}",
        o.show()
    );
    assert_eq!(o.code, 1, "{ctx}");
    let (counters, row) = window_of(&o, late);
    let want: Vec<u64> = (late - context..=(late + context).min(n - 1)).collect();
    assert_eq!(counters, want, "{ctx}");
    assert!(
        row.is_some_and(|l| l.contains("FIRST NaN (input)")),
        "{ctx}"
    );
}
