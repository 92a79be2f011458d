//! Blocks whose two sides share their scale code, summed as integers (AVX-512 BW, VL and
//! VBMI), eight blocks (one 64-byte line of each side) at a time, under one global scale or
//! two within 1/64 of each other (a rewritten `weight_scale_2`, a re-quantization). A group
//! whose codes differ goes through the f64 body after its row.
//!
//! Under one scale `s` and global scale `g` every value is exactly `u · A1 + v · A3`, with
//! `A1 = R1 / 2`, `A3 = R3` and `R1 = (1 · s) · g`, `R3 = (1.5 · s) · g` the reference's own f32
//! products: e2m1 0.5, 1, 2, 4 are `u` = 1, 2, 4, 8 (a power of two times `R1` is exact) and
//! 1.5, 3, 6 are `v` = 1, 2, 4 (times `R3`); `u · v = 0` for every value. So a block's sums are
//! small integer sums of code pairs times products of `A1` and `A3`:
//! - the norms `A1² Σu² + A3² Σv²`;
//! - the squared error `= A1² Σ(δu)² − 2 A1 A3 Σ(uv' + vu') + A3² Σ(δv)²`, whose integer
//!   parts `Σ(δu)² = Σu² + Σu'² − 2 Σuu'` are exact: no cancellation in floating point;
//! - the dot product, `(‖x‖² + ‖y‖² − ‖x − y‖²) / 2` of the piece's sums (their rounding is a
//!   few ulps of the norms, as a directly summed dot product's is).
//!
//! Under two global scales B's values are `u' · B1 + v' · B3`, and the squared error is
//! expanded in `D1 = A1 − B1`, `D3 = A3 − B3` so that again no term cancels ([`group`]).
//!
//! The integer sums are byte tables indexed by the code pair (`vpermi2b`, 128 entries: the
//! two magnitudes and whether the signs differ) and summed per block by `vpsadbw`, whose 64-bit
//! lanes are the eight blocks; the f64 products and sums then run with a block per lane. Each
//! product `A1² · n` rounds once, where the reference rounds once per value: the sums agree to
//! a few ulps, as the f64 body's do. `|A1|` and `|A3|` come from 16-entry tables by the scale
//! code's mantissa, their exponent added as an integer ([`coefs`]): no FP unit is spent on them.
//!
//! The largest |difference| of a block is exact, not bounded. With `w = u + 3v` (twice the
//! e2m1 value) and `ε = A3 − 3 A1`, a difference is `A1 δw + ε δv`; `|ε|` is below `|A1| / 16`
//! (checked per scale code), so `|d| = |A1| W + |ε| T` with `W = |δw|` and `T = ± sign(δw) δv`
//! (the sign of `ε A1`), and the element of largest `(W, T)` holds the block's largest `|d|`.
//! Most blocks cannot hold a new maximum: `|d| ≤ |A1| W + 8 |ε|` (plus a slack under two
//! global scales), so a group of blocks none of whose elements reaches its scale code's
//! threshold `W` ([`Codes::thresholds`], from the largest maximum found so far) is passed
//! over. Under two global scales the others' maxima come from the f64 tables; under one
//! ([`exact`]), a byte table
//! ranks the pairs `(W, T)` of each code pair for each sign (`vpermi2b` again), `vpmaxub`
//! takes the block's largest rank, and two more tables give back its `W` and `T`:
//! `|A1| W + |ε| T` is computed exactly in f64 (both products are exact and the sum fits 53
//! bits), the same bits as the reference's `|f64(y) − f64(x)|`.

use super::avx512::{self, Tables};
use super::QMatrix;
use crate::metrics::Accum;
use crate::nvfp4::e4m3;
use std::arch::x86_64::*;
use std::sync::atomic::AtomicU64;

/// e2m1 magnitude codes 0..8 (0, 0.5, 1, 1.5, 2, 3, 4, 6) as `u · A1 + v · A3`.
const U: [i32; 8] = [0, 1, 2, 0, 4, 0, 8, 0];
const V: [i32; 8] = [0, 0, 0, 1, 0, 2, 0, 4];
/// The biases that keep signed code-pair products bytes: `u u'` is at most 64 in magnitude (so
/// the two halves of a block are summed as 64-bit lanes), `u v' + v u'` at most 32 (so the
/// halves' bytes add first). `(δv)²` needs none: at most 64.
const BIAS_UU: i32 = 64;
const BIAS_UV: i32 = 32;
/// Blocks a step: one 64-byte line of packed codes on each side.
const GROUP: usize = 8;

thread_local! {
    static TOPS: std::cell::Cell<Vec<__m512d>> = const { std::cell::Cell::new(Vec::new()) };
}

pub fn available() -> bool {
    avx512::available()
        && std::is_x86_feature_detected!("avx512bw")
        && std::is_x86_feature_detected!("avx512vl")
        && std::is_x86_feature_detected!("avx512vbmi")
}

/// The scale codes whose blocks the integer sums take under one global scale: those whose 16
/// values are all finite and exactly `±(u · A1 + v · A3)`, with `|A3 − 3 A1|` below
/// `|A1| / 16`. Products that are subnormal f32 (tiny scales) or overflow fail this; both
/// sit at the ends of the magnitudes, so the codes taken are magnitude 0 (when it passes) and
/// one run `lo..hi` (a code and its negation alike). Any other code sends its row to the f64
/// body.
pub struct Codes {
    zero: bool,
    lo: u8,
    hi: u8,
    /// `|A1|` and `|A3|` of the codes below 16 (exponents 0 and 1); a code of exponent
    /// `e > 1` takes exponent 1's entry of its mantissa times `2^(e − 1)` (see [`coefs`]).
    coefs: Coefs,
    /// B's `|B1|`, `|B3|` where its global scale is not A's.
    coefs_b: Option<Coefs>,
    /// Per scale-code magnitude, a bound on what B's other global scale adds to a
    /// difference beyond A's terms (`24 |D1| + 4 |D3|`, rounded up; see [`Codes::slack`]); 0
    /// under one global scale.
    slack: [f64; 128],
    /// The last two [`Codes::thresholds`] and the maxima they are for (their bits), the newer
    /// first: after the first few, every piece starts from just below the largest maximum
    /// found so far and, where it holds that maximum, goes on from the maximum itself.
    last: std::sync::Mutex<[(u64, Thresholds); 2]>,
}

#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Thresholds([u8; 128]);

#[repr(C, align(64))]
struct Coefs {
    a1: [f64; 16],
    a3: [f64; 16],
}

