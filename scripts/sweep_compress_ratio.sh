#!/usr/bin/env bash
# Hydra multirun over SLAMB's compression ratio k (configs/sweep/compress_ratio.yaml); GRID=1 sweeps the
# beta3 x k grid (configs/sweep/beta3_compress_ratio.yaml) whose heat map make_tables.py draws:
#   PIPELINE=cifar10 EXPERIMENT=cifar10/slamb GRID=1 scripts/sweep_compress_ratio.sh [overrides...]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export WANDB_MODE=${WANDB_MODE:-offline}
sweep=compress_ratio
[[ "${GRID:-0}" == 1 ]] && sweep=beta3_compress_ratio
"$PY" -m "${PIPELINE:-cifar10}.train" --multirun "experiment=${EXPERIMENT:-cifar10/slamb}" sweep=$sweep "$@"
"$PY" scripts/make_tables.py --runs "${RUNS:-runs}" --out "${TABLES:-results}"
