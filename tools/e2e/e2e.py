"""End-to-end demo material for nvfp4dbg on transformers' own DeepSeek-V3 implementation.
`run_e2e.sh` runs these stages and the nvfp4dbg commands between and after them.

    python e2e.py build W        # small DeepseekV3ForCausalLM, random weights, BF16 save_pretrained
                                 # -> W/hf; W/experts_bf16.safetensors (routed experts: gate|up
                                 #    concatenated per expert, down); the same with gate and up
                                 #    apart (experts_bf16_unfused); W/calib.json (activation amax
                                 #    per expert -> input_scale)
    nvfp4dbg quantize W/experts_bf16.safetensors W/experts_nvfp4.safetensors
    python e2e.py assemble W     # -> W/ckpt: ModelOpt NVFP4 checkpoint (routed experts NVFP4 with
                                 #    calibrated input_scale, the rest BF16, BF16 originals in bf16/)
    python e2e.py material W     # traces (BF16 x2, NaN in attention, NVFP4 experts, NVFP4 experts
                                 # with the default gs), engine dumps (clean, gate/up swapped),
                                 # routing dumps (clean, EP local ids), a layertest input and the
                                 # transformers MoE block's outputs on it
    python e2e.py crosscheck W layertest-outputs.safetensors   # nvfp4dbg vs transformers

Runs on CUDA when available (the GPU machine), else on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import types

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # tools/: nvfp4dbg_trace
import nvfp4_torch as nv  # noqa: E402
import nvfp4dbg_trace  # noqa: E402

SEED = 1234
BATCH, SEQ = 2, 32           # the evaluated batch: 64 tokens
CALIB_BATCH, CALIB_SEQ = 4, 64
NAN_LAYER = 1                # attention module that produces the NaN
NAN_BATCH, NAN_POS = 1, 9    # ... in this token of the batch
SWAP_LAYER, SWAP_EXPERT = 2, 5   # the expert loaded with gate/up swapped
ROUTING_LAYER = 2            # routing dump and layertest layer
EP_RANK, EP_SIZE = 1, 2


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def make_config():
    from transformers import DeepseekV3Config
    return DeepseekV3Config(
        vocab_size=2048, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
        num_hidden_layers=4, first_k_dense_replace=1,
        n_routed_experts=32, num_experts_per_tok=8, n_group=4, topk_group=2,
        n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        num_attention_heads=8, num_key_value_heads=8,
        q_lora_rank=128, kv_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32,
        max_position_embeddings=512, tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )


def tokens(seed: int, batch: int, seq: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g)


def load_model(w: str):
    from transformers import DeepseekV3ForCausalLM
    m = DeepseekV3ForCausalLM.from_pretrained(os.path.join(w, "hf"), dtype=torch.bfloat16)
    return m.to(device()).eval()


def moe_layers(model):
    return [i for i, l in enumerate(model.model.layers) if hasattr(l.mlp, "experts")]


def routed_expert_key(name: str) -> bool:
    return ".mlp.experts." in name and name.endswith(("gate_proj.weight", "up_proj.weight",
                                                       "down_proj.weight"))


# ---------------------------------------------------------------------------------------------
# experts forwards: calibration (BF16, records amax) and NVFP4 (fake-quant, checkpoint weights)

def _grouped_forward(experts, hidden, top_k_index, top_k_weights, up, down, acc_dtype):
    """transformers' default ``grouped_mm`` experts forward (integrations/moe.py) with the
    per-expert GEMMs replaced: rows sorted by expert, ``up(e, x) -> [n, 2I]``, the activation
    applied once to all rows through ``experts.act_fn`` (so traces hold the same module calls
    as transformers' own run), ``down(e, a) -> [n, H]``, then the routing weights and the
    sum over top-k in FP32."""
    k = top_k_index.size(-1)
    ids = top_k_index.reshape(-1)
    ids_g, perm = torch.sort(ids)
    x_g = hidden[perm // k]
    counts = torch.bincount(ids_g, minlength=experts.num_experts).tolist()
    bounds, start = [], 0
    for e, n in enumerate(counts):
        if n:
            bounds.append((e, start, start + n))
        start += n
    gu = torch.cat([up(e, x_g[s:t]) for e, s, t in bounds]).to(acc_dtype)
    gate, upv = gu.chunk(2, dim=-1)
    act = experts.act_fn(gate) * upv
    out = torch.cat([down(e, act[s:t]) for e, s, t in bounds]).to(acc_dtype)
    out = out * top_k_weights.reshape(-1)[perm].unsqueeze(-1).to(acc_dtype)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return out[inv].view(hidden.size(0), k, -1).float().sum(dim=1).to(hidden.dtype)


def install_calibration(model, amax: dict):
    """BF16 experts as transformers computes them, recording each expert's input amax (the
    gate/up input and the down input), as ModelOpt's calibration does."""
    lin = torch.nn.functional.linear
    for l in moe_layers(model):
        ex = model.model.layers[l].mlp.experts

        def fwd(self, hidden, top_k_index, top_k_weights, _l=l):
            def up(e, x):
                key = (_l, e, "w13")
                amax[key] = max(amax.get(key, 0.0), x.abs().max().float().item())
                return lin(x, self.gate_up_proj[e])

            def down(e, a):
                key = (_l, e, "w2")
                amax[key] = max(amax.get(key, 0.0), a.abs().max().float().item())
                return lin(a, self.down_proj[e])
            return _grouped_forward(self, hidden, top_k_index, top_k_weights, up, down, hidden.dtype)
        ex.forward = types.MethodType(fwd, ex)


