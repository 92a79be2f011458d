//! Checkpoints (DESIGN.md §3): memory-mapped safetensors, HF directories, config.json,
//! ModelOpt / compressed-tensors NVFP4, and the names experts go by.

pub mod writer;
