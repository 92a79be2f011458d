//! Is a dump what one `layertest --dump-inputs` run wrote? `expected.safetensors` is judged
//! against, so it must be what the dumped inputs give: an edited tensor, or a directory mixing
//! the files of two runs (another --seed, --tokens or --gs writing part of it), would make
//! compare-outputs judge a kernel against the wrong numbers.
//!
//! Two checks, every reader of a dump gets both:
//! - **digests**: layertest records in `expected.safetensors`' metadata a digest of every
//!   tensor of both files; a tensor that changed since, or comes from another run, is named.
//!   Dumps written before the digests load unverified by them.
//! - **recompute**: `nvfp4_routed` is recomputed on the CPU from the dumped inputs (the path
//!   layertest and the bug variants run), below [`KERNEL_CHECK_MAX_MACS`]; and `nvfp4_out` must
//!   be `nvfp4_routed + shared_out` (docs/moe-forward.md, Combine), which costs nothing.
//!   `reference_out` (BF16 originals, shared experts) and `shared_out` cannot be recomputed
//!   from the dump: the digests alone cover them.

use super::{Dumped, EXPECTED, INPUTS};
use crate::checkpoint::file::TensorFile;
use crate::checkpoint::writer::TensorSpec;
use crate::error::{Error, Result};
use crate::metrics::{compare, max_rel_l2};
use crate::moe::byok::{routed_cpu, routed_macs, AGREE_MIN_COSINE, KERNEL_CHECK_MAX_MACS};
use rayon::prelude::*;
use safetensors::Dtype;
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::Path;

/// Metadata key of `expected.safetensors` naming the digest; its value is [`DIGEST`].
const DIGEST_KEY: &str = "digest";
/// The digest: FNV-1a 64 of the dtype and shape, then of each 16 MiB chunk's own FNV-1a 64
/// (chunks hashed in parallel), as 16 hex digits. Not cryptographic: it catches edits and mixed
/// runs, not an adversary.
const DIGEST: &str = "fnv1a64-of-16MiB-chunks";
const DIGEST_CHUNK: usize = 1 << 24;
const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0100_0000_01b3;

/// A stored tensor within this relative L2 error of its recompute, row by row, is the same
/// tensor. A GPU-written dump differs from the CPU recompute by FP32 summation order: ~1e-7
/// of a row, except where that moves an intermediate activation across an E2M1 or E4M3
/// rounding tie and one FP4 code or block scale flips before w2. Emulated on the
/// CPU (w1/w3 `weight_scale_2` moved by 1e-7 to 1e-5 relative, 10x FP32 accumulation noise at
/// the top; tiny layer, 10200 tokens), such flips moved 1 to 32 rows, the worst by 2.7% to
/// 4.4% of its norm, while the whole tensor kept cosine > 1 - 5e-7. 0.25 leaves a 5x margin
/// and still flags an edited row (scaled by more than 4/3 or less than 3/4, zeroed, another
/// token's).
pub const TOKEN_MAX_REL_ERR: f64 = 0.25;

fn fnv1a(h: u64, bytes: &[u8]) -> u64 {
    bytes
        .iter()
        .fold(h, |h, &b| (h ^ b as u64).wrapping_mul(FNV_PRIME))
}

/// The digest of one tensor ([`DIGEST`]).
fn digest(dtype: Dtype, shape: &[usize], bytes: &[u8]) -> String {
    let chunks: Vec<u64> = bytes
        .par_chunks(DIGEST_CHUNK)
        .map(|c| fnv1a(FNV_OFFSET, c))
        .collect();
    let head = fnv1a(FNV_OFFSET, format!("{dtype:?} {shape:?}").as_bytes());
    let h = chunks.iter().fold(head, |h, c| fnv1a(h, &c.to_le_bytes()));
    format!("{h:016x}")
}

/// The metadata key holding the digest of tensor `name` of `file`.
fn key(file: &str, name: &str) -> String {
    format!("{DIGEST_KEY}:{file}:{name}")
}

