//! The scales vLLM's ModelOpt NVFP4 MoE derives after loading, checked against the
//! checkpoint's: `g1_alphas = w13_input_scale · w13_weight_scale_2` (the gate's `weight_scale_2`;
//! `w13_input_scale` the max of w1's and w3's per expert, or over all experts for FlashInfer
//! backends with a global scale), `w13_input_scale_quant = 1 / w13_input_scale`, and
//! `g2_alphas` / `w2_input_scale_quant` likewise from w2. A wrong alpha scales every output of
//! the expert; a wrong `*_input_scale_quant` is the activation gs itself.

use super::compare::AScalars;
use super::diagnose::{Diagnosis, DiagnosisKind};
use super::inventory::{ExpertProj, FusedLayer};
use super::rules::Renamed;
use crate::checkpoint::{Proj, TensorSource};
use std::collections::HashMap;

/// Within 1e-6 relative, between finite values (against an infinity the bound is infinite).
fn close(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits()
        || (a.is_finite() && b.is_finite() && (a - b).abs() <= 1e-6 * a.abs().max(b.abs()))
}

/// Candidate derivations of one per-expert value: (how, values by index).
type Candidates = Vec<(&'static str, Vec<Option<f32>>)>;

fn per_expert_and_global(per: Vec<Option<f32>>) -> Candidates {
    let global = per
        .iter()
        .flatten()
        .copied()
        .fold(None, |m: Option<f32>, v| Some(m.map_or(v, |m| m.max(v))));
    let g = vec![global; per.len()];
    vec![
        ("per expert", per),
        ("max over the experts (a global scale)", g),
    ]
}

/// Check the derived tensors of B's fused layer `fl` against A's scalars.
pub fn check(
    b: &Renamed,
    fl: &FusedLayer,
    a: &HashMap<ExpertProj, AScalars>,
    diagnoses: &mut Vec<Diagnosis>,
    notes: &mut Vec<String>,
) {
    let at = |e: usize, proj| {
        a.get(&ExpertProj {
            layer: fl.layer,
            expert: e,
            proj,
        })
        .copied()
    };
    let n = fl.experts;
    let input13: Vec<Option<f32>> = (0..n)
        .map(|i| {
            let g = fl.global.get(i).copied()?;
            let (x, y) = (
                at(g, Proj::Gate)?.input_scale?,
                at(g, Proj::Up)?.input_scale?,
            );
            Some(x.max(y))
        })
        .collect();
    let input2: Vec<Option<f32>> = (0..n)
        .map(|i| at(*fl.global.get(i)?, Proj::Down)?.input_scale)
        .collect();
    let ws2 = |proj| -> Vec<Option<f32>> {
        (0..n)
            .map(|i| at(*fl.global.get(i)?, proj)?.scale_2)
            .collect()
    };
    let (ws2_gate, ws2_down) = (ws2(Proj::Gate), ws2(Proj::Down));
    for (name, tensor) in &fl.derived {
        let (inputs, ws2) = if name.starts_with("w13") || name == "g1_alphas" {
            (per_expert_and_global(input13.clone()), &ws2_gate)
        } else {
            (per_expert_and_global(input2.clone()), &ws2_down)
        };
        let alpha = name.starts_with('g');
        let expected: Candidates = inputs
            .into_iter()
            .map(|(how, v)| {
                let e = v
                    .iter()
                    .zip(ws2)
                    .map(|(x, w)| match (x, w) {
                        (Some(x), Some(w)) if alpha => Some(x * w),
                        (Some(x), _) if !alpha => Some(crate::nvfp4::rcp(*x)),
                        _ => None,
                    })
                    .collect();
                (how, e)
            })
            .collect();
        let Ok(got) = b.tensor_f32(tensor) else {
            notes.push(format!(
                "`{}`: not a float tensor; not checked",
                b.original(tensor)
            ));
            continue;
        };
        if got.len() != n {
            diagnoses.push(Diagnosis {
                kind: DiagnosisKind::DerivedScale,
                layer: Some(fl.layer),
                experts: vec![],
                tensors: 1,
                message: format!(
                    "`{}` holds {} values for {n} experts",
                    b.original(tensor),
                    got.len()
                ),
                fails: true,
                units: vec![],
            });
            continue;
        }
        let fits = |v: &[Option<f32>]| (0..n).all(|i| v[i].is_none_or(|e| close(e, got[i])));
        if let Some((how, _)) = expected.iter().find(|(_, v)| fits(v)) {
            notes.push(format!(
                "layer {}: `{name}` agrees with the checkpoint's scales ({how})",
                fl.layer
            ));
            continue;
        }
        let (_, per) = &expected[0];
        let bad: Vec<usize> = (0..n)
            .filter(|&i| per[i].is_some_and(|e| !close(e, got[i])))
            .collect();
        let i = bad.first().copied().unwrap_or(0);
        let formula = match name.as_str() {
            "g1_alphas" => "max(w1, w3 input_scale) × w1's weight_scale_2",
            "g2_alphas" => "w2 input_scale × w2 weight_scale_2",
            "w13_input_scale_quant" => "1 / max(w1, w3 input_scale)",
            _ => "1 / w2 input_scale",
        };
        diagnoses.push(Diagnosis {
            kind: DiagnosisKind::DerivedScale,
            layer: Some(fl.layer),
            experts: bad.iter().filter_map(|&i| fl.global.get(i).copied()).collect(),
            tensors: bad.len(),
            message: format!(
                "layer {}: `{name}` disagrees with the checkpoint for {} of {n} experts; expert {}: B {:e}, expected {:e} \
                 (= {formula}); a wrong alpha scales every output of the expert, a wrong input_scale_quant is the activation gs",
                fl.layer,
                bad.len(),
                fl.global.get(i).copied().unwrap_or(i),
                got[i],
                per[i].unwrap_or(f32::NAN)
            ),
            fails: true,
            units: vec![],
        });
    }
}

#[cfg(test)]
mod tests {
    use super::close;

    #[test]
    fn close_never_holds_against_an_infinity() {
        assert!(close(1.0, 1.0 + 1e-7));
        assert!(!close(1.0, 1.001));
        assert!(!close(3.0e-4, f32::INFINITY));
        assert!(!close(f32::INFINITY, 3.0e-4));
        assert!(!close(3.0e-4, f32::NEG_INFINITY));
    }
}
