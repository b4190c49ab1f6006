#!/usr/bin/env bash
# SLAMB's compression ratio k in 0.01, 0.05, 0.1, 0.2 (configs/sweep/compress_ratio.yaml); GRID=1 sweeps the
# beta3 x k grid (configs/sweep/beta3_compress_ratio.yaml) whose heat maps make_tables.py draws:
#   PIPELINE=cifar10 EXPERIMENT=cifar10/slamb GRID=1 scripts/sweep_compress_ratio.sh [overrides...]
exec "$(dirname "$0")/sweep.sh" "$([[ "${GRID:-0}" == 1 ]] && echo beta3_compress_ratio || echo compress_ratio)" "$@"
