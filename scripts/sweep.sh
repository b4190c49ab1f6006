#!/usr/bin/env bash
# Hydra multirun over one of configs/sweep/*.yaml for any pipeline and experiment, then the tables:
#   PIPELINE=cifar10 EXPERIMENT=cifar10/slamb scripts/sweep.sh SWEEP [overrides...]
# Each job starts its own workers (trainer.nproc_per_node) and gets runs/sweeps/<name>/<overrides>/;
# RUNS and TABLES name where make_tables.py reads and writes (default runs/ and results/).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export WANDB_MODE=${WANDB_MODE:-offline}
sweep=$1
shift
"$PY" -m "${PIPELINE:-cifar10}.train" --multirun "experiment=${EXPERIMENT:-cifar10/slamb}" "sweep=$sweep" "$@"
"$PY" scripts/make_tables.py --runs "${RUNS:-runs}" --out "${TABLES:-results}"
