# Sourced by the per-paper and sweep scripts: `where ROOT EXPERIMENT... -- OVERRIDES...` sets `runs`, the folder of
# this command's run directories, `tables`, where make_tables.py writes, from RUNS and TABLES, and `smoke`, the
# smoke run's name (empty at the recipes' size).
# At the recipes' size: RUNS (default runs) and TABLES (default results). Overrides that change what the
# experiments compute (python -m harness.recipe: a smaller model, fewer epochs or steps, other workers, ...)
# make a smoke run: RUNS (default smoke)/smoke-<digest of those settings>, and TABLES (default that folder's
# tables/), so that it never takes a recipe run's directory nor writes the committed results/ unless asked.
where() {
    local size
    size=$("$PY" -m harness.recipe "$@")
    smoke=$size
    if [[ -z $size ]]; then
        runs=${RUNS:-runs}
        tables=${TABLES:-results}
    else
        runs=${RUNS:-smoke}/$size
        tables=${TABLES:-$runs/tables}
        echo "$size: run directories under $runs/, tables in $tables/" >&2
    fi
}
