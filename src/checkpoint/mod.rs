//! Checkpoints (DESIGN.md §3): memory-mapped safetensors, HF directories, config.json,
//! ModelOpt / compressed-tensors NVFP4, and the names experts go by.

pub mod audit;
pub mod config;
pub mod file;
pub mod formats;
pub mod hf;
pub mod model;
pub mod names;
pub mod originals;
pub mod quantize;
pub mod source;
pub mod writer;

pub use config::{ModelConfig, QuantConfig, QuantMethod};
pub use file::{TensorFile, TensorInfo};
pub use formats::{Convention, LinearNames};
pub use hf::Checkpoint;
pub use model::{list_moe_layers, load_moe_layer, MoeCheckpoint};
pub use names::{Key, Naming, Proj, Scheme};
pub use safetensors::Dtype;
pub use source::TensorSource;
