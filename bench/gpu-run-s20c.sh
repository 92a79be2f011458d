#!/usr/bin/env bash
# Session 20, final lease: the nightly, the whole bench and the PyTorch peers on the build with
# the register-A token ring at 3 stages (LABEL s20c).
LABEL=s20c bash bench/gpu-run-final.sh
