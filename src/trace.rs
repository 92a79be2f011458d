//! Traces (DESIGN.md §5): directories of `NNNNNN-<module.path>.safetensors`, one per module call.
