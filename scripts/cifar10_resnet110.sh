#!/usr/bin/env bash
# The three rows of the CIFAR-10 / ResNet-110 table (SGD-M, LAMB, SLAMB), 4 local workers each,
# then the tables. Extra arguments are Hydra overrides for every row, e.g.
#   scripts/cifar10_resnet110.sh data.dir=/data/cifar-10-batches-py trainer.nproc_per_node=4
# Rerunning resumes each row from its run directory (runs/cifar10_resnet110_<row>/).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export WANDB_MODE=${WANDB_MODE:-offline}
for row in sgd lamb slamb; do
    "$PY" -m cifar10.train experiment=cifar10/${row} "$@"
done
"$PY" scripts/make_tables.py --runs runs --out results
