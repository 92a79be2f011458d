//! One safetensors file, memory-mapped. The header is parsed and validated here, in full,
//! before any tensor is handed out: a damaged file must be exit 2 naming the file and the
//! tensor, never a panic or an out-of-bounds slice later on.
//!
//! Layout: `u64 little-endian N`, `N` bytes of JSON header, then the data area. The header maps
//! each tensor name to `{dtype, shape, data_offsets: [begin, end]}` relative to the data area,
//! plus an optional `__metadata__` string→string map. As in the reference implementation the
//! tensors must tile the data area exactly: no overlap, no gap, no trailing bytes.

use crate::error::{Error, Result};
use crate::nvfp4::e4m3;
use rayon::prelude::*;
use safetensors::Dtype;
use serde_json::Value;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

/// Headers beyond this are not safetensors headers but garbage in the length field (the
/// largest real ones, DeepSeek-V3 shards, are well under 1 MiB).
pub const MAX_HEADER: u64 = 100 << 20;

/// Where and what one tensor is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    /// `[begin, end)` relative to the start of the data area.
    pub data_offsets: (usize, usize),
}

impl TensorInfo {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    pub fn nbytes(&self) -> usize {
        self.data_offsets.1 - self.data_offsets.0
    }
}

/// Refuse a path that is a FIFO, socket or device: opening one blocks until a writer comes, or
/// reading it never ends (a file or a directory passes; what reads it says what is wrong).
pub fn not_special(path: &Path) -> Result<()> {
    match std::fs::metadata(path) {
        Ok(m) if m.is_file() || m.is_dir() => Ok(()),
        Ok(_) => Err(Error::bad_file(
            path,
            "not a regular file (a FIFO, socket or device): not read, since reading one may never end",
        )),
        Err(e) => Err(Error::io(path, e)),
    }
}

/// The bytes of the file at `path` ([`not_special`] first).
pub fn read_regular(path: &Path) -> Result<Vec<u8>> {
    not_special(path)?;
    std::fs::read(path).map_err(|e| Error::io(path, e))
}

/// A validated, memory-mapped safetensors file. Opened read-only; nothing is read into memory
/// until a tensor's bytes are touched.
pub struct TensorFile {
    path: PathBuf,
    map: memmap2::Mmap,
    data_start: usize,
    tensors: HashMap<String, TensorInfo>,
    /// Names in data order (ascending offsets), the order the file was written in.
    order: Vec<String>,
    metadata: BTreeMap<String, String>,
}

impl std::fmt::Debug for TensorFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TensorFile")
            .field("path", &self.path)
            .field("tensors", &self.order.len())
            .finish()
    }
}

/// The dtype spelled as in safetensors headers (`BF16`, `F8_E4M3`, ...).
pub fn parse_dtype(s: &str) -> Option<Dtype> {
    Some(match s {
        "BOOL" => Dtype::BOOL,
        "F4" => Dtype::F4,
        "F6_E2M3" => Dtype::F6_E2M3,
        "F6_E3M2" => Dtype::F6_E3M2,
        "U8" => Dtype::U8,
        "I8" => Dtype::I8,
        "F8_E5M2" => Dtype::F8_E5M2,
        "F8_E4M3" => Dtype::F8_E4M3,
        "F8_E8M0" => Dtype::F8_E8M0,
        "I16" => Dtype::I16,
        "U16" => Dtype::U16,
        "F16" => Dtype::F16,
        "BF16" => Dtype::BF16,
        "I32" => Dtype::I32,
        "U32" => Dtype::U32,
        "F32" => Dtype::F32,
        "F64" => Dtype::F64,
        "I64" => Dtype::I64,
        "U64" => Dtype::U64,
        _ => return None,
    })
}

/// Map the pages under `bytes` (a slice of a file map) in one call before a pass reads them
/// all, as [`TensorFile::prefetch`] does for a whole tensor: page faults one per few pages
/// cost more. Best effort (older kernels and other systems lack it); reads only.
pub fn populate(bytes: &[u8]) {
    #[cfg(target_os = "linux")]
    if !bytes.is_empty() {
        // SAFETY: sysconf has no preconditions
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(1) as usize;
        let start = bytes.as_ptr() as usize;
        let first = start - start % page;
        // SAFETY: the range covers only the pages holding `bytes`, all mapped; the advice
        // reads them in and changes nothing
        let _ = unsafe {
            libc::madvise(
                first as *mut libc::c_void,
                start + bytes.len() - first,
                libc::MADV_POPULATE_READ,
            )
        };
    }
}

/// Dtypes [`decode_f32_into`] reads.
pub fn is_float(d: Dtype) -> bool {
    matches!(
        d,
        Dtype::BF16 | Dtype::F16 | Dtype::F32 | Dtype::F64 | Dtype::F8_E4M3 | Dtype::F8_E5M2
    )
}

