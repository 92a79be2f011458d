//! `quantize`: float safetensors weights → ModelOpt NVFP4 (or MXFP4) tensors, streaming.
//!
//! Every floating (BF16/F16/F32) 2-D tensor named `*.weight` whose last dim is a multiple of
//! the block becomes
//! - NVFP4: `X.weight` U8 `[N, K/2]`, `X.weight_scale` F8_E4M3 `[N, K/16]` (linear layout),
//!   `X.weight_scale_2` F32 `[]`;
//! - MXFP4: `X.weight` U8 `[N, K/2]`, `X.weight_scale` F8_E8M0 `[N, K/32]` (the OCP UE8M0 code
//!   byte; F8_E8M0 rather than U8 so the file says what the bytes are), no global scale.
//!
//! Other tensors are copied byte for byte: already-quantized ones (ModelOpt, MXFP4), the
//! float weights an input's own quantization_config excludes (a quantized checkpoint's
//! attention, router, dense layers), and those of modules engines never quantize
//! (embeddings, output heads, the MoE router's gate, MTP's eh_proj:
//! `names::never_quantized`). The output's exclude_modules names every float weight matrix
//! left unquantized (exact module names) plus the input's own exclude list.
//!
//! compressed-tensors NVFP4 linears in the input are refused: the output's ModelOpt
//! quantization_config cannot vouch for their names. Every output file is written under its
//! temporary name and renamed only once all are complete: a refused run leaves OUT as it was.
//!
//! One tensor at a time: the input stays memory-mapped, only the outputs of the current
//! tensor are held (a quarter of a BF16 tensor's size), and the blocks of a tensor are
//! quantized on every core. The numerics are `nvfp4`'s own block
//! quantizers with the global scale of `nvfp4::weight_global_scale`, so the bytes are those of
//! `quantize_weight_nvfp4` (a test pins it).

use super::config::{ExcludeList, QuantConfig};
use super::file::{elem_size, TensorFile, TensorInfo};
use super::formats::{Convention, LinearNames};
use super::hf::{Checkpoint, CONFIG_FILE, HF_QUANT_CONFIG_FILE, INDEX_FILE, ORIGINALS_DIR};
use super::source::TensorSource;
use super::writer::{f32_bytes, PendingOutput, ShardWriter, TensorSpec};
use crate::error::{Error, Result};
use crate::nvfp4::quant::{quantize_block_mxfp4, quantize_row_nvfp4};
use crate::nvfp4::{
    e4m3, max_finite_out_scale_gs, out_scale_finite, weight_global_scale, BlockStats, Format,
    GS_DENOM,
};
use crate::report::PendingFile;
use rayon::prelude::*;
use safetensors::Dtype;
use serde::Serialize;
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

#[derive(Clone, Debug)]
pub struct QuantizeOptions {
    pub format: Format,
    /// Quant-direction global scale for every tensor (`weight_scale_2 = 1/gs`); None: each
    /// tensor's own `2688 / amax`.
    pub gs: Option<f32>,
    /// Tensors whose name contains one of these are copied, not quantized (the output's
    /// exclude_modules then names their modules exactly).
    pub exclude: Vec<String>,
    /// With `gs` None: the gate and up projections of one MLP (`gate_proj`/`up_proj`,
    /// `w1`/`w3`) share one global scale, from the larger of their amaxes (ModelOpt's export;
    /// vLLM's fused w13 keeps one). Else each tensor has its own (DESIGN.md §2).
    pub shared_gate_up: bool,
}

/// What happened to one quantized tensor.
#[derive(Clone, Debug, Serialize)]
pub struct QuantizedTensor {
    pub name: String,
    pub dtype: String,
    pub shape: [usize; 2],
    /// None for MXFP4.
    pub weight_scale_2: Option<f32>,
    pub amax: f32,
    #[serde(flatten)]
    pub stats: BlockStats,
}

/// A float `*.weight` that was copied although neither --exclude nor the input's config asked
/// for it: its shape does not quantize.
#[derive(Clone, Debug, Serialize)]
pub struct NotQuantized {
    pub name: String,
    pub shape: Vec<usize>,
    pub reason: String,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct QuantizeSummary {
    pub input: PathBuf,
    pub output: PathBuf,
    pub files_written: usize,
    pub quantized: usize,
    pub copied: usize,
    pub bytes_in: u64,
    pub bytes_out: u64,
    pub blocks: BlockStats,
    pub tensors: Vec<QuantizedTensor>,
    /// Float `*.weight` tensors copied for their shape, not by --exclude or the input's config.
    pub not_quantized: Vec<NotQuantized>,
    /// Float `*.weight` tensors copied because the input's quantization_config excludes them.
    pub excluded_by_input_config: Vec<String>,
    /// Float `*.weight` tensors copied because engines never quantize their modules
    /// (embeddings, output heads, MoE router gates, MTP's eh_proj).
    pub never_quantized: Vec<String>,
}

enum Item {
    Copy(String),
    Quantize {
        name: String,
        rows: usize,
        cols: usize,
    },
}

/// Bytes on their way to the writer thread: a tensor copied straight from the map, or a
/// quantized output.
enum Piece<'a> {
    Mapped(&'a TensorInfo),
    Owned(Vec<u8>),
}

struct FilePlan {
    shard: usize,
    output: PathBuf,
    items: Vec<Item>,
    specs: Vec<TensorSpec>,
    not_quantized: Vec<NotQuantized>,
    excluded_by_input_config: Vec<String>,
    never_quantized: Vec<String>,
    /// Modules of the float weight matrices this file leaves unquantized (any reason).
    unquantized_modules: Vec<String>,
}

/// A checked plan: every output name and shape is known before anything is written.
pub struct QuantizePlan {
    ckpt: Checkpoint,
    output: PathBuf,
    opts: QuantizeOptions,
    /// The input's own exclude list (exclude_modules / ignore), as written there.
    input_exclude: Vec<String>,
    files: Vec<FilePlan>,
    /// `shared_gate_up`: the amax each gate/up member's global scale comes from.
    scale_amax: BTreeMap<String, f32>,
}

fn same_file(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    }
}

