//! One trace file: a memory-mapped safetensors file whose header is validated before any tensor
//! is touched, so a truncated or lying file is reported by name instead of read past its end.

use crate::checkpoint::TensorFile;
use crate::error::Result;
use safetensors::Dtype;
use std::collections::BTreeMap;
use std::path::Path;

/// What a tensor is to the module call it was recorded from (DESIGN.md §5 names).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Role {
    /// `input.N`
    Input(usize),
    /// `output` (0) or `output.N`
    Output(usize),
    /// Any other name: kept, scanned, never used to decide who produced a value.
    Other,
}

/// The role a tensor name plays.
pub fn role(name: &str) -> Role {
    if name == "output" {
        return Role::Output(0);
    }
    let numbered = |prefix: &str| {
        name.strip_prefix(prefix)
            .filter(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|n| n.parse::<usize>().ok())
    };
    if let Some(n) = numbered("output.") {
        Role::Output(n)
    } else if let Some(n) = numbered("input.") {
        Role::Input(n)
    } else {
        Role::Other
    }
}

pub struct TraceFile {
    /// The checkpoint reader's validated map: its header parser streams entries, so a header
    /// of a million tensors costs their `TensorInfo`s, not a JSON tree of them.
    file: TensorFile,
    /// Names in recording order: inputs, outputs (by number), then anything else by name.
    order: Vec<String>,
}

/// A view of one tensor's bytes inside a mapped trace file.
#[derive(Clone, Copy, Debug)]
pub struct TensorRef<'a> {
    pub name: &'a str,
    pub dtype: Dtype,
    pub shape: &'a [usize],
    data: &'a [u8],
}

impl TraceFile {
    /// Map and validate: header length, JSON, offsets tiling the data section and ending
    /// exactly at the end of the file, sizes matching shape × dtype. Tensor bytes are not read.
    pub fn open(path: &Path) -> Result<TraceFile> {
        let file = TensorFile::open(path)?;
        let mut order: Vec<String> = file.names().map(str::to_string).collect();
        order.sort_by(|a, b| (role(a), a).cmp(&(role(b), b)));
        Ok(TraceFile { file, order })
    }

    pub fn path(&self) -> &Path {
        self.file.path()
    }

    /// The `__metadata__` map (empty when absent).
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        self.file.metadata()
    }

    /// All tensors in recording order: `input.*`, `output`, `output.*`, then other names.
    pub fn tensors(&self) -> impl Iterator<Item = TensorRef<'_>> {
        self.order.iter().filter_map(|n| self.view(n))
    }

    pub fn tensor(&self, name: &str) -> Option<TensorRef<'_>> {
        self.view(name)
    }

    fn view<'a>(&'a self, name: &str) -> Option<TensorRef<'a>> {
        let (name, info) = self.file.get_key_value(name)?;
        Some(TensorRef {
            name,
            dtype: info.dtype,
            shape: &info.shape,
            // offsets were checked against the data area by `TensorFile::open`
            data: self.file.slice(info),
        })
    }
}

/// Dtypes a NaN or Inf can live in, all converted to f32 for scanning (finite f64 values beyond
/// the f32 range saturate to ±f32::MAX, so only a real NaN/Inf is reported as one).
pub fn is_float(dtype: Dtype) -> bool {
    matches!(
        dtype,
        Dtype::F64 | Dtype::F32 | Dtype::F16 | Dtype::BF16 | Dtype::F8_E4M3 | Dtype::F8_E5M2
    )
}

impl<'a> TensorRef<'a> {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn is_float(&self) -> bool {
        is_float(self.dtype)
    }

