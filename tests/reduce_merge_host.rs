//! CPU CI: `kernels/reduce.cu`'s compare reduction, its own `Acc` functions cut from the
//! kernel source and run on the host in the kernels' partition and merge order
//! (`tools/checks/reduce_host.cpp`), gives the CPU reference's `max_abs_err`, its index, the
//! NaN and Inf counts and the cosine: on random tensors with ties, NaNs in the reference (a
//! NaN difference ranks above every number) and NaNs and Infs in the test, the GPU's merge
//! order cannot move the maximum. Its batches (`acc_batch`, branch-free where all values are
//! finite) give every field bit for bit as every element through `acc_one` does.
//! Needs a C++ compiler (`$CXX`, else `c++`); `.ci/run` requires one
//! (`NVFP4DBG_REQUIRE_CXX=1`), elsewhere the test says that it skipped.

use rand::{Rng, SeedableRng};
use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

/// The `Acc` struct and functions of `reduce.cu`: from `struct Acc` to the first `#define`
/// after it (acc_zero, acc_takes, acc_merge), and from `acc_sums` (then `acc_one`) to the end
/// of `acc_batch`.
fn acc_source(cu: &str) -> String {
    // where `pat` first stands at or after `from`
    let at = |from: usize, pat: &str| {
        from + cu[from..]
            .find(pat)
            .unwrap_or_else(|| panic!("reduce.cu: no `{}` after byte {from}", pat.escape_debug()))
    };
    let start = at(0, "struct Acc {");
    let end = at(start, "#define REDUCE_THREADS");
    let sums = at(0, "__device__ __forceinline__ double acc_sums");
    let batch = at(sums, "__device__ __forceinline__ void acc_batch");
    let batch_end = at(batch, "\n}\n") + 3;
    format!("{}\n{}", &cu[start..end], &cu[sums..batch_end])
}

fn build(dir: &Path) -> Option<std::path::PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let cu = std::fs::read_to_string(root.join("kernels/reduce.cu")).unwrap();
    std::fs::write(dir.join("reduce_acc.inc"), acc_source(&cu)).unwrap();
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let exe = dir.join("reduce_host");
    let out = Command::new(&cxx)
        .args(["-O2", "-std=c++17", "-o"])
        .arg(&exe)
        .arg(root.join("tools/checks/reduce_host.cpp"))
        .arg(format!("-I{}", dir.display()))
        .output();
    match out {
        Ok(o) if o.status.success() => Some(exe),
        Ok(o) => panic!(
            "{cxx} failed on tools/checks/reduce_host.cpp with reduce.cu's Acc:\n{}",
            String::from_utf8_lossy(&o.stderr)
        ),
        Err(e) if std::env::var_os("NVFP4DBG_REQUIRE_CXX").is_some() => {
            panic!("no C++ compiler ({cxx}: {e}), and NVFP4DBG_REQUIRE_CXX is set")
        }
        Err(e) => {
            eprintln!("reduce_merge_host: skipped, no C++ compiler ({cxx}: {e})");
            None
        }
    }
}

#[test]
fn the_gpu_reduction_merges_to_the_cpu_maximum() {
    let dir = std::env::temp_dir().join(format!("nvfp4dbg-reduce-host-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let Some(exe) = build(&dir) else { return };
    let seed: u64 = rand::random();
    let mut g = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    // sizes: within one block, several, and past 256 blocks (pass 2's threads take several)
    let mut sizes: Vec<usize> = (0..60).map(|_| g.gen_range(1..200_000)).collect();
    sizes.push(32_768 * 260 + g.gen_range(0..32_768));
    let mut cases = Vec::new();
    for (c, &n) in sizes.iter().enumerate() {
        let r: Vec<f32> = (0..n).map(|_| g.gen_range(-1.0f32..1.0)).collect();
        let mut t: Vec<f32> = r.iter().map(|v| v + g.gen_range(-0.01f32..0.01)).collect();
        let mut r = r;
        for _ in 0..2 {
            let i = g.gen_range(0..n);
            (t[i], r[i]) = (64.5, 0.5); // a tie (the lower index wins)
        }
        if n > 2048 {
            // ties within one thread's elements: the next in its vector, its next step
            let i = g.gen_range(0..n - 2048);
            for k in [i, i + 1, i + 1024] {
                (t[k], r[k]) = (96.25, 0.25);
            }
        }
        for _ in 0..c % 3 {
            r[g.gen_range(0..n)] = f32::NAN;
        }
        if c % 4 == 0 {
            t[g.gen_range(0..n)] = f32::NAN;
        }
        if c % 5 == 1 {
            t[g.gen_range(0..n)] = f32::NEG_INFINITY;
            r[g.gen_range(0..n)] = f32::INFINITY;
        }
        cases.push((t, r));
    }
    let mut child = Command::new(&exe)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let input: Vec<u8> = cases
        .iter()
        .flat_map(|(t, r)| {
            let mut b = (t.len() as u64).to_le_bytes().to_vec();
            b.extend(t.iter().chain(r).flat_map(|v| v.to_le_bytes()));
            b
        })
        .collect();
    let writer = std::thread::spawn(move || stdin.write_all(&input).unwrap());
    let out = child.wait_with_output().unwrap();
    writer.join().unwrap();
    assert!(out.status.success(), "reduce_host: {:?}", out.status);
    let lines: Vec<String> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(String::from)
        .collect();
    assert_eq!(lines.len(), 2 * cases.len(), "seed {seed}");
    for (c, ((t, r), pair)) in cases.iter().zip(lines.chunks(2)).enumerate() {
        let what = format!("seed {seed} case {c} (n {})", t.len());
        assert_eq!(pair[0], pair[1], "{what}: acc_batch and acc_one differ");
        let want = nvfp4dbg::metrics::compare(t, r);
        let f: Vec<&str> = pair[0].split(' ').collect();
        let hex = |k: usize| f64::from_bits(u64::from_str_radix(f[k], 16).unwrap());
        let int = |k: usize| f[k].parse::<i64>().unwrap();
        let place = |k: usize| usize::try_from(int(k)).ok();
        // the Acc as the CUDA backend reads it back
        let got = nvfp4dbg::metrics::Accum {
            dot: hex(7),
            nt: hex(8),
            nr: hex(9),
            err: hex(10),
            max_abs: hex(0),
            max_idx: place(1),
            nan: int(2) as u64,
            inf: int(4) as u64,
            first_nan: place(3),
            first_inf: place(5),
            len: int(6) as usize,
        }
        .finish();
        assert_eq!(
            got.max_abs_err_index, want.max_abs_err_index,
            "{what}: index"
        );
        assert_eq!(got.nan_count, want.nan_count, "{what}: NaN count");
        assert_eq!(got.first_nan, want.first_nan, "{what}: first NaN");
        assert_eq!(got.inf_count, want.inf_count, "{what}: Inf count");
        assert_eq!(got.first_inf, want.first_inf, "{what}: first Inf");
        assert_eq!(got.len, t.len(), "{what}: len");
        let same = |a: f64, b: f64| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
        assert!(
            same(got.max_abs_err, want.max_abs_err),
            "{what}: max_abs_err {} vs {}",
            got.max_abs_err,
            want.max_abs_err
        );
        // the sums in another order than the CPU's: to a few ulps
        for (name, a, b) in [
            ("cosine", got.cosine, want.cosine),
            ("rel_l2", got.rel_l2, want.rel_l2),
        ] {
            assert!(
                same(a, b) || (a - b).abs() <= 1e-12 * b.abs().max(1e-3),
                "{what}: {name} {a} vs {b}"
            );
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}
