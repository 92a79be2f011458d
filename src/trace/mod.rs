//! Traces (DESIGN.md §5): directories of `NNNNNN-<module.path>.safetensors`, one file per
//! recorded module call, in execution order by the counter in the name (never by mtime). Each
//! file holds `output` (and `output.N` for tuple outputs, `input.N` for the call's inputs); the
//! first dim is tokens; `__metadata__` may carry `rank` and `step`.
//!
//! - [`index`]: list, validate and order a trace; select a rank and steps.
//! - [`file`]: one memory-mapped trace file and f32 views of its tensors.
//! - [`scan`]: streaming NaN/Inf search and comparison of tensors.
//! - [`locate`]: the first non-finite value (`nan-locate`).
//! - [`bisect`]: the first diverging call between two traces (`bisect`).
//! - [`tokens`]: bisect's per-token check, on row sums taken in the same read.
//! - [`synthetic`]: a tiny transformer that writes traces, with planted faults, for cases and tests.

pub mod bisect;
pub mod file;
pub mod index;
pub mod locate;
pub mod scan;
pub mod synthetic;
pub mod tokens;

pub use file::{role, Role, TensorRef, TraceFile};
pub use index::{
    parse_file_name, rank_list, Selection, Skipped, TraceEntry, TraceIndex, NAME_PATTERN,
};