fn is_float_weight_dtype(d: Dtype) -> bool {
    matches!(d, Dtype::BF16 | Dtype::F16 | Dtype::F32)
}

/// The module (the name without `.weight`) of a float (BF16/F16/F32) 2-D `*.weight`: a
/// linear layer's weight in high precision.
pub fn float_matrix_module<'a>(name: &'a str, t: &TensorInfo) -> Option<&'a str> {
    let module = name.strip_suffix(".weight")?;
    (is_float_weight_dtype(t.dtype) && t.shape.len() == 2).then_some(module)
}

/// Why a float weight matrix is copied rather than quantized.
enum Kept {
    /// `--exclude` names it.
    Excluded,
    /// The input's quantization_config excludes its module.
    InputConfig,
    /// Engines never quantize its module (`names::never_quantized`).
    NeverQuantized,
    /// Its shape does not quantize (the reason).
    Shape(String),
}

/// What `quantize` does with one tensor.
enum Treatment {
    Quantize,
    /// Not a float weight matrix (norms, biases, quantized tensors, scales): copied.
    Copy,
    Keep(Kept),
    /// A weight matrix in a dtype it cannot quantize, not excluded (why): refused, since the
    /// output's quantization_config would claim it quantized.
    Refuse(String),
}

/// What happens to `name` (dtype, shape) under `opts` and the input's exclude list;
/// `quantized`: the bases of the input's already quantized linears.
fn treatment(
    name: &str,
    t: &TensorInfo,
    opts: &QuantizeOptions,
    input_exclude: &ExcludeList,
    quantized: &BTreeSet<String>,
) -> Treatment {
    let Some(module) = name.strip_suffix(".weight") else {
        return Treatment::Copy;
    };
    // 1-D norm weights are never quantized; the packed weight of a quantized linear is copied
    let float = is_float_weight_dtype(t.dtype);
    if t.shape.len() < 2 || (!float && (t.shape.len() != 2 || quantized.contains(module))) {
        return Treatment::Copy;
    }
    if opts.exclude.iter().any(|x| name.contains(x.as_str())) {
        return Treatment::Keep(Kept::Excluded);
    }
    if input_exclude.covers(module) {
        return Treatment::Keep(Kept::InputConfig);
    }
    if super::names::never_quantized(module) {
        return Treatment::Keep(Kept::NeverQuantized);
    }
    if !float {
        return Treatment::Refuse(format!(
            "weight matrix {:?} of dtype {:?}: quantize reads BF16, F16 or F32 weights (and copies \
             the members of already quantized linears); convert it first, or keep it as it is \
             with `--exclude {module}`",
            t.shape, t.dtype
        ));
    }
    let block = opts.format.block();
    let reason = match t.shape.as_slice() {
        [_, 0] => "K = 0".to_string(),
        [_, k] if !k.is_multiple_of(block) => format!(
            "K = {k} is not a multiple of the {} block ({block})",
            opts.format.name()
        ),
        [_, _] => return Treatment::Quantize,
        s => format!("{}-D: only 2-D [N, K] weights are quantized", s.len()),
    };
    Treatment::Keep(Kept::Shape(reason))
}

/// The input's quantization_config (config.json's, else hf_quant_config.json's), checked:
/// a broken config.json is refused before anything is written.
fn input_quant_config(ckpt: &Checkpoint) -> Result<Option<QuantConfig>> {
    if !ckpt.is_dir() {
        return Ok(None);
    }
    if let Some(cfg) = ckpt.config_path() {
        let layers = super::names::Naming::detect(ckpt.names()).map(|n| {
            super::names::layers_present(&n, ckpt.names())
                .last()
                .map_or(0, |l| l + 1)
        });
        return Ok(super::config::check_config_file(&cfg, layers)?.1);
    }
    let hq = ckpt.dir().join(HF_QUANT_CONFIG_FILE);
    if !hq.is_file() {
        return Ok(None);
    }
    let text = super::file::read_regular(&hq)?;
    Ok(Some(super::config::parse_hf_quant_config(&hq, &text)?))
}

impl QuantizePlan {
    pub fn new(input: &Path, output: &Path, opts: QuantizeOptions) -> Result<QuantizePlan> {
        if let Some(gs) = opts.gs {
            if opts.format == Format::Mxfp4 {
                return Err(Error::usage(
                    "--gs applies to NVFP4 only (MXFP4 has no global scale)",
                ));
            }
            if !(gs.is_normal() && gs > 0.0 && (1.0 / gs).is_normal() && out_scale_finite(gs)) {
                return Err(Error::usage(format!(
                    "--gs {gs}: a global scale must be a positive normal number whose reciprocal is \
                     too, at most {:e} (beyond it the smallest block scales' out_scale overflows)",
                    max_finite_out_scale_gs()
                )));
            }
        }
        let ckpt = Checkpoint::open(input)?;
        if ckpt.is_dir() {
            if output.is_file() {
                return Err(Error::usage(format!(
                    "{} is a directory, so OUT must be one too; {} is a file",
                    input.display(),
                    output.display()
                )));
            }
            if same_file(input, output) {
                return Err(Error::usage(
                    "OUT is IN: the input is never modified; pick another directory",
                ));
            }
        } else if output.is_dir() {
            return Err(Error::usage(format!(
                "{} is a file, so OUT is the output file; {} is a directory",
                input.display(),
                output.display()
            )));
        }
        // inputs that cannot be right are refused before anything is written: a broken
        // config.json, NVFP4 triples whose members cannot belong together
        let input_exclude = input_quant_config(&ckpt)?
            .map(|q| q.exclude_modules)
            .unwrap_or_default();
        let covered = ExcludeList::new(&input_exclude);
        let quantized: BTreeSet<String> =
            super::formats::quantized_bases(&ckpt).into_iter().collect();
        for base in &quantized {
            if let Some(ln) = super::formats::find_linear(&ckpt, base)? {
                refuse_compressed_tensors(&ckpt, &ln, opts.format)?;
                refuse_other_format(&ckpt, &ln, opts.format)?;
                super::formats::check_linear(&ckpt, &ln)?;
            }
        }
        let mut files = vec![];
        for (i, shard) in ckpt.shards().iter().enumerate() {
            let out = if ckpt.is_dir() {
                let fname = shard.path().file_name().unwrap_or_default();
                output.join(fname)
            } else {
                output.to_path_buf()
            };
            if ckpt.shards().iter().any(|s| same_file(s.path(), &out)) {
                return Err(Error::usage(format!(
                    "{} would overwrite an input file; the input is never modified",
                    out.display()
                )));
            }
            files.push(plan_file(i, shard, out, &opts, &covered, &quantized)?);
        }
        if ckpt.is_dir() {
            refuse_stale_outputs(&ckpt, output, &files)?;
        }
        let scale_amax = if opts.shared_gate_up && opts.format == Format::Nvfp4 && opts.gs.is_none()
        {
            shared_gate_up_amax(&ckpt, &files)
        } else {
            BTreeMap::new()
        };
        Ok(QuantizePlan {
            ckpt,
            output: output.to_path_buf(),
            opts,
            input_exclude,
            files,
            scale_amax,
        })
    }

