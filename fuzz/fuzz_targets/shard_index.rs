//! A fuzzed `model.safetensors.index.json` next to two valid shards: `Checkpoint::open`, then
//! every tensor it lists read back as f32.
#![no_main]
use libfuzzer_sys::fuzz_target;
use nvfp4dbg::checkpoint::writer::{f32_bytes, write_file, TensorSpec};
use nvfp4dbg::checkpoint::{Checkpoint, Dtype};
use std::sync::OnceLock;

static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();

fn setup() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("temp dir");
    let a = f32_bytes(&[1.0, -2.0, 3.5, 0.25]);
    let b = f32_bytes(&[7.0, 8.0]);
    for (shard, names) in [
        ("model-00001-of-00002.safetensors", ["a.weight", "b.weight"]),
        ("model-00002-of-00002.safetensors", ["c.weight", "b.weight"]),
    ] {
        let specs = vec![
            (TensorSpec::new(names[0], Dtype::F32, &[2, 2]), a.clone()),
            (TensorSpec::new(names[1], Dtype::F32, &[2]), b.clone()),
        ];
        write_file(&dir.path().join(shard), specs, None).expect("write shard");
    }
    dir
}

fuzz_target!(|data: &[u8]| {
    let dir = DIR.get_or_init(setup);
    std::fs::write(dir.path().join("model.safetensors.index.json"), data).expect("write index");
    if let Ok(c) = Checkpoint::open(dir.path()) {
        let names: Vec<String> = c.names().map(str::to_string).collect();
        for n in &names {
            let _ = c.to_f32(n);
        }
        let _ = c.config();
    }
});
