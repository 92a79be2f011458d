//! Writing safetensors files that may be larger than memory: the header is written from the
//! tensor specs first, then each tensor's bytes in order. The file appears under its final
//! name only when complete (temporary name + rename).

use crate::error::{Error, Result};
use crate::report::tmp_name;
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
    path: PathBuf,
    tmp: PathBuf,
    out: BufWriter<std::fs::File>,
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
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
        }
        let tmp = tmp_name(path);
        let f = std::fs::File::create(&tmp).map_err(|e| Error::io(&tmp, e))?;
        let mut out = BufWriter::with_capacity(1 << 22, f);
        out.write_all(&(h.len() as u64).to_le_bytes())
            .and_then(|_| out.write_all(&h))
            .map_err(|e| Error::io(&tmp, e))?;
        Ok(ShardWriter {
            path: path.to_path_buf(),
            tmp,
            out,
            specs,
            next: 0,
        })
    }

    /// Write the bytes of the next tensor (in spec order). A caller bug, not user input, if the
    /// size is off; reported as an error all the same.
    pub fn write_next(&mut self, bytes: &[u8]) -> Result<()> {
        let spec = self.specs.get(self.next).ok_or_else(|| {
            Error::bad_file(&self.path, "internal: more tensors written than declared")
        })?;
        if bytes.len() != spec.nbytes() {
            return Err(Error::bad_tensor(
                &self.path,
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
            .map_err(|e| Error::io(&self.tmp, e))?;
        self.next += 1;
        Ok(())
    }

    pub fn finish(mut self) -> Result<()> {
        if self.next != self.specs.len() {
            return Err(Error::bad_file(
                &self.path,
                format!(
                    "internal: {} of {} tensors written",
                    self.next,
                    self.specs.len()
                ),
            ));
        }
        self.out.flush().map_err(|e| Error::io(&self.tmp, e))?;
        std::fs::rename(&self.tmp, &self.path).map_err(|e| Error::io(&self.path, e))
    }
}

impl Drop for ShardWriter {
    fn drop(&mut self) {
        // an unfinished writer leaves nothing behind
        if self.tmp.exists() {
            let _ = std::fs::remove_file(&self.tmp);
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
}
