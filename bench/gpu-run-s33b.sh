#!/usr/bin/env bash
# Session 33, second lease (commit ef87de5: the gate/up's rows gathered by every thread's
# 16-byte cp.async, where s33a's build, 1e16aa2, issued 1-row TMA boxes from warp 0): the same
# tests, byte compare, A/B rounds and memcheck as bench/gpu-run-s33a.sh, under this label.
LABEL=${LABEL:-s33b} exec bash bench/gpu-run-s33a.sh "$@"