/// Bytes per element of a byte-aligned dtype (None for F4/F6).
pub fn elem_size(d: Dtype) -> Option<usize> {
    let b = d.bitsize();
    b.is_multiple_of(8).then_some(b / 8)
}

#[inline]
fn bf16_at(b: &[u8]) -> f32 {
    f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16)
}

/// Decode little-endian `bytes` of float dtype `d` into `out` (same element count). Returns
/// false for a dtype that is not a float or a length that does not fit; the caller names the
/// tensor in the error.
pub fn decode_f32_into(d: Dtype, bytes: &[u8], out: &mut [f32]) -> bool {
    let Some(sz) = elem_size(d) else {
        return false;
    };
    if !is_float(d) || bytes.len() != out.len() * sz {
        return false;
    }
    // Large tensors are split over the cores; each chunk is a plain loop the compiler vectorizes.
    const CHUNK: usize = 1 << 16;
    out.par_chunks_mut(CHUNK)
        .zip(bytes.par_chunks(CHUNK * sz))
        .for_each(|(o, b)| decode_row(d, b, o));
    true
}

/// The bytes as little-endian u16 values without copying, when they are 2-aligned (tensor data
/// in a mapped file almost always is) on a little-endian host: byte-wise reads defeat
/// vectorization on the hot paths.
pub fn as_u16s(b: &[u8]) -> Option<&[u16]> {
    if cfg!(target_endian = "big") {
        return None;
    }
    // SAFETY: every bit pattern is a valid u16; align_to only hands out the aligned middle
    let (pre, mid, post) = unsafe { b.align_to::<u16>() };
    (pre.is_empty() && post.is_empty()).then_some(mid)
}

/// As [`as_u16s`], for u32 values.
pub fn as_u32s(b: &[u8]) -> Option<&[u32]> {
    if cfg!(target_endian = "big") {
        return None;
    }
    // SAFETY: as in as_u16s
    let (pre, mid, post) = unsafe { b.align_to::<u32>() };
    (pre.is_empty() && post.is_empty()).then_some(mid)
}

