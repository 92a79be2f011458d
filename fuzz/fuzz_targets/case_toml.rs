//! Any bytes as a `cases/*.toml` case file through `load_case`.
#![no_main]
use libfuzzer_sys::fuzz_target;
use nvfp4dbg::cli::run_case::load_case;
use std::sync::OnceLock;

static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();

fuzz_target!(|data: &[u8]| {
    let dir = DIR.get_or_init(|| tempfile::tempdir().expect("temp dir"));
    let path = dir.path().join("case.toml");
    std::fs::write(&path, data).expect("write temp file");
    let _ = load_case(&path);
});
