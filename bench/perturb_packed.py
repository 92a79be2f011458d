#!/usr/bin/env python3
"""Bench material for the compare-weights "differs in every tensor" round
(bench/cpu-compare-weights.md): copy a safetensors file and flip the lowest code bit of one
packed FP4 byte in every 16 of each U8 tensor, so every unit's codes differ from A's and the
whole tensor is dequantized and reduced (no bitwise fast path).

    python3 bench/perturb_packed.py engine.safetensors engine-differs.safetensors
"""

import json
import shutil
import struct
import sys

import numpy as np

src, dst = sys.argv[1], sys.argv[2]
shutil.copyfile(src, dst)
with open(dst, "rb") as f:
    n = struct.unpack("<Q", f.read(8))[0]
    header = json.loads(f.read(n))
header.pop("__metadata__", None)
mm = np.memmap(dst, dtype=np.uint8, mode="r+")
for name, t in header.items():
    if t["dtype"] == "U8":
        a, b = t["data_offsets"]
        mm[8 + n + a : 8 + n + b : 16] ^= 1
mm.flush()
