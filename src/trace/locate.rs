//! The first NaN/Inf of a trace in execution order. A call is *bad* when one of its outputs
//! holds a non-finite value; its inputs then say who made it: clean inputs mean the module
//! itself produced it, bad inputs mean it came from code that ran before (and was not recorded
//! as a module of its own). Bad inputs with clean outputs do not make a call bad: a `-inf`
//! attention mask passed in as an input is normal. Nor does it explain a NaN output: only a NaN
//! input does (a NaN made from a mask's -inf, or from an Inf, was made by this module). An output
//! that holds only `0` and `-inf` is a mask being built, not a bad output. A NaN input never is: the first one (with
//! every output before it clean) is kept as `nan_input`, and a trace with one does not pass.

use super::file::{role, Role, TraceFile};
use super::index::{Skipped, TraceEntry, TraceIndex};
use super::scan::{element_index, tensor_stats, ElementIndex, Kind, TensorStats};
use crate::error::Result;
use std::collections::VecDeque;
use std::path::PathBuf;

/// One tensor of a scanned call.
#[derive(Clone, Debug)]
pub struct ScannedTensor {
    pub name: String,
    pub dtype: String,
    pub shape: Vec<usize>,
    /// `None` for dtypes that cannot hold NaN (ids, masks as bool).
    pub stats: Option<TensorStats>,
}

impl ScannedTensor {
    pub fn is_finite(&self) -> bool {
        self.stats.is_none_or(|s| s.is_finite())
    }
    /// Only `0` and `-inf`: an additive attention mask (see [`TensorStats::is_mask`]).
    pub fn is_mask(&self) -> bool {
        self.stats.is_some_and(|s| s.is_mask())
    }
    /// Holds a NaN/Inf that is not a mask's `-inf`.
    pub fn is_bad(&self) -> bool {
        !self.is_finite() && !self.is_mask()
    }
}

/// One scanned module call.
#[derive(Clone, Debug)]
pub struct ScannedCall {
    pub counter: u64,
    pub module: String,
    pub file: PathBuf,
    pub step: Option<u64>,
    pub tensors: Vec<ScannedTensor>,
}

impl ScannedCall {
    pub fn outputs(&self) -> impl Iterator<Item = &ScannedTensor> {
        self.tensors
            .iter()
            .filter(|t| matches!(role(&t.name), Role::Output(_)))
    }
    pub fn inputs(&self) -> impl Iterator<Item = &ScannedTensor> {
        self.tensors
            .iter()
            .filter(|t| matches!(role(&t.name), Role::Input(_)))
    }
    pub fn outputs_finite(&self) -> bool {
        self.outputs().all(ScannedTensor::is_finite)
    }
    /// No output holds a NaN/Inf other than an attention mask's `-inf` (a module that builds
    /// the mask is not where a NaN starts).
    pub fn outputs_ok(&self) -> bool {
        !self.outputs().any(ScannedTensor::is_bad)
    }
    /// `None` when no input was recorded.
    pub fn inputs_finite(&self) -> Option<bool> {
        let mut any = false;
        let mut all = true;
        for t in self.inputs() {
            any = true;
            all &= t.is_finite();
        }
        any.then_some(all)
    }
}

/// The first non-finite value of one tensor.
#[derive(Clone, Debug)]
pub struct BadValue {
    pub tensor: String,
    pub shape: Vec<usize>,
    pub dtype: String,
    pub index: ElementIndex,
    pub kind: Kind,
    pub value: f32,
    pub nan_count: u64,
    pub inf_count: u64,
}

impl BadValue {
    fn of(t: &ScannedTensor) -> Option<BadValue> {
        let s = t.stats?;
        let (flat, value) = s.first_fault()?;
        Some(BadValue {
            tensor: t.name.clone(),
            shape: t.shape.clone(),
            dtype: t.dtype.clone(),
            index: element_index(&t.shape, flat),
            kind: Kind::of(value)?,
            value,
            nan_count: s.nan_count,
            inf_count: s.inf_count,
        })
    }
}

/// The first bad call.
#[derive(Clone, Debug)]
pub struct FirstNonFinite {
    /// Position of the call in the selected, ordered entries.
    pub position: usize,
    pub call: ScannedCall,
    /// The first bad output tensor of the call, and where in it.
    pub output: BadValue,
    /// `Some(true)`: the recorded inputs were finite, so this module produced the value.
    pub inputs_clean: Option<bool>,
    /// The first bad input, when the inputs were already bad.
    pub bad_input: Option<BadValue>,
    /// With clean inputs: the first input that held ±Inf all the same, not counted because it
    /// cannot explain the output (a NaN output needs a NaN input to have received it; an
    /// additive `0`/`-inf` mask is not a fault): the module made the NaN from it, or by itself.
    pub uncounted_input: Option<BadValue>,
}

