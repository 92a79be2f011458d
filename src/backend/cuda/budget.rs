//! GPU memory a command will need, known before it spends minutes loading weights or
//! generating activations: the big buffers of a MoE forward (moe.rs `DevLayer` and
//! `Workspace`) from the layer's dims, checked against the free memory of the device. The
//! small buffers are left out, so the estimate is a lower bound and never refuses a run that
//! fits; what it misses still ends as `Error::GpuOom` when the allocation fails.

use super::Gpu;
use crate::error::{Error, Result};
use crate::moe::MoeConfig;

/// Which path a forward runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ForwardPath {
    /// NVFP4 kernels (`dynamic`: per-batch activation scales keep the SwiGLU output in f32).
    Nvfp4 { dynamic: bool },
    /// BF16 reference (cuBLAS), experts dequantized to BF16 on the GPU.
    Reference,
}

/// Bytes of one forward of `tokens` tokens through a layer of dims `c` (weights and
/// workspace), without EP (all experts on this device).
pub fn forward_bytes(c: &MoeConfig, tokens: usize, path: ForwardPath, per_slot: bool) -> u64 {
    let (h, i, e) = (
        c.hidden_size as u64,
        c.moe_intermediate_size as u64,
        c.n_routed_experts as u64,
    );
    let t = tokens as u64;
    let n = t * c.num_experts_per_tok as u64;
    let s = (c.n_shared_experts * c.moe_intermediate_size) as u64;
    // router weight (at least BF16), shared experts (BF16)
    let mut b = e * h * 2 + 3 * s * h * 2;
    // hidden, logits, output; routing and sort arrays (6 × n × 4); expert outputs y
    b += t * h * 4 + t * e * 4 + t * h * 4 + 6 * n * 4 + n * h * 4;
    // shared expert workspace: x (BF16), g, u (f32), a (BF16), y (f32)
    if s > 0 {
        b += t * (2 * h + 4 * s + 4 * s + 2 * s + 4 * h);
    }
    if per_slot {
        b += n * h * 4;
    }
    match path {
        ForwardPath::Nvfp4 { dynamic } => {
            // codes of w1, w3, w2 (the scales are 1/16 or 1/32 of that again: left out; so are
            // the second copy in decode tiles that NVFP4 forwards of up to
            // moe_decode::MAX_TOKENS tokens make, and on sm_90a the register-A prefill's
            // copy and its 16-bit tokens, n x (H + I) x 2 bytes, since neither the format nor
            // the arch is known here: a lower bound)
            b += 3 * e * i * h / 2;
            // quantized GEMM inputs with their scales
            b += n * h / 2 + n * h / 16 + n * i / 2 + n * i / 16;
            if dynamic {
                b += n * i * 4;
            }
        }
        ForwardPath::Reference => {
            b += 3 * e * i * h * 2;
            // SwiGLU output and u (f32), gathered rows and the intermediate (BF16)
            b += n * i * 4 + n * i * 4 + n * h * 2 + n * i * 2;
        }
    }
    b
}

/// The larger of the NVFP4 and the reference forward: commands run them one after the other
/// on one device, each freeing its buffers before the next.
pub fn layer_pair_bytes(c: &MoeConfig, tokens: usize, dynamic: bool, per_slot: bool) -> u64 {
    forward_bytes(c, tokens, ForwardPath::Nvfp4 { dynamic }, per_slot).max(forward_bytes(
        c,
        tokens,
        ForwardPath::Reference,
        per_slot,
    ))
}

/// Bytes a forward needs per token beyond its weights (for advice).
pub fn per_token_bytes(c: &MoeConfig, per_slot: bool) -> u64 {
    layer_pair_bytes(c, 2, false, per_slot) - layer_pair_bytes(c, 1, false, per_slot)
}

/// `need` bytes against `free`: Err(GpuOom) naming both when it does not fit (with room
/// for what the driver keeps for itself).
pub fn check_fits(need: u64, free: u64, what: &str) -> Result<()> {
    const SLACK: u64 = 64 << 20;
    if need.saturating_add(SLACK) > free {
        return Err(Error::gpu_oom(
            what.to_string(),
            format!(
                "needs at least {:.2} GB of GPU memory, {:.2} GB are free",
                need as f64 / 1e9,
                free as f64 / 1e9
            ),
        ));
    }
    Ok(())
}

/// [`check_fits`] against the device's free memory now.
pub fn check_free(gpu: &Gpu, need: u64, what: &str) -> Result<()> {
    let (free, _) = gpu.mem_info()?;
    check_fits(need, free as u64, what)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::moe::synthetic::Preset;

    #[test]
    fn estimates_grow_with_tokens_and_refuse_what_cannot_fit() {
        let dsv3 = Preset::Dsv3.config();
        let tokens = 1 + rand::random::<u32>() as usize % 100_000;
        let (h, i, e) = (7168u64, 2048u64, 256u64);
        // the reference holds every expert in BF16: 22.5 GB for DeepSeek-V3's 256
        let r = forward_bytes(&dsv3, tokens, ForwardPath::Reference, false);
        assert!(r >= 3 * e * i * h * 2, "tokens {tokens}");
        let nv = forward_bytes(&dsv3, tokens, ForwardPath::Nvfp4 { dynamic: false }, false);
        assert!(nv >= 3 * e * i * h / 2 && nv < r, "tokens {tokens}");
        // per token: at least the expert outputs of its top-8 slots in f32
        let per = per_token_bytes(&dsv3, true);
        assert!(per >= 2 * 8 * h * 4, "{per}");
        assert_eq!(
            layer_pair_bytes(&dsv3, tokens + 1, false, true)
                - layer_pair_bytes(&dsv3, tokens, false, true),
            per
        );
        // two million tokens of DeepSeek-V3 do not fit on any GPU there is (~1 TB)
        let big = layer_pair_bytes(&dsv3, 2_000_000, false, true);
        assert!(big > 1 << 40, "{big}");
        let free = 141u64 << 30;
        match check_fits(big, free, "layertest") {
            Err(e @ Error::GpuOom { .. }) => {
                let s = e.to_string();
                assert!(s.contains("GB are free") && s.contains("layertest"), "{s}");
            }
            other => panic!("expected GpuOom, got {other:?}"),
        }
        // the default batch of the tiny preset fits anywhere
        let tiny = Preset::Tiny.config();
        assert!(check_fits(layer_pair_bytes(&tiny, 64, true, true), 1 << 30, "x").is_ok());
        assert!(check_fits(r, r, "x").is_err());
    }
}
