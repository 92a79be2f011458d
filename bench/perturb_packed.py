#!/usr/bin/env python3
"""Bench material for the compare-weights "differs in every tensor" round
(bench/cpu-compare-weights.md): copy a safetensors file and flip the lowest code bit of one
packed FP4 byte in every 16 of each U8 tensor, so every unit's codes differ from A's and the
whole tensor is dequantized and reduced (no bitwise fast path).

    python3 bench/perturb_packed.py engine.safetensors engine-differs.safetensors

With `--scale-2 F`, every F32 `*weight_scale_2` is also multiplied by F (f32), as a
re-quantization with another global scale would have it: the two sides' global scales then
differ, which is the comparison's general (f64) body rather than its same-scale one.

    python3 bench/perturb_packed.py engine.safetensors engine-rescaled.safetensors --scale-2 1.0009765625

With `--scale-codes P`, a fraction P of the F8_E4M3 block scales (seeded, never made NaN) also
move one code, as the blocks near a rounding boundary do under a re-quantization with another
global scale: their groups of blocks then take the f64 body.

    python3 bench/perturb_packed.py engine.safetensors engine-requant.safetensors --scale-2 1.0009765625 --scale-codes 0.016
"""

import json
import shutil
import struct
import sys

import numpy as np

args = sys.argv[1:]
factor = None
if "--scale-2" in args:
    i = args.index("--scale-2")
    factor = np.float32(args[i + 1])
    del args[i : i + 2]
codes = None
if "--scale-codes" in args:
    i = args.index("--scale-codes")
    codes = float(args[i + 1])
    del args[i : i + 2]
rng = np.random.default_rng(0)
src, dst = args
shutil.copyfile(src, dst)
with open(dst, "rb") as f:
    n = struct.unpack("<Q", f.read(8))[0]
    header = json.loads(f.read(n))
header.pop("__metadata__", None)
mm = np.memmap(dst, dtype=np.uint8, mode="r+")
for name, t in header.items():
    a, b = t["data_offsets"]
    if t["dtype"] == "U8":
        mm[8 + n + a : 8 + n + b : 16] ^= 1
    elif factor is not None and t["dtype"] == "F32" and name.endswith("weight_scale_2"):
        mm[8 + n + a : 8 + n + b].view(np.float32)[:] *= factor
    elif codes is not None and t["dtype"] == "F8_E4M3":
        s = mm[8 + n + a : 8 + n + b]
        pick = (rng.random(s.shape[0]) < codes) & ((s & 0x7F) < 0x7E)
        s[pick] ^= 1
mm.flush()
