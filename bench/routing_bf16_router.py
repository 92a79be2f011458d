"""Material for checking `nvfp4dbg routing` against an engine router that rounds to BF16.

Writes DIR/ck (a DeepSeek-V3-dims config, one MoE layer's gate and e_score_correction_bias,
one stub expert so the checkpoint reads as MoE) and DIR/dump.safetensors: 512 tokens routed as
vLLM's grouped_topk does with a BF16 gate (BF16 logits, sigmoid in BF16, + FP32 bias,
group-limited noaux_tc top-8), and DIR/dump-bad.safetensors: the same with one slot of one
token sent to an expert outside its set. Prints how many tokens' expert sets differ from an
FP32 router (8-10% at these dims).

    python3 bench/routing_bf16_router.py DIR SEED
    nvfp4dbg routing DIR/dump.safetensors --checkpoint DIR/ck --layer 3      # pass
    nvfp4dbg routing DIR/dump-bad.safetensors --checkpoint DIR/ck --layer 3  # clear_mismatch
"""
import json, os, struct, sys
import numpy as np

out, seed = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 0
rng = np.random.default_rng(seed)
H, I, E, K, T, G, TG, RSF = 7168, 2048, 256, 8, 512, 8, 4, 2.5


def bf16(x):
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def f32(u):
    return (u.astype(np.uint32) << 16).view(np.float32)


def write(path, tensors, meta=None):
    hdr, off, blobs = {}, 0, []
    for name, (dtype, shape, data) in tensors.items():
        b = data.tobytes()
        hdr[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + len(b)]}
        off += len(b)
        blobs.append(b)
    if meta:
        hdr["__metadata__"] = meta
    h = json.dumps(hdr).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        for b in blobs:
            f.write(b)


def route(sel, scores):
    gs = np.sort(sel.reshape(T, G, -1), axis=-1)[:, :, -2:].sum(-1)
    keep = np.zeros((T, G), bool)
    np.put_along_axis(keep, np.argsort(-gs, -1, kind="stable")[:, :TG], True, 1)
    ids = np.argsort(-np.where(np.repeat(keep, E // G, 1), sel, -np.inf), -1, kind="stable")[:, :K]
    w = np.take_along_axis(scores, ids, 1)
    return ids, w / (w.sum(1, keepdims=True) + 1e-20) * RSF


ck = os.path.join(out, "ck")
os.makedirs(ck, exist_ok=True)
W = bf16(rng.normal(0, 0.01, (E, H)))
bias = rng.normal(0, 0.02, E).astype(np.float32)
cfg = dict(model_type="deepseek_v3", hidden_size=H, moe_intermediate_size=I, intermediate_size=18432,
           n_routed_experts=E, num_experts_per_tok=K, n_group=G, topk_group=TG,
           routed_scaling_factor=RSF, scoring_func="sigmoid", norm_topk_prob=True,
           topk_method="noaux_tc", first_k_dense_replace=3, num_hidden_layers=4,
           n_shared_experts=1, rms_norm_eps=1e-6)
json.dump(cfg, open(os.path.join(ck, "config.json"), "w"))
gate = {"model.layers.3.mlp.gate.weight": ("BF16", (E, H), W),
        "model.layers.3.mlp.gate.e_score_correction_bias": ("F32", (E,), bias)}
stub = {f"model.layers.3.mlp.experts.0.{p}.weight": ("BF16", s, np.zeros(s, np.uint16))
        for p, s in [("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))]}
write(os.path.join(ck, "model.safetensors"), {**gate, **stub})

h = bf16(rng.normal(0, 1, (T, H)))
logits = f32(h) @ f32(W).T
scores = f32(bf16(1 / (1 + np.exp(-f32(bf16(logits))))))
ids, w = route(scores + bias, scores)
s32 = 1 / (1 + np.exp(-logits))
ids32, _ = route(s32 + bias, s32)
meta = {"layer": "3"}
dump = lambda p, ids: write(os.path.join(out, p), {
    "topk_ids": ("I64", (T, K), ids.astype(np.int64)),
    "topk_weights": ("F32", (T, K), w.astype(np.float32)),
    "hidden_states": ("BF16", (T, H), h)}, meta)
dump("dump.safetensors", ids)
bad = ids.copy()
t = int(rng.integers(T))
bad[t, 3] = rng.choice([e for e in range(E) if e not in ids[t]])
dump("dump-bad.safetensors", bad)
print(f"{sum(set(a) != set(b) for a, b in zip(ids, ids32))} of {T} tokens' expert sets differ "
      f"from an FP32 router; dump-bad: token {t} slot 3 -> expert {bad[t, 3]}")
