#!/usr/bin/env bash
# BERT-Large pre-training, phase 1 (seq 128) then phase 2 (seq 512, from phase 1's model) for each
# optimizer row (LAMB, 1-bit LAMB, SLAMB). Extra arguments are Hydra overrides for every run.
#
# Single node (8 local workers):
#   scripts/bert_pretrain.sh trainer.nproc_per_node=8
# Multi-node: run the same command on every node with NNODES, NODE_RANK and MASTER_ADDR set; the script
# then starts each phase with torchrun (8 workers per node unless NPROC_PER_NODE says otherwise):
#   NNODES=16 NODE_RANK=0 MASTER_ADDR=node0 scripts/bert_pretrain.sh
# ROWS="slamb" limits the rows; PHASE1_DATA / PHASE2_DATA point at the seq-128 / seq-512 shards
# (python -m bert.prepare_data, or NVIDIA's hdf5 directories). RUNS and TABLES name where the run
# directories and the tables go (default runs/ and results/); overrides that change the recipe (a smaller
# model, fewer steps, ...) make a smoke run, kept apart from both (scripts/where.sh). Rerunning resumes
# each phase from its run directory (RUNS/bert_phase{1,2}_<row>/); a finished phase is not redone.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export WANDB_MODE=${WANDB_MODE:-offline} HF_HUB_OFFLINE=1
ROWS=${ROWS:-"lamb onebit_lamb slamb"}
PHASE1_DATA=${PHASE1_DATA:-data/bert/seq128}
PHASE2_DATA=${PHASE2_DATA:-data/bert/seq512}
NNODES=${NNODES:-1}
source scripts/where.sh
experiments=()
for row in $ROWS; do experiments+=("bert/phase1_$row" "bert/phase2_$row"); done
where bert "${experiments[@]}" -- "$@"

train() {  # train EXPERIMENT (of experiment/bert/) DATA_DIR [OVERRIDES...]
    local exp=$1 data=$2
    shift 2
    if [ "$NNODES" -gt 1 ]; then
        "$PY" -m torch.distributed.run --nnodes "$NNODES" --node-rank "${NODE_RANK:?set NODE_RANK}" \
            --nproc-per-node "${NPROC_PER_NODE:-8}" --rdzv-backend c10d \
            --rdzv-endpoint "${MASTER_ADDR:?set MASTER_ADDR}:${MASTER_PORT:-29400}" \
            -m bert.train experiment="bert/$exp" data.dir="$data" hydra.run.dir="$runs/bert_$exp" "$@"
    else
        "$PY" -m bert.train experiment="bert/$exp" data.dir="$data" hydra.run.dir="$runs/bert_$exp" "$@"
    fi
}

for row in $ROWS; do
    train "phase1_${row}" "$PHASE1_DATA" "$@"
    train "phase2_${row}" "$PHASE2_DATA" init_from="$runs/bert_phase1_${row}/model" "$@"
done
"$PY" scripts/make_tables.py --runs "$runs" --out "$tables"
