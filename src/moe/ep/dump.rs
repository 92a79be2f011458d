//! Routing dumps: a safetensors file an engine wrote at its router, holding `topk_ids [T, K]`
//! (I32/I64), `topk_weights [T, K]` (F32/BF16/F16) and optionally `router_logits [T, E]`,
//! `hidden_states [T, H]`, `input_ids [T]`. Leading dims are flattened into tokens
//! (`[B, S, K]` reads as `[B*S, K]`).

use crate::error::{Error, Result};
use safetensors::{Dtype, SafeTensors};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// `[rows, cols]` row-major values.
#[derive(Clone, Debug, PartialEq)]
pub struct Matrix<T> {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<T>,
}

#[derive(Clone, Debug)]
pub struct RoutingDump {
    pub path: PathBuf,
    pub tokens: usize,
    pub top_k: usize,
    /// `[T*K]`, as stored (global ids unless the engine got it wrong).
    pub topk_ids: Vec<i64>,
    /// `[T*K]` as f32.
    pub topk_weights: Vec<f32>,
    /// Dtype of `topk_weights` as stored: the tolerance of sum checks depends on it.
    pub weights_dtype: Dtype,
    /// `[T, E]`
    pub router_logits: Option<Matrix<f32>>,
    /// `[T, H]`
    pub hidden_states: Option<Matrix<f32>>,
    /// `[T]`
    pub input_ids: Option<Vec<i64>>,
    /// The file's `__metadata__` (e.g. `layer`, `ep_rank`, `ep_size`).
    pub metadata: BTreeMap<String, String>,
}

/// Map a dump file read-only. Routing dumps are small, but hidden states of a long prompt
/// are not, so the file is mapped rather than read.
fn map(path: &Path) -> Result<memmap2::Mmap> {
    let f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    // SAFETY: the file is opened read-only and we never write through the map; a concurrent
    // truncation by another process is outside what the tool can defend against.
    unsafe { memmap2::Mmap::map(&f) }.map_err(|e| Error::io(path, e))
}

fn rows_cols(path: &Path, name: &str, shape: &[usize]) -> Result<(usize, usize)> {
    match shape.split_last() {
        Some((&cols, lead)) if !lead.is_empty() => Ok((lead.iter().product(), cols)),
        _ => Err(Error::bad_tensor(
            path,
            name,
            format!("shape {shape:?}: expected [tokens, n] (at least 2 dims)"),
        )),
    }
}

/// Values of an integer tensor as i64.
pub fn ints(path: &Path, name: &str, t: &safetensors::tensor::TensorView) -> Result<Vec<i64>> {
    let b = t.data();
    Ok(match t.dtype() {
        Dtype::I64 => b
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
            .collect(),
        Dtype::I32 => b
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64)
            .collect(),
        Dtype::I16 => b
            .chunks_exact(2)
            .map(|c| i16::from_le_bytes([c[0], c[1]]) as i64)
            .collect(),
        Dtype::U8 => b.iter().map(|&v| v as i64).collect(),
        d => {
            return Err(Error::bad_tensor(
                path,
                name,
                format!("dtype {d:?}: expected an integer tensor (I32 or I64)"),
            ))
        }
    })
}

/// Values of a float tensor as f32.
pub fn floats(path: &Path, name: &str, t: &safetensors::tensor::TensorView) -> Result<Vec<f32>> {
    decode_floats(t.dtype(), t.data()).ok_or_else(|| {
        Error::bad_tensor(
            path,
            name,
            format!(
                "dtype {:?}: expected a float tensor (F32, BF16 or F16)",
                t.dtype()
            ),
        )
    })
}

/// Little-endian F32, F64, BF16 or F16 bytes as f32; None for any other dtype.
pub fn decode_floats(d: Dtype, b: &[u8]) -> Option<Vec<f32>> {
    Some(match d {
        Dtype::F32 => b
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        Dtype::F64 => b
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]) as f32)
            .collect(),
        Dtype::BF16 => b
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        Dtype::F16 => b
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        _ => return None,
    })
}

