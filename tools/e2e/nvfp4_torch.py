"""NVFP4 in torch, exactly as nvfp4dbg DESIGN.md section 2 pins it (vLLM's ``ref_nvfp4_quant``).

Used by the end-to-end demo to run MoE experts the way an NVFP4 engine does (activations
quantized to NVFP4 with the checkpoint's ``input_scale``, weights from the NVFP4 checkpoint),
and to write engine-style dumps (vLLM FusedMoE names, 128x4-swizzled block scales).
Every step is an f32 op in the order the design gives; a different order flips codes at ties.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0
E2M1_MAX = 6.0
# the magnitudes of the 8 E2M1 codes (bit 3 is the sign)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
R6 = torch.tensor(1.0 / 6.0, dtype=torch.float32).item()  # f32(1/6), as the reference


def _rcp(v: torch.Tensor) -> torch.Tensor:
    """1/v, with rcp(0) = 0 (an all-zero block gets scale 0 and codes 0, not NaN)."""
    return torch.where(v == 0, torch.zeros_like(v), 1.0 / torch.where(v == 0, torch.ones_like(v), v))


def e2m1_round(v: torch.Tensor) -> torch.Tensor:
    """Round |v| <= 6 to the nearest E2M1 magnitude, ties to even code, keeping the sign."""
    a = v.abs()
    q = torch.where(a <= 0.25, 0.0,
        torch.where(a < 0.75, 0.5,
        torch.where(a <= 1.25, 1.0,
        torch.where(a < 1.75, 1.5,
        torch.where(a <= 2.5, 2.0,
        torch.where(a < 3.5, 3.0,
        torch.where(a <= 5.0, 4.0, 6.0)))))))
    return torch.copysign(q.to(torch.float32), v)


def fake_quant(x: torch.Tensor, gs: float) -> torch.Tensor:
    """Quantize-dequantize activations ``x [..., K]`` (K a multiple of 16) to NVFP4 with the
    quant-direction global scale ``gs`` (= 1/input_scale). Returns f32 x-hat."""
    shape = x.shape
    k = shape[-1]
    assert k % 16 == 0, f"last dim {k} is not a multiple of 16"
    xb = x.to(torch.float32).reshape(-1, k // 16, 16)
    gs_t = torch.tensor(gs, dtype=torch.float32, device=x.device)
    vmax = xb.abs().amax(dim=-1, keepdim=True)
    s = torch.clamp(gs_t * (vmax * R6), max=FP8_MAX).to(torch.float8_e4m3fn).to(torch.float32)
    out_scale = _rcp(s * _rcp(gs_t))
    q = e2m1_round(torch.clamp(xb * out_scale, -E2M1_MAX, E2M1_MAX))
    return ((q * s) * (1.0 / gs_t)).reshape(shape)


def dequant_weight(packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    """ModelOpt NVFP4 triple -> f32 ``[N, K]``: ``weight`` U8 ``[N, K/2]`` (element 2i in the low
    nibble), ``weight_scale`` F8_E4M3 ``[N, K/16]`` (linear layout), ``weight_scale_2`` F32 []."""
    lut = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32,
                       device=packed.device)
    p = packed.to(torch.int64)
    codes = torch.stack((p & 0xF, p >> 4), dim=-1).reshape(p.shape[0], p.shape[1] * 2)
    vals = lut[codes]
    n, k = vals.shape
    s = scale.to(torch.float32).reshape(n, k // 16, 1)
    return ((vals.reshape(n, k // 16, 16) * s) * scale_2.to(torch.float32)).reshape(n, k)


def swizzle_128x4(scale: torch.Tensor) -> torch.Tensor:
    """Linear block scales ``[M, K/16]`` -> the CUTLASS/FlashInfer 128x4 swizzled layout
    (DESIGN.md section 2), padded to M % 128 == 0 and K/16 % 4 == 0, reshaped back to 2-D
    ``[M_pad, Kt_pad]`` (what vLLM's ``swizzle_blockscale`` keeps)."""
    m, kt = scale.shape
    mp, kp = (m + 127) // 128 * 128, (kt + 3) // 4 * 4
    raw = scale.view(torch.uint8)
    pad = torch.zeros((mp, kp), dtype=torch.uint8, device=scale.device)
    pad[:m, :kt] = raw
    # (m/128, 4 [m/32 % 4], 32 [m % 32], k/4, 4 [k % 4]) -> (m/128, k/4, m%32, m/32%4, k%4)
    t = pad.reshape(mp // 128, 4, 32, kp // 4, 4).permute(0, 3, 2, 1, 4).contiguous()
    return t.reshape(mp, kp).view(torch.float8_e4m3fn)