impl Coefs {
    /// Exponent 0 (subnormal scales `m · 2^-9`): the reference's own f32 products. Exponent
    /// 1: the products rounded to f32's 24 bits at any exponent, so that scaling by `2^(e − 1)`
    /// gives exponent `e`'s wherever the reference's products are normal f32 (where they are
    /// not, [`Codes::new`] sees the difference and leaves the code to the f64 body).
    fn new(scale_2: f32) -> Coefs {
        let mut c = Coefs {
            a1: [0.0; 16],
            a3: [0.0; 16],
        };
        for m in 0..8u8 {
            let s = e4m3::decode(m);
            c.a1[m as usize] = f64::from((s * scale_2).abs()) / 2.0;
            c.a3[m as usize] = f64::from((1.5 * s * scale_2).abs());
            let s = f64::from(e4m3::decode(8 + m));
            let g = f64::from(scale_2);
            c.a1[8 + m as usize] = f32_rounded(s * g).abs() / 2.0;
            c.a3[8 + m as usize] = f32_rounded(1.5 * s * g).abs();
        }
        c
    }

    /// `(|A1|, |A3|)` of `code` as [`coefs`] computes them.
    fn of(&self, code: u8) -> (f64, f64) {
        let t = code & 0x7F;
        let j = if t < 8 { t } else { 8 | (t & 7) } as usize;
        let shift = (u64::from(t.max(8) >> 3) - 1) << 52;
        let at = |v: f64| f64::from_bits(v.to_bits().wrapping_add(shift));
        (at(self.a1[j]), at(self.a3[j]))
    }

    /// `code`'s signed `(A1, A3)` under `scale_2` (`t[e2m1 1] / 2`, `t[e2m1 1.5]`), where its
    /// 16 values are all finite and exactly `±(u · A1 + v · A3)`, `|A3 − 3 A1|` is below
    /// `|A1| / 16` and these tables give back `|A1|`, `|A3|`.
    fn exact(&self, code: u8, scale_2: f32) -> Option<(f64, f64)> {
        let t = super::table(code, scale_2);
        let (a1, a3) = (f64::from(t[2]) / 2.0, f64::from(t[3]));
        let looked_up = self.of(code) == (a1.abs(), a3.abs());
        let exact = t.iter().enumerate().all(|(q, &v)| {
            let (k, sign) = (q & 7, if q & 8 != 0 { -1.0 } else { 1.0 });
            v.is_finite() && f64::from(v) == sign * (U[k] as f64 * a1 + V[k] as f64 * a3)
        });
        let eps = a3 - 3.0 * a1;
        let small = (a1 == 0.0 && a3 == 0.0) || 16.0 * eps.abs() < a1.abs();
        (looked_up && exact && small).then_some((a1, a3))
    }
}

/// `p` (an exact product) rounded to 24 significant bits, to nearest even, at any exponent:
/// an f32 rounding without f32's exponent range.
fn f32_rounded(p: f64) -> f64 {
    if p == 0.0 || !p.is_finite() {
        return p;
    }
    let e = ((p.to_bits() >> 52) & 0x7FF) as i64 - 1023;
    let scale = f64::from_bits(((1023 - e) as u64) << 52);
    f64::from((p * scale) as f32) / scale
}

impl Codes {
    /// Whether the integer sums may take blocks of two matrices with these global scales:
    /// both finite and nonzero, of one sign, within 1/64 of each other (a re-quantization's,
    /// a rewritten `weight_scale_2`). Further apart, `u' D1` no longer stays below `A1 δu`
    /// and the expanded squared error could cancel.
    pub fn usable(scale_2_a: f32, scale_2_b: f32) -> bool {
        let (ga, gb) = (f64::from(scale_2_a), f64::from(scale_2_b));
        ga.is_finite() && ga != 0.0 && 64.0 * (ga - gb).abs() <= ga.abs()
    }

    /// The codes whose blocks the integer sums take, A's global scale `scale_2_a` and B's
    /// `scale_2_b`: those exact on both sides ([`Coefs::exact`]) whose `D1 = A1 − B1` and
    /// `D3 = A3 − B3` are within 1/64 of `A1`, `A3` (each is exact: two f32 within a factor
    /// of two).
    pub fn new(scale_2_a: f32, scale_2_b: f32) -> Codes {
        let coefs = Coefs::new(scale_2_a);
        let coefs_b = (scale_2_a.to_bits() != scale_2_b.to_bits()).then(|| Coefs::new(scale_2_b));
        let pair = |c: u8| {
            let b = coefs_b.as_ref().unwrap_or(&coefs);
            coefs.exact(c, scale_2_a).zip(b.exact(c, scale_2_b))
        };
        let ok = |m: u8| {
            [m, m | 0x80].into_iter().all(|c| {
                pair(c).is_some_and(|((a1, a3), (b1, b3))| {
                    64.0 * (a1 - b1).abs() <= a1.abs() && 64.0 * (a3 - b3).abs() <= a3.abs()
                })
            })
        };
        let lo = (1..0x80).find(|&m| ok(m)).unwrap_or(0x80);
        let hi = (lo..0x80).find(|&m| !ok(m)).unwrap_or(0x80);
        let mut slack = [0.0; 128];
        if coefs_b.is_some() {
            for m in lo..hi {
                let ((a1, a3), (b1, b3)) = pair(m).expect("a code taken is exact");
                slack[m as usize] = Codes::slack(a1, a3, b1, b3);
            }
        }
        let last = std::sync::Mutex::new([(f64::NAN.to_bits(), Thresholds([255; 128])); 2]);
        Codes {
            zero: ok(0),
            lo,
            hi,
            coefs,
            coefs_b,
            slack,
            last,
        }
    }

    /// With `w = u + 3v`, `εA = A3 − 3 A1`: `x − y = A1 δw + εA δv + D1 w' + (εA − εB) v'`,
    /// and `|w'| ≤ 12`, `|v'| ≤ 4`, `|εA − εB| = |D3 − 3 D1|`: the last two terms are at most
    /// `24 |D1| + 4 |D3|`. Plus `|A1| · 2^-40`, above the rounding of this sum and of the bound
    /// [`Codes::w_thresholds`] adds it to.
    fn slack(a1: f64, a3: f64, b1: f64, b3: f64) -> f64 {
        24.0 * (a1 - b1).abs() + 4.0 * (a3 - b3).abs() + a1.abs() * f64::powi(2.0, -40)
    }

