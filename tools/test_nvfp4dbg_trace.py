"""Tests of the trace recorder, and round trips through the nvfp4dbg binary.

Run with ``pytest tools/test_nvfp4dbg_trace.py`` or ``python tools/test_nvfp4dbg_trace.py``.
Needs torch and safetensors (the GPU nightly has them; CPU torch is enough). The round trips
need the binary: ``$NVFP4DBG_BIN``, else ``target/{release,debug}/nvfp4dbg``, else it is built
with cargo; a missing binary fails the test instead of skipping it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile

import torch
from safetensors import safe_open

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import nvfp4dbg_trace  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAME = re.compile(r"^(\d{6})-(.+)\.safetensors$")
SEED = int(os.environ.get("NVFP4DBG_TEST_SEED", random.randrange(2**31)))
print(f"test_nvfp4dbg_trace: seed {SEED} (NVFP4DBG_TEST_SEED to repeat)")


# ---- a tiny model with the shapes of a transformer --------------------------------------------

class Attn(torch.nn.Module):
    def __init__(self, h):
        super().__init__()
        self.q, self.k, self.v, self.o = (torch.nn.Linear(h, h) for _ in range(4))

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        s = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
        mask = torch.full_like(s, float("-inf")).triu(1)
        return self.o(torch.softmax(s + mask, dim=-1) @ v)


class Mlp(torch.nn.Module):
    def __init__(self, h):
        super().__init__()
        self.up = torch.nn.Linear(h, 2 * h)
        self.act = torch.nn.SiLU()
        self.down = torch.nn.Linear(2 * h, h)

    def forward(self, x):
        return self.down(self.act(self.up(x)))


class InPlaceNorm(torch.nn.Module):
    """Normalizes and, like vLLM's fused add-RMSNorm, overwrites its input."""

    def forward(self, x):
        y = x / (x.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
        x.mul_(0.0)
        return y


class Block(torch.nn.Module):
    def __init__(self, h):
        super().__init__()
        self.norm = InPlaceNorm()
        self.attn = Attn(h)
        self.mlp = Mlp(h)

    def forward(self, x, scale: float = 1.0):
        x = x + self.attn(self.norm(x.clone()))
        x = x + self.mlp(x) * scale
        return x, {"aux": x.mean(-1), "note": "not a tensor"}


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    hidden: torch.Tensor
    tag: str = "x"


class Tiny(torch.nn.Module):
    def __init__(self, vocab=50, h=16, layers=2):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, h)
        self.blocks = torch.nn.ModuleList(Block(h) for _ in range(layers))
        self.head = torch.nn.Linear(h, vocab)

    def forward(self, ids):
        x = self.embed(ids)
        for b in self.blocks:
            x, _ = b(x, scale=0.5)
        return Out(self.head(x), x)


def tiny():
    torch.manual_seed(SEED)
    m = Tiny().eval()
    ids = torch.randint(0, 50, (7,))
    return m, ids


