//! `nvfp4dbg compare-weights` through the real binary: a small ModelOpt NVFP4 checkpoint
//! against engine-style dumps of the same weights (vLLM fused, per-expert, native-V4 names,
//! TP / EP shards), with faults planted.

mod common;
use nvfp4dbg::checkpoint::writer::{bf16_bytes, f32_bytes, write_file, TensorSpec};
use nvfp4dbg::nvfp4::{layout, quantize_weight_nvfp4, Fp4Tensor};
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, StandardNormal};
use safetensors::Dtype;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

const LAYER: usize = 1;

struct ExpertW {
    w1: Fp4Tensor,
    w3: Fp4Tensor,
    w2: Fp4Tensor,
    in1: f32,
    in3: f32,
    in2: f32,
}

struct Model {
    h: usize,
    i: usize,
    experts: Vec<ExpertW>,
    gate: Vec<f32>,
    bias: Vec<f32>,
    shared: [Vec<f32>; 3],
    norm: Vec<f32>,
    embed: Vec<f32>,
    vocab: usize,
}

fn randn(r: &mut impl Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let v: f32 = StandardNormal.sample(r);
            half::bf16::from_f32(v * scale).to_f32()
        })
        .collect()
}

impl Model {
    fn new(r: &mut impl Rng, e: usize) -> Model {
        Model::with_dims(r, e, 64, 32)
    }

    fn with_dims(r: &mut impl Rng, e: usize, h: usize, i: usize) -> Model {
        let vocab = 16;
        let experts = (0..e)
            .map(|_| {
                // different amax per projection: w1 and w3 get different weight_scale_2
                let sc = r.gen_range(0.02..0.08);
                let w1 = randn(r, i * h, sc);
                let sc = r.gen_range(0.02..0.08);
                let w3 = randn(r, i * h, sc);
                let sc = r.gen_range(0.02..0.08);
                let w2 = randn(r, h * i, sc);
                ExpertW {
                    w1: quantize_weight_nvfp4(&w1, i, h).0,
                    w3: quantize_weight_nvfp4(&w3, i, h).0,
                    w2: quantize_weight_nvfp4(&w2, h, i).0,
                    in1: r.gen_range(0.001..0.01),
                    in3: r.gen_range(0.001..0.01),
                    in2: r.gen_range(0.001..0.01),
                }
            })
            .collect();
        Model {
            h,
            i,
            experts,
            gate: randn(r, e * h, 0.1),
            bias: (0..e).map(|_| r.gen_range(-0.1f32..0.1)).collect(),
            shared: [
                randn(r, i * h, 0.05),
                randn(r, i * h, 0.05),
                randn(r, h * i, 0.05),
            ],
            norm: randn(r, h, 1.0),
            embed: randn(r, vocab * h, 1.0),
            vocab,
        }
    }

    /// w1 and w3 of every expert share one weight_scale_2 (as ModelOpt exports them for vLLM).
    fn with_shared_w13_scale(mut self) -> Model {
        for x in &mut self.experts {
            x.w3.scale_2 = x.w1.scale_2;
        }
        self
    }

    fn config(&self, dir: &Path) {
        let c = serde_json::json!({
            "model_type": "deepseek_v3",
            "hidden_size": self.h,
            "moe_intermediate_size": self.i,
            "intermediate_size": 2 * self.i,
            "n_routed_experts": self.experts.len(),
            "num_experts_per_tok": 2,
            "n_shared_experts": 1,
            "n_group": 1,
            "topk_group": 1,
            "num_hidden_layers": 2,
            "first_k_dense_replace": 1,
            "routed_scaling_factor": 2.5,
            "scoring_func": "sigmoid",
            "norm_topk_prob": true,
            "vocab_size": self.vocab,
            "quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"},
        });
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(
            dir.join("config.json"),
            serde_json::to_vec_pretty(&c).unwrap(),
        )
        .unwrap();
    }

    /// Tensors every layout shares (router, shared expert, norm, embedding), under `p`.
    fn common(&self, p: &str, mlp: &str) -> Vec<(TensorSpec, Vec<u8>)> {
        let (h, i, e) = (self.h, self.i, self.experts.len());
        let mut v = vec![
            (
                TensorSpec::new(
                    format!("{p}embed_tokens.weight"),
                    Dtype::BF16,
                    &[self.vocab, h],
                ),
                bf16_bytes(&self.embed),
            ),
            (
                TensorSpec::new(
                    format!("{p}layers.{LAYER}.{mlp}.gate.weight"),
                    Dtype::BF16,
                    &[e, h],
                ),
                bf16_bytes(&self.gate),
            ),
            (
                TensorSpec::new(
                    format!(
                        "{p}layers.{LAYER}.{mlp}.gate.{}",
                        if mlp == "ffn" {
                            "bias"
                        } else {
                            "e_score_correction_bias"
                        }
                    ),
                    Dtype::F32,
                    &[e],
                ),
                f32_bytes(&self.bias),
            ),
        ];
        let names = if mlp == "ffn" {
            ["w1", "w3", "w2"]
        } else {
            ["gate_proj", "up_proj", "down_proj"]
        };
        for (k, n) in names.iter().enumerate() {
            let shape = if k == 2 { [h, i] } else { [i, h] };
            v.push((
                TensorSpec::new(
                    format!("{p}layers.{LAYER}.{mlp}.shared_experts.{n}.weight"),
                    Dtype::BF16,
                    &shape,
                ),
                bf16_bytes(&self.shared[k]),
            ));
        }
        let norm = if mlp == "ffn" {
            format!("{p}layers.{LAYER}.ffn_norm.weight")
        } else {
            format!("{p}layers.{LAYER}.post_attention_layernorm.weight")
        };
        v.push((
            TensorSpec::new(norm, Dtype::BF16, &[h]),
            bf16_bytes(&self.norm),
        ));
        v
    }

    /// The ModelOpt checkpoint: HF names.
    fn write_hf(&self, dir: &Path) {
        self.config(dir);
        write_file(&dir.join("model.safetensors"), self.hf_tensors(), None).unwrap();
    }

    /// The checkpoint's tensors (HF names).
    fn hf_tensors(&self) -> Vec<(TensorSpec, Vec<u8>)> {
        let mut v = self.common("model.", "mlp");
        for (e, x) in self.experts.iter().enumerate() {
            for (n, t, ins) in [
                ("gate_proj", &x.w1, x.in1),
                ("up_proj", &x.w3, x.in3),
                ("down_proj", &x.w2, x.in2),
            ] {
                triple(
                    &mut v,
                    &format!("model.layers.{LAYER}.mlp.experts.{e}.{n}"),
                    t,
                    ins,
                );
            }
        }
        v
    }
}

fn triple(v: &mut Vec<(TensorSpec, Vec<u8>)>, base: &str, t: &Fp4Tensor, input_scale: f32) {
    v.push((
        TensorSpec::new(format!("{base}.weight"), Dtype::U8, &[t.rows, t.cols / 2]),
        t.packed.clone(),
    ));
    v.push((
        TensorSpec::new(
            format!("{base}.weight_scale"),
            Dtype::F8_E4M3,
            &[t.rows, t.cols / 16],
        ),
        t.scales.clone(),
    ));
    v.push((
        TensorSpec::new(format!("{base}.weight_scale_2"), Dtype::F32, &[]),
        f32_bytes(&[t.scale_2]),
    ));
    v.push((
        TensorSpec::new(format!("{base}.input_scale"), Dtype::F32, &[]),
        f32_bytes(&[input_scale]),
    ));
}

/// Rows `[r0, r0+n)` of a quantized tensor.
fn rows_of(t: &Fp4Tensor, r0: usize, n: usize) -> Fp4Tensor {
    let (pb, kb) = (t.cols / 2, t.cols / 16);
    Fp4Tensor {
        rows: n,
        packed: t.packed[r0 * pb..(r0 + n) * pb].to_vec(),
        scales: t.scales[r0 * kb..(r0 + n) * kb].to_vec(),
        ..t.clone()
    }
}

/// Columns (K) `[c0, c0+n)` of a quantized tensor.
fn cols_of(t: &Fp4Tensor, c0: usize, n: usize) -> Fp4Tensor {
    let (pb, kb) = (t.cols / 2, t.cols / 16);
    let mut packed = vec![];
    let mut scales = vec![];
    for r in 0..t.rows {
        packed.extend_from_slice(&t.packed[r * pb + c0 / 2..r * pb + (c0 + n) / 2]);
        scales.extend_from_slice(&t.scales[r * kb + c0 / 16..r * kb + (c0 + n) / 16]);
    }
    Fp4Tensor {
        cols: n,
        packed,
        scales,
        ..t.clone()
    }
}

fn dense_rows(v: &[f32], cols: usize, r0: usize, n: usize) -> Vec<f32> {
    v[r0 * cols..(r0 + n) * cols].to_vec()
}

fn dense_cols(v: &[f32], cols: usize, c0: usize, n: usize) -> Vec<f32> {
    v.chunks(cols)
        .flat_map(|row| row[c0..c0 + n].to_vec())
        .collect()
}