/// Sequential decode of a float dtype's bytes into `o` (no checks: the caller matched the
/// lengths; an unsupported dtype leaves `o` as it was).
pub fn decode_row(d: Dtype, b: &[u8], o: &mut [f32]) {
    match d {
        Dtype::BF16 => match as_u16s(b) {
            Some(h) => o
                .iter_mut()
                .zip(h)
                .for_each(|(o, &h)| *o = f32::from_bits((h as u32) << 16)),
            None => o
                .iter_mut()
                .zip(b.chunks_exact(2))
                .for_each(|(o, b)| *o = bf16_at(b)),
        },
        Dtype::F16 => o
            .iter_mut()
            .zip(b.chunks_exact(2))
            .for_each(|(o, b)| *o = half::f16::from_le_bytes([b[0], b[1]]).to_f32()),
        Dtype::F32 => o
            .iter_mut()
            .zip(b.chunks_exact(4))
            .for_each(|(o, b)| *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        Dtype::F64 => o.iter_mut().zip(b.chunks_exact(8)).for_each(|(o, b)| {
            let mut a = [0u8; 8];
            a.copy_from_slice(b);
            *o = f64::from_le_bytes(a) as f32
        }),
        Dtype::F8_E4M3 => o.iter_mut().zip(b).for_each(|(o, &c)| *o = e4m3::decode(c)),
        // E5M2 is the top byte of an F16
        Dtype::F8_E5M2 => o
            .iter_mut()
            .zip(b)
            .for_each(|(o, &c)| *o = half::f16::from_bits((c as u16) << 8).to_f32()),
        _ => {}
    }
}

impl TensorFile {
    /// Open and validate `path`. Errors name the file and, where there is one, the tensor.
    pub fn open(path: &Path) -> Result<TensorFile> {
        not_special(path)?;
        let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        let meta = file.metadata().map_err(|e| Error::io(path, e))?;
        if meta.is_dir() {
            return Err(Error::bad_file(
                path,
                "is a directory, not a safetensors file",
            ));
        }
        let len = meta.len();
        if len == 0 {
            return Err(Error::bad_file(
                path,
                "empty file (0 bytes): not a safetensors file",
            ));
        }
        if len < 8 {
            return Err(Error::bad_file(
                path,
                format!("truncated: {len} bytes, shorter than the 8-byte header length"),
            ));
        }
        // SAFETY: the map is read-only and private to this process. A file truncated by
        // another process while mapped would fault; that is the usual mmap caveat and the
        // price of not reading whole shards (DESIGN.md §3).
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        let mut n8 = [0u8; 8];
        n8.copy_from_slice(&map[..8]);
        let n = u64::from_le_bytes(n8);
        if n > MAX_HEADER {
            return Err(Error::bad_file(
                path,
                format!(
                    "header length {n} is absurd (more than {MAX_HEADER} bytes): not a safetensors file, or a damaged one"
                ),
            ));
        }
        if 8 + n > len {
            return Err(Error::bad_file(
                path,
                format!(
                    "header length {n} runs past the end of the file ({len} bytes): truncated or not a safetensors file"
                ),
            ));
        }
        let data_start = 8 + n as usize;
        let header = &map[8..data_start];
        let data_len = map.len() - data_start;
        let (tensors, order, metadata) = parse_header(path, header, data_len)?;
        Ok(TensorFile {
            path: path.to_path_buf(),
            map,
            data_start,
            tensors,
            order,
            metadata,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Tensor names in data order.
    pub fn names(&self) -> impl ExactSizeIterator<Item = &str> + '_ {
        self.order.iter().map(|s| s.as_str())
    }

    pub fn len(&self) -> usize {
        self.order.len()
    }

    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    pub fn get(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.get(name)
    }

    /// The stored name with its info: a borrow of the name that lives as long as the file.
    pub fn get_key_value(&self, name: &str) -> Option<(&str, &TensorInfo)> {
        self.tensors
            .get_key_value(name)
            .map(|(k, v)| (k.as_str(), v))
    }

    /// dtype and shape of `name`; missing is bad input naming the file and the tensor.
    pub fn info(&self, name: &str) -> Result<&TensorInfo> {
        self.tensors
            .get(name)
            .ok_or_else(|| Error::bad_tensor(&self.path, name, "no such tensor in this file"))
    }

    /// The raw little-endian bytes of `name`, straight from the map (no copy).
    pub fn bytes(&self, name: &str) -> Result<&[u8]> {
        let t = self.info(name)?;
        Ok(self.slice(t))
    }

    /// The bytes of a tensor whose info came from this file.
    pub fn slice(&self, t: &TensorInfo) -> &[u8] {
        // offsets were checked against the data length in `open`
        &self.map[self.data_start + t.data_offsets.0..self.data_start + t.data_offsets.1]
    }

    /// `name` as f32: BF16, F16, F32, F64 and FP8 (E4M3, E5M2) are read; other dtypes are bad
    /// input naming the tensor.
    pub fn to_f32(&self, name: &str) -> Result<Vec<f32>> {
        self.to_f32_prefix(name, usize::MAX)
    }

    /// The first `n` elements of `name` as f32 (`to_f32` of a prefix): only those bytes are
    /// decoded, so a huge tensor of which a few rows are used is never read whole.
    pub fn to_f32_prefix(&self, name: &str, n: usize) -> Result<Vec<f32>> {
        let t = self.info(name)?;
        let n = n.min(t.numel());
        let bytes = self.slice(t);
        let len = elem_size(t.dtype).map_or(bytes.len(), |sz| n * sz);
        let mut out = vec![0f32; n];
        if !decode_f32_into(t.dtype, &bytes[..len.min(bytes.len())], &mut out) {
            return Err(Error::bad_tensor(
                &self.path,
                name,
                format!(
                    "dtype {:?} is not a floating dtype this tool reads (BF16, F16, F32, F64, F8_E4M3, F8_E5M2)",
                    t.dtype
                ),
            ));
        }
        Ok(out)
    }

    /// A one-element float tensor (shape `[]`, `[1]`, `[1, 1]`, ...) as f32.
    pub fn scalar_f32(&self, name: &str) -> Result<f32> {
        let t = self.info(name)?;
        if t.numel() != 1 {
            return Err(Error::bad_tensor(
                &self.path,
                name,
                format!("expected a scalar, found shape {:?}", t.shape),
            ));
        }
        Ok(self.to_f32(name)?[0])
    }

    /// An integer tensor (I64, I32, I16, I8, U8, U16, U32) as i64; U64 values beyond i64 are
    /// bad input.
    pub fn to_i64(&self, name: &str) -> Result<Vec<i64>> {
        let t = self.info(name)?;
        let b = self.slice(t);
        if t.dtype == Dtype::U64 {
            if let Some(u) = b
                .chunks_exact(8)
                .map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
                .find(|&u| i64::try_from(u).is_err())
            {
                return Err(Error::bad_tensor(
                    &self.path,
                    name,
                    format!("U64 value {u} overflows i64"),
                ));
            }
        }
        decode_ints(t.dtype, b).ok_or_else(|| {
            Error::bad_tensor(
                &self.path,
                name,
                format!("dtype {:?} is not an integer dtype", t.dtype),
            )
        })
    }

    /// The `__metadata__` map (empty when the file has none).
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.metadata
    }

    /// Bytes of the whole file.
    pub fn file_len(&self) -> usize {
        self.map.len()
    }

    /// Map a tensor's pages in one call before a scan touches them all: one page fault per few
    /// pages costs more than the scan itself. Best effort (older kernels lack it).
    pub fn prefetch(&self, t: &TensorInfo) {
        #[cfg(target_os = "linux")]
        if t.nbytes() > 0 {
            let _ = self.map.advise_range(
                memmap2::Advice::PopulateRead,
                self.data_start + t.data_offsets.0,
                t.nbytes(),
            );
        }
    }

    /// Drop this process's mapping of a tensor's pages once it is done with (the page cache keeps
    /// them; a later access maps them again): a scan over a large shard then holds about one
    /// tensor's pages, not the whole shard's.
    pub fn release(&self, t: &TensorInfo) {
        self.drop_pages(self.data_start + t.data_offsets.0, t.nbytes());
    }

    /// [`release`](Self::release) for a part of a tensor (a fused tensor's slice that one
    /// comparison read): only the pages wholly inside `bytes`, and nothing unless `bytes` lies
    /// in this file's map.
    pub fn release_bytes(&self, bytes: &[u8]) {
        let (start, map) = (bytes.as_ptr() as usize, self.map.as_ptr() as usize);
        if start >= map && start + bytes.len() <= map + self.map.len() {
            self.drop_pages(start - map, bytes.len());
        }
    }

    /// MADV_DONTNEED on the whole pages of `[off, off + len)` of the map.
    fn drop_pages(&self, off: usize, len: usize) {
        #[cfg(unix)]
        {
            // SAFETY: sysconf has no preconditions
            let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(1) as usize;
            let (first, end) = (off.next_multiple_of(page), (off + len) / page * page);
            if end > first {
                // SAFETY: the map is read-only and file-backed: after MADV_DONTNEED the pages
                // read back the same file contents, so no live slice observes a change.
                let _ = unsafe {
                    self.map.unchecked_advise_range(
                        memmap2::UncheckedAdvice::DontNeed,
                        first,
                        end - first,
                    )
                };
            }
        }
    }

    /// For a command that reads (nearly) every byte, as compare-weights does: pages read in
    /// through this map then come in 2 MiB folios, which later maps of the file (this run's,
    /// the next run's) take one PMD each. Mapping page cache held in small folios cost 0.35-0.5
    /// s of system time on a 6.3 GB pair that took 0.05 s in large ones; pages already cached
    /// stay as they are. Not for sparse readers (`audit` reads the scales and a few code pages
    /// of each tensor): a fault would read 2 MiB, against a read-ahead window of 128 KiB by
    /// default. Best effort.
    pub fn advise_whole_reads(&self) {
        #[cfg(target_os = "linux")]
        let _ = self.map.advise(memmap2::Advice::HugePage);
    }

    /// Ask the kernel to read ahead: for a scan that touches every tensor once in data order.
    pub fn advise_sequential(&self) {
        #[cfg(unix)]
        let _ = self.map.advise(memmap2::Advice::Sequential);
    }
}

type Parsed = (
    HashMap<String, TensorInfo>,
    Vec<String>,
    BTreeMap<String, String>,
);

fn parse_header(path: &Path, header: &[u8], data_len: usize) -> Result<Parsed> {
    if header.first() != Some(&b'{') {
        let what = if header.is_empty() {
            "header is empty (length 0): not a safetensors file".to_string()
        } else {
            "header is not a JSON object (does not start with `{`): not a safetensors file, or a damaged one"
                .to_string()
        };
        return Err(Error::bad_file(path, what));
    }
    // Entries are validated as they stream in, so a header of a million tensors costs a
    // TensorInfo each, not a whole JSON tree (about 1.5 KB per tensor) at once.
    let entry_err = std::cell::RefCell::new(None);
    let mut de = serde_json::Deserializer::from_slice(header);
    let parsed = serde::Deserializer::deserialize_map(
        &mut de,
        HeaderVisitor {
            path,
            err: &entry_err,
        },
    )
    .and_then(|v| de.end().map(|_| v));
    let (tensors, metadata) = match (parsed, entry_err.into_inner()) {
        (_, Some(e)) => return Err(e),
        (Ok(v), None) => v,
        (Err(e), None) => {
            return Err(Error::bad_file(
                path,
                format!("header is not valid JSON ({e}): a damaged safetensors file"),
            ))
        }
    };
    // The tensors must tile [0, data_len) exactly.
    let mut order: Vec<(&String, &TensorInfo)> = tensors.iter().collect();
    order.sort_by(|a, b| {
        (a.1.data_offsets.0, a.1.data_offsets.1, a.0).cmp(&(
            b.1.data_offsets.0,
            b.1.data_offsets.1,
            b.0,
        ))
    });
    // Past the end first: a tensor placed there also leaves a gap where it belonged, which
    // would otherwise be blamed on the next tensor.
    if let Some((name, t)) = order.iter().find(|(_, t)| t.data_offsets.1 > data_len) {
        let (b, e) = t.data_offsets;
        return Err(Error::bad_tensor(
            path,
            name,
            format!(
                "data_offsets [{b}, {e}] run past the end of the data ({data_len} bytes after the header): truncated file?"
            ),
        ));
    }
    let mut at = 0usize;
    let mut prev: Option<&str> = None;
    for (name, t) in &order {
        let (b, e) = t.data_offsets;
        if b < at {
            let other = prev.unwrap_or("?");
            return Err(Error::bad_tensor(
                path,
                name,
                format!("data_offsets [{b}, {e}] overlap tensor `{other}` (which ends at {at})"),
            ));
        }
        if b > at {
            return Err(Error::bad_tensor(
                path,
                name,
                format!(
                    "data_offsets [{b}, {e}] leave a gap of {} bytes after {} (the data area must be tiled exactly)",
                    b - at,
                    prev.map(|p| format!("tensor `{p}`"))
                        .unwrap_or_else(|| "the header".into())
                ),
            ));
        }
        at = e;
        prev = Some(name.as_str());
    }
    if at != data_len {
        return Err(Error::bad_file(
            path,
            format!(
                "{} bytes after the last tensor's data (the tensors cover {at} of {data_len} data bytes): damaged or not a safetensors file",
                data_len - at
            ),
        ));
    }
    let order: Vec<String> = order.into_iter().map(|(n, _)| n.clone()).collect();
    Ok((tensors, order, metadata))
}

struct HeaderVisitor<'a> {
    path: &'a Path,
    /// The first bad entry; the visitor aborts the parse with a placeholder serde error.
    err: &'a std::cell::RefCell<Option<Error>>,
}

impl<'de> serde::de::Visitor<'de> for HeaderVisitor<'_> {
    type Value = (HashMap<String, TensorInfo>, BTreeMap<String, String>);

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON object of tensor entries")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(
        self,
        mut m: A,
    ) -> std::result::Result<Self::Value, A::Error> {
        let path = self.path;
        let mut tensors = HashMap::new();
        let mut metadata = BTreeMap::new();
        while let Some(name) = m.next_key::<String>()? {
            let v: Value = m.next_value()?;
            let r = if name == "__metadata__" {
                parse_metadata(path, &v).map(|md| metadata = md)
            } else {
                parse_entry(path, &name, &v).and_then(|info| match tensors.entry(name) {
                    std::collections::hash_map::Entry::Occupied(e) => Err(Error::bad_tensor(
                        path,
                        e.key(),
                        "named twice in the header: readers disagree on which entry holds its data (most keep the last, some the first)",
                    )),
                    std::collections::hash_map::Entry::Vacant(e) => {
                        e.insert(info);
                        Ok(())
                    }
                })
            };
            if let Err(e) = r {
                *self.err.borrow_mut() = Some(e);
                return Err(serde::de::Error::custom("bad header entry"));
            }
        }
        Ok((tensors, metadata))
    }
}

