#!/usr/bin/env bash
# SQuAD v1.1 fine-tuning of each pre-training row's phase-2 BERT-Large (LAMB, 1-bit LAMB, SLAMB), then the
# tables. 4 local workers x 8 (global batch 32) by default.
#
#   scripts/squad_finetune.sh [HYDRA_OVERRIDE...]
#   scripts/squad_finetune.sh data.train_file=/data/squad/train-v1.1.json \
#       data.dev_file=/data/squad/dev-v1.1.json trainer.precision=bf16
#   sbatch scripts/slurm/squad_finetune.sbatch data.train_file=... data.dev_file=...   # SLURM, 1 node x 4
#
# Each row fine-tunes BERT_RUNS/bert_phase2_<row>/model (scripts/bert_pretrain.sh writes it); model.dir=...
# fine-tunes another. Overrides apply to every row; relative paths are taken from your directory.
# Environment:
#   ROWS       rows to run, among: lamb onebit_lamb slamb (default: all three)
#   BERT_RUNS  where scripts/bert_pretrain.sh put its runs (default runs/)
#   RUNS       where the run directories go (default runs/; a smoke run: smoke/smoke-<digest>/)
#   TABLES     where the tables go (default results/; a smoke run: beside its runs)
#   LAUNCH     local (default) or srun, one SLURM task per GPU (scripts/slurm/squad_finetune.sbatch)
#   PY         the Python to use (default .venv/bin/python)
# Every row's settings and data are checked before the first row starts. A rerun resumes each row from
# RUNS/squad_<row>/; a finished row is not redone.
set -euo pipefail
caller=$PWD
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export WANDB_MODE=${WANDB_MODE:-offline} HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
source scripts/common.sh
pick_rows lamb onebit_lamb slamb
in_caller BERT_RUNS RUNS TABLES
BERT_RUNS=${BERT_RUNS:-runs}
runs_of=()
for row in $rows; do runs_of+=(--run "squad/$row" model.dir="$BERT_RUNS/bert_phase2_${row}/model"); done
preflight squad "${runs_of[@]}" -- "${launch_settings[@]}" "$@"
source scripts/where.sh
where squad $(printf 'squad/%s ' $rows) -- "${overrides[@]}"
for row in $rows; do
    run_module squad_finetune.train experiment=squad/${row} model.dir="$BERT_RUNS/bert_phase2_${row}/model" \
        "hydra.run.dir=$runs/\${name}/\${hydra.job.override_dirname}" "${overrides[@]}"
done
"$PY" scripts/make_tables.py --runs "$runs" --out "$tables"