#[derive(Default, Clone)]
struct Faults {
    /// Gate and up swapped in these experts.
    swap: Vec<usize>,
    /// Block scales in the 128x4 swizzled layout.
    swizzle: bool,
    /// Only these experts' block scales swizzled (dims where both layouts have one size).
    swizzle_only: Vec<usize>,
    /// w2_weight_scale_2 holds 1/weight_scale_2 (gs).
    flip_w2_scale_2: bool,
    /// w13_weight_scale_2 is [E] holding the gate's (vLLM after loading).
    gate_only_scale_2: bool,
    /// Expert order in the fused tensors.
    order: Option<Vec<usize>>,
    /// Leave out the shared expert's down_proj; add a stray tensor.
    drop_and_add: bool,
    /// TP rank and size.
    tp: Option<(usize, usize)>,
    /// EP rank and size (linear placement).
    ep: Option<(usize, usize)>,
    prefix: Option<&'static str>,
    /// vLLM after `process_weights_after_loading`: one w13_weight_scale_2 per expert, swizzled
    /// `w13_blockscale_swizzled`, and the derived alphas / input_scale_quant (`Some(true)`:
    /// input scales maxed over all experts, as FlashInfer backends do).
    processed: Option<bool>,
    /// g1_alphas of this expert doubled.
    bad_alpha: Option<usize>,
    /// The w2 bytes of these experts with high and low nibble exchanged.
    nibble_swap: Vec<usize>,
    /// w2_weight_scale holds the scales' values as F32, not their e4m3 codes.
    w2_scales_f32: bool,
    /// w2_weight_scale is U8 holding the scales' values cast to integers (wrapping past 255).
    w2_scales_u8_values: bool,
    /// w2_weight_scale is U8 holding the e4m3 bytes unchanged (`.view(torch.uint8)`).
    w2_scales_u8_bytes: bool,
    /// w2_weight_scale holds the e4m3 bytes unchanged under the F8_E5M2 dtype.
    w2_scales_e5m2_tag: bool,
    /// w2_weight_scale holds the scales' values as BF16.
    w2_scales_bf16: bool,
    /// w2_weight_scale has one stray byte after each row ([E, H, I/16 + 1]).
    w2_scales_extra_col: bool,
    /// w13_weight_scale stored [E, H/16, 2I] (each expert's scales transposed).
    w13_scales_transposed: bool,
    /// The weight_scale_2 and input_scale tensors exchanged (w13 and w2).
    swap_scale_2_input: bool,
    /// With `tp`: w13 sharded as one [2I] block (rank r's 2I/n rows of [w1; w3] halved).
    tp_w13_as_one: bool,
    /// This expert's w2 block scale at row 1, block 1 holds the e4m3 NaN code 0x7F.
    nan_scale: Option<usize>,
    /// w2_weight_scale_2 stored in BF16.
    w2_scale_2_bf16: bool,
    /// w2_weight_scale_2 stored in F64 (the same values).
    w2_scale_2_f64: bool,
    /// This expert's w2_weight_scale_2 replaced by this value.
    w2_scale_2_set: Option<(usize, f32)>,
    /// This expert's w2_input_scale replaced by this value.
    w2_input_scale_set: Option<(usize, f32)>,
    /// This expert's w2 codes all zero (allocated, never loaded).
    w2_zero: Option<usize>,
    /// These experts' gate and up packed codes exchanged, their scales left in place.
    swap_codes_only: Vec<usize>,
    /// w2_weight stored as I8 (the same bytes).
    w2_i8: bool,
    /// w2_weight stored as F8_E4M3 (the same bytes).
    w2_f8: bool,
    /// w2_weight_scale holds the scales' values converted to F8_E5M2 (other bytes).
    w2_scales_e5m2_values: bool,
    /// The shared expert's gate and up as vLLM's merged `gate_up_proj` ([gate; up], each
    /// sharded on its own under `tp`); `Some(true)`: [up; gate].
    merged_shared: Option<bool>,
    /// With `tp`: the row-parallel down projections (w2, the shared expert's down_proj) split
    /// along their output rows H instead of K (a loader narrowing the wrong dim).
    tp_down_wrong_axis: bool,
    /// This slot (after EP selection) left out: the experts after it one slot early.
    drop_slot: Option<usize>,
    /// Every expert's `w13_weight_scale_2`, `w2_weight_scale_2` or `w2_input_scale` (the
    /// name) times this factor.
    scalar_factor: Option<(&'static str, f32)>,
    /// Every expert's w2 block scales taken one column off (±1) from A's, clamped at A's edges.
    w2_scale_shift: Option<i64>,
    /// With `ep`: the per-expert scalars (weight_scale_2, input_scale) kept for all experts.
    scalars_all_experts: bool,
    /// These experts' w2 block scales (linear) put through the inverse of the 128x4 swizzle,
    /// as if they had been swizzled (dims where both layouts have one size).
    w2_unswizzled: Vec<usize>,
    /// weight_scale_2 replaced by a max of A's: `Some(false)` over the layer's experts (one
    /// for every gate and up, one for every down: one global scale a fused tensor),
    /// `Some(true)` over gate and up of each expert.
    scale_2_max: Option<bool>,
    /// Every gate's and up's weight_scale_2 replaced by the max over all the model's experts'
    /// gate and up, every down's by the max of their down (taken before EP sharding).
    scale_2_max_all: bool,
}

/// A vLLM-style state dict: fused experts, everything else as in the checkpoint.
fn write_fused(m: &Model, path: &Path, f: &Faults) {
    let p = f.prefix.unwrap_or("model.");
    let (h, i) = (m.h, m.i);
    let (tr, tn) = f.tp.unwrap_or((0, 1));
    let ip = i / tn;
    let mut experts: Vec<usize> = f
        .order
        .clone()
        .unwrap_or_else(|| (0..m.experts.len()).collect());
    if let Some((r, n)) = f.ep {
        let per = m.experts.len() / n;
        experts = experts[r * per..(r + 1) * per].to_vec();
    }
    if let Some(j) = f.drop_slot {
        experts.remove(j);
    }
    let e = experts.len();
    let (mut w13, mut s13, mut g13, mut i13) = (vec![], vec![], vec![], vec![]);
    let (mut w2, mut s2, mut g2, mut i2) = (vec![], vec![], vec![], vec![]);
    for (slot, &x) in experts.iter().enumerate() {
        let ex = &m.experts[x];
        let (mut a, mut b) = if f.tp_w13_as_one {
            let half = |k: usize| {
                let r0 = tr * 2 * ip + k * ip;
                if r0 < i {
                    rows_of(&ex.w1, r0, ip)
                } else {
                    rows_of(&ex.w3, r0 - i, ip)
                }
            };
            (half(0), half(1))
        } else {
            (rows_of(&ex.w1, tr * ip, ip), rows_of(&ex.w3, tr * ip, ip))
        };
        let (mut ia, mut ib) = (ex.in1, ex.in3);
        if f.swap.contains(&x) {
            std::mem::swap(&mut a, &mut b);
            std::mem::swap(&mut ia, &mut ib);
        }
        if f.swap_codes_only.contains(&x) {
            w13.extend_from_slice(&b.packed);
            w13.extend_from_slice(&a.packed);
        } else {
            w13.extend_from_slice(&a.packed);
            w13.extend_from_slice(&b.packed);
        }
        let mut sc: Vec<u8> = a.scales.iter().chain(&b.scales).copied().collect();
        if f.swizzle || f.processed.is_some() || f.swizzle_only.contains(&x) {
            sc = layout::swizzle(&sc, 2 * ip, h / 16);
        }
        if f.w13_scales_transposed {
            let kb = h / 16;
            sc = (0..kb)
                .flat_map(|k| (0..2 * ip).map(move |r| (r, k)))
                .map(|(r, k)| sc[r * kb + k])
                .collect();
        }
        s13.extend(sc);
        if f.gate_only_scale_2 || f.processed.is_some() {
            g13.push(a.scale_2);
        } else {
            g13.extend([a.scale_2, b.scale_2]);
        }
        i13.extend([ia, ib]);
        let d = if f.tp_down_wrong_axis {
            rows_of(&ex.w2, tr * (h / tn), h / tn)
        } else {
            cols_of(&ex.w2, tr * ip, ip)
        };
        if f.w2_zero == Some(x) {
            w2.extend(std::iter::repeat_n(0u8, d.packed.len()));
        } else if f.nibble_swap.contains(&x) {
            w2.extend(d.packed.iter().map(|b| b.rotate_left(4)));
        } else {
            w2.extend_from_slice(&d.packed);
        }
        let mut sc = d.scales.clone();
        if let Some(shift) = f.w2_scale_shift {
            let (kb, kbp) = (i / 16, ip / 16);
            sc = (0..h)
                .flat_map(|r| (0..kbp).map(move |j| (r, j)))
                .map(|(r, j)| {
                    let src = ((tr * kbp + j) as i64 + shift).clamp(0, kb as i64 - 1) as usize;
                    ex.w2.scales[r * kb + src]
                })
                .collect();
        }
        if f.nan_scale == Some(x) {
            sc[ip / 16 + 1] = 0x7F;
        }
        if f.swizzle || f.swizzle_only.contains(&x) {
            sc = layout::swizzle(&sc, h, ip / 16);
        }
        if f.w2_unswizzled.contains(&x) {
            sc = layout::unswizzle(&sc, h, ip / 16);
        }
        if f.w2_scales_extra_col {
            sc = sc
                .chunks(ip / 16)
                .flat_map(|c| c.iter().copied().chain([0x38]))
                .collect();
        }
        s2.extend(sc);
        g2.push(if f.flip_w2_scale_2 {
            1.0 / d.scale_2
        } else {
            d.scale_2
        });
        i2.push(ex.in2);
        if let Some((_, v)) = f.w2_scale_2_set.filter(|&(e, _)| e == x) {
            *g2.last_mut().unwrap() = v;
        }
        if let Some((_, v)) = f.w2_input_scale_set.filter(|&(e, _)| e == x) {
            *i2.last_mut().unwrap() = v;
        }
        let _ = slot;
    }
    let es = if f.scalars_all_experts {
        (g13, i13, g2, i2) = (vec![], vec![], vec![], vec![]);
        for x in &m.experts {
            g13.extend([x.w1.scale_2, x.w3.scale_2]);
            i13.extend([x.in1, x.in3]);
            g2.push(x.w2.scale_2);
            i2.push(x.in2);
        }
        m.experts.len()
    } else {
        e
    };
    match f.scale_2_max {
        Some(false) => {
            for g in [&mut g13, &mut g2] {
                let m = g.iter().copied().fold(f32::MIN, f32::max);
                g.iter_mut().for_each(|x| *x = m);
            }
        }
        Some(true) => {
            for pair in g13.chunks_mut(2) {
                let m = pair[0].max(pair[1]);
                pair.iter_mut().for_each(|x| *x = m);
            }
        }
        None => {}
    }
    if f.scale_2_max_all {
        let m13 = m
            .experts
            .iter()
            .flat_map(|x| [x.w1.scale_2, x.w3.scale_2])
            .fold(f32::MIN, f32::max);
        let m2 = m
            .experts
            .iter()
            .map(|x| x.w2.scale_2)
            .fold(f32::MIN, f32::max);
        g13.iter_mut().for_each(|x| *x = m13);
        g2.iter_mut().for_each(|x| *x = m2);
    }
    if let Some((which, k)) = f.scalar_factor {
        let v = match which {
            "w13_weight_scale_2" => &mut g13,
            "w2_weight_scale_2" => &mut g2,
            "w2_input_scale" => &mut i2,
            _ => panic!("scalar_factor: {which}"),
        };
        v.iter_mut().for_each(|x| *x *= k);
    }
    let ex = |s: &str| format!("{p}layers.{LAYER}.mlp.experts.{s}");
    let swizzled = |rows, kb| {
        let (pr, pk) = layout::swizzled_dims(rows, kb);
        vec![e, pr, pk]
    };
    let s13_shape: Vec<usize> = if f.swizzle || f.processed.is_some() {
        swizzled(2 * ip, h / 16)
    } else if f.w13_scales_transposed {
        vec![e, h / 16, 2 * ip]
    } else {
        vec![e, 2 * ip, h / 16]
    };
    // w2's [rows, K] per expert
    let (w2r, w2k) = if f.tp_down_wrong_axis {
        (h / tn, i)
    } else {
        (h, ip)
    };
    let s2_shape: Vec<usize> = if f.swizzle {
        swizzled(h, ip / 16)
    } else if f.w2_scales_extra_col {
        vec![e, h, ip / 16 + 1]
    } else {
        vec![e, w2r, w2k / 16]
    };
    let g13_shape: Vec<usize> = if f.gate_only_scale_2 || f.processed.is_some() {
        vec![es]
    } else {
        vec![es, 2]
    };
    let mut v = vec![
        (
            TensorSpec::new(ex("w13_weight"), Dtype::U8, &[e, 2 * ip, h / 2]),
            w13,
        ),
        (
            TensorSpec::new(
                ex(if f.processed.is_some() {
                    "w13_blockscale_swizzled"
                } else {
                    "w13_weight_scale"
                }),
                Dtype::F8_E4M3,
                &s13_shape,
            ),
            s13,
        ),
        (
            TensorSpec::new(ex("w13_weight_scale_2"), Dtype::F32, &g13_shape),
            f32_bytes(&g13),
        ),
        (
            TensorSpec::new(ex("w13_input_scale"), Dtype::F32, &[es, 2]),
            f32_bytes(&i13),
        ),
        (
            TensorSpec::new(
                ex("w2_weight"),
                if f.w2_i8 {
                    Dtype::I8
                } else if f.w2_f8 {
                    Dtype::F8_E4M3
                } else {
                    Dtype::U8
                },
                &[e, w2r, w2k / 2],
            ),
            w2,
        ),
        if f.w2_scales_f32 {
            let v: Vec<f32> = s2
                .iter()
                .map(|&c| nvfp4dbg::nvfp4::e4m3::decode(c))
                .collect();
            (
                TensorSpec::new(ex("w2_weight_scale"), Dtype::F32, &s2_shape),
                f32_bytes(&v),
            )
        } else if f.w2_scales_bf16 {
            let v: Vec<f32> = s2
                .iter()
                .map(|&c| nvfp4dbg::nvfp4::e4m3::decode(c))
                .collect();
            (
                TensorSpec::new(ex("w2_weight_scale"), Dtype::BF16, &s2_shape),
                bf16_bytes(&v),
            )
        } else if f.w2_scales_u8_bytes || f.w2_scales_e5m2_tag {
            let dtype = if f.w2_scales_u8_bytes {
                Dtype::U8
            } else {
                Dtype::F8_E5M2
            };
            (TensorSpec::new(ex("w2_weight_scale"), dtype, &s2_shape), s2)
        } else if f.w2_scales_e5m2_values {
            // e5m2 is the top byte of an f16: round the low byte to nearest even
            let v: Vec<u8> = s2
                .iter()
                .map(|&c| {
                    let b = half::f16::from_f32(nvfp4dbg::nvfp4::e4m3::decode(c)).to_bits();
                    ((b + 0x7F + ((b >> 8) & 1)) >> 8) as u8
                })
                .collect();
            (
                TensorSpec::new(ex("w2_weight_scale"), Dtype::F8_E5M2, &s2_shape),
                v,
            )
        } else if f.w2_scales_u8_values {
            let v: Vec<u8> = s2
                .iter()
                .map(|&c| nvfp4dbg::nvfp4::e4m3::decode(c) as u32 as u8)
                .collect();
            (
                TensorSpec::new(ex("w2_weight_scale"), Dtype::U8, &s2_shape),
                v,
            )
        } else {
            (
                TensorSpec::new(ex("w2_weight_scale"), Dtype::F8_E4M3, &s2_shape),
                s2,
            )
        },
        if f.w2_scale_2_bf16 {
            (
                TensorSpec::new(ex("w2_weight_scale_2"), Dtype::BF16, &[es]),
                bf16_bytes(&g2),
            )
        } else if f.w2_scale_2_f64 {
            (
                TensorSpec::new(ex("w2_weight_scale_2"), Dtype::F64, &[es]),
                g2.iter().flat_map(|&v| (v as f64).to_le_bytes()).collect(),
            )
        } else {
            (
                TensorSpec::new(ex("w2_weight_scale_2"), Dtype::F32, &[es]),
                f32_bytes(&g2),
            )
        },
        (
            TensorSpec::new(ex("w2_input_scale"), Dtype::F32, &[es]),
            f32_bytes(&i2),
        ),
    ];
    if f.swap_scale_2_input {
        for (g, i) in [(2, 3), (6, 7)] {
            let (gb, ib) = (v[g].1.clone(), v[i].1.clone());
            let (gs, is) = (v[g].0.shape.clone(), v[i].0.shape.clone());
            (v[g].1, v[g].0.shape, v[i].1, v[i].0.shape) = (ib, is, gb, gs);
        }
    }
    if let Some(global) = f.processed {
        // vLLM's process_weights_after_loading: alphas and the activation gs per expert
        let mut in13: Vec<f32> = i13.chunks(2).map(|c| c[0].max(c[1])).collect();
        let mut in2 = i2.clone();
        if global {
            let (m13, m2) = (
                in13.iter().copied().fold(0f32, f32::max),
                in2.iter().copied().fold(0f32, f32::max),
            );
            in13.iter_mut().for_each(|v| *v = m13);
            in2.iter_mut().for_each(|v| *v = m2);
        }
        let mut g1: Vec<f32> = in13.iter().zip(&g13).map(|(x, w)| x * w).collect();
        if let Some(x) = f.bad_alpha {
            g1[x] *= 2.0;
        }
        let g2a: Vec<f32> = in2.iter().zip(&g2).map(|(x, w)| x * w).collect();
        for (n, vals) in [
            ("g1_alphas", g1),
            ("g2_alphas", g2a),
            (
                "w13_input_scale_quant",
                in13.iter().map(|x| 1.0 / x).collect(),
            ),
            (
                "w2_input_scale_quant",
                in2.iter().map(|x| 1.0 / x).collect(),
            ),
        ] {
            v.push((TensorSpec::new(ex(n), Dtype::F32, &[e]), f32_bytes(&vals)));
        }
    }
    for (spec, bytes) in m.common(p, "mlp") {
        let (mut spec, mut bytes) = (spec, bytes);
        if f.drop_and_add && spec.name.ends_with("shared_experts.down_proj.weight") {
            continue;
        }
        if let Some((r, n)) = f.tp {
            // the shared expert is column/row parallel; the embedding vocab-parallel
            let sh = &m.shared;
            if spec.name.ends_with("shared_experts.gate_proj.weight")
                || spec.name.ends_with("shared_experts.up_proj.weight")
            {
                let k = usize::from(spec.name.contains("up_proj"));
                bytes = bf16_bytes(&dense_rows(&sh[k], h, r * ip, ip));
                spec.shape = vec![ip, h];
            } else if spec.name.ends_with("shared_experts.down_proj.weight") {
                if f.tp_down_wrong_axis {
                    bytes = bf16_bytes(&dense_rows(&sh[2], i, r * (h / n), h / n));
                    spec.shape = vec![h / n, i];
                } else {
                    bytes = bf16_bytes(&dense_cols(&sh[2], i, r * ip, ip));
                    spec.shape = vec![h, ip];
                }
            } else if spec.name.ends_with("embed_tokens.weight") {
                let vp = m.vocab / n;
                bytes = bf16_bytes(&dense_rows(&m.embed, h, r * vp, vp));
                spec.shape = vec![vp, h];
            }
        }
        v.push((spec, bytes));
    }
    if let Some(reversed) = f.merged_shared {
        let part = |k: &str| format!("{p}layers.{LAYER}.mlp.shared_experts.{k}.weight");
        let take = |v: &mut Vec<(TensorSpec, Vec<u8>)>, k: &str| {
            let at = v.iter().position(|(t, _)| t.name == part(k)).unwrap();
            v.remove(at)
        };
        let (g, u) = (take(&mut v, "gate_proj"), take(&mut v, "up_proj"));
        let (first, second) = if reversed { (u, g) } else { (g, u) };
        let rows = first.0.shape[0] + second.0.shape[0];
        let bytes = [first.1, second.1].concat();
        v.push((
            TensorSpec::new(part("gate_up_proj"), Dtype::BF16, &[rows, h]),
            bytes,
        ));
    }
    if f.drop_and_add {
        v.push((
            TensorSpec::new(ex("w13_bias"), Dtype::F32, &[e, 2 * ip]),
            f32_bytes(&vec![0.5; e * 2 * ip]),
        ));
    }
    write_file(path, v, None).unwrap();
}

/// The checkpoint under native-V4 names (no `model.` prefix).
fn write_native(m: &Model, path: &Path) {
    write_native_experts(m, m.common("", "ffn"), path);
}

/// `v` and the experts under native V4 names.
fn write_native_experts(m: &Model, mut v: Vec<(TensorSpec, Vec<u8>)>, path: &Path) {
    for (e, x) in m.experts.iter().enumerate() {
        for (n, t, ins) in [
            ("w1", &x.w1, x.in1),
            ("w3", &x.w3, x.in3),
            ("w2", &x.w2, x.in2),
        ] {
            triple(
                &mut v,
                &format!("layers.{LAYER}.ffn.experts.{e}.{n}"),
                t,
                ins,
            );
        }
    }
    write_file(path, v, None).unwrap();
}

struct Run {
    code: i32,
    json: Value,
    stdout: String,
    stderr: String,
}

fn run(dir: &Path, args: &[&str]) -> Run {
    let json = dir.join(format!("r{}.json", rand::random::<u32>()));
    let out = Command::new(env!("CARGO_BIN_EXE_nvfp4dbg"))
        .arg("compare-weights")
        .args(args)
        .arg("--json")
        .arg(&json)
        .arg("--no-report-dir")
        .arg("--quiet")
        .current_dir(dir)
        .output()
        .unwrap();
    Run {
        code: out.status.code().unwrap_or(-1),
        json: std::fs::read(&json)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or(Value::Null),
        stdout: String::from_utf8_lossy(&out.stdout).into(),
        stderr: String::from_utf8_lossy(&out.stderr).into(),
    }
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

struct Fixture {
    _dir: tempfile::TempDir,
    root: PathBuf,
    ckpt: PathBuf,
    model: Model,
    seed: u64,
}

impl Fixture {
    /// Write `dump` as a fused dump of the model with `f`, compare the checkpoint against it
    /// (with `args`) and check the exit code.
    fn run_fused(&self, dump: &Path, f: &Faults, args: &[&str], code: i32) -> Run {
        write_fused(&self.model, dump, f);
        let mut all = vec![s(&self.ckpt), s(dump)];
        all.extend_from_slice(args);
        let out = run(&self.root, &all);
        check(&out, code, self.seed);
        out
    }
}

fn fixture(experts: usize) -> Fixture {
    fixture_dims(experts, 64, 32)
}

thread_local! {
    /// The test's seed (each test runs on its own thread): NVFP4DBG_SEED replays a failure's
    /// printed seed, the fixture's data and every size the test draws with [`draw`] alike.
    static SEED: u64 = std::env::var("NVFP4DBG_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(rand::random);
    static DRAWS: std::cell::RefCell<rand_chacha::ChaCha8Rng> =
        std::cell::RefCell::new(rand_chacha::ChaCha8Rng::seed_from_u64(SEED.with(|s| *s) ^ 0x5EED));
}

/// A random value from the test's seed (sizes, ranks, which expert).
fn draw<T>() -> T
where
    rand::distributions::Standard: Distribution<T>,
{
    DRAWS.with(|r| r.borrow_mut().gen())
}

fn fixture_dims(experts: usize, h: usize, i: usize) -> Fixture {
    let seed = SEED.with(|s| *s);
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().to_path_buf();
    let model = Model::with_dims(&mut r, experts, h, i);
    let ckpt = root.join("ckpt");
    model.write_hf(&ckpt);
    Fixture {
        _dir: dir,
        root,
        ckpt,
        model,
        seed,
    }
}

fn diag_kinds(j: &Value) -> Vec<String> {
    j["diagnoses"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|d| d["kind"].as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default()
}

fn check(out: &Run, code: i32, seed: u64) {
    assert_eq!(
        out.code, code,
        "seed {seed}\nstdout:\n{}\nstderr:\n{}",
        out.stdout, out.stderr
    );
}

/// A failing run's one mismatch, expert `bad`'s down_proj: its issues.
fn sole_down_mismatch(out: &Run, bad: usize, seed: u64, what: &str) -> Value {
    check(out, 1, seed);
    let m = out.json["mismatches"].as_array().unwrap();
    assert_eq!(m.len(), 1, "seed {seed} {what}: {m:?}");
    let name = m[0]["name"].as_str().unwrap();
    assert!(
        name.contains(&format!("experts.{bad}.down_proj")),
        "seed {seed} {what}: {name}"
    );
    m[0]["issues"].clone()
}

#[test]
fn identical_pair_and_clean_fused_dump_pass() {
    let fx = fixture(4);
    let out = run(&fx.root, &[s(&fx.ckpt), s(&fx.ckpt)]);
    check(&out, 0, fx.seed);
    assert_eq!(out.json["summary"]["mismatched"], 0);
    assert_eq!(out.json["summary"]["equal"], out.json["summary"]["units"]);
    assert_eq!(out.json["mismatches"].as_array().unwrap().len(), 0);

    let dump = fx.root.join("engine.safetensors");
    let out = fx.run_fused(&dump, &Faults::default(), &[], 0);
    // 4 experts × 3 projections paired through the fused tensors, all bitwise
    let units = out.json["summary"]["units"].as_u64().unwrap();
    assert_eq!(units, 12 + 7, "{}", out.stdout);
    assert_eq!(out.json["summary"]["equal"].as_u64().unwrap(), units);
    assert!(out.json["summary"]["b_naming"]
        .as_str()
        .unwrap()
        .contains("vllm-fused"));
    // vLLM keeps max(w1, w3) input scales: a note, not a mismatch
    assert_eq!(out.json["missing"].as_array().unwrap().len(), 0);
}

#[test]
fn native_v4_names_and_prefixes_pair_up() {
    let fx = fixture(3);
    let native = fx.root.join("native.safetensors");
    write_native(&fx.model, &native);
    let out = run(&fx.root, &[s(&fx.ckpt), s(&native)]);
    check(&out, 0, fx.seed);
    assert!(out.json["summary"]["b_naming"]
        .as_str()
        .unwrap()
        .contains("native-v4"));
    // a loader that renamed only the experts: the router, shared expert, norm and embedding
    // keep their HF names and still pair up (each was listed as missing and as extra, under
    // one name)
    let mixed = fx.root.join("mixed.safetensors");
    write_native_experts(&fx.model, fx.model.common("model.", "mlp"), &mixed);
    let out = run(&fx.root, &[s(&fx.ckpt), s(&mixed)]);
    check(&out, 0, fx.seed);
    assert_eq!(
        (
            out.json["missing"].as_array().map(Vec::len),
            out.json["extra"].as_array().map(Vec::len)
        ),
        (Some(0), Some(0)),
        "seed {}",
        fx.seed
    );
    // an extra wrapper prefix on the engine side is found by itself
    let dump = fx.root.join("wrapped.safetensors");
    fx.run_fused(
        &dump,
        &Faults {
            prefix: Some("language_model.model."),
            ..Default::default()
        },
        &[],
        0,
    );
}

/// Guards one expert's tensors written with a stray `model.` prefix (a renaming applied to
/// part of the model) listed only as missing and extra: the prefix is named, and a prefix
/// dropped on the other side too.
#[test]
fn a_prefix_on_some_tensors_only_is_named() {
    let fx = fixture(3);
    let native = fx.root.join("native.safetensors");
    write_native(&fx.model, &native);
    let odd = 1 + draw::<usize>() % 2;
    let partly = fx.root.join("partly.safetensors");
    let mut v = fx.model.common("", "ffn");
    for (e, x) in fx.model.experts.iter().enumerate() {
        let pre = if e == odd { "model." } else { "" };
        for (n, t, ins) in [
            ("w1", &x.w1, x.in1),
            ("w3", &x.w3, x.in3),
            ("w2", &x.w2, x.in2),
        ] {
            triple(
                &mut v,
                &format!("{pre}layers.{LAYER}.ffn.experts.{e}.{n}"),
                t,
                ins,
            );
        }
    }
    write_file(&partly, v, None).unwrap();
    for (a, b, how) in [
        (&native, &partly, "added in B"),
        (&partly, &native, "dropped in B"),
    ] {
        let out = run(&fx.root, &[s(a), s(b)]);
        check(&out, 1, fx.seed);
        let d = out.json["diagnoses"].as_array().unwrap();
        let named: Vec<&Value> = d
            .iter()
            .filter(|d| d["kind"] == "prefix_mismatch")
            .collect();
        assert_eq!(named.len(), 1, "seed {} odd {odd}: {d:?}", fx.seed);
        let msg = named[0]["message"].as_str().unwrap();
        assert!(
            msg.contains(&format!("`model.` {how}")) && !msg.contains("  "),
            "{msg}"
        );
        assert_eq!(named[0]["layer"], LAYER, "{msg}");
        let missing = out.json["missing"].as_array().unwrap().len();
        assert_eq!(named[0]["tensors"], missing, "{msg}");
        assert!(missing > 0 && missing.is_multiple_of(3), "{msg}");
    }
}

// guards: a linear renamed with a stray `model.` prefix except its input_scale (left under its
// own name) listed that input_scale both as missing in B and as extra in B
#[test]
fn a_name_both_sides_hold_is_neither_missing_nor_extra() {
    let fx = fixture(3);
    let native = fx.root.join("native.safetensors");
    write_native(&fx.model, &native);
    let odd = draw::<usize>() % 3;
    let partly = fx.root.join("partly.safetensors");
    let mut v = fx.model.common("", "ffn");
    for (e, x) in fx.model.experts.iter().enumerate() {
        for (n, t, ins) in [
            ("w1", &x.w1, x.in1),
            ("w3", &x.w3, x.in3),
            ("w2", &x.w2, x.in2),
        ] {
            let base = format!("layers.{LAYER}.ffn.experts.{e}.{n}");
            let mut t3 = vec![];
            triple(&mut t3, &base, t, ins);
            for (spec, bytes) in t3 {
                let keep = spec.name.ends_with(".input_scale");
                let spec = match (e == odd && n == "w2" && !keep, spec) {
                    (true, sp) => {
                        TensorSpec::new(format!("model.{}", sp.name), sp.dtype, &sp.shape)
                    }
                    (false, sp) => sp,
                };
                v.push((spec, bytes));
            }
        }
    }
    write_file(&partly, v, None).unwrap();
    let out = run(&fx.root, &[s(&native), s(&partly)]);
    check(&out, 1, fx.seed);
    let kept = format!("layers.{LAYER}.ffn.experts.{odd}.w2.input_scale");
    for list in ["missing", "extra"] {
        let names: Vec<&str> = out.json[list]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|n| n.as_str())
            .collect();
        assert!(
            !names.contains(&kept.as_str()),
            "seed {} odd {odd}: {list} lists {kept}, which both sides hold: {names:?}",
            fx.seed
        );
    }
    assert_eq!(
        out.json["missing"].as_array().unwrap().len(),
        3,
        "seed {}",
        fx.seed
    );
    assert!(diag_kinds(&out.json).contains(&"prefix_mismatch".to_string()));
}

#[test]
fn gate_up_swapped_in_one_expert_is_named() {
    let fx = fixture(4);
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(fx.seed ^ 1);
    let bad = r.gen_range(0..4);
    let dump = fx.root.join("swap.safetensors");
    let out = fx.run_fused(
        &dump,
        &Faults {
            swap: vec![bad],
            ..Default::default()
        },
        &[],
        1,
    );
    let d = out.json["diagnoses"].as_array().unwrap();
    let swap = d
        .iter()
        .find(|d| d["kind"] == "gate_up_swapped")
        .unwrap_or_else(|| panic!("seed {}: {d:?}", fx.seed));
    assert_eq!(swap["experts"], serde_json::json!([bad]));
    // the moved scale_2 and input_scale are symptoms of the swap, not diagnoses of their own
    assert_eq!(
        diag_kinds(&out.json),
        ["gate_up_swapped"],
        "seed {}",
        fx.seed
    );
    assert_eq!(swap["layer"], LAYER);
    let names: Vec<&str> = out.json["mismatches"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["name"].as_str().unwrap())
        .collect();
    assert_eq!(names.len(), 2, "{names:?}");
    assert!(
        names.iter().all(|n| n.contains(&format!("experts.{bad}."))),
        "{names:?}"
    );
}

/// Flips the lowest bit of each byte `i` of the tensor named `*suffix` in the safetensors
/// file at `path` for which `at(i)` holds: FP4 codes that move one step.
/// Gate's and up's packed codes exchanged in one expert while its block scales stayed: it was
/// a bare "values differ" on both projections (the swap check matches codes and scales
/// together).
#[test]
fn gate_up_codes_swapped_without_their_scales_are_named() {
    let fx = fixture(4);
    let bad = rand_chacha::ChaCha8Rng::seed_from_u64(fx.seed).gen_range(0..4);
    let dump = fx.root.join("codes-swapped.safetensors");
    let out = fx.run_fused(
        &dump,
        &Faults {
            swap_codes_only: vec![bad],
            ..Default::default()
        },
        &[],
        1,
    );
    assert_eq!(
        diag_kinds(&out.json),
        ["gate_up_codes_swapped"],
        "seed {}: {}",
        fx.seed,
        out.stdout
    );
    let d = &out.json["diagnoses"][0];
    assert_eq!(d["experts"], serde_json::json!([bad]));
    assert!(d["message"]
        .as_str()
        .unwrap()
        .contains("their block scales not"));
    // the full swap (codes and scales) stays gate_up_swapped
    let out = fx.run_fused(
        &dump,
        &Faults {
            swap: vec![bad],
            ..Default::default()
        },
        &[],
        1,
    );
    assert_eq!(
        diag_kinds(&out.json),
        ["gate_up_swapped"],
        "seed {}",
        fx.seed
    );
}

fn flip_code_bits(path: &Path, suffix: &str, at: impl Fn(usize) -> bool) {
    let mut flipped = 0;
    edit_tensor(path, suffix, |i, b| {
        if at(i) {
            *b ^= 1;
            flipped += 1;
        }
    });
    assert!(flipped > 0, "{suffix}: nothing flipped");
}

/// Rewrite the bytes of the one tensor of the file whose name ends with `suffix`, in place
/// (`edit(index, byte)`).
fn edit_tensor(path: &Path, suffix: &str, mut edit: impl FnMut(usize, &mut u8)) {
    let mut bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let t = header
        .as_object()
        .unwrap()
        .iter()
        .find(|(k, _)| k.ends_with(suffix))
        .map(|(_, t)| t.clone())
        .unwrap_or_else(|| panic!("no tensor named *{suffix}"));
    let off = |k: usize| 8 + n + t["data_offsets"][k].as_u64().unwrap() as usize;
    let (start, end) = (off(0), off(1));
    for (i, b) in bytes[start..end].iter_mut().enumerate() {
        edit(i, b);
    }
    std::fs::write(path, bytes).unwrap();
}

/// Gate and up swapped in one expert whose codes also differ in one place, past the rows a
/// pairing is first tried on, while every other expert's gate and up differ in every 16th
/// byte (all of them mismatch): the swap is still found by cosine, and no other expert is
/// called swapped (their gate-for-up pairings fail on their first rows).
#[test]
fn gate_up_swap_is_found_by_cosine_among_differing_experts() {
    let (h, i) = (128, 320);
    let fx = fixture_dims(4, h, i);
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(fx.seed ^ 7);
    let bad = r.gen_range(0..4);
    let dump = fx.root.join("swap-differs.safetensors");
    write_fused(
        &fx.model,
        &dump,
        &Faults {
            swap: vec![bad],
            ..Default::default()
        },
    );
    // w13_weight [E, 2I, H/2]: one expert's bytes, and a byte in row 200 of its first half
    let (row, per) = (h / 2, 2 * i * h / 2);
    let one = bad * per + 200 * row + r.gen_range(0..row);
    flip_code_bits(&dump, "w13_weight", |b| {
        if b / per == bad {
            b == one
        } else {
            b % 16 == 0
        }
    });
    let out = run(&fx.root, &[s(&fx.ckpt), s(&dump)]);
    check(&out, 1, fx.seed);
    let d = out.json["diagnoses"].as_array().unwrap();
    let swap = d
        .iter()
        .find(|d| d["kind"] == "gate_up_swapped")
        .unwrap_or_else(|| panic!("seed {}: {d:?}", fx.seed));
    assert_eq!(
        swap["experts"],
        serde_json::json!([bad]),
        "seed {}",
        fx.seed
    );
}

/// Element 2i in the high nibble instead of the low one: named as such, on that expert, not
/// as a bare value difference.
#[test]
fn nibble_swapped_expert_is_named() {
    let fx = fixture(4);
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(fx.seed ^ 3);
    let bad = r.gen_range(0..4);
    let dump = fx.root.join("nibbles.safetensors");
    let out = fx.run_fused(
        &dump,
        &Faults {
            nibble_swap: vec![bad],
            ..Default::default()
        },
        &[],
        1,
    );
    assert_eq!(
        diag_kinds(&out.json),
        ["nibbles_swapped"],
        "seed {}",
        fx.seed
    );
    let d = &out.json["diagnoses"][0];
    assert_eq!(d["experts"], serde_json::json!([bad]), "seed {}", fx.seed);
    assert_eq!(d["layer"], LAYER);
    let m = out.json["mismatches"].as_array().unwrap();
    assert_eq!(m.len(), 1, "seed {}: {m:?}", fx.seed);
    assert!(
        m[0]["name"]
            .as_str()
            .unwrap()
            .contains(&format!("experts.{bad}.down_proj")),
        "seed {}: {m:?}",
        fx.seed
    );
    assert_eq!(m[0]["issues"][0]["kind"], "nibbles_swapped");
}

#[test]
fn w13_order_reversed_for_all_experts_is_named() {
    let fx = fixture(4);
    let dump = fx.root.join("rev.safetensors");
    let out = fx.run_fused(
        &dump,
        &Faults {
            swap: (0..4).collect(),
            ..Default::default()
        },
        &[],
        1,
    );
    let kinds = diag_kinds(&out.json);
    assert!(
        kinds.contains(&"w13_order_reversed".to_string()),
        "seed {}: {kinds:?}",
        fx.seed
    );
    assert!(!kinds.contains(&"gate_up_swapped".to_string()));
    assert_eq!(out.json["mismatches"].as_array().unwrap().len(), 8);
}

#[test]
fn swizzled_scales_are_detected_and_compared_correctly() {
    let fx = fixture(3);
    let dump = fx.root.join("swz.safetensors");
    let out = fx.run_fused(
        &dump,
        &Faults {
            swizzle: true,
            ..Default::default()
        },
        &[],
        0,
    );
    let d = out.json["diagnoses"].as_array().unwrap();
    let sw = d.iter().find(|d| d["kind"] == "swizzled_scales").unwrap();
    assert_eq!(sw["fails"], false);
    assert_eq!(sw["tensors"], 9);
    // a fault behind the swizzle is still seen
    let dump2 = fx.root.join("swz-swap.safetensors");
    write_fused(
        &fx.model,
        &dump2,
        &Faults {
            swizzle: true,
            swap: vec![2],
            ..Default::default()
        },
    );
    let out = run(&fx.root, &[s(&fx.ckpt), s(&dump2)]);
    check(&out, 1, fx.seed);
    assert!(diag_kinds(&out.json).contains(&"gate_up_swapped".to_string()));
}

/// Some experts' block scales swizzled, the others' linear, in one fused tensor of a size
/// both layouts share: each expert compares fine after its own unswizzling, but a kernel reads
/// one layout for the whole tensor. It used to pass with a note that the scales are swizzled.
#[test]
fn scales_swizzled_for_some_experts_only_fail() {
    let fx = fixture_dims(4, 128, 64);
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(fx.seed ^ 3);
    let odd = r.gen_range(0..4);
    let dump = fx.root.join("mixed.safetensors");
    let out = fx.run_fused(
        &dump,
        &Faults {
            swizzle_only: vec![odd],
            ..Default::default()
        },
        &[],
        1,
    );
    let d = out.json["diagnoses"].as_array().unwrap();
    let mixed: Vec<&Value> = d
        .iter()
        .filter(|d| d["kind"] == "mixed_scale_layouts")
        .collect();
    // w13 and w2
    assert_eq!(mixed.len(), 2, "seed {}: {d:?}", fx.seed);
    for m in mixed {
        assert_eq!(m["experts"], serde_json::json!([odd]), "seed {}", fx.seed);
        assert_eq!(m["fails"], true);
        assert!(m["message"].as_str().unwrap().contains("one layout"));
    }
    // the odd expert's fused slices are listed under `mismatches`, where CI reads problems
    let listed = out.json["mismatches"].as_array().unwrap();
    assert!(
        !listed.is_empty()
            && listed.iter().all(|m| m["name"]
                .as_str()
                .unwrap()
                .contains(&format!("experts.{odd}."))
                && m["issues"][0]["kind"] == "scales"),
        "seed {}: {listed:?}",
        fx.seed
    );
    // nothing mismatched by value: the headline is the diagnosis (it read "; mixed_scale_layouts")
    let text = out.json["summary"]["text"].as_str().unwrap();
    assert!(
        text.starts_with("mixed_scale_layouts: layer ") && text.contains("one layout"),
        "seed {}: {text}",
        fx.seed
    );
    // every expert swizzled: one layout, a note
    let dump = fx.root.join("all.safetensors");
    let out = fx.run_fused(
        &dump,
        &Faults {
            swizzle_only: (0..4).collect(),
            ..Default::default()
        },
        &[],
        0,
    );
    assert_eq!(
        diag_kinds(&out.json),
        ["swizzled_scales"],
        "seed {}",
        fx.seed
    );
}

/// Block scales stored as U8 with the e4m3 bytes unchanged compare equal (the codes are A's),
/// and the dtype difference is a note naming the tensor: a loader that copies by value where it
/// should reinterpret changes them. It used to pass without a word.
#[test]
fn block_scales_stored_as_u8_with_the_same_bytes_get_a_note() {
    let fx = fixture(2 + (draw::<u8>() % 4) as usize);
    let dump = fx.root.join("u8.safetensors");
    let out = fx.run_fused(
        &dump,
        &Faults {
            w2_scales_u8_bytes: true,
            ..Default::default()
        },
        &[],
        0,
    );
    assert_eq!(out.json["summary"]["mismatched"], 0, "seed {}", fx.seed);
    let notes = out.json["notes"].to_string();
    assert!(
        notes.contains("w2_weight_scale") && notes.contains("U8") && notes.contains("F8_E4M3"),
        "seed {}: {notes}",
        fx.seed
    );
    // the same bytes tagged as another FP8 format: read by their dtype they are other values,
    // a mismatch on every down_proj (it passed with the note)
    let out = fx.run_fused(
        &dump,
        &Faults {
            w2_scales_e5m2_tag: true,
            ..Default::default()
        },
        &[],
        1,
    );
    let m = out.json["mismatches"].as_array().unwrap();
    assert!(
        !m.is_empty()
            && m.iter()
                .all(|u| u["name"].as_str().unwrap().contains("down_proj")
                    && u["issues"]
                        .to_string()
                        .contains("F8_E5M2 where A's are F8_E4M3")),
        "seed {}: {m:?}",
        fx.seed
    );
    // the reference's own dtype: no such note
    let out = fx.run_fused(&dump, &Faults::default(), &[], 0);
    assert!(
        !out.json["notes"].to_string().contains("U8"),
        "seed {}",
        fx.seed
    );
}

/// Packed codes stored as I8 with the same bytes are a dtype mismatch naming the tensor and
/// both dtypes: an int8 `>> 4` sign-extends the high nibble. It passed without a word.
#[test]
fn packed_codes_stored_as_i8_are_a_dtype_mismatch() {
    let fx = fixture(2 + (draw::<u8>() % 4) as usize);
    let dump = fx.root.join("i8.safetensors");
    let out = fx.run_fused(
        &dump,
        &Faults {
            w2_i8: true,
            ..Default::default()
        },
        &[],
        1,
    );
    let m = out.json["mismatches"].as_array().unwrap();
    assert_eq!(m.len(), fx.model.experts.len(), "seed {}: {m:?}", fx.seed);
    for u in m {
        let issues = u["issues"].to_string();
        assert!(
            u["name"].as_str().unwrap().contains("down_proj")
                && issues.contains("\"dtype\"")
                && issues.contains("w2_weight")
                && issues.contains("I8 where A's")
                && issues.contains("are U8"),
            "seed {}: {u}",
            fx.seed
        );
    }
}

/// Packed codes stored as F8_E4M3 with the same bytes are a dtype issue naming both tensors:
/// it read as a shape mismatch ("B [N, K/2] vs A [N, K/2] — dim 1 is 1/2 of A's: a tensor-parallel
/// shard?") with two equal shapes.
#[test]
fn packed_codes_stored_as_f8_are_a_dtype_mismatch() {
    let fx = fixture(2 + (draw::<u8>() % 4) as usize);
    let dump = fx.root.join("f8.safetensors");
    let out = fx.run_fused(
        &dump,
        &Faults {
            w2_f8: true,
            ..Default::default()
        },
        &[],
        1,
    );
    let m = out.json["mismatches"].as_array().unwrap();
    assert_eq!(m.len(), fx.model.experts.len(), "seed {}: {m:?}", fx.seed);
    for u in m {
        let issue = &u["issues"][0];
        let msg = issue["message"].as_str().unwrap();
        assert!(
            u["name"].as_str().unwrap().contains("down_proj")
                && issue["kind"] == "dtype"
                && msg.contains("w2_weight")
                && msg.contains("F8_E4M3")
                && msg.contains("packed FP4 codes")
                && !msg.contains("tensor-parallel"),
            "seed {}: {u}",
            fx.seed
        );
    }
}

/// Block scales converted to F8_E5M2 values (other bytes) are not said to hold "the same bytes"
/// (the message said so for every E5M2 tensor, with a run of spaces in the middle).
#[test]
fn block_scales_converted_to_e5m2_are_not_called_the_same_bytes() {
    let fx = fixture(2 + (draw::<u8>() % 3) as usize);
    let dump = fx.root.join("e5m2.safetensors");
    let out = fx.run_fused(
        &dump,
        &Faults {
            w2_scales_e5m2_values: true,
            ..Default::default()
        },
        &[],
        1,
    );
    let m = out.json["mismatches"].as_array().unwrap();
    assert_eq!(m.len(), fx.model.experts.len(), "seed {}: {m:?}", fx.seed);
    for u in m {
        let issues = u["issues"].to_string();
        assert!(
            issues.contains("F8_E5M2 where A's are F8_E4M3")
                && issues.contains("converted")
                && !issues.contains("the bytes are the same")
                && !issues.contains("   "),
            "seed {}: {u}",
            fx.seed
        );
    }
}

/// A global scale stored as F64 holding A's F32 values is equal after a conversion, not
/// bitwise equal: "bitwise" counts byte-identical tensors only (it counted it bitwise).
#[test]
fn a_global_scale_in_f64_is_equal_after_conversion_not_bitwise() {
    let fx = fixture(2 + (draw::<u8>() % 4) as usize);
    let e = fx.model.experts.len();
    let dump = fx.root.join("f64.safetensors");
    let out = fx.run_fused(
        &dump,
        &Faults {
            w2_scale_2_f64: true,
            ..Default::default()
        },
        &[],
        0,
    );
    let sm = &out.json["summary"];
    assert_eq!(sm["equal_after_conversion"], e, "seed {}: {sm}", fx.seed);
    assert!(
        sm["text"].as_str().unwrap().contains("F64"),
        "seed {}: {sm}",
        fx.seed
    );
}

/// Block scales converted to F32/BF16 values or to U8 integers, stored transposed, or of a
/// shape no layout fits are named as such, with the scale tensor; the dtype, the shape and the
/// transposed layout are `scales` issues. They used to read as "bytes fit neither the linear
/// nor the swizzled layout" (a layout problem, without the tensor), as `unreadable`, or as bare
/// "values differ" (the U8 values, the transposed shape, not looked at).
#[test]
fn converted_and_misshapen_block_scales_are_named() {
    let fx = fixture(2 + (draw::<u8>() % 3) as usize);
    let e = fx.model.experts.len();
    let scales = Some("scales");
    // B's scales as its dtype names them
    let (f32_, bf16_, u8_, e4m3) = (
        "(nvfp4, scales F32)",
        "(nvfp4, scales BF16)",
        "(nvfp4, scales U8)",
        "(nvfp4, scales F8_E4M3)",
    );
    for (faults, tensor, what, n, kind, b_scales) in [
        (
            Faults {
                w2_scales_f32: true,
                ..Default::default()
            },
            "w2_weight_scale",
            "stored as F32",
            e,
            scales,
            f32_,
        ),
        (
            Faults {
                w2_scales_bf16: true,
                ..Default::default()
            },
            "w2_weight_scale",
            "stored as BF16",
            e,
            scales,
            bf16_,
        ),
        (
            Faults {
                w2_scales_u8_values: true,
                ..Default::default()
            },
            "w2_weight_scale",
            "cast to integers",
            e,
            None,
            u8_,
        ),
        (
            Faults {
                w13_scales_transposed: true,
                ..Default::default()
            },
            "w13_weight_scale",
            "stored transposed",
            2 * e,
            scales,
            e4m3,
        ),
        (
            Faults {
                w2_scales_extra_col: true,
                ..Default::default()
            },
            "w2_weight_scale",
            "fit neither",
            e,
            scales,
            e4m3,
        ),
    ] {
        let dump = fx.root.join("scales.safetensors");
        write_fused(&fx.model, &dump, &faults);
        let out = run(&fx.root, &[s(&fx.ckpt), s(&dump)]);
        check(&out, 1, fx.seed);
        let mm = out.json["mismatches"].as_array().unwrap();
        assert_eq!(mm.len(), n, "seed {} {what}: {mm:?}", fx.seed);
        for m in mm {
            let issue = &m["issues"][0];
            let msg = issue["message"].as_str().unwrap();
            assert!(
                kind.is_none_or(|k| issue["kind"] == k)
                    && msg.contains(tensor)
                    && msg.contains(what),
                "seed {} {what}: {issue}",
                fx.seed
            );
            // A loaded fine: its shape and dtype are reported (they were empty where B's
            // scales could not be read)
            assert!(
                m["a_dtype"].as_str().is_some_and(|d| d.contains("nvfp4"))
                    && m["a_shape"].as_array().is_some_and(|v| v.len() == 2),
                "seed {} {what}: {m}",
                fx.seed
            );
            // and B says what it holds, from its headers where it could not be loaded (its
            // side stayed empty)
            assert!(
                m["b_dtype"].as_str().is_some_and(|d| d.contains(b_scales))
                    && m["b_shape"] == m["a_shape"],
                "seed {} {what}: {m}",
                fx.seed
            );
        }
        // the other way round: the side that cannot be loaded is A's
        let out = run(&fx.root, &[s(&dump), s(&fx.ckpt)]);
        check(&out, 1, fx.seed);
        for m in out.json["mismatches"].as_array().unwrap() {
            assert!(
                m["a_dtype"].as_str().is_some_and(|d| d.contains(b_scales))
                    && m["b_dtype"].as_str().is_some_and(|d| d.contains("nvfp4"))
                    && m["a_shape"] == m["b_shape"]
                    && m["a_shape"].as_array().is_some_and(|v| v.len() == 2),
                "seed {} {what} (swapped): {m}",
                fx.seed
            );
        }
    }
}

/// weight_scale_2 taken as the max over the layer's experts (an engine with one global scale
/// for the fused tensor), or over gate and up of each expert, is named with its numbers; experts
/// that really share one weight_scale_2 pass. The max over experts used to be ~3E bare
/// `scale_2` issues with no diagnosis.
#[test]
fn scale_2_max_over_experts_is_named() {
    let mut fx = fixture(4 + (draw::<u8>() % 3) as usize);
    let e = fx.model.experts.len();
    let dump = fx.root.join("max.safetensors");
    let max = |per_expert| Faults {
        scale_2_max: Some(per_expert),
        ..Default::default()
    };
    let out = fx.run_fused(&dump, &max(false), &[], 1);
    let d = out.json["diagnoses"].as_array().unwrap();
    let shared: Vec<&Value> = d
        .iter()
        .filter(|d| d["kind"] == "scale_2_shared_max")
        .collect();
    assert_eq!(shared.len(), 1, "seed {}: {d:?}", fx.seed);
    let msg = shared[0]["message"].as_str().unwrap();
    let m13 = fx
        .model
        .experts
        .iter()
        .flat_map(|x| [x.w1.scale_2, x.w3.scale_2])
        .fold(f32::MIN, f32::max);
    assert!(
        msg.contains("max over the layer's experts (one global scale for the fused tensor)")
            && msg.contains(&format!("{m13:e}"))
            && msg.contains("down_proj"),
        "seed {}: {msg}",
        fx.seed
    );
    // every unit off the max is a mismatch the diagnosis counts, and no other is named
    let mm = out.json["mismatches"].as_array().unwrap();
    let m2 = fx
        .model
        .experts
        .iter()
        .map(|x| x.w2.scale_2)
        .fold(f32::MIN, f32::max);
    let off = fx
        .model
        .experts
        .iter()
        .flat_map(|x| [(x.w1.scale_2, m13), (x.w3.scale_2, m13), (x.w2.scale_2, m2)])
        .filter(|(v, m)| v != m)
        .count();
    assert!(off >= 2 * e - 2, "seed {}", fx.seed);
    assert_eq!(mm.len(), off, "seed {}", fx.seed);
    assert_eq!(shared[0]["tensors"].as_u64(), Some(mm.len() as u64));
    assert_eq!(
        diag_kinds(&out.json),
        vec!["scale_2_shared_max"],
        "seed {}",
        fx.seed
    );
    // gate and up of each expert: the smaller one raised. An up raised alone reads as the
    // gate-only w13 scale; a raised gate is only the max
    let gate_raised = fx.model.experts.iter().any(|x| x.w1.scale_2 < x.w3.scale_2);
    let out = fx.run_fused(&dump, &max(true), &[], 1);
    let kinds = diag_kinds(&out.json);
    if gate_raised {
        assert_eq!(kinds, vec!["scale_2_shared_max"], "seed {}", fx.seed);
        let msg = out.json["diagnoses"][0]["message"].as_str().unwrap();
        assert!(
            msg.contains("larger of their two"),
            "seed {}: {msg}",
            fx.seed
        );
    } else {
        assert_eq!(kinds, vec!["scale_2_gate_only"], "seed {}", fx.seed);
    }
    // experts that do share one weight_scale_2: the max is theirs, nothing is named
    let one = fx.model.experts[0].w2.scale_2;
    for x in &mut fx.model.experts {
        for t in [&mut x.w1, &mut x.w3, &mut x.w2] {
            t.scale_2 = one;
        }
    }
    fx.model.write_hf(&fx.ckpt);
    for per_expert in [false, true] {
        let out = fx.run_fused(&dump, &max(per_expert), &[], 0);
        assert!(diag_kinds(&out.json).is_empty(), "seed {}", fx.seed);
    }
}

/// weight_scale_2 and input_scale exchanged (a loader mapping the two scalars by position) is
/// named as the swap. It used to be two unrelated issues a tensor ("weight_scale_2: B …, A …",
/// "input_scale: B …, A …") and no diagnosis.
/// An EP rank's dump whose weight_scale_2 is the max over ALL the layer's experts (taken on the
/// full checkpoint before sharding), the max held by an expert outside the rank's block: named
/// `scale_2_shared_max` with that expert. The check looked for the max over the rank's experts
/// only, and left 3E/N bare `scale_2` mismatches unnamed; experts that share one value pass.
#[test]
fn scale_2_max_over_all_experts_under_ep_is_named() {
    let n = 2 + (draw::<u8>() % 2) as usize;
    let per = 2 + (draw::<u8>() % 2) as usize;
    let mut fx = fixture(n * per);
    // one expert's gate_proj above all others (scale_2 values tie often enough to matter)
    let x13 = (fx.seed as usize / 7) % (n * per);
    let m13 = 1.5
        * fx.model
            .experts
            .iter()
            .flat_map(|x| [x.w1.scale_2, x.w3.scale_2])
            .fold(f32::MIN, f32::max);
    fx.model.experts[x13].w1.scale_2 = m13;
    fx.model.write_hf(&fx.ckpt);
    // a rank that does not hold the max's expert
    let er = (x13 / per + 1 + (fx.seed as usize) % (n - 1)) % n;
    let (ers, ns) = (er.to_string(), n.to_string());
    let what = format!("seed {} rank {er} of {n}, max at expert {x13}", fx.seed);
    let dump = fx.root.join("max_all.safetensors");
    let f = Faults {
        ep: Some((er, n)),
        scale_2_max_all: true,
        ..Default::default()
    };
    let args = ["--ep-rank", ers.as_str(), "--ep-size", ns.as_str()];
    let out = fx.run_fused(&dump, &f, &args, 1);
    let d = out.json["diagnoses"].as_array().unwrap();
    assert_eq!(
        diag_kinds(&out.json),
        vec!["scale_2_shared_max"],
        "{what}: {d:?}"
    );
    let msg = d[0]["message"].as_str().unwrap();
    assert!(
        msg.contains(&format!(
            "{m13:e}, the max over all {} of the layer's experts in A: expert {x13}'s gate_proj, \
             outside EP rank {er}'s experts",
            n * per
        )) && msg.contains("for every expert's gate_proj and up_proj"),
        "{what}: {msg}"
    );
    // every unit of the rank off the max is a mismatch the diagnosis counts
    let m2 = fx
        .model
        .experts
        .iter()
        .map(|x| x.w2.scale_2)
        .fold(f32::MIN, f32::max);
    let off = fx.model.experts[er * per..(er + 1) * per]
        .iter()
        .flat_map(|x| [(x.w1.scale_2, m13), (x.w3.scale_2, m13), (x.w2.scale_2, m2)])
        .filter(|(v, m)| v != m)
        .count();
    let mm = out.json["mismatches"].as_array().unwrap();
    assert!(off >= 2 * per, "{what}");
    assert_eq!(mm.len(), off, "{what}");
    assert_eq!(d[0]["tensors"].as_u64(), Some(off as u64), "{what}");
    // experts that do share one weight_scale_2: the max is theirs, nothing is named
    let one = fx.model.experts[0].w2.scale_2;
    for x in &mut fx.model.experts {
        for t in [&mut x.w1, &mut x.w3, &mut x.w2] {
            t.scale_2 = one;
        }
    }
    fx.model.write_hf(&fx.ckpt);
    let out = fx.run_fused(&dump, &f, &args, 0);
    assert!(diag_kinds(&out.json).is_empty(), "{what}");
}

#[test]
fn scale_2_and_input_scale_swapped_are_named() {
    let fx = fixture(2);
    let dump = fx.root.join("ws2-in.safetensors");
    let out = fx.run_fused(
        &dump,
        &Faults {
            swap_scale_2_input: true,
            ..Default::default()
        },
        &[],
        1,
    );
    assert_eq!(
        diag_kinds(&out.json),
        ["scale_2_input_scale_swapped"],
        "seed {}: {}",
        fx.seed,
        out.stdout
    );
    let d = &out.json["diagnoses"][0];
    assert_eq!(d["tensors"], 6);
    assert_eq!(d["experts"], serde_json::json!([0, 1]));
    for m in out.json["mismatches"].as_array().unwrap() {
        let kinds: Vec<&str> = m["issues"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| i["kind"].as_str().unwrap())
            .collect();
        assert_eq!(kinds, ["scale_2_input_scale_swapped"], "seed {}", fx.seed);
    }
}

#[test]
fn scale_2_flipped_and_gate_only_scale_2_are_named() {
    let fx = fixture(3);
    let dump = fx.root.join("flip.safetensors");
    let out = fx.run_fused(
        &dump,
        &Faults {
            flip_w2_scale_2: true,
            ..Default::default()
        },
        &[],
        1,
    );
    let d = out.json["diagnoses"].as_array().unwrap();
    let f = d
        .iter()
        .find(|d| d["kind"] == "scale_2_flipped")
        .unwrap_or_else(|| panic!("{d:?}"));
    assert_eq!(f["tensors"], 3);
    let mm = out.json["mismatches"].as_array().unwrap();
    assert_eq!(mm.len(), 3);
    assert!(mm
        .iter()
        .all(|m| m["name"].as_str().unwrap().ends_with("down_proj.weight")));

    let dump = fx.root.join("gate-only.safetensors");
    let out = fx.run_fused(
        &dump,
        &Faults {
            gate_only_scale_2: true,
            ..Default::default()
        },
        &[],
        1,
    );
    let d = out.json["diagnoses"].as_array().unwrap();
    let g = d
        .iter()
        .find(|d| d["kind"] == "scale_2_gate_only")
        .unwrap_or_else(|| panic!("{d:?}"));
    // every expert whose gate and up weight_scale_2 differ: two random BF16 tensors can share
    // their amax (~1 expert in 300: seed 628445739060184811's expert 0), and then the gate's
    // value is the up's own
    let differ: Vec<usize> = (fx.model.experts.iter().enumerate())
        .filter(|(_, x)| x.w1.scale_2 != x.w3.scale_2)
        .map(|(e, _)| e)
        .collect();
    assert!(!differ.is_empty(), "seed {}", fx.seed);
    assert_eq!(
        g["experts"],
        serde_json::json!(differ),
        "seed {}: {d:?}",
        fx.seed
    );
    assert!(out
        .json
        .to_string()
        .contains("vLLM keeps only w1's weight_scale_2"));
}

/// A dump with a NaN block scale in one expert's down projection, compared with the
/// checkpoint, the dump as B or (`dump_as_a`) as A: that unit's one issue message, and the
/// fixture's seed.
fn nan_scale_message(dump_as_a: bool) -> (String, u64) {
    let fx = fixture(3);
    let bad = rand_chacha::ChaCha8Rng::seed_from_u64(fx.seed).gen_range(0..3);
    let dump = fx.root.join("nan.safetensors");
    write_fused(
        &fx.model,
        &dump,
        &Faults {
            nan_scale: Some(bad),
            ..Default::default()
        },
    );
    let (a, b) = if dump_as_a {
        (&dump, &fx.ckpt)
    } else {
        (&fx.ckpt, &dump)
    };
    let out = run(&fx.root, &[s(a), s(b)]);
    let issues = sole_down_mismatch(
        &out,
        bad,
        fx.seed,
        &format!("NaN scale, dump as A: {dump_as_a}"),
    );
    (issues[0]["message"].as_str().unwrap().to_string(), fx.seed)
}

/// A block scale holding the e4m3 NaN code: the NaN in B is traced to it (it used to give
/// only the NaN count).
#[test]
fn nan_block_scale_is_located() {
    let (msg, seed) = nan_scale_message(false);
    assert!(
        msg.contains("1 block scale(s) hold the e4m3 NaN code, first at row 1 block 1 (0x7F)"),
        "seed {seed}: {msg}"
    );
}

/// The same NaN block scale on the reference side (the dump as A): the NaN difference
/// takes `max_abs_err`, and the message points at A's first NaN value (it gave a finite
/// maximum from elsewhere, or NaN at no place, by the order the pieces ran in).
#[test]
fn nan_in_the_reference_is_located() {
    let (msg, seed) = nan_scale_message(true);
    assert!(
        msg.contains("max_abs_err NaN; A (the reference) is NaN at row 1, column 16"),
        "seed {seed}: {msg}"
    );
}

/// A dump whose loader dropped (or renamed) a packed weight or its block scales: a finding
/// of the dump, listed under `missing` (and the renamed tensor under `extra`) with the unit
/// named, exit 1. It was exit 2, "block scales without their packed weight", with no report.
/// The reference missing one stays bad input (exit 2).
#[test]
fn a_dump_missing_a_packed_weight_or_its_scales_lists_them_as_missing() {
    let fx = fixture(3);
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(fx.seed);
    let e = r.gen_range(0..3);
    let base = format!("model.layers.{LAYER}.mlp.experts.{e}.down_proj");
    for (member, rename) in [
        ("weight", false),
        ("weight_scale", false),
        ("weight_scale", true),
    ] {
        let what = format!("{member}{}", if rename { " renamed" } else { " dropped" });
        let name = format!("{base}.{member}");
        let mut v = fx.model.hf_tensors();
        if rename {
            let t = v.iter_mut().find(|(t, _)| t.name == name).unwrap();
            t.0.name = format!("{base}.weight_scale_inv");
        } else {
            v.retain(|(t, _)| t.name != name);
        }
        let dump = fx.root.join("incomplete.safetensors");
        write_file(&dump, v, None).unwrap();
        let out = run(&fx.root, &[s(&fx.ckpt), s(&dump)]);
        let issues = sole_down_mismatch(&out, e, fx.seed, &what);
        assert_eq!(
            issues[0]["kind"], "missing_member",
            "seed {} {what}",
            fx.seed
        );
        assert_eq!(
            out.json["missing"],
            serde_json::json!([name]),
            "seed {} {what}",
            fx.seed
        );
        let extra = if rename {
            serde_json::json!([format!("{base}.weight_scale_inv")])
        } else {
            serde_json::json!([])
        };
        assert_eq!(out.json["extra"], extra, "seed {} {what}", fx.seed);
        // the same file as the reference: bad input
        let out = run(&fx.root, &[s(&dump), s(&fx.ckpt)]);
        check(&out, 2, fx.seed);
        assert!(
            out.stderr.contains(&base),
            "seed {} {what}: {}",
            fx.seed,
            out.stderr
        );
    }
}

/// Swizzled block scales with a nonzero byte in the swizzle's padding: the size is the swizzled
/// layout's, so the message says the padding is what rules it out (it said the bytes "fit
/// neither … nor the swizzled [128, 4] (512)" layout, of the very size they have).
#[test]
fn swizzled_scales_with_dirty_padding_are_named_as_such() {
    let fx = fixture(2);
    let (h, i) = (fx.model.h, fx.model.i);
    assert!(h < 128 && i / 16 < 4, "the fixture's w2 scales are padded");
    let dump = fx.root.join("dirty-padding.safetensors");
    write_fused(
        &fx.model,
        &dump,
        &Faults {
            swizzle: true,
            ..Default::default()
        },
    );
    // expert 0's row m = 100 (past its h rows), block 0: offset (m % 32) * 16 + (m / 32 % 4) * 4
    let m = 100;
    edit_tensor(&dump, "w2_weight_scale", |k, b| {
        if k == (m % 32) * 16 + (m / 32 % 4) * 4 {
            *b = 0x38;
        }
    });
    let out = run(&fx.root, &[s(&fx.ckpt), s(&dump)]);
    let issues = sole_down_mismatch(&out, 0, fx.seed, "dirty padding");
    let msg = issues[0]["message"].as_str().unwrap();
    assert!(
        msg.contains("are the size of the swizzled [128, 4] layout, but its padding")
            && msg.contains(&format!("rows past {h} or blocks past {}", i / 16)),
        "seed {}: {msg}",
        fx.seed
    );
}

/// A dump whose encoding is the checkpoint's (one dtype, one global scale) but with one value
/// changed: one FP4 code, one block scale, one BF16 router weight. Each is a mismatch, however
/// close its cosine (a copy changes no value; it passed as "close after dequantization"), and
/// the changed block is located. And the other way: another global scale with every block
/// scale making up for it is the same values, a pass with a note.
#[test]
fn one_changed_value_under_the_same_encoding_is_a_mismatch() {
    let fx = fixture(2);
    let (h, i) = (fx.model.h, fx.model.i);
    let clean = fx.root.join("clean.safetensors");
    fx.run_fused(&clean, &Faults::default(), &[], 0);
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(fx.seed);
    let (e, row) = (r.gen_range(0..2), r.gen_range(0..h));
    let expert = |at: usize, per_expert: usize| at / per_expert == e;
    // w2_weight [E, H, I/2]: one code of expert e, row `row`, block `blk`
    let blk = r.gen_range(0..i / 16);
    let code_at = (e * h + row) * i / 2 + blk * 8 + r.gen_range(0..8);
    // w2_weight_scale [E, H, I/16]: one scale, one step
    let scale_at = (e * h + row) * (i / 16) + blk;
    for (what, suffix, at, kind) in [
        ("code", "w2_weight", code_at, "its codes"),
        ("scale", "w2_weight_scale", scale_at, "its scale"),
    ] {
        let dump = fx.root.join(format!("one-{what}.safetensors"));
        std::fs::copy(&clean, &dump).unwrap();
        edit_tensor(&dump, suffix, |k, b| {
            if k == at {
                *b = match what {
                    "code" => *b ^ 0x11,
                    // 448, the tensor's largest block's, one step down
                    _ if *b & 0x7F == 0x7E => *b - 1,
                    _ => *b + 1,
                };
            }
        });
        let out = run(&fx.root, &[s(&fx.ckpt), s(&dump)]);
        let issues = sole_down_mismatch(&out, e, fx.seed, what);
        let msg = issues[0]["message"].as_str().unwrap();
        assert!(
            msg.contains(&format!(
                "1 of {} blocks differ under the same global scale",
                h * i / 16
            )) && msg.contains(&format!("the first at row {row}, block {blk} ({kind})")),
            "seed {} {what}: {msg}",
            fx.seed
        );
        assert_eq!(issues[0]["kind"], "values", "seed {} {what}", fx.seed);
    }
    // one router weight (BF16 on both sides) negated
    let dump = fx.root.join("one-router-weight.safetensors");
    std::fs::copy(&clean, &dump).unwrap();
    let at = 2 * r.gen_range(0..2 * h) + 1;
    edit_tensor(&dump, "mlp.gate.weight", |k, b| {
        if k == at {
            *b ^= 0x80;
        }
    });
    let out = run(&fx.root, &[s(&fx.ckpt), s(&dump)]);
    check(&out, 1, fx.seed);
    let m = &out.json["mismatches"][0];
    let msg = m["issues"][0]["message"].as_str().unwrap();
    assert!(
        m["name"].as_str().unwrap().ends_with("mlp.gate.weight")
            && msg.contains(&format!("at row {}, column {}", at / 2 / h, at / 2 % h))
            && msg.contains("both sides BF16: a copy changes no value"),
        "seed {}: {m}",
        fx.seed
    );
    // expert e's down_proj re-encoded: weight_scale_2 doubled, every block scale halved (one
    // less in the e4m3 exponent; these scales are all normal e4m3 above 2^-5)
    let dump = fx.root.join("re-encoded.safetensors");
    let d = &fx.model.experts[e].w2;
    write_fused(
        &fx.model,
        &dump,
        &Faults {
            w2_scale_2_set: Some((e, 2.0 * d.scale_2)),
            ..Default::default()
        },
    );
    let per = h * i / 16;
    edit_tensor(&dump, "w2_weight_scale", |k, b| {
        if expert(k, per) && *b & 0x7F != 0 {
            assert!(*b & 0x78 >= 0x10, "seed {}: scale {b:#04x}", fx.seed);
            *b -= 0x08;
        }
    });
    let out = run(&fx.root, &[s(&fx.ckpt), s(&dump)]);
    check(&out, 0, fx.seed);
    let close = out.json["close"].as_array().unwrap();
    assert_eq!(close.len(), 1, "seed {}: {close:?}", fx.seed);
    assert!(
        close[0]["name"]
            .as_str()
            .unwrap()
            .contains(&format!("experts.{e}.down_proj"))
            && close[0]["notes"].to_string().contains(
                "weight_scale_2 ×2.000000 with the block scales making up for it; the \
                 dequantized values are identical"
            ),
        "seed {}: {close:?}",
        fx.seed
    );
}

/// weight_scale_2 kept in BF16 by the engine: the difference is named as BF16 rounding (it
/// was a bare "weight_scale_2: B …, A … (×0.998)").
#[test]
fn scale_2_rounded_to_bf16_is_named() {
    let fx = fixture(2);
    let dump = fx.root.join("bf16-scale-2.safetensors");
    let out = fx.run_fused(
        &dump,
        &Faults {
            w2_scale_2_bf16: true,
            ..Default::default()
        },
        &[],
        1,
    );
    let m = out.json["mismatches"].as_array().unwrap();
    // each of the 2 experts' down_proj, unless its weight_scale_2 lies so close to a BF16 value
    // that the rounding stays within --min-cosine (seeds 16322066112360010897 and
    // 15298675997728029233 left one expert within it)
    assert!((1..=2).contains(&m.len()), "seed {}: {m:?}", fx.seed);
    for u in m {
        assert!(u["name"].as_str().unwrap().ends_with("down_proj.weight"));
        let msg = u["issues"][0]["message"].as_str().unwrap();
        assert!(msg.contains("rounded to BF16"), "seed {}: {msg}", fx.seed);
    }
}

/// An engine's weight_scale_2 or input_scale of +inf / -inf for one expert is a mismatch (the
/// relative tolerance against an infinity is infinite: it passed as "differs in the last bits").
#[test]
fn infinite_scalars_in_b_are_mismatches() {
    let fx = fixture(3);
    let bad = rand_chacha::ChaCha8Rng::seed_from_u64(fx.seed).gen_range(0..3);
    for (what, v) in [
        ("weight_scale_2", f32::INFINITY),
        ("weight_scale_2", f32::NEG_INFINITY),
        ("input_scale", f32::INFINITY),
    ] {
        let dump = fx.root.join(format!("inf-{what}-{v}.safetensors"));
        let faults = if what == "weight_scale_2" {
            Faults {
                w2_scale_2_set: Some((bad, v)),
                ..Default::default()
            }
        } else {
            Faults {
                w2_input_scale_set: Some((bad, v)),
                ..Default::default()
            }
        };
        write_fused(&fx.model, &dump, &faults);
        let out = run(&fx.root, &[s(&fx.ckpt), s(&dump)]);
        let issues = sole_down_mismatch(&out, bad, fx.seed, &format!("{what} {v}"));
        let msg = issues[0]["message"].as_str().unwrap();
        assert!(
            msg.contains(what) && msg.contains("inf"),
            "seed {} {what} {v}: {msg}",
            fx.seed
        );
    }
}

/// An expert whose w2 codes are all zero (the engine allocated it and never loaded it) is named
/// as such; it read as a bare "values differ: cosine 0.000000".
#[test]
fn an_expert_never_loaded_is_named_all_zero() {
    let fx = fixture(3);
    let bad = rand_chacha::ChaCha8Rng::seed_from_u64(fx.seed).gen_range(0..3);
    let dump = fx.root.join("zero.safetensors");
    write_fused(
        &fx.model,
        &dump,
        &Faults {
            w2_zero: Some(bad),
            ..Default::default()
        },
    );
    let out = run(&fx.root, &[s(&fx.ckpt), s(&dump)]);
    let msg = sole_down_mismatch(&out, bad, fx.seed, "never loaded").to_string();
    assert!(
        msg.contains("B is all zeros") && msg.contains("never loaded"),
        "seed {}: {msg}",
        fx.seed
    );
}

/// A full fused dump compared as one EP rank's shard: its indices past the rank's experts are
/// extra and the ep_shard diagnosis says how many experts B holds. It was exit 2, "stands for
/// `…w13_weight[2]`, which fused expert index 2 … stands for as well" (gate and up of one
/// index shared a key).
#[test]
fn a_full_dump_compared_as_an_ep_shard_is_named() {
    let fx = fixture(4);
    let dump = fx.root.join("full.safetensors");
    let out = fx.run_fused(
        &dump,
        &Faults::default(),
        &["--ep-rank", "0", "--ep-size", "2"],
        1,
    );
    let d = out.json["diagnoses"].as_array().unwrap();
    let e = d
        .iter()
        .find(|d| d["kind"] == "ep_shard")
        .unwrap_or_else(|| panic!("seed {}: {d:?}", fx.seed));
    assert!(
        e["message"]
            .as_str()
            .unwrap()
            .contains("hold 4 experts; EP rank 0 of 2 (linear) holds 2"),
        "{e}"
    );
    // indices 2 and 3: gate, up and down each
    assert_eq!(
        out.json["extra"].as_array().unwrap().len(),
        6,
        "{}",
        out.stdout
    );
}

#[test]
fn missing_and_extra_tensors_are_listed() {
    let fx = fixture(2);
    let dump = fx.root.join("me.safetensors");
    let out = fx.run_fused(
        &dump,
        &Faults {
            drop_and_add: true,
            ..Default::default()
        },
        &[],
        1,
    );
    assert_eq!(
        out.json["missing"],
        serde_json::json!([format!(
            "model.layers.{LAYER}.mlp.shared_experts.down_proj.weight"
        )])
    );
    assert_eq!(
        out.json["extra"],
        serde_json::json!([format!("model.layers.{LAYER}.mlp.experts.w13_bias")])
    );
    assert_eq!(out.json["summary"]["mismatched"], 0);
}

#[test]
fn vllm_processed_state_dict_and_its_derived_scales() {
    let seed: u64 = draw();
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let dir = tempfile::tempdir().unwrap();
    let model = Model::new(&mut r, 4).with_shared_w13_scale();
    let ckpt = dir.path().join("ckpt");
    model.write_hf(&ckpt);
    for global in [false, true] {
        let dump = dir.path().join(format!("processed-{global}.safetensors"));
        write_fused(
            &model,
            &dump,
            &Faults {
                processed: Some(global),
                ..Default::default()
            },
        );
        let out = run(dir.path(), &[s(&ckpt), s(&dump)]);
        check(&out, 0, seed);
        let notes = out.json["notes"].to_string();
        assert!(notes.contains("`g1_alphas` agrees"), "{notes}");
        assert_eq!(notes.contains("global scale"), global, "{notes}");
        assert_eq!(out.json["extra"].as_array().unwrap().len(), 0);
    }
    let bad = r.gen_range(0..4);
    let dump = dir.path().join("bad-alpha.safetensors");
    write_fused(
        &model,
        &dump,
        &Faults {
            processed: Some(false),
            bad_alpha: Some(bad),
            ..Default::default()
        },
    );
    let out = run(dir.path(), &[s(&ckpt), s(&dump)]);
    check(&out, 1, seed);
    let d = out.json["diagnoses"].as_array().unwrap();
    let a = d
        .iter()
        .find(|d| d["kind"] == "derived_scale")
        .unwrap_or_else(|| panic!("seed {seed}: {d:?}"));
    assert_eq!(a["experts"], serde_json::json!([bad]));
    assert!(a["message"].as_str().unwrap().contains("g1_alphas"));
    // vLLM's processing with a checkpoint whose w1 and w3 scale_2 differ: the gate-only bug
    let model2 = Model::new(&mut r, 2);
    let ckpt2 = dir.path().join("ckpt2");
    model2.write_hf(&ckpt2);
    let dump = dir.path().join("processed2.safetensors");
    write_fused(
        &model2,
        &dump,
        &Faults {
            processed: Some(false),
            ..Default::default()
        },
    );
    let out = run(dir.path(), &[s(&ckpt2), s(&dump)]);
    check(&out, 1, seed);
    assert!(diag_kinds(&out.json).contains(&"scale_2_gate_only".to_string()));
}

#[test]
fn expert_permutation_is_named() {
    let fx = fixture(4);
    let dump = fx.root.join("perm.safetensors");
    let out = fx.run_fused(
        &dump,
        &Faults {
            order: Some(vec![1, 0, 2, 3]),
            ..Default::default()
        },
        &[],
        1,
    );
    let d = out.json["diagnoses"].as_array().unwrap();
    let p = d
        .iter()
        .find(|d| d["kind"] == "expert_permutation")
        .unwrap_or_else(|| panic!("seed {}: {d:?}", fx.seed));
    assert_eq!(p["experts"], serde_json::json!([0, 1]));
    assert!(p["message"].as_str().unwrap().contains("0←1"));
}

/// One expert loaded into two slots (B's expert 3 holds A's expert 0, which is also in its
/// own slot): a duplicate, with A's expert 3 lost. It was named "every one is off by -3: local
/// expert ids where global ids belong (an EP rank offset?)" from that single pair.
#[test]
fn an_expert_loaded_twice_is_not_an_ep_offset() {
    let fx = fixture(4);
    let dump = fx.root.join("dup.safetensors");
    let out = fx.run_fused(
        &dump,
        &Faults {
            order: Some(vec![0, 1, 2, 0]),
            ..Default::default()
        },
        &[],
        1,
    );
    let d = out.json["diagnoses"].as_array().unwrap();
    let p = d
        .iter()
        .find(|d| d["kind"] == "expert_permutation")
        .unwrap_or_else(|| panic!("seed {}: {d:?}", fx.seed));
    let msg = p["message"].as_str().unwrap();
    assert!(
        msg.contains("A's expert 0 is in B's experts 0, 3: loaded twice, and A's expert(s) 3 in no slot of B"),
        "seed {}: {msg}",
        fx.seed
    );
    assert!(!msg.contains("EP rank offset"), "seed {}: {msg}", fx.seed);
}

/// Experts large enough (gate/up 128 KiB of codes) that their fingerprints are sampled:
/// the sampled fingerprints nominate, the full ones confirm, and both bugs are still named,
/// alone.
#[test]
fn swaps_and_permutations_are_named_in_experts_past_the_fingerprint_sample() {
    let fx = fixture_dims(3, 1024, 256);
    for (faults, kind, experts) in [
        (
            Faults {
                order: Some(vec![2, 1, 0]),
                ..Default::default()
            },
            "expert_permutation",
            serde_json::json!([0, 2]),
        ),
        (
            Faults {
                swap: vec![1],
                ..Default::default()
            },
            "gate_up_swapped",
            serde_json::json!([1]),
        ),
    ] {
        let dump = fx.root.join(format!("{kind}.safetensors"));
        write_fused(&fx.model, &dump, &faults);
        let out = run(&fx.root, &[s(&fx.ckpt), s(&dump)]);
        check(&out, 1, fx.seed);
        let d = out.json["diagnoses"].as_array().unwrap();
        let found = d
            .iter()
            .find(|d| d["kind"] == kind)
            .unwrap_or_else(|| panic!("seed {}: {d:?}", fx.seed));
        assert_eq!(found["experts"], experts, "seed {}", fx.seed);
        // B's scale tensors have 128-row multiples, so their layout is ambiguous by size: a
        // unit holding another tensor must not be called swizzled because one wrong reading
        // came out nearer than the other
        assert_eq!(diag_kinds(&out.json), [kind], "seed {}", fx.seed);
    }
}

#[test]
fn tp_and_ep_shards_are_compared_against_the_right_slice() {
    let fx = fixture(4);
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(fx.seed ^ 2);
    let tr = r.gen_range(0..2);
    let dump = fx.root.join("tp.safetensors");
    write_fused(
        &fx.model,
        &dump,
        &Faults {
            tp: Some((tr, 2)),
            ..Default::default()
        },
    );
    let trs = tr.to_string();
    let out = run(
        &fx.root,
        &[s(&fx.ckpt), s(&dump), "--tp-rank", &trs, "--tp-size", "2"],
    );
    check(&out, 0, fx.seed);
    assert_eq!(out.json["summary"]["equal"], out.json["summary"]["units"]);
    // the other rank's slice does not match, and the rank B holds is named (it used to be a
    // bare "values differ")
    let other = (1 - tr).to_string();
    let out = run(
        &fx.root,
        &[s(&fx.ckpt), s(&dump), "--tp-rank", &other, "--tp-size", "2"],
    );
    check(&out, 1, fx.seed);
    let d = out.json["diagnoses"].as_array().unwrap();
    let t: Vec<&Value> = d.iter().filter(|d| d["kind"] == "tp_rank").collect();
    // every expert's gate, up and down (layer 1), the shared expert's three and the
    // embedding (no layer)
    assert_eq!(
        t.iter()
            .map(|d| d["tensors"].as_u64().unwrap())
            .sum::<u64>(),
        16,
        "seed {}: {d:?}",
        fx.seed
    );
    for d in t {
        assert!(
            d["message"]
                .as_str()
                .unwrap()
                .contains(&format!("B holds TP rank {tr}'s slice")),
            "seed {}: {d}",
            fx.seed
        );
    }
    assert_eq!(out.json["summary"]["mismatched"], 16, "seed {}", fx.seed);
    // without --tp-size the shapes are named as a likely shard
    let out = run(&fx.root, &[s(&fx.ckpt), s(&dump)]);
    check(&out, 1, fx.seed);
    assert!(out.json.to_string().contains("tensor-parallel shard"));

    let er = r.gen_range(0..2);
    let dump = fx.root.join("ep.safetensors");
    write_fused(
        &fx.model,
        &dump,
        &Faults {
            ep: Some((er, 2)),
            ..Default::default()
        },
    );
    let ers = er.to_string();
    let out = run(
        &fx.root,
        &[s(&fx.ckpt), s(&dump), "--ep-rank", &ers, "--ep-size", "2"],
    );
    check(&out, 0, fx.seed);
    assert_eq!(out.json["summary"]["skipped_ep"], 6);
    let other = (1 - er).to_string();
    let out = run(
        &fx.root,
        &[s(&fx.ckpt), s(&dump), "--ep-rank", &other, "--ep-size", "2"],
    );
    check(&out, 1, fx.seed);
    // rank `er`'s experts under the other rank's names: named as that rank's
    assert!(
        diag_kinds(&out.json).contains(&"ep_rank".to_string()),
        "seed {}: {}",
        fx.seed,
        out.stdout
    );
}

/// B's experts exactly another EP rank's set (round-robin or linear, 4 ranks): named
/// `ep_rank`, "B holds EP rank k's experts". They were an `expert_permutation` "off by 1:
/// local expert ids where global ids belong", as was a linear shift of the ids by one, which
/// is neither; global ids 0..n read as a round-robin rank's are the local-ids case.
#[test]
fn another_ep_ranks_experts_are_named_as_that_rank() {
    let per = 2 + (draw::<u8>() % 2) as usize;
    let fx = fixture(4 * per);
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(fx.seed ^ 11);
    let n = 4;
    let rr = r.gen_bool(0.5);
    let rank = r.gen_range(1..n - 1);
    let k = (rank + r.gen_range(1..n)) % n;
    let set = |q: usize| -> Vec<usize> {
        if rr {
            (0..per).map(|l| q + l * n).collect()
        } else {
            (q * per..(q + 1) * per).collect()
        }
    };
    let placement = if rr { "round-robin" } else { "linear" };
    let ranks = rank.to_string();
    let args = [
        "--ep-rank",
        ranks.as_str(),
        "--ep-size",
        "4",
        "--placement",
        placement,
    ];
    // B's slots (written as linear rank `rank` of 4) hold `slots`
    let with_slots = |name: &str, slots: Vec<usize>| -> Run {
        let mut order: Vec<usize> = (0..4 * per).collect();
        order[rank * per..(rank + 1) * per].copy_from_slice(&slots);
        let dump = fx.root.join(name);
        fx.run_fused(
            &dump,
            &Faults {
                order: Some(order),
                ep: Some((rank, n)),
                ..Default::default()
            },
            &args,
            1,
        )
    };
    let what = format!("seed {} {placement} rank {rank}", fx.seed);
    let out = with_slots("other.safetensors", set(k));
    let d = out.json["diagnoses"].as_array().unwrap();
    let e = d
        .iter()
        .find(|d| d["kind"] == "ep_rank")
        .unwrap_or_else(|| panic!("{what} k {k}: {d:?}"));
    let msg = e["message"].as_str().unwrap();
    assert!(
        msg.contains(&format!("B holds EP rank {k}'s experts"))
            && msg.contains(&format!("not rank {rank}'s")),
        "{what} k {k}: {msg}"
    );
    assert_eq!(e["experts"], serde_json::json!(set(rank)), "{what}");
    assert!(!diag_kinds(&out.json).contains(&"expert_permutation".to_string()));
    // local ids where global ones belong: linear rank 0's set, or under round-robin a set of
    // no rank
    let out = with_slots("local.safetensors", (0..per).collect());
    let d = out.json["diagnoses"].as_array().unwrap();
    let kind = if rr { "expert_permutation" } else { "ep_rank" };
    let msg = d
        .iter()
        .find(|d| d["kind"] == kind)
        .unwrap_or_else(|| panic!("{what}: {d:?}"))["message"]
        .as_str()
        .unwrap();
    assert!(
        msg.contains("local expert ids read as global"),
        "{what}: {msg}"
    );
    // every id one too high: an id offset, not local ids
    if !rr {
        let out = with_slots(
            "shift.safetensors",
            set(rank).iter().map(|g| g + 1).collect(),
        );
        let d = out.json["diagnoses"].as_array().unwrap();
        let msg = d
            .iter()
            .find(|d| d["kind"] == "expert_permutation")
            .unwrap_or_else(|| panic!("{what}: {d:?}"))["message"]
            .as_str()
            .unwrap();
        assert!(
            msg.contains("off by 1") && !msg.contains("local expert ids"),
            "{what}: {msg}"
        );
    }
}

/// The row-parallel down projections (every expert's w2, the shared expert's down_proj) split
/// across TP along their output rows H instead of K: each is a bitwise 1/n slice of A, so it
/// passed as "B is TP rows … of A". The split axis is the module's, not whichever dim fits.
#[test]
fn a_down_projection_split_along_the_wrong_axis_is_named() {
    // I = 64: one block-scale column per rank at TP 4
    let fx = fixture_dims(2 + (draw::<u8>() % 4) as usize, 64, 64);
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(fx.seed ^ 3);
    let n = [2, 4][r.gen_range(0..2)];
    let tr = r.gen_range(0..n);
    let (trs, ns) = (tr.to_string(), n.to_string());
    let args = ["--tp-rank", trs.as_str(), "--tp-size", ns.as_str()];
    let dump = fx.root.join("axis.safetensors");
    let tp = |wrong| Faults {
        tp: Some((tr, n)),
        tp_down_wrong_axis: wrong,
        ..Default::default()
    };
    fx.run_fused(&dump, &tp(false), &args, 0);
    let out = fx.run_fused(&dump, &tp(true), &args, 1);
    let e = fx.model.experts.len();
    let d = out.json["diagnoses"].as_array().unwrap();
    let mut kinds = diag_kinds(&out.json);
    kinds.dedup();
    assert_eq!(kinds, ["tp_axis"], "seed {}: {d:?}", fx.seed);
    let tensors: u64 = d.iter().map(|d| d["tensors"].as_u64().unwrap()).sum();
    assert_eq!(tensors as usize, e + 1, "seed {}: {d:?}", fx.seed);
    let experts: Vec<u64> = d
        .iter()
        .flat_map(|d| d["experts"].as_array().cloned().unwrap_or_default())
        .map(|v| v.as_u64().unwrap())
        .collect();
    assert_eq!(
        experts,
        (0..e as u64).collect::<Vec<_>>(),
        "seed {}",
        fx.seed
    );
    let m = out.json["mismatches"].as_array().unwrap();
    assert_eq!(m.len(), e + 1, "seed {}", fx.seed);
    for u in m {
        assert!(
            u["name"].as_str().unwrap().ends_with("down_proj.weight"),
            "{u}"
        );
        assert!(
            u["issues"]
                .to_string()
                .contains("row-parallel: split along K"),
            "seed {}: {u}",
            fx.seed
        );
    }
}

/// A BF16 column-parallel weight compared as a TP slice (dim 0) with one changed value: the
/// issue names that value's row and column in B. A's slice along dim 0 was read as one flat
/// row, so it said "row 0, column <flat index>", a column past the tensor's width.
#[test]
fn a_changed_value_in_a_row_slice_is_placed_at_its_row_and_column() {
    let seed: u64 = draw();
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let dir = tempfile::tempdir().unwrap();
    let n = [2, 4][r.gen_range(0..2)];
    let (rows, cols) = (n * r.gen_range(2..9), 16 * r.gen_range(1..5));
    let tr = r.gen_range(0..n);
    let a = randn(&mut r, rows * cols, 1.0);
    let name = "model.layers.1.mlp.shared_experts.gate_proj.weight";
    let per = rows / n;
    let mut b = dense_rows(&a, cols, tr * per, per);
    let (i, j) = (r.gen_range(1..per), r.gen_range(0..cols));
    b[i * cols + j] += 100.0;
    let (pa, pb) = (
        dir.path().join("a.safetensors"),
        dir.path().join("b.safetensors"),
    );
    let t = |rows, v: &[f32]| {
        vec![(
            TensorSpec::new(name, Dtype::BF16, &[rows, cols]),
            bf16_bytes(v),
        )]
    };
    write_file(&pa, t(rows, &a), None).unwrap();
    write_file(&pb, t(per, &b), None).unwrap();
    let (trs, ns) = (tr.to_string(), n.to_string());
    let out = run(
        dir.path(),
        &[s(&pa), s(&pb), "--tp-rank", &trs, "--tp-size", &ns],
    );
    check(&out, 1, seed);
    let m = &out.json["mismatches"][0];
    assert!(
        m["issues"][0]["message"]
            .as_str()
            .unwrap()
            .contains(&format!("at row {i}, column {j} ")),
        "seed {seed}: {m}"
    );
}

/// `--tp-size n` where A's K/16 block-scale columns are not a multiple of n: rank r's K slice
/// cuts a 16-element scale block, which no engine can hold. Bad usage (exit 2) naming the
/// tensor and the block arithmetic; it was a bare shape mismatch ("B [rows, k] vs A [rows, K]").
#[test]
fn a_tp_size_that_cuts_scale_blocks_is_bad_usage() {
    let seed: u64 = draw();
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let dir = tempfile::tempdir().unwrap();
    let n = 4;
    // K/16 not a multiple of 4; K/4 even, so B's packed bytes are whole
    let blocks = [1, 2, 3, 5, 6, 7][r.gen_range(0..6)];
    let (rows, k) = (16 * r.gen_range(1..4), 16 * blocks);
    let kp = k / n;
    let tr = r.gen_range(0..n);
    let w = quantize_weight_nvfp4(&randn(&mut r, rows * k, 0.05), rows, k).0;
    let base = "model.layers.1.mlp.shared_experts.down_proj";
    let mut a = vec![];
    triple(&mut a, base, &w, 0.01);
    let (c0, kb) = (tr * kp, k / 16);
    let mut slice = w.clone();
    slice.cols = kp;
    slice.packed = (0..rows)
        .flat_map(|i| w.packed[i * k / 2 + c0 / 2..i * k / 2 + (c0 + kp) / 2].to_vec())
        .collect();
    // the block the slice starts in, one per row (what a loader rounding up would keep)
    slice.scales = (0..rows).map(|i| w.scales[i * kb + c0 / 16]).collect();
    let mut b = vec![];
    triple(&mut b, base, &slice, 0.01);
    // triple declares [rows, K/16] = [rows, 0] scales for K < 16: B keeps one column
    for (spec, bytes) in &mut b {
        if spec.name.ends_with(".weight_scale") {
            spec.shape = vec![rows, bytes.len() / rows];
        }
    }
    let (pa, pb) = (
        dir.path().join("a.safetensors"),
        dir.path().join("b.safetensors"),
    );
    write_file(&pa, a, None).unwrap();
    write_file(&pb, b, None).unwrap();
    let (trs, ns) = (tr.to_string(), n.to_string());
    let out = run(
        dir.path(),
        &[s(&pa), s(&pb), "--tp-rank", &trs, "--tp-size", &ns],
    );
    check(&out, 2, seed);
    assert!(
        !out.stderr.contains("panicked"),
        "seed {seed}: {}",
        out.stderr
    );
    assert_cuts_scale_blocks(&out, base, k, kb, seed);
}

/// The exit-2 message of a --tp-size that cuts `base`'s K = `k` (`kb` scale blocks) mid-block.
fn assert_cuts_scale_blocks(out: &Run, base: &str, k: usize, kb: usize, seed: u64) {
    assert!(
        out.stderr.contains("cannot split at block boundaries")
            && out.stderr.contains(&format!("{base}.weight"))
            && out
                .stderr
                .contains(&format!("K = {k} holds {kb} scale blocks")),
        "seed {seed}: {}",
        out.stderr
    );
}

/// Guards: a --tp-size that cannot split K at block boundaries, given a dump cut to another
/// K (a TP=2 rank's under --tp-size 3), was a bare shape mismatch (exit 1), not bad usage.
#[test]
fn a_tp_size_that_cuts_scale_blocks_is_bad_usage_whatever_b_holds() {
    let seed: u64 = draw();
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let dir = tempfile::tempdir().unwrap();
    // K/16 even (B holds whole blocks of a half) and not a multiple of 3
    let blocks = [2, 4, 8, 10, 14][r.gen_range(0..5)];
    let (rows, k) = (16 * r.gen_range(1..4), 16 * blocks);
    let (kp, kb) = (k / 2, k / 16);
    let w = quantize_weight_nvfp4(&randn(&mut r, rows * k, 0.05), rows, k).0;
    let base = "model.layers.1.mlp.shared_experts.down_proj";
    let mut a = vec![];
    triple(&mut a, base, &w, 0.01);
    // TP rank 0 of 2: the first half of K, codes and block scales
    let mut slice = w.clone();
    slice.cols = kp;
    slice.packed = (0..rows)
        .flat_map(|i| w.packed[i * k / 2..i * k / 2 + kp / 2].to_vec())
        .collect();
    slice.scales = (0..rows)
        .flat_map(|i| w.scales[i * kb..i * kb + kb / 2].to_vec())
        .collect();
    let mut b = vec![];
    triple(&mut b, base, &slice, 0.01);
    let (pa, pb) = (
        dir.path().join("a.safetensors"),
        dir.path().join("b.safetensors"),
    );
    write_file(&pa, a, None).unwrap();
    write_file(&pb, b, None).unwrap();
    let trs = r.gen_range(0..3).to_string();
    let out = run(
        dir.path(),
        &[s(&pa), s(&pb), "--tp-rank", &trs, "--tp-size", "3"],
    );
    check(&out, 2, seed);
    assert_cuts_scale_blocks(&out, base, k, kb, seed);
}

/// An EP rank's dump that left out one expert: every later slot holds the next expert, and the
/// rank's last expert is listed missing though B holds it one slot early. The diagnosis
/// names the dropped expert (global id) and says so; it said "every one is off by 1: local
/// expert ids where global ids belong", pointing at an id convention.
#[test]
fn a_dropped_expert_under_ep_is_named_with_its_global_id() {
    let per = 2 + (draw::<u8>() % 3) as usize;
    let fx = fixture(2 * per);
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(fx.seed ^ 5);
    let er = r.gen_range(0..2);
    let j = r.gen_range(0..per - 1);
    let dump = fx.root.join("dropped.safetensors");
    let ers = er.to_string();
    let out = fx.run_fused(
        &dump,
        &Faults {
            ep: Some((er, 2)),
            drop_slot: Some(j),
            ..Default::default()
        },
        &["--ep-rank", &ers, "--ep-size", "2"],
        1,
    );
    let (dropped, last) = (er * per + j, er * per + per - 1);
    let d = out.json["diagnoses"].as_array().unwrap();
    let perm = d
        .iter()
        .find(|d| d["kind"] == "expert_permutation")
        .unwrap_or_else(|| panic!("seed {}: {d:?}", fx.seed));
    let msg = perm["message"].as_str().unwrap();
    assert!(
        msg.contains(&format!("A's expert(s) {dropped} in no slot of B"))
            && msg.contains("a dropped expert shifted the rest")
            && msg.contains(&format!("A's expert(s) {last} listed missing are held")),
        "seed {}: {msg}",
        fx.seed
    );
    assert!(!msg.contains("local expert ids"), "seed {}: {msg}", fx.seed);
}

/// An EP rank's dump whose per-expert scalars (w13/w2 weight_scale_2 and input_scale) were
/// kept for all E experts while its weights hold the rank's: named `ep_scalars_unsharded`
/// with the tensors and their shapes, and each unit's mismatch says where either side holds
/// it. They were `unreadable` mismatches with empty `a` and `b`.
#[test]
fn per_expert_scalars_kept_for_all_experts_under_ep_are_named() {
    let per = 2 + (draw::<u8>() % 3) as usize;
    let fx = fixture(2 * per);
    let er = (fx.seed % 2) as usize;
    let ers = er.to_string();
    let dump = fx.root.join("scalars.safetensors");
    let out = fx.run_fused(
        &dump,
        &Faults {
            ep: Some((er, 2)),
            scalars_all_experts: true,
            ..Default::default()
        },
        &["--ep-rank", &ers, "--ep-size", "2"],
        1,
    );
    let what = format!("seed {} rank {er}", fx.seed);
    let d = out.json["diagnoses"].as_array().unwrap();
    let u = d
        .iter()
        .find(|d| d["kind"] == "ep_scalars_unsharded")
        .unwrap_or_else(|| panic!("{what}: {d:?}"));
    let msg = u["message"].as_str().unwrap();
    let e = 2 * per;
    for t in [
        "w13_weight_scale_2` [E, 2]",
        "w13_input_scale` [E, 2]",
        "w2_weight_scale_2` [E]",
        "w2_input_scale` [E]",
    ] {
        assert!(
            msg.contains(&t.replace('E', &e.to_string())),
            "{what}: {t} in {msg}"
        );
    }
    assert!(
        msg.contains(&format!("hold EP rank {er}'s {per} experts")),
        "{what}: {msg}"
    );
    let m = out.json["mismatches"].as_array().unwrap();
    assert_eq!(m.len(), 3 * per, "{what}");
    for x in m {
        assert!(
            x["a"].as_str().unwrap().ends_with(".weight")
                && x["b"].as_str().unwrap().contains("mlp.experts.w"),
            "{what}: {x}"
        );
    }
}

/// An unsharded dump compared as a TP rank: no matrix is a slice, and tp_not_sharded says so
/// (a rank holding whole column-parallel weights sums `size` copies in its all-reduce). It
/// passed: every tensor had A's shape, so nothing was compared as a slice.
#[test]
fn a_whole_dump_compared_as_a_tp_rank_is_named() {
    let fx = fixture(2 + (draw::<u8>() % 3) as usize);
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(fx.seed ^ 3);
    let n: usize = r.gen_range(2..5);
    let rank = r.gen_range(0..n).to_string();
    let size = n.to_string();
    let dump = fx.root.join("whole.safetensors");
    write_fused(&fx.model, &dump, &Faults::default());
    let out = run(
        &fx.root,
        &[
            s(&fx.ckpt),
            s(&dump),
            "--tp-rank",
            &rank,
            "--tp-size",
            &size,
        ],
    );
    check(&out, 1, fx.seed);
    let d = out.json["diagnoses"].as_array().unwrap();
    let t = d
        .iter()
        .find(|d| d["kind"] == "tp_not_sharded")
        .unwrap_or_else(|| panic!("seed {}: {d:?}", fx.seed));
    // the experts' gate, up and down, the shared expert's three and the embedding; not the
    // router's gate
    assert_eq!(
        t["tensors"].as_u64().unwrap() as usize,
        3 * fx.model.experts.len() + 4,
        "seed {}: {t}",
        fx.seed
    );
    let msg = t["message"].as_str().unwrap();
    assert!(
        msg.contains(&format!("TP rank {rank} of {n}")) && msg.contains(&format!("1/{n} slice")),
        "seed {}: {msg}",
        fx.seed
    );
    // each whole tensor is a problem of its own, listed under `mismatches` (DESIGN §6) as a
    // shape issue; it was under `diagnoses` only
    let listed = out.json["mismatches"].as_array().unwrap();
    assert_eq!(
        listed.len(),
        3 * fx.model.experts.len() + 4,
        "seed {}",
        fx.seed
    );
    assert!(
        listed.iter().all(|m| m["issues"][0]["kind"] == "shape"
            && m["issues"][0]["message"]
                .as_str()
                .unwrap()
                .starts_with("tp_not_sharded")),
        "seed {}: {listed:?}",
        fx.seed
    );
    // a real shard under the same flags: no such diagnosis (tp_and_ep_shards_… checks the rest)
    let dump = fx.root.join("shard.safetensors");
    let out = fx.run_fused(
        &dump,
        &Faults {
            tp: Some((0, 2)),
            ..Default::default()
        },
        &["--tp-rank", "0", "--tp-size", "2"],
        0,
    );
    assert!(!diag_kinds(&out.json).contains(&"tp_not_sharded".to_string()));
}

/// `synth --preset tiny --layers N` under `root/ck`: (its directory, first_k_dense_replace).
fn tiny_layers(root: &Path, layers: usize, seed: u64) -> (PathBuf, usize) {
    let ck = root.join("ck");
    let synth = Command::new(env!("CARGO_BIN_EXE_nvfp4dbg"))
        .args(["synth", "--preset", "tiny", "--no-report-dir", "-q"])
        .args(["--layers", &layers.to_string()])
        .args(["--seed", &(seed % 100_000).to_string(), "--out", s(&ck)])
        .output()
        .unwrap();
    assert!(synth.status.success(), "seed {seed}: {synth:?}");
    let cfg: Value =
        serde_json::from_slice(&std::fs::read(ck.join("config.json")).unwrap()).unwrap();
    (ck, cfg["first_k_dense_replace"].as_u64().unwrap() as usize)
}

/// Every tensor of `ck`'s shards into one file at `path`, layer `l` renamed to layer `to(l)`
/// (dropped where it is None).
fn renumbered(ck: &Path, path: &Path, to: impl Fn(usize) -> Option<usize>) {
    let mut v = vec![];
    for e in std::fs::read_dir(ck).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_none_or(|x| x != "safetensors") {
            continue;
        }
        let bytes = std::fs::read(&p).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        for (name, t) in st.tensors() {
            let renamed = match name.strip_prefix("model.layers.").and_then(|rest| {
                let (l, tail) = rest.split_once('.')?;
                Some((l.parse::<usize>().ok()?, tail))
            }) {
                Some((l, tail)) => match to(l) {
                    Some(n) => format!("model.layers.{n}.{tail}"),
                    None => continue,
                },
                None => name.clone(),
            };
            v.push((
                TensorSpec::new(renamed, t.dtype(), t.shape()),
                t.data().to_vec(),
            ));
        }
    }
    write_file(path, v, None).unwrap();
}

/// A dump whose MoE layers are numbered off by k (B's layer l holds A's layer l + k: dense or
/// MTP layers counted differently by the loader) is named as a layer shift, each layer pair
/// confirmed byte for byte, and every tensor it explains says so. It read as every tensor of
/// those layers differing, with no word on where B's came from.
#[test]
fn layers_numbered_off_by_k_are_named() {
    let seed = SEED.with(|s| *s);
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let k: usize = r.gen_range(1..3);
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let (ck, dense) = tiny_layers(root, 5, seed);
    // MoE layers renumbered l → l - k (A's first k MoE layers have no place in B)
    let dump = root.join("shifted.safetensors");
    renumbered(&ck, &dump, |l| match l {
        l if l >= dense && l < dense + k => None,
        l if l >= dense => Some(l - k),
        l => Some(l),
    });
    let out = run(root, &[s(&ck), s(&dump)]);
    check(&out, 1, seed);
    let d = out.json["diagnoses"].as_array().unwrap();
    let shift: Vec<&Value> = d.iter().filter(|d| d["kind"] == "layer_shift").collect();
    assert_eq!(shift.len(), 1, "seed {seed} k {k}: {d:?}");
    let msg = shift[0]["message"].as_str().unwrap();
    let pairs: Vec<String> = (dense..5 - k).map(|l| format!("{l}←{}", l + k)).collect();
    assert!(
        msg.contains(&pairs.join(", ")) && msg.contains(&format!("{k:+}")),
        "seed {seed} k {k}: {msg}"
    );
    // every differing tensor of B's MoE layers is explained, and no other tensor differs
    let m = out.json["mismatches"].as_array().unwrap();
    assert_eq!(
        shift[0]["tensors"].as_u64().unwrap() as usize,
        m.len(),
        "seed {seed}"
    );
    for u in m {
        assert!(
            u["issues"].to_string().contains("holds A's layer"),
            "seed {seed} k {k}: {u}"
        );
    }
}

/// A pipeline stage's local layer numbers (B holds A's layers L0.. renumbered from 0) are named
/// as a layer shift also where B's MoE layers fall on A's dense layers' numbers, so that their
/// tensors pair with nothing of A's (found from the layers' tensors that exist in A at another
/// number). It read "1 mismatched, 399 missing, 53 extra" with no diagnosis. B holding A's
/// layers under their own numbers is no shift.
#[test]
fn pipeline_stage_local_layer_numbers_are_named() {
    let seed = SEED.with(|s| *s);
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let (ck, dense) = tiny_layers(root, 4, seed);
    assert!(
        dense >= 1,
        "seed {seed}: the tiny preset has a dense first layer"
    );
    // the stage: A's layers l0..4 (MoE), numbered from 0 or (subset) as they are
    let l0 = dense + (seed % 2) as usize;
    let stage = |renumber: bool, path: &Path| {
        renumbered(&ck, path, |l| match l {
            l if l < l0 => None,
            l if renumber => Some(l - l0),
            l => Some(l),
        })
    };
    let dump = root.join("stage.safetensors");
    stage(true, &dump);
    let out = run(root, &[s(&ck), s(&dump)]);
    check(&out, 1, seed);
    let d = out.json["diagnoses"].as_array().unwrap();
    let shift: Vec<&Value> = d.iter().filter(|d| d["kind"] == "layer_shift").collect();
    assert_eq!(shift.len(), 1, "seed {seed} l0 {l0}: {d:?}");
    let msg = shift[0]["message"].as_str().unwrap();
    let pairs: Vec<String> = (0..4 - l0).map(|l| format!("{l}←{}", l + l0)).collect();
    assert!(
        msg.contains(&pairs.join(", "))
            && msg.contains(&format!("l{:+}", l0 as i64))
            && msg.contains("no same-named tensor in A"),
        "seed {seed} l0 {l0}: {msg}"
    );
    // the subset under its own numbers: tensors missing in B, no shift
    stage(false, &dump);
    let out = run(root, &[s(&ck), s(&dump)]);
    check(&out, 1, seed);
    assert!(
        diag_kinds(&out.json).is_empty(),
        "seed {seed}: {:?}",
        out.json["diagnoses"]
    );
    assert_eq!(out.json["summary"]["mismatched"], 0, "seed {seed}");
}

/// vLLM's merged `gate_up_proj` of the shared expert compares as A's gate_proj and up_proj
/// (also as a TP shard, each part sharded on its own), and halves in the other order are two
/// named mismatches. A clean dump failed: gate_proj and up_proj missing, gate_up_proj extra.
#[test]
fn merged_gate_up_proj_is_compared_as_its_parts() {
    let fx = fixture(2 + (draw::<u8>() % 3) as usize);
    let dump = fx.root.join("merged.safetensors");
    let merged = |reversed, tp| Faults {
        merged_shared: Some(reversed),
        tp,
        ..Default::default()
    };
    let out = fx.run_fused(&dump, &merged(false, None), &[], 0);
    assert_eq!(
        out.json["missing"].as_array().unwrap().len(),
        0,
        "seed {}",
        fx.seed
    );
    assert_eq!(
        out.json["extra"].as_array().unwrap().len(),
        0,
        "seed {}",
        fx.seed
    );
    assert!(
        out.json["notes"]
            .to_string()
            .contains("merged `gate_up_proj`"),
        "seed {}: {}",
        fx.seed,
        out.json["notes"]
    );
    let tr = (fx.seed % 2) as usize;
    let trs = tr.to_string();
    fx.run_fused(
        &dump,
        &merged(false, Some((tr, 2))),
        &["--tp-rank", &trs, "--tp-size", "2"],
        0,
    );
    let out = fx.run_fused(&dump, &merged(true, None), &[], 1);
    let names: Vec<&str> = out.json["mismatches"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            format!("model.layers.{LAYER}.mlp.shared_experts.gate_proj.weight"),
            format!("model.layers.{LAYER}.mlp.shared_experts.up_proj.weight"),
        ],
        "seed {}",
        fx.seed
    );
}

/// vLLM's `fused_qkv_a_proj` = [q_a_proj; kv_a_proj_with_mqa], parts of unequal rows: cut at
/// A's sizes, and one changed value of the second part is named as that part.
/// The shared expert's merged `gate_up_proj` in the order [up; gate], whole or a TP rank's:
/// named `gate_up_swapped` as the routed experts' swap is. It was a bare "values differ" on
/// both halves.
#[test]
fn swapped_halves_of_a_merged_gate_up_proj_are_named() {
    let fx = fixture(2 + (draw::<u8>() % 3) as usize);
    let tr = (fx.seed % 2) as usize;
    let trs = tr.to_string();
    for tp in [None, Some((tr, 2))] {
        let dump = fx.root.join("merged-swapped.safetensors");
        let args: &[&str] = if tp.is_some() {
            &["--tp-rank", &trs, "--tp-size", "2"]
        } else {
            &[]
        };
        let out = fx.run_fused(
            &dump,
            &Faults {
                merged_shared: Some(true),
                tp,
                ..Default::default()
            },
            args,
            1,
        );
        let what = format!("seed {} tp {tp:?}", fx.seed);
        let d = out.json["diagnoses"].as_array().unwrap();
        assert_eq!(diag_kinds(&out.json), ["gate_up_swapped"], "{what}: {d:?}");
        assert_eq!(d[0]["layer"], LAYER, "{what}");
        let msg = d[0]["message"].as_str().unwrap();
        assert!(
            msg.contains(&format!(
                "B's merged `model.layers.{LAYER}.mlp.shared_experts.gate_up_proj.weight` is [up_proj; gate_proj]"
            )),
            "{what}: {msg}"
        );
        for m in out.json["mismatches"].as_array().unwrap() {
            assert!(
                m["issues"].to_string().contains("gate and up swapped"),
                "{what}: {m}"
            );
        }
    }
}

#[test]
fn fused_qkv_a_proj_is_cut_at_the_parts_sizes() {
    let seed: u64 = draw();
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let (h, q, kv) = (32, 16 * r.gen_range(2..7), 8 * r.gen_range(2..7));
    let (wq, mut wkv) = (randn(&mut r, q * h, 1.0), randn(&mut r, kv * h, 1.0));
    let attn = "model.layers.0.self_attn";
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (
        tmp.path().join("a.safetensors"),
        tmp.path().join("b.safetensors"),
    );
    let t = |n: &str, rows: usize, v: &[f32]| {
        (
            TensorSpec::new(format!("{attn}.{n}.weight"), Dtype::F32, &[rows, h]),
            f32_bytes(v),
        )
    };
    write_file(
        &a,
        vec![t("q_a_proj", q, &wq), t("kv_a_proj_with_mqa", kv, &wkv)],
        None,
    )
    .unwrap();
    let write_b = |wkv: &[f32]| {
        let both = [&wq[..], wkv].concat();
        write_file(&b, vec![t("fused_qkv_a_proj", q + kv, &both)], None).unwrap();
    };
    write_b(&wkv);
    let out = run(tmp.path(), &[s(&a), s(&b)]);
    check(&out, 0, seed);
    assert_eq!(out.json["summary"]["units"], 2, "seed {seed}");
    let at = r.gen_range(0..kv * h);
    wkv[at] += 1.0;
    write_b(&wkv);
    let out = run(tmp.path(), &[s(&a), s(&b)]);
    check(&out, 1, seed);
    let m = out.json["mismatches"].as_array().unwrap();
    assert_eq!(m.len(), 1, "seed {seed}: {m:?}");
    assert_eq!(
        m[0]["name"],
        format!("{attn}.kv_a_proj_with_mqa.weight"),
        "seed {seed}"
    );
    assert_eq!(
        m[0]["metrics"]["max_abs_err_index"], at,
        "seed {seed}: {}",
        m[0]
    );
}

/// A quantized merged `gate_up_proj` (a dense MLP's, as vLLM keeps it): its parts compare with
/// A's NVFP4 gate_proj and up_proj, block scales linear or swizzled over the whole merged
/// tensor, per-part global scales (`[2]`, before vLLM's processing) agree, and the one max
/// vLLM keeps after processing is a scale_2 mismatch on the part whose own was smaller.
#[test]
fn quantized_merged_gate_up_proj_and_its_one_global_scale() {
    let seed = SEED.with(|s| *s);
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let (h, i) = (64 * r.gen_range(1..3), 64 * r.gen_range(1..3));
    let base = "model.layers.0.mlp";
    // gate and up of different magnitudes: their weight_scale_2 differ
    let g = quantize_weight_nvfp4(&randn(&mut r, i * h, 0.02), i, h).0;
    let u = quantize_weight_nvfp4(&randn(&mut r, i * h, 0.05), i, h).0;
    let (ig, iu) = (r.gen_range(0.001..0.01f32), r.gen_range(0.001..0.01f32));
    let tmp = tempfile::tempdir().unwrap();
    let a = tmp.path().join("a.safetensors");
    let mut v = vec![];
    triple(&mut v, &format!("{base}.gate_proj"), &g, ig);
    triple(&mut v, &format!("{base}.up_proj"), &u, iu);
    write_file(&a, v, None).unwrap();
    let b = tmp.path().join("b.safetensors");
    let write_b = |swizzle: bool, scale_2: &[f32]| {
        let m = format!("{base}.gate_up_proj");
        let scales = [g.scales.clone(), u.scales.clone()].concat();
        let (scales, sshape) = if swizzle {
            let (pr, pk) = layout::swizzled_dims(2 * i, h / 16);
            (layout::swizzle(&scales, 2 * i, h / 16), vec![pr, pk])
        } else {
            (scales, vec![2 * i, h / 16])
        };
        let shape2: Vec<usize> = if scale_2.len() == 2 { vec![2] } else { vec![] };
        let v = vec![
            (
                TensorSpec::new(format!("{m}.weight"), Dtype::U8, &[2 * i, h / 2]),
                [g.packed.clone(), u.packed.clone()].concat(),
            ),
            (
                TensorSpec::new(format!("{m}.weight_scale"), Dtype::F8_E4M3, &sshape),
                scales,
            ),
            (
                TensorSpec::new(format!("{m}.weight_scale_2"), Dtype::F32, &shape2),
                f32_bytes(scale_2),
            ),
            (
                TensorSpec::new(format!("{m}.input_scale"), Dtype::F32, &[2]),
                f32_bytes(&[ig, iu]),
            ),
        ];
        write_file(&b, v, None).unwrap();
    };
    for swizzle in [false, true] {
        write_b(swizzle, &[g.scale_2, u.scale_2]);
        let out = run(tmp.path(), &[s(&a), s(&b)]);
        check(&out, 0, seed);
        assert_eq!(
            out.json["summary"]["units"], 2,
            "seed {seed}: {}",
            out.stdout
        );
    }
    write_b(true, &[g.scale_2.max(u.scale_2)]);
    let out = run(tmp.path(), &[s(&a), s(&b)]);
    check(&out, 1, seed);
    let m = out.json["mismatches"].as_array().unwrap();
    let smaller = if g.scale_2 < u.scale_2 {
        "gate_proj"
    } else {
        "up_proj"
    };
    assert_eq!(m.len(), 1, "seed {seed}: {m:?}");
    assert!(
        m[0]["name"].as_str().unwrap().contains(smaller)
            && m[0]["issues"].to_string().contains("weight_scale_2"),
        "seed {seed}: {m:?}"
    );
}

/// An EP rank's dump of round-robin placed experts (rank 0 of 2: 0, 2, 4) read as linear
/// (0, 1, 2): the permutation is named as the placement. It used to list "1←2, 2←4" only.
#[test]
fn round_robin_placement_read_as_linear_is_named() {
    let fx = fixture(6);
    let dump = fx.root.join("rr.safetensors");
    write_fused(
        &fx.model,
        &dump,
        &Faults {
            order: Some(vec![0, 2, 4, 1, 3, 5]),
            ep: Some((0, 2)),
            ..Default::default()
        },
    );
    let ep = [s(&fx.ckpt), s(&dump), "--ep-rank", "0", "--ep-size", "2"];
    let out = run(&fx.root, &ep);
    check(&out, 1, fx.seed);
    let d = out.json["diagnoses"].as_array().unwrap();
    let p = d
        .iter()
        .find(|d| d["kind"] == "expert_permutation")
        .unwrap_or_else(|| panic!("seed {}: {d:?}", fx.seed));
    assert_eq!(p["experts"], serde_json::json!([1, 2]), "seed {}", fx.seed);
    let msg = p["message"].as_str().unwrap();
    assert!(
        msg.contains("2·e:") && msg.contains("--placement round-robin"),
        "seed {}: {msg}",
        fx.seed
    );
    // read with the placement it has: agrees
    let out = run(
        &fx.root,
        &[&ep[..], &["--placement", "round-robin"]].concat(),
    );
    check(&out, 0, fx.seed);
}

/// The reverse: an EP rank's dump of linearly placed experts (rank r of 2 holds n/2
/// contiguous ones) read as round-robin (r, r + 2, …): named as the placement too. It used to
/// list only "2←1, 4←2".
#[test]
fn linear_placement_read_as_round_robin_is_named() {
    let fx = fixture(8);
    let r = (fx.seed % 2) as usize;
    let dump = fx.root.join("linear.safetensors");
    write_fused(
        &fx.model,
        &dump,
        &Faults {
            ep: Some((r, 2)),
            ..Default::default()
        },
    );
    let rs = r.to_string();
    let ep = [s(&fx.ckpt), s(&dump), "--ep-rank", &rs, "--ep-size", "2"];
    let out = run(
        &fx.root,
        &[&ep[..], &["--placement", "round-robin"]].concat(),
    );
    check(&out, 1, fx.seed);
    let d = out.json["diagnoses"].as_array().unwrap();
    let p = d
        .iter()
        .find(|d| d["kind"] == "expert_permutation")
        .unwrap_or_else(|| panic!("seed {} rank {r}: {d:?}", fx.seed));
    let msg = p["message"].as_str().unwrap();
    assert!(
        msg.contains("contiguous (linear) expert placement read as strided (round-robin)")
            && msg.contains("--placement linear"),
        "seed {} rank {r}: {msg}",
        fx.seed
    );
    // read with the placement it has: agrees
    check(&run(&fx.root, &ep), 0, fx.seed);
}

/// Every expert's w2 block scales one column off (±1) from A's (whole, or a TP rank's K
/// slice cut one block off) under the right packed codes: named `scales_shifted`. It was
/// "values differ … N of M blocks differ".
#[test]
fn block_scales_shifted_by_one_column_are_named() {
    let fx = fixture_dims(2 + (draw::<u8>() % 3) as usize, 64, 64);
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(fx.seed ^ 17);
    let n = [1usize, 2, 4][r.gen_range(0..3)];
    let tr = r.gen_range(0..n);
    // a shift that stays inside A for at least one of the rank's columns
    let shift = match (tr, n) {
        (_, 1) => [1, -1][r.gen_range(0..2)],
        (0, _) => 1,
        (t, _) if t == n - 1 => -1,
        _ => [1, -1][r.gen_range(0..2)],
    };
    let (trs, ns) = (tr.to_string(), n.to_string());
    let args: Vec<&str> = if n > 1 {
        vec!["--tp-rank", &trs, "--tp-size", &ns]
    } else {
        vec![]
    };
    let dump = fx.root.join("shifted.safetensors");
    let out = fx.run_fused(
        &dump,
        &Faults {
            tp: (n > 1).then_some((tr, n)),
            w2_scale_shift: Some(shift),
            ..Default::default()
        },
        &args,
        1,
    );
    let what = format!("seed {} tp {tr}/{n} shift {shift}", fx.seed);
    let d = out.json["diagnoses"].as_array().unwrap();
    assert_eq!(diag_kinds(&out.json), ["scales_shifted"], "{what}: {d:?}");
    let e = fx.model.experts.len();
    assert_eq!(d[0]["tensors"], e, "{what}");
    let msg = d[0]["message"].as_str().unwrap();
    assert!(
        msg.contains(&format!("A's shifted by {shift:+} column")),
        "{what}: {msg}"
    );
    for m in out.json["mismatches"].as_array().unwrap() {
        assert!(
            m["name"].as_str().unwrap().contains("down_proj"),
            "{what}: {m}"
        );
    }
}

/// A TP rank's global scales (every expert's w13 or w2 weight_scale_2, or w2's input_scale)
/// divided or multiplied by the TP size at load: named `global_scale_scaled_by_tp` with the
/// scale tensor. It was a bare `scale_2` / `input_scale` issue per tensor.
#[test]
fn a_global_scale_scaled_by_the_tp_size_is_named() {
    let fx = fixture_dims(2 + (draw::<u8>() % 3) as usize, 64, 64);
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(fx.seed ^ 13);
    let n = [2usize, 4][r.gen_range(0..2)];
    let tr = r.gen_range(0..n);
    let which = ["w13_weight_scale_2", "w2_weight_scale_2", "w2_input_scale"][r.gen_range(0..3)];
    let times = r.gen_bool(0.5);
    let k = if times { n as f32 } else { 1.0 / n as f32 };
    let (trs, ns) = (tr.to_string(), n.to_string());
    let dump = fx.root.join("gs.safetensors");
    let out = fx.run_fused(
        &dump,
        &Faults {
            tp: Some((tr, n)),
            scalar_factor: Some((which, k)),
            ..Default::default()
        },
        &["--tp-rank", &trs, "--tp-size", &ns],
        1,
    );
    let what = format!("seed {} tp {tr}/{n} {which} ×{k}", fx.seed);
    let d = out.json["diagnoses"].as_array().unwrap();
    let g = d
        .iter()
        .find(|d| d["kind"] == "global_scale_scaled_by_tp")
        .unwrap_or_else(|| panic!("{what}: {d:?}"));
    let e = fx.model.experts.len();
    let units = if which.starts_with("w13") { 2 * e } else { e };
    assert_eq!(g["tensors"], units, "{what}: {g}");
    let msg = g["message"].as_str().unwrap();
    let member = which.trim_start_matches("w13_").trim_start_matches("w2_");
    let op = if times { "×" } else { "/" };
    assert!(
        msg.contains(&format!(
            "B's {member} is A's {op} {n} for {units} tensor(s)"
        )) && msg.contains(&format!("experts.{which}`")),
        "{what}: {msg}"
    );
    assert_eq!(
        diag_kinds(&out.json),
        ["global_scale_scaled_by_tp"],
        "{what}"
    );
}

/// Fused w13 sharded over TP as one [2I] block: rank r's gate and up are rows of [w1; w3],
/// not w1's and w3's own slices. Named; it used to be "values differ" on the up (rank 0) or
/// gate (rank 1) of every expert.
#[test]
fn w13_split_across_tp_as_one_block_is_named() {
    let fx = fixture(4);
    for tr in 0..2 {
        let dump = fx.root.join(format!("tp-w13-{tr}.safetensors"));
        write_fused(
            &fx.model,
            &dump,
            &Faults {
                tp: Some((tr, 2)),
                tp_w13_as_one: true,
                ..Default::default()
            },
        );
        let trs = tr.to_string();
        let out = run(
            &fx.root,
            &[s(&fx.ckpt), s(&dump), "--tp-rank", &trs, "--tp-size", "2"],
        );
        check(&out, 1, fx.seed);
        let d = out.json["diagnoses"].as_array().unwrap();
        let w = d
            .iter()
            .find(|d| d["kind"] == "w13_tp_split")
            .unwrap_or_else(|| panic!("seed {} rank {tr}: {d:?}", fx.seed));
        assert_eq!(w["experts"], serde_json::json!([0, 1, 2, 3]));
        assert_eq!(w["tensors"], 4);
        // rank 0's gate and rank 1's up are right: only the other half mismatches
        let wrong = if tr == 0 { "up_proj" } else { "gate_proj" };
        for m in out.json["mismatches"].as_array().unwrap() {
            assert!(m["name"].as_str().unwrap().contains(wrong), "{m}");
        }
    }
}

/// At TP 4 a rank's half of the one-block split can be another rank's slice of its own
/// projection (rank 2's up is w3's rows of rank 1): that half is part of `w13_tp_split`, not
/// also a `tp_rank` diagnosis beside it.
#[test]
fn w13_split_as_one_block_at_tp4_is_not_also_another_ranks_slice() {
    let fx = fixture_dims(2 + (draw::<u8>() % 3) as usize, 64, 64);
    let e = fx.model.experts.len();
    for tr in 0..4 {
        let dump = fx.root.join(format!("tp4-w13-{tr}.safetensors"));
        let trs = tr.to_string();
        let out = fx.run_fused(
            &dump,
            &Faults {
                tp: Some((tr, 4)),
                tp_w13_as_one: true,
                ..Default::default()
            },
            &["--tp-rank", &trs, "--tp-size", "4"],
            1,
        );
        let what = format!("seed {} rank {tr}", fx.seed);
        let d = out.json["diagnoses"].as_array().unwrap();
        assert_eq!(diag_kinds(&out.json), ["w13_tp_split"], "{what}: {d:?}");
        // ranks 0 and 3 hold one right half (gate, up), ranks 1 and 2 none
        let halves = if tr == 0 || tr == 3 { 1 } else { 2 };
        assert_eq!(d[0]["tensors"], halves * e, "{what}: {d:?}");
        assert_eq!(out.json["summary"]["mismatched"], halves * e, "{what}");
    }
}

#[test]
fn rename_rules_and_bad_input() {
    let fx = fixture(2);
    // an engine that calls things its own way
    let odd = fx.root.join("odd.safetensors");
    let mut v = vec![];
    for (e, x) in fx.model.experts.iter().enumerate() {
        for (n, t, ins) in [
            ("gate", &x.w1, x.in1),
            ("up", &x.w3, x.in3),
            ("down", &x.w2, x.in2),
        ] {
            triple(&mut v, &format!("blk{LAYER}.moe.e{e}.{n}"), t, ins);
        }
    }
    write_file(&odd, v, None).unwrap();
    let rules = fx.root.join("rules.toml");
    std::fs::write(
        &rules,
        r#"
[[rule]]
pattern = '^blk(\d+)\.moe\.e(\d+)\.(gate|up|down)\.'
replace = 'model.layers.$1.mlp.experts.$2.${3}_proj.'
side = "b"
"#,
    )
    .unwrap();
    let out = run(&fx.root, &[s(&fx.ckpt), s(&odd), "--map", s(&rules)]);
    check(&out, 1, fx.seed);
    // every expert paired; only the non-expert tensors are missing
    assert_eq!(out.json["summary"]["units"], 6);
    assert_eq!(out.json["summary"]["equal"], 6);
    assert_eq!(out.json["extra"].as_array().unwrap().len(), 0);
    // a bad rules file is bad input naming the rule
    std::fs::write(&rules, "[[rule]]\npattern = '(unclosed'\nreplace = 'x'\n").unwrap();
    let out = run(&fx.root, &[s(&fx.ckpt), s(&odd), "--map", s(&rules)]);
    check(&out, 2, fx.seed);
    assert!(
        out.stderr.contains("rules.toml") && out.stderr.contains("rule 1"),
        "{}",
        out.stderr
    );
    // other bad input
    for args in [
        vec![s(&fx.ckpt), "nope.safetensors"],
        vec![s(&fx.ckpt), s(&odd), "--tp-rank", "2", "--tp-size", "2"],
        vec![s(&fx.ckpt), s(&odd), "--ep-rank", "1"],
        vec![s(&fx.ckpt), s(&odd), "--min-cosine", "2"],
        vec![s(&fx.ckpt), s(&odd), "--tp-size", "0"],
        vec![s(&fx.ckpt), s(&odd), "--ep-size", "0"],
    ] {
        let out = run(&fx.root, &args);
        assert_eq!(out.code, 2, "{args:?}: {}", out.stderr);
        assert!(!out.stderr.contains("panicked"));
    }
    let junk = fx.root.join("junk.safetensors");
    std::fs::write(&junk, b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}      ").unwrap();
    let out = run(&fx.root, &[s(&fx.ckpt), s(&junk)]);
    check(&out, 2, fx.seed);
    assert!(out.stderr.contains("junk.safetensors"), "{}", out.stderr);
}

#[test]
#[ignore = "prints a report for eyeballing"]
fn show_swap_report() {
    let fx = fixture(4);
    let dump = fx.root.join("swap.safetensors");
    write_fused(
        &fx.model,
        &dump,
        &Faults {
            swap: vec![2],
            swizzle: true,
            gate_only_scale_2: true,
            drop_and_add: true,
            ..Default::default()
        },
    );
    let out = run(&fx.root, &[s(&fx.ckpt), s(&dump)]);
    println!("{}", out.stdout);
}

#[test]
fn compressed_tensors_conventions_and_transposes() {
    let fx = fixture(2);
    // the checkpoint in compressed-tensors names: gs = 1/weight_scale_2, 1/input_scale
    let ct = fx.root.join("ct.safetensors");
    let mut v = fx.model.common("model.", "mlp");
    for (e, x) in fx.model.experts.iter().enumerate() {
        for (n, t, ins) in [
            ("gate_proj", &x.w1, x.in1),
            ("up_proj", &x.w3, x.in3),
            ("down_proj", &x.w2, x.in2),
        ] {
            let base = format!("model.layers.{LAYER}.mlp.experts.{e}.{n}");
            v.push((
                TensorSpec::new(
                    format!("{base}.weight_packed"),
                    Dtype::U8,
                    &[t.rows, t.cols / 2],
                ),
                t.packed.clone(),
            ));
            v.push((
                TensorSpec::new(
                    format!("{base}.weight_scale"),
                    Dtype::F8_E4M3,
                    &[t.rows, t.cols / 16],
                ),
                t.scales.clone(),
            ));
            v.push((
                TensorSpec::new(format!("{base}.weight_global_scale"), Dtype::F32, &[1]),
                f32_bytes(&[1.0 / t.scale_2]),
            ));
            v.push((
                TensorSpec::new(format!("{base}.input_global_scale"), Dtype::F32, &[1]),
                f32_bytes(&[1.0 / ins]),
            ));
        }
    }
    write_file(&ct, v, None).unwrap();
    let out = run(&fx.root, &[s(&fx.ckpt), s(&ct)]);
    check(&out, 0, fx.seed);
    assert_eq!(out.json["summary"]["mismatched"], 0);

    // compressed-tensors names holding ModelOpt's dequant-direction values: named on B's own
    // tensors (it used to say B holds a gs as weight_scale_2, the other way round)
    let ct2 = fx.root.join("ct-modelopt-values.safetensors");
    let mut v = fx.model.common("model.", "mlp");
    for (e, x) in fx.model.experts.iter().enumerate() {
        for (n, t, ins) in [
            ("gate_proj", &x.w1, x.in1),
            ("up_proj", &x.w3, x.in3),
            ("down_proj", &x.w2, x.in2),
        ] {
            let base = format!("model.layers.{LAYER}.mlp.experts.{e}.{n}");
            for (suffix, dtype, shape, bytes) in [
                (
                    "weight_packed",
                    Dtype::U8,
                    vec![t.rows, t.cols / 2],
                    t.packed.clone(),
                ),
                (
                    "weight_scale",
                    Dtype::F8_E4M3,
                    vec![t.rows, t.cols / 16],
                    t.scales.clone(),
                ),
                (
                    "weight_global_scale",
                    Dtype::F32,
                    vec![1],
                    f32_bytes(&[t.scale_2]),
                ),
                ("input_global_scale", Dtype::F32, vec![1], f32_bytes(&[ins])),
            ] {
                v.push((
                    TensorSpec::new(format!("{base}.{suffix}"), dtype, &shape),
                    bytes,
                ));
            }
        }
    }
    write_file(&ct2, v, None).unwrap();
    let out = run(&fx.root, &[s(&fx.ckpt), s(&ct2)]);
    check(&out, 1, fx.seed);
    let kinds = diag_kinds(&out.json);
    assert!(
        kinds.contains(&"scale_2_flipped".to_string())
            && kinds.contains(&"input_scale_flipped".to_string()),
        "seed {}: {kinds:?}",
        fx.seed
    );
    for m in out.json["mismatches"].as_array().unwrap() {
        let msgs = m["issues"].to_string();
        assert!(
            msgs.contains("under compressed-tensors' weight_global_scale name")
                && msgs.contains("under compressed-tensors' input_global_scale name"),
            "seed {}: {msgs}",
            fx.seed
        );
    }

    // an engine that stores expert 1's down_proj and the shared gate_proj transposed
    let tr = fx.root.join("transposed.safetensors");
    let mut v = vec![];
    for (spec, bytes) in fx.model.common("model.", "mlp") {
        if spec.name.ends_with("shared_experts.gate_proj.weight") {
            let (r, c) = (spec.shape[0], spec.shape[1]);
            let t: Vec<f32> = (0..c)
                .flat_map(|j| (0..r).map(move |i| (i, j)))
                .map(|(i, j)| fx.model.shared[0][i * c + j])
                .collect();
            v.push((
                TensorSpec::new(spec.name.clone(), Dtype::BF16, &[c, r]),
                bf16_bytes(&t),
            ));
        } else {
            v.push((spec, bytes));
        }
    }
    for (e, x) in fx.model.experts.iter().enumerate() {
        for (n, t, ins) in [
            ("gate_proj", &x.w1, x.in1),
            ("up_proj", &x.w3, x.in3),
            ("down_proj", &x.w2, x.in2),
        ] {
            let base = format!("model.layers.{LAYER}.mlp.experts.{e}.{n}");
            if e == 1 && n == "down_proj" {
                let (r, c) = (t.rows, t.cols / 2);
                let bt: Vec<u8> = (0..c)
                    .flat_map(|j| (0..r).map(move |i| (i, j)))
                    .map(|(i, j)| t.packed[i * c + j])
                    .collect();
                v.push((
                    TensorSpec::new(format!("{base}.weight"), Dtype::U8, &[c, r]),
                    bt,
                ));
                v.push((
                    TensorSpec::new(
                        format!("{base}.weight_scale"),
                        Dtype::F8_E4M3,
                        &[t.rows, t.cols / 16],
                    ),
                    t.scales.clone(),
                ));
                v.push((
                    TensorSpec::new(format!("{base}.weight_scale_2"), Dtype::F32, &[]),
                    f32_bytes(&[t.scale_2]),
                ));
                v.push((
                    TensorSpec::new(format!("{base}.input_scale"), Dtype::F32, &[]),
                    f32_bytes(&[ins]),
                ));
            } else {
                triple(&mut v, &base, t, ins);
            }
        }
    }
    write_file(&tr, v, None).unwrap();
    let out = run(&fx.root, &[s(&fx.ckpt), s(&tr)]);
    check(&out, 1, fx.seed);
    let d = out.json["diagnoses"].as_array().unwrap();
    let t: Vec<&Value> = d.iter().filter(|d| d["kind"] == "transposed").collect();
    assert_eq!(
        t.iter()
            .map(|d| d["tensors"].as_u64().unwrap())
            .sum::<u64>(),
        2,
        "{d:?}"
    );
    let names: Vec<&str> = out.json["mismatches"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            format!("model.layers.{LAYER}.mlp.experts.1.down_proj.weight"),
            format!("model.layers.{LAYER}.mlp.shared_experts.gate_proj.weight")
        ]
    );
}

