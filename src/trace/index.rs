//! Listing a trace directory: names → (counter, module), `__metadata__` → (rank, step), the
//! selection asked for, in execution order. Only names and headers are held (a few hundred
//! bytes per file), so a trace of 100k calls indexes in bounded memory; tensors are read later,
//! one file at a time.

use super::file::TraceFile;
use crate::error::{Error, Result};
use rayon::prelude::*;
use serde::Serialize;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// One recorded module call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceEntry {
    /// The execution counter from the file name.
    pub counter: u64,
    /// The PyTorch module path from the file name.
    pub module: String,
    /// The file, as found under the trace directory the user named.
    pub path: PathBuf,
    /// `__metadata__` `rank`, else the N of the `rank<N>/` folder it lies in; absent means a
    /// single-process trace, counted as rank 0.
    pub rank: Option<u64>,
    pub step: Option<u64>,
}

/// A directory entry that is not used, and why.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Skipped {
    pub file: PathBuf,
    pub reason: String,
    /// A recorded call (or a `*.safetensors` file that looks like one) whose values were not
    /// looked at: a verdict over the trace cannot pass while one exists. False for entries
    /// that are not part of the trace (notes, a recorder's hidden temporary files).
    pub unscanned_call: bool,
}

impl Skipped {
    /// A recorded call that was not scanned.
    pub fn call(file: PathBuf, reason: impl Into<String>) -> Skipped {
        Skipped {
            file,
            reason: reason.into(),
            unscanned_call: true,
        }
    }
    /// An entry that is not part of the trace.
    pub fn other(file: PathBuf, reason: impl Into<String>) -> Skipped {
        Skipped {
            file,
            reason: reason.into(),
            unscanned_call: false,
        }
    }
}

/// Whether a name that failed [`parse_file_name`] still looks like trace data: a visible
/// `*.safetensors` file that starts with a counter (a short one, an overflowing one) holds
/// values nobody looked at. A name without a counter (`weights.safetensors`) is another file
/// someone put there: ignored.
fn looks_like_trace_data(name: &str) -> bool {
    name.as_bytes().first().is_some_and(u8::is_ascii_digit) && name.ends_with(".safetensors")
}

/// Which calls to look at: `rank` defaults to 0, `step` to all steps in order.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Selection {
    pub rank: Option<u64>,
    pub step: Option<u64>,
}

impl Selection {
    pub fn describe(&self) -> String {
        let step = match self.step {
            Some(s) => format!("step {s}"),
            None => "all steps".to_string(),
        };
        format!("rank {}, {step}", self.rank.unwrap_or(0))
    }
}

/// A trace directory, indexed: the selected calls in execution order.
#[derive(Clone, Debug)]
pub struct TraceIndex {
    pub dir: PathBuf,
    pub selection: Selection,
    /// Selected calls ordered by (step, counter); counters are never compared with mtimes.
    pub entries: Vec<TraceEntry>,
    /// Entries not used: names that do not match, duplicate counters.
    pub skipped: Vec<Skipped>,
    /// Trace files found, all ranks and steps.
    pub files_total: usize,
    pub ranks: Vec<u64>,
    /// Steps present in the selected rank.
    pub steps: Vec<u64>,
    /// Trace files whose header cannot be read (truncated when the run died): kept among the
    /// entries, in order, under their folder's rank/step; what reads them meets the error.
    pub damaged: Vec<PathBuf>,
}

