//! Routing dumps: a safetensors file an engine wrote at its router, holding `topk_ids [T, K]`
//! (I32/I64), `topk_weights [T, K]` (F32/BF16/F16) and optionally `router_logits [T, E]`,
//! `hidden_states [T, H]`, `input_ids [T]`. Leading dims are flattened into tokens
//! (`[B, S, K]` reads as `[B*S, K]`).

use crate::checkpoint::TensorFile;
use crate::error::{Error, Result};
use safetensors::Dtype;
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

fn matrix(f: &TensorFile, name: &str, tokens: usize) -> Result<Option<Matrix<f32>>> {
    let path = f.path();
    let Some(t) = f.get(name) else {
        return Ok(None);
    };
    let (rows, cols) = rows_cols(path, name, &t.shape)?;
    if rows != tokens {
        return Err(Error::bad_tensor(
            path,
            name,
            format!(
                "shape {:?} holds {rows} tokens, topk_ids holds {tokens}",
                t.shape
            ),
        ));
    }
    Ok(Some(Matrix {
        rows,
        cols,
        data: f.to_f32(name)?,
    }))
}

impl RoutingDump {
    pub fn load(path: &Path) -> Result<RoutingDump> {
        // the bounded reader: a header of a million tensors costs their entries, not a JSON
        // tree of them, and offsets are validated before any tensor is touched
        let f = TensorFile::open(path)?;
        let ids_t = f.get("topk_ids").ok_or_else(|| {
            Error::bad_file(
                path,
                format!(
                    "no tensor `topk_ids` (found: {}); a routing dump holds topk_ids [T, K] and topk_weights [T, K]",
                    names(&f)
                ),
            )
        })?;
        let (tokens, top_k) = rows_cols(path, "topk_ids", &ids_t.shape)?;
        // an empty dump would pass every check without one being made
        if tokens == 0 || top_k == 0 {
            return Err(Error::bad_tensor(
                path,
                "topk_ids",
                format!(
                    "shape {:?} holds no routing decision ({tokens} tokens × {top_k} experts): \
                     nothing to check",
                    ids_t.shape
                ),
            ));
        }
        let topk_ids = f.to_i64("topk_ids")?;
        let w_t = f.get("topk_weights").ok_or_else(|| {
            Error::bad_file(
                path,
                format!("no tensor `topk_weights` (found: {})", names(&f)),
            )
        })?;
        if w_t.numel() != tokens * top_k || w_t.shape.last() != Some(&top_k) {
            return Err(Error::bad_tensor(
                path,
                "topk_weights",
                format!(
                    "shape {:?} does not match topk_ids {:?}",
                    w_t.shape, ids_t.shape
                ),
            ));
        }
        let weights_dtype = w_t.dtype;
        let topk_weights = f.to_f32("topk_weights")?;
        let router_logits = matrix(&f, "router_logits", tokens)?;
        let hidden_states = matrix(&f, "hidden_states", tokens)?;
        let input_ids = match f.get("input_ids") {
            Some(_) => {
                let v = f.to_i64("input_ids")?;
                if v.len() != tokens {
                    return Err(Error::bad_tensor(
                        path,
                        "input_ids",
                        format!("{} ids for {tokens} tokens", v.len()),
                    ));
                }
                Some(v)
            }
            None => None,
        };
        let metadata = f.metadata().clone();
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
    let f = TensorFile::open(path)?;
    let name = if f.contains("hidden_states") {
        "hidden_states".to_string()
    } else {
        match f.len() {
            1 => f.names().next().unwrap_or_default().to_string(),
            _ => {
                return Err(Error::bad_file(
                    path,
                    format!(
                        "no tensor `hidden_states` and not exactly one tensor (found: {})",
                        names(&f)
                    ),
                ))
            }
        }
    };
    matrix(&f, &name, tokens)?.ok_or_else(|| Error::bad_tensor(path, &name, "cannot be read"))
}

/// Names shown in a message: a few, sorted, and how many more (a header may list millions).
const NAMES_SHOWN: usize = 12;

fn names(f: &TensorFile) -> String {
    if f.is_empty() {
        return "none".into();
    }
    let mut n: Vec<&str> = f.names().collect();
    n.sort_unstable();
    let more = n.len().saturating_sub(NAMES_SHOWN);
    n.truncate(NAMES_SHOWN);
    let mut s = n.join(", ");
    if more > 0 {
        s.push_str(&format!(", … {more} more"));
    }
    s
}