/// The fixtures behind `cases/compare-weights-*.toml`, from a fixed seed. Regenerate with
/// `cargo test --test compare_weights_cli -- --ignored regenerate_case_data`.
fn case_fixtures(dir: &Path) {
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(0x5eed_0003);
    let model = Model::new(&mut r, 4);
    model.write_hf(&dir.join("ckpt"));
    write_fused(
        &model,
        &dir.join("engine-clean.safetensors"),
        &Faults {
            swizzle: true,
            ..Default::default()
        },
    );
    write_fused(
        &model,
        &dir.join("engine-swapped.safetensors"),
        &Faults {
            swap: vec![2],
            ..Default::default()
        },
    );
    write_fused(
        &model,
        &dir.join("engine-gate-only-scale2.safetensors"),
        &Faults {
            gate_only_scale_2: true,
            ..Default::default()
        },
    );
}

const FIXTURES: [&str; 5] = [
    "ckpt/config.json",
    "ckpt/model.safetensors",
    "engine-clean.safetensors",
    "engine-swapped.safetensors",
    "engine-gate-only-scale2.safetensors",
];

#[test]
#[ignore = "writes cases/data/compare-weights; run by hand after changing the generator"]
fn regenerate_case_data() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("cases/data/compare-weights");
    std::fs::create_dir_all(&dir).unwrap();
    case_fixtures(&dir);
}

