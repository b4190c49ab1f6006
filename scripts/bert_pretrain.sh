#!/usr/bin/env bash
# BERT-Large pre-training for each row (LAMB, 1-bit LAMB, SLAMB): phase 1 (seq 128), then phase 2 (seq 512)
# from phase 1's model; both phases score the held-out shards (validation MLM loss); then the tables.
#
#   scripts/bert_pretrain.sh [HYDRA_OVERRIDE...]
#   scripts/bert_pretrain.sh trainer.nproc_per_node=8                      # one node, 8 GPUs
#   NNODES=16 NODE_RANK=0 MASTER_ADDR=node0 scripts/bert_pretrain.sh       # on each of 16 nodes (torchrun)
#   sbatch scripts/slurm/bert_pretrain.sbatch                              # SLURM, 16 nodes x 8
#
# Overrides apply to both phases of every row; the data of each phase is set by the environment below, not by
# data.dir. Relative paths are taken from your directory.
# Environment:
#   ROWS         rows to run, among: lamb onebit_lamb slamb (default: all three)
#   PHASE1_DATA  seq-128 shards (default data/bert/seq128: python -m bert.prepare_data --max-seq-length 128)
#   PHASE2_DATA  seq-512 shards (default data/bert/seq512)
#   PHASE1_VALID, PHASE2_VALID  held-out shards of each phase (default PHASE<n>_DATA/heldout, which
#                bert.prepare_data writes)
#   RUNS         where the run directories go (default runs/; a smoke run: smoke/smoke-<digest>/)
#   TABLES       where the tables go (default results/; a smoke run: beside its runs)
#   NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT, NPROC_PER_NODE  several nodes through torchrun (default 8
#                workers a node); the run directories on a shared file system; node 0 renders the tables
#   LAUNCH       local (default) or srun, one SLURM task per GPU (scripts/slurm/bert_pretrain.sbatch)
#   PY           the Python to use (default .venv/bin/python)
# Both phases of every row are checked (settings, data) before the first phase starts. Phase 2 starts from
# the model of phase 1 of this command (RUNS/bert_phase1_<row>/model); 1-bit LAMB's phase 2 continues that
# run's optimizer too. A rerun resumes each phase from RUNS/bert_phase{1,2}_<row>/; a finished phase is not
# redone.
set -euo pipefail
caller=$PWD
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export WANDB_MODE=${WANDB_MODE:-offline} HF_HUB_OFFLINE=1
source scripts/common.sh
for arg; do
    case ${arg#+} in
        data.dir=*) die "$arg would give both phases one data folder; set PHASE1_DATA and PHASE2_DATA instead" ;;
        validation.dir=*) die "$arg would give both phases one held-out folder; set PHASE1_VALID and PHASE2_VALID instead" ;;
        init_from=*|init_optimizer_from=*) die "$arg: phase 2 starts from phase 1 of this command (RUNS/bert_phase1_<row>)" ;;
    esac
done
pick_rows lamb onebit_lamb slamb
PHASE1_DATA=${PHASE1_DATA:-data/bert/seq128}
PHASE2_DATA=${PHASE2_DATA:-data/bert/seq512}
in_caller PHASE1_DATA PHASE2_DATA PHASE1_VALID PHASE2_VALID RUNS TABLES
PHASE1_VALID=${PHASE1_VALID:-$PHASE1_DATA/heldout}
PHASE2_VALID=${PHASE2_VALID:-$PHASE2_DATA/heldout}
NNODES=${NNODES:-1}
runs_of=()
experiments=()
for row in $rows; do
    # phase 2 is checked without the model phase 1 will write (init_from), all else as it will run
    runs_of+=(--run "bert/phase1_$row" data.dir="$PHASE1_DATA" validation.dir="$PHASE1_VALID"
              --run "bert/phase2_$row" data.dir="$PHASE2_DATA" validation.dir="$PHASE2_VALID" init_from=null)
    experiments+=("bert/phase1_$row" "bert/phase2_$row")
done
world=()
[[ $NNODES -eq 1 ]] || world=(--world $((NNODES * ${NPROC_PER_NODE:-8})))
preflight bert "${world[@]}" "${runs_of[@]}" -- "${launch_settings[@]}" "$@"
source scripts/where.sh
where bert "${experiments[@]}" -- "${overrides[@]}"

train() {  # train EXPERIMENT (of experiment/bert/) DATA_DIR VALIDATION_DIR [OVERRIDES...]
    local exp=$1 data=$2 valid=$3
    shift 3
    local args=(experiment="bert/$exp" data.dir="$data" validation.dir="$valid" hydra.run.dir="$runs/bert_$exp" "$@")
    if [ "$NNODES" -gt 1 ]; then
        "$PY" -m torch.distributed.run --nnodes "$NNODES" --node-rank "${NODE_RANK:?set NODE_RANK}" \
            --nproc-per-node "${NPROC_PER_NODE:-8}" --rdzv-backend c10d \
            --rdzv-endpoint "${MASTER_ADDR:?set MASTER_ADDR}:${MASTER_PORT:-29400}" -m bert.train "${args[@]}"
    else
        run_module bert.train "${args[@]}"
    fi
}

for row in $rows; do
    train "phase1_${row}" "$PHASE1_DATA" "$PHASE1_VALID" "${overrides[@]}"
    # the model of this command's phase 1 (and, for 1-bit LAMB, its optimizer: init_optimizer_from follows
    # init_from), whatever RUNS is
    train "phase2_${row}" "$PHASE2_DATA" "$PHASE2_VALID" init_from="$runs/bert_phase1_${row}/model" "${overrides[@]}"
done
if [[ ${NODE_RANK:-0} -eq 0 ]]; then
    "$PY" scripts/make_tables.py --runs "$runs" --out "$tables"
fi
