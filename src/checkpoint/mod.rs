//! Checkpoints (DESIGN.md §3): memory-mapped safetensors, HF directories, config.json,
//! ModelOpt / compressed-tensors NVFP4, and the names experts go by.

pub mod writer;

use crate::error::{Error, Result};
use crate::moe::MoeLayer;
use std::path::Path;

/// Load MoE layer `layer` (config, router, experts, shared experts, norm) from a checkpoint
/// directory. Placeholder until the reader lands.
pub fn load_moe_layer(path: &Path, layer: usize) -> Result<MoeLayer> {
    let _ = layer;
    Err(Error::bad_file(path, "checkpoint loading is not built yet"))
}