/// Each `cases/compare-weights-*.toml` run through the binary as `run` would; the committed
/// fixtures are what the generator makes, and small.
#[test]
fn case_files_hold() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let cases = root.join("cases");
    let data = cases.join("data/compare-weights");
    let fresh = tempfile::tempdir().unwrap();
    case_fixtures(fresh.path());
    let mut total = 0;
    for f in FIXTURES {
        let committed = std::fs::read(data.join(f)).unwrap();
        total += committed.len();
        assert!(
            committed == std::fs::read(fresh.path().join(f)).unwrap(),
            "cases/data/compare-weights/{f} is stale: regenerate it"
        );
    }
    assert!(total < 200_000, "fixtures are {total} bytes");
    let n = common::cases_hold("compare-weights-");
    assert!(n >= 2, "compare-weights cases missing");
}

// ---- benchmark material (bench/cpu-compare-weights.md) ----

/// Deterministic bytes, fast in any build: splitmix64 from `seed`.
fn fill(seed: u64, out: &mut [u8], scales: bool) {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
    for c in out.chunks_mut(8) {
        s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        let b = z.to_le_bytes();
        c.copy_from_slice(&b[..c.len()]);
    }
    if scales {
        // E4M3 block scales: positive, never the NaN code
        out.iter_mut().for_each(|b| *b = (*b & 0x7F).min(0x7E));
    }
}

