//! A trace file: the first line of the input is the file name (through `parse_file_name`), the
//! rest its bytes (through `TraceFile::open` and an f32 read of every tensor).
#![no_main]
use libfuzzer_sys::fuzz_target;
use nvfp4dbg::trace::{parse_file_name, TraceFile};
use std::sync::OnceLock;

static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();

fuzz_target!(|data: &[u8]| {
    let dir = DIR.get_or_init(|| tempfile::tempdir().expect("temp dir"));
    let (name, body) = match data.iter().position(|&b| b == b'\n') {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (&b""[..], data),
    };
    if let Ok(name) = std::str::from_utf8(name) {
        let _ = parse_file_name(name);
    }
    let path = dir.path().join("000001-model.layers.0.mlp.safetensors");
    std::fs::write(&path, body).expect("write temp file");
    if let Ok(f) = TraceFile::open(&path) {
        let mut out = Vec::new();
        for t in f.tensors() {
            let n = t.numel();
            t.read_f32(0, n, &mut out);
            t.read_f32(n / 2, n, &mut out);
            t.read_f32(n, 1, &mut out);
        }
    }
});
