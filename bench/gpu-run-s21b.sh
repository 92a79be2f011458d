#!/usr/bin/env bash
# Session 21, final lease: the nightly, `nvfp4dbg bench --device cuda` and the PyTorch peers on
# the build with EXPF_CR_BITS on by default (bench/gpu-run-final.sh).
LABEL=${LABEL:-s21b} exec bash bench/gpu-run-final.sh