fn matrix(path: &Path, st: &SafeTensors, name: &str, tokens: usize) -> Result<Option<Matrix<f32>>> {
    let t = match st.tensor(name) {
        Ok(t) => t,
        Err(_) => return Ok(None),
    };
    let (rows, cols) = rows_cols(path, name, t.shape())?;
    if rows != tokens {
        return Err(Error::bad_tensor(
            path,
            name,
            format!(
                "shape {:?} holds {rows} tokens, topk_ids holds {tokens}",
                t.shape()
            ),
        ));
    }
    Ok(Some(Matrix {
        rows,
        cols,
        data: floats(path, name, &t)?,
    }))
}

impl RoutingDump {
    pub fn load(path: &Path) -> Result<RoutingDump> {
        let mm = map(path)?;
        let st = SafeTensors::deserialize(&mm)
            .map_err(|e| Error::bad_file(path, format!("not a safetensors file: {e}")))?;
        let ids_t = st.tensor("topk_ids").map_err(|_| {
            Error::bad_file(
                path,
                format!(
                    "no tensor `topk_ids` (found: {}); a routing dump holds topk_ids [T, K] and topk_weights [T, K]",
                    names(&st)
                ),
            )
        })?;
        let (tokens, top_k) = rows_cols(path, "topk_ids", ids_t.shape())?;
        let topk_ids = ints(path, "topk_ids", &ids_t)?;
        let w_t = st.tensor("topk_weights").map_err(|_| {
            Error::bad_file(
                path,
                format!("no tensor `topk_weights` (found: {})", names(&st)),
            )
        })?;
        if w_t.shape().iter().product::<usize>() != tokens * top_k
            || w_t.shape().last() != Some(&top_k)
        {
            return Err(Error::bad_tensor(
                path,
                "topk_weights",
                format!(
                    "shape {:?} does not match topk_ids {:?}",
                    w_t.shape(),
                    ids_t.shape()
                ),
            ));
        }
        let weights_dtype = w_t.dtype();
        let topk_weights = floats(path, "topk_weights", &w_t)?;
        let router_logits = matrix(path, &st, "router_logits", tokens)?;
        let hidden_states = matrix(path, &st, "hidden_states", tokens)?;
        let input_ids = match st.tensor("input_ids") {
            Ok(t) => {
                let v = ints(path, "input_ids", &t)?;
                if v.len() != tokens {
                    return Err(Error::bad_tensor(
                        path,
                        "input_ids",
                        format!("{} ids for {tokens} tokens", v.len()),
                    ));
                }
                Some(v)
            }
            Err(_) => None,
        };
        let metadata = SafeTensors::read_metadata(&mm)
            .ok()
            .and_then(|(_, m)| m.metadata().clone())
            .map(|m| m.into_iter().collect())
            .unwrap_or_default();
        Ok(RoutingDump {
            path: path.to_path_buf(),
            tokens,
            top_k,
            topk_ids,
            topk_weights,
            weights_dtype,
            router_logits,
            hidden_states,
            input_ids,
            metadata,
        })
    }
}

/// Hidden states from a separate file (`--hidden`): the tensor `hidden_states`, or the only
/// tensor of the file.
pub fn load_hidden(path: &Path, tokens: usize) -> Result<Matrix<f32>> {
    let mm = map(path)?;
    let st = SafeTensors::deserialize(&mm)
        .map_err(|e| Error::bad_file(path, format!("not a safetensors file: {e}")))?;
    let name = if st.tensor("hidden_states").is_ok() {
        "hidden_states".to_string()
    } else {
        let all = st.names();
        match all.as_slice() {
            [one] => one.to_string(),
            _ => {
                return Err(Error::bad_file(
                    path,
                    format!(
                        "no tensor `hidden_states` and not exactly one tensor (found: {})",
                        names(&st)
                    ),
                ))
            }
        }
    };
    matrix(path, &st, &name, tokens)?
        .ok_or_else(|| Error::bad_tensor(path, &name, "cannot be read"))
}

fn names(st: &SafeTensors) -> String {
    let mut n: Vec<&str> = st.names();
    n.sort_unstable();
    if n.is_empty() {
        "none".into()
    } else {
        n.join(", ")
    }
}