def install_nvfp4(model, ckpt_dir: str, gs_mode: str = "checkpoint"):
    """Routed experts as an NVFP4 engine runs them (DESIGN.md sections 2 and 4): weights
    dequantized from the checkpoint's NVFP4 triples, activations quantized to NVFP4 before
    each GEMM with gs = 1/input_scale (``gs_mode="checkpoint"``) or the seed code's default
    input_scale 1/2688, i.e. gs 2688 (``"default"``), FP32 accumulation."""
    dev = device()
    f = safe_open(os.path.join(ckpt_dir, "model.safetensors"), "pt", device="cpu")

    def deq(b):
        return nv.dequant_weight(f.get_tensor(b + ".weight"), f.get_tensor(b + ".weight_scale"),
                                 f.get_tensor(b + ".weight_scale_2")).to(dev)

    def gs(b):
        return 1.0 / f.get_tensor(b + ".input_scale").item() if gs_mode == "checkpoint" else 2688.0

    for l in moe_layers(model):
        ex = model.model.layers[l].mlp.experts
        w13, w2, gs1, gs2 = {}, {}, {}, {}
        for e in range(ex.num_experts):
            b = f"model.layers.{l}.mlp.experts.{e}"
            w13[e] = torch.cat((deq(b + ".gate_proj"), deq(b + ".up_proj")))
            w2[e] = deq(b + ".down_proj")
            gs1[e], gs2[e] = gs(b + ".gate_proj"), gs(b + ".down_proj")

        def fwd(self, hidden, top_k_index, top_k_weights, w13=w13, w2=w2, gs1=gs1, gs2=gs2):
            return _grouped_forward(
                self, hidden, top_k_index, top_k_weights,
                lambda e, x: nv.fake_quant(x, gs1[e]) @ w13[e].T,
                lambda e, a: nv.fake_quant(a, gs2[e]) @ w2[e].T,
                torch.float32)
        ex.forward = types.MethodType(fwd, ex)


# ---------------------------------------------------------------------------------------------

