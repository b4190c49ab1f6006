#!/usr/bin/env bash
# Hydra multirun over SLAMB's sync interval H (configs/sweep/sync_interval.yaml) for any pipeline and SLAMB
# experiment; make_tables.py gives its line (top-1 and bytes by H, beside LAMB where LAMB runs are found):
#   PIPELINE=cifar10 EXPERIMENT=cifar10/slamb scripts/sweep_sync_interval.sh [overrides...]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export WANDB_MODE=${WANDB_MODE:-offline}
"$PY" -m "${PIPELINE:-cifar10}.train" --multirun "experiment=${EXPERIMENT:-cifar10/slamb}" sweep=sync_interval "$@"
"$PY" scripts/make_tables.py --runs "${RUNS:-runs}" --out "${TABLES:-results}"
