//! Which layout each side's block scales are in, where their size fits both the linear
//! `[N, K/16]` and the 128x4 swizzle (rows a multiple of 128, K/16 of 4: every DeepSeek
//! shape). Nothing in the bytes tells the two apart, so a unit's layouts are decided by
//! pairing: the reading of the two sides under which they agree. Either side may be the
//! swizzled one (an engine's dump is A as often as B), so both sides' swizzled readings are
//! tried, and the decision does not change when A and B are exchanged.
//!
//! A side's units then vote per operand (its routed experts' w13, their w2, its other
//! linears): a side holds one layout, swizzled or linear (an engine's dump swizzles what its
//! kernels read, a checkpoint does not), and a side that mixes the two within one operand
//! holds some scales a kernel reads wrong. Units equal on both sides as stored say only that
//! the two sides agree: linear where either side is a checkpoint's own tensors, unknown
//! between two engine dumps.

use super::compare::{Status, UnitResult};
use super::view::{QMatrix, ScalesSeen};
use crate::checkpoint::Proj;
use crate::nvfp4::layout::{layout_by_cosines, ScaleLayout};
use std::collections::{BTreeMap, BTreeSet};

/// Rows whose two scale readings decide an ambiguous layout: one row of 128-row swizzle
/// tiles (128 · K/16 block scales, each permuted within its tile).
pub const LAYOUT_ROWS: usize = 128;

/// The reading of a unit's block scales under which its two sides pair up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reading {
    /// Both as their sizes say (a size both layouts fit: linear).
    AsStored,
    /// A's block scales in the 128x4 swizzle.
    ASwizzled,
    /// B's block scales in the 128x4 swizzle.
    BSwizzled,
    /// One side's block scales in the 128x4 swizzle, and the bytes cannot tell which: with
    /// K/16 = 16 the swizzle is its own inverse (it exchanges a row's 32-row group with its
    /// 4-block group), so A swizzled against B and B against A are the same pairing. Which
    /// side it is, the side's other units tell ([`settle_open`]).
    EitherSwizzled,
}

/// One side of a unit: its matrix as stored and, where the size fits both layouts, its first
/// [`LAYOUT_ROWS`] rows under the swizzled reading of its block scales (what decides; the
/// whole swizzled reading is built for the winner only: DeepSeek's shapes are all ambiguous,
/// and unswizzling every tensor of both sides would cost more than comparing them).
#[derive(Clone, Copy)]
pub struct Readings<'r, 'a> {
    pub stored: &'r QMatrix<'a>,
    pub swizzled_head: Option<&'r QMatrix<'a>>,
}

/// The rows the first tile of `m` spans.
pub fn head_rows(m: &QMatrix) -> usize {
    m.rows.min(LAYOUT_ROWS)
}

/// The stored readings agree on the block scales: all of them where the codes are equal,
/// else the first tile's (a unit with other codes differs in its scales too, as a rule, but
/// the layout is the same). Nothing more needs deciding then.
pub fn stored_agree(a: &QMatrix, b: &QMatrix, packed_equal: bool) -> bool {
    if packed_equal {
        return a.scales == b.scales;
    }
    let tile = head_rows(a) * a.kb();
    a.scales.get(..tile) == b.scales.get(..tile)
}

/// The reading that pairs `a` with `b`. The stored reading holds when the block scales
/// agree as stored ([`stored_agree`]); else a side's swizzled reading wins when under it the
/// first tile's scales agree and under the other side's they do not (under both: the
/// swizzle is its own inverse, [`Reading::EitherSwizzled`]), or, when no reading makes them
/// agree (a unit with a fault), when its cosine over the first tile is decisively nearer
/// than the stored reading's ([`layout_by_cosines`]) and nearer than the other side's
/// swizzled reading.
pub fn choose(a: Readings, b: Readings, packed_equal: bool) -> Reading {
    if (a.swizzled_head.is_none() && b.swizzled_head.is_none())
        || stored_agree(a.stored, b.stored, packed_equal)
    {
        return Reading::AsStored;
    }
    let tile = head_rows(a.stored) * a.stored.kb();
    let agrees = |head: Option<&QMatrix>, other: &QMatrix| {
        head.is_some_and(|h| Some(&h.scales[..]) == other.scales.get(..tile))
    };
    let (a_agrees, b_agrees) = (
        agrees(a.swizzled_head, b.stored),
        agrees(b.swizzled_head, a.stored),
    );
    match (a_agrees, b_agrees) {
        (true, false) => Reading::ASwizzled,
        (false, true) => Reading::BSwizzled,
        (true, true) => Reading::EitherSwizzled,
        (false, false) => by_cosines(a, b),
    }
}