/// A multi-GB pair with DeepSeek-V3 expert shapes: A an HF checkpoint (one shard per layer,
/// ModelOpt triples), B a vLLM-style fused dump of the same bytes. Environment:
/// `NVFP4DBG_BENCH_DIR` (required), `NVFP4DBG_BENCH_LAYERS` (2), `NVFP4DBG_BENCH_EXPERTS` (64),
/// `NVFP4DBG_BENCH_SWIZZLE` (0), `NVFP4DBG_BENCH_B` (engine.safetensors; A is kept when it
/// exists). Run with
/// `cargo test --release --test compare_weights_cli -- --ignored make_bench_pair`.
#[test]
#[ignore = "writes gigabytes; benchmark material only"]
fn make_bench_pair() {
    use nvfp4dbg::checkpoint::writer::ShardWriter;
    let env = |k: &str, d: usize| {
        std::env::var(k)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(d)
    };
    let dir = PathBuf::from(std::env::var("NVFP4DBG_BENCH_DIR").expect("set NVFP4DBG_BENCH_DIR"));
    let (layers, e) = (
        env("NVFP4DBG_BENCH_LAYERS", 2),
        env("NVFP4DBG_BENCH_EXPERTS", 64),
    );
    let swizzle = env("NVFP4DBG_BENCH_SWIZZLE", 0) == 1;
    let (h, i) = (7168usize, 2048usize);
    let a = dir.join("ckpt");
    let b_name = std::env::var("NVFP4DBG_BENCH_B").unwrap_or_else(|_| "engine.safetensors".into());
    let write_a = !a.join("model.safetensors.index.json").exists();
    std::fs::create_dir_all(&a).unwrap();
    let config = serde_json::json!({
        "hidden_size": h, "moe_intermediate_size": i, "n_routed_experts": e,
        "num_experts_per_tok": 8, "num_hidden_layers": layers + 1, "first_k_dense_replace": 1,
    });
    std::fs::write(
        a.join("config.json"),
        serde_json::to_vec_pretty(&config).unwrap(),
    )
    .unwrap();
    let seed = |l: usize, x: usize, p: usize, scales: bool| {
        ((l * 1000 + x) * 8 + p * 2 + usize::from(scales)) as u64
    };
    let dims = |p: usize| if p == 2 { (h, i) } else { (i, h) };
    let names = ["gate_proj", "up_proj", "down_proj"];
    let s2 = |p: usize| 1e-4f32 * (1.0 + p as f32);
    let mut weight_map = serde_json::Map::new();
    for l in (1..=layers).filter(|_| write_a) {
        let file = format!("model-{l:05}-of-{layers:05}.safetensors");
        let mut specs = vec![];
        for x in 0..e {
            for (p, n) in names.iter().enumerate() {
                let (rows, cols) = dims(p);
                let base = format!("model.layers.{l}.mlp.experts.{x}.{n}");
                specs.push(TensorSpec::new(
                    format!("{base}.weight"),
                    Dtype::U8,
                    &[rows, cols / 2],
                ));
                specs.push(TensorSpec::new(
                    format!("{base}.weight_scale"),
                    Dtype::F8_E4M3,
                    &[rows, cols / 16],
                ));
                specs.push(TensorSpec::new(
                    format!("{base}.weight_scale_2"),
                    Dtype::F32,
                    &[],
                ));
                specs.push(TensorSpec::new(
                    format!("{base}.input_scale"),
                    Dtype::F32,
                    &[],
                ));
            }
        }
        for s in &specs {
            weight_map.insert(s.name.clone(), Value::String(file.clone()));
        }
        let mut w = ShardWriter::create(&a.join(&file), specs, None).unwrap();
        for x in 0..e {
            for p in 0..3 {
                let (rows, cols) = dims(p);
                let mut buf = vec![0u8; rows * cols / 2];
                fill(seed(l, x, p, false), &mut buf, false);
                w.write_next(&buf).unwrap();
                let mut sc = vec![0u8; rows * cols / 16];
                fill(seed(l, x, p, true), &mut sc, true);
                w.write_next(&sc).unwrap();
                w.write_next(&f32_bytes(&[1e-4 * (1.0 + p as f32)]))
                    .unwrap();
                w.write_next(&f32_bytes(&[2e-3])).unwrap();
            }
        }
        w.finish().unwrap();
    }
    if write_a {
        let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
        std::fs::write(
            a.join("model.safetensors.index.json"),
            serde_json::to_vec(&index).unwrap(),
        )
        .unwrap();
    }

    // B: fused, one file
    let mut specs = vec![];
    for l in 1..=layers {
        let ex = |s: &str| format!("model.layers.{l}.mlp.experts.{s}");
        // the 128x4 swizzle of [2I, H/16] = [4096, 448] has no padding: same shape either way
        let sc13 = [e, 2 * i, h / 16];
        specs.extend([
            TensorSpec::new(ex("w13_weight"), Dtype::U8, &[e, 2 * i, h / 2]),
            TensorSpec::new(ex("w13_weight_scale"), Dtype::F8_E4M3, &sc13),
            TensorSpec::new(ex("w13_weight_scale_2"), Dtype::F32, &[e, 2]),
            TensorSpec::new(ex("w13_input_scale"), Dtype::F32, &[e, 2]),
            TensorSpec::new(ex("w2_weight"), Dtype::U8, &[e, h, i / 2]),
            TensorSpec::new(ex("w2_weight_scale"), Dtype::F8_E4M3, &[e, h, i / 16]),
            TensorSpec::new(ex("w2_weight_scale_2"), Dtype::F32, &[e]),
            TensorSpec::new(ex("w2_input_scale"), Dtype::F32, &[e]),
        ]);
    }
    let mut w = ShardWriter::create(&dir.join(b_name), specs, None).unwrap();
    for l in 1..=layers {
        let gen = |x: usize, p: usize, scales: bool| {
            let (rows, cols) = dims(p);
            let mut v = vec![0u8; rows * cols / if scales { 16 } else { 2 }];
            fill(seed(l, x, p, scales), &mut v, scales);
            v
        };
        let mut w13 = Vec::with_capacity(e * 2 * i * h / 2);
        for x in 0..e {
            w13.extend(gen(x, 0, false));
            w13.extend(gen(x, 1, false));
        }
        w.write_next(&w13).unwrap();
        drop(w13);
        let mut s13 = vec![];
        for x in 0..e {
            let mut s: Vec<u8> = gen(x, 0, true);
            s.extend(gen(x, 1, true));
            if swizzle {
                // 2I = 4096 rows and H/16 = 448 blocks fill the 128x4 tiles: same size, permuted
                s = layout::swizzle(&s, 2 * i, h / 16);
            }
            s13.extend(s);
        }
        w.write_next(&s13).unwrap();
        w.write_next(&f32_bytes(
            &(0..e).flat_map(|_| [s2(0), s2(1)]).collect::<Vec<_>>(),
        ))
        .unwrap();
        w.write_next(&f32_bytes(&vec![2e-3f32; 2 * e])).unwrap();
        let w2: Vec<u8> = (0..e).flat_map(|x| gen(x, 2, false)).collect();
        w.write_next(&w2).unwrap();
        let sc2: Vec<u8> = (0..e).flat_map(|x| gen(x, 2, true)).collect();
        w.write_next(&sc2).unwrap();
        w.write_next(&f32_bytes(&vec![s2(2); e])).unwrap();
        w.write_next(&f32_bytes(&vec![2e-3f32; e])).unwrap();
    }
    w.finish().unwrap();
}

