#!/usr/bin/env bash
# Session 48: are CUDA-written `layertest --dump-inputs` dumps accepted by compare-outputs' dump
# check (expected tensors against a CPU recompute, per-token tolerance dump::verify::
# TOKEN_MAX_REL_ERR)? The same layer on cuda and on cpu, per seed and size; compare-outputs run
# on each CUDA dump with its own nvfp4_routed as the output (must pass, exit 0); then the CUDA
# and CPU dumps' expected tensors compared row by row (numpy). Usage: DIR BIN (from gpu-run-s48.sh).
set -uo pipefail
D=$1; B=$2
mkdir -p $D && cd $D
$B synth --preset tiny-v4 --out v4 --no-report-dir --quiet >/dev/null || echo "synth failed"
pair() { # name args...
    local n=$1; shift
    $B layertest --device cuda "$@" --dump-inputs g-$n --no-report-dir --quiet >/dev/null; echo "cuda $n rc=$?"
    $B layertest --device cpu "$@" --dump-inputs c-$n --no-report-dir --quiet >/dev/null; echo "cpu $n rc=$?"
}
for s in 1 2; do pair t16-$s --tokens 16 --seed $s; done
for s in 1 2; do pair t512-$s --tokens 512 --seed $s; done
pair t10200-1 --tokens 10200 --seed 1
pair v4-t512-1 --checkpoint v4 --tokens 512 --seed 1
pair v4-t4096-3 --checkpoint v4 --tokens 4096 --seed 3
for g in g-*/; do
    $B compare-outputs $g $g/expected.safetensors --tensor nvfp4_routed --no-report-dir --quiet \
        --json co-${g%/}.json > co-${g%/}.txt 2>&1
    echo "compare-outputs $g rc=$?: $(tail -1 co-${g%/}.txt | cut -c1-200)"
done
python3 - <<'PY'
import glob
import numpy as np
from safetensors.numpy import load_file
for g in sorted(glob.glob('g-*/')):
    n = g[2:-1]
    try:
        ge, ce = load_file(g + 'expected.safetensors'), load_file('c-' + n + '/expected.safetensors')
    except Exception as e:
        print(n, 'load failed', e)
        continue
    out = [n]
    for k in ['nvfp4_routed', 'nvfp4_out']:
        a, b = ge[k].astype(np.float64), ce[k].astype(np.float64)
        d = np.linalg.norm(a - b, axis=1)
        m = np.maximum(np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1))
        r = np.where(m > 0, d / np.where(m > 0, m, 1), 0)
        cos = (a * b).sum() / np.sqrt((a * a).sum() * (b * b).sum())
        out.append('%s: 1-cos %.1e, worst row %.2e, rows > 1e-3: %d' % (k, 1 - cos, r.max(), (r > 1e-3).sum()))
    print('  '.join(out))
PY
