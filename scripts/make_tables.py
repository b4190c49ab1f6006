"""Regenerate every results table (markdown + CSV) and plot from the run directories.

    python scripts/make_tables.py [--runs runs] [--out results] [--allow-smoke] [--keep DIR]
    make tables [RUNS=runs] [TABLES=results]
    python scripts/make_tables.py --runs results/sweeps/runs --out results/sweeps   # the sweep pages, rebuilt

Every page first says what ran, from the runs' own records (config, summary, meta.json, identity.json): model,
data by content (CIFAR-10, SQuAD v1.1 or ImageNet-1k only where the files are the published ones), workers,
epochs or steps, precision, hardware and commit. Comparison tables (one per ``paper.table``): one row per
optimizer and identity (every setting but the seed and the operational ones, plus what the data is), mean ±
standard deviation over its seeds (each counted once) and their number, bytes per worker, ratio to LAMB,
training time. Published numbers stand beside ours only where every run is its experiment's recipe at the
recipe's size on the published data; otherwise the page gives the reasons and the published numbers apart,
under their source. Sweeps (any pipeline): the beta3 x k grid and heat maps, the H line, the metric against
bytes, each cell's effective compression ratio, beside LAMB's runs of the same identity. Runs with a NaN
summary or no epoch are left out with a message.

The committed ``results/`` take only runs at their recipe's size (a sweep's: apart from what it sweeps): a run
at another size (a smoke run), or one recorded before runs recorded their recipe, is refused there in one line
unless ``--allow-smoke``. See :mod:`harness.tables`.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python scripts/make_tables.py`: the repository's packages are importable
    sys.path.insert(0, str(ROOT))

from harness.records import keep_records, load_runs, size_departures  # noqa: E402
from harness.tables import build_tables  # noqa: E402

RESULTS = ROOT / "results"


def smoke_runs(runs: list[dict]) -> list[tuple[dict, str]]:
    """The runs not at their recipe's size, each with why."""
    out = []
    for run in runs:
        size = size_departures(run)
        if size is None:
            out.append((run, "no record of its recipe (identity.json): its size cannot be told"))
        elif size:
            out.append((run, "; ".join(size)))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="results tables and plots from run directories")
    parser.add_argument("--runs", default="runs", help="folder searched (recursively) for finished runs")
    parser.add_argument("--out", default="results", help="where the tables and plots go")
    parser.add_argument("--allow-smoke", action="store_true",
                        help="write the tables of runs at another size than their recipe's into results/ too")
    parser.add_argument("--keep", metavar="DIR", help="first copy each run's record (config, metadata, identity, "
                        "metrics; no checkpoints) into DIR, and render from there: the pages' runs, kept beside them")
    args = parser.parse_args(argv)
    if args.keep:
        keep_records(Path(args.runs), Path(args.keep))
        args.runs = args.keep
    runs = load_runs(args.runs)
    if not runs:
        print(f"no finished run (metrics.json) under {args.runs}: run scripts/cifar10_resnet110.sh first",
              file=sys.stderr)
        return 1
    out = Path(args.out).resolve()
    smoke = smoke_runs(runs)
    if smoke and (out == RESULTS or RESULTS in out.parents) and not args.allow_smoke:
        run, why = smoke[0]
        print(f"error: --out {args.out} is the repository's results/, and {len(smoke)} of the {len(runs)} runs under "
              f"{args.runs} are not at their recipe's size (e.g. {run['dir']}: {why}); fix: write their tables "
              "elsewhere (make tables TABLES=smoke/tables), or pass --allow-smoke", file=sys.stderr)
        return 2
    for table, files in build_tables(runs, args.out).items():
        print(f"{table}: " + ", ".join(str(f) for f in files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