    /// For each code pair, the smallest scale-code magnitude under which its difference may
    /// exceed `max`: the smallest code whose [`Codes::w_thresholds`] entry is at most the
    /// pair's `W`; 255 where none is. A block whose scale code is below every element's entry
    /// holds no difference above `max`. The entries fall as the scale grows, so this is
    /// exact; where a code's `8 |εA|` breaks that, a larger code may be looked at in vain,
    /// never one passed over that may hold more.
    unsafe fn thresholds(&self, max: f64) -> [__m512i; 2] {
        let key = max.to_bits();
        let cached = self
            .last
            .lock()
            .ok()
            .and_then(|last| last.iter().find(|l| l.0 == key).map(|l| l.1));
        let th = cached.unwrap_or_else(|| {
            let th = self.compute_thresholds(max);
            if let Ok(mut last) = self.last.lock() {
                *last = [(key, th), last[0]];
            }
            th
        });
        [
            _mm512_load_si512(th.0.as_ptr() as *const __m512i),
            _mm512_load_si512(th.0.as_ptr().add(64) as *const __m512i),
        ]
    }

    fn compute_thresholds(&self, max: f64) -> Thresholds {
        let tau = self.w_thresholds(max);
        // the smallest code of each threshold, then of each threshold or below
        let mut by_w = [255u8; 256];
        for t in (self.lo..self.hi).rev() {
            by_w[tau[t as usize] as usize] = t;
        }
        for w in 1..256 {
            by_w[w] = by_w[w].min(by_w[w - 1]);
        }
        Thresholds(Pairs::get().w.map(|w| by_w[w as usize]))
    }

    /// For each scale-code magnitude, the smallest `W` whose bound `|A1| W + 8 |εA| + slack`
    /// exceeds `max` (`|δv| ≤ 8`; the slack bounds the rest, 0 under one global scale): a
    /// block with no element at or above it holds no difference above `max`. `|A1| W` and
    /// `8 |εA|` are exact and so is their sum (the quanta of `A1` and `A3`, within 30 bits of
    /// it); the slack's margin is above the rounding of adding it. 255 (above every `W`)
    /// where none does, as for a zero scale, or when `max` is NaN (nothing exceeds it).
    fn w_thresholds(&self, max: f64) -> [u8; 128] {
        let mut th = [255; 128];
        for (m, e) in th.iter_mut().enumerate() {
            let ((a1, a3), slack) = (self.coefs.of(m as u8), self.slack[m]);
            if a1 > 0.0 && a1.is_finite() && !max.is_nan() {
                let rest = 8.0 * (a3 - 3.0 * a1).abs() + slack;
                let above = |w: u32| a1 * f64::from(w) + rest > max;
                let mut w = ((max - rest) / a1).clamp(0.0, 255.0) as u32;
                while w > 0 && above(w - 1) {
                    w -= 1;
                }
                while w < 255 && !above(w) {
                    w += 1;
                }
                *e = w as u8;
            }
        }
        th
    }

    /// Whether B's global scale is not A's (the integer body's `TWO`).
    pub fn two_scales(&self) -> bool {
        self.coefs_b.is_some()
    }

    fn take(&self, code: u8) -> bool {
        let m = code & 0x7F;
        ((m == 0) & self.zero) | ((self.lo <= m) & (m < self.hi))
    }

    /// Whether a row's codes are equal on both sides and all taken (a branch-free fold,
    /// vectorized): then no group of it needs [`Codes::takes`].
    fn all_equal(&self, a: &[u8], b: &[u8]) -> bool {
        a.len() == b.len()
            && a.iter()
                .zip(b)
                .fold(true, |all, (&x, &y)| all & (x == y) & self.take(x))
    }

    /// Whether eight blocks' scale codes (`a`, `b` on each side) are equal and all taken.
    #[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vl,avx512vbmi")]
    unsafe fn takes(&self, a: *const u8, b: *const u8) -> bool {
        let x = (a as *const u64).read_unaligned();
        if x != (b as *const u64).read_unaligned() {
            return false;
        }
        let t = _mm_and_si128(_mm_cvtsi64_si128(x as i64), _mm_set1_epi8(0x7F));
        let run = _mm_cmpge_epu8_mask(t, _mm_set1_epi8(self.lo as i8))
            & _mm_cmplt_epu8_mask(t, _mm_set1_epi8(self.hi as i8));
        let zero = _mm_cmpeq_epi8_mask(t, _mm_setzero_si128()) & if self.zero { 0xFF } else { 0 };
        (run | zero) & 0xFF == 0xFF
    }
}

/// `|A1|` and `|A3|` of eight blocks from their scale codes `t` (sign dropped: both sides
/// share it, and every sum takes a product of two coefficients), looked up in [`Coefs`]' two
/// 16-entry tables (two registers each): entry `t` for `t < 16`, else exponent 1's entry
/// of `t`'s mantissa with `e − 1` added to its f64 exponent, which multiplies it by `2^(e − 1)`
/// exactly. No FP unit is involved: the loop's multiplies and conversions have theirs.
#[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vl,avx512vbmi")]
unsafe fn coefs(codes: *const u8, k: &[__m512d; 4]) -> (__m512d, __m512d, __m512i) {
    let c = _mm512_cvtepu8_epi64(_mm_loadl_epi64(codes as *const __m128i));
    let t = _mm512_and_si512(c, _mm512_set1_epi64(0x7F));
    let eight = _mm512_set1_epi64(8);
    // `t & 7 | min(t, 8) & 8`: the select `C ? A : B` with C = 7
    let j = _mm512_ternarylogic_epi64::<0xE4>(t, _mm512_min_epu64(t, eight), _mm512_set1_epi64(7));
    let shift = _mm512_sub_epi64(
        _mm512_slli_epi64::<49>(_mm512_and_si512(
            _mm512_max_epu64(t, eight),
            _mm512_set1_epi64(0x78),
        )),
        _mm512_set1_epi64(1 << 52),
    );
    let at = |lo: __m512d, hi: __m512d| {
        _mm512_castsi512_pd(_mm512_add_epi64(
            _mm512_castpd_si512(_mm512_permutex2var_pd(lo, j, hi)),
            shift,
        ))
    };
    (at(k[0], k[1]), at(k[2], k[3]), t)
}

/// [`Coefs`]' tables in registers.
#[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vl,avx512vbmi")]
unsafe fn coef_regs(c: &Coefs) -> [__m512d; 4] {
    let two = |t: &[f64; 16]| {
        [
            _mm512_loadu_pd(t.as_ptr()),
            _mm512_loadu_pd(t.as_ptr().add(8)),
        ]
    };
    let ([a, b], [x, y]) = (two(&c.a1), two(&c.a3));
    [a, b, x, y]
}