    /// Tensors the run will visit (for a progress bar).
    pub fn tensor_count(&self) -> usize {
        self.files.iter().map(|f| f.items.len()).sum()
    }

    /// Quantize and write, all or nothing: every file is written under its temporary name,
    /// and only when all are complete do they take their final names (shards first, side files
    /// last). On an error OUT is as it was. `on_tensor` is called after each input tensor is
    /// done.
    pub fn run(self, on_tensor: &(dyn Fn(&str) + Sync)) -> Result<QuantizeSummary> {
        let mut sum = QuantizeSummary {
            input: self.ckpt.path().to_path_buf(),
            output: self.output.clone(),
            ..Default::default()
        };
        let out_dir = if self.ckpt.is_dir() {
            self.output.as_path()
        } else {
            self.output.parent().unwrap_or(Path::new(""))
        };
        let mut pending = PendingOutput::new(out_dir);
        for fp in &self.files {
            sum.not_quantized.extend(fp.not_quantized.iter().cloned());
            sum.excluded_by_input_config
                .extend(fp.excluded_by_input_config.iter().cloned());
            sum.never_quantized
                .extend(fp.never_quantized.iter().cloned());
            pending.push(self.run_file(fp, &mut sum, on_tensor)?);
            sum.files_written += 1;
        }
        if self.ckpt.is_dir() {
            for f in self.side_files(&sum)? {
                pending.push(f);
            }
            self.remove_stale_markers()?;
        }
        pending.commit()?;
        Ok(sum)
    }

    /// One output shard, complete under its temporary name. A writer thread takes each
    /// tensor's bytes while the next one is quantized, so the cores are not idle during the
    /// (single-threaded) write; at most two tensors' outputs are in flight.
    fn run_file(
        &self,
        fp: &FilePlan,
        sum: &mut QuantizeSummary,
        on_tensor: &(dyn Fn(&str) + Sync),
    ) -> Result<PendingFile> {
        let shard = &self.ckpt.shards()[fp.shard];
        shard.advise_sequential();
        let meta = (!shard.metadata().is_empty()).then(|| shard.metadata().clone());
        let mut w = ShardWriter::create(&fp.output, fp.specs.clone(), meta)?;
        // output buffers go back and forth between the two threads instead of being reallocated
        let pool = std::sync::Mutex::new(Vec::<Vec<u8>>::new());
        std::thread::scope(|sc| {
            let (tx, rx) = std::sync::mpsc::sync_channel::<Piece>(2);
            let pool = &pool;
            let writer = sc.spawn(move || -> Result<ShardWriter> {
                for p in rx {
                    match p {
                        Piece::Mapped(t) => {
                            w.write_next(shard.slice(t))?;
                            shard.release(t);
                        }
                        Piece::Owned(b) => {
                            w.write_next(&b)?;
                            if let Ok(mut p) = pool.lock() {
                                p.push(b);
                            }
                        }
                    }
                }
                Ok(w)
            });
            let produced = self.produce(fp, shard, &tx, pool, sum, on_tensor);
            drop(tx);
            let written = writer
                .join()
                .map_err(|_| Error::bad_file(&fp.output, "internal: the writer thread panicked"))?;
            // a failed write stops the producer (its send fails): the write error is the news
            match (produced, written) {
                (_, Err(e)) | (Err(e), Ok(_)) => Err(e),
                (Ok(()), Ok(w)) => w.complete(),
            }
        })
    }

