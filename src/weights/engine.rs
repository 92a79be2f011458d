//! The diff engine: the one step of compare-weights that does arithmetic on every value —
//! dequantize both sides of a unit and reduce them to `Metrics`. Everything that decides a
//! verdict from bytes (bitwise identity, scale layouts, global scales) stays on the CPU and is
//! the same whichever engine runs, so the engines can only differ in the last bits of the f64
//! sums (see [`CudaDiff`]).

use super::blocks::BlockCount;
use super::compare::{metrics_any, metrics_qq, Values};
use super::fused;
use super::view::QMatrix;
use crate::backend::cuda::reduce::CompareScratch;
use crate::backend::cuda::{budget, dequant, probe, Gpu};
use crate::backend::DeviceRequest;
use crate::error::{Error, Result};
use crate::metrics::{Accum, Metrics};
use cudarc::driver::CudaSlice;
use std::sync::{Arc, Mutex};

pub trait DiffEngine: Sync {
    /// "cpu" or "cuda:0 (NVIDIA H200, sm_90a)".
    fn name(&self) -> String;

    /// Metrics of `b` (test) against `a` (reference) over their row-major values; Ok(None)
    /// when the element counts differ or a dtype does not decode.
    fn metrics(&self, a: &Values, b: &Values) -> Result<Option<Metrics>>;

    /// Metrics of two quantized matrices, and with `count`, their differing blocks where the
    /// engine counts them in the same pass (`None`: count them apart).
    fn metrics_counted(
        &self,
        a: &QMatrix,
        b: &QMatrix,
        count: bool,
    ) -> Result<Option<(Metrics, Option<BlockCount>)>> {
        let _ = count;
        uncounted(self, a, b)
    }
}

/// [`DiffEngine::metrics_counted`] with the blocks left to count apart.
fn uncounted(
    e: &(impl DiffEngine + ?Sized),
    a: &QMatrix,
    b: &QMatrix,
) -> Result<Option<(Metrics, Option<BlockCount>)>> {
    Ok(e.metrics(&Values::Q(a), &Values::Q(b))?.map(|m| (m, None)))
}

/// The reference: chunked over the cores, f64 sums (`metrics::Accum`); two NVFP4 matrices of
/// one shape, or NVFP4 against a BF16 reference, in one fused pass (`fused`: the same values,
/// max and counts, the sums in lanes).
pub struct CpuDiff;

impl DiffEngine for CpuDiff {
    fn name(&self) -> String {
        "cpu".into()
    }

    fn metrics(&self, a: &Values, b: &Values) -> Result<Option<Metrics>> {
        Ok(match (a, b) {
            (Values::Q(x), Values::Q(y)) if (x.rows, x.cols) == (y.rows, y.cols) => {
                Some(fused::metrics_nvfp4(x, y).unwrap_or_else(|| metrics_qq(x, y)))
            }
            (Values::D(x), Values::Q(y)) => {
                fused::metrics_bf16_nvfp4(x, y).or_else(|| metrics_any(a, b))
            }
            _ => metrics_any(a, b),
        })
    }

    /// Each piece of rows counted right after its fused pass, while it is in cache.
    fn metrics_counted(
        &self,
        a: &QMatrix,
        b: &QMatrix,
        count: bool,
    ) -> Result<Option<(Metrics, Option<BlockCount>)>> {
        match fused::metrics_nvfp4_counted(a, b, count) {
            Some(x) => Ok(Some(x)),
            None => uncounted(self, a, b),
        }
    }
}

/// The engine `--device` asks for: `cuda[:N]` must open (no GPU → exit 2), `auto` takes
/// cuda:0 when one is usable, else the CPU.
pub fn open(req: &DeviceRequest) -> Result<Box<dyn DiffEngine>> {
    match req {
        DeviceRequest::Cpu => Ok(Box::new(CpuDiff)),
        DeviceRequest::Cuda(n) => Ok(Box::new(CudaDiff::open(*n)?)),
        DeviceRequest::Auto => match probe(0) {
            Ok(_) => Ok(Box::new(CudaDiff::open(0)?)),
            Err(_) => Ok(Box::new(CpuDiff)),
        },
    }
}

/// Bytes of the host→GPU staging buffer: tensors stream through it in pieces of this size.
const STAGE: usize = 64 << 20;

/// Bytes the GPU needs to diff a pair of `n` elements: both sides in f32, the staging
/// buffer for the raw bytes (at least one packed row, `min_stage`), and the partial sums
/// of the reduction (88 bytes per 8192 elements).
pub fn pair_bytes(n: usize, min_stage: usize) -> usize {
    2 * 4 * n + STAGE.max(min_stage) + 88 * (n.div_ceil(8192) + 1)
}