/// The metadata `expected.safetensors` records: the digest of every tensor of both files.
pub(super) fn digest_metadata(
    inputs: &[(TensorSpec, Vec<u8>)],
    expected: &[(TensorSpec, Vec<u8>)],
) -> BTreeMap<String, String> {
    let mut meta = BTreeMap::from([(DIGEST_KEY.to_string(), DIGEST.to_string())]);
    for (file, tensors) in [(INPUTS, inputs), (EXPECTED, expected)] {
        for (spec, bytes) in tensors {
            meta.insert(
                key(file, &spec.name),
                digest(spec.dtype, &spec.shape, bytes),
            );
        }
    }
    meta
}

const WRITE_AGAIN: &str =
    "the dump was edited or mixes two layertest runs; write it again with layertest --dump-inputs";

/// Every tensor of `f` (`file` in the metadata keys) against the digest `expected.safetensors`
/// recorded for it.
fn check_file(f: &TensorFile, meta: &BTreeMap<String, String>, file: &str) -> Result<()> {
    for name in f.names() {
        let info = f.info(name)?;
        let Some(recorded) = meta.get(&key(file, name)) else {
            return Err(Error::bad_tensor(
                f.path(),
                name,
                format!("{EXPECTED} records no digest of it, so it was not written by the layertest run that wrote {EXPECTED}: {WRITE_AGAIN}"),
            ));
        };
        let here = digest(info.dtype, &info.shape, f.bytes(name)?);
        if &here != recorded {
            let what = if file == EXPECTED {
                "changed since layertest wrote it".to_string()
            } else {
                format!("differs from the one {EXPECTED} was computed from")
            };
            return Err(Error::bad_tensor(
                f.path(),
                name,
                format!("{what} (digest {here}, recorded {recorded}): {WRITE_AGAIN}"),
            ));
        }
    }
    Ok(())
}

/// Both files against the digests layertest recorded: `Ok(true)` when every tensor matches,
/// `Ok(false)` for a dump written before the digests (or by another digest).
pub(super) fn check_digests(inputs: &TensorFile, expected: &TensorFile) -> Result<bool> {
    let meta = expected.metadata();
    if meta.get(DIGEST_KEY).map(String::as_str) != Some(DIGEST) {
        return Ok(false);
    }
    let recorded = |file: &str| {
        meta.keys()
            .filter_map(|k| k.strip_prefix(&format!("{DIGEST_KEY}:{file}:")))
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    for (f, file) in [(inputs, INPUTS), (expected, EXPECTED)] {
        if let Some(gone) = recorded(file).into_iter().find(|n| !f.contains(n)) {
            return Err(Error::bad_tensor(
                f.path(),
                &gone,
                format!("missing, and {EXPECTED} records its digest: {WRITE_AGAIN}"),
            ));
        }
        check_file(f, meta, file)?;
    }
    Ok(true)
}

/// A stored `[tokens, hidden]` tensor against what it should be.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Agreement {
    /// Over the values finite in both.
    pub cosine: f64,
    pub rel_l2: f64,
    /// Tokens whose row is off by more than [`TOKEN_MAX_REL_ERR`], or NaN/Inf on one side
    /// only.
    pub differing_tokens: usize,
    pub first_differing_token: Option<usize>,
    /// The largest row error, relative to the larger of the two rows' norms.
    pub worst_token_rel_err: f64,
}

impl Agreement {
    /// The same tensor up to FP32 summation order.
    pub fn holds(&self) -> bool {
        self.differing_tokens == 0
            && self.cosine >= AGREE_MIN_COSINE
            && self.rel_l2 <= max_rel_l2(AGREE_MIN_COSINE)
    }
}

/// Both non-finite the same way (NaN and NaN, or the same infinity), as the same path gives.
fn same_nonfinite(a: f32, b: f32) -> bool {
    (a.is_nan() && b.is_nan()) || (a.is_infinite() && a == b)
}

