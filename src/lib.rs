//! nvfp4dbg: numerical debugging and bisection of NVFP4 Mixture-of-Experts kernels.

pub mod backend;
pub mod bench;
pub mod checkpoint;
pub mod cli;
pub mod error;
pub mod metrics;
pub mod moe;
pub mod nvfp4;
pub mod report;
pub mod trace;
pub mod weights;

pub use error::{Error, Result};