/// Device buffers reused from pair to pair (grown when a larger pair comes).
struct Work {
    /// Elements `x` and `y` hold.
    cap: usize,
    /// A (reference) and B (test), dequantized.
    x: CudaSlice<f32>,
    y: CudaSlice<f32>,
    stage: CudaSlice<u8>,
    scratch: Option<(usize, CompareScratch)>,
    /// The first index of the largest error.
    first: CudaSlice<u64>,
}

/// Dequantize and diff on the GPU: one pair at a time (a lock; the CPU work of other units —
/// loading, byte comparisons — goes on in parallel), the bytes streamed from the memory maps
/// through a staging buffer, so GPU memory is two f32 copies of the largest pair plus 64 MB.
///
/// The values are bit-identical to the CPU's (kernels/dequant.cu); the sums are f64 in
/// another order (fixed, deterministic) with FMA. So `len`, `nan_count`, `inf_count`,
/// `first_nan`, `first_inf`, `max_abs_err` and its index (the first one among ties, found by
/// a second pass) are exact; `cosine`, `rel_l2` and `sqnr_db` agree to about 1e-12 relative
/// (blocked f64 summation of 65536-element chunks bounds the difference by ~2·65536·2^-53 ≈
/// 1.5e-11 of ‖a‖·‖b‖; measured ≤ 2e-13 on DeepSeek-V3 experts); the tests allow 1e-9. One
/// case is not exact on either engine: where A (the reference) holds NaN and B does not,
/// `max_abs_err` depends on where the summation splits.
pub struct CudaDiff {
    gpu: Arc<Gpu>,
    work: Mutex<Option<Work>>,
}

impl CudaDiff {
    pub fn open(ordinal: usize) -> Result<CudaDiff> {
        Ok(CudaDiff {
            gpu: Gpu::open(ordinal)?,
            work: Mutex::new(None),
        })
    }

    /// Make room for a pair of `n` elements whose rows need `min_stage` staging bytes.
    fn room(&self, work: &mut Option<Work>, n: usize, min_stage: usize) -> Result<()> {
        let stage_need = STAGE.max(min_stage);
        if let Some(w) = work.as_ref() {
            if w.cap >= n && w.stage.len() >= stage_need {
                return Ok(());
            }
        }
        let cap = n.max(work.as_ref().map_or(0, |w| w.cap));
        // free the old buffers before asking for the new ones
        *work = None;
        let gpu = &self.gpu;
        budget::check_free(
            gpu,
            pair_bytes(cap, min_stage) as u64,
            &format!("compare-weights: dequantizing a tensor pair of {cap} elements in f32"),
        )?;
        *work = Some(Work {
            cap,
            x: gpu.alloc::<f32>(cap, "the reference tensor (A) in f32")?,
            y: gpu.alloc::<f32>(cap, "the test tensor (B) in f32")?,
            stage: gpu.alloc::<u8>(stage_need, "the staging buffer")?,
            scratch: None,
            first: gpu.alloc::<u64>(1, "the first index at the maximum")?,
        });
        Ok(())
    }

    /// Dequantize one side's values into `out` (device address of `len` f32).
    fn fill(&self, v: &Values, out: u64, stage: &CudaSlice<u8>) -> Result<()> {
        let gpu = &self.gpu;
        let (sp, scap) = (gpu.ptr(stage), stage.len());
        for_each_piece(v, scap, &mut |p| {
            let dst = out + 4 * p.at as u64;
            gpu.upload_raw(p.bytes, sp, scap, "tensor bytes")?;
            match v {
                Values::D(d) => {
                    let code = dequant::float_code(d.dtype)
                        .ok_or_else(|| Error::usage(format!("{:?}: not a float dtype", d.dtype)))?;
                    dequant::decode_into(gpu, sp, p.elems, code, dst)
                }
                Values::Q(q) => {
                    let spp = sp + p.bytes.len() as u64;
                    gpu.upload_raw(p.scales, spp, scap - p.bytes.len(), "block scales")?;
                    dequant::dequant_fp4_into(
                        gpu, sp, spp, p.rows, q.cols, q.format, q.scale_2, dst,
                    )
                }
            }
        })
    }
}

/// One upload through the staging buffer: raw bytes (packed codes, or float elements), the
/// block scales of those rows (quantized sides), and where the values go.
struct Piece<'p> {
    bytes: &'p [u8],
    scales: &'p [u8],
    /// Rows of a quantized side in this piece.
    rows: usize,
    /// Flat index of the piece's first value, and its value count.
    at: usize,
    elems: usize,
}