/// One row of `stored` against `should`: its relative error (NaN/Inf on one side only:
/// infinite), and both rows with the values non-finite on both sides zeroed, for the
/// whole-tensor metrics.
fn row_error(stored: &[f32], should: &[f32]) -> (f64, Vec<f32>, Vec<f32>) {
    let (mut d, mut ns, mut nr) = (0f64, 0f64, 0f64);
    let (mut a, mut b) = (stored.to_vec(), should.to_vec());
    for (x, y) in a.iter_mut().zip(b.iter_mut()) {
        if same_nonfinite(*x, *y) {
            (*x, *y) = (0.0, 0.0);
        } else if !x.is_finite() || !y.is_finite() {
            return (f64::INFINITY, vec![0.0; a.len()], vec![0.0; b.len()]);
        }
        let (p, q) = (*x as f64, *y as f64);
        d += (p - q) * (p - q);
        ns += p * p;
        nr += q * q;
    }
    let norm = ns.max(nr).sqrt();
    let err = if d == 0.0 { 0.0 } else { d.sqrt() / norm };
    (err, a, b)
}

/// `stored` against `should`, both `[tokens, hidden]`.
pub fn agreement(stored: &[f32], should: &[f32], hidden: usize) -> Agreement {
    let rows: Vec<(f64, Vec<f32>, Vec<f32>)> = stored
        .par_chunks(hidden.max(1))
        .zip(should.par_chunks(hidden.max(1)))
        .map(|(a, b)| row_error(a, b))
        .collect();
    let differing: Vec<usize> = rows
        .iter()
        .enumerate()
        .filter(|(_, r)| r.0 > TOKEN_MAX_REL_ERR)
        .map(|(t, _)| t)
        .collect();
    let (a, b): (Vec<f32>, Vec<f32>) = rows
        .iter()
        .flat_map(|(_, a, b)| a.iter().copied().zip(b.iter().copied()))
        .unzip();
    let m = compare(&a, &b);
    Agreement {
        cosine: m.cosine,
        rel_l2: m.rel_l2,
        differing_tokens: differing.len(),
        first_differing_token: differing.first().copied(),
        worst_token_rel_err: rows.iter().map(|r| r.0).fold(0.0, f64::max),
    }
}

/// How a dump was verified on reading.
#[derive(Clone, Debug, Default, Serialize)]
pub struct DumpCheck {
    /// Every tensor of both files matched the digest layertest recorded (false: a dump written
    /// before the digests).
    pub digests_verified: bool,
    /// `nvfp4_routed` against its CPU recompute from the dumped inputs (None: too large).
    pub routed_recompute: Option<Agreement>,
    /// Multiply-adds of the recompute, and the limit.
    pub recompute_macs: f64,
    pub recompute_max_macs: f64,
    /// `nvfp4_out` against `nvfp4_routed + shared_out`.
    pub layer_sum: Agreement,
}

impl DumpCheck {
    /// Nothing but the cheap sum checked: an older dump, too large to recompute.
    pub fn unverified(&self) -> bool {
        !self.digests_verified && self.routed_recompute.is_none()
    }

    /// The check in words, for the report.
    pub fn text(&self) -> String {
        let digests = if self.digests_verified {
            "every tensor matches the digest layertest recorded".to_string()
        } else {
            "no digests recorded (written by an older nvfp4dbg): not verified by digest".into()
        };
        let recompute = match &self.routed_recompute {
            Some(a) => format!(
                "nvfp4_routed matches its CPU recompute from the inputs (cosine {:.6}, worst token rel err {:.1e})",
                a.cosine, a.worst_token_rel_err
            ),
            None => format!(
                "nvfp4_routed not recomputed ({:.1e} multiply-adds, limit {:.0e})",
                self.recompute_macs, self.recompute_max_macs
            ),
        };
        let lead = if self.unverified() {
            "NOT VERIFIED: "
        } else {
            ""
        };
        format!("{lead}{digests}; {recompute}; nvfp4_out = nvfp4_routed + shared_out")
    }
}

/// Tensor `name` of `expected.safetensors` at `path` does not match `what`: `a` is it against
/// `against`.
fn mismatch(
    path: &Path,
    name: &str,
    what: &str,
    against: &str,
    a: &Agreement,
    tokens: usize,
) -> Error {
    let first = a
        .first_differing_token
        .map_or(String::new(), |t| format!("; first differing token {t}"));
    Error::bad_tensor(
        path,
        name,
        format!(
            "{name} does not match {what} (cosine {:.6}, rel-L2 {:.2e} against {against}; {} of {tokens} tokens off by more than {TOKEN_MAX_REL_ERR} of their norm{first}): {WRITE_AGAIN}",
            a.cosine, a.rel_l2, a.differing_tokens,
        ),
    )
}

