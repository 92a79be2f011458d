#!/usr/bin/env python3
"""Independent NVFP4 / MXFP4 quantizer for golden tests of `nvfp4dbg quantize`.

Written from DESIGN.md §2 alone, with numpy (every step an IEEE f32 op, in the pinned order)
and ml_dtypes (float8_e4m3fn / float4_e2m1fn round to nearest even), never from the Rust code:

  weight_scale_2 = f32(amax) / 2688, gs = 1 / weight_scale_2   (an explicit gs: weight_scale_2 = 1/gs)
  s         = e4m3(min(gs * (vmax * R6), 448))                  R6 = f32(1/6)
  out_scale = rcp(f32(s) * rcp(gs))                             rcp(0) = 0
  q         = e2m1(clamp(x * out_scale, -6, 6))                 sign kept on zero (-0.1 -> 0x8)

MXFP4 (OCP MX): blocks of 32, scale 2^(floor(log2 vmax) - 2) as a UE8M0 code, q = e2m1(clamp(x / scale)).

Usage:
  make_golden.py golden OUTDIR            adversarial input + expected outputs (committed)
  make_golden.py quantize IN OUT [--gs V] [--format nvfp4|mxfp4]
                                          quantize any safetensors file as the tool does
Needs: numpy, ml_dtypes (pip install numpy ml_dtypes). safetensors is read and written by hand.
"""

import argparse
import json
import struct
import sys

import numpy as np
import ml_dtypes

F32 = np.float32
R6 = F32(1) / F32(6)
E4M3_MAX = F32(448)
GS_DENOM = F32(2688)

DTYPES = {
    "BF16": ml_dtypes.bfloat16,
    "F16": np.float16,
    "F32": np.float32,
    "F64": np.float64,
    "I64": np.int64,
    "I32": np.int32,
    "U8": np.uint8,
    "I8": np.int8,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
}


# ---------------------------------------------------------------- safetensors by hand


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    meta = header.pop("__metadata__", None)
    body = data[8 + n :]
    out = []
    for name, t in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        b, e = t["data_offsets"]
        out.append((name, t["dtype"], list(t["shape"]), body[b:e]))
    return out, meta


def write_safetensors(path, tensors, meta=None):
    """tensors: list of (name, dtype string, shape, raw bytes), written in this order."""
    header = {}
    if meta:
        header["__metadata__"] = meta
    off = 0
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + len(raw)]}
        off += len(raw)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for _, _, _, raw in tensors:
            f.write(raw)


def as_f32(dtype, shape, raw):
    return np.frombuffer(raw, dtype=DTYPES[dtype]).astype(np.float32).reshape(shape)


# ---------------------------------------------------------------- the numerics


def rcp(v):
    v = np.asarray(v, dtype=F32)
    with np.errstate(divide="ignore"):
        return np.where(v == 0, F32(0), F32(1) / v).astype(F32)


def e2m1_codes(v):
    return (v.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF).astype(np.uint8)


def pack(codes):
    c = codes.reshape(codes.shape[0], -1, 2)
    return (c[..., 0] | (c[..., 1] << 4)).astype(np.uint8)


def weight_global_scale(x):
    amax = F32(np.max(np.abs(x))) if x.size else F32(0)
    ws2 = F32(amax / GS_DENOM)
    with np.errstate(divide="ignore", over="ignore"):
        ok = ws2 > 0 and np.isfinite(ws2) and np.isfinite(F32(1) / ws2)
    if not ok:
        ws2 = F32(1) / GS_DENOM
    return ws2, F32(F32(1) / ws2)