    fn produce<'a>(
        &self,
        fp: &FilePlan,
        shard: &'a TensorFile,
        tx: &std::sync::mpsc::SyncSender<Piece<'a>>,
        pool: &std::sync::Mutex<Vec<Vec<u8>>>,
        sum: &mut QuantizeSummary,
        on_tensor: &(dyn Fn(&str) + Sync),
    ) -> Result<()> {
        // the writer stopped (its error comes out of join): stop producing
        let send = |p: Piece<'a>| {
            tx.send(p)
                .map_err(|_| Error::bad_file(&fp.output, "write failed"))
        };
        for item in &fp.items {
            match item {
                Item::Copy(name) => {
                    let t = shard.info(name)?;
                    send(Piece::Mapped(t))?;
                    sum.copied += 1;
                    sum.bytes_in += t.nbytes() as u64;
                    sum.bytes_out += t.nbytes() as u64;
                    on_tensor(name);
                }
                Item::Quantize { name, rows, cols } => {
                    let t = shard.info(name)?;
                    // the smallest recycled buffer that holds `n` bytes
                    let take = |n: usize| {
                        pool.lock()
                            .ok()
                            .and_then(|mut p| {
                                let i = (0..p.len())
                                    .filter(|&i| p[i].capacity() >= n)
                                    .min_by_key(|&i| p[i].capacity())?;
                                Some(p.swap_remove(i))
                            })
                            .unwrap_or_default()
                    };
                    let block = self.opts.format.block();
                    let (pb, sb) = (take(rows * cols / 2), take(rows * cols / block));
                    let shared = self.scale_amax.get(name).copied();
                    let q = quantize_tensor_into(
                        shard, name, t, *rows, *cols, &self.opts, shared, pb, sb,
                    )?;
                    shard.release(t);
                    sum.bytes_out += (q.packed.len() + q.scales.len()) as u64;
                    send(Piece::Owned(q.packed))?;
                    send(Piece::Owned(q.scales))?;
                    if let Some(ws2) = q.weight_scale_2 {
                        send(Piece::Owned(f32_bytes(&[ws2])))?;
                        sum.bytes_out += 4;
                    }
                    sum.bytes_in += t.nbytes() as u64;
                    sum.quantized += 1;
                    add(&mut sum.blocks, &q.stats);
                    sum.tensors.push(QuantizedTensor {
                        name: name.clone(),
                        dtype: format!("{:?}", t.dtype),
                        shape: [*rows, *cols],
                        weight_scale_2: q.weight_scale_2,
                        amax: q.amax,
                        stats: q.stats,
                    });
                    on_tensor(name);
                }
            }
        }
        Ok(())
    }

    /// An OUT that already holds a checkpoint loses the files that make it one (those this
    /// run writes again, after every shard), once every file of this run is complete and
    /// before the first takes its final name: a run killed while renaming then leaves shards,
    /// never an old index or config.json vouching for a mix of old and new shards.
    fn remove_stale_markers(&self) -> Result<()> {
        let mut markers = vec![HF_QUANT_CONFIG_FILE];
        if self.ckpt.index_path().is_some() {
            markers.push(INDEX_FILE);
        }
        if self.ckpt.config_path().is_some() {
            markers.push(CONFIG_FILE);
        }
        for m in markers {
            let p = self.output.join(m);
            if p.is_file() {
                std::fs::remove_file(&p).map_err(|e| Error::io(&p, e))?;
            }
        }
        Ok(())
    }

    /// The output's exclude list: the exact module names of every float weight matrix left
    /// unquantized (engines read entries as module names or whole-name globs, never as
    /// substrings), and the input's own entries; sorted, without duplicates.
    fn exclude_modules(&self) -> Vec<String> {
        let mut all: Vec<String> = self
            .files
            .iter()
            .flat_map(|f| f.unquantized_modules.iter().cloned())
            .chain(self.input_exclude.iter().cloned())
            .collect();
        all.sort_unstable();
        all.dedup();
        all
    }

    /// Index, config.json with quantization_config, hf_quant_config.json, and the other small
    /// files of an HF directory (tokenizer, generation config) copied as they are; under
    /// their temporary names, in the order they take their final ones.
    fn side_files(&self, sum: &QuantizeSummary) -> Result<Vec<PendingFile>> {
        let mut files = vec![];
        let out = &self.output;
        let (algo, group) = match self.opts.format {
            Format::Nvfp4 => ("NVFP4", 16),
            Format::Mxfp4 => ("MXFP4", 32),
        };
        let exclude = self.exclude_modules();
        let producer = json!({"name": "nvfp4dbg", "version": env!("CARGO_PKG_VERSION")});
        if let Some(ix) = self.ckpt.index_path() {
            let old: Value = std::fs::read(ix)
                .ok()
                .and_then(|b| serde_json::from_slice(&b).ok())
                .unwrap_or(Value::Null);
            let mut meta = old
                .get("metadata")
                .and_then(|m| m.as_object())
                .cloned()
                .unwrap_or_default();
            meta.insert("total_size".into(), json!(sum.bytes_out));
            let mut map = BTreeMap::new();
            for fp in &self.files {
                let fname = fp
                    .output
                    .file_name()
                    .unwrap_or_default()
                    .to_string_lossy()
                    .to_string();
                for s in &fp.specs {
                    map.insert(s.name.clone(), fname.clone());
                }
            }
            let v = json!({"metadata": meta, "weight_map": map});
            files.push(pending_json(&out.join(INDEX_FILE), &v)?);
        }
        if let Some(cfg) = self.ckpt.config_path() {
            let text = std::fs::read(&cfg).map_err(|e| Error::io(&cfg, e))?;
            let mut v: Value = serde_json::from_slice(&text)
                .map_err(|e| Error::bad_file(&cfg, format!("not valid JSON: {e}")))?;
            let obj = v
                .as_object_mut()
                .ok_or_else(|| Error::bad_file(&cfg, "is not a JSON object"))?;
            obj.insert(
                "quantization_config".into(),
                json!({"quant_method": "modelopt", "quant_algo": algo, "group_size": group,
                       "exclude_modules": exclude, "producer": producer}),
            );
            files.push(pending_json(&out.join(CONFIG_FILE), &v)?);
        }
        files.push(pending_json(
            &out.join(HF_QUANT_CONFIG_FILE),
            &json!({"producer": producer, "quantization": {"quant_algo": algo, "group_size": group,
                    "kv_cache_quant_algo": null, "exclude_modules": exclude}}),
        )?);
        let rd = std::fs::read_dir(self.ckpt.dir()).map_err(|e| Error::io(self.ckpt.dir(), e))?;
        for e in rd {
            let e = e.map_err(|e| Error::io(self.ckpt.dir(), e))?;
            let p = e.path();
            let name = e.file_name().to_string_lossy().to_string();
            let ours = name.ends_with(".safetensors")
                || [INDEX_FILE, CONFIG_FILE, HF_QUANT_CONFIG_FILE, ORIGINALS_DIR]
                    .contains(&name.as_str());
            if p.is_file() && !ours {
                let bytes = std::fs::read(&p).map_err(|e| Error::io(&p, e))?;
                files.push(PendingFile::write(&out.join(&name), &bytes)?);
            }
        }
        Ok(files)
    }
}