/// At DeepSeek's shapes both block-scale layouts have one size (2I a multiple of 128, H/16 of
/// 4). A swapped or misplaced expert matches A under neither reading, so its layout comes from
/// its fused tensor's other experts, read swizzled. Gate/up swapped and an expert permutation
/// went unnamed there: "values differ" at cosine ~0, the expert's scales read linear.
#[test]
fn swaps_under_swizzled_scales_of_an_ambiguous_size_are_named() {
    let fx = fixture_dims(4, 64, 64);
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(fx.seed ^ 5);
    let bad = r.gen_range(0..4);
    let dump = fx.root.join("swapped.safetensors");
    let out = fx.run_fused(
        &dump,
        &Faults {
            swizzle: true,
            swap: vec![bad],
            ..Default::default()
        },
        &[],
        1,
    );
    let d = out.json["diagnoses"].as_array().unwrap();
    assert!(
        d.iter()
            .any(|d| d["kind"] == "gate_up_swapped" && d["experts"] == serde_json::json!([bad])),
        "seed {}: {d:?}",
        fx.seed
    );
    // the expert_permutation diagnosis of a swizzled dump whose experts are in `order`
    let permutation = |order: Vec<usize>| -> (Value, Value) {
        let out = fx.run_fused(
            &dump,
            &Faults {
                swizzle: true,
                order: Some(order),
                ..Default::default()
            },
            &[],
            1,
        );
        let d = &out.json["diagnoses"];
        let p = d
            .as_array()
            .unwrap()
            .iter()
            .find(|d| d["kind"] == "expert_permutation")
            .unwrap_or_else(|| panic!("seed {}: {d}", fx.seed))
            .clone();
        (p, out.json)
    };
    let (x, y) = (bad, (bad + r.gen_range(1..4)) % 4);
    let mut order: Vec<usize> = (0..4).collect();
    order.swap(x, y);
    let (p, json) = permutation(order);
    let msg = p["message"].as_str().unwrap();
    assert!(
        msg.contains(&format!("{x}←{y}")) && msg.contains(&format!("{y}←{x}")),
        "seed {}: {msg}",
        fx.seed
    );
    // every expert's scales are named swizzled, none linear
    assert!(
        !diag_kinds(&json).contains(&"mixed_scale_layouts".to_string()),
        "seed {}: {}",
        fx.seed,
        json["diagnoses"]
    );
    // every expert misplaced (a rotation): no expert confirms the layout, yet the permutation
    // is found by the codes and confirmed under the scales' swizzled reading
    let k = r.gen_range(1..4);
    let (p, _) = permutation((0..4).map(|e| (e + k) % 4).collect());
    assert_eq!(
        p["experts"],
        serde_json::json!([0, 1, 2, 3]),
        "seed {}: {p}",
        fx.seed
    );
    assert!(
        p["message"].as_str().unwrap().contains(&format!("0←{k}")),
        "seed {}: {p}",
        fx.seed
    );
}