/// Ranks as a message lists them: `0, 1, 3`.
pub fn rank_list(ranks: &[u64]) -> String {
    ranks
        .iter()
        .map(|r| r.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// The shape of a trace file name, for messages.
pub const NAME_PATTERN: &str = "NNNNNN-<module.path>.safetensors";

/// `NNNNNN-<module.path>.safetensors` → (counter, module path). The counter has at least six
/// digits (a recorder that passes 999999 calls writes seven); the error says why not.
pub fn parse_file_name(name: &str) -> std::result::Result<(u64, String), String> {
    if name.starts_with('.') {
        return Err("hidden file (a recorder's temporary file?)".into());
    }
    let Some(stem) = name.strip_suffix(".safetensors") else {
        return Err(format!("not a trace file: expected {NAME_PATTERN}"));
    };
    let digits = stem.bytes().take_while(|b| b.is_ascii_digit()).count();
    if digits < 6 || stem.as_bytes().get(digits) != Some(&b'-') {
        return Err(format!(
            "name does not start with a six-digit counter and '-': expected {NAME_PATTERN}"
        ));
    }
    let counter = stem[..digits]
        .parse::<u64>()
        .map_err(|_| format!("counter `{}` does not fit in 64 bits", &stem[..digits]))?;
    let module = &stem[digits + 1..];
    if module.is_empty() {
        return Err(format!("empty module path: expected {NAME_PATTERN}"));
    }
    Ok((counter, module.to_string()))
}

/// `rank<N>` → (Some(N), None), `step<N>` → (None, Some(N)); any other name → `None`.
fn folder_rank_step(name: &str) -> Option<(Option<u64>, Option<u64>)> {
    let num = |p: &str| {
        name.strip_prefix(p)
            .filter(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|n| n.parse::<u64>().ok())
    };
    num("rank")
        .map(|r| (Some(r), None))
        .or_else(|| num("step").map(|s| (None, Some(s))))
}

fn parse_meta(path: &Path, f: &TraceFile, key: &str) -> Result<Option<u64>> {
    match f.metadata().get(key) {
        None => Ok(None),
        Some(v) => v.trim().parse::<u64>().map(Some).map_err(|_| {
            Error::bad_file(
                path,
                format!("__metadata__ `{key}` = {v:?} is not a non-negative integer"),
            )
        }),
    }
}

fn join_u64(v: &[u64]) -> String {
    v.iter()
        .map(|x| x.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

impl TraceIndex {
    /// Index `dir`: its `*.safetensors` trace files and those one directory level down in
    /// `rank<N>/` or `step<N>/` folders (one directory per rank or step is how multi-process
    /// recorders keep names from colliding); a file without `rank`/`step` metadata takes its
    /// folder's N. Other folders are listed as ignored, not read.
    /// Every trace file's header is read here; one that cannot be ([`TraceIndex::damaged`])
    /// stays an entry, for [`TraceIndex::require_readable`] or the scan to report. No trace
    /// file at all, or none in the selection, is bad input.
    pub fn open(dir: &Path, selection: Selection) -> Result<TraceIndex> {
        Listing::read(dir)?.select(selection)
    }

    /// The error of the first damaged trace file, if any: for a command that compares whole
    /// traces, where a damaged file is bad input wherever it lies.
    pub fn require_readable(&self) -> Result<()> {
        match self.damaged.first() {
            Some(p) => TraceFile::open(p).map(|_| ()),
            None => Ok(()),
        }
    }

    /// One index per rank the trace holds (ascending), each of `step` when given: what a
    /// verdict over the whole trace must look at. Ranks without that step are left out; none
    /// with it is a usage error.
    pub fn open_each_rank(dir: &Path, step: Option<u64>) -> Result<Vec<TraceIndex>> {
        let listing = Listing::read(dir)?;
        let mut out = Vec::new();
        for &r in &listing.ranks {
            let has =
                |e: &TraceEntry| e.rank.unwrap_or(0) == r && step.is_none_or(|s| e.step == Some(s));
            if step.is_some() && !listing.all.iter().any(has) {
                continue;
            }
            out.push(listing.clone().select(Selection {
                rank: Some(r),
                step,
            })?);
        }
        if out.is_empty() {
            let steps: BTreeSet<u64> = listing.all.iter().filter_map(|e| e.step).collect();
            let steps: Vec<u64> = steps.into_iter().collect();
            return Err(Error::usage(format!(
                "{}: no trace files of step {} in any rank (ranks {}; steps present: {})",
                dir.display(),
                step.unwrap_or(0),
                join_u64(&listing.ranks),
                if steps.is_empty() {
                    "none recorded".to_string()
                } else {
                    join_u64(&steps)
                }
            )));
        }
        Ok(out)
    }
}

/// `__metadata__` `rank` and `step` of one file.
type RankStep = (Option<u64>, Option<u64>);

/// Every trace file of a directory with its validated header, before any selection.
#[derive(Clone, Debug)]
struct Listing {
    dir: PathBuf,
    all: Vec<TraceEntry>,
    skipped: Vec<Skipped>,
    files_total: usize,
    ranks: Vec<u64>,
    damaged: Vec<PathBuf>,
}

impl Listing {
    fn read(dir: &Path) -> Result<Listing> {
        let meta = std::fs::metadata(dir).map_err(|e| Error::io(dir, e))?;
        if !meta.is_dir() {
            return Err(Error::bad_file(
                dir,
                format!("not a directory: a trace is a directory of {NAME_PATTERN} files"),
            ));
        }
        let mut skipped = Vec::new();
        // (counter, module, path, (rank, step) of its folder's name)
        let mut named = Vec::new();
        type Sub = (PathBuf, (Option<u64>, Option<u64>));
        let mut visit = |d: &Path,
                         depth: usize,
                         of: (Option<u64>, Option<u64>),
                         subdirs: &mut Vec<Sub>|
         -> Result<()> {
            let rd = std::fs::read_dir(d).map_err(|e| Error::io(d, e))?;
            let mut items = Vec::new();
            for ent in rd {
                let ent = ent.map_err(|e| Error::io(d, e))?;
                items.push(ent.path());
            }
            items.sort();
            for p in items {
                let name = p.file_name().and_then(|n| n.to_str()).map(str::to_string);
                if p.is_dir() {
                    if depth == 0 {
                        match name.as_deref().and_then(folder_rank_step) {
                            Some(rs) => subdirs.push((p, rs)),
                            None => skipped.push(Skipped::other(
                                p,
                                "subdirectory not named rank<N> or step<N>: not part of the trace, \
                                 ignored",
                            )),
                        }
                    } else {
                        skipped.push(Skipped::other(
                            p,
                            "directory nested two levels deep (one level, e.g. rank0/, is read)",
                        ));
                    }
                    continue;
                }
                match name.as_deref().map(|n| (n, parse_file_name(n))) {
                    Some((_, Ok((counter, module)))) => named.push((counter, module, p, of)),
                    Some((n, Err(reason))) if looks_like_trace_data(n) => {
                        skipped.push(Skipped::call(p, reason))
                    }
                    Some((_, Err(reason))) => skipped.push(Skipped::other(p, reason)),
                    None => {
                        let lossy = p.to_string_lossy();
                        let reason = "file name is not UTF-8";
                        skipped.push(if lossy.ends_with(".safetensors") {
                            Skipped::call(p, reason)
                        } else {
                            Skipped::other(p, reason)
                        })
                    }
                }
            }
            Ok(())
        };
        let mut subdirs = Vec::new();
        visit(dir, 0, (None, None), &mut subdirs)?;
        for (s, of) in subdirs {
            visit(&s, 1, of, &mut Vec::new())?;
        }
        if named.is_empty() {
            let mut what = format!("no trace files ({NAME_PATTERN}) in this directory");
            if !skipped.is_empty() {
                what.push_str(&format!(
                    "; {} other entries, e.g. {}: {}",
                    skipped.len(),
                    skipped[0].file.display(),
                    skipped[0].reason
                ));
            }
            return Err(Error::bad_file(dir, what));
        }

        // Headers: validated in parallel; the first bad file in name order is the one reported.
        let headers: Vec<Result<Option<RankStep>>> = named
            .par_iter()
            .map(|(_, _, p, _)| {
                // an unreadable header is a damaged file (kept); bad metadata is bad input
                let Ok(f) = TraceFile::open(p) else {
                    return Ok(None);
                };
                Ok(Some((
                    parse_meta(p, &f, "rank")?,
                    parse_meta(p, &f, "step")?,
                )))
            })
            .collect();
        let files_total = named.len();
        let mut all = Vec::with_capacity(named.len());
        let mut damaged = Vec::new();
        for ((counter, module, path, (dir_rank, dir_step)), h) in named.into_iter().zip(headers) {
            // `__metadata__` first; a file without it takes its rank<N>/ or step<N>/ folder's
            let (rank, step) = h?.unwrap_or_else(|| {
                damaged.push(path.clone());
                (None, None)
            });
            let (rank, step) = (rank.or(dir_rank), step.or(dir_step));
            all.push(TraceEntry {
                counter,
                module,
                path,
                rank,
                step,
            });
        }

        let ranks: Vec<u64> = all
            .iter()
            .map(|e| e.rank.unwrap_or(0))
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        Ok(Listing {
            dir: dir.to_path_buf(),
            all,
            skipped,
            files_total,
            ranks,
            damaged,
        })
    }

    fn select(self, selection: Selection) -> Result<TraceIndex> {
        let Listing {
            dir,
            mut all,
            mut skipped,
            files_total,
            ranks,
            damaged,
        } = self;
        let dir = dir.as_path();
        let rank = selection.rank.unwrap_or(0);
        all.retain(|e| e.rank.unwrap_or(0) == rank);
        if all.is_empty() {
            return Err(Error::usage(format!(
                "{}: no trace files of rank {rank} (ranks present: {}); choose one with --rank",
                dir.display(),
                join_u64(&ranks)
            )));
        }
        let steps: Vec<u64> = all
            .iter()
            .filter_map(|e| e.step)
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        if let Some(s) = selection.step {
            // a call that records no step beside calls that do may belong to step s: not
            // scanned, and said so (it was dropped without a word, and could hold the NaN)
            let (unstepped, rest): (Vec<_>, Vec<_>) = all
                .into_iter()
                .partition(|e| e.step.is_none() && !steps.is_empty());
            skipped.extend(unstepped.into_iter().map(|e| {
                Skipped::call(
                    e.path,
                    format!("records no step while other calls do: it may belong to step {s}"),
                )
            }));
            all = rest;
            all.retain(|e| e.step == Some(s));
            if all.is_empty() {
                return Err(Error::usage(format!(
                    "{}: no trace files of step {s} for rank {rank} (steps present: {})",
                    dir.display(),
                    if steps.is_empty() {
                        "none recorded".to_string()
                    } else {
                        join_u64(&steps)
                    }
                )));
            }
        }
        // Counters restart per step only when steps were recorded separately; (step, counter)
        // is execution order either way. The path breaks ties only to make the order total.
        all.sort_by(|a, b| (a.step, a.counter, &a.path).cmp(&(b.step, b.counter, &b.path)));
        let mut entries: Vec<TraceEntry> = Vec::with_capacity(all.len());
        for e in all {
            if let Some(prev) = entries.last() {
                if prev.step == e.step && prev.counter == e.counter {
                    let reason = format!(
                        "duplicate counter {:06}{}: execution order is ambiguous; kept {}",
                        e.counter,
                        e.step.map(|s| format!(" in step {s}")).unwrap_or_default(),
                        prev.path.display()
                    );
                    skipped.push(Skipped::call(e.path, reason));
                    continue;
                }
            }
            entries.push(e);
        }
        Ok(TraceIndex {
            dir: dir.to_path_buf(),
            selection,
            entries,
            skipped,
            files_total,
            ranks,
            steps,
            damaged,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert_eq!(
            parse_file_name("000042-model.layers.3.mlp.safetensors"),
            Ok((42, "model.layers.3.mlp".into()))
        );
        assert_eq!(
            parse_file_name("1000000-lm_head.safetensors"),
            Ok((1_000_000, "lm_head".into()))
        );
        for bad in [
            "00042-x.safetensors",
            "000042x.safetensors",
            "000042-.safetensors",
            "000042-x.safetensors.tmp",
            ".000042-x.safetensors",
            "x-000042.safetensors",
            "README.md",
            "99999999999999999999999-x.safetensors",
        ] {
            assert!(parse_file_name(bad).is_err(), "{bad}");
        }
    }
}
