#!/usr/bin/env bash
# Hydra multirun over SLAMB's beta3 (configs/sweep/beta3.yaml) for any pipeline and SLAMB experiment:
#   PIPELINE=cifar10 EXPERIMENT=cifar10/slamb scripts/sweep_beta3.sh [overrides...]
# Each job starts its own workers (trainer.nproc_per_node) and gets runs/sweeps/<name>/<overrides>/.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export WANDB_MODE=${WANDB_MODE:-offline}
"$PY" -m "${PIPELINE:-cifar10}.train" --multirun "experiment=${EXPERIMENT:-cifar10/slamb}" sweep=beta3 "$@"
"$PY" scripts/make_tables.py --runs "${RUNS:-runs}" --out "${TABLES:-results}"
