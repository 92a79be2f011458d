//! A checkpoint as users hand it to us: an HF directory (`model.safetensors`, or shards with
//! `model.safetensors.index.json`, or just `*.safetensors`), or a single `.safetensors` file.
//! Every shard is memory-mapped and its header validated at open; tensor bytes are touched only
//! when asked for.

use super::file::{TensorFile, TensorInfo};
use super::source::TensorSource;
use crate::error::{Error, Result};
use std::collections::HashMap;
use std::path::{Component, Path, PathBuf};

pub const INDEX_FILE: &str = "model.safetensors.index.json";
pub const SINGLE_FILE: &str = "model.safetensors";
pub const CONFIG_FILE: &str = "config.json";
pub const HF_QUANT_CONFIG_FILE: &str = "hf_quant_config.json";
/// Where a synth checkpoint keeps the BF16 originals of its quantized weights.
pub const ORIGINALS_DIR: &str = "bf16";

#[derive(Debug)]
pub struct Checkpoint {
    /// The path the user gave.
    root: PathBuf,
    /// The directory config.json is looked for in (the parent of a single file).
    dir: PathBuf,
    index: Option<PathBuf>,
    shards: Vec<TensorFile>,
    lookup: HashMap<String, usize>,
    names: Vec<String>,
    /// Second copies in another shard than the one the index names: (name, shard).
    shadowed: Vec<(String, usize)>,
    /// Tensors a listed shard stores that the index's `weight_map` does not name: (name, shard).
    unindexed: Vec<(String, usize)>,
    /// `*.safetensors` files next to the index that it does not list (not opened).
    unlisted: Vec<PathBuf>,
    originals: Option<Box<Checkpoint>>,
}

impl Checkpoint {
    /// Open a directory or a single `.safetensors` file, with `bf16/` originals when present.
    pub fn open(path: &Path) -> Result<Checkpoint> {
        Self::open_inner(path, true)
    }

    /// Open without looking at `bf16/` (for commands told not to use the originals: a broken
    /// originals directory is then no reason to refuse the checkpoint).
    pub fn open_without_originals(path: &Path) -> Result<Checkpoint> {
        Self::open_inner(path, false)
    }

    fn open_inner(path: &Path, with_originals: bool) -> Result<Checkpoint> {
        let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
        if !meta.is_dir() {
            let f = TensorFile::open(path)?;
            let dir = path
                .parent()
                .filter(|p| !p.as_os_str().is_empty())
                .unwrap_or_else(|| Path::new("."))
                .to_path_buf();
            return Self::assemble(path, dir, None, vec![f], None, None);
        }
        let index = path.join(INDEX_FILE);
        let mut unlisted = vec![];
        // an index that is there but cannot be read (a directory, a broken symlink) is not
        // an absent one: engines fail on it, and the shards alone may be a partial download
        let index_there = std::fs::symlink_metadata(&index).is_ok();
        if let Some(why) = not_a_file(&index).filter(|_| index_there) {
            return Err(Error::bad_file(&index, why));
        }
        let (shards, index, weight_map) = if index_there {
            let (files, map) = read_index(&index)?;
            unlisted = safetensors_in(path)?
                .into_iter()
                .filter(|p| {
                    p.is_file()
                        && p.file_name()
                            .is_none_or(|n| !files.iter().any(|f| n == f.as_str()))
                })
                .collect();
            let mut shards = Vec::with_capacity(files.len());
            for f in &files {
                let p = path.join(f);
                if let Some(why) = not_a_file(&p) {
                    return Err(Error::bad_file(
                        &index,
                        format!("names shard `{f}`, which {why} ({})", p.display()),
                    ));
                }
                shards.push(TensorFile::open(&p)?);
            }
            (shards, Some(index), Some((files, map)))
        } else if path.join(SINGLE_FILE).is_file() {
            (vec![TensorFile::open(&path.join(SINGLE_FILE))?], None, None)
        } else {
            let files = safetensors_in(path)?;
            if files.is_empty() {
                return Err(Error::bad_file(
                    path,
                    format!("directory without tensors: no {SINGLE_FILE}, no {INDEX_FILE}, no *.safetensors"),
                ));
            }
            // without an index every *.safetensors is a shard: one that cannot be read is not
            // to be skipped (its tensors would be reported missing, or not at all)
            for p in &files {
                if let Some(why) = not_a_file(p) {
                    return Err(Error::bad_file(
                        p,
                        format!("{why}; without {INDEX_FILE}, every *.safetensors here is read as a shard"),
                    ));
                }
            }
            if let Some(missing) = missing_numbered_shard(&files) {
                return Err(Error::bad_file(
                    path.join(&missing),
                    format!(
                        "does not exist, but the shards here are numbered as a set that holds \
                         it (no {INDEX_FILE} says otherwise): an unfinished download or copy"
                    ),
                ));
            }
            let shards = files
                .iter()
                .map(|p| TensorFile::open(p))
                .collect::<Result<Vec<_>>>()?;
            (shards, None, None)
        };
        let originals = if with_originals && path.join(ORIGINALS_DIR).is_dir() {
            Some(Box::new(Self::open_inner(
                &path.join(ORIGINALS_DIR),
                false,
            )?))
        } else {
            None
        };
        let mut ck = Self::assemble(
            path,
            path.to_path_buf(),
            index,
            shards,
            weight_map,
            originals,
        )?;
        ck.unlisted = unlisted;
        Ok(ck)
    }

