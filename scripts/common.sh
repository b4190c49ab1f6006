# Sourced by the per-paper scripts once they are in the repository, with `caller` the directory they were
# started in: --help, the rows, the caller's relative paths, every run's checks before the first starts, and
# how a run starts (LAUNCH).
#
# LAUNCH=local (default): the pipeline starts this node's workers (trainer.nproc_per_node), or torchrun does on
# several nodes. LAUNCH=srun, inside an sbatch allocation (scripts/slurm/): each run is one srun step of one task
# per GPU, every task a worker that reads its rank from SLURM; the script itself, and so the tables, run once.

die() { echo "error: $*" >&2; exit 2; }

# the script's header comment: its lines after the shebang, up to the first line that is not a comment
usage() { awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; }
for arg in "$@"; do
    if [[ $arg == -h || $arg == --help ]]; then usage; exit 0; fi
done

# pick_rows ROW...: the rows to run, from ROWS (unset: every ROW); an empty ROWS or an unknown row is refused
pick_rows() {
    rows=${ROWS-$*}
    [[ -n ${rows//[[:space:]]/} ]] || die "ROWS is empty; name rows among: $* (leave ROWS unset for all of them)"
    local row
    for row in $rows; do
        [[ " $* " == *" $row "* ]] || die "invalid ROWS='$ROWS': no row '$row'; choose from: $* (leave ROWS unset for all)"
    done
}

# in_caller VARIABLE...: a relative path in these settings of the script (RUNS, TABLES, ...) is the caller's,
# as the pipelines' input paths are (harness.preflight); the defaults stay the repository's
in_caller() {
    local name
    for name; do
        local value=${!name-}
        if [[ -n $value && $value != /* && $(pwd -P) != "$(cd "$caller" && pwd -P)" ]]; then
            printf -v "$name" '%s' "$caller/$value"
        fi
    done
}

LAUNCH=${LAUNCH:-local}
case $LAUNCH in
    local) launch_settings=() ;;
    srun)
        [[ -n ${SLURM_JOB_ID:-} ]] || die "LAUNCH=srun runs inside a SLURM allocation: sbatch scripts/slurm/<experiment>.sbatch"
        # the tasks of a node are its workers: the runs' settings say so, and so does the recipe's size
        tasks_per_node=${SLURM_NTASKS_PER_NODE:-${SLURM_TASKS_PER_NODE%%[(,]*}}
        launch_settings=("trainer.nproc_per_node=$tasks_per_node") ;;
    *) die "invalid LAUNCH=$LAUNCH: choose local (this node starts the workers) or srun (one SLURM task per GPU, under sbatch)" ;;
esac

# preflight ROOT [--world N] --run EXPERIMENT [SETTING...] ... -- OVERRIDES...: every run checked before the
# first starts (python -m harness.preflight); sets `overrides`, the OVERRIDES with the caller's input paths
preflight() {
    local out
    out=$("$PY" -m harness.preflight "$1" --caller "$caller" "${@:2}")
    overrides=()
    [[ -z $out ]] || mapfile -t overrides <<< "$out"
}

# run_module MODULE ARG...: one run of a pipeline, by LAUNCH
run_module() {
    if [[ $LAUNCH == srun ]]; then
        srun --kill-on-bad-exit=1 ${SLURM_CPUS_PER_TASK:+--cpus-per-task="$SLURM_CPUS_PER_TASK"} "$PY" -m "$@"
    else
        "$PY" -m "$@"
    fi
}
