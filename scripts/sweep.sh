#!/usr/bin/env bash
# Hydra multirun over one of configs/sweep/*.yaml for any pipeline and experiment, then the tables:
#   PIPELINE=cifar10 EXPERIMENT=cifar10/slamb scripts/sweep.sh SWEEP [overrides...]
#   PIPELINE=bert EXPERIMENT=bert/phase1_slamb scripts/sweep.sh beta3 data.dir=... validation.dir=...
# Each job starts its own workers (trainer.nproc_per_node). At the experiment's recipe size (apart from what the
# sweep varies) its run directories go to $RUNS/<name>/<overrides>/ (RUNS default runs/sweeps) and the pages to
# TABLES (default results/); overrides that change the recipe (fewer epochs, other workers, a smaller model, ...)
# make a smoke sweep, kept apart from both under smoke/ (scripts/where.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export WANDB_MODE=${WANDB_MODE:-offline}
source scripts/where.sh
sweep=$1
shift
pipeline=${PIPELINE:-cifar10}
experiment=${EXPERIMENT:-cifar10/slamb}
declare -A CONFIG=([cifar10]=cifar10 [swin]=swin [bert]=bert [squad_finetune]=squad)
if [[ -z ${CONFIG[$pipeline]:-} ]]; then
    echo "error: invalid PIPELINE=$pipeline; fix: one of ${!CONFIG[*]}" >&2
    exit 2
fi
where "${CONFIG[$pipeline]}" "$experiment" -- "$@"
[[ -n $smoke ]] || runs=${RUNS:-runs/sweeps}
"$PY" -m "$pipeline.train" --multirun "experiment=$experiment" "sweep=$sweep" "hydra.sweep.dir=$runs/\${name}" "$@"
"$PY" scripts/make_tables.py --runs "$runs" --out "$tables"
