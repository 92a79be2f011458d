"""Check one nvfp4dbg JSON report against what the end-to-end demo planted.

    python check.py KIND REPORT.json [ARGS...]

Prints one line, ``got: ...`` (what the report says, in a few words), and exits 0 when the
expectation holds, 1 when it does not, 2 when the report is missing or unreadable. Standard
library only.
"""

from __future__ import annotations

import json
import sys


def verdict_pass(d, *_):
    s = d.get("summary", {})
    return d.get("verdict") == "pass", s.get("text", d.get("verdict"))


def quantize(d, *_):
    s = d.get("summary", {})
    return d.get("verdict") == "pass" and s.get("quantized", 0) > 0, s.get("text", "")


def audit_pass(d, *_):
    s = d["summary"]
    ok = d["verdict"] == "pass" and s.get("quantized_linears", 0) > 0
    return ok, s.get("text", "")


def audit_gate_up(d, *_):
    s = d["summary"]
    kinds = s.get("by_kind", {})
    n = kinds.get("gate_up_scale_mismatch", 0)
    first = next((f for f in d.get("findings", []) if f.get("kind") == "gate_up_scale_mismatch"), None)
    where = f"; first {first['tensor']}: {first['detail']}" if first else ""
    return d["verdict"] == "fail" and n > 0, f"{s.get('text', '')} {kinds}{where}"


def nan_named(d, module, token):
    f = d.get("first_nonfinite") or {}
    idx = f.get("index") or {}
    got = (f"first {f.get('kind')} in {f.get('module')} {f.get('tensor')} token {idx.get('token')} "
           f"channel {idx.get('channel')}, inputs_clean={f.get('inputs_clean')}")
    ok = (d.get("verdict") == "fail" and f.get("module") == module
          and idx.get("token") == int(token) and f.get("inputs_clean") is True)
    return ok, got


def bisect_named(d, module):
    """The module itself with matching inputs, or a recorded child of it (e.g. its act_fn,
    whose input is the output of a GEMM inside the module that no hook sees)."""
    f = d.get("first_divergence") or {}
    m = f.get("module") or ""
    got = (f"first divergence {m} {f.get('tensor')} cosine {f.get('cosine', 0):.6f}, "
           f"inputs_diverged={f.get('inputs_diverged')}")
    named = (m == module and f.get("inputs_diverged") is False) or m.startswith(module + ".")
    return d.get("verdict") == "fail" and named, got


def weights_swapped(d, layer, expert):
    names = sorted({m.get("name", m.get("a", "")) for m in d.get("mismatches", [])})
    want = {f"model.layers.{layer}.mlp.experts.{expert}.{p}.weight" for p in ("gate_proj", "up_proj")}
    text = json.dumps(d)
    diagnosed = "gate_up_swapped" in text
    got = (f"mismatches {names}; missing {len(d.get('missing', []))}, extra {len(d.get('extra', []))}; "
           f"gate_up_swapped diagnosis: {'yes' if diagnosed else 'no'}")
    ok = (d.get("verdict") == "fail" and set(names) == want and diagnosed
          and not d.get("missing") and not d.get("extra"))
    return ok, got


def weights_identical(d, *_):
    s = d.get("summary", {})
    ok = (d.get("verdict") == "pass" and s.get("units", 0) > 0 and s.get("equal") == s.get("units")
          and not d.get("missing") and not d.get("extra"))
    return ok, f"{s.get('text', '')}; {s.get('equal')} of {s.get('units')} units bitwise equal"


def weights_clean(d, *_):
    s = d.get("summary", {})
    # vLLM's merged gate_up_proj / fused_qkv_a_proj compared as their parts: nothing missing
    merged = [n for n in d.get("notes", []) if "merged" in n]
    ok = (d.get("verdict") == "pass" and s.get("units", 0) > 0 and len(merged) == 2
          and not d.get("missing") and not d.get("extra"))
    diag = sorted({x.get("kind") for x in d.get("diagnoses", []) if isinstance(x, dict)})
    return ok, f"{s.get('text', '')}; diagnoses {diag}; {'; '.join(merged)}"


def routing_local(d, *_):
    kinds = [f.get("kind") for f in d.get("findings", [])]
    ok = d.get("verdict") == "fail" and "local_ids_as_global" in kinds
    msg = next((f["message"] for f in d.get("findings", []) if f.get("kind") == "local_ids_as_global"
                and "offset" in f.get("message", "")), "")
    return ok, f"findings {kinds}" + (f"; {msg[:160]}" if msg else "")


def routing_clean(d, *_):
    s = d.get("summary", {})
    return d.get("verdict") == "pass", f"{s.get('text', '')}; match_rate {s.get('match_rate')}"


def layertest(d, device):
    s = d.get("summary", {})
    kc = d.get("kernel_check") or {}
    kc_ok = True
    kc_txt = ""
    if device.startswith("cuda"):
        # on a GPU the kernels must also match nvfp4dbg's CPU NVFP4 path (same math)
        m = kc.get("metrics") or {}
        kc_ok = kc.get("done") is True and kc.get("pass") is True
        kc_txt = (f"; {kc.get('backend')} kernels vs CPU NVFP4 path: cosine "
                  f"{m.get('cosine', float('nan')):.7f} (min {kc.get('min_cosine')}), "
                  f"pass={kc.get('pass')}" + (f", {kc.get('reason')}" if kc.get("reason") else ""))
    ok = (d.get("verdict") == "pass" and s.get("nan_count") == 0 and kc_ok
          and str(s.get("device", "")).startswith(device))
    return ok, (f"cosine {s.get('cosine', 0):.4f} rel_l2 {s.get('rel_l2', 0):.3f} on {s.get('device')}, "
                f"gs {s.get('gs')}, NaN {s.get('nan_count')}{kc_txt}")


KINDS = {k: v for k, v in globals().items() if callable(v) and not k.startswith("_")
         and k not in ("main",) and v.__module__ == __name__}


def main() -> int:
    if len(sys.argv) < 3 or sys.argv[1] not in KINDS:
        print(f"usage: check.py {{{','.join(sorted(KINDS))}}} REPORT.json [ARGS...]")
        return 2
    try:
        with open(sys.argv[2]) as fh:
            d = json.load(fh)
    except (OSError, ValueError) as e:
        print(f"got: no readable report ({e})")
        return 2
    try:
        ok, got = KINDS[sys.argv[1]](d, *sys.argv[3:])
    except (KeyError, TypeError, ValueError) as e:
        print(f"got: report lacks what the check reads ({type(e).__name__}: {e})")
        return 2
    print(f"got: {got}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