#[derive(Clone, Debug)]
pub struct LocateResult {
    pub first: Option<FirstNonFinite>,
    /// The last call before the first bad one whose outputs were all finite.
    pub last_clean: Option<ScannedCall>,
    /// Calls around the first bad one, in order; with no bad output, around `nan_input`'s call
    /// (a swallowed NaN), else the last ones scanned.
    pub window: Vec<ScannedCall>,
    /// Calls whose outputs were scanned (files without an output are not counted).
    pub calls_scanned: usize,
    /// Calls whose file had no `output` tensor: named, not scanned.
    pub skipped: Vec<Skipped>,
    /// The first call before any bad output whose outputs were finite while an input held a
    /// NaN (a ±Inf input is a mask, a NaN never is): made by code between recorded modules, or
    /// recorded by hooks out of order, and swallowed by this module. The value is its first
    /// input holding a NaN.
    pub nan_input: Option<(ScannedCall, BadValue)>,
    /// The last call before `nan_input`'s whose outputs were all finite.
    pub clean_before_nan_input: Option<ScannedCall>,
    /// The first call before the first bad one whose output came within 2x of its dtype's
    /// largest finite value (BF16/F32 3.4e38, F16 65504): where an overflow that turns into Inf
    /// one module later starts. (call, output tensor, its max |x|, the dtype's max.)
    pub near_overflow: Option<(ScannedCall, String, f32, f32)>,
    /// Outputs up to the first bad call that held only `0` and `-inf` (an attention mask being
    /// built): not counted as bad. (counter, module, tensor, -inf count); the number of them.
    pub mask_outputs: Option<(u64, String, String, u64)>,
    pub mask_output_count: usize,
}

/// The largest finite value of a float dtype as `ScannedTensor::dtype` spells it; `None` for
/// FP8 (E4M3 has no Inf, and both saturate by design) and non-float dtypes.
pub fn dtype_max(dtype: &str) -> Option<f32> {
    match dtype {
        "F16" => Some(65504.0),
        "BF16" => Some(3.3895314e38),
        "F32" | "F64" => Some(f32::MAX),
        _ => None,
    }
}

/// The first output of `c` within 2x of its dtype's largest finite value.
fn near_overflow(c: &ScannedCall) -> Option<(String, f32, f32)> {
    c.outputs().find_map(|t| {
        let max = dtype_max(&t.dtype)?;
        let m = t.stats?.max_abs;
        (m >= max / 2.0).then(|| (t.name.clone(), m, max))
    })
}

/// The call's tensors scanned, or why it cannot be (no output: the reason names what the file
/// held instead, a few names and how many, since a header may list millions).
fn scan_call(e: &TraceEntry) -> Result<std::result::Result<ScannedCall, String>> {
    let f = TraceFile::open(&e.path)?;
    if !f.tensors().any(|t| matches!(role(t.name), Role::Output(_))) {
        const SHOWN: usize = 5;
        let names: Vec<String> = f
            .tensors()
            .take(SHOWN)
            .map(|t| format!("`{}`", t.name))
            .collect();
        let n = f.tensors().count();
        let held = match n {
            0 => "it holds no tensor".to_string(),
            _ if n > SHOWN => format!(
                "it holds {n} tensors ({}, … {} more)",
                names.join(", "),
                n - SHOWN
            ),
            _ => format!("it holds {n} tensors ({})", names.join(", ")),
        };
        return Ok(Err(format!(
            "no `output` tensor: {held} (a trace file holds output, output.N, input.N)"
        )));
    }
    let tensors = f
        .tensors()
        .map(|t| ScannedTensor {
            name: t.name.to_string(),
            dtype: format!("{:?}", t.dtype),
            shape: t.shape.to_vec(),
            stats: tensor_stats(&t),
        })
        .collect();
    Ok(Ok(ScannedCall {
        counter: e.counter,
        module: e.module.clone(),
        file: e.path.clone(),
        step: e.step,
        tensors,
    }))
}

