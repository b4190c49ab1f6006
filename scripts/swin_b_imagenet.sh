#!/usr/bin/env bash
# The three rows of the Swin-B / ImageNet table (AdamW, LAMB, SLAMB), then the tables.
#
#   scripts/swin_b_imagenet.sh GPUS_PER_NODE [NODES NODE_RANK MASTER_ADDR[:PORT]] [-- hydra overrides...]
#
# Single node (the launcher of the package starts the workers):
#   scripts/swin_b_imagenet.sh 8 -- data.dir=/data/imagenet
# Multi-node (torchrun on every node, same command, its own NODE_RANK):
#   scripts/swin_b_imagenet.sh 8 16 0 node0.example:29400 -- data.dir=/data/imagenet
# Gradient accumulation (same global batch on half the GPUs): ... -- accumulation_steps=2
# SLURM (one task per GPU, docs/configs.md): python -m swin.train --multirun hydra/launcher=slurm \
#   hydra.launcher.nodes=16 trainer.nproc_per_node=8 experiment=swin_b/slamb data.dir=/data/imagenet
# ROWS="slamb" runs one row. RUNS and TABLES name where the run directories and the tables go (default
# runs/ and results/); overrides that change the recipe (a smaller model, fewer epochs, ...) make a smoke
# run, kept apart from both (scripts/where.sh). Rerunning resumes each row from its run directory
# (RUNS/swin_b_<row>/...).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export WANDB_MODE=${WANDB_MODE:-offline}
usage() { sed -n 2,16p "$0" >&2; exit 2; }

[[ $# -ge 1 && $1 =~ ^[0-9]+$ ]] || usage
gpus=$1; shift
nodes=1; node_rank=0; master=""
if [[ $# -ge 1 && $1 =~ ^[0-9]+$ ]]; then
    [[ $# -ge 3 ]] || usage
    nodes=$1; node_rank=$2; master=$3; shift 3
    [[ $master == *:* ]] || master="$master:29400"
fi
[[ $# -ge 1 && $1 == "--" ]] && shift

source scripts/where.sh
rows=${ROWS:-adamw lamb slamb}
where swin $(printf 'swin_b/%s ' $rows) -- trainer.nproc_per_node=${gpus} "$@"
dir="hydra.run.dir=$runs/\${name}/\${hydra.job.override_dirname}"
for row in $rows; do
    if [[ $nodes -eq 1 ]]; then
        "$PY" -m swin.train experiment=swin_b/${row} trainer.nproc_per_node=${gpus} "$dir" "$@"
    else
        # c10d rendezvous: every node runs this command; the run directory must be on a shared file system
        "$(dirname "$PY")/torchrun" --nnodes "${nodes}" --node-rank "${node_rank}" --nproc-per-node "${gpus}" \
            --rdzv-backend c10d --rdzv-endpoint "${master}" --rdzv-id "swin_b_${row}" \
            -m swin.train experiment=swin_b/${row} trainer.nproc_per_node=${gpus} "$dir" "$@"
    fi
done
if [[ $node_rank -eq 0 ]]; then
    "$PY" scripts/make_tables.py --runs "$runs" --out "$tables"
fi