    /// The tensor's bytes as stored (little-endian).
    pub fn raw(&self) -> &'a [u8] {
        self.data
    }

    /// F32 values made here rather than read from a file (`data`: their little-endian bytes).
    pub fn f32_view(name: &'a str, shape: &'a [usize], data: &'a [u8]) -> TensorRef<'a> {
        debug_assert_eq!(data.len(), 4 * shape.iter().product::<usize>());
        TensorRef {
            name,
            dtype: Dtype::F32,
            shape,
            data,
        }
    }

    /// Every element as an integer, for the integer and bool dtypes (ids, masks, positions);
    /// `None` for any other dtype. A U64 past `i64::MAX` wraps: it is compared, not summed.
    pub fn read_i64(&self) -> Option<Vec<i64>> {
        match self.dtype {
            Dtype::BOOL => Some(self.data.iter().map(|&x| x as i64).collect()),
            d => crate::checkpoint::file::decode_ints(d, self.data),
        }
    }

    /// Elements `start .. start + len` as f32 into `out` (cleared first). Non-float dtypes and
    /// ranges past the end give fewer values; callers ask within `numel()`.
    pub fn read_f32(&self, start: usize, len: usize, out: &mut Vec<f32>) {
        out.clear();
        let width = self.dtype.bitsize() / 8;
        // saturating: a caller asking far past the end gets nothing, not an overflow
        let end = start.saturating_add(len).min(self.numel());
        if !self.is_float() || width == 0 || start >= end {
            return;
        }
        let Some(bytes) = self.data.get(start * width..end * width) else {
            return;
        };
        out.reserve(end - start);
        match self.dtype {
            Dtype::F32 => out.extend(
                bytes
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
            ),
            // a finite f64 beyond the f32 range is not an Inf: saturate it, keep NaN/Inf as is
            Dtype::F64 => out.extend(bytes.chunks_exact(8).map(|b| {
                let v = f64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]);
                if v.is_finite() {
                    v.clamp(-(f32::MAX as f64), f32::MAX as f64) as f32
                } else {
                    v as f32
                }
            })),
            Dtype::BF16 => out.extend(
                bytes
                    .chunks_exact(2)
                    .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()),
            ),
            Dtype::F16 => out.extend(
                bytes
                    .chunks_exact(2)
                    .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()),
            ),
            Dtype::F8_E4M3 => out.extend(bytes.iter().map(|&b| crate::nvfp4::e4m3::decode(b))),
            // E5M2 is the top byte of an IEEE half
            Dtype::F8_E5M2 => out.extend(
                bytes
                    .iter()
                    .map(|&b| half::f16::from_bits((b as u16) << 8).to_f32()),
            ),
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::writer::{bf16_bytes, f32_bytes, write_file, TensorSpec};

    /// A range far past the end reads nothing (it used to overflow `start + len`).
    #[test]
    fn read_f32_far_past_the_end_is_empty() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("000001-a.safetensors");
        let v: Vec<f32> = (0..6).map(|_| rand::random::<f32>() + 0.5).collect();
        let spec = TensorSpec::new("output", Dtype::F32, &[2, 3]);
        write_file(&p, vec![(spec, f32_bytes(&v))], None).unwrap();
        let f = TraceFile::open(&p).unwrap();
        let t = f.tensor("output").unwrap();
        let mut out = vec![1.0];
        t.read_f32(usize::MAX - 1, 4, &mut out);
        assert!(out.is_empty());
        t.read_f32(4, usize::MAX, &mut out);
        assert_eq!(out, v[4..]);
    }

    #[test]
    fn roles_and_order() {
        assert_eq!(role("output"), Role::Output(0));
        assert_eq!(role("output.2"), Role::Output(2));
        assert_eq!(role("input.10"), Role::Input(10));
        assert_eq!(role("input."), Role::Other);
        assert_eq!(role("input.x"), Role::Other);
        assert_eq!(role("outputs"), Role::Other);
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("000001-a.safetensors");
        let v = [1.0f32, -2.5];
        write_file(
            &p,
            vec![
                (TensorSpec::new("output.1", Dtype::F32, &[2]), f32_bytes(&v)),
                (TensorSpec::new("zz", Dtype::F32, &[2]), f32_bytes(&v)),
                (
                    TensorSpec::new("output", Dtype::BF16, &[1, 2]),
                    bf16_bytes(&v),
                ),
                (TensorSpec::new("input.10", Dtype::F32, &[2]), f32_bytes(&v)),
                (TensorSpec::new("input.2", Dtype::F32, &[2]), f32_bytes(&v)),
            ],
            None,
        )
        .unwrap();
        let f = TraceFile::open(&p).unwrap();
        let names: Vec<_> = f.tensors().map(|t| t.name.to_string()).collect();
        assert_eq!(names, ["input.2", "input.10", "output", "output.1", "zz"]);
        let t = f.tensor("output").unwrap();
        assert_eq!(t.shape, &[1, 2]);
        let mut out = vec![];
        t.read_f32(0, 10, &mut out);
        assert_eq!(out, v);
    }

    #[test]
    fn every_float_dtype_reads_as_f32() {
        let seed: u64 = rand::random();
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let x: Vec<f32> = (0..37).map(|_| rng.gen_range(-100.0f32..100.0)).collect();
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("000000-m.safetensors");
        let mut f64b: Vec<u8> = x.iter().flat_map(|&v| (v as f64).to_le_bytes()).collect();
        f64b.extend(1e300f64.to_le_bytes());
        f64b.extend(f64::NEG_INFINITY.to_le_bytes());
        let f16b: Vec<u8> = x
            .iter()
            .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
            .collect();
        let e4m3: Vec<u8> = x
            .iter()
            .map(|&v| crate::nvfp4::e4m3::encode_saturating(v))
            .collect();
        // E5M2 by truncating an f16 whose low byte is zero: exact for these values
        let e5m2: Vec<u8> = x
            .iter()
            .map(|&v| (half::f16::from_f32(v).to_bits() >> 8) as u8)
            .collect();
        write_file(
            &p,
            vec![
                (TensorSpec::new("f32", Dtype::F32, &[37]), f32_bytes(&x)),
                (TensorSpec::new("f64", Dtype::F64, &[39]), f64b),
                (TensorSpec::new("f16", Dtype::F16, &[37]), f16b),
                (TensorSpec::new("bf16", Dtype::BF16, &[37]), bf16_bytes(&x)),
                (TensorSpec::new("e4m3", Dtype::F8_E4M3, &[37]), e4m3.clone()),
                (TensorSpec::new("e5m2", Dtype::F8_E5M2, &[37]), e5m2.clone()),
                (TensorSpec::new("ids", Dtype::I64, &[2]), vec![0; 16]),
            ],
            None,
        )
        .unwrap();
        let f = TraceFile::open(&p).unwrap();
        let mut out = vec![];
        let mut read = |name: &str, start: usize, len: usize| {
            f.tensor(name).unwrap().read_f32(start, len, &mut out);
            out.clone()
        };
        assert_eq!(read("f32", 0, 37), x, "seed {seed}");
        assert_eq!(read("f64", 0, 37), x, "seed {seed}");
        assert_eq!(read("f64", 37, 2), [f32::MAX, f32::NEG_INFINITY]);
        assert_eq!(read("f32", 30, 100), x[30..].to_vec(), "seed {seed}");
        let want: Vec<f32> = x.iter().map(|&v| half::f16::from_f32(v).to_f32()).collect();
        assert_eq!(read("f16", 0, 37), want, "seed {seed}");
        let want: Vec<f32> = x
            .iter()
            .map(|&v| half::bf16::from_f32(v).to_f32())
            .collect();
        assert_eq!(read("bf16", 5, 7), want[5..12].to_vec(), "seed {seed}");
        let want: Vec<f32> = e4m3
            .iter()
            .map(|&c| crate::nvfp4::e4m3::decode(c))
            .collect();
        assert_eq!(read("e4m3", 0, 37), want, "seed {seed}");
        for (got, &c) in read("e5m2", 0, 37).iter().zip(&e5m2) {
            let want = half::f16::from_bits((c as u16) << 8).to_f32();
            assert_eq!(*got, want, "seed {seed}");
        }
        assert!(read("ids", 0, 2).is_empty());
        assert!(!f.tensor("ids").unwrap().is_float());
    }

    #[test]
    fn truncated_and_lying_files_are_bad_input_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("000003-x.safetensors");
        write_file(
            &p,
            vec![(
                TensorSpec::new("output", Dtype::F32, &[4, 4]),
                f32_bytes(&[1.0; 16]),
            )],
            None,
        )
        .unwrap();
        let full = std::fs::read(&p).unwrap();
        for cut in [0usize, 5, 8, 20, full.len() - 1] {
            std::fs::write(&p, &full[..cut]).unwrap();
            let e = TraceFile::open(&p).err().expect("truncated file accepted");
            assert!(e.to_string().contains("000003-x.safetensors"), "{e}");
        }
        // a header that claims more data than there is
        let lying = String::from_utf8_lossy(&full).replace("[4,4]", "[4,5]");
        std::fs::write(&p, lying.as_bytes()).unwrap();
        let e = TraceFile::open(&p).err().expect("lying header accepted");
        assert!(e.to_string().contains("000003-x.safetensors"), "{e}");
    }
}
