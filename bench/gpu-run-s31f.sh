#!/usr/bin/env bash
# Session 31, sixth lease: the tile widths measured again now that a tile's padding rows are
# zeros (per-expert tensor maps): the down at 144 tokens between 128 and 160 (RS_N144_DOWN=1)
# and both GEMMs at 48 between 32 and 64 (RS_N48=1), against the defaults, alternating rounds.
set -uo pipefail
L=${LABEL:-s31f}
source bench/gpu-lib.sh
ab_rounds ${ROUNDS:-4} layer_4096 "default| n144down|NVFP4DBG_NVRTC_DEFINES=-DRS_N144_DOWN=1 n48|NVFP4DBG_NVRTC_DEFINES=-DRS_N48=1"
stamp done
pack