def cmd_build(w: str) -> None:
    from transformers import DeepseekV3ForCausalLM
    os.makedirs(w, exist_ok=True)
    cfg = make_config()
    torch.manual_seed(SEED)
    model = DeepseekV3ForCausalLM(cfg).to(torch.bfloat16)
    g = torch.Generator().manual_seed(SEED)
    for l in moe_layers(model):  # F32 as in DeepSeek's checkpoints; trained routers have a bias
        gate = model.model.layers[l].mlp.gate
        gate.e_score_correction_bias = torch.randn(cfg.n_routed_experts, generator=g) * 0.02
    model.save_pretrained(os.path.join(w, "hf"))
    sd = load_file(os.path.join(w, "hf", "model.safetensors"))
    # gate and up side by side in one tensor, so that `quantize` gives them ONE weight_scale_2
    # (amax over both), as ModelOpt exports them: vLLM fuses them into w13 and keeps one global
    # scale for both; per-tensor scales would scale the up projection wrongly (audit flags it)
    experts = {}
    for k, v in sd.items():
        if k.endswith(".gate_proj.weight") and routed_expert_key(k):
            up = sd[k.replace(".gate_proj.", ".up_proj.")]
            experts[k.replace(".gate_proj.", ".gate_up_proj.")] = torch.cat((v, up)).contiguous()
        elif k.endswith(".down_proj.weight") and routed_expert_key(k):
            experts[k] = v
    save_file(experts, os.path.join(w, "experts_bf16.safetensors"))
    # the same weights gate and up apart: what a naive per-tensor quantization starts from
    save_file({k: v for k, v in sd.items() if routed_expert_key(k)},
              os.path.join(w, "experts_bf16_unfused.safetensors"))

    model = model.to(device()).eval()  # the weights just saved (reloading would give the same)
    amax: dict = {}
    install_calibration(model, amax)
    with torch.no_grad():
        model(tokens(SEED + 1, CALIB_BATCH, CALIB_SEQ, cfg.vocab_size).to(device()))
    calib = {f"{l}.{e}.{k}": v for (l, e, k), v in amax.items()}
    with open(os.path.join(w, "calib.json"), "w") as fh:
        json.dump(calib, fh, indent=1, sort_keys=True)
    n_exp = cfg.n_routed_experts * len(moe_layers(model))
    print(f"built DeepseekV3ForCausalLM: {cfg.num_hidden_layers} layers (first_k_dense_replace="
          f"{cfg.first_k_dense_replace}), hidden {cfg.hidden_size}, {cfg.n_routed_experts} routed "
          f"experts top-{cfg.num_experts_per_tok} (n_group {cfg.n_group}, topk_group "
          f"{cfg.topk_group}), moe_intermediate {cfg.moe_intermediate_size}; "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params on {device()}")
    print(f"routed expert weights: {len(experts)} tensors -> experts_bf16.safetensors; "
          f"calibrated {len(calib) // 2} of {n_exp} experts on {CALIB_BATCH * CALIB_SEQ} tokens")


def cmd_assemble(w: str) -> None:
    """ModelOpt-style NVFP4 checkpoint: the HF BF16 weights with the routed experts replaced by
    the NVFP4 triples `nvfp4dbg quantize` wrote, plus the calibrated input_scale (amax/2688)."""
    ck = os.path.join(w, "ckpt")
    shutil.rmtree(ck, ignore_errors=True)
    os.makedirs(os.path.join(ck, "bf16"))
    sd = load_file(os.path.join(w, "hf", "model.safetensors"))
    q = load_file(os.path.join(w, "experts_nvfp4.safetensors"))
    with open(os.path.join(w, "calib.json")) as fh:
        calib = json.load(fh)
    cfg = json.load(open(os.path.join(w, "hf", "config.json")))
    out = {k: v for k, v in sd.items() if not routed_expert_key(k)}
    for k, v in q.items():
        if ".gate_up_proj." not in k:
            out[k] = v
            continue
        if k.endswith("weight_scale_2"):  # shared by construction
            out[k.replace(".gate_up_proj.", ".gate_proj.")] = v.clone()
            out[k.replace(".gate_up_proj.", ".up_proj.")] = v.clone()
        else:  # NVFP4 blocks run along K inside a row: the row halves are gate and up exactly
            g, u = v.chunk(2, dim=0)
            out[k.replace(".gate_up_proj.", ".gate_proj.")] = g.contiguous()
            out[k.replace(".gate_up_proj.", ".up_proj.")] = u.contiguous()
    n_layers_moe = range(cfg["first_k_dense_replace"], cfg["num_hidden_layers"])
    for l in n_layers_moe:
        seen = [calib[f"{l}.{e}.w13"] for e in range(cfg["n_routed_experts"]) if f"{l}.{e}.w13" in calib]
        seen2 = [calib[f"{l}.{e}.w2"] for e in range(cfg["n_routed_experts"]) if f"{l}.{e}.w2" in calib]
        for e in range(cfg["n_routed_experts"]):
            # an expert no calibration token reached gets the layer's largest amax (no saturation)
            a1 = calib.get(f"{l}.{e}.w13", max(seen))
            a2 = calib.get(f"{l}.{e}.w2", max(seen2))
            for p, a in (("gate_proj", a1), ("up_proj", a1), ("down_proj", a2)):
                out[f"model.layers.{l}.mlp.experts.{e}.{p}.input_scale"] = \
                    torch.tensor(a / 2688.0, dtype=torch.float32)
    save_file(out, os.path.join(ck, "model.safetensors"), metadata={"format": "pt"})
    save_file({k: v for k, v in sd.items() if routed_expert_key(k)},
              os.path.join(ck, "bf16", "model.safetensors"), metadata={"format": "pt"})
    exclude = ["lm_head", "model.embed_tokens", "*self_attn*", "*mlp.gate", "*shared_experts*",
               "model.layers.0.mlp*"]
    cfg["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4",
                                  "group_size": 16, "kv_cache_quant_algo": None,
                                  "exclude_modules": exclude}
    with open(os.path.join(ck, "config.json"), "w") as fh:
        json.dump(cfg, fh, indent=2)
    with open(os.path.join(ck, "hf_quant_config.json"), "w") as fh:
        json.dump({"producer": {"name": "nvfp4dbg tools/e2e"},
                   "quantization": {"quant_algo": "NVFP4", "group_size": 16,
                                    "kv_cache_quant_algo": None, "exclude_modules": exclude}},
                  fh, indent=2)
    shutil.copy(os.path.join(w, "hf", "generation_config.json"), ck)
    nq = sum(1 for k in out if k.endswith(".weight_scale_2"))
    print(f"assembled {ck}: {nq} NVFP4 linears (+input_scale), {len(out) - 4 * nq} other tensors "
          f"(BF16), BF16 originals of the routed experts in bf16/")


def engine_dump(ckpt: str, path: str, swap=None) -> None:
    """What an engine's state dict holds after loading the checkpoint. Routed experts as vLLM's
    FusedMoE keeps them: w13 = concat(w1 gate, w3 up) per expert, w2, block scales in the 128x4
    swizzled layout (process_weights_after_loading), w13 global scales [E, 2]. ``swap=(layer, expert)`` loads that expert's gate into the up half and up
    into the gate half."""
    f = safe_open(os.path.join(ckpt, "model.safetensors"), "pt", device="cpu")
    cfg = json.load(open(os.path.join(ckpt, "config.json")))
    out = {}
    for l in range(cfg["first_k_dense_replace"], cfg["num_hidden_layers"]):
        pre = f"model.layers.{l}.mlp.experts"
        cols = {k: [] for k in ("w13_weight", "w13_weight_scale", "w13_weight_scale_2",
                                "w13_input_scale", "w2_weight", "w2_weight_scale",
                                "w2_weight_scale_2", "w2_input_scale")}
        for e in range(cfg["n_routed_experts"]):
            g = lambda p, t: f.get_tensor(f"{pre}.{e}.{p}.{t}")  # noqa: E731
            w1, w3 = "gate_proj", "up_proj"
            if swap == (l, e):
                w1, w3 = w3, w1
            cols["w13_weight"].append(torch.cat((g(w1, "weight"), g(w3, "weight"))))
            cols["w13_weight_scale"].append(nv.swizzle_128x4(
                torch.cat((g(w1, "weight_scale"), g(w3, "weight_scale")))))
            cols["w13_weight_scale_2"].append(torch.stack((g(w1, "weight_scale_2"), g(w3, "weight_scale_2"))))
            cols["w13_input_scale"].append(torch.stack((g(w1, "input_scale"), g(w3, "input_scale"))))
            cols["w2_weight"].append(g("down_proj", "weight"))
            cols["w2_weight_scale"].append(nv.swizzle_128x4(g("down_proj", "weight_scale")))
            cols["w2_weight_scale_2"].append(g("down_proj", "weight_scale_2"))
            cols["w2_input_scale"].append(g("down_proj", "input_scale"))
        for k, v in cols.items():
            out[f"{pre}.{k}"] = torch.stack(v).contiguous()
    # the rest as loaded, with vLLM's merged linears: gate_up_proj = [gate_proj; up_proj]
    # (dense MLPs, the shared expert) and fused_qkv_a_proj = [q_a_proj; kv_a_proj_with_mqa]
    merged = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
              "q_a_proj": ("fused_qkv_a_proj", 0), "kv_a_proj_with_mqa": ("fused_qkv_a_proj", 1)}
    parts = {}
    for k in f.keys():
        if ".mlp.experts." in k:
            continue
        mod, _, member = k.rpartition(".")
        head, _, last = mod.rpartition(".")
        if member == "weight" and last in merged:
            name, i = merged[last]
            parts.setdefault(f"{head}.{name}.weight", {})[i] = f.get_tensor(k)
        else:
            out[k] = f.get_tensor(k)
    for k, p in parts.items():
        out[k] = torch.cat((p[0], p[1])).contiguous()
    save_file(out, path, metadata={"producer": "vllm FusedMoE state_dict (simulated)"})


