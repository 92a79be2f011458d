//! `compare-weights` logic: did the engine load what the checkpoint holds?

pub mod pattern;
pub mod rules;
