#!/usr/bin/env bash
# The three rows of the CIFAR-10 / ResNet-110 table (SGD-M, LAMB, SLAMB), 4 local workers each,
# then the tables. Extra arguments are Hydra overrides for every row, e.g.
#   scripts/cifar10_resnet110.sh data.dir=/data/cifar-10-batches-py trainer.nproc_per_node=4
# ROWS="slamb" picks rows. RUNS and TABLES name where the run directories and the tables go (default runs/
# and results/); overrides that change the recipe (a smaller model, fewer epochs, ...) make a smoke run,
# kept apart from both (scripts/where.sh). Rerunning resumes each row from its run directory
# (RUNS/cifar10_resnet110_<row>/).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export WANDB_MODE=${WANDB_MODE:-offline}
source scripts/where.sh
rows=${ROWS:-sgd lamb slamb}
where cifar10 $(printf 'cifar10/%s ' $rows) -- "$@"
for row in $rows; do
    "$PY" -m cifar10.train experiment=cifar10/${row} "hydra.run.dir=$runs/\${name}/\${hydra.job.override_dirname}" "$@"
done
"$PY" scripts/make_tables.py --runs "$runs" --out "$tables"