def quantize_nvfp4(x, gs):
    n, k = x.shape
    gs = F32(gs)
    blocks = x.reshape(n, k // 16, 16)
    vmax = np.max(np.abs(blocks), axis=-1).astype(F32)
    t = (gs * (vmax * R6)).astype(F32)
    t = np.minimum(t, E4M3_MAX)
    s = t.astype(ml_dtypes.float8_e4m3fn)
    out_scale = rcp(s.astype(F32) * rcp(gs))
    v = (blocks * out_scale[..., None]).astype(F32)
    v = np.clip(v, F32(-6), F32(6)).astype(F32)
    codes = e2m1_codes(v).reshape(n, k)
    return pack(codes), s.view(np.uint8).reshape(n, k // 16)


def quantize_mxfp4(x):
    n, k = x.shape
    blocks = x.reshape(n, k // 32, 32)
    vmax = np.max(np.abs(blocks), axis=-1).astype(F32)
    mant, e = np.frexp(vmax)  # vmax = mant * 2^e, mant in [0.5, 1): floor(log2 vmax) = e - 1
    exp = np.where(vmax == 0, -127, (e - 1) - 2)
    exp = np.clip(exp, -127, 127).astype(np.int32)
    scale = np.ldexp(F32(1), exp).astype(F32)
    v = (blocks / scale[..., None]).astype(F32)
    v = np.clip(v, F32(-6), F32(6)).astype(F32)
    codes = e2m1_codes(v).reshape(n, k)
    return pack(codes), (exp + 127).astype(np.uint8)


def quantizable(name, dtype, shape, block):
    return (
        name.endswith(".weight")
        and dtype in ("BF16", "F16", "F32")
        and len(shape) == 2
        and shape[1] > 0
        and shape[1] % block == 0
    )


def quantize_file(inp, out, gs=None, fmt="nvfp4"):
    tensors, meta = read_safetensors(inp)
    block = 16 if fmt == "nvfp4" else 32
    res = []
    for name, dtype, shape, raw in tensors:
        if not quantizable(name, dtype, shape, block):
            res.append((name, dtype, shape, raw))
            continue
        x = as_f32(dtype, shape, raw)
        base = name[: -len(".weight")]
        n, k = shape
        if fmt == "mxfp4":
            p, s = quantize_mxfp4(x)
            res.append((name, "U8", [n, k // 2], p.tobytes()))
            res.append((base + ".weight_scale", "F8_E8M0", [n, k // 32], s.tobytes()))
            continue
        if gs is None:
            ws2, g = weight_global_scale(x)
        else:
            g = F32(gs)
            ws2 = F32(F32(1) / g)
        p, s = quantize_nvfp4(x, g)
        res.append((name, "U8", [n, k // 2], p.tobytes()))
        res.append((base + ".weight_scale", "F8_E4M3", [n, k // 16], s.tobytes()))
        res.append((base + ".weight_scale_2", "F32", [], np.array([ws2], dtype=F32).tobytes()))
    write_safetensors(out, res, meta)


# ---------------------------------------------------------------- adversarial input

E2M1_TIES = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]


def bf16(v):
    return np.asarray(v, dtype=F32).astype(ml_dtypes.bfloat16).astype(F32)


def bf16_next(v, up):
    b = int(np.asarray([v], dtype=ml_dtypes.bfloat16).view(np.uint16)[0])
    step = 1 if (up == (v >= 0)) else -1
    return float(np.array([b + step], dtype=np.uint16).view(ml_dtypes.bfloat16).astype(F32)[0])


def e4m3_midpoints():
    vals = np.arange(0, 0x7F, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return [(a + b) / 2 for a, b in zip(vals[:-1], vals[1:])]


def adversarial_blocks(rng):
    """16-element blocks for a tensor whose amax is 10.5, so that gs = 2688/10.5 = 256 and every
    block scale gs*vmax/6 is exact: ties in E2M1 and in E4M3 are hit exactly, not nearly."""
    out = []
    anchor = 10.5
    out.append([anchor] + [-anchor] + list(rng.uniform(-anchor, anchor, 14)))
    # E2M1 ties: vmax = 6 * 2^j makes s = 2^(j+8) and out_scale = 2^-j exact
    for j in (-2, -5, 0, -9, -14, -17):
        u = 2.0**j
        ties = [6.0] + E2M1_TIES + [-t for t in E2M1_TIES] + [-6.0]
        out.append([t * u for t in ties])
        above = [bf16_next(t * u, True) for t in E2M1_TIES]
        below = [bf16_next(t * u, False) for t in E2M1_TIES]
        out.append([6.0 * u] + above + [-b for b in below] + [-6.0 * u])
        # negative values that round to zero keep their sign: code 0x8
        out.append([-6.0 * u, -0.1 * u, -0.2 * u, -0.25 * u, -1e-3 * u, -0.0, 0.0, 0.1 * u,
                    -0.24 * u, 0.24 * u, -0.01 * u, 0.3 * u, -0.3 * u, -0.26 * u, 0.26 * u, 3.0 * u])
    # all-zero blocks (one with negative zeros: 0 * -0 = -0 -> 0x8)
    out.append([0.0] * 16)
    out.append([-0.0, 0.0] * 8)
    # E4M3 ties of the block scale: gs * (vmax * R6) lands exactly on a midpoint
    mids = e4m3_midpoints()
    for m in mids[:: max(1, len(mids) // 40)] + [mids[0], mids[1], mids[2], mids[-1], mids[-2]]:
        vmax = 6.0 * m / 256.0
        body = list(rng.uniform(-vmax, vmax, 14))
        out.append([vmax, -vmax * 0.5] + body)
        out.append([bf16_next(vmax, True), bf16_next(vmax, False)] + body)
    # saturating blocks: vmax close to amax, where gs*vmax/6 rounds to 448
    for vmax in (10.5, 10.25, 10.125, 10.15, 10.0):
        out.append([vmax] + list(rng.uniform(-vmax, vmax, 15)))
    # subnormal block scales (gs*vmax/6 < 2^-6) and flushed blocks (< 2^-10)
    for vmax in (3.5e-4, 2e-4, 1e-4, 5e-5, 2.3e-5, 1.2e-5, 6e-6, 1e-6, 1e-9):
        out.append([vmax] + list(rng.uniform(-vmax, vmax, 15)))
    # ordinary data at several magnitudes
    for sc in (1.0, 0.1, 0.01, 3.0):
        for _ in range(4):
            out.append(list(rng.standard_normal(16) * sc))
    return out


# Other orders of the same arithmetic: each flips some block scales or codes on BF16 data, so
# the golden files pin the order of DESIGN.md §2 and not just the formula.
def _e4m3_codes(t):
    t = np.minimum(np.nan_to_num(t.astype(F32), nan=0.0, posinf=448.0), E4M3_MAX)
    return t.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


SCALE_ORDERS = {
    "(gs*vmax)/6": lambda gs, v: (gs * v) / F32(6),
    "gs*(vmax/6)": lambda gs, v: gs * (v / F32(6)),
    "vmax*(gs/6)": lambda gs, v: v * (gs / F32(6)),
    "(vmax*gs)*R6": lambda gs, v: (v * gs) * R6,
}
CODE_ORDERS = {
    "x*(gs/s)": lambda x, gs, s: x * (gs / s),
    "(x*gs)/s": lambda x, gs, s: (x * gs) / s,
    "x/(s/gs)": lambda x, gs, s: x / (s / gs),
    "x/(s*rcp(gs))": lambda x, gs, s: x / (s * rcp(gs)),
}


def order_flips(x, gs):
    """(blocks whose scale, elements whose code) another order would change."""
    b = x.reshape(-1, 16)
    vmax = np.max(np.abs(b), axis=1).astype(F32)
    ref = _e4m3_codes(gs * (vmax * R6))
    scale_flips = np.zeros(len(ref), dtype=bool)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for f in SCALE_ORDERS.values():
            scale_flips |= _e4m3_codes(f(gs, vmax)) != ref
        s = ref.view(ml_dtypes.float8_e4m3fn).astype(F32)[:, None]
        want = e2m1_codes(np.clip(b * rcp(s * rcp(gs)), F32(-6), F32(6)).astype(F32))
        code_flips = np.zeros(b.shape, dtype=bool)
        for f in CODE_ORDERS.values():
            v = np.where(s == 0, F32(0), f(b, gs, s)).astype(F32)
            code_flips |= e2m1_codes(np.clip(v, F32(-6), F32(6)).astype(F32)) != want
    return int(scale_flips.sum()), int(code_flips.sum())


def order_sensitive_blocks(amax, rng):
    """Blocks for a tensor of this amax (a non-power-of-two gs) where the order matters."""
    amax = F32(ml_dtypes.bfloat16(amax))
    _, gs = weight_global_scale(np.array([amax], dtype=F32))
    v = np.arange(1, 0x7F80, dtype=np.uint16).view(ml_dtypes.bfloat16).astype(F32)
    v = v[v <= amax]
    ref = _e4m3_codes(gs * (v * R6))
    blocks = [[float(amax)] + list(rng.uniform(-amax, amax, 15))]
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        differ = np.zeros(len(v), dtype=bool)
        for f in SCALE_ORDERS.values():
            differ |= _e4m3_codes(f(gs, v)) != ref
    for vm in v[differ][:24]:
        blocks.append([float(vm), -float(vm)] + list(rng.uniform(-vm, vm, 14)))
    for code in np.unique(ref):
        s = F32(np.array([code], dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(F32)[0])
        if s == 0:
            continue
        top = v[ref == code].max()
        xs = v[v < top]
        want = e2m1_codes(np.clip(xs * rcp(s * rcp(gs)), F32(-6), F32(6)).astype(F32))
        flip = np.zeros(len(xs), dtype=bool)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            for f in CODE_ORDERS.values():
                flip |= e2m1_codes(np.clip(f(xs, gs, s), F32(-6), F32(6)).astype(F32)) != want
        xs = xs[flip]
        for i in range(0, len(xs), 15):
            chunk = [float(a) * rng.choice([-1.0, 1.0]) for a in xs[i : i + 15]]
            blocks.append([float(top)] + chunk + [0.0] * (15 - len(chunk)))
    while len(blocks) % 4:
        blocks.append(list(rng.uniform(-amax, amax, 16) * 0.5))
    return np.array(blocks, dtype=F32).reshape(-1, 64)


def check_adversarial(x):
    """The input must really hit the cases it is built for, not nearly."""
    ws2, gs = weight_global_scale(x)
    assert gs == F32(256), gs
    b = x.reshape(-1, 16)
    t = (gs * (np.max(np.abs(b), axis=1) * R6)).astype(F32)
    mids = set(e4m3_midpoints())
    e4m3_ties = sum(float(v) in mids for v in t)
    s = np.minimum(t, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn).astype(F32)
    v = np.abs(b * rcp(s * rcp(gs))[:, None])
    e2m1_ties = int(np.isin(v.ravel(), np.array(E2M1_TIES, dtype=F32)).sum())
    assert e4m3_ties >= 40 and e2m1_ties >= 80, (e4m3_ties, e2m1_ties)


def golden(outdir):
    import os

    os.makedirs(outdir, exist_ok=True)
    rng = np.random.default_rng(20240521)
    blocks = adversarial_blocks(rng)
    while len(blocks) % 4:
        blocks.append(list(rng.standard_normal(16) * 0.5))
    x = bf16(np.clip(np.array(blocks, dtype=np.float64), -10.5, 10.5)).reshape(-1, 64)
    assert np.max(np.abs(x)) == F32(10.5)
    check_adversarial(x)
    n = x.shape[0]
    # the same blocks, rows permuted and negated, as F32 and F16 tensors (other dtypes, other amax)
    x32 = (-x[::-1] * F32(0.375)).astype(F32)
    x16 = (x[rng.permutation(n)] * F32(0.125)).astype(np.float16)
    order = []
    for e, amax in enumerate((6.25, 8.5, 19.0, 7.3125, 10.25)):
        y = bf16(order_sensitive_blocks(amax, rng))
        sf, cf = order_flips(y, weight_global_scale(y)[1])
        assert sf + cf > 0, (amax, sf, cf)
        order.append((sf, cf))
        order_name = f"model.layers.1.mlp.experts.{e}.gate_proj.weight"
        order.append((order_name, "BF16", list(y.shape), y.astype(ml_dtypes.bfloat16).tobytes()))
    flips = [o for o in order if len(o) == 2]
    assert sum(a for a, _ in flips) >= 10 and sum(b for _, b in flips) >= 40, flips
    tensors = [t for t in order if len(t) == 4] + [
        ("model.layers.0.mlp.experts.0.gate_proj.weight", "BF16", [n, 64],
         x.astype(ml_dtypes.bfloat16).tobytes()),
        ("model.layers.0.mlp.experts.0.up_proj.weight", "F32", [n, 64], x32.tobytes()),
        ("model.layers.0.mlp.experts.0.down_proj.weight", "F16", [n, 64], x16.tobytes()),
        # not quantized: 1-D, K not a multiple of 16, 3-D, not *.weight, integer
        ("model.layers.0.post_attention_layernorm.weight", "BF16", [64],
         bf16(rng.standard_normal(64)).astype(ml_dtypes.bfloat16).tobytes()),
        ("model.layers.0.mlp.gate.e_score_correction_bias", "F32", [8],
         rng.standard_normal(8).astype(F32).tobytes()),
        ("model.layers.0.odd.weight", "BF16", [4, 24],
         bf16(rng.standard_normal(96)).astype(ml_dtypes.bfloat16).tobytes()),
        ("model.layers.0.cube.weight", "BF16", [2, 2, 32],
         bf16(rng.standard_normal(128)).astype(ml_dtypes.bfloat16).tobytes()),
        ("model.layers.0.mlp.gate.tid2eid", "I64", [4, 2],
         np.arange(8, dtype=np.int64).tobytes()),
        ("model.layers.0.table", "F32", [2, 32], rng.standard_normal(64).astype(F32).tobytes()),
    ]
    inp = os.path.join(outdir, "input.safetensors")
    write_safetensors(inp, tensors, {"format": "pt"})
    quantize_file(inp, os.path.join(outdir, "expected_nvfp4.safetensors"))
    quantize_file(inp, os.path.join(outdir, "expected_nvfp4_gs1024.safetensors"), gs=1024.0)
    quantize_file(inp, os.path.join(outdir, "expected_nvfp4_gs0.75.safetensors"), gs=0.75)
    quantize_file(inp, os.path.join(outdir, "expected_mxfp4.safetensors"), fmt="mxfp4")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("golden")
    g.add_argument("outdir")
    q = sub.add_parser("quantize")
    q.add_argument("input")
    q.add_argument("output")
    q.add_argument("--gs", type=float)
    q.add_argument("--format", choices=["nvfp4", "mxfp4"], default="nvfp4")
    a = ap.parse_args()
    if a.cmd == "golden":
        golden(a.outdir)
    else:
        quantize_file(a.input, a.output, gs=a.gs, fmt=a.format)
    return 0


if __name__ == "__main__":
    sys.exit(main())