fn parse_metadata(path: &Path, v: &Value) -> Result<BTreeMap<String, String>> {
    let obj = v.as_object().ok_or_else(|| {
        Error::bad_file(path, "`__metadata__` in the header is not a JSON object")
    })?;
    let mut metadata = BTreeMap::new();
    for (k, v) in obj {
        let s = v.as_str().ok_or_else(|| {
            Error::bad_file(
                path,
                format!(
                    "`__metadata__.{k}` is not a string (safetensors metadata is string → string)"
                ),
            )
        })?;
        metadata.insert(k.clone(), s.to_string());
    }
    Ok(metadata)
}

fn parse_entry(path: &Path, name: &str, v: &Value) -> Result<TensorInfo> {
    let bad = |what: String| Error::bad_tensor(path, name, what);
    let obj = v
        .as_object()
        .ok_or_else(|| bad("header entry is not a JSON object".into()))?;
    let dtype_s = obj
        .get("dtype")
        .ok_or_else(|| bad("header entry has no `dtype`".into()))?
        .as_str()
        .ok_or_else(|| bad("`dtype` is not a string".into()))?;
    let dtype = parse_dtype(dtype_s).ok_or_else(|| bad(format!("unknown dtype `{dtype_s}`")))?;
    let shape_v = obj
        .get("shape")
        .ok_or_else(|| bad("header entry has no `shape`".into()))?
        .as_array()
        .ok_or_else(|| bad("`shape` is not an array".into()))?;
    let mut shape = Vec::with_capacity(shape_v.len());
    for d in shape_v {
        let d = d
            .as_u64()
            .and_then(|d| usize::try_from(d).ok())
            .ok_or_else(|| {
                bad(format!(
                    "`shape` {} holds a non-integer or negative dim",
                    serde_json::Value::from(shape_v.clone())
                ))
            })?;
        shape.push(d);
    }
    let offs = obj
        .get("data_offsets")
        .ok_or_else(|| bad("header entry has no `data_offsets`".into()))?
        .as_array()
        .filter(|a| a.len() == 2)
        .ok_or_else(|| bad("`data_offsets` is not a pair [begin, end]".into()))?;
    let off = |i: usize| {
        offs[i]
            .as_u64()
            .and_then(|d| usize::try_from(d).ok())
            .ok_or_else(|| {
                bad(format!(
                    "`data_offsets` {offs:?} are not non-negative integers"
                ))
            })
    };
    let (b, e) = (off(0)?, off(1)?);
    if b > e {
        return Err(bad(format!(
            "data_offsets [{b}, {e}] are reversed (begin > end)"
        )));
    }
    let numel = shape
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(|| bad(format!("shape {shape:?} overflows")))?;
    let bits = numel
        .checked_mul(dtype.bitsize())
        .ok_or_else(|| bad(format!("shape {shape:?} overflows")))?;
    if !bits.is_multiple_of(8) {
        return Err(bad(format!(
            "{numel} elements of {dtype:?} are not a whole number of bytes"
        )));
    }
    if bits / 8 != e - b {
        return Err(bad(format!(
            "holds {} bytes (data_offsets [{b}, {e}]) but {dtype:?} {shape:?} needs {}",
            e - b,
            bits / 8
        )));
    }
    Ok(TensorInfo {
        dtype,
        shape,
        data_offsets: (b, e),
    })
}

