//! "Bring your own kernel" on the CPU: plugins that are not plugins (wrong ABI version, missing
//! symbol) are exit 2 naming the file; a good plugin without a GPU is exit 2 saying why; the
//! header's struct layout is the Rust one; and `layertest --dump-inputs` + `compare-outputs`
//! pass a correct output and fail (naming the bug) a buggy one.
//!
//! The tiny plugins are built here with the system C compiler (`cc`); without one these tests
//! fail, they never pass by skipping.

use nvfp4dbg::backend::cuda::plugin::MoeArgs;
use nvfp4dbg::checkpoint::writer::{f32_bytes, write_file, TensorSpec};
use nvfp4dbg::moe::byok::{self, dump, Feeding, SuspectedBug};
use nvfp4dbg::nvfp4::layout::ScaleLayout;
use rand::{Rng, SeedableRng};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn header_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels/include")
}

fn cc(dir: &Path, name: &str, src: &str, shared: bool) -> PathBuf {
    let c = dir.join(format!("{name}.c"));
    std::fs::write(&c, src).unwrap();
    let out = dir.join(if shared {
        format!("{name}.so")
    } else {
        name.to_string()
    });
    let mut cmd = Command::new("cc");
    if shared {
        cmd.args(["-shared", "-fPIC"]);
    }
    let r = cmd
        .arg("-I")
        .arg(header_dir())
        .arg(&c)
        .arg("-o")
        .arg(&out)
        .output()
        .expect("these tests build tiny plugins with `cc`: install a C compiler");
    assert!(
        r.status.success(),
        "cc {name}: {}",
        String::from_utf8_lossy(&r.stderr)
    );
    out
}

fn nvfp4dbg(dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_nvfp4dbg"))
        .args(args)
        .args(["--no-report-dir", "--quiet"])
        .current_dir(dir)
        .output()
        .unwrap()
}

/// `nvfp4dbg CMD --kernel PLUGIN --device cpu EXTRA…` in `dir`.
fn with_kernel(dir: &Path, cmd: &str, plugin: &Path, extra: &[&str]) -> Output {
    let mut args = vec![cmd, "--kernel", plugin.to_str().unwrap(), "--device", "cpu"];
    args.extend(extra);
    nvfp4dbg(dir, &args)
}

fn text(o: &Output) -> String {
    format!(
        "{}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

const GOOD: &str = r#"
#include "nvfp4dbg_moe.h"
uint32_t nvfp4dbg_moe_abi_version(void) { return NVFP4DBG_MOE_ABI_VERSION; }
int nvfp4dbg_moe_forward(const nvfp4dbg_moe_args *a, nvfp4dbg_stream_t s) { (void)a; (void)s; return 0; }
"#;

#[test]
fn a_plugin_of_another_abi_version_is_exit_2_naming_it() {
    let d = tempfile::tempdir().unwrap();
    let so = cc(
        d.path(),
        "v99",
        &GOOD.replace("return NVFP4DBG_MOE_ABI_VERSION;", "return 99;"),
        true,
    );
    for cmd in ["layertest", "gs-sweep", "multilayer"] {
        let o = with_kernel(d.path(), cmd, &so, &[]);
        let t = text(&o);
        assert_eq!(o.status.code(), Some(2), "{cmd}: {t}");
        assert!(
            t.contains(so.to_str().unwrap()) && t.contains("ABI version 99"),
            "{cmd}: {t}"
        );
    }
}

#[test]
fn a_plugin_missing_the_entry_point_is_exit_2_naming_it() {
    let d = tempfile::tempdir().unwrap();
    let so = cc(
        d.path(),
        "noforward",
        "#include \"nvfp4dbg_moe.h\"\nuint32_t nvfp4dbg_moe_abi_version(void) { return 1; }\n",
        true,
    );
    let o = with_kernel(d.path(), "layertest", &so, &[]);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(2), "{t}");
    assert!(
        t.contains(so.to_str().unwrap()) && t.contains("nvfp4dbg_moe_forward"),
        "{t}"
    );
    // a library that is not a plugin at all, and a file that is not a library
    let junk = d.path().join("junk.so");
    std::fs::write(&junk, b"not an ELF file").unwrap();
    let o = with_kernel(d.path(), "layertest", Path::new("junk.so"), &[]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("junk.so"), "{}", text(&o));
    // an out-of-range query answer is named too
    let so = cc(
        d.path(),
        "badlayout",
        &format!("{GOOD}\nint32_t nvfp4dbg_moe_scale_layout(void) {{ return 7; }}\n"),
        true,
    );
    let o = with_kernel(d.path(), "layertest", &so, &[]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(
        text(&o).contains("nvfp4dbg_moe_scale_layout() = 7"),
        "{}",
        text(&o)
    );
}

#[test]
fn a_good_plugin_without_a_gpu_is_exit_2_saying_it_needs_one() {
    let d = tempfile::tempdir().unwrap();
    let so = cc(d.path(), "good", GOOD, true);
    let o = with_kernel(d.path(), "layertest", &so, &["--tokens", "4"]);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(2), "{t}");
    assert!(
        t.contains("needs a GPU") && t.contains("--dump-inputs"),
        "{t}"
    );
}

#[test]
fn the_header_struct_layout_is_the_rust_one() {
    let d = tempfile::tempdir().unwrap();
    let fields = [
        "abi_version",
        "struct_size",
        "tokens",
        "hidden",
        "intermediate",
        "num_experts",
        "num_local_experts",
        "top_k",
        "swiglu_limit",
        "has_swiglu_limit",
        "hidden_states",
        "a1_gscale",
        "a2_gscale",
        "w1",
        "w3",
        "w2",
        "w1_scale",
        "w3_scale",
        "w2_scale",
        "scale_layout",
        "output_dtype",
        "w1_scale_2",
        "w3_scale_2",
        "w2_scale_2",
        "topk_ids",
        "topk_weights",
        "expert_map",
        "id_convention",
        "ep_rank",
        "ep_size",
        "reserved0",
        "output",
        "workspace",
        "workspace_bytes",
    ];
    let mut src = String::from(
        "#include <stdio.h>\n#include <stddef.h>\n#include \"nvfp4dbg_moe.h\"\nint main(void) {\n  printf(\"size %zu\\n\", sizeof(nvfp4dbg_moe_args));\n",
    );
    for f in fields {
        src.push_str(&format!(
            "  printf(\"{f} %zu\\n\", offsetof(nvfp4dbg_moe_args, {f}));\n"
        ));
    }
    src.push_str("  return 0;\n}\n");
    let exe = cc(d.path(), "layout", &src, false);
    let out = Command::new(&exe).output().unwrap();
    let c: std::collections::HashMap<String, usize> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let (k, v) = l.split_once(' ')?;
            Some((k.to_string(), v.parse().ok()?))
        })
        .collect();
    assert_eq!(c["size"], std::mem::size_of::<MoeArgs>());
    macro_rules! off {
        ($($f:ident),*) => { $( assert_eq!(c[stringify!($f)], std::mem::offset_of!(MoeArgs, $f), stringify!($f)); )* };
    }
    off!(
        abi_version,
        struct_size,
        tokens,
        hidden,
        intermediate,
        num_experts,
        num_local_experts,
        top_k,
        swiglu_limit,
        has_swiglu_limit,
        hidden_states,
        a1_gscale,
        a2_gscale,
        w1,
        w3,
        w2,
        w1_scale,
        w3_scale,
        w2_scale,
        scale_layout,
        output_dtype,
        w1_scale_2,
        w3_scale_2,
        w2_scale_2,
        topk_ids,
        topk_weights,
        expert_map,
        id_convention,
        ep_rank,
        ep_size,
        reserved0,
        output,
        workspace,
        workspace_bytes
    );
    assert_eq!(c.len(), fields.len() + 1);
}