/// [`choose`] by the cosines of the first [`LAYOUT_ROWS`] rows under each reading.
fn by_cosines(a: Readings, b: Readings) -> Reading {
    let n = head_rows(a.stored);
    let (Some(a_head), Some(b_head)) = (a.stored.rows_slice(0, n), b.stored.rows_slice(0, n))
    else {
        return Reading::AsStored;
    };
    let stored = head_cosine(&a_head, &b_head);
    let a_swz = a.swizzled_head.map(|x| head_cosine(x, &b_head));
    let b_swz = b.swizzled_head.map(|y| head_cosine(&a_head, y));
    // the nearer of the two swizzled readings (NaN compares false: no winner); equally near
    // (up to the f64 sums' rounding), the swizzle is its own inverse and they are one pairing
    let (best, reading) = match (a_swz, b_swz) {
        (Some(x), Some(y)) if (x - y).abs() <= COSINE_TIE => (x.max(y), Reading::EitherSwizzled),
        (Some(x), Some(y)) if x > y => (x, Reading::ASwizzled),
        (Some(x), Some(y)) if y > x => (y, Reading::BSwizzled),
        (Some(x), None) => (x, Reading::ASwizzled),
        (None, Some(y)) => (y, Reading::BSwizzled),
        _ => return Reading::AsStored,
    };
    if layout_by_cosines(stored, best) == ScaleLayout::Swizzled {
        reading
    } else {
        Reading::AsStored
    }
}

/// Two cosines this close are one: the two readings give the same values, in another order
/// of the f64 sums.
const COSINE_TIE: f64 = 1e-12;

/// Cosine of two quantized matrices of one shape (the fused pass where it applies).
fn head_cosine(a: &QMatrix, b: &QMatrix) -> f64 {
    super::fused::metrics_nvfp4(a, b)
        .unwrap_or_else(|| super::compare::metrics_qq(a, b))
        .cosine
}

/// The note of a unit compared with `side`'s block scales read swizzled (None: one side's,
/// the bytes cannot tell which).
pub fn swizzle_note(side: Option<SideName>) -> String {
    format!(
        "{}'s block scales are in the 128x4 swizzled layout (what CUTLASS / FlashInfer kernels \
         take); compared after unswizzling{}",
        side.map_or("A's or B", SideName::label),
        if side.is_none() {
            " (with K/16 = 16 the swizzle is its own inverse: these bytes cannot tell which side \
             holds it)"
        } else {
            ""
        }
    )
}

/// `UnitResult::equal_after`'s clause for a unit compared with `side`'s block scales read
/// swizzled (None: one side's, the bytes cannot tell which).
pub fn relaid_reason(side: Option<SideName>) -> String {
    format!(
        "reading {}'s block scales in the 128x4 swizzle",
        side.map_or("A's or B", SideName::label)
    )
}

/// Name the side of the units whose pairing had either side's scales swizzled
/// ([`Reading::EitherSwizzled`]): the side the other units read swizzled, where one side's
/// did and the other's did not; else the side that is an engine's fused dump, where one is;
/// else they stay open ("A's or B's"). Their values are the same under either reading.
pub fn settle_open(results: &mut [UnitResult]) {
    let seen_swizzled = |side: SideName| {
        results
            .iter()
            .any(|r| !r.swizzle_side_open && r.scales(side) == Some(ScalesSeen::Swizzled))
    };
    let (a, b) = (seen_swizzled(SideName::A), seen_swizzled(SideName::B));
    for r in results.iter_mut().filter(|r| r.swizzle_side_open) {
        let fused = |side: SideName| !r.per_linear(side);
        let side = match (a, b) {
            (true, false) => Some(SideName::A),
            (false, true) => Some(SideName::B),
            _ => match (fused(SideName::A), fused(SideName::B)) {
                (true, false) => Some(SideName::A),
                (false, true) => Some(SideName::B),
                _ => None,
            },
        };
        if let Some(side) = side {
            r.settle_swizzled_side(side);
        }
    }
}