    fn assemble(
        root: &Path,
        dir: PathBuf,
        index: Option<PathBuf>,
        shards: Vec<TensorFile>,
        weight_map: Option<WeightMap>,
        originals: Option<Box<Checkpoint>>,
    ) -> Result<Checkpoint> {
        let mut lookup = HashMap::new();
        let mut names = vec![];
        let mut shadowed = vec![];
        let mut unindexed = vec![];
        if let (Some((files, map)), Some(ix)) = (&weight_map, &index) {
            // The index is what engines load by: every tensor it names must be where it says.
            for (name, fi) in map {
                let shard = &shards[*fi];
                if !shard.contains(name) {
                    return Err(Error::bad_tensor(
                        shard.path(),
                        name,
                        format!(
                            "{} places this tensor in shard `{}`, which lacks it",
                            ix.display(),
                            files[*fi]
                        ),
                    ));
                }
                lookup.insert(name.clone(), *fi);
            }
        }
        for (i, s) in shards.iter().enumerate() {
            for n in s.names() {
                match lookup.get(n) {
                    Some(&j) if j == i => {}
                    Some(&j) if index.is_none() => {
                        return Err(Error::bad_tensor(
                            s.path(),
                            n,
                            format!(
                                "also in {}: which copy is meant is ambiguous without an index",
                                shards[j].path().display()
                            ),
                        ))
                    }
                    // the index chose another shard's copy
                    Some(_) => {
                        shadowed.push((n.to_string(), i));
                        continue;
                    }
                    None => {
                        if index.is_some() {
                            unindexed.push((n.to_string(), i));
                        }
                        lookup.insert(n.to_string(), i);
                    }
                }
                names.push(n.to_string());
            }
        }
        if names.is_empty() {
            return Err(Error::bad_file(root, "holds no tensors"));
        }
        Ok(Checkpoint {
            root: root.to_path_buf(),
            dir,
            index,
            shards,
            lookup,
            names,
            shadowed,
            unindexed,
            unlisted: vec![],
            originals,
        })
    }

    /// The path as given.
    pub fn path(&self) -> &Path {
        &self.root
    }

    /// The directory of the checkpoint (the parent directory for a single file).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// True when opened from a directory (not a single file).
    pub fn is_dir(&self) -> bool {
        self.root == self.dir
    }

    pub fn index_path(&self) -> Option<&Path> {
        self.index.as_deref()
    }

    pub fn shards(&self) -> &[TensorFile] {
        &self.shards
    }

