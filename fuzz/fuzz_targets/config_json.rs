//! Any bytes as `config.json` / `hf_quant_config.json`.
#![no_main]
use libfuzzer_sys::fuzz_target;
use nvfp4dbg::checkpoint::config::{parse_config, parse_hf_quant_config};
use std::path::Path;

fuzz_target!(|data: &[u8]| {
    let p = Path::new("config.json");
    let _ = parse_config(p, data, None);
    let hint = data.first().map(|b| *b as usize % 8);
    let _ = parse_config(p, data, hint);
    let _ = parse_hf_quant_config(Path::new("hf_quant_config.json"), data);
});