/// One side of the comparison.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SideName {
    A,
    B,
}

impl SideName {
    pub fn label(self) -> &'static str {
        match self {
            SideName::A => "A",
            SideName::B => "B",
        }
    }

    pub fn other(self) -> SideName {
        match self {
            SideName::A => SideName::B,
            SideName::B => SideName::A,
        }
    }
}

/// What one kernel reads in one layout: a side's routed experts' w13 (gate and up) or w2
/// (down), every layer's (an engine runs one MoE backend), or its other quantized linears.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Operand {
    W13,
    W2,
    Other,
}

impl Operand {
    fn of(r: &UnitResult) -> Operand {
        match r.expert.map(|e| e.proj) {
            Some(Proj::Gate | Proj::Up) => Operand::W13,
            Some(Proj::Down) => Operand::W2,
            None => Operand::Other,
        }
    }

    /// "routed experts' w13 (gate_proj/up_proj)".
    pub fn describe(self) -> &'static str {
        match self {
            Operand::W13 => "routed experts' w13 (gate_proj/up_proj)",
            Operand::W2 => "routed experts' w2 (down_proj)",
            Operand::Other => "quantized linears outside the routed experts",
        }
    }
}

impl UnitResult {
    /// How `side` read this unit's block scales (quantized units).
    pub fn scales(&self, side: SideName) -> Option<ScalesSeen> {
        match side {
            SideName::A => self.a_scales,
            SideName::B => self.b_scales,
        }
    }

    /// Where `side` holds this unit, for messages (`…w13_weight[5] rows 0..I (gate)`).
    pub fn label(&self, side: SideName) -> &str {
        match side {
            SideName::A => &self.a,
            SideName::B => &self.b,
        }
    }

    /// The tensor `side` holds this unit in, as stored: `…w13_weight[5] rows 0..I (gate)` →
    /// `…w13_weight`; a linear's packed weight as it is.
    pub fn stored(&self, side: SideName) -> &str {
        let label = self.label(side);
        label.split(['[', ' ']).next().unwrap_or(label)
    }

    /// `side`'s block scales read swizzled because under that reading the two sides pair:
    /// the other side's, of a size both layouts fit, are then linear.
    pub fn read_swizzled(&mut self, side: SideName) {
        let (this, other) = match side {
            SideName::A => (&mut self.a_scales, &mut self.b_scales),
            SideName::B => (&mut self.b_scales, &mut self.a_scales),
        };
        *this = Some(ScalesSeen::Swizzled);
        if *other == Some(ScalesSeen::Ambiguous) {
            *other = Some(ScalesSeen::Linear);
        }
    }

    /// An open [`Reading::EitherSwizzled`] unit is `side`'s swizzled scales.
    fn settle_swizzled_side(&mut self, side: SideName) {
        self.read_swizzled(side);
        self.swizzle_side_open = false;
        let (open_note, note) = (swizzle_note(None), swizzle_note(Some(side)));
        for n in self.notes.iter_mut().filter(|n| **n == open_note) {
            n.clone_from(&note);
        }
        let (open_why, why) = (relaid_reason(None), relaid_reason(Some(side)));
        if let Some(e) = self.equal_after.as_mut() {
            *e = e.replace(&open_why, &why);
        }
    }

    /// What this unit says about its side's layout: swizzled or linear (by the size, or by
    /// the reading under which the sides pair, or read linear and matching the other side's
    /// known layout); the same layout as the other side's (both of a size both layouts fit,
    /// equal as stored: nothing tells which); nothing (it matched under no reading).
    fn layout_evidence(&self, side: SideName) -> Option<Evidence> {
        let other = match side {
            SideName::A => self.b_scales,
            SideName::B => self.a_scales,
        };
        match self.scales(side)? {
            ScalesSeen::Swizzled => Some(Evidence::Swizzled),
            ScalesSeen::Linear => Some(Evidence::Linear),
            ScalesSeen::Ambiguous if self.status == Status::Mismatch || self.swizzle_side_open => {
                None
            }
            ScalesSeen::Ambiguous if other == Some(ScalesSeen::Ambiguous) => Some(Evidence::Same),
            ScalesSeen::Ambiguous => Some(Evidence::Linear),
        }
    }