/// The byte tables, indexed by a code pair `sx << 6 | ma << 3 | mb` (the signs differ, A's
/// magnitude code, B's), and by a rank for `dec_w` / `dec_t`.
#[repr(C, align(64))]
pub struct Pairs {
    /// `BIAS_UU ± u u'`, `BIAS_UV ± (u v' + v u')`, `BIAS_UV ± u v'`, `(v ∓ v')²`
    uu: [u8; 128],
    uv: [u8; 128],
    uv1: [u8; 128],
    dv2: [u8; 128],
    /// The rank of `(W, T)` when `ε A1 ≥ 0`, of `(W, −T)` when it is negative.
    rank_pos: [u8; 128],
    rank_neg: [u8; 128],
    /// A rank's `W`, and its `T + 8`.
    dec_w: [u8; 128],
    /// `W` of a code pair, for [`Codes::thresholds`].
    w: [u8; 128],
    dec_t: [u8; 128],
    /// `Σu²` and `Σv²` of a packed byte's two codes, indexed by its low 7 bits (the high
    /// code's sign, bit 7, does not matter).
    u2: [u8; 128],
    v2: [u8; 128],
}

impl Pairs {
    /// The tables, built once.
    pub fn get() -> &'static Pairs {
        static PAIRS: std::sync::OnceLock<Box<Pairs>> = std::sync::OnceLock::new();
        PAIRS.get_or_init(Pairs::new)
    }

    fn new() -> Box<Pairs> {
        let w = |m: usize| U[m] + 3 * V[m];
        // (sign of the product, A's magnitude, B's magnitude) of every pair index
        let split = |i: usize| (if i >> 6 == 1 { -1 } else { 1 }, (i >> 3) & 7, i & 7);
        // (W, T) of a pair: |A1 δw + ε δv| = |A1| W + ε' T, ε' = ε · sign(A1)
        let wt = |i: usize| {
            let (sg, ma, mb) = split(i);
            let (dw, dv) = (w(ma) - sg * w(mb), V[ma] - sg * V[mb]);
            debug_assert!(dw != 0 || dv == 0, "equal w, equal value");
            (dw.abs(), dw.signum() * dv)
        };
        let mut levels: Vec<(i32, i32)> = (0..128)
            .flat_map(|i| {
                let (w, t) = wt(i);
                [(w, t), (w, -t)]
            })
            .collect();
        levels.sort_unstable();
        levels.dedup();
        assert!(levels.len() <= 128, "ranks fit a vpermi2b table");
        let rank = |l: (i32, i32)| levels.binary_search(&l).unwrap() as u8;
        let byte = |v: i32| u8::try_from(v).expect("a table entry is a byte");
        let mut p = Box::new(Pairs {
            uu: [0; 128],
            uv: [0; 128],
            uv1: [0; 128],
            dv2: [0; 128],
            rank_pos: [0; 128],
            rank_neg: [0; 128],
            dec_w: [0; 128],
            dec_t: [0; 128],
            w: [0; 128],
            u2: [0; 128],
            v2: [0; 128],
        });
        for i in 0..128 {
            let (sg, ma, mb) = split(i);
            p.uu[i] = byte(BIAS_UU + sg * U[ma] * U[mb]);
            p.uv[i] = byte(BIAS_UV + sg * (U[ma] * V[mb] + V[ma] * U[mb]));
            p.uv1[i] = byte(BIAS_UV + sg * U[ma] * V[mb]);
            p.dv2[i] = byte((V[ma] - sg * V[mb]).pow(2));
            let (w, t) = wt(i);
            p.rank_pos[i] = rank((w, t));
            p.rank_neg[i] = rank((w, -t));
            p.w[i] = byte(w);
        }
        for (r, &(w, t)) in levels.iter().enumerate() {
            p.dec_w[r] = byte(w);
            p.dec_t[r] = byte(t + 8);
        }
        for i in 0..128 {
            let (lo, hi) = (i & 7, (i >> 4) & 7);
            p.u2[i] = byte(U[lo] * U[lo] + U[hi] * U[hi]);
            p.v2[i] = byte(V[lo] * V[lo] + V[hi] * V[hi]);
        }
        p
    }
}

/// The tables in registers: a 128-entry table is two.
struct Regs {
    uu: [__m512i; 2],
    uv: [__m512i; 2],
    uv1: [__m512i; 2],
    dv2: [__m512i; 2],
    rank_pos: [__m512i; 2],
    rank_neg: [__m512i; 2],
    dec_w: [__m512i; 2],
    dec_t: [__m512i; 2],
    u2: [__m512i; 2],
    v2: [__m512i; 2],
}

#[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vl,avx512vbmi")]
unsafe fn load(p: &Pairs) -> Regs {
    let two = |t: &[u8; 128]| {
        [
            _mm512_loadu_si512(t.as_ptr() as *const __m512i),
            _mm512_loadu_si512(t.as_ptr().add(64) as *const __m512i),
        ]
    };
    Regs {
        uu: two(&p.uu),
        uv: two(&p.uv),
        uv1: two(&p.uv1),
        dv2: two(&p.dv2),
        rank_pos: two(&p.rank_pos),
        rank_neg: two(&p.rank_neg),
        dec_w: two(&p.dec_w),
        dec_t: two(&p.dec_t),
        u2: two(&p.u2),
        v2: two(&p.v2),
    }
}

/// The sums, a block per lane; the squared error in two (two dependency chains where a
/// block has eight terms).
struct Sums8 {
    nt: __m512d,
    nr: __m512d,
    err: [__m512d; 2],
}

/// The pair index of each element of eight blocks (`a`, `b` their 64 packed bytes on each
/// side): even elements' in the first vector (low nibbles), odd ones' in the second.
/// Element k of either half of a block sits in the same byte on both sides, and the block's
/// bytes in its 64-bit lane. `x` is A with B's sign bits XORed in (bits 3 and 7: the signs
/// differ); then bits 3-6 come from `x`'s nibble and bits 0-2 from B's (ternary
/// `(A & C) | (B & !C)`, C = 0x78). Word shifts carry bits across bytes, but only into bits
/// the mask drops or bit 7, which `vpermi2b` ignores.
#[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vl,avx512vbmi")]
unsafe fn pair_index(a: __m512i, b: __m512i) -> [__m512i; 2] {
    let x = _mm512_ternarylogic_epi32::<0x78>(a, b, _mm512_set1_epi8(0x88u8 as i8));
    let c = _mm512_set1_epi8(0x78);
    [
        _mm512_ternarylogic_epi32::<0xE4>(_mm512_slli_epi16::<3>(x), b, c),
        _mm512_ternarylogic_epi32::<0xE4>(_mm512_srli_epi16::<1>(x), _mm512_srli_epi16::<4>(b), c),
    ]
}