/// Little-endian integers of `dtype` (I64, I32, I16, I8, U64, U32, U16, U8) as i64, a U64
/// past `i64::MAX` wrapped; `None` for any other dtype.
pub fn decode_ints(dtype: Dtype, b: &[u8]) -> Option<Vec<i64>> {
    let v = match dtype {
        Dtype::I64 | Dtype::U64 => b
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
            .collect(),
        Dtype::I32 => b
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64)
            .collect(),
        Dtype::U32 => b
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64)
            .collect(),
        Dtype::I16 => b
            .chunks_exact(2)
            .map(|c| i16::from_le_bytes([c[0], c[1]]) as i64)
            .collect(),
        Dtype::U16 => b
            .chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]) as i64)
            .collect(),
        Dtype::I8 => b.iter().map(|&c| c as i8 as i64).collect(),
        Dtype::U8 => b.iter().map(|&c| c as i64).collect(),
        _ => return None,
    };
    Some(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::writer::{bf16_bytes, f32_bytes, write_file, TensorSpec};
    use rand::{Rng, SeedableRng};

    /// Build a file from a raw header and data area.
    fn raw(dir: &Path, name: &str, header: &str, data: &[u8]) -> PathBuf {
        let p = dir.join(name);
        let mut b = (header.len() as u64).to_le_bytes().to_vec();
        b.extend_from_slice(header.as_bytes());
        b.extend_from_slice(data);
        std::fs::write(&p, b).unwrap();
        p
    }

    fn err_of(p: &Path) -> String {
        TensorFile::open(p).unwrap_err().to_string()
    }

    /// Every integer dtype reads back its values as i64; a U64 past i64 is bad input naming
    /// the tensor; a float tensor is not read as integers.
    #[test]
    fn integer_tensors_read_as_i64() {
        let seed: u64 = rand::random();
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("ids.safetensors");
        let v: Vec<i64> = (0..7).map(|_| r.gen_range(-100..100)).collect();
        let u: Vec<i64> = v.iter().map(|x| x.abs()).collect();
        let bytes = |w: usize, v: &[i64]| -> Vec<u8> {
            v.iter()
                .flat_map(|x| x.to_le_bytes()[..w].to_vec())
                .collect()
        };
        let mut t = vec![];
        for (d, w) in [
            (Dtype::I64, 8),
            (Dtype::I32, 4),
            (Dtype::I16, 2),
            (Dtype::I8, 1),
        ] {
            t.push((TensorSpec::new(format!("{d:?}"), d, &[7]), bytes(w, &v)));
        }
        for (d, w) in [
            (Dtype::U64, 8),
            (Dtype::U32, 4),
            (Dtype::U16, 2),
            (Dtype::U8, 1),
        ] {
            t.push((TensorSpec::new(format!("{d:?}"), d, &[7]), bytes(w, &u)));
        }
        let mut big = bytes(8, &u);
        big[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        t.push((TensorSpec::new("big", Dtype::U64, &[7]), big));
        t.push((TensorSpec::new("f", Dtype::F32, &[7]), f32_bytes(&[1.5; 7])));
        write_file(&p, t, None).unwrap();
        let f = TensorFile::open(&p).unwrap();
        for d in ["I64", "I32", "I16", "I8"] {
            assert_eq!(f.to_i64(d).unwrap(), v, "seed {seed} {d}");
        }
        for d in ["U64", "U32", "U16", "U8"] {
            assert_eq!(f.to_i64(d).unwrap(), u, "seed {seed} {d}");
        }
        let e = f.to_i64("big").unwrap_err().to_string();
        assert!(e.contains("big") && e.contains("overflows i64"), "{e}");
        assert!(f
            .to_i64("f")
            .unwrap_err()
            .to_string()
            .contains("not an integer dtype"));
    }

    /// Releasing or populating part of a tensor (whole pages of it, several pages here) changes
    /// no byte, in the file or as read back; a slice of another buffer is left alone.
    #[test]
    fn released_and_populated_pages_read_back_the_same() {
        let seed: u64 = rand::random();
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("w.safetensors");
        let data: Vec<u8> = (0..5 * 4096 + r.gen_range(1..4096))
            .map(|_| r.gen())
            .collect();
        let n = data.len();
        write_file(
            &p,
            vec![(TensorSpec::new("w", Dtype::U8, &[n]), data.clone())],
            None,
        )
        .unwrap();
        let on_disk = std::fs::read(&p).unwrap();
        let f = TensorFile::open(&p).unwrap();
        let w = f.bytes("w").unwrap();
        assert_eq!(w, &data[..], "seed {seed}");
        let (a, b) = (r.gen_range(0..n / 3), r.gen_range(2 * n / 3..n));
        populate(&w[a..b]);
        f.release_bytes(&w[a..b]);
        assert_eq!(w, &data[..], "seed {seed}: after releasing [{a}, {b})");
        // a heap buffer is not this file's map: releasing it must not zero it
        let heap = data.clone();
        f.release_bytes(&heap);
        assert_eq!(heap, data);
        f.release(f.info("w").unwrap());
        assert_eq!(w, &data[..], "seed {seed}: after releasing the tensor");
        drop(f);
        assert_eq!(
            std::fs::read(&p).unwrap(),
            on_disk,
            "the file is never modified"
        );
    }

    #[test]
    fn reads_what_the_writer_wrote() {
        let seed: u64 = rand::random();
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.safetensors");
        // at least 2 rows: x.f32 must not be a scalar (scalar_f32 refuses it below)
        let (rows, cols) = (r.gen_range(2..40), r.gen_range(1..70));
        let x: Vec<f32> = (0..rows * cols)
            .map(|_| r.gen_range(-3.0f32..3.0))
            .collect();
        let xb: Vec<f32> = x
            .iter()
            .map(|&v| half::bf16::from_f32(v).to_f32())
            .collect();
        let xh: Vec<f32> = x.iter().map(|&v| half::f16::from_f32(v).to_f32()).collect();
        let fp8: Vec<u8> = (0..cols).map(|_| r.gen_range(0..=255u8)).collect();
        let ids: Vec<i64> = (0..cols).map(|_| r.gen_range(-5..1000)).collect();
        let mut meta = BTreeMap::new();
        meta.insert("rank".to_string(), "3".to_string());
        write_file(
            &p,
            vec![
                (
                    TensorSpec::new("x.f32", Dtype::F32, &[rows, cols]),
                    f32_bytes(&x),
                ),
                (
                    TensorSpec::new("x.bf16", Dtype::BF16, &[rows, cols]),
                    bf16_bytes(&x),
                ),
                (
                    TensorSpec::new("x.f16", Dtype::F16, &[rows, cols]),
                    xh.iter()
                        .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
                        .collect(),
                ),
                (TensorSpec::new("s", Dtype::F8_E4M3, &[cols]), fp8.clone()),
                (
                    TensorSpec::new("ids", Dtype::I64, &[cols]),
                    ids.iter().flat_map(|v| v.to_le_bytes()).collect(),
                ),
                (TensorSpec::new("one", Dtype::F32, &[]), f32_bytes(&[0.125])),
                (TensorSpec::new("empty", Dtype::BF16, &[0, 7]), vec![]),
            ],
            Some(meta),
        )
        .unwrap();
        let f = TensorFile::open(&p).unwrap();
        assert_eq!(f.len(), 7, "seed {seed}");
        assert_eq!(f.names().next(), Some("x.f32"), "data order");
        assert_eq!(f.to_f32("x.f32").unwrap(), x, "seed {seed}");
        assert_eq!(f.to_f32("x.bf16").unwrap(), xb, "seed {seed}");
        assert_eq!(f.to_f32("x.f16").unwrap(), xh, "seed {seed}");
        let s = f.to_f32("s").unwrap();
        for (a, &c) in s.iter().zip(&fp8) {
            assert!(a.to_bits() == e4m3::decode(c).to_bits() || (a.is_nan() && e4m3::is_nan(c)));
        }
        assert_eq!(f.to_i64("ids").unwrap(), ids);
        assert_eq!(f.scalar_f32("one").unwrap(), 0.125);
        assert_eq!(f.info("x.bf16").unwrap().shape, vec![rows, cols]);
        assert_eq!(f.info("empty").unwrap().numel(), 0);
        assert_eq!(f.metadata().get("rank").map(|s| s.as_str()), Some("3"));
        assert!(f
            .scalar_f32("x.f32")
            .unwrap_err()
            .to_string()
            .contains("x.f32"));
        assert!(f.to_f32("ids").unwrap_err().to_string().contains("`ids`"));
        assert!(f.bytes("nope").unwrap_err().to_string().contains("nope"));
    }

    #[test]
    fn damaged_files_name_file_and_tensor() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let ok = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#;

        std::fs::write(d.join("empty.safetensors"), b"").unwrap();
        assert!(err_of(&d.join("empty.safetensors")).contains("empty"));

        std::fs::write(d.join("short.safetensors"), [1u8, 2, 3]).unwrap();
        assert!(err_of(&d.join("short.safetensors")).contains("truncated"));

        let mut b = 1000u64.to_le_bytes().to_vec();
        b.extend_from_slice(b"{}");
        std::fs::write(d.join("past.safetensors"), &b).unwrap();
        assert!(err_of(&d.join("past.safetensors")).contains("past the end"));

        let b = (u64::MAX - 3).to_le_bytes().to_vec();
        std::fs::write(d.join("huge.safetensors"), &b).unwrap();
        assert!(err_of(&d.join("huge.safetensors")).contains("absurd"));

        let p = raw(d, "nojson.safetensors", "hello world", &[]);
        assert!(err_of(&p).contains("not a JSON"));
        let p = raw(d, "badjson.safetensors", "{\"a\": [1, 2", &[]);
        assert!(err_of(&p).contains("not valid JSON"));

        let p = raw(d, "dtype.safetensors", &ok.replace("F32", "F33"), &[0; 8]);
        let e = err_of(&p);
        assert!(
            e.contains("unknown dtype `F33`") && e.contains("`a`"),
            "{e}"
        );

        let p = raw(d, "trunc.safetensors", ok, &[0; 5]);
        let e = err_of(&p);
        assert!(
            e.contains("past the end of the data") && e.contains("`a`"),
            "{e}"
        );

        let p = raw(d, "count.safetensors", &ok.replace("[2]", "[3]"), &[0; 8]);
        let e = err_of(&p);
        assert!(e.contains("needs 12") && e.contains("`a`"), "{e}");

        let two = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#;
        let p = raw(d, "overlap.safetensors", two, &[0; 12]);
        let e = err_of(&p);
        assert!(
            e.contains("overlap") && e.contains("`b`") && e.contains("`a`"),
            "{e}"
        );

        let rev = r#"{"a":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}}"#;
        let p = raw(d, "rev.safetensors", rev, &[0; 8]);
        assert!(err_of(&p).contains("reversed"));

        let gap = r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#;
        let p = raw(d, "gap.safetensors", gap, &[0; 8]);
        assert!(err_of(&p).contains("gap"));

        let p = raw(d, "trail.safetensors", ok, &[0; 9]);
        assert!(err_of(&p).contains("after the last tensor"));

        let neg = r#"{"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}}"#;
        let p = raw(d, "neg.safetensors", neg, &[0; 8]);
        // the shape as the header spells it, not Rust's `[Number(-2)]`
        let e = err_of(&p);
        assert!(
            e.contains("`shape` [-2] holds a non-integer or negative"),
            "{e}"
        );

        let meta = r#"{"__metadata__":{"a":1}}"#;
        let p = raw(d, "meta.safetensors", meta, &[]);
        assert!(err_of(&p).contains("__metadata__"));

        assert!(err_of(d).contains("directory"));
        for e in ["empty", "short", "past", "huge"] {
            assert!(
                err_of(&d.join(format!("{e}.safetensors"))).contains(&format!("{e}.safetensors"))
            );
        }
    }
}