/// The larger amax of each gate/up pair that both get quantized, for both members (a pair
/// whose member holds NaN/Inf is left out: quantizing it refuses that member).
fn shared_gate_up_amax(ckpt: &Checkpoint, files: &[FilePlan]) -> BTreeMap<String, f32> {
    let mut at: BTreeMap<&str, usize> = BTreeMap::new();
    for fp in files {
        for item in &fp.items {
            if let Item::Quantize { name, .. } = item {
                at.insert(name, fp.shard);
            }
        }
    }
    let amax = |name: &str| -> Option<f32> {
        let shard = &ckpt.shards()[*at.get(name)?];
        let t = shard.info(name).ok()?;
        let (bits, nonfinite) = max_abs_bits(t.dtype, shard.slice(t))?;
        (!nonfinite).then(|| bits_to_f32(bits, t.dtype))
    };
    let mut out = BTreeMap::new();
    for gate in at.keys() {
        let Some(up) = gate
            .strip_suffix(".weight")
            .and_then(super::names::up_sibling)
            .map(|u| format!("{u}.weight"))
        else {
            continue;
        };
        if let (Some(a), Some(b)) = (amax(gate), amax(&up)) {
            out.insert(gate.to_string(), a.max(b));
            out.insert(up, a.max(b));
        }
    }
    out
}

fn pending_json(p: &Path, v: &Value) -> Result<PendingFile> {
    let s = serde_json::to_string_pretty(v).unwrap_or_default() + "\n";
    PendingFile::write(p, s.as_bytes())
}

/// An OUT directory that already holds checkpoint files this run would not write again (the
/// shards of a previous run with other shard names, an index or config.json where IN has
/// none) is refused before anything is written: left in place they would describe a mix of
/// old and new files (an old index points loaders at the old shards only; without an index,
/// vLLM and `nvfp4dbg` read every `*.safetensors` of the directory).
fn refuse_stale_outputs(ckpt: &Checkpoint, output: &Path, files: &[FilePlan]) -> Result<()> {
    let Ok(rd) = std::fs::read_dir(output) else {
        return Ok(());
    };
    let ours: BTreeSet<&std::ffi::OsStr> =
        files.iter().filter_map(|f| f.output.file_name()).collect();
    let mut stale = vec![];
    for e in rd.flatten() {
        let name = e.file_name();
        let n = name.to_string_lossy();
        let describes = (n.ends_with(".safetensors") && !ours.contains(name.as_os_str()))
            || (n == INDEX_FILE && ckpt.index_path().is_none())
            || (n == CONFIG_FILE && ckpt.config_path().is_none());
        if describes && e.path().is_file() {
            stale.push(n.to_string());
        }
    }
    if stale.is_empty() {
        return Ok(());
    }
    stale.sort();
    Err(Error::usage(format!(
        "{} already holds {}, which this run would not write again: left there, they would \
         describe a mix of old and new files (an old index points loaders at the old shards; \
         without one, every *.safetensors of the directory is loaded). Remove them or pick an \
         empty directory",
        output.display(),
        stale.join(", ")
    )))
}

/// compressed-tensors NVFP4 linears cannot pass through: they would be copied under their own
/// names (`weight_packed`, the reciprocal `weight_global_scale`) next to the ModelOpt
/// quantization_config this run writes, and no engine loads such a checkpoint.
fn refuse_compressed_tensors(ckpt: &Checkpoint, ln: &LinearNames, format: Format) -> Result<()> {
    if ln.convention != Convention::CompressedTensors {
        return Ok(());
    }
    // the member that carries a compressed-tensors name
    let tensor = match &ln.global_scale {
        Some(g) if !ln.weight.ends_with("_packed") => g,
        _ => &ln.weight,
    };
    Err(Error::bad_tensor(
        ckpt.file_of(tensor),
        tensor,
        format!(
            "IN holds compressed-tensors NVFP4 linears; quantize writes ModelOpt {} and one \
             checkpoint cannot mix the two (engines load ModelOpt names under a ModelOpt \
             quantization_config): quantize the BF16 originals",
            format.name().to_uppercase()
        ),
    ))
}

/// Already quantized linears of the other format cannot pass through either: copied byte for
/// byte next to a quantization_config naming this run's format (NVFP4 codes with E4M3 scales of
/// 16 under `quant_algo: MXFP4, group_size: 32`, or the reverse), engines would load them
/// with the wrong method.
fn refuse_other_format(ckpt: &Checkpoint, ln: &LinearNames, format: Format) -> Result<()> {
    let theirs = match ln.convention {
        Convention::Modelopt => Format::Nvfp4,
        Convention::Mxfp4 => Format::Mxfp4,
        Convention::CompressedTensors => return Ok(()),
    };
    if theirs == format {
        return Ok(());
    }
    Err(Error::bad_tensor(
        ckpt.file_of(&ln.weight_scale),
        &ln.weight_scale,
        format!(
            "IN holds {} linears; --format {} would copy them as they are under a \
             quantization_config that says {}, and engines would load them with the wrong \
             method: quantize the BF16 originals, or keep --format {}",
            theirs.name().to_uppercase(),
            format.name(),
            format.name().to_uppercase(),
            theirs.name()
        ),
    ))
}

fn add(a: &mut BlockStats, b: &BlockStats) {
    a.blocks += b.blocks;
    a.saturated += b.saturated;
    a.flushed += b.flushed;
    a.nan_scales += b.nan_scales;
}