    /// Tensors that a second shard also stores, with that shard: the index names the other
    /// copy, but engines that load every tensor of every listed shard (vLLM, transformers)
    /// read both.
    pub fn shadowed_copies(&self) -> impl Iterator<Item = (&str, &TensorFile)> + '_ {
        self.shadowed
            .iter()
            .map(|(n, i)| (n.as_str(), &self.shards[*i]))
    }

    /// Tensors stored in a shard the index lists but missing from its `weight_map`, with that
    /// shard. They are loaded and scanned like the others (vLLM, which reads every tensor of
    /// every listed shard, loads them too), but transformers loads by the `weight_map` and
    /// never sees them.
    pub fn unindexed_tensors(&self) -> impl Iterator<Item = (&str, &TensorFile)> + '_ {
        self.unindexed
            .iter()
            .map(|(n, i)| (n.as_str(), &self.shards[*i]))
    }

    /// `*.safetensors` files in the checkpoint directory that its index does not list, sorted
    /// (not opened: engines never read them, transformers' `model.safetensors` aside, which it
    /// loads instead of the index).
    pub fn unlisted_files(&self) -> &[PathBuf] {
        &self.unlisted
    }

    /// `config.json` of the checkpoint directory, if there is one.
    pub fn config_path(&self) -> Option<PathBuf> {
        let p = self.dir.join(CONFIG_FILE);
        p.is_file().then_some(p)
    }

    /// The BF16 originals (`DIR/bf16/`), when the checkpoint ships them.
    pub fn originals(&self) -> Option<&Checkpoint> {
        self.originals.as_deref()
    }

    /// Every tensor name: shards in order, each in data order.
    pub fn names(&self) -> impl ExactSizeIterator<Item = &str> + '_ {
        self.names.iter().map(|s| s.as_str())
    }

    pub fn contains(&self, name: &str) -> bool {
        self.lookup.contains_key(name)
    }

    pub fn info(&self, name: &str) -> Result<&TensorInfo> {
        self.tensor_info(name)
    }

    pub fn bytes(&self, name: &str) -> Result<&[u8]> {
        self.tensor_bytes(name)
    }

    pub fn to_f32(&self, name: &str) -> Result<Vec<f32>> {
        self.tensor_f32(name)
    }

    pub fn scalar_f32(&self, name: &str) -> Result<f32> {
        self.tensor_scalar_f32(name)
    }

    pub fn to_i64(&self, name: &str) -> Result<Vec<i64>> {
        self.tensor_i64(name)
    }

    /// The model configuration from `config.json` (+ `hf_quant_config.json`); a checkpoint
    /// without one is bad input for commands that need it.
    pub fn config(&self) -> Result<super::config::ModelConfig> {
        let p = self.config_path().ok_or_else(|| {
            Error::bad_file(
                &self.root,
                format!(
                    "no {CONFIG_FILE} in {} (the MoE dimensions come from it)",
                    self.dir.display()
                ),
            )
        })?;
        let naming = super::names::Naming::detect(self.names());
        let layers_hint = naming.map(|n| {
            super::names::layers_present(&n, self.names())
                .last()
                .map_or(0, |l| l + 1)
        });
        super::config::read_config(&p, layers_hint)
    }
}

impl TensorSource for Checkpoint {
    fn origin(&self) -> &Path {
        &self.root
    }
    fn locate(&self, name: &str) -> Option<(&TensorFile, &TensorInfo)> {
        let i = *self.lookup.get(name)?;
        let f = &self.shards[i];
        f.get(name).map(|t| (f, t))
    }
    fn tensor_names(&self) -> Box<dyn Iterator<Item = &str> + '_> {
        Box::new(self.names())
    }
}

/// The `*.safetensors` entries directly in `dir`, sorted: regular files, and whatever else
/// carries such a name (a directory, a broken symlink) for the caller to judge.
fn safetensors_in(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut files = vec![];
    for e in std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))? {
        let e = e.map_err(|e| Error::io(dir, e))?;
        let p = e.path();
        if p.extension().is_some_and(|x| x == "safetensors") {
            files.push(p);
        }
    }
    files.sort();
    Ok(files)
}

/// The first file missing from a set of shards named `<stem>-NNNNN-of-MMMMM.safetensors`
/// (the names `save_pretrained` writes), or None when each such set is whole.
fn missing_numbered_shard(files: &[PathBuf]) -> Option<String> {
    let numbered = |p: &PathBuf| -> Option<(String, String, String)> {
        let name = p.file_name()?.to_str()?.strip_suffix(".safetensors")?;
        let (rest, total) = name.rsplit_once("-of-")?;
        let (stem, i) = rest.rsplit_once('-')?;
        let digits = |x: &str| !x.is_empty() && x.bytes().all(|b| b.is_ascii_digit());
        (digits(i) && digits(total)).then(|| (stem.to_string(), i.to_string(), total.to_string()))
    };
    let sets: Vec<(String, String, String)> = files.iter().filter_map(numbered).collect();
    for (stem, _, total) in &sets {
        let n: u64 = total.parse().ok()?;
        let have = |k: u64| {
            sets.iter()
                .any(|(s, i, t)| s == stem && t == total && i.parse() == Ok(k))
        };
        if let Some(k) = (1..=n.min(1 << 20)).find(|&k| !have(k)) {
            let w = total.len();
            return Some(format!("{stem}-{k:0w$}-of-{total}.safetensors"));
        }
    }
    None
}