#[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vl,avx512vbmi")]
unsafe fn pick(t: &[__m512i; 2], i: __m512i) -> __m512i {
    _mm512_permutex2var_epi8(t[0], i, t[1])
}

/// The largest byte of each 64-bit lane, in its low byte (the others hold junk).
#[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vl,avx512vbmi")]
unsafe fn lane_max(mut v: __m512i) -> __m512i {
    v = _mm512_max_epu8(v, _mm512_srli_epi64::<32>(v));
    v = _mm512_max_epu8(v, _mm512_srli_epi64::<16>(v));
    _mm512_max_epu8(v, _mm512_srli_epi64::<8>(v))
}

/// Eight blocks: `pa` / `pb` their 64 packed bytes on each side, `a1` / `a3` their
/// coefficients `|A1|`, `|A3|` on A's side and `b1` / `b3` on B's (used only with `TWO`
/// global scales) and `t` their scale codes' magnitudes (one a lane, both sides). Adds their
/// sums to `s`; returns whether a block may hold a difference above the piece's maximum: its
/// scale code at or above an element's [`Codes::thresholds`] entry.
///
/// Under two global scales, with `D1 = A1 − B1`, `D3 = A3 − B3` (small: [`Codes::new`]),
/// `x − y = δu A1 + δv A3 + u' D1 + v' D3`, whose square sums to
/// `A1² Σ(δu)² + A3² Σ(δv)² + D1² Σu'² + D3² Σv'² + 2 A1 D1 Σ δu u' + 2 A3 D3 Σ δv v'
///  − 2 A1 B3 Σ u v' − 2 A3 B1 Σ v u'` (`u v = 0`; the `A1 A3 Σ δu δv` and `A1 D3 Σ δu v'`
/// terms folded into the last two). Every integer sum there is exact, and each term is of the
/// size of the differences it comes from (`u v' ≠ 0` only where the codes differ), so no
/// term cancels one of the norms' size.
#[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vl,avx512vbmi")]
#[allow(clippy::too_many_arguments)]
unsafe fn group<const TWO: bool>(
    k: &Regs,
    pa: *const u8,
    pb: *const u8,
    (a1, a3): (__m512d, __m512d),
    (b1, b3): (__m512d, __m512d),
    t: __m512i,
    th: &[__m512i; 2],
    s: &mut Sums8,
) -> bool {
    let zero = _mm512_setzero_si512();
    let (a, b) = (
        _mm512_loadu_si512(pa as *const __m512i),
        _mm512_loadu_si512(pb as *const __m512i),
    );
    let idx = pair_index(a, b);
    let sad = |v: __m512i| _mm512_sad_epu8(v, zero);
    // a block's sum of one table over both halves, less 16 biases
    let sum = |t: &[__m512i; 2], bias: i32, bytes_add: bool| {
        let (lo, hi) = (pick(t, idx[0]), pick(t, idx[1]));
        let s = if bytes_add {
            sad(_mm512_add_epi8(lo, hi))
        } else {
            _mm512_add_epi64(sad(lo), sad(hi))
        };
        _mm512_sub_epi64(s, _mm512_set1_epi64(16 * bias as i64))
    };
    let (suu, suv) = (sum(&k.uu, BIAS_UU, false), sum(&k.uv, BIAS_UV, true));
    let sdv2 = sad(_mm512_add_epi8(pick(&k.dv2, idx[0]), pick(&k.dv2, idx[1])));
    let from = _mm512_min_epu8(pick(th, idx[0]), pick(th, idx[1]));
    // each lane's scale code in its 8 bytes: byte 0 of each 64-bit lane repeated
    let bcast = _mm512_set_epi64(
        0x0808_0808_0808_0808,
        0,
        0x0808_0808_0808_0808,
        0,
        0x0808_0808_0808_0808,
        0,
        0x0808_0808_0808_0808,
        0,
    );
    let t = _mm512_shuffle_epi8(t, bcast);
    // Σu², Σv² of each side, both codes of a byte at once
    let (nua, nva) = (sad(pick(&k.u2, a)), sad(pick(&k.v2, a)));
    let (nub, nvb) = (sad(pick(&k.u2, b)), sad(pick(&k.v2, b)));
    let f = |v: __m512i| _mm512_cvtepi64_pd(v);
    let (c11, c33) = (_mm512_mul_pd(a1, a1), _mm512_mul_pd(a3, a3));
    s.nr = _mm512_fmadd_pd(c11, f(nua), s.nr);
    s.nr = _mm512_fmadd_pd(c33, f(nva), s.nr);
    // Σ(δu)² = Σu² + Σu'² − 2 Σuu' (its table would not fit bytes)
    let sdu2 = _mm512_sub_epi64(_mm512_add_epi64(nua, nub), _mm512_add_epi64(suu, suu));
    s.err[0] = _mm512_fmadd_pd(c11, f(sdu2), s.err[0]);
    s.err[0] = _mm512_fmadd_pd(c33, f(sdv2), s.err[0]);
    let mul = _mm512_mul_pd;
    if TWO {
        s.nt = _mm512_fmadd_pd(mul(b1, b1), f(nub), s.nt);
        s.nt = _mm512_fmadd_pd(mul(b3, b3), f(nvb), s.nt);
        let (d1, d3) = (_mm512_sub_pd(a1, b1), _mm512_sub_pd(a3, b3));
        // 2 Σ u v', 2 Σ v u' (= 2 Σ(u v' + v u') − 2 Σ u v')
        let suv1 = sum(&k.uv1, BIAS_UV, true);
        let suv1 = _mm512_add_epi64(suv1, suv1);
        let svu1 = _mm512_sub_epi64(_mm512_add_epi64(suv, suv), suv1);
        // 2 Σ δu u' = 2 Σuu' − 2 Σu'², 2 Σ δv v' = Σv² − Σv'² − Σ(δv)²
        let duu = _mm512_sub_epi64(_mm512_add_epi64(suu, suu), _mm512_add_epi64(nub, nub));
        let dvv = _mm512_sub_epi64(_mm512_sub_epi64(nva, nvb), sdv2);
        s.err[0] = _mm512_fmadd_pd(mul(d1, d1), f(nub), s.err[0]);
        s.err[0] = _mm512_fmadd_pd(mul(d3, d3), f(nvb), s.err[0]);
        s.err[1] = _mm512_fmadd_pd(mul(a1, d1), f(duu), s.err[1]);
        s.err[1] = _mm512_fmadd_pd(mul(a3, d3), f(dvv), s.err[1]);
        s.err[1] = _mm512_fnmadd_pd(mul(a1, b3), f(suv1), s.err[1]);
        s.err[1] = _mm512_fnmadd_pd(mul(a3, b1), f(svu1), s.err[1]);
    } else {
        s.nt = _mm512_fmadd_pd(c11, f(nub), s.nt);
        s.nt = _mm512_fmadd_pd(c33, f(nvb), s.nt);
        // Σ δu δv = −Σ(uv' + vu')
        let c13 = mul(a1, a3);
        s.err[0] = _mm512_fnmadd_pd(_mm512_add_pd(c13, c13), f(suv), s.err[0]);
    }
    _mm512_cmpge_epu8_mask(t, from) != 0
}