def restore_experts(model) -> None:
    """Back to transformers' own experts forward (drop the instance override)."""
    for l in moe_layers(model):
        model.model.layers[l].mlp.experts.__dict__.pop("forward", None)


def cmd_material(w: str) -> None:
    dev = device()
    cfg = make_config()
    ids = tokens(SEED + 2, BATCH, SEQ, cfg.vocab_size).to(dev)
    tr = os.path.join(w, "traces")
    shutil.rmtree(tr, ignore_errors=True)
    model = load_model(w)
    ck = os.path.join(w, "ckpt")

    def run(name, setup=None):
        handles = (setup(model) if setup else None) or []
        with torch.no_grad(), nvfp4dbg_trace.record(model, os.path.join(tr, name)) as rec:
            logits = model(ids).logits
        for h in handles:
            h.remove()
        restore_experts(model)
        bad = (~torch.isfinite(logits.float())).any(dim=-1).sum().item()
        print(f"trace {name}: {len(rec.files)} module calls recorded, logits {tuple(logits.shape)}, "
              f"{bad} of {logits.shape[0] * logits.shape[1]} tokens with non-finite logits")

    # 1. healthy BF16 runs (twice: the second is the "test" that must match), capturing the
    #    routing of layer ROUTING_LAYER and the input of its MoE block on the way
    captured = {}

    def capture(m):
        blk = m.model.layers[ROUTING_LAYER].mlp

        def pre(mod, args):  # input of the mlp = post_attention_layernorm output
            captured["mlp_in"] = args[0].detach().cpu()

        def gate(mod, args, out):
            logits, wts, idx = out
            captured["router_logits"], captured["topk_weights"], captured["topk_ids"] = (
                logits.detach().float().cpu(), wts.detach().float().cpu(), idx.detach().cpu())
            captured["gate_in"] = args[0].detach().cpu()
        return [blk.register_forward_pre_hook(pre), blk.gate.register_forward_hook(gate)]

    run("bf16", capture)
    run("bf16-rerun")

    # 2. a NaN produced inside one attention module (what an overflowing or uninitialized
    #    attention kernel leaves): one token's output row of model.layers.1.self_attn
    def nan_in_attention(m):
        def hook(mod, args, kwargs, out):
            out[0][NAN_BATCH, NAN_POS, :] = float("nan")
            return out
        return [m.model.layers[NAN_LAYER].self_attn.register_forward_hook(hook, with_kwargs=True)]
    run("nan-attn", nan_in_attention)

    # 3. routed experts in NVFP4 (checkpoint input_scale), and with the seed code's default gs
    run("nvfp4", lambda m: install_nvfp4(m, ck, "checkpoint"))
    run("nvfp4-default-gs", lambda m: install_nvfp4(m, ck, "default"))

    # 4. the PyTorch NVFP4 MoE block on the layertest input, to cross-check nvfp4dbg's kernels
    t = BATCH * SEQ
    x = captured["mlp_in"]
    blk = model.model.layers[ROUTING_LAYER].mlp
    with torch.no_grad():
        ref_bf16 = blk(x.to(dev)).float().reshape(t, -1).cpu()
        install_nvfp4(model, ck, "checkpoint")
        ref_nvfp4 = blk(x.to(dev)).float().reshape(t, -1).cpu()
        restore_experts(model)
    save_file({"torch_bf16_out": ref_bf16.contiguous(), "torch_nvfp4_out": ref_nvfp4.contiguous()},
              os.path.join(w, f"layer{ROUTING_LAYER}-torch-out.safetensors"))
    save_file({"hidden_states": x.reshape(t, -1).contiguous(),
               "input_ids": ids.reshape(-1).cpu().contiguous()},
              os.path.join(w, f"layer{ROUTING_LAYER}-mlp-input.safetensors"))
    print(f"layertest input: layer {ROUTING_LAYER} MoE block input (post_attention_layernorm "
          f"output), {tuple(x.reshape(t, -1).shape)} {x.dtype}, amax {x.abs().max().item():.3f}")

    # 5. engine weight dumps: vLLM FusedMoE expert tensors (+ the other tensors as loaded)
    dumps = os.path.join(w, "dumps")
    os.makedirs(dumps, exist_ok=True)
    engine_dump(ck, os.path.join(dumps, "engine-clean.safetensors"))
    engine_dump(ck, os.path.join(dumps, "engine-swapped.safetensors"), swap=(SWAP_LAYER, SWAP_EXPERT))
    print(f"engine dumps: clean, and layer {SWAP_LAYER} expert {SWAP_EXPERT} loaded with gate/up swapped")

    # 6. routing dumps of layer ROUTING_LAYER on EP rank 1 of 2 (experts [16, 32))
    meta = {"layer": str(ROUTING_LAYER), "ep_rank": str(EP_RANK), "ep_size": str(EP_SIZE)}
    base = {"topk_weights": captured["topk_weights"].contiguous(),
            "hidden_states": captured["gate_in"].reshape(t, -1).contiguous(),
            "router_logits": captured["router_logits"].contiguous()}
    gid = captured["topk_ids"].to(torch.int64)
    save_file({**base, "topk_ids": gid.contiguous()}, os.path.join(dumps, "routing-clean.safetensors"),
              metadata=meta)
    # the bug: rank 1 subtracts its first expert id (its expert_map offset) from the router's
    # global ids and hands the result to code that expects global ids
    n_local = cfg.n_routed_experts // EP_SIZE
    save_file({**base, "topk_ids": (gid - EP_RANK * n_local).contiguous()},
              os.path.join(dumps, "routing-ep-local.safetensors"), metadata=meta)
    print(f"routing dumps of layer {ROUTING_LAYER}: {t} tokens x top-{gid.shape[1]}, EP rank "
          f"{EP_RANK} of {EP_SIZE}: clean (global ids) and local ids (global - {EP_RANK * n_local})")


