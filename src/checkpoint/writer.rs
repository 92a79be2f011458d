//! Writing safetensors files that may be larger than memory: the header is written from the
//! tensor specs first, then each tensor's bytes in order. The file appears under its final
//! name only when complete (temporary name + rename); a run of several files can keep them all
//! under temporary names until every one is complete ([`PendingOutput`]).

use crate::error::{Error, Result};
use crate::report::PendingFile;
use safetensors::Dtype;
use std::collections::BTreeMap;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

#[derive(Clone, Debug)]
pub struct TensorSpec {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
}

impl TensorSpec {
    pub fn new(name: impl Into<String>, dtype: Dtype, shape: &[usize]) -> Self {
        TensorSpec {
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
        }
    }
    pub fn nbytes(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.bitsize() / 8
    }
}

pub fn dtype_name(d: Dtype) -> String {
    // safetensors spells dtypes as their Debug names (F32, BF16, U8, F8_E4M3, ...)
    format!("{d:?}")
}

/// Streams tensors into one safetensors file, in the order of the specs given to `create`.
pub struct ShardWriter {
    // closed before `file` removes an unfinished temporary
    out: BufWriter<std::fs::File>,
    file: PendingFile,
    specs: Vec<TensorSpec>,
    next: usize,
}

impl ShardWriter {
    pub fn create(
        path: &Path,
        specs: Vec<TensorSpec>,
        metadata: Option<BTreeMap<String, String>>,
    ) -> Result<ShardWriter> {
        let mut header = serde_json::Map::new();
        if let Some(m) = metadata {
            header.insert(
                "__metadata__".into(),
                serde_json::to_value(m).unwrap_or_default(),
            );
        }
        let mut offset = 0usize;
        for s in &specs {
            let n = s.nbytes();
            header.insert(
                s.name.clone(),
                serde_json::json!({
                    "dtype": dtype_name(s.dtype),
                    "shape": s.shape,
                    "data_offsets": [offset, offset + n],
                }),
            );
            offset += n;
        }
        let mut h = serde_json::to_vec(&serde_json::Value::Object(header)).unwrap_or_default();
        // pad the header with spaces to 8 bytes, as the reference writer does
        while !h.len().is_multiple_of(8) {
            h.push(b' ');
        }
        let (file, f) = PendingFile::create(path)?;
        let mut out = BufWriter::with_capacity(1 << 22, f);
        out.write_all(&(h.len() as u64).to_le_bytes())
            .and_then(|_| out.write_all(&h))
            .map_err(|e| Error::io(file.tmp(), e))?;
        Ok(ShardWriter {
            out,
            file,
            specs,
            next: 0,
        })
    }

    /// Write the bytes of the next tensor (in spec order). A caller bug, not user input, if the
    /// size is off; reported as an error all the same.
    pub fn write_next(&mut self, bytes: &[u8]) -> Result<()> {
        let spec = self.specs.get(self.next).ok_or_else(|| {
            Error::bad_file(
                self.file.path(),
                "internal: more tensors written than declared",
            )
        })?;
        if bytes.len() != spec.nbytes() {
            return Err(Error::bad_tensor(
                self.file.path(),
                &spec.name,
                format!(
                    "internal: {} bytes written, {} declared",
                    bytes.len(),
                    spec.nbytes()
                ),
            ));
        }
        self.out
            .write_all(bytes)
            .map_err(|e| Error::io(self.file.tmp(), e))?;
        self.next += 1;
        Ok(())
    }

    /// The complete file, still under its temporary name. An unfinished writer, dropped,
    /// leaves nothing behind.
    pub fn complete(mut self) -> Result<PendingFile> {
        if self.next != self.specs.len() {
            return Err(Error::bad_file(
                self.file.path(),
                format!(
                    "internal: {} of {} tensors written",
                    self.next,
                    self.specs.len()
                ),
            ));
        }
        self.out
            .flush()
            .map_err(|e| Error::io(self.file.tmp(), e))?;
        Ok(self.file)
    }

    /// The complete file under its final name.
    pub fn finish(self) -> Result<()> {
        self.complete()?.commit()
    }
}

/// The files of one run that writes several, complete under their temporary names until
/// `commit` gives them their final names, in the order they were pushed. Dropped uncommitted
/// (an error on the way), it removes the temporaries and the directories the run created for
/// them: what was there before the run is as it was.
pub struct PendingOutput {
    files: Vec<PendingFile>,
    /// Directories that did not exist when the run began, innermost first.
    created_dirs: Vec<PathBuf>,
}