/// Each of eight blocks' largest |difference|, exactly (arguments as [`group`]'s).
#[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vl,avx512vbmi")]
unsafe fn exact(k: &Regs, pa: *const u8, pb: *const u8, a1: __m512d, a3: __m512d) -> __m512d {
    let idx = pair_index(
        _mm512_loadu_si512(pa as *const __m512i),
        _mm512_loadu_si512(pb as *const __m512i),
    );
    // ε |A1| / A1 = |A3| − 3 |A1|, exact (both are f32 values, 3 A1 = 1.5 R1 has 25 bits)
    let eps = _mm512_fmadd_pd(_mm512_set1_pd(-3.0), a1, a3);
    // the blocks where ε A1 < 0 rank by (W, −T)
    let neg = _mm512_movepi64_mask(_mm512_castpd_si512(eps));
    let rank =
        |i: __m512i| _mm512_mask_blend_epi64(neg, pick(&k.rank_pos, i), pick(&k.rank_neg, i));
    // the block's largest rank in the low byte of its lane, then its W and T + 8 there
    let top = lane_max(_mm512_max_epu8(rank(idx[0]), rank(idx[1])));
    let low = 0x0101_0101_0101_0101;
    let f = |v: __m512i| _mm512_cvtepi64_pd(v);
    let w = f(_mm512_maskz_permutex2var_epi8(
        low, k.dec_w[0], top, k.dec_w[1],
    ));
    let t = _mm512_sub_pd(
        f(_mm512_maskz_permutex2var_epi8(
            low, k.dec_t[0], top, k.dec_t[1],
        )),
        _mm512_set1_pd(8.0),
    );
    // |A1| W + |ε| T: both products exact, their sum too
    _mm512_fmadd_pd(a1, w, _mm512_mul_pd(_mm512_abs_pd(eps), t))
}

/// Each of eight blocks' largest |difference| from both sides' f64 tables (`codes` their
/// scale codes, equal on both sides): the exact maxima where the global scales differ.
#[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vl,avx512vbmi")]
unsafe fn exact_tabled(
    ta: &Tables,
    tb: &Tables,
    codes: *const u8,
    pa: *const u8,
    pb: *const u8,
) -> __m512d {
    let mut m = [0f64; GROUP];
    for (i, m) in m.iter_mut().enumerate() {
        let c = *codes.add(i);
        *m = avx512::block_max(ta, tb, c, c, pa.add(8 * i), pb.add(8 * i));
    }
    _mm512_loadu_pd(m.as_ptr())
}

/// The eight blocks from `j` on through the f64 body's `block` (`sa`, `sb` the row's
/// finite scale codes, `pa`, `pb` its packed bytes), with their maximum in every lane: the
/// group's first block is where the search for its first index starts.
#[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vl,avx512vbmi")]
#[allow(clippy::too_many_arguments)]
unsafe fn f64_group(
    ta: &Tables,
    tb: &Tables,
    sa: &[u8],
    sb: &[u8],
    pa: *const u8,
    pb: *const u8,
    j: usize,
    s: &mut avx512::Sums,
) -> __m512d {
    let mut m = _mm512_setzero_pd();
    for j in j..j + GROUP {
        m = avx512::block_of(ta, tb, sa[j], sb[j], pa, pb, j, s, m);
    }
    _mm512_set1_pd(_mm512_reduce_max_pd(m))
}

/// The groups of eight blocks of one row whose maxima may be computed here (`sa`, `sb` its
/// scale codes, `pa`, `pb` its packed bytes, `check`: whether its codes may differ or not be
/// taken): their sums added to `s`, their exact block maxima (0 where none can beat the
/// piece's maximum) in `tops`, the largest returned. A group this leaves to its caller
/// is marked in `tops`: NaN where its codes differ or are not taken (the f64 body's), -1
/// where under `TWO` global scales its maxima are needed (from the f64 tables): a call in
/// this loop would make it keep its tables and sums in memory.
#[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vl,avx512vbmi")]
#[allow(clippy::too_many_arguments)]
unsafe fn row_groups<const TWO: bool>(
    k: &Regs,
    ck: &[__m512d; 4],
    ckb: &[__m512d; 4],
    c: &Codes,
    th: &[__m512i; 2],
    (sa, sb): (&[u8], &[u8]),
    pa: *const u8,
    pb: *const u8,
    check: bool,
    tops: &mut [__m512d],
    s: &mut Sums8,
) -> __m512d {
    let z = _mm512_setzero_pd();
    let (later, tabled) = (_mm512_set1_pd(f64::NAN), _mm512_set1_pd(-1.0));
    let mut m = z;
    for (i, top) in tops.iter_mut().enumerate() {
        let j = i * GROUP;
        avx512::prefetch(pa, pb, j);
        let ca = sa.as_ptr().add(j);
        if check && !c.takes(ca, sb.as_ptr().add(j)) {
            *top = later;
            continue;
        }
        let (a1, a3, codes) = coefs(ca, ck);
        let (b1, b3) = if TWO {
            let (b1, b3, _) = coefs(ca, ckb);
            (b1, b3)
        } else {
            (a1, a3)
        };
        let (qa, qb) = (pa.add(j * 8), pb.add(j * 8));
        *top = if !group::<TWO>(k, qa, qb, (a1, a3), (b1, b3), codes, th, s) {
            z
        } else if TWO {
            tabled
        } else {
            exact(k, qa, qb, a1, a3)
        };
        m = _mm512_max_pd(m, *top);
    }
    m
}

