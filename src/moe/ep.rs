//! Expert parallelism: which rank owns which expert, `expert_map[global] = local | -1`.
//!
//! Placement follows vLLM's `determine_expert_map`: with `E % R != 0` the first `E % R` ranks
//! hold one expert more (`linear`: rank r starts at `r * (E / R) + min(r, E % R)`;
//! `round-robin`: rank r holds `r, r + R, r + 2R, …`). SGLang's EP MoE and DeepEP instead
//! require `E % R == 0`; [`ExpertMap::require_even`] says so when asked.
//!
//! `check` holds the routing-dump checks built on top of this map (range, duplicates,
//! weights, local-vs-global ids, load), `dump` reads routing dumps.

pub mod check;
pub mod dump;

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};

/// How experts are spread over EP ranks (vLLM's `expert_placement_strategy`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Placement {
    /// Contiguous blocks: rank r owns `[start_r, start_r + n_r)` (the DESIGN.md §4 default).
    Linear,
    /// Strided: rank r owns every expert `e` with `e % R == r`.
    RoundRobin,
}

impl Placement {
    pub fn name(self) -> &'static str {
        match self {
            Placement::Linear => "linear",
            Placement::RoundRobin => "round-robin",
        }
    }
}

/// The expert map of one EP rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertMap {
    pub num_experts: usize,
    pub ep_rank: usize,
    pub ep_size: usize,
    pub placement: Placement,
    /// `expert_map[global] = local | -1`, as the engine holds it.
    expert_map: Vec<i32>,
    /// `local_to_global[local] = global`, ascending.
    local_to_global: Vec<usize>,
}

/// Experts rank `rank` of `ep_size` holds under vLLM's even-as-possible split.
fn local_count(num_experts: usize, rank: usize, ep_size: usize) -> usize {
    num_experts / ep_size + usize::from(rank < num_experts % ep_size)
}

impl ExpertMap {
    /// The map of rank `ep_rank` of `ep_size` for `num_experts` global experts. An uneven
    /// split is allowed (vLLM's rule); a rank without experts (`E < R`) is an error, since no
    /// engine serves that.
    pub fn new(
        num_experts: usize,
        ep_rank: usize,
        ep_size: usize,
        placement: Placement,
    ) -> Result<ExpertMap> {
        if ep_size == 0 {
            return Err(Error::usage("--ep-size must be at least 1"));
        }
        if ep_rank >= ep_size {
            return Err(Error::usage(format!(
                "--ep-rank {ep_rank} is out of range for --ep-size {ep_size} (ranks are 0..{ep_size})"
            )));
        }
        if num_experts < ep_size {
            return Err(Error::usage(format!(
                "{num_experts} experts cannot be spread over {ep_size} EP ranks: some rank would hold none"
            )));
        }
        let n_local = local_count(num_experts, ep_rank, ep_size);
        let local_to_global: Vec<usize> = match placement {
            Placement::Linear => {
                let start = ep_rank * (num_experts / ep_size) + ep_rank.min(num_experts % ep_size);
                (start..start + n_local).collect()
            }
            Placement::RoundRobin => (ep_rank..num_experts).step_by(ep_size).collect(),
        };
        debug_assert_eq!(local_to_global.len(), n_local);
        let mut expert_map = vec![-1i32; num_experts];
        for (l, &g) in local_to_global.iter().enumerate() {
            expert_map[g] = l as i32;
        }
        Ok(ExpertMap {
            num_experts,
            ep_rank,
            ep_size,
            placement,
            expert_map,
            local_to_global,
        })
    }

    /// The maps of every rank `0..ep_size`.
    pub fn all_ranks(
        num_experts: usize,
        ep_size: usize,
        placement: Placement,
    ) -> Result<Vec<ExpertMap>> {
        (0..ep_size)
            .map(|r| ExpertMap::new(num_experts, r, ep_size, placement))
            .collect()
    }

    /// Error unless `E % R == 0`: SGLang's EP MoE and DeepEP's dispatch require it, where vLLM
    /// gives the first `E % R` ranks one expert more.
    pub fn require_even(&self) -> Result<()> {
        if !self.is_even() {
            return Err(Error::usage(format!(
                "{} experts are not divisible by --ep-size {}: SGLang and DeepEP refuse this; vLLM \
                 gives the first {} ranks {} experts and the others {}",
                self.num_experts,
                self.ep_size,
                self.num_experts % self.ep_size,
                self.num_experts / self.ep_size + 1,
                self.num_experts / self.ep_size
            )));
        }
        Ok(())
    }

    pub fn is_even(&self) -> bool {
        self.num_experts.is_multiple_of(self.ep_size)
    }

    /// `expert_map[global] = local | -1`.
    pub fn expert_map(&self) -> &[i32] {
        &self.expert_map
    }

    /// Global ids of this rank's experts, by local id.
    pub fn local_to_global(&self) -> &[usize] {
        &self.local_to_global
    }

    pub fn num_local(&self) -> usize {
        self.local_to_global.len()
    }

    /// Local id of global expert `global`, or None when another rank owns it (or it is out
    /// of range).
    pub fn local(&self, global: i64) -> Option<usize> {
        let g = usize::try_from(global).ok()?;
        let l = *self.expert_map.get(g)?;
        usize::try_from(l).ok()
    }

    /// Global id of local expert `local`.
    pub fn global(&self, local: i64) -> Option<usize> {
        let l = usize::try_from(local).ok()?;
        self.local_to_global.get(l).copied()
    }

    pub fn owns(&self, global: i64) -> bool {
        self.local(global).is_some()
    }