fn plan_file(
    shard: usize,
    f: &TensorFile,
    output: PathBuf,
    opts: &QuantizeOptions,
    input_exclude: &ExcludeList,
    quantized: &BTreeSet<String>,
) -> Result<FilePlan> {
    let mut plan = FilePlan {
        shard,
        output,
        items: vec![],
        specs: vec![],
        not_quantized: vec![],
        excluded_by_input_config: vec![],
        never_quantized: vec![],
        unquantized_modules: vec![],
    };
    let block = opts.format.block();
    for name in f.names() {
        let t = f.info(name)?;
        match treatment(name, t, opts, input_exclude, quantized) {
            Treatment::Quantize => {}
            Treatment::Refuse(why) => return Err(Error::bad_tensor(f.path(), name, why)),
            Treatment::Copy => {
                plan.copy(name, t);
                continue;
            }
            Treatment::Keep(k) => {
                plan.keep(name, t, k);
                plan.copy(name, t);
                continue;
            }
        }
        let (rows, cols) = (t.shape[0], t.shape[1]);
        let base = &name[..name.len() - ".weight".len()];
        let mut outs = vec![(format!("{base}.weight_scale"), opts.format)];
        if opts.format == Format::Nvfp4 {
            outs.push((format!("{base}.weight_scale_2"), opts.format));
        }
        for (o, _) in &outs {
            if f.contains(o) {
                return Err(Error::bad_tensor(
                    f.path(),
                    o,
                    format!("already exists, and quantizing `{name}` would write it again"),
                ));
            }
        }
        plan.specs
            .push(TensorSpec::new(name, Dtype::U8, &[rows, cols / 2]));
        let sd = match opts.format {
            Format::Nvfp4 => Dtype::F8_E4M3,
            Format::Mxfp4 => Dtype::F8_E8M0,
        };
        plan.specs.push(TensorSpec::new(
            format!("{base}.weight_scale"),
            sd,
            &[rows, cols / block],
        ));
        if opts.format == Format::Nvfp4 {
            plan.specs.push(TensorSpec::new(
                format!("{base}.weight_scale_2"),
                Dtype::F32,
                &[],
            ));
        }
        plan.items.push(Item::Quantize {
            name: name.to_string(),
            rows,
            cols,
        });
    }
    Ok(plan)
}

impl FilePlan {
    fn copy(&mut self, name: &str, t: &TensorInfo) {
        self.items.push(Item::Copy(name.to_string()));
        self.specs.push(TensorSpec::new(name, t.dtype, &t.shape));
    }

    /// A float weight left as it is: its module goes into the exclude list (2-D ones: the
    /// linears engines would build), and the report says why when no --exclude asked for it.
    fn keep(&mut self, name: &str, t: &TensorInfo, why: Kept) {
        if let Some(m) = name.strip_suffix(".weight").filter(|_| t.shape.len() == 2) {
            self.unquantized_modules.push(m.to_string());
        }
        match why {
            Kept::Excluded => {}
            Kept::InputConfig => self.excluded_by_input_config.push(name.to_string()),
            Kept::NeverQuantized => self.never_quantized.push(name.to_string()),
            Kept::Shape(reason) => self.not_quantized.push(NotQuantized {
                name: name.to_string(),
                shape: t.shape.clone(),
                reason,
            }),
        }
    }
}

/// One quantized tensor's outputs.
pub struct QuantizedBytes {
    pub packed: Vec<u8>,
    pub scales: Vec<u8>,
    pub weight_scale_2: Option<f32>,
    pub amax: f32,
    pub stats: BlockStats,
}

/// Max `|x|` of a float tensor as raw bits (abs bits of non-negative IEEE values order like the
/// values), and whether any element is NaN/Inf: exactly when the max abs bits reach the
/// all-ones exponent. A pure max-reduction over integers, which the compiler vectorizes.
fn max_abs_bits(d: Dtype, bytes: &[u8]) -> Option<(u32, bool)> {
    const CHUNK: usize = 1 << 18;
    let (size, inf) = match d {
        Dtype::BF16 => (2, 0x7F80u32),
        Dtype::F16 => (2, 0x7C00),
        Dtype::F32 => (4, 0x7F80_0000),
        _ => return None,
    };
    // fixed-width accumulators: the max of non-negative i16/i32 lanes vectorizes (pmaxsw)
    fn max16(c: &[u8]) -> u32 {
        let Some(h) = super::file::as_u16s(c) else {
            return c
                .chunks_exact(2)
                .map(|e| (u16::from_le_bytes([e[0], e[1]]) & 0x7FFF) as u32)
                .max()
                .unwrap_or(0);
        };
        let mut acc = [0i16; 32];
        let mut it = h.chunks_exact(32);
        for blk in &mut it {
            for (a, &v) in acc.iter_mut().zip(blk) {
                *a = (*a).max((v & 0x7FFF) as i16);
            }
        }
        let tail = it
            .remainder()
            .iter()
            .map(|&v| (v & 0x7FFF) as i16)
            .fold(0, i16::max);
        acc.iter().copied().fold(tail, i16::max) as u32
    }
    fn max32(c: &[u8]) -> u32 {
        let Some(w) = super::file::as_u32s(c) else {
            return c
                .chunks_exact(4)
                .map(|e| u32::from_le_bytes([e[0], e[1], e[2], e[3]]) & 0x7FFF_FFFF)
                .max()
                .unwrap_or(0);
        };
        let mut acc = [0i32; 16];
        let mut it = w.chunks_exact(16);
        for blk in &mut it {
            for (a, &v) in acc.iter_mut().zip(blk) {
                *a = (*a).max((v & 0x7FFF_FFFF) as i32);
            }
        }
        let tail = it
            .remainder()
            .iter()
            .map(|&v| (v & 0x7FFF_FFFF) as i32)
            .fold(0, i32::max);
        acc.iter().copied().fold(tail, i32::max) as u32
    }
    #[inline(never)]
    fn max_chunk(c: &[u8], size: usize) -> u32 {
        if size == 2 {
            max16(c)
        } else {
            max32(c)
        }
    }
    let m = bytes
        .par_chunks(CHUNK * size)
        .map(|c| max_chunk(c, size))
        .max()
        .unwrap_or(0);
    Some((m, m >= inf))
}

fn bits_to_f32(a: u32, d: Dtype) -> f32 {
    match d {
        Dtype::BF16 => f32::from_bits(a << 16),
        Dtype::F16 => half::f16::from_bits(a as u16).to_f32(),
        _ => f32::from_bits(a),
    }
}

