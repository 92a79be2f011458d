//! CUBINs kept on disk between runs: NVRTC takes seconds per module (the Hopper prefill GEMMs
//! tens of seconds on a slow core), and a user who runs `layertest` or a sweep by hand would
//! pay that on every invocation. An entry is named by a 128-bit digest of everything the
//! compile reads (source, header, options, NVRTC version); a changed kernel, a tuning define or
//! a planted fault is a different name, never a stale hit. Any cache trouble (no home, a
//! read-only disk, a truncated file) falls back to compiling; the cache never fails a run.
//!
//! Where: `NVFP4DBG_CACHE_DIR`, else `$XDG_CACHE_HOME/nvfp4dbg/cubin`, else
//! `~/.cache/nvfp4dbg/cubin`. `NVFP4DBG_CACHE_DIR=off` turns it off.

use crate::error::Result;
use crate::weights::view::Fingerprint;
use std::hash::Hasher;
use std::path::{Path, PathBuf};

/// The cache folder, or None when turned off or there is no home to put it in.
pub(crate) fn dir() -> Option<PathBuf> {
    match std::env::var_os("NVFP4DBG_CACHE_DIR") {
        Some(v) if v == "off" || v.is_empty() => None,
        Some(v) => Some(PathBuf::from(v)),
        None => std::env::var_os("XDG_CACHE_HOME")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
            .map(|base| base.join("nvfp4dbg").join("cubin")),
    }
}

/// A 128-bit digest of `parts` (each length-prefixed, so their boundaries count): SipHash-1-3
/// with zero keys (std's `DefaultHasher::new()`) beside the weight comparison's
/// [`Fingerprint`], as 32 hex digits.
pub(crate) fn digest(parts: &[&[u8]]) -> String {
    let mut sip = std::hash::DefaultHasher::new();
    let mut fp = Fingerprint::new();
    for p in parts {
        let len = (p.len() as u64).to_le_bytes();
        fp.update(&len);
        fp.update(p);
        sip.write_u64(p.len() as u64);
        sip.write(p);
    }
    format!("{:016x}{:016x}", sip.finish(), fp.finish())
}

/// The CUBIN named `name` (a file stem) and `key` in `dir`, or `compile()`'s, which is then
/// stored there (written to a temporary name and renamed, so a reader never sees half a
/// file). Returns the CUBIN and, when it came from the cache, its path (to forget it should
/// the driver refuse it).
pub(crate) fn get_or_compile(
    dir: Option<&Path>,
    name: &str,
    key: &str,
    compile: impl FnOnce() -> Result<Vec<u8>>,
) -> Result<(Vec<u8>, Option<PathBuf>)> {
    let Some(dir) = dir else {
        return compile().map(|c| (c, None));
    };
    let path = dir.join(format!("{name}-{key}.cubin"));
    if let Ok(bytes) = std::fs::read(&path) {
        // an ELF file, or a leftover of something else: compile anew
        if bytes.starts_with(b"\x7fELF") {
            return Ok((bytes, Some(path)));
        }
    }
    let cubin = compile()?;
    let tmp = dir.join(format!(".{name}-{key}.{}.tmp", std::process::id()));
    let stored = std::fs::create_dir_all(dir)
        .and_then(|_| std::fs::write(&tmp, &cubin))
        .and_then(|_| std::fs::rename(&tmp, &path));
    if stored.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    Ok((cubin, None))
}

/// Drop an entry the driver would not load.
pub(crate) fn forget(path: &Path) {
    let _ = std::fs::remove_file(path);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;
    use std::cell::Cell;

    fn elf(tag: u8) -> Vec<u8> {
        let mut v = b"\x7fELF".to_vec();
        v.extend((0..64).map(|i| tag.wrapping_add(i)));
        v
    }

    #[test]
    fn the_digest_sees_every_byte_and_every_boundary() {
        let base = digest(&[b"kernels/moe.cu", b"source", b"-DX=1"]);
        assert_eq!(base.len(), 32);
        assert_eq!(base, digest(&[b"kernels/moe.cu", b"source", b"-DX=1"]));
        assert_ne!(base, digest(&[b"kernels/moe.cu", b"sourcf", b"-DX=1"]));
        assert_ne!(base, digest(&[b"kernels/moe.cu", b"source", b"-DX=2"]));
        assert_ne!(base, digest(&[b"kernels/moe.cu", b"sourc", b"e-DX=1"]));
    }

    #[test]
    fn a_second_run_reads_what_the_first_compiled() {
        let dir = tempfile::tempdir().unwrap();
        let calls = Cell::new(0);
        let compile = |tag| {
            calls.set(calls.get() + 1);
            Ok(elf(tag))
        };
        let (a, from) = get_or_compile(Some(dir.path()), "moe", "k1", || compile(1)).unwrap();
        assert!(from.is_none());
        let (b, from) = get_or_compile(Some(dir.path()), "moe", "k1", || compile(2)).unwrap();
        assert_eq!((a, calls.get()), (b, 1));
        assert_eq!(from.unwrap(), dir.path().join("moe-k1.cubin"));
        // another key compiles; a file that is not a CUBIN is compiled over
        let (c, _) = get_or_compile(Some(dir.path()), "moe", "k2", || compile(3)).unwrap();
        assert_eq!((c, calls.get()), (elf(3), 2));
        std::fs::write(dir.path().join("moe-k1.cubin"), b"garbage").unwrap();
        let (d, from) = get_or_compile(Some(dir.path()), "moe", "k1", || compile(4)).unwrap();
        assert_eq!((d, from, calls.get()), (elf(4), None, 3));
        assert_eq!(
            std::fs::read(dir.path().join("moe-k1.cubin")).unwrap(),
            elf(4)
        );
        // no temporary files left behind
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert!(names.iter().all(|n| n.ends_with(".cubin")), "{names:?}");
    }

    #[test]
    fn an_unwritable_cache_or_none_still_compiles_and_errors_pass_through() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("not-a-dir");
        std::fs::write(&file, b"x").unwrap();
        let (c, from) = get_or_compile(Some(&file), "moe", "k", || Ok(elf(7))).unwrap();
        assert_eq!((c, from), (elf(7), None));
        let (c, _) = get_or_compile(None, "moe", "k", || Ok(elf(8))).unwrap();
        assert_eq!(c, elf(8));
        let e = get_or_compile(Some(dir.path()), "moe", "k", || {
            Err(Error::usage("no nvrtc"))
        })
        .unwrap_err();
        assert!(e.to_string().contains("no nvrtc"), "{e}");
        assert!(!dir.path().join("moe-k.cubin").exists());
    }
}