/// Why `p` cannot be opened as a file, or None when it can (a FIFO or device passes here:
/// opening it says what it is).
fn not_a_file(p: &Path) -> Option<String> {
    match std::fs::metadata(p) {
        Ok(m) if m.is_dir() => Some("is a directory, not a file".into()),
        Ok(_) => None,
        Err(e) if std::fs::symlink_metadata(p).is_ok() => Some(format!(
            "is a symlink that cannot be followed ({e}): a broken link (an unfinished download?)"
        )),
        Err(_) => Some("does not exist".into()),
    }
}

/// `weight_map` of an index: the shard file names (first-seen order) and each tensor's shard.
type WeightMap = (Vec<String>, Vec<(String, usize)>);

fn read_index(index: &Path) -> Result<WeightMap> {
    let text = super::file::read_regular(index)?;
    let v: serde_json::Value = serde_json::from_slice(&text)
        .map_err(|e| Error::bad_file(index, format!("not valid JSON: {e}")))?;
    let wm = v
        .get("weight_map")
        .ok_or_else(|| Error::bad_file(index, "has no `weight_map`"))?
        .as_object()
        .ok_or_else(|| Error::bad_file(index, "`weight_map` is not a JSON object"))?;
    let mut files: Vec<String> = vec![];
    let mut pos: HashMap<String, usize> = HashMap::new();
    let mut map = Vec::with_capacity(wm.len());
    for (name, f) in wm {
        let f = f.as_str().ok_or_else(|| {
            Error::bad_file(
                index,
                format!("`weight_map[\"{name}\"]` is not a file name"),
            )
        })?;
        // shards live next to the index; anything else is not an HF checkpoint
        let mut comps = Path::new(f).components();
        if !matches!(
            (comps.next(), comps.next()),
            (Some(Component::Normal(_)), None)
        ) {
            return Err(Error::bad_file(
                index,
                format!(
                    "`weight_map[\"{name}\"]` = `{f}` is not a plain file name in this directory"
                ),
            ));
        }
        let i = *pos.entry(f.to_string()).or_insert_with(|| {
            files.push(f.to_string());
            files.len() - 1
        });
        map.push((name.clone(), i));
    }
    if map.is_empty() {
        return Err(Error::bad_file(
            index,
            "`weight_map` is empty: directory without tensors",
        ));
    }
    Ok((files, map))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::writer::{f32_bytes, write_file, TensorSpec};
    use safetensors::Dtype;

    // Guards: without an index, half of a numbered shard set was read as the whole checkpoint.
    #[test]
    fn a_numbered_shard_set_with_a_gap_names_the_missing_shard() {
        let seed: u64 = rand::random();
        let total = 2 + seed % 6;
        let gap = 1 + (seed / 7) % total;
        let name = |k: u64| PathBuf::from(format!("/x/model-{k:05}-of-{total:05}.safetensors"));
        let mut files: Vec<PathBuf> = (1..=total).filter(|&k| k != gap).map(name).collect();
        files.push(PathBuf::from("/x/extra.safetensors"));
        assert_eq!(
            missing_numbered_shard(&files).as_deref(),
            name(gap).file_name().and_then(|n| n.to_str()),
            "seed {seed}"
        );
        files.push(name(gap));
        assert_eq!(missing_numbered_shard(&files), None, "seed {seed}");
    }

    fn shard(p: &Path, names: &[(&str, f32)]) {
        write_file(
            p,
            names
                .iter()
                .map(|(n, v)| (TensorSpec::new(*n, Dtype::F32, &[2]), f32_bytes(&[*v, -*v])))
                .collect(),
            None,
        )
        .unwrap();
    }

    #[test]
    fn sharded_directory_with_index() {
        let d = tempfile::tempdir().unwrap();
        let v: f32 = rand::random::<f32>() + 0.5;
        shard(&d.path().join("a.safetensors"), &[("x", v), ("y", 2.0 * v)]);
        shard(&d.path().join("b.safetensors"), &[("z", 3.0 * v)]);
        let idx = r#"{"metadata":{},"weight_map":{"x":"a.safetensors","y":"a.safetensors","z":"b.safetensors"}}"#;
        std::fs::write(d.path().join(INDEX_FILE), idx).unwrap();
        let c = Checkpoint::open(d.path()).unwrap();
        assert_eq!(c.names().count(), 3);
        assert_eq!(c.to_f32("z").unwrap(), vec![3.0 * v, -3.0 * v]);
        assert_eq!(c.file_of("z"), d.path().join("b.safetensors"));
        assert!(c.originals().is_none());
        assert!(c.to_f32("w").unwrap_err().to_string().contains("`w`"));
        assert_eq!(c.unindexed_tensors().count(), 0);

        // a tensor a listed shard stores but the weight_map leaves out: still read, and named
        let idx = r#"{"weight_map":{"x":"a.safetensors","z":"b.safetensors"}}"#;
        std::fs::write(d.path().join(INDEX_FILE), idx).unwrap();
        let c = Checkpoint::open(d.path()).unwrap();
        assert_eq!(c.to_f32("y").unwrap(), vec![2.0 * v, -2.0 * v]);
        let u: Vec<_> = c
            .unindexed_tensors()
            .map(|(n, f)| (n.to_string(), f.path().to_path_buf()))
            .collect();
        assert_eq!(u, vec![("y".to_string(), d.path().join("a.safetensors"))]);

        // index naming a tensor the shard lacks
        let idx = r#"{"weight_map":{"x":"b.safetensors"}}"#;
        std::fs::write(d.path().join(INDEX_FILE), idx).unwrap();
        let e = Checkpoint::open(d.path()).unwrap_err().to_string();
        assert!(
            e.contains("b.safetensors") && e.contains("`x`") && e.contains("lacks"),
            "{e}"
        );
        // index naming a missing shard
        let idx = r#"{"weight_map":{"x":"c.safetensors"}}"#;
        std::fs::write(d.path().join(INDEX_FILE), idx).unwrap();
        let e = Checkpoint::open(d.path()).unwrap_err().to_string();
        assert!(e.contains(INDEX_FILE) && e.contains("c.safetensors"), "{e}");
        // broken index
        std::fs::write(d.path().join(INDEX_FILE), "{\"weight_map\": ").unwrap();
        let e = Checkpoint::open(d.path()).unwrap_err().to_string();
        assert!(e.contains(INDEX_FILE) && e.contains("JSON"), "{e}");
        std::fs::write(
            d.path().join(INDEX_FILE),
            r#"{"weight_map":{"x":"../a.safetensors"}}"#,
        )
        .unwrap();
        assert!(Checkpoint::open(d.path()).is_err());

        // without an index: every *.safetensors, duplicates are ambiguous
        std::fs::remove_file(d.path().join(INDEX_FILE)).unwrap();
        let c = Checkpoint::open(d.path()).unwrap();
        assert_eq!(c.names().count(), 3);
        shard(&d.path().join("c.safetensors"), &[("x", 1.0)]);
        let e = Checkpoint::open(d.path()).unwrap_err().to_string();
        assert!(e.contains("ambiguous") && e.contains("`x`"), "{e}");
    }

    #[test]
    fn directories_without_tensors_and_originals() {
        let d = tempfile::tempdir().unwrap();
        let e = Checkpoint::open(d.path()).unwrap_err().to_string();
        assert!(e.contains("without tensors"), "{e}");
        write_file(&d.path().join(SINGLE_FILE), vec![], None).unwrap();
        let e = Checkpoint::open(d.path()).unwrap_err().to_string();
        assert!(e.contains("no tensors"), "{e}");
        shard(&d.path().join(SINGLE_FILE), &[("a.weight", 1.0)]);
        std::fs::create_dir(d.path().join(ORIGINALS_DIR)).unwrap();
        shard(
            &d.path().join(ORIGINALS_DIR).join(SINGLE_FILE),
            &[("a.weight", 5.0)],
        );
        let c = Checkpoint::open(d.path()).unwrap();
        assert_eq!(c.originals().unwrap().to_f32("a.weight").unwrap()[0], 5.0);
        assert!(c.is_dir());
        let f = Checkpoint::open(&d.path().join(SINGLE_FILE)).unwrap();
        assert!(!f.is_dir() && f.originals().is_none());
        assert_eq!(f.dir(), d.path());
    }
}