impl PendingOutput {
    /// Before anything is written into `dir`: notes which of `dir` and its ancestors the run
    /// will create.
    pub fn new(dir: &Path) -> PendingOutput {
        let created_dirs = dir
            .ancestors()
            .take_while(|d| !d.as_os_str().is_empty() && !d.exists())
            .map(Path::to_path_buf)
            .collect();
        PendingOutput {
            files: vec![],
            created_dirs,
        }
    }

    pub fn push(&mut self, file: PendingFile) {
        self.files.push(file);
    }

    /// Rename every file to its final name, in order. A failed rename stops there; the files
    /// not renamed yet are removed.
    pub fn commit(mut self) -> Result<()> {
        for f in std::mem::take(&mut self.files) {
            f.commit()?;
        }
        self.created_dirs.clear();
        Ok(())
    }
}

impl Drop for PendingOutput {
    fn drop(&mut self) {
        self.files.clear();
        // only empty ones go: a directory the run did put a final file into stays
        for d in &self.created_dirs {
            let _ = std::fs::remove_dir(d);
        }
    }
}

/// Write a whole small file at once: `(spec, bytes)` pairs.
pub fn write_file(
    path: &Path,
    tensors: Vec<(TensorSpec, Vec<u8>)>,
    metadata: Option<BTreeMap<String, String>>,
) -> Result<()> {
    let specs = tensors.iter().map(|(s, _)| s.clone()).collect();
    let mut w = ShardWriter::create(path, specs, metadata)?;
    for (_, b) in &tensors {
        w.write_next(b)?;
    }
    w.finish()
}

/// Little-endian bytes of f32 values.
pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// BF16 bytes of f32 values (round to nearest even).
pub fn bf16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
        .collect()
}

pub fn i64_bytes(v: &[i64]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::tmp_name;

    #[test]
    fn round_trip_through_the_safetensors_crate() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.safetensors");
        let x: Vec<f32> = (0..6).map(|i| i as f32 * 0.5 - 1.0).collect();
        write_file(
            &p,
            vec![
                (TensorSpec::new("x", Dtype::F32, &[2, 3]), f32_bytes(&x)),
                (
                    TensorSpec::new("s", Dtype::F8_E4M3, &[3]),
                    vec![0x38, 0x7E, 0x01],
                ),
                (TensorSpec::new("z", Dtype::F32, &[]), f32_bytes(&[0.25])),
            ],
            None,
        )
        .unwrap();
        let bytes = std::fs::read(&p).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let t = st.tensor("x").unwrap();
        assert_eq!(t.shape(), &[2, 3]);
        assert_eq!(t.data(), &f32_bytes(&x)[..]);
        assert_eq!(st.tensor("s").unwrap().dtype(), Dtype::F8_E4M3);
        assert_eq!(st.tensor("z").unwrap().shape(), &[] as &[usize]);
        assert!(!tmp_name(&p).exists());
    }

    #[test]
    fn an_unfinished_writer_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("b.safetensors");
        let mut w = ShardWriter::create(
            &p,
            vec![
                TensorSpec::new("a", Dtype::U8, &[4]),
                TensorSpec::new("b", Dtype::U8, &[4]),
            ],
            None,
        )
        .unwrap();
        w.write_next(&[1, 2, 3, 4]).unwrap();
        drop(w);
        assert!(!p.exists());
        assert!(!tmp_name(&p).exists());
    }

    #[test]
    fn pending_output_is_all_or_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("new").join("out");
        let names = ["a.safetensors", "b.safetensors"];
        let stage = || {
            let mut pending = PendingOutput::new(&out);
            for n in names {
                let mut w = ShardWriter::create(
                    &out.join(n),
                    vec![TensorSpec::new("x", Dtype::U8, &[2])],
                    None,
                )
                .unwrap();
                w.write_next(&[1, 2]).unwrap();
                pending.push(w.complete().unwrap());
                assert!(
                    !out.join(n).exists(),
                    "{n} under its final name before commit"
                );
            }
            pending
        };
        // an error before the commit: nothing of the run stays, not even the directories
        drop(stage());
        assert!(!dir.path().join("new").exists());
        stage().commit().unwrap();
        let mut left: Vec<_> = std::fs::read_dir(&out)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
            .collect();
        left.sort();
        assert_eq!(left, names);
    }
}
