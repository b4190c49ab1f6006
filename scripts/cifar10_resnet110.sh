#!/usr/bin/env bash
# The CIFAR-10 / ResNet-110 table (SGD-M, LAMB, SLAMB): 4 local workers per row, then the tables.
#
#   scripts/cifar10_resnet110.sh [HYDRA_OVERRIDE...]
#   scripts/cifar10_resnet110.sh data.dir=/data/cifar-10-batches-py trainer.nproc_per_node=4
#
# Overrides apply to every row. Relative paths are taken from your directory.
# Environment:
#   ROWS     rows to run, among: sgd lamb slamb (default: all three)
#   RUNS     where the run directories go (default runs/; a smoke run: smoke/smoke-<digest>/)
#   TABLES   where the tables go (default results/; a smoke run: beside its runs)
#   LAUNCH   local (default) or srun, one SLURM task per GPU (scripts/slurm/cifar10_resnet110.sbatch)
#   PY       the Python to use (default .venv/bin/python)
# Every row's settings and data are checked before the first row starts. A rerun resumes each row from
# RUNS/cifar10_resnet110_<row>/; a finished row is not redone.
set -euo pipefail
caller=$PWD
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export WANDB_MODE=${WANDB_MODE:-offline}
source scripts/common.sh
pick_rows sgd lamb slamb
in_caller RUNS TABLES
runs_of=()
for row in $rows; do runs_of+=(--run "cifar10/$row"); done
preflight cifar10 "${runs_of[@]}" -- "${launch_settings[@]}" "$@"
source scripts/where.sh
where cifar10 $(printf 'cifar10/%s ' $rows) -- "${overrides[@]}"
for row in $rows; do
    run_module cifar10.train experiment=cifar10/${row} "hydra.run.dir=$runs/\${name}/\${hydra.job.override_dirname}" \
        "${overrides[@]}"
done
"$PY" scripts/make_tables.py --runs "$runs" --out "$tables"