fn write_output(path: &Path, v: &[f32], t: usize, h: usize) {
    write_file(
        path,
        vec![(
            TensorSpec::new("output", safetensors::Dtype::F32, &[t, h]),
            f32_bytes(v),
        )],
        None,
    )
    .unwrap();
}

fn json(path: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

/// `compare-outputs dump NAME.safetensors` on `out` written there: (the run, its JSON report).
fn judge_output(
    p: &Path,
    name: &str,
    out: &[f32],
    t: usize,
    h: usize,
) -> (Output, serde_json::Value) {
    let (file, report) = (format!("{name}.safetensors"), format!("{name}.json"));
    write_output(&p.join(&file), out, t, h);
    let o = nvfp4dbg(p, &["compare-outputs", "dump", &file, "--json", &report]);
    let j = json(&p.join(&report));
    (o, j)
}

#[test]
fn compare_outputs_passes_a_correct_output_and_names_the_bug_of_a_wrong_one() {
    let seed: u64 = rand::random();
    let d = tempfile::tempdir().unwrap();
    let p = d.path();
    let s = seed.to_string();
    let o = nvfp4dbg(
        p,
        &[
            "layertest",
            "--device",
            "cpu",
            "--tokens",
            "12",
            "--seed",
            &s,
            "--dump-inputs",
            "dump",
        ],
    );
    // only the dump matters here, not the layer's own verdict
    assert!(
        matches!(o.status.code(), Some(0 | 1)),
        "seed {seed}: {}",
        text(&o)
    );
    let dumped = dump::read(&p.join("dump")).unwrap();
    let (t, h) = (dumped.routing.tokens, dumped.layer.config.hidden_size);
    // the kernel's output as our CPU path computes it, from the dumped inputs alone
    let ours = byok::routed_cpu(
        &dumped.layer,
        &dumped.hidden,
        &dumped.routing,
        &dumped.scales,
    )
    .unwrap();
    write_output(&p.join("good.safetensors"), &ours, t, h);
    let o = nvfp4dbg(
        p,
        &[
            "compare-outputs",
            "dump",
            "good.safetensors",
            "--json",
            "good.json",
        ],
    );
    assert_eq!(o.status.code(), Some(0), "seed {seed}: {}", text(&o));
    assert_eq!(json(&p.join("good.json"))["verdict"], "pass");

    // outputs of buggy kernels: each fails, and the bug is named
    let feeding = Feeding {
        layout: Some(ScaleLayout::Swizzled),
        ep: None,
    };
    let variants = byok::bug_variants(
        &dumped.layer,
        &dumped.hidden,
        &dumped.routing,
        &dumped.scales,
        feeding,
    )
    .unwrap();
    for (bug, v) in &variants {
        write_output(&p.join("bad.safetensors"), v, t, h);
        let o = nvfp4dbg(
            p,
            &[
                "compare-outputs",
                "dump",
                "bad.safetensors",
                "--json",
                "bad.json",
            ],
        );
        assert_eq!(
            o.status.code(),
            Some(1),
            "seed {seed} {bug:?}: {}",
            text(&o)
        );
        let j = json(&p.join("bad.json"));
        assert_eq!(j["verdict"], "fail");
        assert_eq!(
            j["summary"]["diagnosis"],
            serde_json::json!(bug),
            "seed {seed}: {j}"
        );
        assert!(
            text(&o).contains(bug.describe()),
            "seed {seed}: {}",
            text(&o)
        );
    }
    assert!(variants
        .iter()
        .any(|(b, _)| *b == SuspectedBug::GateUpSwapped));

    // a kernel that drops every slot of other experts' tokens, as with local ids read as
    // global: slots of experts >= E/2 contribute nothing
    let e = dumped.layer.config.n_routed_experts as i32;
    let mut r = dumped.routing.clone();
    for (id, w) in r.topk_ids.iter().zip(r.topk_weights.iter_mut()) {
        if *id >= e / 2 {
            *w = 0.0;
        }
    }
    let dropped = byok::routed_cpu(&dumped.layer, &dumped.hidden, &r, &dumped.scales).unwrap();
    write_output(&p.join("dropped.safetensors"), &dropped, t, h);
    let o = nvfp4dbg(p, &["compare-outputs", "dump", "dropped.safetensors"]);
    assert_eq!(o.status.code(), Some(1), "seed {seed}: {}", text(&o));
    assert!(
        text(&o).contains("deviates from the built-in"),
        "{}",
        text(&o)
    );

    // an output off by a factor (cosine 1 with ours) is the kernel's scale error, not "the
    // inputs" (it used to agree with the built-in kernel by cosine alone)
    let factor = 1.5 + rand::random::<f32>();
    let scaled: Vec<f32> = ours.iter().map(|v| v * factor).collect();
    write_output(&p.join("scaled.safetensors"), &scaled, t, h);
    let o = nvfp4dbg(p, &["compare-outputs", "dump", "scaled.safetensors"]);
    assert_eq!(o.status.code(), Some(1), "seed {seed}: {}", text(&o));
    assert!(text(&o).contains("scale error"), "{}", text(&o));
    assert!(
        text(&o).contains(&format!("{factor:.4} × ours")),
        "{}",
        text(&o)
    );
    assert!(!text(&o).contains("not the kernel"), "{}", text(&o));

    // the whole layer handed back (shared experts included) is named
    let layer: Vec<f32> = ours
        .iter()
        .zip(&dumped.expected.shared_out)
        .map(|(a, b)| a + b)
        .collect();
    write_output(&p.join("layer.safetensors"), &layer, t, h);
    let o = nvfp4dbg(
        p,
        &[
            "compare-outputs",
            "dump",
            "layer.safetensors",
            "--json",
            "layer.json",
        ],
    );
    assert_eq!(o.status.code(), Some(1), "seed {seed}: {}", text(&o));
    assert_eq!(
        json(&p.join("layer.json"))["summary"]["diagnosis"],
        "shared-experts-included",
        "seed {seed}: {}",
        text(&o)
    );

    // one expert's output missing: the expert is named; rows swapped: a permutation; a row
    // never written: named (these used to fail with "the bug is in the kernel" only)
    let k = dumped.routing.top_k;
    let e = dumped.routing.topk_ids[k + 1];
    let mut r = dumped.routing.clone();
    for (id, w) in r.topk_ids.iter().zip(r.topk_weights.iter_mut()) {
        if *id == e {
            *w = 0.0;
        }
    }
    let served_by = |x: i32| -> Vec<usize> {
        (0..t)
            .filter(|&i| dumped.routing.topk_ids[i * k..(i + 1) * k].contains(&x))
            .collect()
    };
    let served = served_by(e).len();
    // another expert serving exactly the same tokens cannot be told apart
    let twin = (0..dumped.layer.config.n_routed_experts as i32)
        .any(|x| x != e && served_by(x) == served_by(e));
    let missing = byok::routed_cpu(&dumped.layer, &dumped.hidden, &r, &dumped.scales).unwrap();
    write_output(&p.join("missing.safetensors"), &missing, t, h);
    let o = nvfp4dbg(p, &["compare-outputs", "dump", "missing.safetensors"]);
    assert_eq!(o.status.code(), Some(1), "seed {seed}: {}", text(&o));
    if served >= 2 && served < t && !twin {
        assert!(
            text(&o).contains(&format!("expert {e}'s output is wrong or missing")),
            "seed {seed}: expert {e} serves {served}: {}",
            text(&o)
        );
    }
    let (a, b) = (rand::random::<usize>() % t, rand::random::<usize>() % t);
    let mut swapped = ours.clone();
    for c in 0..h {
        swapped.swap(a * h + c, b * h + c);
    }
    if a != b {
        write_output(&p.join("swapped.safetensors"), &swapped, t, h);
        let o = nvfp4dbg(p, &["compare-outputs", "dump", "swapped.safetensors"]);
        assert_eq!(o.status.code(), Some(1), "seed {seed}: {}", text(&o));
        assert!(
            text(&o).contains("tokens permuted")
                && text(&o).contains(&format!("row {} holds token {}", a.min(b), a.max(b))),
            "seed {seed}: {a} {b}: {}",
            text(&o)
        );
    }
    let mut unwritten = ours.clone();
    unwritten[a * h..(a + 1) * h].fill(0.0);
    write_output(&p.join("unwritten.safetensors"), &unwritten, t, h);
    let o = nvfp4dbg(p, &["compare-outputs", "dump", "unwritten.safetensors"]);
    assert_eq!(o.status.code(), Some(1), "seed {seed}: {}", text(&o));
    assert!(
        text(&o).contains(&format!("never written (tokens {a})")),
        "seed {seed}: {}",
        text(&o)
    );

    // a NaN the kernel never wrote fails and is counted
    let mut holes = ours.clone();
    holes[5] = f32::NAN;
    write_output(&p.join("holes.safetensors"), &holes, t, h);
    let o = nvfp4dbg(p, &["compare-outputs", "dump", "holes.safetensors"]);
    assert_eq!(o.status.code(), Some(1), "seed {seed}: {}", text(&o));
    // counted, placed at the NaN (max_abs_err's cell named the largest finite difference's
    // place), and not blamed on a poisoned call: compare-outputs made none
    assert!(
        text(&o).contains("1 NaN/Inf values where ours has none: computed so, or never written")
            && text(&o).contains("NaN at token 0 channel 5"),
        "{}",
        text(&o)
    );

    // bad input is exit 2, naming the file
    write_output(&p.join("short.safetensors"), &ours[..h], 1, h);
    let o = nvfp4dbg(p, &["compare-outputs", "dump", "short.safetensors"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("short.safetensors"), "{}", text(&o));
    let o = nvfp4dbg(p, &["compare-outputs", "nodir", "good.safetensors"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
}

/// An engine that applies each token's routing weights to the wrong slots computes every
/// expert right and combines them wrong; compare-outputs used to fail it without naming the
/// bug. The buggy outputs are built here as such engines compute them (ids sorted but not the
/// weights; the weights index one slot off), not from the diagnosis' own variants; a healthy
/// output (also rounded to BF16, as an engine returns it) passes and is named nothing.
#[test]
fn compare_outputs_names_routing_weights_applied_to_the_wrong_slots() {
    let seed: u64 = rand::random();
    let d = tempfile::tempdir().unwrap();
    let p = d.path();
    let s = seed.to_string();
    let o = nvfp4dbg(
        p,
        &[
            "layertest",
            "--device",
            "cpu",
            "--tokens",
            "16",
            "--seed",
            &s,
            "--dump-inputs",
            "dump",
        ],
    );
    assert!(
        matches!(o.status.code(), Some(0 | 1)),
        "seed {seed}: {}",
        text(&o)
    );
    let dumped = dump::read(&p.join("dump")).unwrap();
    let (t, h, k) = (
        dumped.routing.tokens,
        dumped.layer.config.hidden_size,
        dumped.routing.top_k,
    );
    let engine = |r: &nvfp4dbg::moe::Routing| {
        byok::routed_cpu(&dumped.layer, &dumped.hidden, r, &dumped.scales).unwrap()
    };
    let judge = |name: &str, out: &[f32]| {
        write_output(&p.join(format!("{name}.safetensors")), out, t, h);
        let o = nvfp4dbg(
            p,
            &[
                "compare-outputs",
                "dump",
                &format!("{name}.safetensors"),
                "--json",
                &format!("{name}.json"),
            ],
        );
        (
            o.status.code(),
            text(&o),
            json(&p.join(format!("{name}.json"))),
        )
    };

    let ours = engine(&dumped.routing);
    let bf16: Vec<f32> = ours
        .iter()
        .map(|&v| half::bf16::from_f32(v).to_f32())
        .collect();
    for (name, out) in [("good", &ours), ("good-bf16", &bf16)] {
        let (code, text, j) = judge(name, out);
        assert_eq!(code, Some(0), "seed {seed} {name}: {text}");
        assert!(
            j["summary"]["diagnosis"].is_null(),
            "seed {seed} {name}: {j}"
        );
        assert!(!text.contains("wrong slots"), "seed {seed} {name}: {text}");
    }

    // the engine sorts each token's topk_ids (say, for its block alignment) but not topk_weights
    let mut sorted = dumped.routing.clone();
    for row in sorted.topk_ids.chunks_mut(k) {
        row.sort_unstable();
    }
    // the engine reads topk_weights one slot late: slot j+1 gets slot j's weight
    let mut shifted = dumped.routing.clone();
    for row in shifted.topk_weights.chunks_mut(k) {
        row.rotate_right(1);
    }
    for (name, r, bug) in [
        ("ids-sorted", &sorted, "ids-sorted-weights-not"),
        ("shifted", &shifted, "weights-shifted-forward"),
    ] {
        let out = engine(r);
        let m = nvfp4dbg::metrics::compare(&out, &ours);
        // weights this close cannot be told from summation noise; never at top-4 in practice
        assert!(m.cosine < 0.9999, "seed {seed} {name}: cosine {}", m.cosine);
        let (code, text, j) = judge(name, &out);
        assert_eq!(code, Some(1), "seed {seed} {name}: {text}");
        assert_eq!(j["summary"]["diagnosis"], bug, "seed {seed} {name}: {text}");
        assert!(
            text.contains("routing weights applied to the wrong slots"),
            "seed {seed} {name}: {text}"
        );
    }
}

/// Two combine bugs compare-outputs failed without naming: the shared experts added twice
/// (routed + 2 shared: the kernel's own add and the engine's), and top-k weights not
/// renormalized (each token's weights scaled by its own factor, the sum of its chosen
/// scores: every row keeps our direction, only its norm moves). Both built as such an engine
/// computes them, from the dumped inputs; a BF16-accumulated healthy output still passes.
#[test]
fn compare_outputs_names_shared_experts_added_twice_and_weights_not_renormalized() {
    let seed: u64 = rand::random();
    let d = tempfile::tempdir().unwrap();
    let p = d.path();
    let s = seed.to_string();
    let o = nvfp4dbg(
        p,
        &[
            "layertest",
            "--device",
            "cpu",
            "--tokens",
            "24",
            "--seed",
            &s,
            "--dump-inputs",
            "dump",
        ],
    );
    assert!(
        matches!(o.status.code(), Some(0 | 1)),
        "seed {seed}: {}",
        text(&o)
    );
    let dumped = dump::read(&p.join("dump")).unwrap();
    let (t, h, k) = (
        dumped.routing.tokens,
        dumped.layer.config.hidden_size,
        dumped.routing.top_k,
    );
    let engine = |r: &nvfp4dbg::moe::Routing| {
        byok::routed_cpu(&dumped.layer, &dumped.hidden, r, &dumped.scales).unwrap()
    };
    let judge = |name: &str, out: &[f32]| {
        write_output(&p.join(format!("{name}.safetensors")), out, t, h);
        let f = format!("{name}.safetensors");
        let js = format!("{name}.json");
        let o = nvfp4dbg(p, &["compare-outputs", "dump", &f, "--json", &js]);
        (o.status.code(), text(&o), json(&p.join(js)))
    };
    let ours = engine(&dumped.routing);

    // healthy, accumulated slot by slot in BF16 (each token's running sum rounded)
    let mut per_slot = vec![];
    for s in 0..k {
        let mut r = dumped.routing.clone();
        for (i, w) in r.topk_weights.iter_mut().enumerate() {
            if i % k != s {
                *w = 0.0;
            }
        }
        per_slot.push(engine(&r));
    }
    let round = |v: f32| half::bf16::from_f32(v).to_f32();
    let bf16_acc: Vec<f32> = (0..t * h)
        .map(|i| per_slot.iter().fold(0.0, |a, c| round(a + round(c[i]))))
        .collect();
    let (code, out, _) = judge("bf16-acc", &bf16_acc);
    assert_eq!(code, Some(0), "seed {seed}: {out}");

    let twice: Vec<f32> = ours
        .iter()
        .zip(&dumped.expected.shared_out)
        .map(|(a, b)| a + 2.0 * b)
        .collect();
    let (code, out, j) = judge("shared-twice", &twice);
    assert_eq!(code, Some(1), "seed {seed}: {out}");
    assert_eq!(
        j["summary"]["diagnosis"], "shared-experts-added-twice",
        "seed {seed}: {out}"
    );
    assert!(
        out.contains("shared experts are added twice"),
        "seed {seed}: {out}"
    );

    // sigmoid scores of top-k experts sum to about k/2..k: the weights the router hands out
    // before renormalization are each token's normalized ones times that sum
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut unnormalized = dumped.routing.clone();
    for row in unnormalized.topk_weights.chunks_mut(k) {
        let sum = rng.gen_range(0.5..1.0) * k as f32;
        row.iter_mut().for_each(|w| *w *= sum);
    }
    let (code, out, _) = judge("not-renormalized", &engine(&unnormalized));
    assert_eq!(code, Some(1), "seed {seed}: {out}");
    assert!(
        out.contains("scaled by a factor of its own") && out.contains("not renormalized"),
        "seed {seed}: {out}"
    );
}

/// An expert's contribution dropped where it served a single token (the one-expert rule needs
/// two deviating tokens), and two experts each dropped from one token: compare-outputs failed
/// naming only "1 of T tokens deviate". Built as such a kernel computes it (that slot's weight
/// never applied), from the dumped inputs.
#[test]
fn compare_outputs_names_an_expert_contribution_dropped_from_one_token() {
    let seed: u64 = rand::random();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let d = tempfile::tempdir().unwrap();
    let p = d.path();
    let s = seed.to_string();
    let o = nvfp4dbg(
        p,
        &[
            "layertest",
            "--device",
            "cpu",
            "--tokens",
            "8",
            "--seed",
            &s,
            "--dump-inputs",
            "dump",
        ],
    );
    assert!(
        matches!(o.status.code(), Some(0 | 1)),
        "seed {seed}: {}",
        text(&o)
    );
    let dumped = dump::read(&p.join("dump")).unwrap();
    let (t, h, k) = (
        dumped.routing.tokens,
        dumped.layer.config.hidden_size,
        dumped.routing.top_k,
    );
    let engine = |r: &nvfp4dbg::moe::Routing| {
        byok::routed_cpu(&dumped.layer, &dumped.hidden, r, &dumped.scales).unwrap()
    };
    // two slots of two different tokens and experts
    let a = rng.gen_range(0..t);
    let b = (a + rng.gen_range(1..t)) % t;
    let sa = a * k + rng.gen_range(0..k);
    let sb = (0..k)
        .map(|x| b * k + x)
        .find(|&x| dumped.routing.topk_ids[x] != dumped.routing.topk_ids[sa])
        .unwrap();
    for (name, slots) in [("one", vec![sa]), ("two", vec![sa, sb])] {
        let mut r = dumped.routing.clone();
        for &x in &slots {
            r.topk_weights[x] = 0.0;
        }
        write_output(&p.join(format!("{name}.safetensors")), &engine(&r), t, h);
        let f = format!("{name}.safetensors");
        let o = nvfp4dbg(p, &["compare-outputs", "dump", &f]);
        assert_eq!(o.status.code(), Some(1), "seed {seed} {name}: {}", text(&o));
        for &x in &slots {
            let (tok, e) = (x / k, dumped.routing.topk_ids[x]);
            let want = format!("token {tok}: expert {e}");
            assert!(
                text(&o).contains(&want),
                "seed {seed} {name}: {want}: {}",
                text(&o)
            );
        }
        assert!(
            text(&o).contains("dropped"),
            "seed {seed} {name}: {}",
            text(&o)
        );
    }
}

/// What the dump cannot hold is refused before anything is written: per-batch (dynamic)
/// scales, and the per-rank views of --ep (the dump is one rank's).
#[test]
fn dump_inputs_refuses_dynamic_scales_and_ep() {
    for (flags, named) in [(["--gs", "dynamic"], "dynamic"), (["--ep", "2"], "--ep")] {
        let d = tempfile::tempdir().unwrap();
        let mut args = vec!["layertest", "--device", "cpu", "--tokens", "4"];
        args.extend(flags);
        args.extend(["--dump-inputs", "x"]);
        let o = nvfp4dbg(d.path(), &args);
        assert_eq!(o.status.code(), Some(2), "{}", text(&o));
        assert!(text(&o).contains(named), "{}", text(&o));
        assert!(!d.path().join("x").exists(), "{flags:?}");
    }
}

/// The example plugin's device code (the reference and every twin) compiles with NVRTC for
/// Hopper and Blackwell. Like tests/kernels_compile.rs it needs NVRTC and the CUDA headers from
/// `.ci/compile-kernels` (which runs it) and says it skipped when NVFP4DBG_NVRTC_CHECK is unset;
/// the host half is built by nvcc in tests/gpu_plugin.rs.
#[test]
fn the_example_plugin_compiles_for_hopper_and_blackwell() {
    use nvfp4dbg::backend::cuda::nvrtc;
    if std::env::var_os("NVFP4DBG_NVRTC_CHECK").is_none() {
        eprintln!(
            "plugin NVRTC check: skipped (NVFP4DBG_NVRTC_CHECK unset; run .ci/compile-kernels)"
        );
        return;
    }
    let module = nvrtc::KernelModule {
        file: "kernels/examples/moe_reference_plugin.cu",
        source: include_str!("../kernels/examples/moe_reference_plugin.cu"),
        kernels: &[],
    };
    let inc = format!("-I{}", header_dir().display());
    for arch in ["sm_90a", "sm_100a"] {
        for bug in 0..=5 {
            let def = format!("-DNVFP4DBG_BUG={bug}");
            let (cubin, _) = nvrtc::compile_cubin_with(&module, arch, &[&inc, &def])
                .unwrap_or_else(|e| panic!("{arch} NVFP4DBG_BUG={bug}: {e}"));
            assert!(!cubin.is_empty());
        }
    }
}

/// `layertest --device cpu --tokens T --seed S --dump-inputs DIR` in `p` (its own verdict does
/// not matter, only the dump).
fn dump_layer(p: &Path, dir: &str, seed: u64, tokens: usize) {
    let (s, t) = (seed.to_string(), tokens.to_string());
    let o = nvfp4dbg(
        p,
        &[
            "layertest",
            "--device",
            "cpu",
            "--tokens",
            &t,
            "--seed",
            &s,
            "--dump-inputs",
            dir,
        ],
    );
    assert!(
        matches!(o.status.code(), Some(0 | 1)),
        "seed {seed}: {}",
        text(&o)
    );
}

/// `dump_layer` into `p/dump`, read back.
fn layer_dump(p: &Path, seed: u64, tokens: usize) -> dump::Dumped {
    dump_layer(p, "dump", seed, tokens);
    dump::read(&p.join("dump")).unwrap()
}

/// Change tensor `name` of safetensors file `path` in place, header and metadata untouched (a
/// hex editor's edit, or a tool writing into the mapped file).
fn edit_in_place(path: &Path, name: &str, edit: impl FnOnce(&mut [u8])) {
    let mut b = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&b[8..8 + n]).unwrap();
    let off = &header[name]["data_offsets"];
    let (lo, hi) = (
        8 + n + off[0].as_u64().unwrap() as usize,
        8 + n + off[1].as_u64().unwrap() as usize,
    );
    edit(&mut b[lo..hi]);
    std::fs::write(path, b).unwrap();
}

/// Rewrite `expected.safetensors` of `dir` as a script does (load, change, save): F32
/// tensors, no metadata; `edit` gets each tensor's name and values.
fn rewrite_expected(dir: &Path, edit: impl Fn(&str, &mut Vec<f32>)) {
    use nvfp4dbg::checkpoint::file::TensorFile;
    let path = dir.join(dump::EXPECTED);
    let f = TensorFile::open(&path).unwrap();
    let names: Vec<String> = f.names().map(str::to_string).collect();
    let tensors = names
        .iter()
        .map(|n| {
            let shape = f.info(n).unwrap().shape.clone();
            let mut v = f.to_f32(n).unwrap();
            edit(n, &mut v);
            (
                TensorSpec::new(n.as_str(), safetensors::Dtype::F32, &shape),
                f32_bytes(&v),
            )
        })
        .collect();
    drop(f);
    write_file(&path, tensors, None).unwrap();
}

/// `compare-outputs DIR good.safetensors` in `p`: (exit code, text).
fn compare_outputs(p: &Path, dir: &str) -> (Option<i32>, String) {
    let o = nvfp4dbg(p, &["compare-outputs", dir, "good.safetensors"]);
    (o.status.code(), text(&o))
}

/// compare-outputs used to judge against `expected.safetensors` blindly: one row of
/// `nvfp4_routed` scaled turned a correct kernel output into a failure blamed on the kernel.
/// An edit that keeps the metadata is caught by the digest; one that drops it (a script
/// rewriting the file) by the CPU recompute, which names the first token that differs; a
/// changed `shared_out` by `nvfp4_out = nvfp4_routed + shared_out`. Exit 2 naming
/// expected.safetensors and the tensor.
#[test]
fn compare_outputs_refuses_a_dump_whose_expected_outputs_were_edited() {
    let seed: u64 = rand::random();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let d = tempfile::tempdir().unwrap();
    let p = d.path();
    let dumped = layer_dump(p, seed, 12);
    assert!(
        dumped.check.digests_verified && dumped.check.routed_recompute.is_some(),
        "seed {seed}: {:?}",
        dumped.check
    );
    let (t, h) = (dumped.routing.tokens, dumped.layer.config.hidden_size);
    let ours = byok::routed_cpu(
        &dumped.layer,
        &dumped.hidden,
        &dumped.routing,
        &dumped.scales,
    )
    .unwrap();
    write_output(&p.join("good.safetensors"), &ours, t, h);
    let (code, out) = compare_outputs(p, "dump");
    assert_eq!(code, Some(0), "seed {seed}: {out}");
    assert!(out.contains("every tensor matches the digest"), "{out}");
    let saved = std::fs::read(p.join("dump").join(dump::EXPECTED)).unwrap();
    let restore = || std::fs::write(p.join("dump").join(dump::EXPECTED), &saved).unwrap();

    let row = rng.gen_range(0..t);
    let factor = rng.gen_range(1.5f32..2.5);
    let scale_row = |v: &mut [f32]| {
        v[row * h..(row + 1) * h]
            .iter_mut()
            .for_each(|x| *x *= factor)
    };
    // in place, metadata kept: the digest
    edit_in_place(&p.join("dump").join(dump::EXPECTED), "nvfp4_routed", |b| {
        let mut v: Vec<f32> = b
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        scale_row(&mut v);
        b.copy_from_slice(&f32_bytes(&v));
    });
    let (code, out) = compare_outputs(p, "dump");
    assert_eq!(code, Some(2), "seed {seed}: {out}");
    assert!(
        out.contains("expected.safetensors")
            && out.contains("`nvfp4_routed`")
            && out.contains("layertest --dump-inputs"),
        "seed {seed}: {out}"
    );
    // rewritten without metadata: the recompute, naming the row
    restore();
    rewrite_expected(&p.join("dump"), |n, v| {
        if n == "nvfp4_routed" {
            scale_row(v)
        }
    });
    let (code, out) = compare_outputs(p, "dump");
    assert_eq!(code, Some(2), "seed {seed}: {out}");
    assert!(
        out.contains("expected.safetensors")
            && out.contains("nvfp4_routed does not match the dumped inputs")
            && out.contains(&format!("first differing token {row}")),
        "seed {seed} row {row}: {out}"
    );
    assert!(dump::read(&p.join("dump")).is_err());
    // shared_out changed (and nothing else): nvfp4_out is no longer routed + shared
    restore();
    rewrite_expected(&p.join("dump"), |n, v| {
        if n == "shared_out" {
            scale_row(v)
        }
    });
    let (code, out) = compare_outputs(p, "dump");
    assert_eq!(code, Some(2), "seed {seed}: {out}");
    assert!(
        out.contains("expected.safetensors")
            && out.contains("nvfp4_out does not match nvfp4_routed + shared_out"),
        "seed {seed}: {out}"
    );
    // the same file rewritten unchanged (metadata lost) still loads: recomputed, not digested
    restore();
    rewrite_expected(&p.join("dump"), |_, _| {});
    let (code, out) = compare_outputs(p, "dump");
    assert_eq!(code, Some(0), "seed {seed}: {out}");
    assert!(out.contains("not verified by digest"), "{out}");
}

/// A directory mixing two layertest runs: expected.safetensors of a run with another seed
/// beside the inputs of this one (with its digests, and without them as an older nvfp4dbg
/// wrote it), and the inputs of a run with other --tokens beside this run's expected outputs.
/// compare-outputs used to judge against the other run's numbers.
#[test]
fn compare_outputs_refuses_a_dump_mixing_two_layertest_runs() {
    let seed: u64 = rand::random::<u64>() >> 1;
    let d = tempfile::tempdir().unwrap();
    let p = d.path();
    dump_layer(p, "dump", seed, 12);
    dump_layer(p, "other-seed", seed + 1, 12);
    dump_layer(p, "other-tokens", seed, 8);
    let dumped = dump::read(&p.join("dump")).unwrap();
    let (t, h) = (dumped.routing.tokens, dumped.layer.config.hidden_size);
    write_output(
        &p.join("good.safetensors"),
        &dumped.expected.nvfp4_routed,
        t,
        h,
    );
    let (code, out) = compare_outputs(p, "dump");
    assert_eq!(code, Some(0), "seed {seed}: {out}");

    let copy = |from: &str, file: &str, to: &str| {
        std::fs::create_dir_all(p.join(to)).unwrap();
        std::fs::copy(p.join(from).join(file), p.join(to).join(file)).unwrap();
    };
    copy("dump", dump::INPUTS, "mixed");
    copy("other-seed", dump::EXPECTED, "mixed");
    let (code, out) = compare_outputs(p, "mixed");
    assert_eq!(code, Some(2), "seed {seed}: {out}");
    assert!(
        out.contains("expected.safetensors") && out.contains("layertest --dump-inputs"),
        "seed {seed}: {out}"
    );
    rewrite_expected(&p.join("mixed"), |_, _| {});
    let (code, out) = compare_outputs(p, "mixed");
    assert_eq!(code, Some(2), "seed {seed}: {out}");
    assert!(
        out.contains("expected.safetensors")
            && out.contains("nvfp4_routed does not match the dumped inputs")
            && out.contains("first differing token 0"),
        "seed {seed}: {out}"
    );
    // a second run with --tokens 8 that wrote only inputs.safetensors
    copy("other-tokens", dump::INPUTS, "partial");
    copy("dump", dump::EXPECTED, "partial");
    let (code, out) = compare_outputs(p, "partial");
    assert_eq!(code, Some(2), "seed {seed}: {out}");
    assert!(
        out.contains("inputs.safetensors")
            && out.contains("expected.safetensors was computed from"),
        "seed {seed}: {out}"
    );
}

/// Above the recompute limit (tokens · top_k · 3 · hidden · intermediate multiply-adds > 4e9)
/// only the digests check a dump: a tampered input tensor (one hidden state, one weight byte)
/// is named; the untouched dump passes without a recompute; the same dump without digests
/// (an older nvfp4dbg's) still loads and says it was not verified.
#[test]
fn compare_outputs_checks_a_dump_above_the_recompute_limit_by_its_digests() {
    let seed: u64 = rand::random();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let d = tempfile::tempdir().unwrap();
    let p = d.path();
    // tiny: 4 · 3 · 256 · 128 multiply-adds a token
    let tokens = (byok::KERNEL_CHECK_MAX_MACS / (4.0 * 3.0 * 256.0 * 128.0)) as usize + 64;
    let dumped = layer_dump(p, seed, tokens);
    assert!(
        dumped.check.digests_verified && dumped.check.routed_recompute.is_none(),
        "seed {seed}: {:?}",
        dumped.check
    );
    let (t, h) = (dumped.routing.tokens, dumped.layer.config.hidden_size);
    write_output(
        &p.join("good.safetensors"),
        &dumped.expected.nvfp4_routed,
        t,
        h,
    );
    let (code, out) = compare_outputs(p, "dump");
    assert_eq!(code, Some(0), "seed {seed}: {out}");
    assert!(
        out.contains("every tensor matches the digest") && out.contains("not recomputed"),
        "{out}"
    );
    let inputs = p.join("dump").join(dump::INPUTS);
    let saved = std::fs::read(&inputs).unwrap();
    for name in ["hidden_states", "w2"] {
        std::fs::write(&inputs, &saved).unwrap();
        edit_in_place(&inputs, name, |b| {
            let i = rng.gen_range(0..b.len());
            b[i] ^= 0x11;
        });
        let (code, out) = compare_outputs(p, "dump");
        assert_eq!(code, Some(2), "seed {seed} {name}: {out}");
        assert!(
            out.contains("inputs.safetensors")
                && out.contains(&format!("`{name}`"))
                && out.contains("expected.safetensors was computed from"),
            "seed {seed} {name}: {out}"
        );
    }
    std::fs::write(&inputs, &saved).unwrap();
    rewrite_expected(&p.join("dump"), |_, _| {});
    let (code, out) = compare_outputs(p, "dump");
    assert_eq!(code, Some(0), "seed {seed}: {out}");
    assert!(out.contains("NOT VERIFIED"), "{out}");
}

/// A C kernel writing the output column-major into a flat buffer: compare-outputs accepts the
/// flat `[tokens · hidden]` tensor and used to fail it naming no bug; it is named now.
#[test]
fn compare_outputs_names_a_flat_output_written_transposed() {
    let seed: u64 = rand::random();
    let d = tempfile::tempdir().unwrap();
    let p = d.path();
    let dumped = layer_dump(p, seed, 10);
    let (t, h) = (dumped.routing.tokens, dumped.layer.config.hidden_size);
    let ours = &dumped.expected.nvfp4_routed;
    let mut flat = vec![0f32; t * h];
    for tok in 0..t {
        for c in 0..h {
            flat[c * t + tok] = ours[tok * h + c];
        }
    }
    // flat, and shaped [hidden, tokens] (that one was refused as a shape mismatch, exit 2)
    for shape in [vec![t * h], vec![h, t]] {
        write_file(
            &p.join("flat.safetensors"),
            vec![(
                TensorSpec::new("output", safetensors::Dtype::F32, &shape),
                f32_bytes(&flat),
            )],
            None,
        )
        .unwrap();
        let o = nvfp4dbg(
            p,
            &[
                "compare-outputs",
                "dump",
                "flat.safetensors",
                "--json",
                "flat.json",
            ],
        );
        assert_eq!(
            o.status.code(),
            Some(1),
            "seed {seed} {shape:?}: {}",
            text(&o)
        );
        assert_eq!(
            json(&p.join("flat.json"))["summary"]["diagnosis"],
            "output-transposed",
            "seed {seed} {shape:?}: {}",
            text(&o)
        );
        assert!(text(&o).contains("written transposed"), "{}", text(&o));
    }
}

/// A kernel that ignores V4's swiglu_limit (gate and up unclamped) is named on a tiny-v4 dump
/// whose activations reach the limit; it used to be only "N of M tokens deviate".
#[test]
fn compare_outputs_names_swiglu_limit_ignored() {
    let seed: u64 = rand::random();
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let d = tempfile::tempdir().unwrap();
    let p = d.path();
    let o = nvfp4dbg(
        p,
        &[
            "synth",
            "--preset",
            "tiny-v4",
            "--out",
            "ck",
            "--seed",
            &seed.to_string(),
        ],
    );
    assert_eq!(o.status.code(), Some(0), "seed {seed}: {}", text(&o));
    // hidden states 4x randn: the gate and up outputs reach swiglu_limit 10
    let (t, h) = (32, 256);
    let hidden: Vec<f32> = (0..t * h)
        .map(|_| {
            let (a, b): (f32, f32) = (r.gen_range(1e-7..1.0), r.gen());
            4.0 * (-2.0 * a.ln()).sqrt() * (std::f32::consts::TAU * b).cos()
        })
        .collect();
    write_file(
        &p.join("in.safetensors"),
        vec![(
            TensorSpec::new("hidden_states", safetensors::Dtype::F32, &[t, h]),
            f32_bytes(&hidden),
        )],
        None,
    )
    .unwrap();
    let o = nvfp4dbg(
        p,
        &[
            "layertest",
            "--device",
            "cpu",
            "--checkpoint",
            "ck",
            "--layer",
            "1",
            "--input",
            "in.safetensors",
            "--gs",
            "30",
            "--dump-inputs",
            "dump",
        ],
    );
    assert!(
        matches!(o.status.code(), Some(0 | 1)),
        "seed {seed}: {}",
        text(&o)
    );
    let dumped = dump::read(&p.join("dump")).unwrap();
    assert_eq!(dumped.layer.config.swiglu_limit, Some(10.0));
    let feeding = Feeding {
        layout: Some(ScaleLayout::Swizzled),
        ep: None,
    };
    let variants = byok::bug_variants(
        &dumped.layer,
        &dumped.hidden,
        &dumped.routing,
        &dumped.scales,
        feeding,
    )
    .unwrap();
    let (_, unclamped) = variants
        .iter()
        .find(|(b, _)| *b == SuspectedBug::SwigluLimitIgnored)
        .unwrap_or_else(|| panic!("seed {seed}: no swiglu_limit variant"));
    write_output(&p.join("bad.safetensors"), unclamped, t, h);
    let o = nvfp4dbg(
        p,
        &[
            "compare-outputs",
            "dump",
            "bad.safetensors",
            "--json",
            "bad.json",
        ],
    );
    assert_eq!(o.status.code(), Some(1), "seed {seed}: {}", text(&o));
    assert_eq!(
        json(&p.join("bad.json"))["summary"]["diagnosis"],
        "swiglu-limit-ignored",
        "seed {seed}: {}",
        text(&o)
    );
}

/// A correct kernel on a checkpoint with a NaN block scale reproduces our NaN bit for bit:
/// compare-outputs used to say it "deviates from the built-in" kernel and blame the NaN expert's
/// output on it; it agrees with ours, and the inputs are to blame.
#[test]
fn compare_outputs_agrees_with_a_kernel_reproducing_our_nan() {
    let seed: u64 = rand::random();
    let d = tempfile::tempdir().unwrap();
    let p = d.path();
    let s = seed.to_string();
    let o = nvfp4dbg(
        p,
        &[
            "synth",
            "--out",
            "ckpt",
            "--seed",
            &s,
            "--plant",
            "nan-block-scale",
        ],
    );
    assert_eq!(o.status.code(), Some(0), "seed {seed}: {}", text(&o));
    let o = nvfp4dbg(
        p,
        &[
            "layertest",
            "--checkpoint",
            "ckpt",
            "--device",
            "cpu",
            "--tokens",
            "24",
            "--seed",
            &s,
            "--dump-inputs",
            "dump",
        ],
    );
    assert_eq!(o.status.code(), Some(1), "seed {seed}: {}", text(&o));
    let dumped = dump::read(&p.join("dump")).unwrap();
    let (t, h) = (dumped.routing.tokens, dumped.layer.config.hidden_size);
    let ours = &dumped.expected.nvfp4_routed;
    assert!(ours.iter().any(|v| v.is_nan()), "seed {seed}: no NaN");
    write_output(&p.join("same.safetensors"), ours, t, h);
    let o = nvfp4dbg(
        p,
        &[
            "compare-outputs",
            "dump",
            "same.safetensors",
            "--json",
            "same.json",
        ],
    );
    // the layer holds NaN: a failure, but not the kernel's
    assert_eq!(o.status.code(), Some(1), "seed {seed}: {}", text(&o));
    assert!(
        text(&o).contains("agrees with the built-in NVFP4 kernel"),
        "seed {seed}: {}",
        text(&o)
    );
    assert!(!text(&o).contains("deviates"), "seed {seed}: {}", text(&o));
    let j = json(&p.join("same.json"));
    assert_eq!(j["kernel"]["judgement"]["agree"], true, "seed {seed}: {j}");
    assert!(j["localization"].is_null(), "seed {seed}: {j}");

    // NaN in one more row than ours is still the kernel's
    let mut more = ours.clone();
    let row = (0..t)
        .find(|&r| more[r * h..(r + 1) * h].iter().all(|v| v.is_finite()))
        .unwrap();
    more[row * h] = f32::NAN;
    write_output(&p.join("more.safetensors"), &more, t, h);
    let o = nvfp4dbg(p, &["compare-outputs", "dump", "more.safetensors"]);
    assert_eq!(o.status.code(), Some(1), "seed {seed}: {}", text(&o));
    assert!(
        text(&o).contains("deviates from the built-in"),
        "seed {seed}: {}",
        text(&o)
    );
}

/// Guards two engine mistakes compare-outputs failed without naming (only "N of M tokens
/// deviate ... the bug is in the kernel"): a weight-only W4A16 kernel (BF16 activations, as
/// Marlin's NVFP4 MoE on Hopper), computed here independently from the dequantized weights,
/// and gs1/gs2 handed the other way round.
#[test]
fn compare_outputs_names_a_w4a16_kernel_and_swapped_gs() {
    use nvfp4dbg::moe::{moe_forward, ActScales, Path as MoePath};
    let seed: u64 = rand::random();
    let d = tempfile::tempdir().unwrap();
    let p = d.path();
    let s = seed.to_string();
    let o = nvfp4dbg(
        p,
        &["synth", "--preset", "tiny", "--out", "ck", "--seed", &s],
    );
    assert_eq!(o.status.code(), Some(0), "seed {seed}: {}", text(&o));
    let args = [
        "layertest",
        "--device",
        "cpu",
        "--checkpoint",
        "ck",
        "--seed",
        &s,
    ];
    let o = nvfp4dbg(
        p,
        &[&args[..], &["--gs", "calibrated", "--dump-inputs", "dump"]].concat(),
    );
    assert!(
        matches!(o.status.code(), Some(0 | 1)),
        "seed {seed}: {}",
        text(&o)
    );
    let dumped = dump::read(&p.join("dump")).unwrap();
    let (layer, routing) = (&dumped.layer, &dumped.routing);
    let (h, i) = (layer.config.hidden_size, layer.config.moe_intermediate_size);
    let (t, k) = (routing.tokens, routing.top_k);
    assert_eq!(layer.config.swiglu_limit, None);

    // W4A16: BF16 inputs times the dequantized weights, f64 sums, the SwiGLU output in BF16
    let deq: Vec<[Vec<f32>; 3]> = layer
        .experts
        .iter()
        .map(|x| {
            [
                x.w1.weight.dequantize(),
                x.w3.weight.dequantize(),
                x.w2.weight.dequantize(),
            ]
        })
        .collect();
    let dot = |w: &[f32], row: usize, x: &[f32]| -> f64 {
        let n = x.len();
        w[row * n..(row + 1) * n]
            .iter()
            .zip(x)
            .map(|(&a, &b)| a as f64 * b as f64)
            .sum()
    };
    let mut w4a16 = vec![0f32; t * h];
    for tok in 0..t {
        let x = &dumped.hidden[tok * h..(tok + 1) * h];
        for slot in 0..k {
            let e = routing.topk_ids[tok * k + slot] as usize;
            let [w1, w3, w2] = &deq[e];
            let a: Vec<f32> = (0..i)
                .map(|j| {
                    let g = dot(w1, j, x) as f32;
                    let u = dot(w3, j, x) as f32;
                    half::bf16::from_f32(g / (1.0 + (-g).exp()) * u).to_f32()
                })
                .collect();
            for c in 0..h {
                w4a16[tok * h + c] += routing.topk_weights[tok * k + slot] * dot(w2, c, &a) as f32;
            }
        }
    }
    let ActScales::Fixed { gs1, gs2 } = &dumped.scales else {
        panic!("seed {seed}: calibrated scales are fixed");
    };
    assert_ne!(gs1, gs2, "seed {seed}");
    let swapped = ActScales::Fixed {
        gs1: gs2.clone(),
        gs2: gs1.clone(),
    };
    let mut routed_only = layer.clone();
    routed_only.shared = None;
    let path = MoePath::Nvfp4 {
        scales: &swapped,
        flavor: nvfp4dbg::nvfp4::Flavor::Reference,
    };
    let gs_swapped = moe_forward(&routed_only, &dumped.hidden, routing, &path, false)
        .unwrap()
        .out;

    for (name, out, want) in [
        ("w4a16", &w4a16, "activations-not-quantized"),
        ("gs_swapped", &gs_swapped, "gs-swapped"),
    ] {
        write_output(&p.join(format!("{name}.safetensors")), out, t, h);
        let (f, j) = (format!("{name}.safetensors"), format!("{name}.json"));
        let o = nvfp4dbg(p, &["compare-outputs", "dump", &f, "--json", &j]);
        assert_eq!(o.status.code(), Some(1), "seed {seed} {name}: {}", text(&o));
        assert_eq!(
            json(&p.join(&j))["summary"]["diagnosis"],
            want,
            "seed {seed}: {}",
            text(&o)
        );
    }
}

/// compare-outputs took an FP8 (or F64) output although it names F32, BF16 or F16 as the
/// output dtypes: an F8_E4M3 output was judged as a kernel deviation instead of exit 2.
#[test]
fn compare_outputs_refuses_an_output_dtype_a_kernel_does_not_write() {
    let seed: u64 = rand::random();
    let d = tempfile::tempdir().unwrap();
    let p = d.path();
    let dumped = layer_dump(p, seed, 8);
    let (t, h) = (dumped.routing.tokens, dumped.layer.config.hidden_size);
    let ours = byok::routed_cpu(
        &dumped.layer,
        &dumped.hidden,
        &dumped.routing,
        &dumped.scales,
    )
    .unwrap();
    let f8: Vec<u8> = ours
        .iter()
        .map(|&v| nvfp4dbg::nvfp4::e4m3::encode_saturating(v))
        .collect();
    let f64s: Vec<u8> = ours
        .iter()
        .flat_map(|&v| f64::from(v).to_le_bytes())
        .collect();
    for (dtype, name, bytes) in [
        (safetensors::Dtype::F8_E4M3, "F8_E4M3", f8),
        (safetensors::Dtype::F64, "F64", f64s),
    ] {
        let f = format!("{name}.safetensors");
        write_file(
            &p.join(&f),
            vec![(TensorSpec::new("output", dtype, &[t, h]), bytes)],
            None,
        )
        .unwrap();
        let o = nvfp4dbg(p, &["compare-outputs", "dump", &f]);
        assert_eq!(o.status.code(), Some(2), "seed {seed}: {}", text(&o));
        assert!(
            text(&o).contains(&f)
                && text(&o).contains("tensor `output`")
                && text(&o).contains(&format!("dtype {name}, expected F32, BF16 or F16")),
            "seed {seed}: {}",
            text(&o)
        );
    }
    // the dtypes a kernel writes still pass
    write_file(
        &p.join("bf16.safetensors"),
        vec![(
            TensorSpec::new("output", safetensors::Dtype::BF16, &[t, h]),
            nvfp4dbg::checkpoint::writer::bf16_bytes(&ours),
        )],
        None,
    )
    .unwrap();
    let o = nvfp4dbg(p, &["compare-outputs", "dump", "bf16.safetensors"]);
    assert_ne!(o.status.code(), Some(2), "seed {seed}: {}", text(&o));
}

/// An engine that multiplies topk_weights in twice (the kernel's finalize and its own
/// combine, output Σ w² · y): compare-outputs failed it as "N of M tokens deviate" without
/// naming it.
#[test]
fn compare_outputs_names_routing_weights_applied_twice() {
    let seed: u64 = rand::random();
    let d = tempfile::tempdir().unwrap();
    let p = d.path();
    let dumped = layer_dump(p, seed, 16);
    let (t, h) = (dumped.routing.tokens, dumped.layer.config.hidden_size);
    let mut twice = dumped.routing.clone();
    for w in &mut twice.topk_weights {
        *w *= *w;
    }
    let out = byok::routed_cpu(&dumped.layer, &dumped.hidden, &twice, &dumped.scales).unwrap();
    let (o, j) = judge_output(p, "twice", &out, t, h);
    assert_eq!(o.status.code(), Some(1), "seed {seed}: {}", text(&o));
    assert_eq!(
        j["summary"]["diagnosis"],
        "weights-applied-twice",
        "seed {seed}: {}",
        text(&o)
    );
    assert!(
        text(&o).contains("routing weights applied twice"),
        "seed {seed}: {}",
        text(&o)
    );
}

/// Guards: a kernel reading the weights' linear block scales transposed ([K/16, N] for
/// [N, K/16]) failed with no known bug named.
#[test]
fn compare_outputs_names_block_scales_read_transposed() {
    let seed: u64 = rand::random();
    let d = tempfile::tempdir().unwrap();
    let p = d.path();
    let dumped = layer_dump(p, seed, 16);
    let (t, h) = (dumped.routing.tokens, dumped.layer.config.hidden_size);
    let mut layer = dumped.layer.clone();
    for x in &mut layer.experts {
        for l in [&mut x.w1, &mut x.w3, &mut x.w2] {
            let w = &mut l.weight;
            let (rows, kb) = (w.rows, w.cols / 16);
            let orig = w.scales.clone();
            for m in 0..rows {
                for k in 0..kb {
                    w.scales[m * kb + k] = orig[k * rows + m];
                }
            }
        }
    }
    let out = byok::routed_cpu(&layer, &dumped.hidden, &dumped.routing, &dumped.scales).unwrap();
    let (o, j) = judge_output(p, "scales_t", &out, t, h);
    assert_eq!(o.status.code(), Some(1), "seed {seed}: {}", text(&o));
    assert_eq!(
        j["summary"]["diagnosis"],
        "scales-read-transposed",
        "seed {seed}: {}",
        text(&o)
    );
    assert!(
        text(&o).contains("read transposed, as [K/16, N]"),
        "seed {seed}: {}",
        text(&o)
    );
}
