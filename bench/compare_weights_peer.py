#!/usr/bin/env python3
"""The peer of `nvfp4dbg compare-weights` for bench/cpu-compare-weights.md: what an engineer
would write with safetensors + numpy to check that an engine's state dict (vLLM fused
`w13_weight` / `w2_weight`, scales possibly 128x4-swizzled) holds the bytes of a ModelOpt NVFP4
checkpoint (HF per-expert names). Same pairing and the same per-tensor checks on the fast path:
packed codes and block scales bitwise (the swizzled reading tried when the size is ambiguous),
weight_scale_2 and input_scale by value; where bytes differ, cosine after dequantization.

    python3 bench/compare_weights_peer.py CKPT_DIR ENGINE.safetensors

Tensors are memory-mapped (np.memmap) like the Rust tool; safetensors reads the scalars and
lists the keys. Prints a JSON summary; exit 1 on any mismatch.
"""

import glob
import json
import os
import re
import struct
import sys

import numpy as np
from safetensors import safe_open

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def files_of(path):
    if os.path.isdir(path):
        return sorted(glob.glob(os.path.join(path, "*.safetensors")))
    return [path]


class Side:
    """Every tensor of a file set: name -> (file, dtype, shape, begin, end)."""

    def __init__(self, path):
        self.tensors = {}
        self.maps = {}
        for f in files_of(path):
            with open(f, "rb") as fh:
                n = struct.unpack("<Q", fh.read(8))[0]
                header = json.loads(fh.read(n))
            header.pop("__metadata__", None)
            self.maps[f] = (np.memmap(f, dtype=np.uint8, mode="r"), 8 + n)
            with safe_open(f, framework="numpy") as st:
                keys = set(st.keys())
            for k, v in header.items():
                assert k in keys
                self.tensors[k] = (f, v["dtype"], v["shape"], *v["data_offsets"])

    def raw(self, name):
        f, _, shape, a, b = self.tensors[name]
        mm, start = self.maps[f]
        return mm[start + a:start + b]

    def f32(self, name):
        f, dtype, _, _, _ = self.tensors[name]
        assert dtype == "F32", (name, dtype)
        return self.raw(name).view(np.float32)


def e4m3(codes):
    import ml_dtypes

    return codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)


def unswizzle(sw, rows, kb):
    """128x4 swizzle → linear [rows, kb] (rows % 128 == 0 and kb % 4 == 0 here)."""
    t = sw.reshape(rows // 128, kb // 4, 32, 4, 4)  # [m/128, k/4, m%32, (m/32)%4, k%4]
    return t.transpose(0, 3, 2, 1, 4).reshape(rows, kb)


def dequant(packed, scales, scale_2):
    lo, hi = packed & 0xF, packed >> 4
    q = np.stack([E2M1[lo], E2M1[hi]], axis=-1).reshape(packed.shape[0], -1)
    s = np.repeat(e4m3(scales), 16, axis=1)
    return (q * s) * np.float32(scale_2)


def cosine(a, b):
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-300))


HF = re.compile(r"^(.*layers\.(\d+)\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def main():
    a, b = Side(sys.argv[1]), Side(sys.argv[2])
    units = equal = close = 0
    mismatches, missing = [], []
    for name in sorted(a.tensors):
        m = HF.match(name)
        if not m:
            continue
        base, layer, e, proj = m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)
        stem = name[: -len(".weight")]
        w13 = proj != "down_proj"
        fw = f"{base}.{'w13' if w13 else 'w2'}_weight"
        if fw not in b.tensors:
            missing.append(name)
            continue
        units += 1
        _, _, (E, R, C), _, _ = b.tensors[fw]
        rows = R // 2 if w13 else R
        r0 = rows if proj == "up_proj" else 0
        bw = b.raw(fw).reshape(E, R, C)[e, r0:r0 + rows]
        aw = a.raw(name).reshape(rows, C)
        kb = C * 2 // 16
        asc = a.raw(stem + ".weight_scale").reshape(rows, kb)
        bsc_all = b.raw(f"{base}.{'w13' if w13 else 'w2'}_weight_scale").reshape(E, -1)[e]
        if bsc_all.size == R * kb:
            bsc = bsc_all.reshape(R, kb)[r0:r0 + rows]
            same_sc = np.array_equal(asc, bsc)
            if not same_sc and R % 128 == 0 and kb % 4 == 0:
                bsc = unswizzle(bsc_all, R, kb)[r0:r0 + rows]
                same_sc = np.array_equal(asc, bsc)
        else:
            pr, pk = -(-R // 128) * 128, -(-kb // 4) * 4
            full = np.zeros(pr * pk, np.uint8)
            full[: bsc_all.size] = bsc_all
            bsc = unswizzle(full, pr, pk)[r0:r0 + rows, :kb]
            same_sc = np.array_equal(asc, bsc)
        a2 = float(a.f32(stem + ".weight_scale_2")[0])
        s2 = b.f32(f"{base}.{'w13' if w13 else 'w2'}_weight_scale_2").reshape(E, -1)[e]
        b2 = float(s2[1] if (proj == "up_proj" and s2.size == 2) else s2[0])
        ai = float(a.f32(stem + ".input_scale")[0])
        si = b.f32(f"{base}.{'w13' if w13 else 'w2'}_input_scale").reshape(E, -1)[e]
        bi = float(si[1] if (proj == "up_proj" and si.size == 2) else si[0])
        same_w = np.array_equal(aw, bw)
        if same_w and same_sc and a2 == b2 and ai == bi:
            equal += 1
            continue
        c = cosine(dequant(bw, bsc, b2), dequant(aw, asc, a2))
        if c >= 0.9999 and ai == bi and abs(a2 - b2) <= 1e-6 * abs(a2):
            close += 1
        else:
            mismatches.append({"name": name, "cosine": c, "scale_2": [a2, b2], "input_scale": [ai, bi]})
    out = {
        "units": units,
        "equal": equal,
        "close": close,
        "mismatched": len(mismatches),
        "missing": len(missing),
        "mismatches": mismatches[:20],
    }
    print(json.dumps(out, indent=1))
    sys.exit(1 if mismatches or missing else 0)


if __name__ == "__main__":
    main()
