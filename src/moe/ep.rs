//! Expert parallelism: which rank owns which expert, `expert_map[global] = local | -1`.