/// Cut a side into pieces of at most `cap` staging bytes (bytes + scales), in order. A float
/// row longer than the stage is cut at element boundaries; a quantized row never is (the
/// stage is sized for one, [`min_stage`]).
fn for_each_piece(
    v: &Values,
    cap: usize,
    f: &mut dyn FnMut(Piece<'_>) -> Result<()>,
) -> Result<()> {
    match v {
        Values::D(d) => {
            let (es, rb) = (d.es(), d.mat.row_bytes.max(1));
            let piece = (cap / es).max(1) * es;
            let rows_per = (cap / rb).max(1);
            let mut at = 0usize;
            for r0 in (0..d.mat.rows).step_by(rows_per) {
                let r1 = (r0 + rows_per).min(d.mat.rows);
                let bytes = d.mat.rows_bytes(r0, r1);
                for p in bytes.chunks(piece) {
                    let elems = p.len() / es;
                    f(Piece {
                        bytes: p,
                        scales: &[],
                        rows: 0,
                        at,
                        elems,
                    })?;
                    at += elems;
                }
            }
        }
        Values::Q(q) => {
            let (pb, kb) = (q.cols / 2, q.kb());
            let rows_per = (cap / (pb + kb).max(1)).max(1);
            for r0 in (0..q.rows).step_by(rows_per) {
                let r1 = (r0 + rows_per).min(q.rows);
                let packed = q.packed.rows_bytes(r0, r1);
                f(Piece {
                    bytes: &packed,
                    scales: &q.scales[r0 * kb..r1 * kb],
                    rows: r1 - r0,
                    at: r0 * q.cols,
                    elems: (r1 - r0) * q.cols,
                })?;
            }
        }
    }
    Ok(())
}

/// Staging bytes one row group of a side needs at the least.
fn min_stage(v: &Values) -> usize {
    match v {
        Values::Q(q) => q.cols / 2 + q.kb(),
        Values::D(d) => d.es(),
    }
}

fn decodes(v: &Values) -> bool {
    match v {
        Values::Q(_) => true,
        Values::D(d) => dequant::float_code(d.dtype).is_some(),
    }
}

impl DiffEngine for CudaDiff {
    fn name(&self) -> String {
        self.gpu.describe()
    }

    fn metrics(&self, a: &Values, b: &Values) -> Result<Option<Metrics>> {
        let n = a.len();
        if n != b.len() || !decodes(a) || !decodes(b) {
            return Ok(None);
        }
        if n == 0 {
            return Ok(Some(Accum::default().finish()));
        }
        let mut guard = self.work.lock().unwrap_or_else(|p| p.into_inner());
        self.room(&mut guard, n, min_stage(a).max(min_stage(b)))?;
        let Some(w) = guard.as_mut() else {
            return Err(Error::usage("compare-weights: the GPU buffers vanished"));
        };
        let gpu = &self.gpu;
        // poison: anything a kernel fails to write is NaN and shows up as a NaN count
        let (xp, yp) = (gpu.ptr(&w.x), gpu.ptr(&w.y));
        gpu.fill_raw(xp, 4 * n, 0xFF, "the reference tensor (A) in f32")?;
        gpu.fill_raw(yp, 4 * n, 0xFF, "the test tensor (B) in f32")?;
        self.fill(a, xp, &w.stage)?;
        self.fill(b, yp, &w.stage)?;
        if w.scratch.as_ref().is_none_or(|(m, _)| *m != n) {
            w.scratch = None;
            w.scratch = Some((n, CompareScratch::new(gpu, n)?));
        }
        let Some((_, scratch)) = w.scratch.as_ref() else {
            return Err(Error::usage(
                "compare-weights: the reduction buffers vanished",
            ));
        };
        scratch.enqueue(gpu, &w.y, &w.x)?;
        let mut m = scratch.metrics(gpu)?;
        // dequantized weights repeat values, so the largest error is often tied: report the
        // first index holding it, as the CPU does
        if let Some(hint) = m.max_abs_err_index {
            let i = dequant::first_index_at_max(gpu, yp, xp, n, hint, &mut w.first)?;
            m.max_abs_err_index = Some(i);
        }
        Ok(Some(m))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::file::decode_row;
    use crate::nvfp4::{dequantize_row, Format};
    use crate::weights::compare::DView;
    use crate::weights::view::{Mat, QMatrix};
    use rand::{Rng, SeedableRng};
    use safetensors::Dtype;
    use std::borrow::Cow;

    /// The pieces, decoded on the CPU where the GPU would put them, give every value of the
    /// side bit for bit, in order, each piece within the stage.
    fn check_pieces(v: &Values, cap: usize, what: &str) {
        let n = v.len();
        let mut want = vec![0f32; n];
        assert!(v.fill(0, &mut want), "{what}");
        let mut got = vec![f32::from_bits(0x7fc0_1234); n];
        let mut next = 0;
        for_each_piece(v, cap, &mut |p| {
            assert_eq!(p.at, next, "{what}");
            let out = &mut got[p.at..p.at + p.elems];
            match v {
                Values::D(d) => {
                    if p.elems > 1 {
                        assert!(p.bytes.len() <= cap, "{what}");
                    }
                    assert_eq!(p.bytes.len(), p.elems * d.es(), "{what}");
                    decode_row(d.dtype, p.bytes, out);
                }
                Values::Q(q) => {
                    let (pb, kb) = (q.cols / 2, q.kb());
                    assert!(p.bytes.len() + p.scales.len() <= cap.max(pb + kb), "{what}");
                    assert_eq!((p.bytes.len(), p.scales.len()), (p.rows * pb, p.rows * kb));
                    for i in 0..p.rows {
                        dequantize_row(
                            q.format,
                            &p.bytes[i * pb..(i + 1) * pb],
                            &p.scales[i * kb..(i + 1) * kb],
                            q.scale_2,
                            q.format.block(),
                            &mut out[i * q.cols..(i + 1) * q.cols],
                        );
                    }
                }
            }
            next += p.elems;
            Ok(())
        })
        .unwrap();
        assert_eq!(next, n, "{what}");
        for i in 0..n {
            assert_eq!(got[i].to_bits(), want[i].to_bits(), "{what}: value {i}");
        }
    }

    #[test]
    fn pieces_cover_every_value_in_order() {
        let seed: u64 = rand::random();
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        for trial in 0..40 {
            let format = if r.gen_bool(0.5) {
                Format::Nvfp4
            } else {
                Format::Mxfp4
            };
            let block = format.block();
            let (rows, cols) = (r.gen_range(1..40), block * r.gen_range(1..8));
            let packed: Vec<u8> = (0..rows * cols / 2).map(|_| r.gen()).collect();
            let scales: Vec<u8> = (0..rows * cols / block).map(|_| r.gen()).collect();
            let full = QMatrix {
                format,
                rows,
                cols,
                packed: Mat::dense(&packed, rows, cols / 2).unwrap(),
                scales: Cow::Borrowed(&scales),
                scale_2: r.gen_range(1e-3..2.0),
            };
            // a TP column slice has strided rows
            let q = if cols >= 3 * block && r.gen_bool(0.5) {
                full.cols_slice(block, cols - 2 * block).unwrap()
            } else {
                full.clone()
            };
            let cap = r.gen_range(1..3 * (q.cols / 2 + q.kb()) * 4);
            let v = Values::Q(&q);
            check_pieces(
                &v,
                cap.max(min_stage(&v)),
                &format!("seed {seed} trial {trial} Q"),
            );

            let dtype = [
                Dtype::BF16,
                Dtype::F16,
                Dtype::F32,
                Dtype::F64,
                Dtype::F8_E4M3,
                Dtype::F8_E5M2,
            ][r.gen_range(0..6)];
            let es = dtype.bitsize() / 8;
            let (rows, cols) = (r.gen_range(1..30), r.gen_range(1..50));
            let bytes: Vec<u8> = (0..rows * cols * es).map(|_| r.gen()).collect();
            let mat = Mat::dense(&bytes, rows, cols * es).unwrap();
            let mat = if cols > 2 && r.gen_bool(0.5) {
                mat.slice_cols(es, (cols - 2) * es).unwrap()
            } else {
                mat
            };
            let v = Values::D(DView { mat, dtype });
            let cap = r.gen_range(1..rows * cols * es + 16);
            check_pieces(&v, cap, &format!("seed {seed} trial {trial} {dtype:?}"));
        }
    }

    #[test]
    fn pair_estimate_and_the_early_check() {
        let n: usize = 1 + rand::random::<u32>() as usize % (1 << 28);
        let need = pair_bytes(n, 0);
        assert!(need >= 8 * n + STAGE, "n {n}");
        assert!(need < 8 * n + STAGE + n / 64 + 1024, "n {n}");
        // a row wider than the stage grows it
        assert_eq!(pair_bytes(n, STAGE * 3) - pair_bytes(n, 0), STAGE * 2);
        let need = need as u64;
        assert!(budget::check_fits(need, need + (128 << 20), "x").is_ok());
        match budget::check_fits(need, need, "diffing x") {
            Err(e @ Error::GpuOom { .. }) => {
                let s = e.to_string();
                assert!(s.contains("diffing x") && s.contains("GB are free"), "{s}");
            }
            other => panic!("expected GpuOom, got {other:?}"),
        }
    }
}