/// Scan `index` in order until the first call with a non-finite output, then `context` more
/// calls for the table; `tick` is called once per scanned call. Memory: `2·context + 1` calls,
/// twice that once a NaN input was swallowed (the calls around it, kept in case no output is bad).
pub fn locate(index: &TraceIndex, context: usize, tick: &mut dyn FnMut()) -> Result<LocateResult> {
    let mut before: VecDeque<ScannedCall> = VecDeque::new();
    let mut last_clean: Option<ScannedCall> = None;
    let mut skipped = Vec::new();
    let mut scanned = 0;
    let mut found: Option<FirstNonFinite> = None;
    let mut after = Vec::new();
    let mut nan_input = None;
    let mut clean_before_nan_input = None;
    // the calls around `nan_input`'s call: the table when no output turns out bad
    let mut around_nan_input: Vec<ScannedCall> = Vec::new();
    let mut after_nan_input = 0;
    let mut near = None;
    let mut mask_outputs = None;
    let mut mask_output_count = 0;
    let mut unreadable = None;
    for (pos, e) in index.entries.iter().enumerate() {
        if found.is_some() && after.len() >= context {
            break;
        }
        let scanned_call = scan_call(e);
        tick();
        let call = match scanned_call {
            Ok(Ok(c)) => c,
            Ok(Err(reason)) => {
                skipped.push(Skipped::call(e.path.clone(), reason));
                continue;
            }
            // a damaged file (truncated when the run died) is named and the scan goes on: a
            // NaN before it, or after it, is still the answer; with none, it is bad input
            Err(err) => {
                let why = err.to_string();
                let why = why
                    .strip_prefix(&format!("{}: ", e.path.display()))
                    .unwrap_or(&why);
                skipped.push(Skipped::call(e.path.clone(), format!("unreadable: {why}")));
                unreadable.get_or_insert(err);
                continue;
            }
        };
        scanned += 1;
        if found.is_some() {
            after.push(call);
            continue;
        }
        for t in call.outputs().filter(|t| t.is_mask()) {
            mask_output_count += 1;
            mask_outputs.get_or_insert((
                call.counter,
                call.module.clone(),
                t.name.clone(),
                t.stats.map_or(0, |s| s.inf_count),
            ));
        }
        if call.outputs_ok() {
            if nan_input.is_none() {
                nan_input = call
                    .inputs()
                    .find(|t| t.stats.is_some_and(|s| s.nan_count > 0))
                    .and_then(BadValue::of)
                    .map(|b| (call.clone(), b));
                if nan_input.is_some() {
                    clean_before_nan_input = last_clean.clone();
                    around_nan_input = before.iter().cloned().collect();
                    around_nan_input.push(call.clone());
                }
            } else if after_nan_input < context {
                after_nan_input += 1;
                around_nan_input.push(call.clone());
            }
            if near.is_none() {
                near = near_overflow(&call).map(|(t, m, max)| (call.clone(), t, m, max));
            }
            last_clean = Some(call.clone());
            if before.len() == context {
                before.pop_front();
            }
            if context > 0 {
                before.push_back(call);
            }
            continue;
        }
        let output = call.outputs().filter(|t| t.is_bad()).find_map(BadValue::of);
        let Some(output) = output else { continue };
        // An input explains the output when it holds what the output holds: a NaN output was
        // received only from a NaN input (a -inf mask or an Inf turned into NaN here was made
        // here); an Inf output from any NaN/Inf input but an additive mask.
        let explains = |t: &ScannedTensor| match output.kind {
            Kind::Nan => t.stats.is_some_and(|s| s.nan_count > 0),
            Kind::Inf => t.is_bad(),
        };
        let inputs_clean = call.inputs().next().map(|_| !call.inputs().any(explains));
        let bad_input = call.inputs().filter(|t| explains(t)).find_map(BadValue::of);
        let uncounted_input = match inputs_clean {
            Some(true) => call
                .inputs()
                .filter(|t| !t.is_finite())
                .find_map(BadValue::of),
            _ => None,
        };
        found = Some(FirstNonFinite {
            position: pos,
            call: call.clone(),
            output,
            inputs_clean,
            bad_input,
            uncounted_input,
        });
        before.push_back(call);
    }
    if let Some(err) = unreadable.filter(|_| found.is_none() && nan_input.is_none()) {
        return Err(err);
    }
    let window: Vec<ScannedCall> = match (&found, &nan_input) {
        (None, Some(_)) => around_nan_input,
        _ => before.into_iter().chain(after).collect(),
    };
    Ok(LocateResult {
        first: found,
        last_clean,
        window,
        calls_scanned: scanned,
        skipped,
        nan_input,
        clean_before_nan_input,
        near_overflow: near,
        mask_outputs,
        mask_output_count,
    })
}
