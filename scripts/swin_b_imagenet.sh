#!/usr/bin/env bash
# The Swin-B / ImageNet table (AdamW, LAMB, SLAMB), then the tables.
#
#   scripts/swin_b_imagenet.sh GPUS_PER_NODE [NODES NODE_RANK MASTER_ADDR[:PORT]] [-- HYDRA_OVERRIDE...]
#   scripts/swin_b_imagenet.sh 8 -- data.dir=/data/imagenet                            # one node
#   scripts/swin_b_imagenet.sh 8 16 0 node0.example:29400 -- data.dir=/data/imagenet  # on each of 16 nodes
#   sbatch scripts/slurm/swin_b_imagenet.sbatch data.dir=/data/imagenet               # SLURM, 16 nodes x 8
#
# The global batch is the paper's 16,384 on any number of GPUs: each worker accumulates
# 16,384 / (GPUs x data.micro_batch) micro-batches per step. Several nodes: torchrun on each node,
# the run directories on a shared file system. Overrides apply to every row; relative paths are
# taken from your directory.
# Environment:
#   ROWS     rows to run, among: adamw lamb slamb (default: all three)
#   RUNS     where the run directories go (default runs/; a smoke run: smoke/smoke-<digest>/)
#   TABLES   where the tables go (default results/; a smoke run: beside its runs)
#   LAUNCH   local (default) or srun, one SLURM task per GPU (scripts/slurm/swin_b_imagenet.sbatch)
#   PY       the Python to use (default .venv/bin/python)
# Every row's settings and data are checked before the first row starts. A rerun resumes each row from
# RUNS/swin_b_<row>/...; a finished row is not redone.
set -euo pipefail
caller=$PWD
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export WANDB_MODE=${WANDB_MODE:-offline}
source scripts/common.sh

[[ $# -ge 1 && $1 =~ ^[0-9]+$ ]] || die "the first argument is GPUS_PER_NODE, a number (scripts/swin_b_imagenet.sh --help)"
gpus=$1; shift
nodes=1; node_rank=0; master=""
if [[ $# -ge 1 && $1 =~ ^[0-9]+$ ]]; then
    [[ $# -ge 3 ]] || die "several nodes take NODES NODE_RANK MASTER_ADDR[:PORT] (scripts/swin_b_imagenet.sh --help)"
    nodes=$1; node_rank=$2; master=$3; shift 3
    [[ $master == *:* ]] || master="$master:29400"
fi
[[ $# -ge 1 && $1 == "--" ]] && shift

pick_rows adamw lamb slamb
in_caller RUNS TABLES
runs_of=()
for row in $rows; do runs_of+=(--run "swin_b/$row"); done
world=()
[[ $nodes -eq 1 ]] || world=(--world $((nodes * gpus)))
preflight swin "${world[@]}" "${runs_of[@]}" -- trainer.nproc_per_node="$gpus" "${launch_settings[@]}" "$@"
source scripts/where.sh
where swin $(printf 'swin_b/%s ' $rows) -- "${overrides[@]}"
dir="hydra.run.dir=$runs/\${name}/\${hydra.job.override_dirname}"
for row in $rows; do
    if [[ $nodes -eq 1 ]]; then
        run_module swin.train experiment=swin_b/${row} "$dir" "${overrides[@]}"
    else
        # c10d rendezvous: every node runs this command
        "$(dirname "$PY")/torchrun" --nnodes "${nodes}" --node-rank "${node_rank}" --nproc-per-node "${gpus}" \
            --rdzv-backend c10d --rdzv-endpoint "${master}" --rdzv-id "swin_b_${row}" \
            -m swin.train experiment=swin_b/${row} "$dir" "${overrides[@]}"
    fi
done
if [[ $node_rank -eq 0 ]]; then
    "$PY" scripts/make_tables.py --runs "$runs" --out "$tables"
fi