def load(path):
    with safe_open(path, "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {}


def files(d):
    return sorted(n for n in os.listdir(d) if NAME.match(n))


# ---- recorder ----------------------------------------------------------------------------------

def test_record_writes_one_file_per_call_in_completion_order():
    m, ids = tiny()
    seen = {}
    handles = [mod.register_forward_hook(lambda mod, a, o, n=name: seen.setdefault(n, o))
               for name, mod in m.named_modules() if name]
    with tempfile.TemporaryDirectory() as d:
        with nvfp4dbg_trace.record(m, d, rank=3, step=5) as rec:
            with torch.no_grad():
                m(ids)
        for h in handles:
            h.remove()
        names = files(d)
        assert not [n for n in os.listdir(d) if n not in names], os.listdir(d)  # no temp files
        counters = [int(NAME.match(n).group(1)) for n in names]
        assert counters == list(range(len(names))), names
        order = {NAME.match(n).group(2): i for i, n in enumerate(names)}
        # every module with tensor output, no root by default
        assert set(order) == set(seen), (set(order) ^ set(seen))
        assert "__root__" not in order
        # children complete before parents
        assert order["blocks.0.attn.q"] < order["blocks.0.attn"] < order["blocks.0"] < order["blocks.1.norm"]
        assert order["blocks.1.mlp.down"] < order["blocks.1.mlp"] < order["blocks.1"] < order["head"]
        t, meta = load(os.path.join(d, names[order["blocks.0.attn.q"]]))
        assert torch.equal(t["output"], seen["blocks.0.attn.q"]), "output differs"
        assert t["output"].shape == (7, 16)
        assert meta["rank"] == "3" and meta["step"] == "5" and meta["module"] == "blocks.0.attn.q"
        assert "input.0" in t and t["input.0"].shape == (7, 16)
        # tuple + dict output: output, output.1; the string is skipped; kwargs `scale` is a float
        t, meta = load(os.path.join(d, names[order["blocks.1"]]))
        assert set(t) == {"output", "output.1", "input.0"}, set(t)
        assert torch.equal(t["output.1"], seen["blocks.1"][1]["aux"])
        assert meta["input_names"] == "args.0"
        # embedding ids are recorded as int64
        t, _ = load(os.path.join(d, names[order["embed"]]))
        assert t["input.0"].dtype == torch.int64 and torch.equal(t["input.0"], ids)
        assert len(rec.files) == len(names)


def test_inputs_are_copied_before_an_in_place_kernel_overwrites_them():
    m, ids = tiny()
    with tempfile.TemporaryDirectory() as d:
        with nvfp4dbg_trace.record(m, d, modules=r"^blocks\.0\.norm$"), torch.no_grad():
            m(ids)
        (name,) = files(d)
        t, _ = load(os.path.join(d, name))
        assert t["input.0"].abs().max() > 0, "input recorded after the in-place overwrite"
        x = t["input.0"]
        want = x / (x.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
        assert torch.allclose(t["output"], want, rtol=1e-5, atol=1e-6)


def test_module_filter_root_and_dataclass_outputs():
    m, ids = tiny()
    with tempfile.TemporaryDirectory() as d:
        with nvfp4dbg_trace.record(m, d, modules=r"mlp\.(up|down)$", inputs=False), torch.no_grad():
            m(ids)
        mods = [NAME.match(n).group(2) for n in files(d)]
        assert mods == ["blocks.0.mlp.up", "blocks.0.mlp.down", "blocks.1.mlp.up", "blocks.1.mlp.down"], mods
        t, meta = load(os.path.join(d, files(d)[0]))
        assert set(t) == {"output"} and "rank" not in meta and "step" not in meta
    with tempfile.TemporaryDirectory() as d:
        with nvfp4dbg_trace.record(m, d, modules=lambda n, mod: n == "__root__", root=True), torch.no_grad():
            out = m(ids)
        (name,) = files(d)
        assert name == "000000-__root__.safetensors"
        t, _ = load(os.path.join(d, name))
        assert torch.equal(t["output"], out.logits) and torch.equal(t["output.1"], out.hidden)


def test_counter_continues_across_records_and_install_uninstall():
    m, ids = tiny()
    with tempfile.TemporaryDirectory() as d:
        for step in range(2):
            with nvfp4dbg_trace.record(m, d, modules=r"^head$", step=step), torch.no_grad():
                m(ids)
        nvfp4dbg_trace.install(m, os.path.join(d, "rank{rank}"), modules=r"^head$", rank=2)
        with torch.no_grad():
            m(ids)
        nvfp4dbg_trace.uninstall(m)
        with torch.no_grad():
            m(ids)  # not recorded
        assert files(d) == ["000000-head.safetensors", "000001-head.safetensors"]
        assert load(os.path.join(d, "000001-head.safetensors"))[1]["step"] == "1"
        assert files(os.path.join(d, "rank2")) == ["000000-head.safetensors"]
        assert not hasattr(m, "_nvfp4dbg_recorder")


# ---- round trips through the binary ------------------------------------------------------------

def nvfp4dbg_bin():
    env = os.environ.get("NVFP4DBG_BIN")
    if env:
        return env
    for profile in ("release", "debug"):
        p = os.path.join(REPO, "target", profile, "nvfp4dbg")
        if os.path.exists(p):
            return p
    cargo = shutil.which("cargo")
    assert cargo, "no nvfp4dbg binary: set NVFP4DBG_BIN or build it (cargo build)"
    subprocess.run([cargo, "build", "--quiet"], cwd=REPO, check=True)
    return os.path.join(REPO, "target", "debug", "nvfp4dbg")


def run(*args):
    with tempfile.TemporaryDirectory() as d:
        j = os.path.join(d, "r.json")
        p = subprocess.run([nvfp4dbg_bin(), *args, "--json", j, "--no-report-dir", "--quiet"],
                           capture_output=True, text=True)
        report = json.load(open(j)) if os.path.exists(j) else None
    return p.returncode, report, p.stdout + p.stderr


def test_nan_locate_finds_a_nan_planted_in_one_module():
    m, ids = tiny()
    rng = random.Random(SEED)
    target = rng.choice(["blocks.1.attn.v", "blocks.0.mlp.act", "blocks.1.attn", "head"])
    token, channel = rng.randrange(7), rng.randrange(16)

    def plant(mod, args, out):
        out = out.clone()
        out[token, channel] = float("nan")
        return out

    # registered before the recorder: its hook sees the planted value
    h = dict(m.named_modules())[target].register_forward_hook(plant)
    with tempfile.TemporaryDirectory() as d:
        with nvfp4dbg_trace.record(m, d), torch.no_grad():
            m(ids)
        h.remove()
        code, rep, text = run("nan-locate", d)
        assert code == 1, text
        f = rep["first_nonfinite"]
        assert f["module"] == target, (target, text)
        assert f["tensor"] == "output" and f["kind"] == "nan"
        assert f["inputs_clean"] is True, text
        assert (f["index"]["token"], f["index"]["channel"]) == (token, channel), text
        assert rep["last_clean"] is not None


def test_nan_locate_passes_and_bisect_names_a_perturbed_module():
    m, ids = tiny()
    with tempfile.TemporaryDirectory() as d:
        ref, test = os.path.join(d, "ref"), os.path.join(d, "test")
        with nvfp4dbg_trace.record(m, ref), torch.no_grad():
            m(ids)
        code, rep, text = run("nan-locate", ref)
        assert code == 0 and rep["first_nonfinite"] is None, text
        h = m.blocks[0].mlp.down.register_forward_hook(
            lambda mod, a, out: out + 0.5 * out.std() * torch.randn_like(out))
        with nvfp4dbg_trace.record(m, test), torch.no_grad():
            m(ids)
        h.remove()
        code, rep, text = run("bisect", ref, test)
        assert code == 1, text
        assert rep["first_divergence"]["module"] == "blocks.0.mlp.down", text
        assert rep["first_divergence"]["inputs_diverged"] is False, text
        code, rep, text = run("bisect", ref, ref)
        assert code == 0, text


def test_transformers_llama_bf16_against_f32_and_a_nan_in_attention():
    """A real model calls its modules with keyword arguments and returns tuples and ModelOutputs.
    Skipped (said so) where transformers is not installed."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        print("skipped: transformers not installed")
        return
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(SEED)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    m32 = LlamaForCausalLM(cfg).to(dev).eval()
    m16 = LlamaForCausalLM(cfg).to(dev).eval()
    m16.load_state_dict(m32.state_dict())
    m16 = m16.to(torch.bfloat16)
    ids = torch.randint(0, 128, (1, 12), device=dev)
    with tempfile.TemporaryDirectory() as d:
        a, b, n = (os.path.join(d, x) for x in ("f32", "bf16", "nan"))
        with nvfp4dbg_trace.record(m32, a), torch.no_grad():
            m32(ids)
        with nvfp4dbg_trace.record(m16, b), torch.no_grad():
            m16(ids)
        _, meta = load(os.path.join(a, [f for f in files(a) if f.endswith("layers.0.self_attn.safetensors")][0]))
        assert meta["input_names"].startswith("kwargs.hidden_states"), meta
        code, rep, text = run("bisect", a, b)  # BF16 rounding stays far above 0.99
        assert code == 0, text
        attn = m16.model.layers[1].self_attn
        h = attn.register_forward_hook(
            lambda mod, args, out: (out[0].index_fill(1, torch.tensor([5], device=dev), float("nan")),) + tuple(out[1:]))
        with nvfp4dbg_trace.record(m16, n), torch.no_grad():
            m16(ids)
        h.remove()
        code, rep, text = run("nan-locate", n)
        assert code == 1, text
        f = rep["first_nonfinite"]
        assert f["module"] == "model.layers.1.self_attn" and f["inputs_clean"] is True, text
        assert f["index"]["multi"] == [0, 5, 0], text  # [batch, seq, hidden]: seq position 5


if __name__ == "__main__":
    tests = [v for k, v in sorted(globals().items()) if k.startswith("test_") and callable(v)]
    for t in tests:
        t()
        print(f"ok {t.__name__}")
    print(f"{len(tests)} passed")
