#!/usr/bin/env python3
"""What PyTorch peers achieve on this GPU, beside `nvfp4dbg bench`.

Measures, at DeepSeek-V3 MoE dims by default (H 7168, I 2048, 256 experts, top-8, one shared
expert), on the GPU this runs on:

  floors      device-to-device copy bandwidth; cuBLAS BF16 GEMM TFLOP/s at 4096^3 and 8192^3
  fp4_loop    what engines do on Hopper without FP4 kernels: per expert, in a Python loop,
              dequantize the NVFP4 weights (packed uint8 + E4M3 block scales + weight_scale_2)
              to BF16, quantize-dequantize the activations to NVFP4 in torch, BF16 matmul
  grouped     the same MoE in plain BF16 with torch._grouped_mm, eager and as a CUDA graph
  quantize    NVFP4 quantize of BF16 activations in torch, eager and torch.compile'd
  scans       cosine / NaN-Inf scans in torch over large tensors

Prints a JSON document on stdout (also written to --json PATH after every section, so a run
cut short keeps what it measured) and a human table on stderr.

`--check` runs at tiny dims and verifies that the torch NVFP4 code here is a fair, correct
peer: quantize codes and scales bit-exact against a straightforward numpy reference written
from DESIGN.md section 2 (every step an IEEE f32 op, in that order), dequantize and the
activation quantize-dequantize bit-exact, and both MoE peers against a float64 reference.

Timing (METHOD.md): warm-up, then every repeat timed alone with CUDA events; median and min
are reported. Inputs rotate through enough buffer sets that their total exceeds 4x the L2,
so repeats do not read from cache.
"""

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

# ---------------------------------------------------------------------------------------------
# NVFP4 in torch (DESIGN.md section 2)

E4M3_MAX = 448.0
E2M1_MAX = 6.0
GS_DENOM = 2688.0  # 6 * 448
R6 = float(np.float32(1.0 / 6.0))  # f32(1/6), exactly representable as a Python float
E2M1_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]

_LUT_CACHE = {}


def e2m1_lut(device):
    """Code (0..15) -> value, f32; bit 3 is the sign."""
    lut = _LUT_CACHE.get(device)
    if lut is None:
        vals = E2M1_VALUES + [-v for v in E2M1_VALUES]
        lut = torch.tensor(vals, dtype=torch.float32, device=device)
        _LUT_CACHE[device] = lut
    return lut


def rcp(v):
    """1/v with rcp(0) = 0, as the reference's get_reciprocal."""
    return torch.where(v == 0, torch.zeros_like(v), 1.0 / v)


def e2m1_codes(v):
    """Round-half-to-even onto E2M1 (the thresholds of DESIGN.md section 2); v is already
    clamped to [-6, 6]. The sign bit is the sign of v, also when the magnitude rounds to 0."""
    a = v.abs()
    # Counted down from 7 as an if-chain would be, so that NaN lands where the Rust codec puts it.
    mag = (
        7
        - (a <= 5.0).to(torch.uint8)
        - (a < 3.5).to(torch.uint8)
        - (a <= 2.5).to(torch.uint8)
        - (a < 1.75).to(torch.uint8)
        - (a <= 1.25).to(torch.uint8)
        - (a < 0.75).to(torch.uint8)
        - (a <= 0.25).to(torch.uint8)
    )
    return mag.to(torch.uint8) | (torch.signbit(v).to(torch.uint8) << 3)


def _block_scales(xb, gs):
    """xb [rows, nb, 16] f32 -> (E4M3 block scales [rows, nb, 1], out_scale [rows, nb, 1])."""
    vmax = xb.abs().amax(dim=-1, keepdim=True)
    s = torch.clamp(gs * (vmax * R6), max=E4M3_MAX)  # saturate: a plain cast of >448 is NaN
    s8 = s.to(torch.float8_e4m3fn)
    out_scale = rcp(s8.float() * rcp(gs))
    return s8, out_scale