def cmd_crosscheck(w: str, saved: str) -> None:
    """nvfp4dbg layertest --save-outputs vs the PyTorch MoE block on the same input: the NVFP4
    paths (Rust/CUDA kernels vs nvfp4_torch in transformers' block) and the references
    (nvfp4dbg's BF16-weight reference vs transformers' BF16 block) must agree."""
    mine = load_file(os.path.join(w, f"layer{ROUTING_LAYER}-torch-out.safetensors"))
    theirs = load_file(saved)

    def cos(a, b):
        a, b = a.double().flatten(), b.double().flatten()
        return (a @ b / (a.norm() * b.norm())).item(), ((a - b).norm() / b.norm()).item()
    ok = True
    for mk, tk, floor in (("torch_nvfp4_out", "nvfp4_out", 0.9999),
                          ("torch_bf16_out", "reference_out", 0.9999),
                          ("torch_nvfp4_out", "reference_out", None)):
        c, r = cos(theirs[tk], mine[mk])
        verdict = "" if floor is None else (" ok" if c >= floor else f" BELOW {floor}")
        ok &= floor is None or c >= floor
        print(f"nvfp4dbg {tk:<13} vs transformers {mk:<15}: cosine {c:.6f}, rel_l2 {r:.3e}{verdict}")
    sys.exit(0 if ok else 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=["build", "assemble", "material", "crosscheck"])
    ap.add_argument("workdir")
    ap.add_argument("saved", nargs="?", help="crosscheck: the file of layertest --save-outputs")
    a = ap.parse_args()
    if a.stage == "crosscheck":
        cmd_crosscheck(a.workdir, a.saved)
    else:
        {"build": cmd_build, "assemble": cmd_assemble, "material": cmd_material}[a.stage](a.workdir)


if __name__ == "__main__":
    main()