/// Rows `r0..r1` of two matrices (`ta`, `tb` their f64 tables, `c` the codes taken): a row
/// whose scale codes are all finite runs its groups of eight blocks here, as integer sums
/// where the group's codes are equal on both sides and all taken, else through the f64
/// body's `block` (as are the blocks past its last whole group); any other row is the f64
/// body's. The row-end maximum check and walk are the f64 body's. `TWO`: whether the global
/// scales differ ([`Codes::two_scales`]).
#[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vl,avx512vbmi")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn rows<const TWO: bool>(
    a: &QMatrix,
    b: &QMatrix,
    ta: &Tables,
    tb: &Tables,
    c: &Codes,
    best: &AtomicU64,
    r0: usize,
    r1: usize,
) -> Accum {
    let (cols, kb) = (a.cols, a.kb());
    let k = load(Pairs::get());
    let ck = coef_regs(&c.coefs);
    let ckb = coef_regs(c.coefs_b.as_ref().unwrap_or(&c.coefs));
    let z = _mm512_setzero_pd();
    let mut s = Sums8 {
        nt: z,
        nr: z,
        err: [z; 2],
    };
    let mut f64_sums = avx512::Sums::zero();
    let mut acc = Accum::default();
    let current = |acc: &Accum| _mm512_set1_pd(super::running_max(acc));
    let mut cur = current(&acc);
    // what a block's difference must exceed to matter: above this piece's maximum and at
    // least every piece's `best` (above the f64 below it)
    let theta = |acc: &Accum| {
        let cur = super::running_max(acc);
        let floor = f64::from_bits(best.load(std::sync::atomic::Ordering::Relaxed)).next_down();
        if cur.is_nan() {
            cur
        } else {
            cur.max(floor)
        }
    };
    let mut th = c.thresholds(theta(&acc));
    let whole = kb - kb % GROUP;
    // each group's block maxima, kept for the row's first-index search (a buffer of the
    // thread's: an aligned allocation a piece cost 2% of the pass in malloc)
    let mut tops = TOPS.take();
    tops.clear();
    tops.resize(whole / GROUP, z);
    for r in r0..r1 {
        let (sa, sb) = (a.scale_row(r), b.scale_row(r));
        // a code taken is finite: only a row with others needs its codes looked at
        let check = !c.all_equal(sa, sb);
        if check && !(ta.all_finite(sa) && tb.all_finite(sb)) {
            acc = acc.merge(avx512::rows(a, b, ta, tb, best, r, r + 1));
            cur = current(&acc);
            th = c.thresholds(theta(&acc));
            continue;
        }
        let (pa, pb) = (a.packed.row(r).as_ptr(), b.packed.row(r).as_ptr());
        let mut m = row_groups::<TWO>(
            &k,
            &ck,
            &ckb,
            c,
            &th,
            (sa, sb),
            pa,
            pb,
            check,
            &mut tops,
            &mut s,
        );
        // the groups it left: whose codes differ or are not taken (NaN), whose exact maxima
        // come from the tables (-1)
        if check || TWO {
            for (i, top) in tops.iter_mut().enumerate() {
                let j = i * GROUP;
                if _mm512_cmp_pd_mask::<_CMP_UNORD_Q>(*top, *top) != 0 {
                    *top = f64_group(ta, tb, sa, sb, pa, pb, j, &mut f64_sums);
                } else if _mm512_cmp_pd_mask::<_CMP_LT_OQ>(*top, z) != 0 {
                    *top = exact_tabled(ta, tb, sa.as_ptr().add(j), pa.add(j * 8), pb.add(j * 8));
                } else {
                    continue;
                }
                m = _mm512_max_pd(m, *top);
            }
        }
        for j in whole..kb {
            m = avx512::block_of(ta, tb, sa[j], sb[j], pa, pb, j, &mut f64_sums, m);
        }
        if let Some(mb) = avx512::beats(m, cur, best) {
            // the first block holding the maximum, from the groups' block maxima (exact), or
            // past them; then its first element
            let target = _mm512_set1_pd(mb);
            let j = tops
                .iter()
                .enumerate()
                .find_map(|(i, &top)| {
                    let hit = _mm512_cmp_pd_mask::<_CMP_EQ_OQ>(top, target);
                    (hit != 0).then(|| i * GROUP + hit.trailing_zeros() as usize)
                })
                .unwrap_or(whole);
            acc.max_abs = mb;
            acc.max_idx = Some(avx512::first_of(a, b, ta, tb, r, j, mb));
            cur = current(&acc);
            avx512::publish(best, mb);
            th = c.thresholds(theta(&acc));
        }
    }
    TOPS.set(tops);
    f64_sums.add_to(&mut acc);
    let (nt, nr, err) = (
        _mm512_reduce_add_pd(s.nt),
        _mm512_reduce_add_pd(s.nr),
        _mm512_reduce_add_pd(_mm512_add_pd(s.err[0], s.err[1])),
    );
    acc.dot += (nr + nt - err) / 2.0;
    acc.nt += nt;
    acc.nr += nr;
    acc.err += err;
    acc.len = (r1 - r0) * cols;
    acc
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weights::fused::table;

    /// For every scale code taken, under global scales from tiny to huge: the coefficients
    /// computed in registers are the table's (`A1 = t[e2m1 1] / 2`, `A3 = t[e2m1 1.5]`), every
    /// code pair's |difference| read back from its rank is the reference's, bit for bit, and
    /// a higher rank never holds a smaller difference (so a block's largest rank holds its
    /// largest difference).
    #[test]
    fn ranks_give_every_difference_exactly() {
        if !available() {
            eprintln!("no AVX-512 VBMI on this CPU: the integer body never runs here");
            return;
        }
        let p = Pairs::get();
        let mut taken = 0;
        for g in [1.0f32, 3.7e-4, 1.3e-2, 2.5e-38, 7e-41, 1e-30, 6.1e35] {
            let c = Codes::new(g, g);
            for code in (0..=255u8).filter(|&code| c.take(code)) {
                let t = table(code, g);
                let (a1, a3) = (f64::from(t[2]) / 2.0, f64::from(t[3]));
                let mut lanes = [[0f64; 8]; 2];
                // SAFETY: `available` saw the features
                unsafe {
                    let (x1, x3, _) = coefs([code; 8].as_ptr(), &coef_regs(&c.coefs));
                    _mm512_storeu_pd(lanes[0].as_mut_ptr(), x1);
                    _mm512_storeu_pd(lanes[1].as_mut_ptr(), x3);
                }
                assert_eq!(
                    (lanes[0][7].to_bits(), lanes[1][7].to_bits()),
                    (a1.abs().to_bits(), a3.abs().to_bits()),
                    "g {g:e} code {code:#04x}: coefficients"
                );
                let eps = a3 - 3.0 * a1;
                let neg = (eps * a1) < 0.0;
                let mut seen: Vec<(u8, f64)> = Vec::new();
                for qa in 0..16usize {
                    for qb in 0..16usize {
                        let i = (((qa ^ qb) & 8) << 3) | ((qa & 7) << 3) | (qb & 7);
                        let r = if neg { p.rank_neg[i] } else { p.rank_pos[i] } as usize;
                        let (w, tt) = (p.dec_w[r] as f64, p.dec_t[r] as f64 - 8.0);
                        let got = a1.abs().mul_add(w, eps.abs() * tt);
                        let want = (f64::from(t[qb]) - f64::from(t[qa])).abs();
                        assert_eq!(
                            got.to_bits(),
                            want.to_bits(),
                            "g {g:e} code {code:#04x} pair ({qa}, {qb}): {got:e} vs {want:e}"
                        );
                        seen.push((r as u8, want));
                    }
                }
                seen.sort_by(|x, y| x.partial_cmp(y).unwrap());
                for w in seen.windows(2) {
                    assert!(
                        w[0].1 <= w[1].1,
                        "g {g:e} code {code:#04x}: rank {} holds {:e}, rank {} holds {:e}",
                        w[0].0,
                        w[0].1,
                        w[1].0,
                        w[1].1
                    );
                }
                taken += 1;
            }
        }
        // the ordinary scales take every finite code but NaN; tiny and huge ones fewer
        assert_eq!(Codes::new(3.7e-4, 3.7e-4).lo, 1);
        assert_eq!(Codes::new(3.7e-4, 3.7e-4).hi, 0x7F);
        assert!(taken > 1000, "only {taken} codes taken");
        assert!(
            !Codes::new(7e-41, 7e-41).take(1),
            "a subnormal product is not taken"
        );
    }

    /// Every threshold is the smallest `W` whose bound `|A1| W + 8 |εA| + slack` exceeds the
    /// maximum (so a block below it cannot hold a larger difference, and one at it may), for
    /// maxima from none yet (-1) through ties with a code's own bound to above every bound,
    /// and NaN; under one global scale (no slack) and under two.
    #[test]
    fn thresholds_are_the_smallest_w_whose_bound_exceeds_the_maximum() {
        use rand::{Rng, SeedableRng};
        let seed: u64 = rand::random();
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        for g in [3.7e-4f32, 1.0, 2.5e-38, 6.1e35, r.gen_range(1e-6..1e-2)] {
            for g_b in [g, g * r.gen_range(0.99..1.01)] {
                let c = Codes::new(g, g_b);
                let taken: Vec<u8> = (0..0x80u8).filter(|&m| c.take(m)).collect();
                let a1 = |m: u8| c.coefs.of(m).0;
                let rest = |m: u8| {
                    let (a1, a3) = c.coefs.of(m);
                    8.0 * (a3 - 3.0 * a1).abs() + c.slack[m as usize]
                };
                let pick = taken[r.gen_range(0..taken.len())];
                let maxima = [
                    -1.0,
                    0.0,
                    a1(pick) * 3.0,
                    (a1(pick) * 3.0).next_down(),
                    a1(pick) * 3.0 + rest(pick),
                    (a1(pick) * 3.0 + rest(pick)).next_down(),
                    a1(pick) * r.gen_range(0.0..30.0),
                    f64::MAX,
                    f64::NAN,
                ];
                for max in maxima {
                    let th = c.w_thresholds(max);
                    let what = |m: u8| format!("seed {seed} g {g:e} {g_b:e} max {max:e} {m:#04x}");
                    for &m in &taken {
                        let (t, a, slack) = (th[m as usize], a1(m), c.slack[m as usize]);
                        assert_eq!(slack == 0.0, g == g_b || a == 0.0, "{}", what(m));
                        let bound = |w: u8| a * f64::from(w) + rest(m);
                        if max.is_nan() || a == 0.0 {
                            assert_eq!(t, 255, "{}", what(m));
                            continue;
                        }
                        assert!(t == 255 || bound(t) > max, "{}: {t}", what(m));
                        assert!(t == 0 || bound(t - 1) <= max, "{}: {t}", what(m));
                    }
                    // the pairs' table: a block under code m is looked at whenever one of its
                    // pairs' W reaches m's threshold; only then where the thresholds fall as
                    // the codes grow (the `8 |εA|` of a few codes can break that)
                    let pairs = c.compute_thresholds(max);
                    let falling = taken
                        .windows(2)
                        .all(|p| th[p[0] as usize] >= th[p[1] as usize]);
                    for &m in &taken {
                        for (i, &w) in Pairs::get().w.iter().enumerate() {
                            let (looked_at, reaches) = (m >= pairs.0[i], w >= th[m as usize]);
                            assert!(looked_at || !reaches, "{} pair {i}", what(m));
                            assert!(!falling || looked_at == reaches, "{} pair {i}", what(m));
                        }
                    }
                }
            }
        }
    }

    /// The bound the thresholds rest on, for every code taken under one global scale or two and
    /// every code pair: `|y − x| ≤ |A1| W + 8 |εA| + slack`, with `x` from A's table and `y`
    /// from B's; and the codes taken are the ordinary ones (not too few).
    #[test]
    fn the_bound_holds_for_every_difference() {
        use rand::{Rng, SeedableRng};
        let seed: u64 = rand::random();
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let p = Pairs::get();
        for g in [3.7e-4f32, 1.0, 2.5e-38, 6.1e35, r.gen_range(1e-6..1e-2)] {
            for g_b in [
                g,
                g * (1.0 + 1.0 / 1024.0),
                g * r.gen_range(0.985..1.015),
                g * 0.99,
            ] {
                assert!(Codes::usable(g, g_b));
                let c = Codes::new(g, g_b);
                let taken: Vec<u8> = (0..=255u8).filter(|&m| c.take(m)).collect();
                if g == 3.7e-4 {
                    assert_eq!((c.lo, c.hi), (1, 0x7F), "seed {seed} g {g:e} {g_b:e}");
                }
                for code in taken {
                    let (ta, tb) = (table(code, g), table(code, g_b));
                    let ((a1, a3), slack) = (c.coefs.of(code), c.slack[(code & 0x7F) as usize]);
                    for (qa, &x) in ta.iter().enumerate() {
                        for (qb, &y) in tb.iter().enumerate() {
                            let i = (((qa ^ qb) & 8) << 3) | ((qa & 7) << 3) | (qb & 7);
                            let d = (f64::from(y) - f64::from(x)).abs();
                            let bound =
                                a1 * f64::from(p.w[i]) + 8.0 * (a3 - 3.0 * a1).abs() + slack;
                            assert!(
                                d <= bound,
                                "seed {seed} g {g:e} {g_b:e} code {code:#04x} ({qa}, {qb}): \
                                 {d:e} >= {bound:e}"
                            );
                        }
                    }
                }
            }
        }
        assert!(!Codes::usable(1.0, 1.02) && !Codes::usable(1.0, -1.0));
        assert!(!Codes::usable(f32::NAN, 1.0) && !Codes::usable(0.0, 0.0));
    }
}