/// Check `d.expected` (read from `path`) against the dumped inputs; `digests_verified` from
/// [`check_digests`].
pub(super) fn check_expected(d: &Dumped, path: &Path, digests_verified: bool) -> Result<DumpCheck> {
    let h = d.layer.config.hidden_size;
    let x = &d.expected;
    let macs = routed_macs(&d.layer.config, &d.routing);
    let routed_recompute = if macs <= KERNEL_CHECK_MAX_MACS {
        let ours = routed_cpu(&d.layer, &d.hidden, &d.routing, &d.scales)?;
        let a = agreement(&x.nvfp4_routed, &ours, h);
        if !a.holds() {
            return Err(mismatch(
                path,
                "nvfp4_routed",
                "the dumped inputs",
                "a CPU recompute from inputs.safetensors",
                &a,
                d.routing.tokens,
            ));
        }
        Some(a)
    } else {
        None
    };
    let sum: Vec<f32> = x
        .nvfp4_routed
        .iter()
        .zip(&x.shared_out)
        .map(|(r, s)| r + s)
        .collect();
    let layer_sum = agreement(&x.nvfp4_out, &sum, h);
    if !layer_sum.holds() {
        return Err(mismatch(
            path,
            "nvfp4_out",
            "nvfp4_routed + shared_out",
            "that sum: nvfp4_out or shared_out was changed",
            &layer_sum,
            d.routing.tokens,
        ));
    }
    Ok(DumpCheck {
        digests_verified,
        routed_recompute,
        recompute_macs: macs,
        recompute_max_macs: KERNEL_CHECK_MAX_MACS,
        layer_sum,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv1a_is_the_published_function() {
        // the FNV test vectors (Fowler, Noll, Vo): "" and "a"
        assert_eq!(fnv1a(FNV_OFFSET, b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(FNV_OFFSET, b"a"), 0xaf63_dc4c_8601_ec8c);
    }

    #[test]
    fn a_digest_sees_one_byte_the_dtype_and_the_shape() {
        let b: Vec<u8> = (0..1000u32).map(|i| (i * 7 + 3) as u8).collect();
        let d = digest(Dtype::U8, &[10, 100], &b);
        let mut c = b.clone();
        c[517] ^= 1;
        assert_ne!(d, digest(Dtype::U8, &[10, 100], &c));
        assert_ne!(d, digest(Dtype::U8, &[100, 10], &b));
        assert_ne!(d, digest(Dtype::I8, &[10, 100], &b));
        assert_eq!(d, digest(Dtype::U8, &[10, 100], &b));
    }

    #[test]
    fn agreement_takes_summation_noise_and_rejects_one_changed_row() {
        let (t, h) = (64, 32);
        let v: Vec<f32> = (0..t * h)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        let noisy: Vec<f32> = v.iter().map(|x| x * (1.0 + 3e-7)).collect();
        let a = agreement(&noisy, &v, h);
        assert!(a.holds(), "{a:?}");
        let mut row = v.clone();
        row[5 * h..6 * h].iter_mut().for_each(|x| *x *= 1.5);
        let a = agreement(&row, &v, h);
        assert!(!a.holds(), "{a:?}");
        assert_eq!(a.first_differing_token, Some(5));
        // the same NaN on both sides is the same path; on one side only, a differing token
        let (mut n1, mut n2) = (v.clone(), v.clone());
        n1[3 * h + 1] = f32::NAN;
        n2[3 * h + 1] = f32::NAN;
        assert!(agreement(&n1, &n2, h).holds());
        let a = agreement(&n1, &v, h);
        assert_eq!((a.differing_tokens, a.first_differing_token), (1, Some(3)));
        // a scaled tensor keeps its cosine and fails by its norm
        let scaled: Vec<f32> = v.iter().map(|x| x * 1.01).collect();
        assert!(!agreement(&scaled, &v, h).holds());
    }
}
