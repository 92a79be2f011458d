//! vLLM's merged linears: `gate_up_proj` = [gate_proj; up_proj] (dense MLPs and the shared
//! expert, `MergedColumnParallelLinear`) and `fused_qkv_a_proj` = [q_a_proj;
//! kv_a_proj_with_mqa] (MLA). A merged unit of B whose parts A holds as separate linears is
//! split into one unit per part, rows cut at A's part sizes (each part sharded on its own
//! under TP, as the merged layer's loader does), so that a clean dump compares clean and a
//! wrong part is named by its own name.

use super::inventory::{Inventory, Source, Unit};
use super::rules::Renamed;
use crate::checkpoint::TensorSource;

/// (merged module, its parts in row order).
const MERGED: [(&str, &[&str]); 3] = [
    ("gate_up_proj", &["gate_proj", "up_proj"]),
    ("fused_qkv_a_proj", &["q_a_proj", "kv_a_proj_with_mqa"]),
    // SGLang's name
    (
        "fused_qkv_a_proj_with_mqa",
        &["q_a_proj", "kv_a_proj_with_mqa"],
    ),
];

/// Rows `[row0, row0 + rows)` of a merged linear: part `part` of `parts`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MergedPart {
    pub inner: Box<Source>,
    pub part: usize,
    pub parts: usize,
    pub row0: usize,
    pub rows: usize,
}

/// Rows of a unit's weight (its first dim), where it is a matrix.
fn rows_of(src: &Renamed, s: &Source) -> Option<usize> {
    let name = match s {
        Source::Linear(ln) => ln.weight.as_str(),
        Source::Tensor(t) => t.as_str(),
        _ => return None,
    };
    let info = src.tensor_info(name).ok()?;
    (info.shape.len() == 2).then(|| info.shape[0])
}

/// Split B's merged units into their parts where A holds the parts; a note per kind split.
pub fn split(
    b_inv: &mut Inventory,
    a_inv: &Inventory,
    a: &Renamed,
    b: &Renamed,
    tp: Option<(usize, usize)>,
) -> Vec<String> {
    let n = tp.map_or(1, |t| t.1);
    let mut split: Vec<(String, &str, Vec<Unit>)> = vec![];
    for (key, u) in &b_inv.units {
        let Some((merged, base, parts)) = MERGED
            .iter()
            .find_map(|&(m, parts)| Some((m, key.strip_suffix(&format!("{m}.weight"))?, parts)))
        else {
            continue;
        };
        let keys: Vec<String> = parts.iter().map(|p| format!("{base}{p}.weight")).collect();
        if a_inv.units.contains_key(key) || keys.iter().any(|k| b_inv.units.contains_key(k)) {
            continue;
        }
        // A's part rows, each 1/n under TP; they must add up to B's
        let a_rows: Option<Vec<usize>> = keys
            .iter()
            .map(|k| rows_of(a, &a_inv.units.get(k)?.source))
            .collect();
        let (Some(a_rows), Some(b_rows)) = (a_rows, rows_of(b, &u.source)) else {
            continue;
        };
        if a_rows.iter().any(|r| r % n != 0) || a_rows.iter().sum::<usize>() != n * b_rows {
            continue;
        }
        let mut row0 = 0;
        let units = keys
            .iter()
            .zip(&a_rows)
            .enumerate()
            .map(|(part, (k, r))| {
                let rows = r / n;
                let unit = Unit {
                    key: k.clone(),
                    source: Source::Merged(MergedPart {
                        inner: Box::new(u.source.clone()),
                        part,
                        parts: keys.len(),
                        row0,
                        rows,
                    }),
                    expert: None,
                };
                row0 += rows;
                unit
            })
            .collect();
        split.push((key.clone(), merged, units));
    }
    let mut kinds: Vec<&str> = vec![];
    for (key, merged, units) in split {
        b_inv.units.remove(&key);
        for u in units {
            b_inv.units.insert(u.key.clone(), u);
        }
        if !kinds.contains(&merged) {
            kinds.push(merged);
        }
    }
    MERGED
        .iter()
        .filter(|(m, _)| kinds.contains(m))
        .map(|(m, parts)| {
            format!(
                "B's merged `{m}` compared as its parts {} (rows cut at A's sizes)",
                parts.join(" + ")
            )
        })
        .collect()
}