/// Why a tensor of (finite) max `|x|` `amax` has no usable own global scale: nonzero, but
/// `amax / 2688` is not a normal f32. Where it or its reciprocal does not exist in f32,
/// `weight_global_scale` takes amax as 1 (as for an all-zero tensor) and every code is zero;
/// a subnormal `weight_scale_2` is read as 0 by kernels that flush subnormals.
///
/// Also refused: a normal `weight_scale_2` whose `gs = 1/weight_scale_2` is so large (amax below
/// about 4e-33) that the recipe's `out_scale = rcp(s * rcp(gs))` overflows to inf for the
/// smallest block scales (`nvfp4::out_scale_finite`): such blocks would get codes computed from
/// inf and NaN (zeros written as -6, everything else as ±6).
fn tiny_amax(amax: f32, name: &str) -> Option<String> {
    let ws2 = amax / GS_DENOM;
    if amax == 0.0 || (ws2.is_normal() && out_scale_finite(1.0 / ws2)) {
        return None;
    }
    let harm = if ws2.is_normal() {
        format!(
            "its global scale gs = 2688/amax = {:e} is so large that out_scale = 1/(s/gs) \
             overflows to inf in blocks with the smallest E4M3 scales (their zeros would be \
             written as -6, every other element as ±6; gs must stay at most {:e}): refusing to quantize",
            1.0 / ws2,
            max_finite_out_scale_gs()
        )
    } else if ws2 > 0.0 && (1.0 / ws2).is_finite() {
        format!(
            "weight_scale_2 = amax/2688 = {ws2:e} would be subnormal (fewer significant bits; \
             code built with flush-to-zero reads it as 0 and zeroes every output): refusing to quantize"
        )
    } else {
        format!(
            "amax/2688 = {ws2:e} or its reciprocal is no normal f32, so the global scale would \
             fall back to amax = 1: refusing to quantize (every code would be zero)"
        )
    };
    Some(format!(
        "amax {amax:e} is nonzero, but {harm}; keep it unquantized with `--exclude {name}`"
    ))
}

/// Why a nonzero tensor would be written as all-zero codes under global scale `gs`: the block
/// holding its amax gets the largest block scale, and even that one rounds to E4M3 zero, so every
/// block is flushed (a `--gs` given in the dequant direction, `weight_scale_2`, does this).
fn all_blocks_flushed(
    amax: f32,
    gs: f32,
    format: Format,
    explicit: bool,
    name: &str,
) -> Option<String> {
    let s = gs * (amax * crate::nvfp4::quant::R6);
    if format != Format::Nvfp4 || amax == 0.0 || e4m3::encode_saturating(s) & 0x7F != 0 {
        return None;
    }
    let from = if explicit {
        "--gs"
    } else {
        "the gate/up pair's shared global scale"
    };
    Some(format!(
        "amax {amax:e} is nonzero, but under {from} gs = {gs:e} its largest block scale \
         gs·amax/6 = {s:e} rounds to E4M3 zero: every block would be flushed and every code \
         zero (gs is the quant direction, 1/weight_scale_2; this tensor's own is 2688/amax = \
         {:e}): refusing to quantize; keep it unquantized with `--exclude {name}`",
        GS_DENOM / amax
    ))
}

/// Quantize one float tensor `[rows, cols]` of `f`.
pub fn quantize_tensor(
    f: &TensorFile,
    name: &str,
    t: &TensorInfo,
    rows: usize,
    cols: usize,
    opts: &QuantizeOptions,
) -> Result<QuantizedBytes> {
    quantize_tensor_into(f, name, t, rows, cols, opts, None, vec![], vec![])
}

