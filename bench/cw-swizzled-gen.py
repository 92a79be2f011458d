# A float side (BF16 values of a quantized weight, and one unrelated) and the quantized weight as
# an engine dumps it, its block scales in the 128x4 swizzle, at 1024x7168: compare-weights must
# pass the first pair and fail the second.  Usage: python3 bench/cw-swizzled-gen.py DIR [SEED]
# (needs /tmp/s49/nvfp4dbg or NVFP4DBG for the quantize step).
import json, os, struct, subprocess, sys

import ml_dtypes
import numpy as np


def load_file(p):
    b = open(p, "rb").read(); n = struct.unpack("<Q", b[:8])[0]; h = json.loads(b[8:8+n]); out = {}
    dt = {"U8": np.uint8, "F32": np.float32, "F8_E4M3": ml_dtypes.float8_e4m3fn, "BF16": ml_dtypes.bfloat16}
    for k, v in h.items():
        if k == "__metadata__": continue
        a, e = v["data_offsets"]; out[k] = np.frombuffer(b[8+n+a:8+n+e], dtype=dt[v["dtype"]]).reshape(v["shape"])
    return out
def save_file(d, p):
    hdr = {}; off = 0; blobs = []
    names = {np.dtype(np.uint8): "U8", np.dtype(np.float32): "F32", np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3", np.dtype(ml_dtypes.bfloat16): "BF16"}
    for k, a in d.items():
        a = np.ascontiguousarray(a); by = a.tobytes(); hdr[k] = {"dtype": names[a.dtype], "shape": list(a.shape), "data_offsets": [off, off + len(by)]}; off += len(by); blobs.append(by)
    h = json.dumps(hdr).encode(); h += b" " * ((8 - len(h) % 8) % 8)
    open(p, "wb").write(struct.pack("<Q", len(h)) + h + b"".join(blobs))

os.chdir(sys.argv[1])  # the folder to write into
rng = np.random.default_rng(int(sys.argv[2]) if len(sys.argv) > 2 else 49)
N, K = 1024, 7168
base = "model.layers.3.mlp.experts.5.down_proj"
w = (rng.standard_normal((N, K)) * 0.02).astype(ml_dtypes.bfloat16)
save_file({f"{base}.weight": w}, "w.safetensors")
subprocess.run([os.environ.get("NVFP4DBG", "nvfp4dbg"), "quantize", "w.safetensors", "q_lin.safetensors", "--no-report-dir", "-q"], check=True, stdout=subprocess.DEVNULL)
q = load_file("q_lin.safetensors")
for f in ("w.safetensors", "q_lin.safetensors"):
    os.remove(f)
codes = q[f"{base}.weight"]; sc = q[f"{base}.weight_scale"]; s2 = q[f"{base}.weight_scale_2"]
sc8 = sc.view(np.uint8).reshape(N, K // 16)
# swizzle per DESIGN §2 (N multiple of 128, K/16 multiple of 4 here)
kt = (K // 16) // 4
sw = np.zeros(N * (K // 16), dtype=np.uint8)
m = np.arange(N)[:, None]; k = np.arange(K // 16)[None, :]
off = (m // 128 * kt + k // 4) * 512 + (m % 32) * 16 + ((m // 32) % 4) * 4 + k % 4
sw[off.ravel()] = sc8.ravel()
q[f"{base}.weight_scale"] = sw.reshape(N, K // 16).view(ml_dtypes.float8_e4m3fn)
save_file(q, "q_swz.safetensors")
lut = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)
c = codes.view(np.uint8)
vals = np.empty((N, K), np.float32); vals[:, 0::2] = lut[c & 15]; vals[:, 1::2] = lut[c >> 4]
bs = np.repeat(sc8.view(ml_dtypes.float8_e4m3fn).astype(np.float32), 16, axis=1)
deq = (vals * bs) * np.float32(s2)
save_file({f"{base}.weight": deq.astype(ml_dtypes.bfloat16)}, "deq.safetensors")
other = (rng.standard_normal((N, K)) * 0.02).astype(ml_dtypes.bfloat16)
save_file({f"{base}.weight": other}, "other.safetensors")