/// Another TP rank's slice of w13 under swizzled scales of a size both layouts fit: every
/// expert's gate and up read linear for want of a match, and only the down projections (whose
/// swizzled size is padded) were named as rank 0's slice. The gate/up were "values differ".
#[test]
fn another_tp_ranks_slice_under_swizzled_scales_of_an_ambiguous_size_is_named() {
    let fx = fixture_dims(2 + (draw::<u8>() % 3) as usize, 64, 128);
    let e = fx.model.experts.len();
    let dump = fx.root.join("tp.safetensors");
    let faults = Faults {
        swizzle: true,
        tp: Some((0, 2)),
        ..Default::default()
    };
    fx.run_fused(&dump, &faults, &["--tp-rank", "0", "--tp-size", "2"], 0);
    let out = fx.run_fused(&dump, &faults, &["--tp-rank", "1", "--tp-size", "2"], 1);
    let m = out.json["mismatches"].as_array().unwrap();
    // every expert's gate, up and down, the shared expert's three, the embedding
    assert_eq!(m.len(), 3 * e + 4, "seed {}: {m:?}", fx.seed);
    for u in m {
        assert!(
            u["issues"]
                .to_string()
                .contains("B holds TP rank 0's slice"),
            "seed {}: {u}",
            fx.seed
        );
    }
}

/// Every fused-dump fault named at DeepSeek-like dims, where both block-scale layouts of w13
/// and w2 have one size (rows a multiple of 128, K/16 of 4), under vLLM's swizzled scales: the
/// diagnoses that read B's scales must not depend on a size that tells the layout.
#[test]
fn faults_are_named_under_swizzled_scales_of_ambiguous_sizes() {
    let fx = fixture_dims(4, 128, 64);
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(fx.seed ^ 7);
    let x = r.gen_range(0..4);
    let dump = fx.root.join("d.safetensors");
    let f = || Faults {
        swizzle: true,
        ..Default::default()
    };
    let cases: Vec<(&str, Faults)> = vec![
        (
            "gate_up_swapped",
            Faults {
                swap: vec![x],
                ..f()
            },
        ),
        (
            "gate_up_codes_swapped",
            Faults {
                swap_codes_only: vec![x],
                ..f()
            },
        ),
        (
            "nibbles_swapped",
            Faults {
                nibble_swap: vec![x],
                ..f()
            },
        ),
        (
            "scale_2_flipped",
            Faults {
                flip_w2_scale_2: true,
                ..f()
            },
        ),
        (
            "scale_2_gate_only",
            Faults {
                gate_only_scale_2: true,
                ..f()
            },
        ),
        (
            "expert_permutation",
            Faults {
                order: Some(vec![1, 0, 3, 2]),
                ..f()
            },
        ),
        (
            "scale_2_input_scale_swapped",
            Faults {
                swap_scale_2_input: true,
                ..f()
            },
        ),
        (
            "mixed_scale_layouts",
            Faults {
                swizzle: false,
                swizzle_only: vec![x],
                ..f()
            },
        ),
        (
            "derived_scale",
            Faults {
                processed: Some(false),
                bad_alpha: Some(x),
                ..f()
            },
        ),
        (
            "NaN code",
            Faults {
                nan_scale: Some(x),
                ..f()
            },
        ),
        (
            "never loaded",
            Faults {
                w2_zero: Some(x),
                ..f()
            },
        ),
    ];
    fx.run_fused(&dump, &f(), &[], 0);
    for (want, faults) in cases {
        let out = fx.run_fused(&dump, &faults, &[], 1);
        let named = if want.contains(' ') {
            out.json["mismatches"].to_string().contains(want)
        } else {
            diag_kinds(&out.json).iter().any(|k| k == want)
        };
        assert!(named, "seed {} {want}: {}", fx.seed, out.json["diagnoses"]);
    }
}

/// Both orders of one pair: (A→B run, B→A run).
fn both_orders(fx: &Fixture, a: &Path, b: &Path) -> (Run, Run) {
    (run(&fx.root, &[s(a), s(b)]), run(&fx.root, &[s(b), s(a)]))
}