    /// The first global id of a linear block (the offset engines subtract to get local ids).
    pub fn linear_offset(&self) -> Option<usize> {
        match self.placement {
            Placement::Linear => self.local_to_global.first().copied(),
            Placement::RoundRobin => None,
        }
    }

    /// Human-readable set of owned experts: `[32, 48)` or `{1, 5, 9, …} (e % 4 == 1)`.
    pub fn describe_owned(&self) -> String {
        match self.placement {
            Placement::Linear => {
                let a = self.local_to_global.first().copied().unwrap_or(0);
                format!("[{a}, {})", a + self.num_local())
            }
            Placement::RoundRobin => {
                format!("{{e : e % {} == {}}}", self.ep_size, self.ep_rank)
            }
        }
    }
}

/// The rank owning global expert `global` under `placement` (vLLM's split), or None when out
/// of range.
pub fn owner_rank(
    num_experts: usize,
    ep_size: usize,
    placement: Placement,
    global: i64,
) -> Option<usize> {
    let g = usize::try_from(global).ok()?;
    if g >= num_experts || ep_size == 0 {
        return None;
    }
    match placement {
        Placement::RoundRobin => Some(g % ep_size),
        Placement::Linear => {
            let (base, rem) = (num_experts / ep_size, num_experts % ep_size);
            // the first `rem` ranks hold base + 1 experts
            let big = rem * (base + 1);
            if g < big {
                Some(g / (base + 1))
            } else {
                // base > 0 here: num_experts >= ep_size is not required by this function, but
                // g >= big with base == 0 would mean g >= num_experts
                (base > 0).then(|| rem + (g - big) / base)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    #[test]
    fn linear_even_blocks() {
        let m = ExpertMap::new(16, 1, 4, Placement::Linear).unwrap();
        assert_eq!(m.local_to_global(), &[4, 5, 6, 7]);
        assert_eq!(m.expert_map()[4], 0);
        assert_eq!(m.expert_map()[7], 3);
        assert_eq!(m.expert_map()[3], -1);
        assert_eq!(m.expert_map()[8], -1);
        assert_eq!(m.linear_offset(), Some(4));
        assert_eq!(m.describe_owned(), "[4, 8)");
        assert!(m.require_even().is_ok());
    }

    #[test]
    fn round_robin_strides() {
        let m = ExpertMap::new(10, 2, 4, Placement::RoundRobin).unwrap();
        assert_eq!(m.local_to_global(), &[2, 6]);
        let m = ExpertMap::new(10, 1, 4, Placement::RoundRobin).unwrap();
        assert_eq!(m.local_to_global(), &[1, 5, 9]);
        assert_eq!(m.local(9), Some(2));
        assert_eq!(m.global(2), Some(9));
        assert_eq!(m.global(3), None);
        assert_eq!(m.local(-1), None);
        assert_eq!(m.local(10), None);
    }

    #[test]
    fn uneven_split_follows_vllm() {
        // 10 experts over 4 ranks: 3, 3, 2, 2 starting at 0, 3, 6, 8
        let starts: Vec<_> = ExpertMap::all_ranks(10, 4, Placement::Linear)
            .unwrap()
            .iter()
            .map(|m| (m.linear_offset().unwrap(), m.num_local()))
            .collect();
        assert_eq!(starts, vec![(0, 3), (3, 3), (6, 2), (8, 2)]);
        let m = ExpertMap::new(10, 0, 4, Placement::Linear).unwrap();
        let e = m.require_even().unwrap_err().to_string();
        assert!(e.contains("SGLang") && e.contains("vLLM"), "{e}");
    }

    #[test]
    fn bad_configs_are_usage_errors() {
        assert!(ExpertMap::new(8, 2, 2, Placement::Linear).is_err());
        assert!(ExpertMap::new(8, 0, 0, Placement::Linear).is_err());
        assert!(ExpertMap::new(3, 0, 4, Placement::Linear).is_err());
    }

    #[test]
    fn every_expert_has_exactly_one_owner_and_owner_rank_agrees() {
        let seed: u64 = rand::random();
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        for _ in 0..50 {
            let ep = r.gen_range(1..=9);
            let e = r.gen_range(ep..=ep * 7 + 3);
            for placement in [Placement::Linear, Placement::RoundRobin] {
                let maps = ExpertMap::all_ranks(e, ep, placement).unwrap();
                for g in 0..e {
                    let owners: Vec<usize> = maps
                        .iter()
                        .filter(|m| m.owns(g as i64))
                        .map(|m| m.ep_rank)
                        .collect();
                    assert_eq!(
                        owners.len(),
                        1,
                        "seed {seed} E {e} R {ep} {placement:?} g {g}"
                    );
                    assert_eq!(
                        owner_rank(e, ep, placement, g as i64),
                        Some(owners[0]),
                        "seed {seed} E {e} R {ep} {placement:?} g {g}"
                    );
                    let m = &maps[owners[0]];
                    assert_eq!(m.global(m.local(g as i64).unwrap() as i64), Some(g));
                }
                let total: usize = maps.iter().map(|m| m.num_local()).sum();
                assert_eq!(total, e);
                let counts: Vec<usize> = maps.iter().map(|m| m.num_local()).collect();
                let (lo, hi) = (counts.iter().min().unwrap(), counts.iter().max().unwrap());
                assert!(hi - lo <= 1, "seed {seed}: {counts:?}");
            }
        }
        assert_eq!(owner_rank(8, 2, Placement::Linear, 8), None);
        assert_eq!(owner_rank(8, 2, Placement::Linear, -1), None);
    }
}
