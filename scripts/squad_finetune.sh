#!/usr/bin/env bash
# SQuAD v1.1 fine-tuning of the phase-2 BERT-Large checkpoint of each pre-training row (LAMB,
# 1-bit LAMB, SLAMB; scripts/bert_pretrain.sh writes them), then the tables. 4 local workers x 8
# (global batch 32) by default. Extra arguments are Hydra overrides for every row, e.g.
#   scripts/squad_finetune.sh data.train_file=/data/squad/train-v1.1.json \
#       data.dev_file=/data/squad/dev-v1.1.json trainer.nproc_per_node=8 trainer.precision=bf16
# ROWS="lamb slamb" picks rows. RUNS and TABLES name where the run directories and the tables go (default
# runs/ and results/); overrides that change the recipe (a smaller model, fewer epochs, ...) make a smoke
# run, kept apart from both (scripts/where.sh). Each row fine-tunes BERT_RUNS/bert_phase2_<row>/model
# (BERT_RUNS: where scripts/bert_pretrain.sh put it, default runs; model.dir=... overrides it).
# Multi-node: run one row per command under torchrun, e.g.
#   torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \
#       -m squad_finetune.train experiment=squad/slamb
# Rerunning resumes each row from its run directory (RUNS/squad_<row>/).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export WANDB_MODE=${WANDB_MODE:-offline} HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
source scripts/where.sh
rows=${ROWS:-lamb onebit_lamb slamb}
where squad $(printf 'squad/%s ' $rows) -- "$@"
for row in $rows; do
    "$PY" -m squad_finetune.train experiment=squad/${row} model.dir="${BERT_RUNS:-runs}/bert_phase2_${row}/model" \
        "hydra.run.dir=$runs/\${name}/\${hydra.job.override_dirname}" "$@"
done
"$PY" scripts/make_tables.py --runs "$runs" --out "$tables"