/// The names of a run's mismatched units with their issue kinds, sorted.
fn mismatch_kinds(out: &Run) -> Vec<(String, String)> {
    let mut v: Vec<(String, String)> = out.json["mismatches"]
        .as_array()
        .map(|m| {
            m.iter()
                .map(|u| {
                    let kinds: Vec<String> = u["issues"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter_map(|i| i["kind"].as_str().map(String::from))
                        .collect();
                    (
                        u["name"].as_str().unwrap_or("").to_string(),
                        kinds.join(","),
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// The `swizzled_scales` diagnoses' messages of a run.
fn swizzle_notes(out: &Run) -> Vec<String> {
    out.json["diagnoses"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|d| d["kind"] == "swizzled_scales")
        .filter_map(|d| d["message"].as_str().map(String::from))
        .collect()
}

/// D1: a vLLM dump whose block scales are in the 128x4 swizzle, at sizes where both layouts
/// have one size (every DeepSeek shape; K/16 = 16 included, where the swizzle is its own
/// inverse), gives the same verdict and the same mismatches as A and as B, and the diagnosis
/// names the dump's side. As A its w2 scales were read linear: every down_proj "values
/// differ", blamed on B.
#[test]
fn a_swizzled_dump_gives_one_verdict_in_either_order() {
    for (h, i) in [(128, 64), (256, 128)] {
        let fx = fixture_dims(4, h, i);
        let x = rand_chacha::ChaCha8Rng::seed_from_u64(fx.seed ^ 11).gen_range(0..4);
        let dump = fx.root.join("swz.safetensors");
        let swizzled = Faults {
            swizzle: true,
            ..Default::default()
        };
        write_fused(&fx.model, &dump, &swizzled);
        let (fwd, rev) = both_orders(&fx, &fx.ckpt, &dump);
        let what = format!("seed {} h {h} i {i}", fx.seed);
        check(&fwd, 0, fx.seed);
        check(&rev, 0, fx.seed);
        for (out, side) in [(&fwd, "B"), (&rev, "A")] {
            let notes = swizzle_notes(out);
            assert!(
                !notes.is_empty()
                    && notes
                        .iter()
                        .all(|n| n.contains(&format!("{side}'s block scales"))),
                "{what}: {notes:?}"
            );
            // the 12 expert units hold other bytes: never counted bitwise
            assert_eq!(
                out.json["summary"]["equal_after_conversion"], 12,
                "{what}: {}",
                out.stdout
            );
            assert!(
                out.stdout.contains(&format!(
                    "12 equal after reading {side}'s block scales in the 128x4 swizzle"
                )),
                "{what}: {}",
                out.stdout
            );
        }
        // a fault behind the swizzle: the same one mismatch either way
        let faulty = Faults {
            w2_scale_2_set: Some((x, 3.0 * fx.model.experts[x].w2.scale_2)),
            ..swizzled
        };
        write_fused(&fx.model, &dump, &faulty);
        let (fwd, rev) = both_orders(&fx, &fx.ckpt, &dump);
        check(&fwd, 1, fx.seed);
        check(&rev, 1, fx.seed);
        let want = vec![(
            format!("model.layers.{LAYER}.mlp.experts.{x}.down_proj.weight"),
            "scale_2".to_string(),
        )];
        assert_eq!(mismatch_kinds(&fwd), want, "{what}: {}", fwd.stdout);
        assert_eq!(mismatch_kinds(&rev), want, "{what}: {}", rev.stdout);
    }
}

/// The ModelOpt checkpoint with `experts`' block scales stored in the 128x4 swizzle (of the
/// same size as linear at these dims).
fn write_swizzled_experts(m: &Model, path: &Path, experts: &[usize]) {
    let mut v = m.hf_tensors();
    for (spec, bytes) in v.iter_mut() {
        let swizzle = experts.iter().any(|e| {
            spec.name
                .starts_with(&format!("model.layers.{LAYER}.mlp.experts.{e}."))
        }) && spec.name.ends_with(".weight_scale");
        if swizzle {
            *bytes = layout::swizzle(bytes, spec.shape[0], spec.shape[1]);
        }
    }
    write_file(path, v, None).unwrap();
}

/// D2: one expert's block scales stored swizzled inside a ModelOpt checkpoint (the others
/// linear) is a mix a kernel reads wrong: exit 1 in either order, naming that expert and the
/// side that holds it, and its tensors are never "bitwise". It passed as "bitwise". A side
/// swizzled throughout (an engine's per-linear dump) passes, counted as equal after reading
/// its scales in the swizzle.
#[test]
fn one_experts_swizzled_scales_in_a_checkpoint_are_a_mixed_layout() {
    let fx = fixture_dims(4, 128, 128);
    let odd = rand_chacha::ChaCha8Rng::seed_from_u64(fx.seed ^ 13).gen_range(0..4);
    let faulty = fx.root.join("odd.safetensors");
    write_swizzled_experts(&fx.model, &faulty, &[odd]);
    let (fwd, rev) = both_orders(&fx, &fx.ckpt, &faulty);
    for (out, side) in [(&fwd, "B"), (&rev, "A")] {
        let what = format!("seed {} faulty side {side}", fx.seed);
        check(out, 1, fx.seed);
        let mixed: Vec<&Value> = out.json["diagnoses"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|d| d["kind"] == "mixed_scale_layouts")
            .collect();
        // w13 and w2
        assert_eq!(mixed.len(), 2, "{what}: {}", out.json["diagnoses"]);
        for d in mixed {
            assert_eq!(d["experts"], serde_json::json!([odd]), "{what}: {d}");
            assert_eq!(d["fails"], true);
            let msg = d["message"].as_str().unwrap();
            assert!(
                msg.contains(&format!("{side}'s routed experts"))
                    && msg.contains(&format!("expert(s) {odd} in the 128x4 swizzled layout")),
                "{what}: {msg}"
            );
        }
        // its 3 tensors hold other bytes: not bitwise, and each is a mismatch (a kernel reads
        // it in the wrong layout), listed under `mismatches` with a scales issue
        let units = out.json["summary"]["units"].as_u64().unwrap();
        assert_eq!(out.json["summary"]["equal"], units - 3, "{what}");
        assert_eq!(out.json["summary"]["mismatched"], 3, "{what}");
        let listed = out.json["mismatches"].as_array().unwrap();
        assert!(
            listed.len() == 3
                && listed.iter().all(|m| m["name"]
                    .as_str()
                    .unwrap()
                    .contains(&format!("experts.{odd}."))
                    && m["issues"][0]["kind"] == "scales"),
            "{what}: {listed:?}"
        );
    }
    // every expert swizzled: one layout, a pass with the note
    let all = fx.root.join("all.safetensors");
    write_swizzled_experts(&fx.model, &all, &[0, 1, 2, 3]);
    let (fwd, rev) = both_orders(&fx, &fx.ckpt, &all);
    for (out, side) in [(&fwd, "B"), (&rev, "A")] {
        check(out, 0, fx.seed);
        assert_eq!(
            diag_kinds(&out.json),
            ["swizzled_scales"],
            "seed {}",
            fx.seed
        );
        assert!(
            out.stdout.contains(&format!(
                "12 equal after reading {side}'s block scales in the 128x4 swizzle"
            )),
            "seed {}: {}",
            fx.seed,
            out.stdout
        );
    }
    // the rule is in the help
    let help = Command::new(env!("CARGO_BIN_EXE_nvfp4dbg"))
        .args(["compare-weights", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(
        help.contains("swizzled throughout") && help.contains("mixed_scale_layouts"),
        "{help}"
    );
}

/// The checkpoint in compressed-tensors names (`weight_global_scale` = 1/weight_scale_2),
/// its block scales halved and its global scales doubled when `half`; `gs_of` gives each
/// linear's stored weight_global_scale from its weight_scale_2 (None: not written).
fn write_ct(m: &Model, path: &Path, half: bool, gs_of: &dyn Fn(&str, f32) -> Option<f32>) {
    let mut v = m.common("model.", "mlp");
    for (e, x) in m.experts.iter().enumerate() {
        for (n, t, ins) in [
            ("gate_proj", &x.w1, x.in1),
            ("up_proj", &x.w3, x.in3),
            ("down_proj", &x.w2, x.in2),
        ] {
            let base = format!("model.layers.{LAYER}.mlp.experts.{e}.{n}");
            let scales: Vec<u8> = if half {
                t.scales.iter().map(|&c| halve_e4m3(c)).collect()
            } else {
                t.scales.clone()
            };
            let ws2 = if half { 2.0 * t.scale_2 } else { t.scale_2 };
            v.push((
                TensorSpec::new(
                    format!("{base}.weight_packed"),
                    Dtype::U8,
                    &[t.rows, t.cols / 2],
                ),
                t.packed.clone(),
            ));
            v.push((
                TensorSpec::new(
                    format!("{base}.weight_scale"),
                    Dtype::F8_E4M3,
                    &[t.rows, t.cols / 16],
                ),
                scales,
            ));
            if let Some(gs) = gs_of(&base, ws2) {
                v.push((
                    TensorSpec::new(format!("{base}.weight_global_scale"), Dtype::F32, &[1]),
                    f32_bytes(&[gs]),
                ));
            }
            v.push((
                TensorSpec::new(format!("{base}.input_global_scale"), Dtype::F32, &[1]),
                f32_bytes(&[1.0 / ins]),
            ));
        }
    }
    write_file(path, v, None).unwrap();
}

/// An e4m3 code's value halved, exactly: the exponent one down (a normal code above the
/// smallest binade; zero stays zero).
fn halve_e4m3(c: u8) -> u8 {
    let exp = (c >> 3) & 0xF;
    if c & 0x7F == 0 {
        return c;
    }
    assert!(exp >= 2, "block scale code {c:#04x} has no exact half");
    c - 0x08
}

/// D5: a global scale re-encoded by a power of two (block scales halved, global scale
/// doubled) and stored in the other convention is the same values: the ulp its reciprocal
/// costs is allowed, and no more. Every weight_scale_2 is nudged to one whose doubled value
/// does not survive the f32 reciprocal round trip: each gave "scale_2 ×2.000000" at cosine 1.
#[test]
fn a_power_of_two_reencoding_in_the_other_convention_is_the_same_values() {
    let mut fx = fixture_dims(4, 128, 64);
    let survives = |v: f32| 1.0 / (1.0 / (2.0 * v)) == 2.0 * v;
    for x in fx.model.experts.iter_mut() {
        for t in [&mut x.w1, &mut x.w3, &mut x.w2] {
            while survives(t.scale_2) {
                t.scale_2 = f32::from_bits(t.scale_2.to_bits() + 1);
            }
        }
    }
    let ckpt = fx.root.join("ckpt-nudged");
    fx.model.write_hf(&ckpt);
    let ct_half = fx.root.join("ct-half.safetensors");
    write_ct(&fx.model, &ct_half, true, &|_, ws2| Some(1.0 / ws2));
    let (fwd, rev) = both_orders(&fx, &ckpt, &ct_half);
    for out in [&fwd, &rev] {
        check(out, 0, fx.seed);
        assert_eq!(out.json["summary"]["mismatched"], 0, "seed {}", fx.seed);
        assert!(
            out.json["close"]
                .to_string()
                .contains("1 ulp from the exact"),
            "seed {}: {}",
            fx.seed,
            out.json["close"]
        );
    }
    // 3 ulps off in the other convention: another scale
    let bad = format!("model.layers.{LAYER}.mlp.experts.1.up_proj");
    let off = fx.root.join("ct-half-off.safetensors");
    write_ct(&fx.model, &off, true, &|base, ws2| {
        let gs = 1.0 / ws2;
        Some(if base == bad {
            f32::from_bits(gs.to_bits() + 3)
        } else {
            gs
        })
    });
    let (fwd, rev) = both_orders(&fx, &ckpt, &off);
    let want = vec![(format!("{bad}.weight"), "scale_2".to_string())];
    for out in [&fwd, &rev] {
        check(out, 1, fx.seed);
        assert_eq!(mismatch_kinds(out), want, "seed {}", fx.seed);
    }
    // 1 ulp off in one convention: no reciprocal to excuse it
    let mut v = fx.model.hf_tensors();
    for (spec, bytes) in v.iter_mut() {
        if spec.name.ends_with(".weight_scale") {
            *bytes = bytes.iter().map(|&c| halve_e4m3(c)).collect();
        }
        if let Some(base) = spec.name.strip_suffix(".weight_scale_2") {
            let ws2 = f32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
            let doubled = 2.0 * ws2;
            let stored = if base == bad {
                f32::from_bits(doubled.to_bits() + 1)
            } else {
                doubled
            };
            *bytes = f32_bytes(&[stored]);
        }
    }
    let mo_half = fx.root.join("modelopt-half-off.safetensors");
    write_file(&mo_half, v, None).unwrap();
    let (fwd, rev) = both_orders(&fx, &ckpt, &mo_half);
    for out in [&fwd, &rev] {
        check(out, 1, fx.seed);
        assert_eq!(mismatch_kinds(out), want, "seed {}", fx.seed);
    }
}

/// D6: a linear without its global scale fails whichever side lacks it, named as that side's
/// convention names it: a compressed-tensors A without `weight_global_scale` passed against
/// ModelOpt ("close", with a note), while the reverse order failed naming `weight_scale_2`.
#[test]
fn a_missing_global_scale_fails_on_either_side() {
    let fx = fixture(3);
    let e = rand_chacha::ChaCha8Rng::seed_from_u64(fx.seed ^ 17).gen_range(0..3);
    let base = format!("model.layers.{LAYER}.mlp.experts.{e}.gate_proj");
    let ct = fx.root.join("ct-missing.safetensors");
    write_ct(&fx.model, &ct, false, &|b, ws2| {
        (b != base).then_some(1.0 / ws2)
    });
    let (fwd, rev) = both_orders(&fx, &ct, &fx.ckpt);
    let want = vec![(format!("{base}.weight"), "missing_member".to_string())];
    for (out, lacking) in [(&fwd, "A"), (&rev, "B")] {
        check(out, 1, fx.seed);
        assert_eq!(
            mismatch_kinds(out),
            want,
            "seed {}: {}",
            fx.seed,
            out.stdout
        );
        let msg = out.json["mismatches"][0]["issues"][0]["message"]
            .as_str()
            .unwrap();
        assert!(
            msg.contains(&format!(
                "{lacking} has no weight_global_scale (`{base}.weight_global_scale`)"
            )),
            "seed {}: {msg}",
            fx.seed
        );
    }
    // the other side's weight_scale_2 has no counterpart: extra in B, or missing in B
    let ws2 = serde_json::json!([format!("{base}.weight_scale_2")]);
    assert_eq!(fwd.json["extra"], ws2, "seed {}", fx.seed);
    assert_eq!(rev.json["missing"], ws2, "seed {}", fx.seed);
    // a ModelOpt side without weight_scale_2, against compressed-tensors: its own name
    let full_ct = fx.root.join("ct.safetensors");
    write_ct(&fx.model, &full_ct, false, &|_, ws2| Some(1.0 / ws2));
    let mut v = fx.model.hf_tensors();
    v.retain(|(t, _)| t.name != format!("{base}.weight_scale_2"));
    let mo = fx.root.join("modelopt-missing.safetensors");
    write_file(&mo, v, None).unwrap();
    let (fwd, rev) = both_orders(&fx, &mo, &full_ct);
    for (out, lacking) in [(&fwd, "A"), (&rev, "B")] {
        check(out, 1, fx.seed);
        assert_eq!(mismatch_kinds(out), want, "seed {}", fx.seed);
        assert!(
            out.json["mismatches"][0]["issues"][0]["message"]
                .as_str()
                .unwrap()
                .contains(&format!(
                    "{lacking} has no weight_scale_2 (`{base}.weight_scale_2`)"
                )),
            "seed {}",
            fx.seed
        );
    }
}

/// A dense layer's MLP, quantized: `prefix` `mlp.{gate,up,down}_proj` (HF) or `ffn.{w1,w3,w2}`
/// (native) triples of layer 0.
fn dense_mlp(m: &Model, r: &mut impl Rng, native: bool) -> Vec<(TensorSpec, Vec<u8>)> {
    let mut v = vec![];
    let (h, i) = (m.h, 2 * m.i);
    let mut r2 = rand_chacha::ChaCha8Rng::seed_from_u64(r.gen());
    for (hf, nat, rows, cols) in [
        ("gate_proj", "w1", i, h),
        ("up_proj", "w3", i, h),
        ("down_proj", "w2", h, i),
    ] {
        let t = quantize_weight_nvfp4(&randn(&mut r2, rows * cols, 0.05), rows, cols).0;
        let base = if native {
            format!("layers.0.ffn.{nat}")
        } else {
            format!("model.layers.0.mlp.{hf}")
        };
        triple(&mut v, &base, &t, 0.004);
    }
    v
}

/// D8: native dense-MLP names (`layers.0.ffn.w1`, quantized members too) pair with HF's
/// `model.layers.0.mlp.gate_proj`: identical weights gave "3 missing, 3 extra" (12 members).
#[test]
fn native_dense_mlp_names_pair_with_hf() {
    let fx = fixture(3);
    let seed = fx.seed ^ 19;
    let hf = fx.root.join("hf.safetensors");
    let mut v = fx.model.hf_tensors();
    v.extend(dense_mlp(
        &fx.model,
        &mut rand_chacha::ChaCha8Rng::seed_from_u64(seed),
        false,
    ));
    write_file(&hf, v, None).unwrap();
    let native = fx.root.join("native.safetensors");
    let mut v = fx.model.common("", "ffn");
    v.extend(dense_mlp(
        &fx.model,
        &mut rand_chacha::ChaCha8Rng::seed_from_u64(seed),
        true,
    ));
    write_native_experts(&fx.model, v, &native);
    let (fwd, rev) = both_orders(&fx, &hf, &native);
    for out in [&fwd, &rev] {
        check(out, 0, fx.seed);
        assert_eq!(
            (
                out.json["missing"].as_array().map(Vec::len),
                out.json["extra"].as_array().map(Vec::len)
            ),
            (Some(0), Some(0)),
            "seed {}",
            fx.seed
        );
        // 9 routed + 3 dense quantized linears, all bitwise
        assert_eq!(
            out.json["summary"]["equal"], out.json["summary"]["units"],
            "seed {}",
            fx.seed
        );
    }
}

/// Two engine dumps (fused, both layouts of one size) equal as stored but for one expert,
/// whose block scales one holds swizzled and the other linear: one side mixes layouts, and
/// nothing tells which (each holds whatever its kernels read), so the diagnosis names the
/// expert and both readings, the same way in either order. It blamed A, linear assumed.
#[test]
fn two_dumps_differing_in_one_experts_layout_name_both_readings() {
    let fx = fixture_dims(4, 128, 64);
    let odd = rand_chacha::ChaCha8Rng::seed_from_u64(fx.seed ^ 23).gen_range(0..4);
    let (all, one) = (
        fx.root.join("all.safetensors"),
        fx.root.join("one.safetensors"),
    );
    write_fused(
        &fx.model,
        &all,
        &Faults {
            swizzle: true,
            ..Default::default()
        },
    );
    let others: Vec<usize> = (0..4).filter(|&e| e != odd).collect();
    write_fused(
        &fx.model,
        &one,
        &Faults {
            swizzle_only: others,
            ..Default::default()
        },
    );
    let (fwd, rev) = both_orders(&fx, &all, &one);
    for (out, swizzled_in) in [(&fwd, "A"), (&rev, "B")] {
        check(out, 1, fx.seed);
        let d: Vec<&Value> = out.json["diagnoses"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|d| d["kind"] == "mixed_scale_layouts")
            .collect();
        assert_eq!(d.len(), 2, "seed {}: {d:?}", fx.seed);
        for d in d {
            assert_eq!(d["experts"], serde_json::json!([odd]), "seed {}", fx.seed);
            let msg = d["message"].as_str().unwrap();
            assert!(
                msg.contains(&format!("in the 128x4 swizzled layout in {swizzled_in}"))
                    && msg.contains("one side mixes layouts"),
                "seed {}: {msg}",
                fx.seed
            );
        }
    }
}

/// A float side against a quantized one whose block scales are swizzled at a size both layouts
/// fit (rows % 128 == 0, K/16 % 4 == 0: DeepSeek's shapes): the BF16 values a loader
/// dequantized from that tensor compare close once the scales are read swizzled, with a note
/// saying so; they used to be read linear only and fail as "values differ". A float side that
/// is not those values still fails.
#[test]
fn a_float_side_against_ambiguous_swizzled_scales_reads_them_swizzled() {
    let seed: u64 = draw();
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let d = tempfile::tempdir().unwrap();
    let (rows, cols) = (128 * r.gen_range(1..3), 64 * r.gen_range(1..3));
    let w = randn(&mut r, rows * cols, 0.02);
    let (t, _) = quantize_weight_nvfp4(&w, rows, cols);
    let base = "model.layers.0.self_attn.o_proj";
    let mut swizzled = t.clone();
    swizzled.scales = layout::swizzle(&t.scales, rows, cols / 16);
    let mut q = vec![];
    triple(&mut q, base, &swizzled, 0.01);
    write_file(&d.path().join("q.safetensors"), q, None).unwrap();
    for (name, values, want) in [
        ("dequantized", t.dequantize(), 0),
        ("another", randn(&mut r, rows * cols, 0.02), 1),
    ] {
        let f = d.path().join(format!("{name}.safetensors"));
        let spec = TensorSpec::new(format!("{base}.weight"), Dtype::BF16, &[rows, cols]);
        write_file(&f, vec![(spec, bf16_bytes(&values))], None).unwrap();
        let out = run(d.path(), &[s(&f), "q.safetensors", "--device", "cpu"]);
        assert_eq!(
            out.code, want,
            "seed {seed}: {name}:\n{}\n{}",
            out.stdout, out.stderr
        );
        if want == 0 {
            assert!(
                out.json.to_string().contains("read in the 128x4 swizzle"),
                "seed {seed}: {}",
                out.json
            );
        }
    }
}

/// The file at `path` rewritten without the tensor whose name ends with `suffix`.
fn drop_tensor(path: &Path, suffix: &str) {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let mut v = vec![];
    for (k, t) in header.as_object().unwrap() {
        if k == "__metadata__" || k.ends_with(suffix) {
            continue;
        }
        let off = |i: usize| 8 + n + t["data_offsets"][i].as_u64().unwrap() as usize;
        let dtype: Dtype = serde_json::from_value(t["dtype"].clone()).unwrap();
        let shape: Vec<usize> = serde_json::from_value(t["shape"].clone()).unwrap();
        v.push((
            TensorSpec::new(k.clone(), dtype, &shape),
            bytes[off(0)..off(1)].to_vec(),
        ));
    }
    assert!(v.len() + 1 == header.as_object().unwrap().len(), "{suffix}");
    write_file(path, v, None).unwrap();
}

/// A fused dump without `w2_weight_scale` lists A's `down_proj.weight_scale` of every expert
/// under `missing` (they were `unreadable` mismatches with `missing` empty), and the same
/// dump as the reference is bad input naming its packed weight (it was exit 1).
#[test]
fn a_fused_dump_missing_its_block_scales_lists_them_as_missing() {
    let fx = fixture(3);
    let dump = fx.root.join("fused.safetensors");
    write_fused(&fx.model, &dump, &Faults::default());
    drop_tensor(&dump, "w2_weight_scale");
    let out = run(&fx.root, &[s(&fx.ckpt), s(&dump)]);
    check(&out, 1, fx.seed);
    let want: Vec<String> = (0..3)
        .map(|e| format!("model.layers.{LAYER}.mlp.experts.{e}.down_proj.weight_scale"))
        .collect();
    assert_eq!(
        out.json["missing"],
        serde_json::json!(want),
        "seed {}",
        fx.seed
    );
    for m in out.json["mismatches"].as_array().unwrap() {
        assert_eq!(
            m["issues"][0]["kind"], "missing_member",
            "seed {}: {m}",
            fx.seed
        );
    }
    let out = run(&fx.root, &[s(&dump), s(&fx.ckpt)]);
    check(&out, 2, fx.seed);
    assert!(
        out.stderr.contains("w2_weight`") && out.stderr.contains("without block scales"),
        "seed {}: {}",
        fx.seed,
        out.stderr
    );
}

/// One expert's w2 block scales halved (the codes A's) is named with its factor; one changed
/// scale byte in another expert is not called rescaled (both were only "N of M blocks differ").
#[test]
fn block_scales_rescaled_at_load_are_named_with_their_factor() {
    let fx = fixture(4);
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(fx.seed);
    let (bad, stray) = (r.gen_range(0..2), r.gen_range(2..4));
    let dump = fx.root.join("fused.safetensors");
    write_fused(&fx.model, &dump, &Faults::default());
    let per = fx.model.h * fx.model.i / 16;
    let stray_at = stray * per + r.gen_range(0..per);
    edit_tensor(&dump, "w2_weight_scale", |i, b| {
        if i / per == bad {
            let v = nvfp4dbg::nvfp4::e4m3::decode(*b) * 0.5;
            *b = nvfp4dbg::nvfp4::e4m3::encode_saturating(v);
        } else if i == stray_at {
            *b ^= 0x08;
        }
    });
    let out = run(&fx.root, &[s(&fx.ckpt), s(&dump)]);
    check(&out, 1, fx.seed);
    let msg = |e: usize| {
        out.json["mismatches"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| {
                m["name"]
                    .as_str()
                    .unwrap()
                    .contains(&format!("experts.{e}.down_proj"))
            })
            .map(|m| m["issues"][0]["message"].as_str().unwrap().to_string())
            .unwrap_or_else(|| panic!("seed {}: expert {e} not a mismatch", fx.seed))
    };
    assert!(
        msg(bad).contains("block scales are A's ×0.5"),
        "seed {}: {}",
        fx.seed,
        msg(bad)
    );
    assert!(
        !msg(stray).contains("rescaled"),
        "seed {}: {}",
        fx.seed,
        msg(stray)
    );
}

/// SGLang's shared-expert fusion: the shared expert as fused index E after the E routed ones,
/// no `shared_experts` tensors. A faithful dump passes (it failed: the shared expert "missing",
/// expert E "extra"), and a changed code in that slot is a mismatch of the shared expert.
#[test]
fn sglang_fused_shared_expert_is_compared_as_the_shared_expert() {
    let fx = fixture(3);
    let m = &fx.model;
    let (h, i, e) = (m.h, m.i, m.experts.len());
    let shared: Vec<Fp4Tensor> = m
        .shared
        .iter()
        .enumerate()
        .map(|(k, w)| {
            let (rows, cols) = if k == 2 { (h, i) } else { (i, h) };
            quantize_weight_nvfp4(w, rows, cols).0
        })
        .collect();
    let not_shared =
        |v: &mut Vec<(TensorSpec, Vec<u8>)>| v.retain(|(t, _)| !t.name.contains("shared_experts"));
    // A: the checkpoint with its shared expert quantized as well
    let mut a = m.hf_tensors();
    not_shared(&mut a);
    for (n, t) in ["gate_proj", "up_proj", "down_proj"].iter().zip(&shared) {
        triple(
            &mut a,
            &format!("model.layers.{LAYER}.mlp.shared_experts.{n}"),
            t,
            0.004,
        );
    }
    let ckpt = fx.root.join("ckpt_q");
    m.config(&ckpt);
    write_file(&ckpt.join("model.safetensors"), a, None).unwrap();
    // B: fused [routed experts; shared expert]
    let all: Vec<[&Fp4Tensor; 3]> = m
        .experts
        .iter()
        .map(|x| [&x.w1, &x.w3, &x.w2])
        .chain(std::iter::once([&shared[0], &shared[1], &shared[2]]))
        .collect();
    let ins: Vec<[f32; 3]> = m
        .experts
        .iter()
        .map(|x| [x.in1, x.in3, x.in2])
        .chain(std::iter::once([0.004; 3]))
        .collect();
    let cat = |f: &dyn Fn(&[&Fp4Tensor; 3]) -> Vec<u8>| all.iter().flat_map(f).collect::<Vec<u8>>();
    let p = format!("model.layers.{LAYER}.mlp.experts.");
    let n = e + 1;
    let mut b = m.common("model.", "mlp");
    not_shared(&mut b);
    b.extend([
        (
            TensorSpec::new(format!("{p}w13_weight"), Dtype::U8, &[n, 2 * i, h / 2]),
            cat(&|x| [x[0].packed.clone(), x[1].packed.clone()].concat()),
        ),
        (
            TensorSpec::new(
                format!("{p}w13_weight_scale"),
                Dtype::F8_E4M3,
                &[n, 2 * i, h / 16],
            ),
            cat(&|x| [x[0].scales.clone(), x[1].scales.clone()].concat()),
        ),
        (
            TensorSpec::new(format!("{p}w13_weight_scale_2"), Dtype::F32, &[n, 2]),
            cat(&|x| f32_bytes(&[x[0].scale_2, x[1].scale_2])),
        ),
        (
            TensorSpec::new(format!("{p}w13_input_scale"), Dtype::F32, &[n, 2]),
            f32_bytes(&ins.iter().flat_map(|s| [s[0], s[1]]).collect::<Vec<f32>>()),
        ),
        (
            TensorSpec::new(format!("{p}w2_weight"), Dtype::U8, &[n, h, i / 2]),
            cat(&|x| x[2].packed.clone()),
        ),
        (
            TensorSpec::new(
                format!("{p}w2_weight_scale"),
                Dtype::F8_E4M3,
                &[n, h, i / 16],
            ),
            cat(&|x| x[2].scales.clone()),
        ),
        (
            TensorSpec::new(format!("{p}w2_weight_scale_2"), Dtype::F32, &[n]),
            cat(&|x| f32_bytes(&[x[2].scale_2])),
        ),
        (
            TensorSpec::new(format!("{p}w2_input_scale"), Dtype::F32, &[n]),
            f32_bytes(&ins.iter().map(|s| s[2]).collect::<Vec<f32>>()),
        ),
    ]);
    let dump = fx.root.join("sglang.safetensors");
    write_file(&dump, b, None).unwrap();
    let out = run(&fx.root, &[s(&ckpt), s(&dump)]);
    check(&out, 0, fx.seed);
    assert!(
        out.stdout.contains("shared-expert fusion"),
        "seed {}: {}",
        fx.seed,
        out.stdout
    );
    // one code of the shared slot's w2 changed
    let per = h * i / 2;
    let at = e * per + (fx.seed as usize % per);
    edit_tensor(&dump, "w2_weight", |k, x| {
        if k == at {
            *x ^= 0x01;
        }
    });
    let out = run(&fx.root, &[s(&ckpt), s(&dump)]);
    check(&out, 1, fx.seed);
    let mm = out.json["mismatches"].as_array().unwrap();
    assert_eq!(mm.len(), 1, "seed {}: {mm:?}", fx.seed);
    assert_eq!(
        mm[0]["name"],
        format!("model.layers.{LAYER}.mlp.shared_experts.down_proj.weight"),
        "seed {}",
        fx.seed
    );
}

/// B's w2 block scales are A's linear ones put through the inverse swizzle (a loader
/// "unswizzling" scales that were never swizzled). A is a checkpoint, whose scales are linear
/// (DESIGN §3), so the fault is B's: it used to pass as "A's block scales are swizzled" (every
/// expert) or blame A ("A's routed experts' w2 hold block scales in both layouts", one expert).
#[test]
fn inverse_swizzle_of_b_against_a_checkpoint_is_blamed_on_b() {
    let fx = fixture_dims(4, 128, 64);
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(fx.seed ^ 5);
    let odd = r.gen_range(0..4);
    for experts in [(0..4).collect::<Vec<_>>(), vec![odd]] {
        let dump = fx.root.join("unswizzled.safetensors");
        let out = fx.run_fused(
            &dump,
            &Faults {
                w2_unswizzled: experts.clone(),
                ..Default::default()
            },
            &[],
            1,
        );
        let d = out.json["diagnoses"].as_array().unwrap();
        assert_eq!(
            diag_kinds(&out.json),
            ["inverse_swizzle"],
            "seed {}: {d:?}",
            fx.seed
        );
        assert_eq!(
            d[0]["experts"],
            serde_json::json!(experts),
            "seed {}",
            fx.seed
        );
        assert_eq!(d[0]["fails"], true);
        let msg = d[0]["message"].as_str().unwrap();
        assert!(
            msg.contains("B's block scales")
                && msg.contains("inverse")
                && msg.contains("w2_weight"),
            "seed {}: {msg}",
            fx.seed
        );
    }
    // the checkpoint as B: the dump (A) is the one that unswizzled
    let dump = fx.root.join("unswizzled.safetensors");
    let out = run(&fx.root, &[s(&dump), s(&fx.ckpt)]);
    check(&out, 1, fx.seed);
    let d = out.json["diagnoses"].as_array().unwrap();
    assert_eq!(
        diag_kinds(&out.json),
        ["inverse_swizzle"],
        "seed {}: {d:?}",
        fx.seed
    );
    assert!(d[0]["message"]
        .as_str()
        .unwrap()
        .contains("A's block scales"));
}

/// A fused dump without `w13_weight` but with its block scales and scalars: only the packed
/// weights are missing. B's `w13_weight_scale`, `_scale_2` and `input_scale` were listed
/// missing too (4 names per expert projection where 1 is absent).
#[test]
fn a_dump_missing_w13_weight_lists_only_what_is_absent() {
    let fx = fixture(3);
    let dump = fx.root.join("no-w13.safetensors");
    write_fused(&fx.model, &dump, &Faults::default());
    drop_tensor(&dump, "experts.w13_weight");
    let out = run(&fx.root, &[s(&fx.ckpt), s(&dump)]);
    check(&out, 1, fx.seed);
    let missing: Vec<&str> = out.json["missing"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m.as_str().unwrap())
        .collect();
    let want: Vec<String> = (0..3)
        .flat_map(|e| {
            ["gate_proj", "up_proj"]
                .map(|p| format!("model.layers.{LAYER}.mlp.experts.{e}.{p}.weight"))
        })
        .collect();
    assert_eq!(missing, want, "seed {}", fx.seed);
}

/// A native-V4 MXFP4 expert (32-element blocks, UE8M0 scales) against engine dumps of it:
/// BF16 values dequantized with each scale applied to 16 elements, or with the UE8M0 bytes
/// read as E4M3, and the scale bytes tagged F8_E4M3. Each is named as what it is; they were
/// "values differ" and "A is mxfp4, B is nvfp4".
#[test]
fn mxfp4_scales_misread_by_an_engine_are_named() {
    let seed = SEED.with(|s| *s);
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let dir = tempfile::tempdir().unwrap();
    let (n, k) = (64, 256);
    let base = format!("layers.{LAYER}.ffn.experts.1.w1");
    let packed: Vec<u8> = (0..n * k / 2).map(|_| r.gen()).collect();
    // UE8M0 around 2^-8..2^-1 (0x7F, E4M3's NaN, left out)
    let scales: Vec<u8> = (0..n * k / 32).map(|_| r.gen_range(119..127)).collect();
    let a = dir.path().join("a.safetensors");
    let q = |scale_dtype: Dtype| {
        vec![
            (
                TensorSpec::new(format!("{base}.weight"), Dtype::U8, &[n, k / 2]),
                packed.clone(),
            ),
            (
                TensorSpec::new(format!("{base}.weight_scale"), scale_dtype, &[n, k / 32]),
                scales.clone(),
            ),
        ]
    };
    write_file(&a, q(Dtype::F8_E8M0), None).unwrap();
    const E2M1: [f32; 16] = [
        0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
    ];
    let ue8m0 = |b: u8| 2f32.powi(b as i32 - 127);
    let e4m3 = |b: u8| {
        let (e, m) = ((b >> 3) & 0xF, (b & 7) as f32);
        if e == 0 {
            m / 8.0 * 2f32.powi(-6)
        } else {
            (1.0 + m / 8.0) * 2f32.powi(e as i32 - 7)
        }
    };
    let deq = |scale: &dyn Fn(usize, usize) -> f32| -> Vec<f32> {
        (0..n * k)
            .map(|i| {
                let (row, c) = (i / k, i % k);
                let code = (packed[i / 2] >> (4 * (c % 2))) & 0xF;
                E2M1[code as usize] * scale(row, c)
            })
            .collect()
    };
    let kb = k / 32;
    let b = dir.path().join("b.safetensors");
    for (what, vals, needle) in [
        (
            "16-element blocks",
            deq(&|row, c| ue8m0(scales[row * kb + (c / 16) % kb])),
            "applied to 16 elements instead of 32",
        ),
        (
            "E4M3",
            deq(&|row, c| e4m3(scales[row * kb + c / 32])),
            "read as E4M3",
        ),
    ] {
        let t = (
            TensorSpec::new(format!("{base}.weight"), Dtype::BF16, &[n, k]),
            bf16_bytes(&vals),
        );
        write_file(&b, vec![t], None).unwrap();
        let out = run(dir.path(), &[s(&a), s(&b)]);
        check(&out, 1, seed);
        let issues = &out.json["mismatches"][0]["issues"];
        let m = issues
            .as_array()
            .unwrap()
            .iter()
            .find(|i| i["kind"] == "scales_misread")
            .unwrap_or_else(|| panic!("seed {seed} {what}: {issues}"));
        let msg = m["message"].as_str().unwrap();
        assert!(
            msg.contains(needle) && msg.contains(&base),
            "seed {seed} {what}: {msg}"
        );
        assert!(
            diag_kinds(&out.json).contains(&"scales_misread".to_string()),
            "seed {seed}"
        );
    }
    // the right reading: equal after dequantization, no misreading named
    let vals = deq(&|row, c| ue8m0(scales[row * kb + c / 32]));
    let t = (
        TensorSpec::new(format!("{base}.weight"), Dtype::BF16, &[n, k]),
        bf16_bytes(&vals),
    );
    write_file(&b, vec![t], None).unwrap();
    check(&run(dir.path(), &[s(&a), s(&b)]), 0, seed);
    // the UE8M0 bytes tagged F8_E4M3
    write_file(&b, q(Dtype::F8_E4M3), None).unwrap();
    let out = run(dir.path(), &[s(&a), s(&b)]);
    check(&out, 1, seed);
    let issue = &out.json["mismatches"][0]["issues"][0];
    let msg = issue["message"].as_str().unwrap();
    assert_eq!(issue["kind"], "dtype", "seed {seed}: {msg}");
    assert!(
        msg.contains("tagged F8_E4M3") && msg.contains("UE8M0") && msg.contains(&base),
        "seed {seed}: {msg}"
    );
}

/// A swizzled dump of EP rank 1 of 4 holding rank 2's experts: every expert mismatches, so no
/// unit pairs up to decide B's layout, but B's experts hold A's (rank 2's) only read swizzled.
/// The per-tensor numbers are taken in that layout: they read B's swizzled scales as linear
/// (another cosine and max_abs_err than the values B holds).
#[test]
fn another_ranks_swizzled_experts_are_measured_in_the_swizzled_layout() {
    let fx = fixture_dims(8, 128, 64);
    let mut order: Vec<usize> = (0..8).collect();
    order[2..4].copy_from_slice(&[4, 5]);
    let dump = fx.root.join("rank2.safetensors");
    let out = fx.run_fused(
        &dump,
        &Faults {
            order: Some(order),
            ep: Some((1, 4)),
            swizzle: true,
            ..Default::default()
        },
        &["--ep-rank", "1", "--ep-size", "4"],
        1,
    );
    assert!(diag_kinds(&out.json).contains(&"ep_rank".to_string()));
    let mm = out.json["mismatches"].as_array().unwrap();
    assert_eq!(mm.len(), 6, "seed {}: {mm:?}", fx.seed);
    for m in mm {
        assert_eq!(m["b_scales"], "swizzled", "seed {}: {m}", fx.seed);
    }
    let cos = |a: &[f32], b: &[f32]| {
        let dot = |x: &[f32], y: &[f32]| {
            x.iter()
                .zip(y)
                .map(|(&p, &q)| p as f64 * q as f64)
                .sum::<f64>()
        };
        dot(a, b) / (dot(a, a) * dot(b, b)).sqrt()
    };
    for e in [2, 3] {
        let name = format!("model.layers.{LAYER}.mlp.experts.{e}.down_proj.weight");
        let m = mm.iter().find(|m| m["name"] == name).unwrap();
        let (a, b) = (
            fx.model.experts[e].w2.dequantize(),
            fx.model.experts[e + 2].w2.dequantize(),
        );
        let got = m["metrics"]["cosine"].as_f64().unwrap();
        assert!(
            (got - cos(&b, &a)).abs() < 1e-9,
            "seed {}: expert {e}: {got} vs {}",
            fx.seed,
            cos(&b, &a)
        );
        let max = a
            .iter()
            .zip(&b)
            .map(|(&x, &y)| (x as f64 - y as f64).abs())
            .fold(0f64, f64::max);
        assert_eq!(
            m["metrics"]["max_abs_err"].as_f64().unwrap(),
            max,
            "seed {}",
            fx.seed
        );
    }
}

/// BF16 originals against their checkpoint differ by NVFP4's quantization error, which is no
/// load error to hunt: each is named as the unquantized source (it quantizes back to the
/// checkpoint's codes), where it read as 48 bare "values differ". An engine's dequantized copy
/// with one row damaged is not called that.
#[test]
fn bf16_originals_are_named_as_the_unquantized_source() {
    let seed: u64 = draw();
    let tmp = tempfile::tempdir().unwrap();
    let ck = tmp.path().join("ck");
    let synth = Command::new(env!("CARGO_BIN_EXE_nvfp4dbg"))
        .args([
            "synth",
            "--preset",
            "tiny",
            "--layers",
            "2",
            "--no-report-dir",
            "-q",
        ])
        .args(["--seed", &(seed % 100_000).to_string(), "--out", s(&ck)])
        .output()
        .unwrap();
    assert!(synth.status.success(), "seed {seed}: {synth:?}");
    let out = run(tmp.path(), &[s(&ck), s(&ck.join("bf16"))]);
    check(&out, 1, seed);
    assert_eq!(diag_kinds(&out.json), ["unquantized_source"], "seed {seed}");
    let mm = out.json["mismatches"].as_array().unwrap();
    assert!(!mm.is_empty(), "seed {seed}");
    for m in mm {
        assert!(
            m["issues"]
                .as_array()
                .unwrap()
                .iter()
                .any(|i| i["kind"] == "unquantized_source"),
            "seed {seed}: {m}"
        );
    }

    let fx = fixture(4);
    let bad = fx.seed as usize % 4;
    let mut v = vec![];
    for (e, x) in fx.model.experts.iter().enumerate() {
        for (proj, t) in [("gate", &x.w1), ("up", &x.w3), ("down", &x.w2)] {
            let mut w = t.dequantize();
            if e == bad && proj == "down" {
                w[3 * t.cols..4 * t.cols].iter_mut().for_each(|v| *v *= 3.0);
            }
            let name = format!("model.layers.{LAYER}.mlp.experts.{e}.{proj}_proj.weight");
            v.push((
                TensorSpec::new(name, Dtype::F32, &[t.rows, t.cols]),
                f32_bytes(&w),
            ));
        }
    }
    let dump = fx.root.join("dequantized.safetensors");
    write_file(&dump, v, None).unwrap();
    let out = run(&fx.root, &[s(&fx.ckpt), s(&dump)]);
    check(&out, 1, fx.seed);
    assert!(
        !diag_kinds(&out.json).contains(&"unquantized_source".to_string()),
        "seed {}: {:?}",
        fx.seed,
        out.json["diagnoses"]
    );
    let mm = out.json["mismatches"].as_array().unwrap();
    assert_eq!(mm.len(), 1, "seed {}: {mm:?}", fx.seed);
    assert!(
        mm[0]["name"]
            .as_str()
            .unwrap()
            .contains(&format!("experts.{bad}.down_proj")),
        "seed {}",
        fx.seed
    );
}
