"""Record a trace of any PyTorch model for ``nvfp4dbg nan-locate`` and ``nvfp4dbg bisect``.

A trace is a directory with one safetensors file per module call, named
``NNNNNN-<module.path>.safetensors`` (execution counter, then the module's name in the model),
holding ``output`` (``output.1``, ... for tuple/list/dict/dataclass outputs) and ``input.0``,
``input.1``, ... (positional then keyword tensor arguments), first dim = tokens, with
``__metadata__`` ``rank`` and ``step`` when known (nvfp4dbg DESIGN.md section 5).

    import nvfp4dbg_trace
    with nvfp4dbg_trace.record(model, "trace/"):
        model(input_ids)
    # $ nvfp4dbg nan-locate trace/
    # $ nvfp4dbg bisect trace-bf16/ trace-nvfp4/

Only ``torch`` and ``safetensors`` are needed: copy this file next to your script or put
``tools/`` on ``PYTHONPATH``.

Order. Forward hooks fire when a module's forward *returns*, so children are numbered before
their parents (``...self_attn.q_proj`` < ``...self_attn`` < ``model.layers.3``): the first bad
file in counter order is the innermost module that produced the bad value. Inputs are copied
when the call *starts* (a forward pre-hook), because engine kernels work in place (vLLM's
fused add-RMSNorm overwrites its ``residual`` input): a copy taken at the end would show the
output there.

Cost. Every recorded tensor is copied to the CPU and written synchronously: a full trace of a
large model is slow and big. Narrow it with ``modules=r"layers\\.(3|4)\\."``, record one short
prompt, or pass ``inputs=False``.

vLLM. Run eagerly (``enforce_eager=True`` / ``--enforce-eager``): CUDA graphs replay kernels
without running Python, so hooks would only fire during capture, and torch.compile traces the
model with hooks inlined. The hooks must live in the process that runs the model:

* vLLM versions with ``LLM.apply_model`` (it runs a function on the model in every worker, so it
  also covers tensor/expert parallelism); ``{rank}`` in ``out_dir`` becomes the worker's rank,
  one directory per rank (same-named files of different ranks must not share a directory)::

      llm = LLM(model=path, enforce_eager=True, tensor_parallel_size=8)
      llm.apply_model(lambda m: nvfp4dbg_trace.install(m, "/tmp/trace/rank{rank}", step=0))
      llm.generate(prompts, SamplingParams(max_tokens=1))
      llm.apply_model(nvfp4dbg_trace.uninstall)
      # nvfp4dbg nan-locate /tmp/trace --rank 3

  The function is pickled to the workers: ``nvfp4dbg_trace`` must be importable there too.

* In-process engines (older vLLM, or V1 with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, TP=1): hook the
  model object directly. Its attribute path changes between versions, e.g.
  ``llm.llm_engine.model_executor.driver_worker.model_runner.model`` (V0) or
  ``llm.llm_engine.model_executor.driver_worker.worker.model_runner.model`` (V1); look for the
  ``nn.Module`` whose ``named_modules()`` lists ``model.layers.0...``.

vLLM flattens the batch (hidden states are ``[num_tokens, hidden]``), transformers keeps
``[batch, seq, hidden]``; ``nvfp4dbg bisect`` compares such pairs flat when only leading dims
differ.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import threading
from typing import Callable, Iterator, Optional, Union

import torch
from safetensors.torch import save_file

__all__ = ["record", "install", "uninstall", "Recorder"]

_NAME = re.compile(r"^(\d{6,})-(.+)\.safetensors$")

# dtypes safetensors stores and nvfp4dbg reads; anything else is skipped, not fatal
_DTYPES = {
    torch.float64, torch.float32, torch.float16, torch.bfloat16,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
}
for _n in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _n):
        _DTYPES.add(getattr(torch, _n))

ModuleFilter = Union[None, str, "re.Pattern[str]", Callable[[str, torch.nn.Module], bool]]


def _flatten(obj, out: list) -> None:
    """Tensors of an output or argument, depth first; everything else is skipped."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, dict):  # also transformers' ModelOutput (an OrderedDict dataclass)
        for v in obj.values():
            _flatten(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _flatten(v, out)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            _flatten(getattr(obj, f.name, None), out)


def _to_cpu(t: torch.Tensor) -> Optional[torch.Tensor]:
    if t.is_sparse or t.is_quantized or t.device.type == "meta" or t.dtype not in _DTYPES:
        return None
    # copy=True: an output that aliases an input (identity, in-place op) must not share storage
    return t.detach().to("cpu", copy=True).contiguous()


def _next_counter(out_dir: str) -> int:
    """One past the highest counter already in out_dir, so several record() blocks (steps)
    into one directory never overwrite each other."""
    top = -1
    for name in os.listdir(out_dir):
        m = _NAME.match(name)
        if m:
            top = max(top, int(m.group(1)))
    return top + 1


def _default_rank() -> Optional[int]:
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:  # noqa: BLE001 - no distributed setup is the common case
        pass
    return None


class Recorder:
    """Forward hooks that write one trace file per module call. Use :func:`record` (a context
    manager) or :func:`install` / :func:`uninstall`; ``step`` may be changed between passes."""

    def __init__(
        self,
        model: torch.nn.Module,
        out_dir: str,
        modules: ModuleFilter = None,
        inputs: bool = True,
        rank: Optional[int] = None,
        step: Optional[int] = None,
        *,
        root: bool = False,
    ) -> None:
        self.rank = rank if rank is not None else _default_rank()
        self.out_dir = out_dir.replace("{rank}", str(self.rank or 0))
        self.model = model
        self.inputs = inputs
        self.step = step
        self.root = root
        self._match = self._matcher(modules)
        self._handles: list = []
        self._pending: dict = {}  # id(module) -> stack of input snapshots (re-entrant calls)
        self._lock = threading.Lock()
        self._counter = 0
        self.files: list = []

    @staticmethod
    def _matcher(modules: ModuleFilter) -> Callable[[str, torch.nn.Module], bool]:
        if modules is None:
            return lambda name, mod: True
        if isinstance(modules, str):
            modules = re.compile(modules)
        if isinstance(modules, re.Pattern):
            return lambda name, mod: modules.search(name) is not None
        if callable(modules):
            return modules
        raise TypeError("modules: None, a regex (str or re.Pattern), or a callable(name, module)")

    def start(self) -> "Recorder":
        os.makedirs(self.out_dir, exist_ok=True)
        self._counter = _next_counter(self.out_dir)
        for name, mod in self.model.named_modules():
            if name == "" and not self.root:
                continue
            name = name or "__root__"
            if not self._match(name, mod):
                continue
            if self.inputs:
                self._handles.append(
                    mod.register_forward_pre_hook(self._pre_hook(), with_kwargs=True))
            self._handles.append(
                mod.register_forward_hook(self._hook(name), with_kwargs=True))
        return self

    def stop(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._pending.clear()

    def _pre_hook(self):
        def hook(mod, args, kwargs):
            flat: list = []
            names: list = []
            for i, a in enumerate(args):
                before = len(flat)
                _flatten(a, flat)
                names += [f"args.{i}"] * (len(flat) - before)
            for k, v in kwargs.items():
                before = len(flat)
                _flatten(v, flat)
                names += [f"kwargs.{k}"] * (len(flat) - before)
            snap = [(n, _to_cpu(t)) for n, t in zip(names, flat)]
            self._pending.setdefault(id(mod), []).append([(n, t) for n, t in snap if t is not None])
            return None
        return hook

    def _hook(self, name: str):
        safe = name.replace("/", "_")

        def hook(mod, args, kwargs, output):
            ins = []
            stack = self._pending.get(id(mod))
            if stack:
                ins = stack.pop()
            outs: list = []
            _flatten(output, outs)
            tensors = {}
            for i, t in enumerate(x for x in (_to_cpu(o) for o in outs) if x is not None):
                tensors["output" if i == 0 else f"output.{i}"] = t
            if not tensors:
                return None  # nothing to scan: no file, no counter
            for i, (_, t) in enumerate(ins):
                tensors[f"input.{i}"] = t
            with self._lock:
                counter = self._counter
                self._counter += 1
            meta = {"module": name, "counter": str(counter)}
            if ins:
                meta["input_names"] = ",".join(n for n, _ in ins)
            if self.rank is not None:
                meta["rank"] = str(self.rank)
            if self.step is not None:
                meta["step"] = str(self.step)
            fname = f"{counter:06d}-{safe}.safetensors"
            path = os.path.join(self.out_dir, fname)
            tmp = os.path.join(self.out_dir, f".{fname}.tmp")
            save_file(tensors, tmp, metadata=meta)
            os.replace(tmp, path)  # readers never see half a file
            self.files.append(path)
            return None
        return hook


@contextlib.contextmanager
def record(
    model: torch.nn.Module,
    out_dir: str,
    modules: ModuleFilter = None,
    inputs: bool = True,
    rank: Optional[int] = None,
    step: Optional[int] = None,
    *,
    root: bool = False,
) -> Iterator[Recorder]:
    """Record every module call of ``model`` (or those whose name matches ``modules``, a regex
    searched in the module path, or a ``callable(name, module)``) into ``out_dir``.

    ``inputs``: also record each call's tensor arguments as ``input.N``. ``rank``: metadata
    (default: the torch.distributed rank when initialized, else none); ``{rank}`` in ``out_dir``
    is replaced by it. ``step``: metadata; set ``recorder.step`` between forward passes to record
    several. ``root``: also record the model itself, as ``__root__``.
    """
    rec = Recorder(model, out_dir, modules, inputs, rank, step, root=root).start()
    try:
        yield rec
    finally:
        rec.stop()


def install(model: torch.nn.Module, out_dir: str, modules: ModuleFilter = None,
            inputs: bool = True, rank: Optional[int] = None, step: Optional[int] = None,
            *, root: bool = False) -> None:
    """Start recording until :func:`uninstall`, for engines that run the model in worker
    processes (``llm.apply_model(lambda m: install(m, ...))``). The recorder is kept on the model
    as ``model._nvfp4dbg_recorder``; nothing is returned because ``apply_model`` pickles results
    back to the caller, and a recorder (hooks, the model) does not pickle."""
    uninstall(model)
    rec = Recorder(model, out_dir, modules, inputs, rank, step, root=root).start()
    model._nvfp4dbg_recorder = rec


def uninstall(model: torch.nn.Module) -> None:
    """Stop a recorder started by :func:`install` (no-op when none)."""
    rec = getattr(model, "_nvfp4dbg_recorder", None)
    if rec is not None:
        rec.stop()
        del model._nvfp4dbg_recorder
