//! Any bytes as a `compare-weights --map RULES.toml` file through `Renames::load`, then the
//! loaded rules applied to tensor names of both conventions, on both sides.
#![no_main]
use libfuzzer_sys::fuzz_target;
use nvfp4dbg::weights::rules::{Renames, Side};
use std::sync::OnceLock;

static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();

const NAMES: [&str; 6] = [
    "model.layers.3.mlp.experts.7.gate_proj.weight",
    "layers.3.ffn.experts.7.w1.weight_scale",
    "language_model.model.layers.0.mlp.gate.e_score_correction_bias",
    "model.layers.61.mlp.experts.w13_weight_scale_2",
    "",
    "ü.ß.\u{1F600}.$1.${0}",
];

fuzz_target!(|data: &[u8]| {
    let dir = DIR.get_or_init(|| tempfile::tempdir().expect("temp dir"));
    let path = dir.path().join("rules.toml");
    std::fs::write(&path, data).expect("write temp file");
    // `--strip-prefix` values come from the command line; one fixed one exercises the merge
    let strip = ["model.".to_string()];
    if let Ok(r) = Renames::load(&strip, Some(&path)) {
        for n in NAMES {
            let _ = r.apply(n, Side::A);
            let _ = r.apply(n, Side::B);
        }
    }
});