def nvfp4_quantize(x, gs):
    """x [rows, cols] (BF16/F32), gs 0-d f32 tensor (quant direction) ->
    (packed uint8 [rows, cols/2], E4M3 scales [rows, cols/16], linear layout)."""
    rows, cols = x.shape
    xb = x.float().view(rows, cols // 16, 16)
    s8, out_scale = _block_scales(xb, gs)
    v = torch.clamp(xb * out_scale, -E2M1_MAX, E2M1_MAX)
    code = e2m1_codes(v).view(rows, cols // 2, 2)
    packed = code[..., 0] | (code[..., 1] << 4)  # element 2i in the low nibble
    return packed, s8.view(rows, cols // 16)


def nvfp4_dequantize(packed, scales, scale_2, out_dtype=torch.float32):
    """x^ = (e2m1(q) * f32(s)) * scale_2 in f32, then cast; scale_2 is a 0-d tensor or
    broadcasts against [rows, cols/16, 1] (one value per row, say)."""
    rows, half = packed.shape
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).view(rows, half * 2)
    vals = e2m1_lut(packed.device)[codes.long()]
    deq = (vals.view(rows, -1, 16) * scales.float().unsqueeze(-1)) * scale_2
    return deq.view(rows, half * 2).to(out_dtype)


def nvfp4_qdq(x, gs, out_dtype=torch.bfloat16):
    """Activation quantize-dequantize as engines emulate NVFP4 (no packing): the same
    steps as nvfp4_quantize, then dequantize with scale_2 = rcp(gs)."""
    rows, cols = x.shape
    xb = x.float().view(rows, cols // 16, 16)
    s8, out_scale = _block_scales(xb, gs)
    v = torch.clamp(xb * out_scale, -E2M1_MAX, E2M1_MAX)
    vals = e2m1_lut(x.device)[e2m1_codes(v).long()]
    deq = (vals * s8.float()) * rcp(gs)
    return deq.view(rows, cols).to(out_dtype)


def _nvfp4_quantize_rn(x, gs):
    # another code object, so that dynamo compiles it afresh instead of reusing the cached
    # compile of nvfp4_quantize made under the default settings
    return nvfp4_quantize(x, gs)


def compiled_quantize(exact_div):
    """nvfp4_quantize under torch.compile. Inductor lowers an f32 `/` to Triton's approximate
    div.full, which flips FP4 codes at rounding ties; exact_div compiles with
    eager_numerics.division_rounding (Triton's div_rn, the IEEE division eager uses)."""
    if not exact_div:
        return torch.compile(nvfp4_quantize, dynamic=False)
    import torch._inductor.config as inductor_config

    fn = torch.compile(_nvfp4_quantize_rn, dynamic=False)

    def run(x, gs):
        with inductor_config.patch({"eager_numerics.division_rounding": True}):
            return fn(x, gs)

    return run


def weight_global_scale(w):
    """weight_scale_2 = f32(amax) / 2688 (amax 0 -> 1/2688); returns (weight_scale_2, gs)."""
    amax = w.abs().amax().float()
    ws2 = amax / GS_DENOM
    ws2 = torch.where(ws2 > 0, ws2, torch.full_like(ws2, 1.0 / GS_DENOM))
    return ws2, 1.0 / ws2


# ---------------------------------------------------------------------------------------------
# Straightforward numpy reference (for --check): every step an f32 op, in DESIGN.md's order.


def _e4m3_table():
    """All non-negative finite float8_e4m3fn values, by code 0..0x7E."""
    vals = []
    for code in range(0x7F):
        e, m = code >> 3, code & 7
        vals.append(m / 8.0 * 2.0**-6 if e == 0 else (1 + m / 8.0) * 2.0 ** (e - 7))
    return np.array(vals, dtype=np.float64)


E4M3_TABLE = _e4m3_table()


def ref_e4m3_code(v):
    """v: f32 array, 0 <= v <= 448 -> code, round to nearest, ties to the even code."""
    v = v.astype(np.float64)
    hi = np.clip(np.searchsorted(E4M3_TABLE, v, side="left"), 0, len(E4M3_TABLE) - 1)
    lo = np.clip(hi - 1, 0, None)
    d_lo = v - E4M3_TABLE[lo]
    d_hi = E4M3_TABLE[hi] - v
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    code = np.where(pick_hi, hi, lo)
    code = np.where(v <= 0, 0, code)
    return code.astype(np.uint8)


def ref_e2m1_code(v):
    """Element by element, the table of DESIGN.md section 2."""
    out = np.empty(v.shape, dtype=np.uint8)
    flat_v, flat_o = v.reshape(-1), out.reshape(-1)
    for i, x in enumerate(flat_v.tolist()):
        a = abs(x)
        if a <= 0.25:
            m = 0
        elif a < 0.75:
            m = 1
        elif a <= 1.25:
            m = 2
        elif a < 1.75:
            m = 3
        elif a <= 2.5:
            m = 4
        elif a < 3.5:
            m = 5
        elif a <= 5.0:
            m = 6
        else:
            m = 7
        flat_o[i] = m | (8 if math.copysign(1.0, x) < 0 else 0)
    return out


def ref_quantize(x, gs):
    """x [rows, cols] f32 numpy, gs f32 -> (packed, scale codes, block scale values)."""
    f32 = np.float32
    rows, cols = x.shape
    gs = f32(gs)
    xb = x.astype(f32).reshape(rows, cols // 16, 16)
    vmax = np.abs(xb).max(axis=-1, keepdims=True).astype(f32)
    t = (gs * (vmax * f32(R6))).astype(f32)  # 1. gs * (vmax * R6)
    t = np.minimum(t, f32(E4M3_MAX))  #    min(., 448)
    s_code = ref_e4m3_code(t)  #    e4m3, nearest even
    s = E4M3_TABLE[s_code].astype(f32)
    rgs = f32(0.0) if gs == 0 else f32(f32(1.0) / gs)  # 2. rcp(f32(s) * rcp(gs))
    prod = (s * rgs).astype(f32)
    with np.errstate(divide="ignore"):
        out_scale = np.where(prod == 0, f32(0.0), (f32(1.0) / prod)).astype(f32)
    v = np.clip((xb * out_scale).astype(f32), f32(-6.0), f32(6.0))  # 3. clamp(x * out_scale)
    code = ref_e2m1_code(v).reshape(rows, cols)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).astype(np.uint8)
    return packed, s_code.reshape(rows, cols // 16), s.reshape(rows, cols // 16)


def ref_dequantize(packed, s_code, scale_2):
    f32 = np.float32
    rows, half = packed.shape
    codes = np.stack((packed & 0xF, packed >> 4), axis=-1).reshape(rows, half * 2)
    lut = np.array(E2M1_VALUES + [-v for v in E2M1_VALUES], dtype=f32)
    vals = lut[codes].reshape(rows, -1, 16)
    s = E4M3_TABLE[s_code].astype(f32)[..., None]
    return ((vals * s).astype(f32) * f32(scale_2)).astype(f32).reshape(rows, half * 2)


# ---------------------------------------------------------------------------------------------
# The MoE layer (DESIGN.md section 4; docs/moe-forward.md): V3 router + routed experts + shared


class Moe:
    """Weights of one MoE layer: NVFP4 routed experts (vLLM's fused layout: w13 = concat(w1,
    w3) per expert, weight_scale_2 per projection), their BF16 dequantization for the BF16
    peer, a BF16 shared expert and a V3 router."""

    def __init__(self, H, I, E, K, n_shared, n_group, topk_group, device, seed, want_bf16=True):
        self.H, self.I, self.E, self.K = H, I, E, K
        self.n_group, self.topk_group = n_group, topk_group
        self.scaling = 2.5
        gen = torch.Generator(device=device).manual_seed(seed)

        def randn(*shape, std=1.0):
            return (torch.randn(*shape, generator=gen, device=device) * std).to(torch.bfloat16)

        self.wg = randn(E, H, std=H**-0.5).float()  # router kept in f32 as engines do
        self.bias = torch.rand(E, generator=gen, device=device) * 0.1
        Is = I * n_shared
        self.shared_w13 = torch.cat([randn(Is, H, std=H**-0.5), randn(Is, H, std=H**-0.5)])
        self.shared_w2 = randn(H, Is, std=Is**-0.5)

        u8, f8 = torch.uint8, torch.float8_e4m3fn
        self.w13 = torch.empty(E, 2 * I, H // 2, dtype=u8, device=device)
        self.w13_scale = torch.empty(E, 2 * I, H // 16, dtype=f8, device=device)
        self.w13_scale_2 = torch.empty(E, 2, device=device)
        self.w2 = torch.empty(E, H, I // 2, dtype=u8, device=device)
        self.w2_scale = torch.empty(E, H, I // 16, dtype=f8, device=device)
        self.w2_scale_2 = torch.empty(E, device=device)
        for e in range(E):
            for half in range(2):
                w = randn(I, H, std=H**-0.5)
                ws2, gs = weight_global_scale(w)
                p, s = nvfp4_quantize(w, gs)
                self.w13[e, half * I : (half + 1) * I] = p
                self.w13_scale[e, half * I : (half + 1) * I] = s
                self.w13_scale_2[e, half] = ws2
            w = randn(H, I, std=I**-0.5)
            ws2, gs = weight_global_scale(w)
            p, s = nvfp4_quantize(w, gs)
            self.w2[e], self.w2_scale[e], self.w2_scale_2[e] = p, s, ws2
        # weight_scale_2 per output row of w13 (gate rows, then up rows), for dequantize
        self.w13_scale_2_rows = self.w13_scale_2.repeat_interleave(I, dim=1).view(E, 2 * I, 1, 1)

        self.w13_bf16 = self.w2_bf16 = None
        if want_bf16:
            self.w13_bf16 = torch.empty(E, 2 * I, H, dtype=torch.bfloat16, device=device)
            self.w2_bf16 = torch.empty(E, H, I, dtype=torch.bfloat16, device=device)
            for e in range(E):
                self.w13_bf16[e] = self.dequant_w13(e)
                self.w2_bf16[e] = self.dequant_w2(e)
        # activation global scales (quant direction), one per expert as engines keep them
        # (amax of randn x over millions of values is about 6; of silu(g)*u, about 30)
        self.gs1 = torch.full((E,), GS_DENOM / 8.0, device=device)
        self.gs2 = torch.full((E,), GS_DENOM / 32.0, device=device)

    def dequant_w13(self, e):
        return nvfp4_dequantize(
            self.w13[e], self.w13_scale[e], self.w13_scale_2_rows[e], torch.bfloat16
        )

    def dequant_w2(self, e):
        return nvfp4_dequantize(self.w2[e], self.w2_scale[e], self.w2_scale_2[e], torch.bfloat16)

    def weight_bytes(self, fp4):
        """Bytes of one routed expert's three projections, and of the shared expert."""
        n = 3 * self.H * self.I
        per_expert = n // 2 + n // 16 if fp4 else 2 * n
        shared = 2 * (self.shared_w13.numel() + self.shared_w2.numel())
        return per_expert, shared

    def route(self, x):
        """V3: sigmoid scores, selection on score + bias, group-limited top-K, weights =
        unbiased scores normalized and scaled. f32."""
        T = x.shape[0]
        scores = torch.sigmoid(x.float() @ self.wg.T)
        sel = scores + self.bias
        if self.n_group > 1:
            g = sel.view(T, self.n_group, -1)
            group_score = g.topk(2, dim=-1).values.sum(-1)
            keep = group_score.topk(self.topk_group, dim=-1).indices
            gmask = torch.zeros_like(group_score).scatter_(1, keep, 1.0)
            sel = sel.masked_fill(gmask.repeat_interleave(self.E // self.n_group, 1) == 0, -1e30)
        ids = sel.topk(self.K, dim=-1).indices
        w = scores.gather(1, ids)
        w = w / (w.sum(-1, keepdim=True) + 1e-20) * self.scaling
        return ids, w

    def shared(self, x):
        gu = x @ self.shared_w13.T
        g, u = gu.float().chunk(2, dim=-1)
        return ((F.silu(g) * u).to(torch.bfloat16) @ self.shared_w2.T).float()

    def forward_fp4_loop(self, x, routing=None):
        """Engines without FP4 kernels: a Python loop over the experts that got tokens;
        dequantize that expert's weights to BF16, quantize-dequantize its activations."""
        T, I = x.shape[0], self.I
        ids, w = routing if routing is not None else self.route(x)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.E).tolist()  # the one host sync
        tok = order // self.K
        wsorted = w.reshape(-1)[order]
        out = torch.zeros(T, self.H, dtype=torch.float32, device=x.device)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            t, we = tok[start : start + n], wsorted[start : start + n]
            start += n
            xe = nvfp4_qdq(x[t], self.gs1[e])
            gu = (xe @ self.dequant_w13(e).T).float()
            a = F.silu(gu[:, :I]) * gu[:, I:]
            ae = nvfp4_qdq(a, self.gs2[e])
            y = (ae @ self.dequant_w2(e).T).float()
            out.index_add_(0, t, y * we[:, None])
        return (out + self.shared(x)).to(torch.bfloat16)

    def forward_grouped(self, x, routing=None):
        """Plain BF16 with torch._grouped_mm: tokens sorted by expert, offsets cumulative
        int32, mat_b the [E, N, K] weights seen as [E, K, N] (transposed view). No host sync,
        so it can be captured as a CUDA graph."""
        T, I = x.shape[0], self.I
        ids, w = routing if routing is not None else self.route(x)
        flat = ids.reshape(-1)
        _, order = torch.sort(flat, stable=True)
        counts = torch.zeros(self.E, dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        tok = order // self.K
        xs = x[tok]  # [T*K, H], sorted by expert
        gu = torch._grouped_mm(xs, self.w13_bf16.transpose(1, 2), offs=offs)  # [T*K, 2I]
        a = (F.silu(gu[:, :I].float()) * gu[:, I:].float()).to(torch.bfloat16)
        y = torch._grouped_mm(a, self.w2_bf16.transpose(1, 2), offs=offs)  # [T*K, H]
        y = y.float() * w.reshape(-1)[order, None]
        out = torch.zeros(T, self.H, dtype=torch.float32, device=x.device).index_add_(0, tok, y)
        return (out + self.shared(x)).to(torch.bfloat16)

    def forward_ref64(self, x, routing, act_quant):
        """Float64 reference per token and slot from the same weights (and, with act_quant,
        the same activation quantize-dequantize, whose exactness --check verifies)."""
        ids, w = routing
        T, I = x.shape[0], self.I
        out = torch.zeros(T, self.H, dtype=torch.float64, device=x.device)
        for e in range(self.E):
            sel = (ids == e).nonzero()
            if sel.numel() == 0:
                continue
            t, slot = sel[:, 0], sel[:, 1]
            xe = nvfp4_qdq(x[t], self.gs1[e], torch.float64) if act_quant else x[t].double()
            gu = xe @ self.w13_bf16[e].double().T
            a = F.silu(gu[:, :I]) * gu[:, I:]
            a = nvfp4_qdq(a.float(), self.gs2[e], torch.float64) if act_quant else a
            y = a @ self.w2_bf16[e].double().T
            out.index_add_(0, t, y * w[t, slot].double()[:, None])
        xd = x.double()
        gu = xd @ self.shared_w13.double().T
        g, u = gu.chunk(2, dim=-1)
        return out + (F.silu(g) * u) @ self.shared_w2.double().T


# ---------------------------------------------------------------------------------------------
# Timing


class Timer:
    def __init__(self, device, quick):
        self.device = device
        self.quick = quick
        props = torch.cuda.get_device_properties(device)
        self.l2 = int(getattr(props, "L2_cache_size", 0) or 60 * 2**20)

    def sets_for(self, bytes_per_set, cap=16):
        """Input sets to rotate through so that together they exceed 4x the L2."""
        return max(1, min(cap, math.ceil(4 * self.l2 / max(1, bytes_per_set))))

    def time(self, fn, n_sets=1, warmup=None, reps=None):
        """fn(i) runs the work on input set i. Returns median/min of per-repeat event times."""
        warmup = warmup if warmup is not None else (2 if self.quick else 5)
        reps = reps if reps is not None else (10 if self.quick else 50)
        for i in range(warmup):
            fn(i % n_sets)
        torch.cuda.synchronize()
        ev = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(reps)
        ]
        for r in range(reps):
            ev[r][0].record()
            fn(r % n_sets)
            ev[r][1].record()
        torch.cuda.synchronize()
        ms = sorted(a.elapsed_time(b) for a, b in ev)
        return {
            "median_ms": float(np.median(ms)),
            "min_ms": ms[0],
            "max_ms": ms[-1],
            "reps": reps,
            "warmup": warmup,
            "rotate_sets": n_sets,
        }


def rate(t, amount, unit_scale):
    """amount / time for the median and the best repeat, in units of unit_scale per second."""
    return (
        amount / (t["median_ms"] * 1e-3) / unit_scale,
        amount / (t["min_ms"] * 1e-3) / unit_scale,
    )


# ---------------------------------------------------------------------------------------------
# Output


class Out:
    def __init__(self, path):
        self.path = path
        self.doc = {}
        self.rows = []  # (section, name, median_ms, min_ms, rate text)

    def row(self, section, name, t, rate_text):
        self.rows.append((section, name, t["median_ms"], t["min_ms"], rate_text))
        print(
            f"  {section:<9} {name:<44} {t['median_ms']:10.3f} ms  "
            f"(min {t['min_ms']:.3f})  {rate_text}",
            file=sys.stderr,
            flush=True,
        )

    def note(self, text):
        print(f"  {text}", file=sys.stderr, flush=True)

    def save(self):
        if not self.path:
            return
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.doc, f, indent=2)
            f.write("\n")
        os.replace(tmp, self.path)

    def table(self):
        w = max([len(r[1]) for r in self.rows] + [4])
        lines = [f"{'section':<9}  {'what':<{w}}  {'median ms':>10}  {'min ms':>10}  rate"]
        lines.append("-" * len(lines[0]) + "-" * 20)
        for sec, name, med, mn, rt in self.rows:
            lines.append(f"{sec:<9}  {name:<{w}}  {med:10.3f}  {mn:10.3f}  {rt}")
        return "\n".join(lines)


def device_info(device):
    p = torch.cuda.get_device_properties(device)
    info = {
        "name": p.name,
        "capability": f"{p.major}.{p.minor}",
        "sm_count": p.multi_processor_count,
        "memory_bytes": p.total_memory,
        "l2_bytes": int(getattr(p, "L2_cache_size", 0)),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }
    try:
        q = "name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,power.draw,temperature.gpu"
        r = subprocess.run(
            ["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        if r.returncode == 0:
            info["nvidia_smi"] = r.stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        pass
    return info


# ---------------------------------------------------------------------------------------------
# Sections


def bench_floors(args, timer, out, dev):
    res = {}
    n = args.copy_mib * 2**20
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    t = timer.time(lambda i: dst.copy_(src), timer.sets_for(2 * n))
    moved = 2 * n
    med, best = rate(t, moved, 1e9)
    res["copy"] = dict(t, bytes_per_rep=moved, gbps_median=med, gbps_best=best,
                       counted="bytes read + bytes written")
    out.row("floor", f"copy d2d {args.copy_mib} MiB", t, f"{med:7.0f} GB/s (best {best:.0f})")
    src = dst = None  # free the GPU memory before the next test

    res["gemm_bf16"] = []
    for m in args.gemm_sizes:
        per_set = 3 * m * m * 2
        sets = timer.sets_for(per_set, cap=4)
        a = [torch.randn(m, m, device=dev, dtype=torch.bfloat16) for _ in range(sets)]
        b = [torch.randn(m, m, device=dev, dtype=torch.bfloat16) for _ in range(sets)]
        c = [torch.empty(m, m, device=dev, dtype=torch.bfloat16) for _ in range(sets)]
        t = timer.time(lambda i: torch.mm(a[i], b[i], out=c[i]), sets)
        flops = 2 * m**3
        med, best = rate(t, flops, 1e12)
        res["gemm_bf16"].append(dict(t, m=m, n=m, k=m, flops=flops, tflops_median=med,
                                     tflops_best=best, data="randn"))
        out.row("floor", f"cuBLAS bf16 GEMM {m}^3", t, f"{med:7.1f} TFLOP/s (best {best:.1f})")
        a = b = c = None
    torch.cuda.empty_cache()
    return res


def moe_counts(moe, T):
    """FLOPs of one forward, for reference: routed 6*T*K*H*I, shared 6*T*H*Is, router 2*T*H*E."""
    Is = moe.shared_w2.shape[1]
    return {
        "routed_flops": 6 * T * moe.K * moe.H * moe.I,
        "shared_flops": 6 * T * moe.H * Is,
        "router_flops": 2 * T * moe.H * moe.E,
    }


def bench_moe(args, timer, out, dev, floors):
    copy_gbps = floors["copy"]["gbps_best"] if floors else None
    gemm_tflops = max(g["tflops_best"] for g in floors["gemm_bf16"]) if floors else None
    t0 = time.time()
    moe = Moe(args.hidden, args.inter, args.experts, args.topk, args.shared, args.n_group,
              args.topk_group, dev, args.seed)
    torch.cuda.synchronize()
    setup_s = time.time() - t0
    out.note(f"MoE weights built in {setup_s:.1f} s "
             f"({torch.cuda.memory_allocated(dev) / 2**30:.1f} GiB on the GPU)")
    res = {
        "dims": dict(hidden=args.hidden, inter=args.inter, experts=args.experts, topk=args.topk,
                     n_shared=args.shared, n_group=args.n_group, topk_group=args.topk_group),
        "setup_s": setup_s,
        "counted": "flops: routed 6*T*K*H*I + shared 6*T*H*I*n_shared + router 2*T*H*E; "
                   "bytes (floor): weights of the experts hit (fp4 loop: packed + E4M3 scales; "
                   "grouped: BF16) + shared BF16 + x in + out, each once",
        "runs": [],
    }
    gen = torch.Generator(device=dev).manual_seed(args.seed + 1)
    for T in args.tokens:
        # a few input sets; the weights streamed per forward are GBs, far past the L2
        sets = 3
        xs = [torch.randn(T, args.hidden, generator=gen, device=dev).to(torch.bfloat16)
              for _ in range(sets)]
        ids, _ = moe.route(xs[0])
        hit = int(torch.unique(ids).numel())
        c = moe_counts(moe, T)
        flops = sum(c.values())
        run = dict(tokens=T, experts_hit=hit, **c)
        per_fp4, shared_b = moe.weight_bytes(True)
        per_bf16, _ = moe.weight_bytes(False)
        io = 2 * 2 * T * args.hidden
        bytes_fp4 = hit * per_fp4 + shared_b + io
        bytes_bf16 = hit * per_bf16 + shared_b + io
        run["bytes_fp4_weights"] = bytes_fp4
        run["bytes_bf16_weights"] = bytes_bf16

        def floor_ms(nbytes):
            if not copy_gbps:
                return None
            return max(nbytes / (copy_gbps * 1e9), flops / (gemm_tflops * 1e12)) * 1e3

        run["floor_ms_fp4_weights"] = floor_ms(bytes_fp4)
        run["floor_ms_bf16_weights"] = floor_ms(bytes_bf16)

        def describe(t, nbytes):
            med, _ = rate(t, flops, 1e12)
            gbs, _ = rate(t, nbytes, 1e9)
            text = f"{med:6.1f} TFLOP/s {gbs:6.0f} GB/s"
            return dict(t, tflops_median=med, gbps_median=gbs), text

        # 1. the engine emulation loop
        loop_reps = args.loop_reps if args.loop_reps else (3 if args.quick else 10)
        t = timer.time(lambda i: moe.forward_fp4_loop(xs[i]), sets, warmup=1, reps=loop_reps)
        run["fp4_loop"], txt = describe(t, bytes_fp4)
        out.row("moe", f"T={T} fp4 dequant + python loop", t, txt)

        # 2. BF16 grouped, eager
        t = timer.time(lambda i: moe.forward_grouped(xs[i]), sets)
        run["grouped_eager"], txt = describe(t, bytes_bf16)
        out.row("moe", f"T={T} bf16 _grouped_mm eager", t, txt)

        # 2b. the same captured as a CUDA graph (one static input; weights are the working set)
        try:
            static_x = xs[0].clone()
            s = torch.cuda.Stream(dev)
            s.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(s):
                for _ in range(3):
                    moe.forward_grouped(static_x)
            torch.cuda.current_stream(dev).wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                static_out = moe.forward_grouped(static_x)
            g.replay()
            torch.cuda.synchronize()
            eager_out = moe.forward_grouped(static_x)
            agree = cosine(static_out, eager_out)
            t = timer.time(lambda i: g.replay(), 1)
            run["grouped_graph"], txt = describe(t, bytes_bf16)
            run["grouped_graph"]["cosine_vs_eager"] = agree
            out.row("moe", f"T={T} bf16 _grouped_mm CUDA graph", t, txt)
            g = static_out = None
        except Exception as e:  # noqa: BLE001 - a failed capture is a result to report
            run["grouped_graph"] = {"error": f"{type(e).__name__}: {e}"}
            out.note(f"T={T} graph capture failed: {e}")

        # the two peers compute the same layer, bar the NVFP4 activations of the loop
        a = moe.forward_fp4_loop(xs[0])
        b = moe.forward_grouped(xs[0])
        run["cosine_fp4_loop_vs_grouped"] = cosine(a, b)
        out.note(f"T={T}: experts hit {hit}/{args.experts}; cosine(fp4 loop, bf16 grouped) = "
                 f"{run['cosine_fp4_loop_vs_grouped']:.5f}; floor "
                 f"{fmt_ms(run['floor_ms_fp4_weights'])} (fp4 weights) / "
                 f"{fmt_ms(run['floor_ms_bf16_weights'])} (bf16 weights)")
        res["runs"].append(run)
        xs = None
    moe = None
    torch.cuda.empty_cache()
    return res


def fmt_ms(v):
    return "n/a" if v is None else f"{v:.3f} ms"


def cosine(a, b):
    a, b = a.double().reshape(-1), b.double().reshape(-1)
    return float((a @ b) / (a.norm() * b.norm()).clamp_min(1e-300))


def bench_quantize(args, timer, out, dev):
    rows, cols = args.quant_rows, args.quant_cols
    elems = rows * cols
    nbytes = elems * 2 + elems // 2 + elems // 16  # read bf16, write packed + E4M3 scales
    sets = timer.sets_for(elems * 2, cap=8)
    gen = torch.Generator(device=dev).manual_seed(args.seed + 2)
    xs = [torch.randn(rows, cols, generator=gen, device=dev).to(torch.bfloat16)
          for _ in range(sets)]
    gss = [(GS_DENOM / x.abs().amax().float()).reshape(()) for x in xs]
    # set 0 at gs = 2688/7, where another order of the f32 ops would flip E4M3 scales: the
    # compiled/eager comparison below then covers ties too
    gss[0] = torch.tensor(384.0, device=dev)
    res = {"shape": [rows, cols], "bytes_per_rep": nbytes,
           "counted": "bf16 read (2 B/elem) + packed written (0.5) + E4M3 scales written (1/16)"}
    t = timer.time(lambda i: nvfp4_quantize(xs[i], gss[i]), sets)
    med, best = rate(t, nbytes, 1e9)
    res["eager"] = dict(t, gbps_median=med, gbps_best=best)
    out.row("quantize", f"nvfp4 {rows}x{cols} torch eager", t, f"{med:7.0f} GB/s (best {best:.0f})")

    for key, exact_div, label in (("compiled", False, "torch.compile"),
                                  ("compiled_div_rn", True, "torch.compile div_rn")):
        try:
            compiled = compiled_quantize(exact_div)
            t0 = time.time()
            compiled(xs[0], gss[0])
            torch.cuda.synchronize()
            compile_s = time.time() - t0
            code_flips = scale_flips = 0
            compared = min(2, sets)
            for i in range(compared):
                pc, sc = compiled(xs[i], gss[i])
                pe, se = nvfp4_quantize(xs[i], gss[i])
                code_flips += int(nibble_diff(pc, pe))
                scale_flips += int((sc.view(torch.uint8) != se.view(torch.uint8)).sum())
            t = timer.time(lambda i: compiled(xs[i], gss[i]), sets)
            med, best = rate(t, nbytes, 1e9)
            res[key] = dict(t, gbps_median=med, gbps_best=best, compile_s=compile_s,
                            exact_division=exact_div, sets_compared=compared,
                            code_flips_vs_eager=code_flips, scale_flips_vs_eager=scale_flips)
            out.row("quantize", f"nvfp4 {rows}x{cols} {label}", t,
                    f"{med:7.0f} GB/s (best {best:.0f})")
            out.note(f"{label}: compiled in {compile_s:.1f} s; vs eager {code_flips} FP4 codes "
                     f"and {scale_flips} E4M3 scales differ (of {compared * elems} and "
                     f"{compared * elems // 16})")
        except Exception as e:  # noqa: BLE001 - a failed compile is a result to report
            res[key] = {"error": f"{type(e).__name__}: {e}"}
            out.note(f"{label} failed: {e}")
    xs = None
    torch.cuda.empty_cache()
    return res


def nibble_diff(a, b):
    """How many FP4 codes differ between two packed tensors."""
    x = a ^ b
    return ((x & 0xF) != 0).sum() + ((x >> 4) != 0).sum()


def bench_scans(args, timer, out, dev):
    res = []
    n = args.scan_melems * 2**20
    for dt_name in args.scan_dtypes:
        dt = {"bf16": torch.bfloat16, "f32": torch.float32}[dt_name]
        a = torch.randn(n, device=dev, dtype=torch.float32)
        b = (a + 0.01 * torch.randn_like(a)).to(dt)
        a = a.to(dt)
        torch.cuda.empty_cache()
        es = a.element_size()

        def metrics(x, y):
            xf, yf = x.float(), y.float()
            d = xf - yf
            dot = torch.dot(xf, yf)
            nx, ny, nd = xf.norm(), yf.norm(), d.norm()
            return (dot / (nx * ny), nd / ny, d.abs().max(), torch.isnan(x).sum(),
                    torch.isinf(x).sum())

        cases = [
            ("cosine F.cosine_similarity (f32)", 2 * n * es,
             lambda i: F.cosine_similarity(a.float().view(1, -1), b.float().view(1, -1))),
            ("nan/inf count (~isfinite).sum()", n * es, lambda i: (~torch.isfinite(a)).sum()),
            ("nan any torch.isnan().any()", n * es, lambda i: torch.isnan(a).any()),
            ("metrics cos+rel_l2+max_abs+nan/inf", 2 * n * es, lambda i: metrics(a, b)),
        ]
        for name, nbytes, fn in cases:
            t = timer.time(fn, 1)  # each input is far past the L2
            med, best = rate(t, nbytes, 1e9)
            res.append(dict(t, what=name, dtype=dt_name, elements=n, bytes_per_rep=nbytes,
                            counted="input bytes read once", gbps_median=med, gbps_best=best))
            out.row("scan", f"{name} {dt_name} {n >> 20}Mi", t,
                    f"{med:7.0f} GB/s (best {best:.0f})")
        a = b = None
        torch.cuda.empty_cache()
    return res


# ---------------------------------------------------------------------------------------------
# --check


def run_check(args, dev, out):
    """Bit-exact NVFP4 against the numpy reference; MoE peers against float64."""
    ok = True
    res = {"device": str(dev), "quantize": [], "moe": {}}
    rng = np.random.default_rng(args.seed)

    def inputs():
        # BF16 data of widely spread block magnitudes (flushed, normal and saturated blocks),
        # plus exact ties of both roundings.
        rows, cols = 128, 256
        x = rng.standard_normal((rows, cols)).astype(np.float32)
        block_mag = 10.0 ** rng.uniform(-4, 3, size=(rows, cols // 16, 1))
        x *= block_mag.repeat(16, -1).reshape(rows, cols)
        ties = np.array([0.25, -0.25, 0.75, 1.25, -1.75, 2.5, 3.5, -5.0, -0.1, 0.0, -0.0,
                         6.0, 0.5, 1.0, 1.5, 3.0], dtype=np.float32)
        x[0, :16] = ties  # vmax 6 and gs 1: s = 1, out_scale = 1, so v = x
        x[1, :16] = 0.0
        x[2, :16] = -0.0
        return torch.from_numpy(x).to(torch.bfloat16).float().numpy()  # BF16-exact, as fed

    # 2688/7, 448 and 896 make gs * (vmax * R6) land near E4M3 ties, where another order of
    # the f32 ops flips scales; 1/2688 flushes blocks, 1e4 saturates them.
    compiled = None
    for gs in (1.0, 2688.0 / 4.0, 1.0 / 2688.0, 1e4, 2688.0 / 1e3, 384.0, 448.0, 896.0):
        x_np = inputs()
        rows, cols = x_np.shape
        p_ref, s_ref, _ = ref_quantize(x_np, np.float32(gs))
        x = torch.from_numpy(x_np).to(dev).to(torch.bfloat16)
        gst = torch.tensor(gs, dtype=torch.float32, device=dev)
        p, s = nvfp4_quantize(x, gst)
        code_flips = int(nibble_diff(p.cpu(), torch.from_numpy(p_ref)))
        scale_flips = int((s.view(torch.uint8).cpu().numpy() != s_ref).sum())
        # e4m3 cast in torch vs the independent table rounding (and ml_dtypes if present)
        deq_ref = ref_dequantize(p_ref, s_ref, np.float32(1.0) / np.float32(gs))
        deq = nvfp4_dequantize(p, s, torch.reciprocal(gst)).cpu().numpy()
        deq_bad = int((deq.view(np.uint32) != deq_ref.view(np.uint32)).sum())
        qdq = nvfp4_qdq(x, gst, torch.float32).cpu().numpy()
        qdq_bad = int((qdq.view(np.uint32) != deq_ref.view(np.uint32)).sum())
        sat = int((s_ref == 0x7E).sum())
        flushed = int(((s_ref == 0) & (np.abs(x_np).reshape(rows, -1, 16).max(-1) > 0)).sum())
        entry = dict(gs=gs, elements=x_np.size, code_flips=code_flips, scale_flips=scale_flips,
                     dequant_mismatch=deq_bad, qdq_mismatch=qdq_bad, saturated_blocks=sat,
                     flushed_blocks=flushed)
        if args.check_compile:
            # one compile each: gs is a tensor, and its value does not recompile
            compiled = compiled or {"compiled": compiled_quantize(False),
                                    "compiled_div_rn": compiled_quantize(True)}
            for key, fn in compiled.items():
                cp, cs = fn(x, gst)
                entry[f"{key}_code_flips"] = int(nibble_diff(cp.cpu(), torch.from_numpy(p_ref)))
                entry[f"{key}_scale_flips"] = int(
                    (cs.view(torch.uint8).cpu().numpy() != s_ref).sum())
        res["quantize"].append(entry)
        good = code_flips == 0 and scale_flips == 0 and deq_bad == 0 and qdq_bad == 0
        ok &= good
        out.note(f"check quantize gs={gs:<10.4g} {'ok ' if good else 'BAD'} {entry}")

    # ties of the E4M3 rounding itself, against ml_dtypes when it is installed
    v = np.concatenate([E4M3_TABLE[:-1] * 0.5 + E4M3_TABLE[1:] * 0.5,  # every midpoint
                        rng.uniform(0, 448, 4096)]).astype(np.float32)
    torch_codes = torch.from_numpy(v).to(dev).to(torch.float8_e4m3fn).view(torch.uint8)
    torch_codes = torch_codes.cpu().numpy()
    e4m3_bad = int((torch_codes != ref_e4m3_code(v)).sum())
    res["e4m3_cast_mismatch"] = e4m3_bad
    ok &= e4m3_bad == 0
    try:
        import ml_dtypes

        md = v.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
        res["e4m3_ml_dtypes_mismatch"] = int((md != ref_e4m3_code(v)).sum())
        ok &= res["e4m3_ml_dtypes_mismatch"] == 0
    except ImportError:
        res["e4m3_ml_dtypes_mismatch"] = None
    out.note(f"check e4m3 cast: torch vs table {e4m3_bad} mismatches; ml_dtypes vs table "
             f"{res['e4m3_ml_dtypes_mismatch']}")

    # the two MoE peers against float64 at tiny dims
    H, I, E, K = 256, 128, 16, 4
    moe = Moe(H, I, E, K, 1, 4, 2, dev, args.seed)
    T = 37
    x = torch.randn(T, H, device=dev, generator=torch.Generator(device=dev).manual_seed(7))
    x = x.to(torch.bfloat16)
    routing = moe.route(x)
    for name, fwd, act_quant, tol in (
        ("fp4_loop", moe.forward_fp4_loop, True, 5e-2),
        ("grouped", moe.forward_grouped, False, 1e-2),
    ):
        try:
            y = fwd(x, routing).double()
            ref = moe.forward_ref64(x, routing, act_quant)
            rel = float((y - ref).norm() / ref.norm())
            good = bool(torch.isfinite(y).all()) and rel < tol
            res["moe"][name] = dict(rel_l2=rel, tol=tol, cosine=cosine(y, ref), ok=good)
        except Exception as e:  # noqa: BLE001
            good = False
            res["moe"][name] = dict(error=f"{type(e).__name__}: {e}", ok=False)
        ok &= good
        out.note(f"check moe {name:<9} {'ok ' if good else 'BAD'} {res['moe'][name]}")
    res["ok"] = bool(ok)
    return res


# ---------------------------------------------------------------------------------------------


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer repeats, smaller scans and copy")
    p.add_argument("--check", action="store_true", help="only the correctness check (tiny dims)")
    p.add_argument("--with-check", action="store_true", help="the check, then the benches")
    p.add_argument("--no-check-compile", dest="check_compile", action="store_false",
                   help="in the check, skip torch.compile (it takes a while)")
    p.add_argument("--sections", default="floors,moe,quantize,scans",
                   help="comma list of floors,moe,quantize,scans")
    p.add_argument("--json", help="also write the JSON document here (after every section)")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--seed", type=int, default=None, help="default: random, printed")
    g = p.add_argument_group("MoE dims (DeepSeek-V3 by default)")
    g.add_argument("--hidden", type=int, default=7168)
    g.add_argument("--inter", type=int, default=2048, help="moe_intermediate_size")
    g.add_argument("--experts", type=int, default=256)
    g.add_argument("--topk", type=int, default=8)
    g.add_argument("--shared", type=int, default=1, help="n_shared_experts")
    g.add_argument("--n-group", type=int, default=8)
    g.add_argument("--topk-group", type=int, default=4)
    g.add_argument("--tokens", default="4096,16", help="comma list of token counts")
    g.add_argument("--loop-reps", type=int, default=0, help="repeats of the slow fp4 loop")
    g = p.add_argument_group("other sizes")
    g.add_argument("--gemm-sizes", default="4096,8192")
    g.add_argument("--copy-mib", type=int, default=None, help="default 2048 (quick 1024)")
    g.add_argument("--quant-rows", type=int, default=8192)
    g.add_argument("--quant-cols", type=int, default=7168)
    g.add_argument("--scan-melems", type=int, default=None,
                   help="Mi elements per scanned tensor; default 512 (quick 256)")
    g.add_argument("--scan-dtypes", default="bf16,f32")
    a = p.parse_args(argv)
    a.tokens = [int(v) for v in a.tokens.split(",") if v]
    a.gemm_sizes = [int(v) for v in a.gemm_sizes.split(",") if v]
    a.scan_dtypes = [v for v in a.scan_dtypes.split(",") if v]
    a.sections = [v for v in a.sections.split(",") if v]
    if a.copy_mib is None:
        a.copy_mib = 1024 if a.quick else 2048
    if a.scan_melems is None:
        a.scan_melems = 256 if a.quick else 512
    if a.seed is None:
        a.seed = int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF
    bad = [s for s in a.sections if s not in ("floors", "moe", "quantize", "scans")]
    if bad:
        p.error(f"unknown section(s) {bad}")
    if a.hidden % 16 or a.inter % 16:
        p.error("--hidden and --inter must be multiples of 16 (NVFP4 blocks)")
    if a.n_group > 1 and (a.experts % a.n_group or a.topk_group > a.n_group):
        p.error("--experts must divide into --n-group groups, --topk-group <= --n-group")
    if a.quant_cols % 16:
        p.error("--quant-cols must be a multiple of 16")
    return a


def main(argv=None):
    args = parse_args(argv if argv is not None else sys.argv[1:])
    out = Out(args.json)
    out.doc = {
        "tool": "bench/peers.py",
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv[1:],
        "seed": args.seed,
        "quick": args.quick,
    }
    print(f"peers.py seed {args.seed}", file=sys.stderr, flush=True)
    torch.manual_seed(args.seed)
    have_cuda = torch.cuda.is_available()
    if args.check or args.with_check:
        dev = torch.device(args.device if have_cuda else "cpu")
        if have_cuda:
            out.doc["device"] = device_info(dev)
        with torch.inference_mode():
            out.doc["check"] = run_check(args, dev, out)
        out.save()
        ok = out.doc["check"]["ok"]
        print(f"check: {'PASS' if ok else 'FAIL'}", file=sys.stderr, flush=True)
        if args.check:
            print(json.dumps(out.doc, indent=2))
            return 0 if ok else 1
    if not have_cuda:
        print("peers.py: no CUDA device; the benches need one (--check runs on the CPU)",
              file=sys.stderr)
        return 2
    dev = torch.device(args.device)
    torch.cuda.set_device(dev)
    timer = Timer(dev, args.quick)
    out.doc["device"] = device_info(dev)
    out.doc["method"] = {
        "timing": "warm-up, then each repeat timed alone with CUDA events; median and min",
        "rotation": "inputs rotate through sets totalling > 4x L2 (rotate_sets per entry); the "
                    "MoE weights and the scanned tensors are each far past the L2 alone",
        "l2_bytes": timer.l2,
        "rates": "FLOP/s = counted FLOPs / time; GB/s = counted bytes / time (1 GB = 1e9 B)",
    }
    print(f"{out.doc['device']['name']}  torch {torch.__version__}  cuda {torch.version.cuda}  "
          f"L2 {timer.l2 >> 20} MiB", file=sys.stderr, flush=True)
    floors = None
    with torch.inference_mode():
        if "floors" in args.sections:
            floors = out.doc["floors"] = bench_floors(args, timer, out, dev)
            out.save()
        if "moe" in args.sections:
            out.doc["moe"] = bench_moe(args, timer, out, dev, floors)
            out.save()
        if "quantize" in args.sections:
            q = out.doc["quantize"] = bench_quantize(args, timer, out, dev)
            if floors:
                for k in ("eager", "compiled", "compiled_div_rn"):
                    if "gbps_median" in q.get(k, {}):
                        q[k]["fraction_of_copy"] = (
                            q[k]["gbps_median"] / floors["copy"]["gbps_median"])
            out.save()
        if "scans" in args.sections:
            sc = out.doc["scans"] = bench_scans(args, timer, out, dev)
            if floors:
                for r in sc:
                    r["fraction_of_copy"] = r["gbps_median"] / floors["copy"]["gbps_median"]
            out.save()
    print("\n" + out.table(), file=sys.stderr, flush=True)
    print(json.dumps(out.doc, indent=2))
    if "check" in out.doc and not out.doc["check"]["ok"]:
        print("check: FAIL (the benches ran anyway)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