    /// Stored as its own linear's tensors on `side` (not a slice of a fused tensor).
    fn per_linear(&self, side: SideName) -> bool {
        self.stored(side) == self.label(side)
    }
}

/// What a unit says about its side's layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Evidence {
    Swizzled,
    Linear,
    /// Equal to the other side's as stored, both of a size both layouts fit.
    Same,
}

/// One side's units of one operand, by the layout they were read in.
#[derive(Debug)]
pub struct Group<'r> {
    pub side: SideName,
    pub operand: Operand,
    pub swizzled: Vec<&'r UnitResult>,
    pub linear: Vec<&'r UnitResult>,
    /// Equal to the other side's as stored, of a size both layouts fit: in the layout
    /// [`same_layout`] gives, where it gives one.
    pub same: Vec<&'r UnitResult>,
    /// Quantized units that said nothing about the layout.
    pub undecided: Vec<&'r UnitResult>,
}

impl Group<'_> {
    /// Both layouts within one operand.
    pub fn mixed(&self) -> bool {
        !self.swizzled.is_empty() && !self.linear.is_empty()
    }

    /// Read swizzled, none linear: the side's layout for this operand.
    pub fn swizzled_throughout(&self) -> bool {
        !self.swizzled.is_empty() && self.linear.is_empty()
    }

    /// The units of the smaller set (the swizzled ones on a tie: checkpoints hold linear
    /// scales), and whether they are the swizzled ones.
    pub fn odd_ones_out(&self) -> (&[&UnitResult], bool) {
        if self.swizzled.len() <= self.linear.len() {
            (&self.swizzled, true)
        } else {
            (&self.linear, false)
        }
    }
}

/// Every (side, operand) group of the quantized units, the units equal on both sides as
/// stored counted in the layout [`same_layout`] gives (left in `same` where it gives none).
pub fn groups(results: &[UnitResult]) -> BTreeMap<(SideName, Operand), Group<'_>> {
    let mut out = raw_groups(results);
    for ((_, operand), g) in out.iter_mut() {
        match same_layout(results, *operand) {
            Some(ScaleLayout::Linear) => g.linear.append(&mut g.same),
            Some(ScaleLayout::Swizzled) => g.swizzled.append(&mut g.same),
            None => {}
        }
    }
    out
}

/// The layout of an operand's units that are equal on both sides as stored, where both
/// layouts have their size: linear where either side holds them as a checkpoint does, one
/// linear's own tensors (DESIGN §3: checkpoints hold linear scales); none between two engine
/// dumps' fused tensors (each holds whatever its kernels read: nothing tells).
pub fn same_layout(results: &[UnitResult], operand: Operand) -> Option<ScaleLayout> {
    results
        .iter()
        .filter(|r| Operand::of(r) == operand && r.a_scales.is_some() && r.b_scales.is_some())
        .any(|r| r.per_linear(SideName::A) || r.per_linear(SideName::B))
        .then_some(ScaleLayout::Linear)
}

fn raw_groups(results: &[UnitResult]) -> BTreeMap<(SideName, Operand), Group<'_>> {
    let mut out: BTreeMap<(SideName, Operand), Group> = BTreeMap::new();
    for r in results {
        for side in [SideName::A, SideName::B] {
            if r.scales(side).is_none() {
                continue;
            }
            let operand = Operand::of(r);
            let g = out.entry((side, operand)).or_insert_with(|| Group {
                side,
                operand,
                swizzled: vec![],
                linear: vec![],
                same: vec![],
                undecided: vec![],
            });
            match r.layout_evidence(side) {
                Some(Evidence::Swizzled) => g.swizzled.push(r),
                Some(Evidence::Linear) => g.linear.push(r),
                Some(Evidence::Same) => g.same.push(r),
                None => g.undecided.push(r),
            }
        }
    }
    out
}