/// [`quantize_tensor`] into recycled output buffers (their contents are overwritten): fresh
/// multi-MB allocations per tensor cost a page fault and a kernel page clear per 4 KiB.
/// `scale_amax`: the amax its global scale comes from when not its own (a gate/up pair's).
#[allow(clippy::too_many_arguments)]
pub fn quantize_tensor_into(
    f: &TensorFile,
    name: &str,
    t: &TensorInfo,
    rows: usize,
    cols: usize,
    opts: &QuantizeOptions,
    scale_amax: Option<f32>,
    mut packed: Vec<u8>,
    mut scales: Vec<u8>,
) -> Result<QuantizedBytes> {
    f.prefetch(t);
    let bytes = f.slice(t);
    let (amax_raw, nonfinite) = max_abs_bits(t.dtype, bytes).ok_or_else(|| {
        Error::bad_tensor(
            f.path(),
            name,
            format!("{:?} is not BF16, F16 or F32", t.dtype),
        )
    })?;
    if nonfinite {
        let (_, first) = super::audit::count_nonfinite(t.dtype, bytes);
        let i = first.unwrap_or(0);
        let size = elem_size(t.dtype).unwrap_or(1);
        let mut x = [0f32];
        super::file::decode_row(t.dtype, &bytes[i * size..(i + 1) * size], &mut x);
        return Err(Error::bad_tensor(
            f.path(),
            name,
            format!(
                "element [{}, {}] is {}: refusing to quantize (it would silently give NaN block scales)",
                i / cols.max(1),
                i % cols.max(1),
                x[0]
            ),
        ));
    }
    let amax = bits_to_f32(amax_raw, t.dtype);
    let block = opts.format.block();
    let (gs, weight_scale_2) = match (opts.format, opts.gs) {
        (Format::Mxfp4, _) => (1.0, None),
        (Format::Nvfp4, Some(gs)) => (gs, Some(1.0 / gs)),
        // the one-element slice has the tensor's amax: the same scales quantize_weight_nvfp4 picks
        (Format::Nvfp4, None) => {
            let amax = scale_amax.unwrap_or(amax);
            if let Some(why) = tiny_amax(amax, name) {
                return Err(Error::bad_tensor(f.path(), name, why));
            }
            let (ws2, gs) = weight_global_scale(&[amax]);
            (gs, Some(ws2))
        }
    };
    if let Some(why) = all_blocks_flushed(amax, gs, opts.format, opts.gs.is_some(), name) {
        return Err(Error::bad_tensor(f.path(), name, why));
    }
    let kb = cols / block;
    packed.clear();
    packed.resize(rows * cols / 2, 0);
    scales.clear();
    scales.resize(rows * kb, 0);
    let row_bytes = cols * elem_size(t.dtype).unwrap_or(1);
    // enough rows per task that a task is ~64K elements
    let rows_per = (65536 / cols.max(1)).max(1);
    let stats = packed
        .par_chunks_mut(rows_per * cols / 2)
        .zip(scales.par_chunks_mut(rows_per * kb))
        .zip(bytes.par_chunks(rows_per * row_bytes))
        .map(|((p, s), b)| {
            let mut st = BlockStats::default();
            let mut row = vec![0f32; cols];
            for ((pr, sr), br) in p
                .chunks_exact_mut(cols / 2)
                .zip(s.chunks_exact_mut(kb))
                .zip(b.chunks_exact(row_bytes))
            {
                super::file::decode_row(t.dtype, br, &mut row);
                match opts.format {
                    Format::Nvfp4 => quantize_row_nvfp4(&row, gs, pr, sr, &mut st),
                    Format::Mxfp4 => {
                        for (j, (xb, pb)) in row
                            .chunks_exact(block)
                            .zip(pr.chunks_exact_mut(block / 2))
                            .enumerate()
                        {
                            sr[j] = quantize_block_mxfp4(xb, pb, &mut st);
                        }
                    }
                }
            }
            st
        })
        .reduce(BlockStats::default, |mut a, b| {
            add(&mut a, &b);
            a
        });
    Ok(QuantizedBytes {
        packed,
        scales,
        weight_scale_2,
        amax,
        stats,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::writer::{bf16_bytes, write_file};
    use crate::nvfp4::{quantize_mxfp4, quantize_nvfp4, quantize_weight_nvfp4};
    use rand::{Rng, SeedableRng};
    use rand_distr::{Distribution, StandardNormal};

    #[test]
    fn streaming_matches_the_whole_tensor_quantizers() {
        let seed: u64 = rand::random();
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let d = tempfile::tempdir().unwrap();
        for (dtype, rows, cols) in [
            (Dtype::BF16, r.gen_range(1..300), 32 * r.gen_range(1..40)),
            (
                Dtype::F32,
                r.gen_range(1..5),
                65536 + 32 * r.gen_range(1..4),
            ),
            (Dtype::F16, r.gen_range(1..50), 32 * r.gen_range(1..20)),
        ] {
            let x: Vec<f32> = (0..rows * cols)
                .map(|_| {
                    let v: f32 = StandardNormal.sample(&mut r);
                    v * r.gen_range(1e-3f32..2.0)
                })
                .collect();
            let bytes = match dtype {
                Dtype::BF16 => bf16_bytes(&x),
                Dtype::F16 => x
                    .iter()
                    .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
                    .collect(),
                _ => f32_bytes(&x),
            };
            let p = d.path().join("x.safetensors");
            write_file(
                &p,
                vec![(TensorSpec::new("w.weight", dtype, &[rows, cols]), bytes)],
                None,
            )
            .unwrap();
            let f = TensorFile::open(&p).unwrap();
            let xs = f.to_f32("w.weight").unwrap();
            let t = f.info("w.weight").unwrap();
            let auto = QuantizeOptions {
                format: Format::Nvfp4,
                gs: None,
                exclude: vec![],
                shared_gate_up: false,
            };
            let q = quantize_tensor(&f, "w.weight", t, rows, cols, &auto).unwrap();
            let (want, st) = quantize_weight_nvfp4(&xs, rows, cols);
            assert_eq!(q.packed, want.packed, "seed {seed} {dtype:?}");
            assert_eq!(q.scales, want.scales, "seed {seed} {dtype:?}");
            assert_eq!(q.weight_scale_2, Some(want.scale_2), "seed {seed}");
            assert_eq!(q.stats, st);
            let gs: f32 = r.gen_range(1.0..5000.0);
            let fixed = QuantizeOptions {
                gs: Some(gs),
                ..auto.clone()
            };
            let q = quantize_tensor(&f, "w.weight", t, rows, cols, &fixed).unwrap();
            let (want, _) = quantize_nvfp4(&xs, rows, cols, gs);
            assert_eq!(
                (q.packed, q.scales),
                (want.packed, want.scales),
                "seed {seed} gs {gs}"
            );
            let mx = QuantizeOptions {
                format: Format::Mxfp4,
                gs: None,
                exclude: vec![],
                shared_gate_up: false,
            };
            let q = quantize_tensor(&f, "w.weight", t, rows, cols, &mx).unwrap();
            let (want, _) = quantize_mxfp4(&xs, rows, cols);
            assert_eq!(
                (q.packed, q.scales, q.weight_scale_2),
                (want.packed, want.scales, None),
                "seed {seed}"
            );
        }
    }

    #[test]
    fn non_finite_weights_are_refused() {
        let d = tempfile::tempdir().unwrap();
        let mut r = rand::thread_rng();
        let (rows, cols) = (3, 64);
        let mut x: Vec<f32> = (0..rows * cols).map(|_| r.gen_range(-1.0..1.0)).collect();
        let at = r.gen_range(0..rows * cols);
        x[at] = if r.gen() { f32::NAN } else { f32::NEG_INFINITY };
        let p = d.path().join("x.safetensors");
        write_file(
            &p,
            vec![(
                TensorSpec::new("w.weight", Dtype::BF16, &[rows, cols]),
                bf16_bytes(&x),
            )],
            None,
        )
        .unwrap();
        let f = TensorFile::open(&p).unwrap();
        let opts = QuantizeOptions {
            format: Format::Nvfp4,
            gs: None,
            exclude: vec![],
            shared_gate_up: false,
        };
        let e = quantize_tensor(
            &f,
            "w.weight",
            f.info("w.weight").unwrap(),
            rows,
            cols,
            &opts,
        )
        .err()
        .unwrap()
        .to_string();
        assert!(
            e.contains(&format!("element [{}, {}]", at / cols, at % cols))
                && e.contains("`w.weight`"),
            "{e}"
        );
    }
}
