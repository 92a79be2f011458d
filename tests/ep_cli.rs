//! `--ep` through the real binary on the CPU: layertest, gs-sweep and multilayer sharded over
//! N ranks agree with the unsharded run; `--fault` is caught and named; `--save-routing`
//! writes per-rank dumps that `routing` flags; bad combinations are usage errors (exit 2).

use safetensors::SafeTensors;
use serde_json::Value;
use std::path::Path;
use std::process::Command;

/// Run the binary in `dir`; returns (exit code, stdout+stderr, JSON report if written).
fn run(dir: &Path, args: &[&str]) -> (i32, String, Option<Value>) {
    let json = dir.join(format!("report-{}.json", rand::random::<u32>()));
    let out = Command::new(env!("CARGO_BIN_EXE_nvfp4dbg"))
        .current_dir(dir)
        .args(args)
        .args([
            "--json",
            json.to_str().unwrap(),
            "--no-report-dir",
            "--quiet",
        ])
        .output()
        .expect("run nvfp4dbg");
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    let report = std::fs::read(&json)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok());
    (out.status.code().unwrap_or(-1), text, report)
}

fn seed() -> String {
    let s = rand::random::<u16>().to_string();
    eprintln!("seed {s}");
    s
}

/// `topk_ids` `[T, K]` of a `--save-outputs` file.
fn topk_ids(file: &Path) -> Vec<i64> {
    let bytes = std::fs::read(file).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    st.tensor("topk_ids")
        .unwrap()
        .data()
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

#[test]
fn layertest_sharded_over_n_ranks_agrees_with_one_rank() {
    let s = seed();
    let dir = tempfile::tempdir().unwrap();
    let base = [
        "layertest",
        "--device",
        "cpu",
        "--tokens",
        "16",
        "--seed",
        &s,
    ];
    let (code, text, one) = run(dir.path(), &base);
    assert_eq!(code, 0, "seed {s}:\n{text}");
    let one = one.unwrap();
    assert!(one.get("ep").is_none(), "no EP section without --ep");
    let cos1 = one["summary"]["cosine"].as_f64().unwrap();
    for n in ["2", "4", "8"] {
        for placement in ["linear", "round-robin"] {
            let mut args = base.to_vec();
            args.extend(["--ep", n, "--placement", placement]);
            let (code, text, r) = run(dir.path(), &args);
            let what = format!("seed {s} --ep {n} --placement {placement}");
            assert_eq!(code, 0, "{what}:\n{text}");
            let r = r.unwrap();
            let ep = &r["ep"];
            assert_eq!(ep["size"], n.parse::<u64>().unwrap(), "{what}");
            assert_eq!(ep["placement"], placement, "{what}");
            assert_eq!(
                ep["agreement"]["within_bound"], true,
                "{what}: {}",
                ep["agreement"]
            );
            assert_eq!(ep["act_stats_match_unsharded"], true, "{what}");
            assert_eq!(ep["reduce"]["method"], "host", "{what}");
            assert_eq!(r["summary"]["ep_within_bound"], true, "{what}");
            assert_eq!(
                r["summary"]["dropped_by_rank"],
                serde_json::json!({}),
                "{what}"
            );
            let ranks = ep["ranks"].as_array().unwrap();
            assert_eq!(ranks.len().to_string(), n, "{what}");
            let owned: u64 = ranks
                .iter()
                .map(|x| x["slots"]["owned"].as_u64().unwrap())
                .sum();
            assert_eq!(
                owned,
                16 * 4,
                "{what}: every (token, slot) pair has one owner"
            );
            assert!(ranks.iter().all(
                |x| x["slots"]["dropped"] == 0 && x["slots"]["computed"] == x["slots"]["owned"]
            ));
            // the same layer, up to FP32 summation order
            let cos = r["summary"]["cosine"].as_f64().unwrap();
            assert!((cos - cos1).abs() < 1e-6, "{what}: cosine {cos} vs {cos1}");
            assert!(text.contains("EP ranks"), "{what}:\n{text}");
        }
    }
}

#[test]
fn flipped_id_conventions_fail_naming_the_convention_and_the_ranks() {
    let s = seed();
    let dir = tempfile::tempdir().unwrap();
    for (fault, named) in [
        ("local-ids", "local ids taken as global ids"),
        ("global-ids", "global ids taken as local ids"),
    ] {
        for placement in ["linear", "round-robin"] {
            let what = format!("seed {s} --fault {fault} --placement {placement}");
            let out = dir.path().join(format!("{fault}-{placement}.safetensors"));
            let (code, text, r) = run(
                dir.path(),
                &[
                    "layertest",
                    "--device",
                    "cpu",
                    "--tokens",
                    "24",
                    "--seed",
                    &s,
                    "--ep",
                    "2",
                    "--placement",
                    placement,
                    "--fault",
                    fault,
                    "--save-outputs",
                    out.to_str().unwrap(),
                ],
            );
            assert_eq!(code, 1, "{what}:\n{text}");
            let r = r.unwrap();
            let first = r["failures"][0].as_str().unwrap();
            assert!(first.contains(named), "{what}: {first}");
            assert!(r["summary"]["text"].as_str().unwrap().contains(named));
            assert_eq!(r["ep"]["fault"], fault, "{what}");
            assert_eq!(r["ep"]["agreement"]["within_bound"], false, "{what}");
            // rank 1 owns experts [8, 16) (linear) or the odd ones (round-robin): under both
            // faults it never computes its own pairs (its local ids are rank 0's experts /
            // its global ids fall off its table)
            let ids = topk_ids(&out);
            let owned1 = ids
                .iter()
                .filter(|&&g| match placement {
                    "linear" => g >= 8,
                    _ => g % 2 == 1,
                })
                .count() as u64;
            let dropped = &r["summary"]["dropped_by_rank"];
            let d1 = dropped["1"].as_u64().unwrap_or(0);
            match (fault, placement) {
                // round-robin rank 1, local ids taken as global: local id l = g / 2 runs where
                // it is odd (as local expert l / 2, the wrong one), is dropped where even
                ("local-ids", "round-robin") => {
                    let want = ids
                        .iter()
                        .filter(|&&g| g % 2 == 1 && (g / 2) % 2 == 0)
                        .count();
                    assert_eq!(d1, want as u64, "{what}");
                }
                // global ids on rank 1's 8-entry table: its own ids ≥ 8 fall off (linear);
                // round-robin: its odd ids < 8 run local expert g (global 2g + 1: wrong)
                ("global-ids", "round-robin") => {
                    let want = ids.iter().filter(|&&g| g % 2 == 1 && g >= 8).count();
                    assert_eq!(d1, want as u64, "{what}");
                }
                _ => assert_eq!(d1, owned1, "{what}: rank 1 drops all its pairs"),
            }
            assert!(d1 > 0, "{what}: seed without rank-1 pairs?");
            assert!(first.contains("rank 1 silently dropped"), "{what}: {first}");
            let ranks = r["ep"]["ranks"].as_array().unwrap();
            let share = ranks[1]["share"]["cosine"].as_f64().unwrap();
            assert!(share < 0.9, "{what}: rank 1's share cosine {share}");
            // the routing checks of what rank 1 was handed name the confusion
            let kinds: Vec<&str> = ranks[1]["routing_findings"]
                .as_array()
                .unwrap()
                .iter()
                .map(|f| f["kind"].as_str().unwrap())
                .collect();
            assert!(
                kinds.contains(&"out_of_range") || kinds.contains(&"local_ids_as_global"),
                "{what}: {kinds:?}"
            );
        }
    }
}

/// Run the `routing` command a layertest report advertises for one dump.
fn routing_cmd(dir: &Path, cmd: &str) -> (i32, String, Option<Value>) {
    let args: Vec<&str> = cmd.split_whitespace().skip(1).collect();
    assert_eq!(args[0], "routing", "{cmd}");
    run(dir, &args)
}

#[test]
fn saved_routing_dumps_are_flagged_by_the_routing_command() {
    let s = seed();
    let dir = tempfile::tempdir().unwrap();
    let layertest = |fault: Option<&str>, out: &str| -> Value {
        let mut args = vec![
            "layertest",
            "--device",
            "cpu",
            "--tokens",
            "32",
            "--seed",
            &s,
            "--ep",
            "2",
            "--save-routing",
            out,
        ];
        if let Some(f) = fault {
            args.extend(["--fault", f]);
        }
        let (code, text, r) = run(dir.path(), &args);
        assert_eq!(
            code,
            if fault.is_some() { 1 } else { 0 },
            "{fault:?}:\n{text}"
        );
        r.unwrap()
    };
    let dumps = |r: &Value| -> Vec<String> {
        r["ep"]["routing_dumps"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d["command"].as_str().unwrap().to_string())
            .collect()
    };
    // clean: both ranks' dumps hold global ids over all experts
    let clean = layertest(None, "clean");
    let cmds = dumps(&clean);
    assert_eq!(cmds.len(), 2);
    for c in &cmds {
        let (code, text, _) = routing_cmd(dir.path(), c);
        assert_eq!(code, 0, "seed {s}: {c}\n{text}");
    }
    assert!(dir.path().join("clean/rank1.safetensors").is_file());
    // local ids taken as global: rank 1's dump holds local ids [0, 8) and -1
    let r = layertest(Some("local-ids"), "local");
    let c = &dumps(&r)[1];
    assert!(c.contains("--ids global"), "{c}");
    let (code, text, rep) = routing_cmd(dir.path(), c);
    assert_eq!(code, 1, "seed {s}: {c}\n{text}");
    let t = rep.unwrap().to_string();
    assert!(t.contains("local_ids_as_global"), "seed {s}: {t}");
    // global ids taken as local: rank 1's kernel reads global ids as local ones
    let r = layertest(Some("global-ids"), "global");
    let c = &dumps(&r)[1];
    assert!(c.contains("--ids local"), "{c}");
    let (code, text, rep) = routing_cmd(dir.path(), c);
    assert_eq!(code, 1, "seed {s}: {c}\n{text}");
    let t = rep.unwrap().to_string();
    assert!(t.contains("global_ids_as_local"), "seed {s}: {t}");
    // the dump's metadata carries the EP setup, so the bare command finds the rank too
    let (code, _, _) = run(
        dir.path(),
        &["routing", "local/rank1.safetensors", "--num-experts", "16"],
    );
    assert_eq!(code, 1);
}

#[test]
fn gs_sweep_and_multilayer_run_sharded() {
    let s = seed();
    let dir = tempfile::tempdir().unwrap();
    let (code, text, r) = run(
        dir.path(),
        &[
            "gs-sweep",
            "--device",
            "cpu",
            "--tokens",
            "8",
            "--seed",
            &s,
            "--points",
            "3",
            "--gs",
            "calibrated",
            "--ep",
            "4",
            "--placement",
            "round-robin",
        ],
    );
    assert!(code == 0 || code == 1, "seed {s}:\n{text}");
    let r = r.unwrap();
    assert_eq!(
        r["summary"]["ep_within_bound"], true,
        "seed {s}: {}",
        r["ep"]
    );
    assert_eq!(r["ep"]["size"], 4);
    let (code, text, r) = run(
        dir.path(),
        &[
            "multilayer",
            "--device",
            "cpu",
            "--tokens",
            "8",
            "--seed",
            &s,
            "--layers",
            "1..=2",
            "--ep",
            "2",
            // what this test checks is the sharding, not the verdict on the random model:
            // with 8 tokens a rare seed's layer 2 amplifies the error past the default 2.0
            // (seed 46988: 2.13x, routing 90.6% agreed), which fails the run with exit 1
            "--max-amplification",
            "1000",
        ],
    );
    assert_eq!(code, 0, "seed {s}:\n{text}");
    let r = r.unwrap();
    assert_eq!(r["summary"]["ep_within_bound"], true, "seed {s}");
    for l in r["per_layer"].as_array().unwrap() {
        assert_eq!(l["ep_agreement"]["within_bound"], true, "seed {s}: {l}");
    }
}

#[test]
fn bad_ep_combinations_are_usage_errors() {
    let dir = tempfile::tempdir().unwrap();
    for (args, says) in [
        (vec!["layertest", "--fault", "local-ids"], "--ep 2 or more"),
        (
            vec!["layertest", "--ep", "2", "--ep-reduce", "nccl"],
            "two or more GPUs",
        ),
        (
            vec!["layertest", "--ep", "2", "--ep-gpus", "2"],
            "--device cuda",
        ),
        (vec!["layertest", "--ep", "17"], "17 EP ranks"),
        (vec!["layertest", "--ep", "0"], "at least 1"),
        (vec!["gs-sweep", "--ep", "0"], "at least 1"),
        (
            vec!["multilayer", "--ep", "2", "--ep-reduce", "nccl"],
            "two or more GPUs",
        ),
    ] {
        let mut a = args.clone();
        a.extend(["--device", "cpu", "--tokens", "4"]);
        let (code, text, _) = run(dir.path(), &a);
        assert_eq!(code, 2, "{a:?}:\n{text}");
        assert!(text.contains(says), "{a:?}: {text}");
    }
}