/// The tensors (as stored) of `side` to read in the swizzled layout where their size fits
/// both: every unit of an operand whose units were read swizzled and none linear. A unit that
/// matched under neither reading (gate and up swapped, another expert's weights: the nearer
/// of two wrong readings says nothing) is then read as its operand is, so that what it holds
/// can be named.
pub fn swizzled_tensors(results: &[UnitResult], side: SideName) -> BTreeSet<String> {
    groups(results)
        .into_values()
        .filter(|g| g.side == side && g.swizzled_throughout())
        .flat_map(|g| {
            g.swizzled
                .into_iter()
                .chain(g.undecided)
                .map(|r| r.stored(side).to_string())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nvfp4::{layout, Format};
    use crate::weights::view::Mat;
    use rand::{Rng, SeedableRng};
    use std::borrow::Cow;

    fn matrix<'a>(packed: &'a [u8], scales: Vec<u8>, rows: usize, cols: usize) -> QMatrix<'a> {
        QMatrix {
            format: Format::Nvfp4,
            rows,
            cols,
            packed: Mat::dense(packed, rows, cols / 2).unwrap(),
            scales: Cow::Owned(scales),
            scale_2: 1.0,
        }
    }

    fn head<'a>(m: &QMatrix<'a>) -> QMatrix<'a> {
        m.rows_slice(0, head_rows(m)).unwrap()
    }

    /// Whichever side holds the swizzled scales, the decision names it, and exchanging A and
    /// B exchanges the answer: with the same codes, with a few codes changed, with one block
    /// scale changed past the first tile.
    #[test]
    fn either_side_may_be_the_swizzled_one() {
        let seed: u64 = rand::random();
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let (rows, kb) = (128 * r.gen_range(1..3), 4 * r.gen_range(1..4));
        let cols = 16 * kb;
        let packed: Vec<u8> = (0..rows * cols / 2).map(|_| r.gen()).collect();
        let lin: Vec<u8> = (0..rows * kb).map(|_| r.gen_range(0x18..0x60)).collect();
        let swz = layout::swizzle(&lin, rows, kb);
        let mut changed = packed.clone();
        for b in changed.iter_mut() {
            if r.gen_bool(0.05) {
                *b = r.gen();
            }
        }
        let mut late = lin.clone();
        late[rows * kb - 1] ^= 0x08;
        for (what, other_packed, linear_scales) in [
            ("same codes", &packed, &lin),
            ("5% of codes changed", &changed, &lin),
            ("a late block scale changed", &packed, &late),
        ] {
            let linear = matrix(other_packed, linear_scales.clone(), rows, cols);
            // the linear side's swizzled reading: its bytes unswizzled
            let linear_alt = head(&matrix(
                other_packed,
                layout::unswizzle(linear_scales, rows, kb),
                rows,
                cols,
            ));
            let stored_swz = matrix(&packed, swz.clone(), rows, cols);
            let read_swz = head(&matrix(&packed, lin.clone(), rows, cols));
            let swizzled = Readings {
                stored: &stored_swz,
                swizzled_head: Some(&read_swz),
            };
            let linear = Readings {
                stored: &linear,
                swizzled_head: Some(&linear_alt),
            };
            let same = other_packed == &packed;
            assert_eq!(
                choose(swizzled, linear, same),
                Reading::ASwizzled,
                "seed {seed}, {rows}x{kb}: {what}, A swizzled"
            );
            assert_eq!(
                choose(linear, swizzled, same),
                Reading::BSwizzled,
                "seed {seed}, {rows}x{kb}: {what}, B swizzled"
            );
        }
        // both linear, or both swizzled with the same bytes: as stored
        let a = matrix(&packed, lin.clone(), rows, cols);
        let a_alt = head(&matrix(
            &packed,
            layout::unswizzle(&lin, rows, kb),
            rows,
            cols,
        ));
        let both = Readings {
            stored: &a,
            swizzled_head: Some(&a_alt),
        };
        assert_eq!(choose(both, both, true), Reading::AsStored, "seed {seed}");
    }
}
