//! Any bytes as a `.safetensors` file through our loader: open, then every tensor as f32
//! (and as i64 where the dtype is an integer one). Errors are fine; panics and OOM are not.
#![no_main]
use libfuzzer_sys::fuzz_target;
use nvfp4dbg::checkpoint::TensorFile;
use std::sync::OnceLock;

static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();

fuzz_target!(|data: &[u8]| {
    let dir = DIR.get_or_init(|| tempfile::tempdir().expect("temp dir"));
    let path = dir.path().join("x.safetensors");
    std::fs::write(&path, data).expect("write temp file");
    if let Ok(f) = TensorFile::open(&path) {
        let names: Vec<String> = f.names().map(str::to_string).collect();
        for n in &names {
            let _ = f.to_f32(n);
            let _ = f.to_i64(n);
            let _ = f.scalar_f32(n);
        }
    }
});
